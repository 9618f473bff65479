"""Which URIs a subscription may name (gateway/mcp/subscriptions.py): the gateway's own
two templates, nothing else. Subscriptions on the real gateway: tests/e2e/test_protocol.py."""

from __future__ import annotations

import pytest
from mcp import MCPError

from mcp_forge.gateway.mcp.subscriptions import _parse


@pytest.mark.parametrize(
    ("uri", "want"),
    [
        ("forge://sessions/s1/notebook", ("s1", None)),
        ("forge://sessions/s1/files/a.txt", ("s1", "a.txt")),
        ("forge://sessions/s1/files/dir/b c.csv", ("s1", "dir/b c.csv")),
        # a path is checked where it is read (in /workspace, no links): kept as sent here
        ("forge://sessions/s1/files/../x", ("s1", "../x")),
    ],
)
def test_the_gateways_resources_are_parsed(uri: str, want: tuple[str, str | None]) -> None:
    assert _parse(uri) == want


@pytest.mark.parametrize(
    "uri",
    [
        "test://watched-resource",
        "forge://sessions/s1",
        "forge://sessions/s1/notebook/extra",
        "forge://sessions//files/a",
        "forge://sessions/s1/files/",
        "file:///etc/passwd",
        "forge://sessions/" + "x" * 300 + "/notebook",
    ],
)
def test_anything_else_is_refused_naming_it(uri: str) -> None:
    with pytest.raises(MCPError) as refused:
        _parse(uri)
    assert refused.value.error.code == -32602
    assert "not a resource of this gateway" in refused.value.error.message
