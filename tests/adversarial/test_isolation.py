"""Multi-tenant isolation in code mode: what one session leaves in an upstream MCP server
is not read by another unless they share the server's process by configuration
(`"isolation"` in --mcp-config: `shared`, `client` — the default for stdio servers — or
`session`; docs/bridge.md). The upstream is tests/mcp_servers/edge_server.py, whose
`write_note` keeps one note per process and returns the one it replaced, and whose `pid`
tells processes apart.

Everything runs through the real gateway (stdio, one client) into real kernels in real
Podman pods. Isolation between two clients is in tests/integration/test_code_mode.py
(a stdio gateway has one client).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from mcp_servers.config import upstream_config

from .conftest import gateway, run, text

pytestmark = pytest.mark.podman

SERVERS = {"mine": "session", "ours": "shared", "theirs": None}  # None: the default


def config_file(directory: Path) -> Path:
    """The edge server three times, isolated per session, shared, and by default."""
    entry = upstream_config(directory)["mcpServers"]["edge"]
    servers = {
        name: entry if isolation is None else {**entry, "isolation": isolation}
        for name, isolation in SERVERS.items()
    }
    path = directory / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


async def session(c: Client) -> str:
    made = await c.call_tool(
        "create_session",
        {
            "variant": "minimal",
            "memory": "512Mi",
            "mcp_servers": [{"name": name} for name in SERVERS],
        },
    )
    assert not made.is_error, text(made)
    sid: str = made.structured_content["session_id"]
    return sid


async def out(c: Client, sid: str, code: str) -> Any:
    r = await run(
        c, "import json, mcp_tools\n" + code + "\nprint(json.dumps(_out))", session_id=sid
    )
    assert r["status"] == "ok", r["_text"]
    return json.loads(r["stdout"].strip().splitlines()[-1])


WRITE_NOTES = (
    "_out = {{s: [getattr(mcp_tools, s).write_note(text={note!r} + s)['previous'],\n"
    "             getattr(mcp_tools, s).pid()['pid']] for s in {servers!r}}}"
)


async def test_a_note_left_upstream_by_one_session_is_not_read_by_another(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: session B reads what session A left in an upstream server's memory (issue
    10: a note written by one session was read by another). With `session` isolation B
    has a process of its own and finds no note; with `shared` it reads A's note, as
    configured; with the default (`client`) both sessions of this one client share."""
    async with gateway(state_dir, args=("--mcp-config", str(config_file(tmp_path)))) as c:
        a, b = await session(c), await session(c)
        wrote = await out(c, a, WRITE_NOTES.format(note="secret of A in ", servers=list(SERVERS)))
        read = await out(c, b, WRITE_NOTES.format(note="B in ", servers=list(SERVERS)))
    assert all(previous is None for previous, _ in wrote.values()), wrote
    assert read["mine"][0] is None, read
    assert read["mine"][1] != wrote["mine"][1], "one process for two isolated sessions"
    assert read["ours"] == ["secret of A in ours", wrote["ours"][1]], read
    assert read["theirs"] == ["secret of A in theirs", wrote["theirs"][1]], read


async def test_isolated_upstreams_are_bounded_and_the_limit_says_so(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: sessions started one after another to make the gateway start an upstream
    process each. With --mcp-processes-max 1 the second session gets none: its kernel
    sees the server with no tools, and the error names the limit; the first session's
    server still works."""
    args = ("--mcp-config", str(config_file(tmp_path)), "--mcp-processes-max", "1")
    async with gateway(state_dir, args=args) as c:
        a, b = await session(c), await session(c)
        first = await out(c, a, "_out = mcp_tools.mine.echo(text='a')")
        second = await out(
            c,
            b,
            "try:\n"
            "    _out = ['called', mcp_tools.mine.echo(text='b')]\n"
            "except AttributeError as e:\n"
            "    _out = ['refused', str(e)]\n"
            "_out.append(mcp_tools.servers()['mine'])",
        )
        still = await out(c, a, "_out = mcp_tools.mine.echo(text='again')")
    assert first == {"text": "a"}
    assert second[0] == "refused" and "its limit" in second[1], second
    assert "--mcp-processes-max" in second[1] and second[2] == [], second
    assert still == {"text": "again"}


TRY_MINE = (
    "try:\n"
    "    _out = ['called', mcp_tools.mine.pid()['pid']]\n"
    "except AttributeError as e:\n"
    "    _out = ['refused', str(e)]"
)


async def test_one_client_holds_few_isolated_upstreams_and_a_closed_session_frees_its_own(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: one client opens sessions to make the gateway start an upstream process
    for each, locking other clients out of the server. With a bound of 2 per client
    (the gateway's own stays 32) the client's second session gets no `mine` (its first
    holds `mine` and the client's `theirs`), and the error names the per-client limit;
    once the first session is closed, its process is gone at once (not a minute
    later): the client's next session gets one."""
    args = ("--mcp-config", str(config_file(tmp_path)))
    env = {"MCPFORGE_MCP_PROCESSES_PER_CLIENT_MAX": "2"}
    async with gateway(state_dir, args=args, env=env) as c:
        a = await session(c)
        first = await out(c, a, TRY_MINE)
        b = await session(c)
        second = await out(c, b, TRY_MINE)
        closed = await c.call_tool("close_session", {"session_id": a})
        assert not closed.is_error, text(closed)
        again = await out(c, await session(c), TRY_MINE)
    assert first[0] == "called", first
    assert second[0] == "refused" and "limit per client" in second[1], second
    assert again[0] == "called" and again[1] != first[1], again


async def test_a_session_cannot_reach_a_server_it_did_not_name(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: a session that named only `ours` sends a call frame by hand for `mine`, a
    server another session uses. The gateway refuses it (denied: the session may not use
    it); nothing reached the other session's process."""
    async with gateway(state_dir, args=("--mcp-config", str(config_file(tmp_path)))) as c:
        owner = await session(c)
        before = await out(c, owner, "_out = mcp_tools.mine.count()['calls']")
        made = await c.call_tool(
            "create_session",
            {"variant": "minimal", "memory": "512Mi", "mcp_servers": [{"name": "ours"}]},
        )
        assert not made.is_error, text(made)
        other = made.structured_content["session_id"]
        got = await out(
            c,
            other,
            "B = mcp_tools.__mcp_forge_bridge__\n"
            "tool = B.catalog['ours'].tools['write_note']\n"
            "tool.server = 'mine'\n"
            "try:\n"
            "    _out = ['called', B.call(tool, {'text': 'planted'})]\n"
            "except PermissionError as e:\n"
            "    _out = ['denied', str(e)]",
        )
        after = await out(c, owner, "_out = mcp_tools.mine.count()['calls']")
    assert got[0] == "denied" and "'mine'" in got[1], got
    assert after == before + 1, (before, after)  # only the owner's own second count
