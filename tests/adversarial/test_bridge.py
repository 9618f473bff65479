"""Code mode's bridge (docs/bridge.md): kernel code that speaks to the gateway's bridge
as an attacker would. The kernel gets at the raw connection (`mcp_tools` keeps it in
`__mcp_forge_bridge__`) and sends what an honest kernel never does: frames too large,
cut in half, not JSON, nested deep, of unknown types, replies for calls it never made,
floods of calls and cancels, arguments the tool's schema does not allow. The gateway
closes a connection that breaks the framing, dials again, keeps its limits and its
policy, and never lets a kernel steer it to another socket.

Everything runs through the real gateway (stdio, --mcp-config with the edge server of
tests/mcp_servers) into real kernels in real Podman pods.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from mcp_servers.config import upstream_config
from support import cancelled_call

from .conftest import gateway, run, text

pytestmark = pytest.mark.podman

CALL_DEADLINE = 120.0

# Kernel-side helpers, run before each attack: `B` is the kernel's bridge, `raw` puts
# bytes on the gateway connection as they are (through its writer thread, so frames are
# never interleaved), `new_connection` waits for the gateway to have closed `old` and
# dialed again (an event: the bridge's condition variable).
HELPERS = """
import json, struct, time, mcp_tools
B = mcp_tools.__mcp_forge_bridge__
def raw(data):
    B.conn.outbox.put(data)
def frame(obj):
    payload = json.dumps(obj).encode()
    return struct.pack('>I', len(payload)) + payload
def new_connection(old, seconds):
    with B.changed:
        return B.changed.wait_for(
            lambda: old.closed is not None and B.conn is not None and B.conn is not old
            and B.conn.ready, seconds)
"""


def config_file(directory: Path, **edge: Any) -> Path:
    """An --mcp-config with the edge server (and `edge` merged into its entry)."""
    entry = upstream_config(directory)["mcpServers"]["edge"]
    path = directory / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"edge": {**entry, **edge}}}))
    return path


@asynccontextmanager
async def code_gateway(state_dir: Path, tmp_path: Path, *args: str) -> AsyncIterator[Client]:
    async with gateway(state_dir, args=("--mcp-config", str(config_file(tmp_path)), *args)) as c:
        yield c


async def session(c: Client, **policy: Any) -> str:
    made = await c.call_tool(
        "create_session",
        {"variant": "minimal", "memory": "512Mi", "mcp_servers": [{"name": "edge", **policy}]},
    )
    assert not made.is_error, text(made)
    sid: str = made.structured_content["session_id"]
    return sid


async def out(c: Client, sid: str, code: str, *, timeout: float = 120) -> Any:
    """Run HELPERS then `code` in the session; the JSON of what `code` left in `_out`."""
    r = await asyncio.wait_for(
        run(
            c,
            HELPERS + code + "\nprint('\\n' + json.dumps(_out, default=repr))",
            session_id=sid,
            timeout=timeout,
        ),
        CALL_DEADLINE + timeout,
    )
    assert r["status"] == "ok", r["_text"]
    return json.loads(r["stdout"].strip().splitlines()[-1])


async def still_serves(c: Client, sid: str) -> None:
    """The session's next tool call works: the bridge recovered."""
    got = await out(c, sid, "_out = mcp_tools.edge.echo(text='after')")
    assert got == {"text": "after"}


async def test_an_oversized_frame_closes_that_connection_and_the_next_call_works(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: a frame header announcing 2 MiB (over the 1 MiB limit). The gateway refuses
    it, closes that connection (the kernel sees it closed), dials again, and the next call
    is served (issue 10: after a refused frame the next call failed)."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "old = B.conn\n"
            "raw(struct.pack('>I', 2 << 20) + b'x' * 64)\n"
            "back = new_connection(old, 30)\n"
            "_out = {'back': back, 'why': old.closed,\n"
            "        'next': mcp_tools.edge.echo(text='next')}",
        )
        assert got["back"] is True, got
        # The old connection ended: the kernel saw it closed, or, if the gateway's new
        # dial arrived first, replaced (a race between two threads; either is the refusal).
        ended = ("the MCP bridge connection was closed", "the MCP bridge connection was replaced")
        assert got["why"].startswith(ended), got
        assert got["next"] == {"text": "next"}


async def test_a_half_sent_frame_is_cut_off_within_the_frame_deadline(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: a header announcing 100 bytes, then 4 of them, then silence: it held the
    connection (and every later call on it) forever. The gateway closes it once the frame
    deadline passes and dials again; the kernel's next call works."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "old = B.conn\n"
            "t0 = time.monotonic()\n"
            "raw(struct.pack('>I', 100) + b'{\"v\"')\n"
            "back = new_connection(old, 60)\n"
            "_out = {'back': back, 'seconds': time.monotonic() - t0,\n"
            "        'next': mcp_tools.edge.echo(text='next')}",
        )
        assert got["back"] is True, got
        assert got["next"] == {"text": "next"}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param("struct.pack('>I', 0)", id="zero-length"),
        pytest.param("struct.pack('>I', 9) + b'{not json'", id="invalid-json"),
        pytest.param("struct.pack('>I', 6) + b'\\xff\\xfe{}{}'", id="invalid-utf8"),
        pytest.param(
            "struct.pack('>I', 400_000) + b'[' * 200_000 + b']' * 200_000", id="deep-json"
        ),
        pytest.param("frame([1, 2, 3])", id="an-array"),
        pytest.param("frame({'v': 2, 'type': 'call', 'id': 1})", id="version-2"),
    ],
)
async def test_a_broken_frame_closes_the_connection_and_the_gateway_dials_again(
    state_dir: Path, tmp_path: Path, payload: str
) -> None:
    """Attack: frames of bad lengths, bad JSON, JSON nested 200,000 deep (a RecursionError
    in a parser that does not bound it), not an object, a future version. Each closes the
    connection it came on; the gateway dials again and serves the next call."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "old = B.conn\n"
            f"raw({payload})\n"
            "back = new_connection(old, 30)\n"
            "_out = {'back': back, 'next': mcp_tools.edge.echo(text='next')}",
        )
        assert got == {"back": True, "next": {"text": "next"}}, got


async def test_unknown_frames_and_forged_replies_are_ignored(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: frames of types the gateway does not serve (a hello and results sent to the
    gateway, replies for call ids the kernel never made, a cancel of nothing, a type that
    does not exist, ids that are not positive integers). They are valid frames: the
    gateway ignores them, keeps the connection, and upstream nothing was called."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "before = mcp_tools.edge.count()['calls']\n"
            "old = B.conn\n"
            "for f in [{'type': 'hello', 'servers': {}},\n"
            "          {'type': 'result', 'id': 987654, 'ok': True, 'structured': {'x': 1}},\n"
            "          {'type': 'result', 'id': 1, 'ok': False, 'error': {'kind': 'denied'}},\n"
            "          {'type': 'cancel', 'id': 424242},\n"
            "          {'type': 'no-such-type', 'id': 5},\n"
            "          {'type': 'call', 'id': -1, 'server': 'edge', 'tool': 'crash'},\n"
            "          {'type': 'call', 'id': True, 'server': 'edge', 'tool': 'crash'},\n"
            "          {'type': 'call', 'id': '7', 'server': 'edge', 'tool': 'crash'},\n"
            "          {'type': 'call', 'id': 1.5, 'server': 'edge', 'tool': 'crash'}]:\n"
            "    raw(frame({'v': 1, **f}))\n"
            "after = mcp_tools.edge.count()['calls']\n"
            "_out = {'same': B.conn is old and old.closed is None, 'calls': after - before}",
        )
        # One call between the two counts: the second count itself. crash was never called.
        assert got == {"same": True, "calls": 1}, got


async def test_a_flood_of_calls_over_the_in_flight_limit_is_refused_at_once(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: 2,000 concurrent calls of a slow tool from one cell: the gateway held a task
    for each (only upstream calls were bounded). Calls over the session's in-flight limit
    are refused at once with a message saying so; the upstream never sees more than its
    concurrency; cancelling the rest leaves the session serving."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "import asyncio\n"
            "async def flood():\n"
            "    tasks = [asyncio.ensure_future(mcp_tools.edge.slow.aio(seconds=120))\n"
            "             for _ in range(2000)]\n"
            "    await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)\n"
            "    refused = [t for t in tasks if t.done()]\n"
            "    deadline = time.monotonic() + 60\n"
            "    while len(refused) < 1900 and time.monotonic() < deadline:\n"
            "        await asyncio.wait([t for t in tasks if not t.done()], timeout=1,\n"
            "                           return_when=asyncio.FIRST_COMPLETED)\n"
            "        refused = [t for t in tasks if t.done()]\n"
            "    errors = sorted({str(t.exception())[:80] for t in refused})\n"
            "    for t in tasks:\n"
            "        t.cancel()\n"
            "    await asyncio.gather(*tasks, return_exceptions=True)\n"
            "    return len(refused), errors\n"
            "n, errors = await flood()\n"
            "_out = {'refused': n, 'errors': errors}",
            timeout=240,
        )
        assert got["refused"] >= 1900, got
        assert all("in flight" in e for e in got["errors"]), got
        await still_serves(c, sid)


async def test_a_cancel_storm_leaves_the_session_serving(state_dir: Path, tmp_path: Path) -> None:
    """Attack: 20 slow calls in flight, each cancelled, then 20,000 cancels of ids never
    made. The gateway cancels the real ones upstream (the server counts them), ignores
    the rest, and the next call is served."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "import asyncio\n"
            "async def storm():\n"
            "    tasks = [asyncio.ensure_future(mcp_tools.edge.slow.aio(seconds=120))\n"
            "             for _ in range(20)]\n"
            "    await asyncio.sleep(0)\n"
            "    for t in tasks:\n"
            "        t.cancel()\n"
            "    await asyncio.gather(*tasks, return_exceptions=True)\n"
            "await storm()\n"
            "raw(b''.join(frame({'v': 1, 'type': 'cancel', 'id': 10**6 + i})\n"
            "             for i in range(20000)))\n"
            "_out = {'echo': mcp_tools.edge.echo(text='alive'),\n"
            "        'same': B.conn is not None and B.conn.closed is None}",
        )
        assert got == {"echo": {"text": "alive"}, "same": True}, got


async def test_a_tool_the_policy_refuses_is_refused_even_in_a_forged_call(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: a session denied `crash` calls it anyway, by the function mcp_tools offers
    (it says why) and by a call frame written by hand. Both are refused by the gateway;
    the upstream server never received the call (its counter) and is still up."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c, deny=["crash"])
        got = await out(
            c,
            sid,
            "before = mcp_tools.edge.count()['calls']\n"
            "try:\n"
            "    mcp_tools.edge.crash()\n"
            "    by_function = 'called'\n"
            "except PermissionError as e:\n"
            "    by_function = str(e)\n"
            "tool = B.catalog['edge'].tools['crash']\n"
            "try:\n"
            "    B.call(tool, {})\n"
            "    by_frame = 'called'\n"
            "except PermissionError as e:\n"
            "    by_frame = str(e)\n"
            "_out = {'f': by_function, 'raw': by_frame,\n"
            "        'calls': mcp_tools.edge.count()['calls'] - before}",
        )
        assert "denied by the session's policy" in got["f"], got
        assert "denied by the session's policy" in got["raw"], got
        assert got["calls"] == 1, got  # the second count only


async def test_arguments_outside_the_tools_schema_never_reach_the_upstream(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: kernel code sends `echo` an extra field, a wrong type, and a missing required
    argument, past mcp_tools' own signature checks (by the bridge's call with hand-made
    arguments). The gateway validates arguments against the tool's input schema: each is
    refused as invalid (ValueError) naming the problem, and the upstream server's call
    counter shows none of them arrived."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "before = mcp_tools.edge.count()['calls']\n"
            "tool = B.catalog['edge'].tools['echo']\n"
            "seen = []\n"
            "for args in [{'text': 'hi', 'smuggled': {'path': '/etc/shadow'}},\n"
            "             {'text': 5}, {}]:\n"
            "    try:\n"
            "        seen.append(['called', B.call(tool, args)])\n"
            "    except ValueError as e:\n"
            "        seen.append(['invalid', str(e)])\n"
            "_out = {'seen': seen, 'calls': mcp_tools.edge.count()['calls'] - before,\n"
            "        'ok': mcp_tools.edge.echo(text='fine')}",
        )
        kinds = [k for k, _ in got["seen"]]
        assert kinds == ["invalid", "invalid", "invalid"], got
        assert "smuggled" in got["seen"][0][1], got
        assert got["calls"] == 1, got  # the second count only
        assert got["ok"] == {"text": "fine"}


async def test_the_rate_limit_outlives_a_restart_and_a_cancelled_call(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: a session limited to 3 calls a minute spends them, then gets a fresh
    count: by a restart of its kernel, or by a cancelled execute_code (both made the
    gateway build a new bridge with a new meter). The limit is the session's: both
    times the next call is still refused."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c, callsPerMinute=3)
        spend = (
            "results = []\n"
            "for i in range(4):\n"
            "    try:\n"
            "        results.append(mcp_tools.edge.echo(text=str(i))['text'])\n"
            "    except mcp_tools.ToolError as e:\n"
            "        results.append(str(e))\n"
            "_out = results"
        )
        got = await out(c, sid, spend)
        assert got[:3] == ["0", "1", "2"] and "rate limit of 3" in got[3], got
        # A cancelled execute_code: the gateway drops its kernel connection (and bridge).
        await cancelled_call(c, sid)
        again = await out(c, sid, spend)
        assert all("rate limit of 3" in r for r in again), again
        restarted = await c.call_tool("restart_kernel", {"session_id": sid})
        assert not restarted.is_error, text(restarted)
        after = await out(c, sid, spend)
        assert all("rate limit of 3" in r for r in after), after


async def test_a_kernel_that_connects_to_its_own_bridge_does_not_keep_it(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: kernel code connects to its own bridge socket, so the bridge takes that
    connection in place of the gateway's, and feeds itself a forged hello. The gateway
    sees its connection replaced, dials again (replacing the impostor: its socket is
    closed), and the next call goes to the real upstream server again."""
    async with code_gateway(state_dir, tmp_path) as c:
        sid = await session(c)
        got = await out(
            c,
            sid,
            "import socket\n"
            "old = B.conn\n"
            "me = socket.socket(socket.AF_UNIX)\n"
            "me.connect('/run/mcp-forge/bridge/bridge.sock')\n"
            "me.settimeout(30)\n"
            "try:\n"
            "    me.sendall(frame({'v': 1, 'type': 'hello', 'servers': {'fake': {'tools': []}}}))\n"
            "    leftover = me.recv(1 << 16)\n"
            "except TimeoutError:\n"
            "    leftover = None\n"
            "except (BrokenPipeError, ConnectionResetError):\n"
            "    leftover = b''  # closed even before its hello was sent: the same outcome\n"
            "me.close()\n"
            "with B.changed:\n"
            "    back = B.changed.wait_for(lambda: B.conn is not None and B.conn.ready\n"
            "                              and 'edge' in B.catalog, 30)\n"
            "_out = {'impostor_closed': leftover == b'', 'back': back,\n"
            "        'next': mcp_tools.edge.echo(text='real')}",
        )
        assert got == {"impostor_closed": True, "back": True, "next": {"text": "real"}}, got


class HostListener:
    """A Unix socket on the host, listening; it accepts nothing, so any connect() made to
    it waits in its backlog, to be counted at the end."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "victim.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o777)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def connections(self) -> int:
        """How many connections were made to it (each taken off the backlog, closed)."""
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


PLANT = (
    "import os\n"
    "p = '/run/mcp-forge/bridge/bridge.sock'\n"
    "os.unlink(p)\n"
    "os.symlink({target!r}, p)\n"
    "_out = os.readlink(p)"
)


async def test_a_bridge_socket_swapped_for_a_symlink_is_never_followed(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: after the run directory is sealed the kernel still owns the bridge directory;
    it replaces bridge.sock with a symlink to a host Unix socket, then gets the gateway to
    dial again: a cancelled execute_code drops the connection and the next call dials
    (and, a second time, a broken frame makes the gateway dial at once). The gateway
    (root) opens the path without following links: the host listener never sees a
    connection, and the gateway says the bridge is not a socket."""
    victim_dir = Path(tempfile.mkdtemp(prefix="mfv-", dir="/tmp"))
    listener = HostListener(victim_dir)
    target = str(listener.path)
    try:
        async with code_gateway(state_dir, tmp_path) as c:
            sid = await session(c)
            assert await out(c, sid, PLANT.format(target=target)) == target
            await cancelled_call(c, sid)
            after = await asyncio.wait_for(
                c.call_tool("execute_code", {"code": "1 + 1", "session_id": sid}),
                CALL_DEADLINE,
            )
            # Every dial happened before the gateway answered: a connect() is in the backlog.
            assert listener.connections() == 0, "the gateway connected to a host socket"
            said = text(after)
            assert after.is_error and "is not a socket" in said, said
            # A restart replaces the link with the kernel's socket: code mode works again.
            restarted = await c.call_tool("restart_kernel", {"session_id": sid})
            assert not restarted.is_error, text(restarted)
            await still_serves(c, sid)
            got = await out(
                c,
                sid,
                PLANT.format(target=target) + "\n"
                "old = B.conn\n"
                "raw(struct.pack('>I', 2 << 20))  # the gateway closes, then dials again\n"
                "with B.changed:\n"
                "    B.changed.wait_for(lambda: old.closed is not None, 30)\n"
                "_out = {'closed': old.closed is not None, 'link': _out}",
            )
            assert got == {"closed": True, "link": target}, got
            # The redial is refused the same way (the next call dials no more: closed).
            refused = await asyncio.wait_for(
                c.call_tool("execute_code", {"code": "2 + 2", "session_id": sid}),
                CALL_DEADLINE,
            )
            assert listener.connections() == 0, "the gateway connected to a host socket"
            assert refused.structured_content is not None, text(refused)
    finally:
        listener.close()
        shutil.rmtree(victim_dir)
