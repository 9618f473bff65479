"""kernelside/launch.py: a cluster kernel's connection, from its environment to a file
only the kernel's uid may read, never over something already there."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mcp_forge.kernelside import launch


def test_the_connection_is_written_0400_in_a_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / ".mcp-forge" / "connection.json"
    launch.write_connection('{"key": "k"}', str(path))
    assert path.read_text() == '{"key": "k"}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_nothing_already_there_is_written_over_or_followed(tmp_path: Path, planted: str) -> None:
    path = tmp_path / "connection.json"
    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    if planted == "file":
        path.write_text("theirs")
    else:
        path.symlink_to(target)
    with pytest.raises(FileExistsError):
        launch.write_connection('{"key": "k"}', str(path))
    assert target.read_text() == "theirs"
    if planted == "file":
        assert path.read_text() == "theirs"


def test_without_the_variable_the_kernel_does_not_start_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(launch.ENV, raising=False)
    with pytest.raises(SystemExit) as ended:
        launch.main()
    assert launch.ENV in str(ended.value.code)
