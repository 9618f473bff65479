"""Code mode's bridge, gateway side, against the real kernel module and a real server.

The kernel is the stand-in process of test_mcp_tools.py (the bridge's program executed in
a plain `python -I -S`, cells on its stdin); the gateway side is
`mcp_forge.gateway.codemode.bridge.Bridge`; the upstream is tests/mcp_servers/edge_server.py
through the SDK client. No Podman: the pod-based flow is tests/integration/test_code_mode.py.
Blocking waits on the stand-in run in threads; waits have deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_mcp_tools import Kernel

from mcp_forge.api.connection import Address
from mcp_forge.errors import UpstreamError
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.gateway.codemode.policy import ServerPolicy
from mcp_forge.gateway.codemode.upstream import Lease, Upstream, UpstreamPool, parse_config
from mcp_servers.config import upstream_config

pytestmark = pytest.mark.servers  # not the fast loop (docs/testing.md)

DEADLINE = 20.0


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Upstream]:
    upstream = Upstream(parse_config(upstream_config(tmp_path))["edge"])
    yield upstream
    await upstream.close()


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(tmp_path, tmp_path / "bridge" / "bridge.sock")
    yield k
    k.close()


async def connect(kernel: Kernel, edge: Upstream, policy: ServerPolicy) -> Bridge:
    bridge = Bridge("s1", {"edge": edge}, {"edge": policy}, call_timeout=DEADLINE)
    await bridge.open(
        Address("unix", path=str(kernel.socket_path), peer_check=lambda pid: pid == kernel.proc.pid)
    )
    assert await run(kernel, "import mcp_tools\nresult = mcp_tools.wait_connected(10)") is True
    return bridge


async def run(kernel: Kernel, code: str) -> Any:
    return await asyncio.to_thread(kernel.run, code)


async def fails(kernel: Kernel, code: str) -> dict[str, Any]:
    return await asyncio.to_thread(kernel.fails, code)


async def test_the_budget_is_per_execution(kernel: Kernel, edge: Upstream) -> None:
    bridge = await connect(kernel, edge, ServerPolicy("edge", calls_per_execution=3))
    try:
        got = await run(kernel, "result = [mcp_tools.edge.add(a=i)['sum'] for i in range(3)]")
        assert got == [2, 3, 4]
        spent = await fails(kernel, "mcp_tools.edge.add(a=1)")
        assert spent["type"] == "ToolError" and "budget of 3 calls" in spent["message"]
        bridge.new_execution()
        assert await run(kernel, "result = mcp_tools.edge.add(a=1)") == {"sum": 3}
    finally:
        await bridge.close()


async def test_the_rate_limit_holds(kernel: Kernel, edge: Upstream) -> None:
    bridge = await connect(kernel, edge, ServerPolicy("edge", calls_per_minute=2))
    try:
        await run(kernel, "mcp_tools.edge.echo(text='1'); mcp_tools.edge.echo(text='2')")
        limited = await fails(kernel, "mcp_tools.edge.echo(text='3')")
        assert "rate limit of 2 calls a minute" in limited["message"]
    finally:
        await bridge.close()


async def test_an_oversized_request_is_refused_and_the_bridge_still_works(
    kernel: Kernel, edge: Upstream
) -> None:
    bridge = await connect(kernel, edge, ServerPolicy("edge"))
    try:
        big = await fails(kernel, "mcp_tools.edge.echo(text='x' * (2 << 20))")
        assert big["type"] == "ValueError", big
        assert await run(kernel, "result = mcp_tools.edge.echo(text='after')") == {"text": "after"}
        assert bridge.started == 1, "the oversized request never reached the gateway"
    finally:
        await bridge.close()


async def test_a_frame_the_gateway_refuses_closes_that_connection_and_it_dials_again(
    kernel: Kernel, edge: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mcp_forge.gateway.codemode.bridge")
    bridge = await connect(kernel, edge, ServerPolicy("edge"))
    try:
        got = await run(
            kernel,
            """
            import struct
            B = mcp_tools.__mcp_forge_bridge__
            old = B.conn
            old.outbox.put(struct.pack(">I", 5) + b"{nope")  # as it is, through its writer
            with B.changed:
                back = B.changed.wait_for(
                    lambda: old.closed is not None and B.conn not in (None, old) and B.conn.ready,
                    10,
                )
            result = {"back": back, "why": old.closed}
            """,
        )
        assert got["back"] is True, got
        # The old connection ends either way the kernel sees first: its EOF ("closed"),
        # or the gateway's new dial taking its place ("replaced"); both are the recovery.
        assert got["why"].startswith(
            ("the MCP bridge connection was closed", "the MCP bridge connection was replaced")
        ), got
        assert await run(kernel, "result = mcp_tools.edge.echo(text='next')") == {"text": "next"}
        closed = [
            r.getMessage() for r in caplog.records if r.name == "mcp_forge.gateway.codemode.bridge"
        ]
        assert "bridge of s1 closed: a frame that is not JSON: Expecting" in "\n".join(closed)
    finally:
        await bridge.close()


async def test_an_upstream_that_dies_is_an_error_then_comes_back(
    kernel: Kernel, edge: Upstream
) -> None:
    bridge = await connect(kernel, edge, ServerPolicy("edge"))
    try:
        died = await fails(kernel, "mcp_tools.edge.crash()")
        assert died["type"] == "ToolError" and "edge.crash failed" in died["message"], died
        # The next call starts the server again: a fresh process has served one call.
        assert (await run(kernel, "result = mcp_tools.edge.count()"))["calls"] == 1
    finally:
        await bridge.close()


async def test_an_interrupt_cancels_the_call_in_flight(
    kernel: Kernel, edge: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mcp_forge.gateway.codemode.bridge")
    bridge = await connect(kernel, edge, ServerPolicy("edge"))
    try:
        started = bridge.call_started
        await asyncio.to_thread(kernel.start, "mcp_tools.edge.slow(seconds=60)")
        await asyncio.wait_for(started.wait(), DEADLINE)
        kernel.proc.send_signal(signal.SIGINT)
        interrupted = await asyncio.to_thread(kernel.reply)
        assert interrupted["type"] == "KeyboardInterrupt", interrupted
        assert await run(kernel, "result = mcp_tools.edge.echo(text='next')") == {"text": "next"}
        lines = [r.getMessage() for r in caplog.records if "call=edge.slow" in r.getMessage()]
        assert lines and "status=cancelled" in lines[0], lines
    finally:
        await bridge.close()


async def test_every_call_is_logged_and_denials_name_the_rule(
    kernel: Kernel, edge: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mcp_forge.gateway.codemode.bridge")
    bridge = await connect(kernel, edge, ServerPolicy("edge", deny=("add",)))
    try:
        denied = await fails(kernel, "mcp_tools.edge.add(a=1)")
        assert denied["type"] == "PermissionError" and "denied" in denied["message"]
        assert await run(kernel, "result = mcp_tools.edge.echo(text='hi')") == {"text": "hi"}
        logged = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("bridge call")
        ]
        assert any("status=denied" in m and "call=edge.add" in m for m in logged), logged
        assert any("session=s1 status=ok" in m and "call=edge.echo" in m for m in logged), logged
    finally:
        await bridge.close()


async def test_a_bridge_served_by_another_process_is_refused(
    kernel: Kernel, edge: Upstream
) -> None:
    """Locally the socket's peer must be the session's kernel (SO_PEERCRED): a socket
    swapped for another session's is not believed."""
    bridge = Bridge("s1", {"edge": edge}, {"edge": ServerPolicy("edge")})
    address = Address("unix", path=str(kernel.socket_path), peer_check=lambda pid: False)
    with pytest.raises(ConnectionError, match="outside its kernel's container"):
        await bridge.open(address)
    assert not bridge.connected


async def test_an_http_upstream_gets_its_headers_and_large_results() -> None:
    from mcp_servers.config import edge_over_http

    async with edge_over_http() as entry:
        good = Upstream(parse_config({"mcpServers": {"web": entry}})["web"])
        bad_entry = {"url": entry["url"], "headers": {"Authorization": "Bearer wrong"}}
        bad = Upstream(parse_config({"mcpServers": {"web": bad_entry}})["web"])
        try:
            result = await good.call("echo", {"text": "over http"}, timeout=DEADLINE)
            assert result.structured_content == {"text": "over http"}
            # Over the SDK's default 1 MiB per SSE event, under the bridge's 16 MiB.
            huge = await good.call("huge", {"size": 3 << 20}, timeout=DEADLINE)
            assert sum(len(getattr(c, "text", "")) for c in huge.content) == 3 << 20
            with pytest.raises(UpstreamError, match="unavailable"):
                await bad.call("echo", {"text": "x"}, timeout=DEADLINE)
        finally:
            await good.close()
            await bad.close()


def isolated_configs(tmp_path: Path) -> dict[str, Any]:
    """The edge server three times: isolated per session, per client (the default for a
    stdio server), and shared."""
    entry = upstream_config(tmp_path)["mcpServers"]["edge"]
    return parse_config(
        {
            "mcpServers": {
                "per_session": {**entry, "isolation": "session"},
                "per_client": entry,
                "shared": {**entry, "isolation": "shared"},
            }
        }
    )


async def note(lease: Lease, server: str, text: str) -> str | None:
    """Write the server's note; the note it replaced (another session's, if shared)."""
    result = await lease.upstreams[server].call("write_note", {"text": text}, timeout=DEADLINE)
    assert result.structured_content is not None
    previous: str | None = result.structured_content["previous"]
    return previous


async def test_isolated_upstreams_keep_notes_apart_and_shared_ones_do_not(tmp_path: Path) -> None:
    """A note written through one session is read by another only where they share the
    server's process: always with `shared`, within one client with `client`, never with
    `session`."""
    pool = UpstreamPool(isolated_configs(tmp_path), linger=0)
    names = ["per_session", "per_client", "shared"]
    try:
        a = pool.lease(names, session="default/a/1", client="stdio:me")
        b = pool.lease(names, session="default/b/2", client="stdio:me")
        c = pool.lease(names, session="default/c/3", client="http:someone-else")
        for server in names:
            assert await note(a, server, f"a wrote to {server}") is None
        assert await note(b, "per_session", "b") is None
        assert await note(b, "per_client", "b") == "a wrote to per_client"  # same client
        assert await note(b, "shared", "b") == "a wrote to shared"
        assert await note(c, "per_session", "c") is None
        assert await note(c, "per_client", "c") is None  # another client
        assert await note(c, "shared", "c") == "b"
        assert pool.isolated == 3 + 2  # a process per session, and per client
        assert a.upstreams["shared"] is b.upstreams["shared"] is c.upstreams["shared"]
    finally:
        await pool.close()


async def wait_exit(pid: int, seconds: float) -> bool:
    """Whether process `pid` ends within `seconds` (its pidfd becomes readable)."""
    fd = os.pidfd_open(pid)
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, ended.set)
    try:
        await asyncio.wait_for(ended.wait(), seconds)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_an_isolated_upstream_ends_with_its_session_and_their_number_is_bounded(
    tmp_path: Path,
) -> None:
    pool = UpstreamPool(isolated_configs(tmp_path), processes_max=1, linger=0)
    try:
        a = pool.lease(["per_session"], session="default/a/1", client=None)
        result = await a.upstreams["per_session"].call("pid", {}, timeout=DEADLINE)
        assert result.structured_content is not None
        pid = result.structured_content["pid"]
        b = pool.lease(["per_session"], session="default/b/2", client=None)
        assert "per_session" not in b.upstreams
        assert "its limit" in b.refused["per_session"], b.refused
        b.release()
        a.release()
        assert await wait_exit(pid, DEADLINE), "the session's upstream process did not end"
        assert pool.isolated == 0
        again = pool.lease(["per_session"], session="default/b/2", client=None)
        assert not again.refused and "per_session" in again.upstreams
        again.release()
    finally:
        await pool.close()


async def test_a_session_keeps_its_upstreams_and_meter_across_a_new_bridge(
    tmp_path: Path,
) -> None:
    """A kernel restart makes a new bridge: the session's upstream process (its state)
    and its call meter (its rate limit) are the same ones if it comes back in time."""
    pool = UpstreamPool(isolated_configs(tmp_path), linger=30)
    try:
        first = pool.lease(["per_session"], session="default/a/1", client=None)
        await note(first, "per_session", "kept")
        meter = first.meter
        first.release()
        second = pool.lease(["per_session"], session="default/a/1", client=None)
        assert second.meter is meter
        assert await note(second, "per_session", "next") == "kept"
        second.release()
    finally:
        await pool.close()
