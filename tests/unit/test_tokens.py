"""Bearer tokens: one client per token, never a weak or exposed one."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_forge.errors import InvalidRequest
from mcp_forge.gateway.mcp import tokens


def test_a_tokens_file_names_one_client_per_token(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# clients\nalice aaaaaaaaaaaaaaaaaaaa\n\nbob bbbbbbbbbbbbbbbbbbbb\n")
    loaded, source = tokens.load(tmp_path, None, str(f))
    assert loaded == {"a" * 20: "alice", "b" * 20: "bob"}
    assert source == str(f)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("alice short\n", "16+"),
        ("alice\n", "NAME TOKEN"),
        ("a xxxxxxxxxxxxxxxxxxxx\nb xxxxxxxxxxxxxxxxxxxx\n", "already given to a"),
        ("# nobody\n", "names no client"),
    ],
)
def test_a_bad_tokens_file_is_refused_with_the_line(
    tmp_path: Path, content: str, words: str
) -> None:
    f = tmp_path / "tokens"
    f.write_text(content)
    with pytest.raises(InvalidRequest, match=words):
        tokens.load(tmp_path, None, str(f))


def test_a_short_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="at least 16"):
        tokens.load(tmp_path, "short", None)


def test_a_generated_token_is_kept_private_and_reused(tmp_path: Path) -> None:
    first, source = tokens.load(tmp_path, None, None)
    path = tmp_path / "gateway-token"
    assert source == str(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    (token,) = first
    assert len(token) >= 32
    assert tokens.load(tmp_path, None, None)[0] == first


def test_a_stored_token_others_can_read_is_refused(tmp_path: Path) -> None:
    tokens.load(tmp_path, None, None)
    (tmp_path / "gateway-token").chmod(0o644)
    with pytest.raises(InvalidRequest, match="chmod 600"):
        tokens.load(tmp_path, None, None)
