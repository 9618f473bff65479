"""Prometheus metrics of the gateway (issue 13): a real gateway with --metrics, driven by a
real MCP client, scraped over loopback; the numbers move with the calls."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
from test_stdio import gateway, text

from mcp_forge import metrics
from support import half_sent, scrape, wait_closed

pytestmark = pytest.mark.podman


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def labels(**kv: str) -> frozenset[tuple[str, str]]:
    return frozenset(kv.items())


async def test_calls_executions_deaths_and_sessions_are_counted(state_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    args = ("--metrics", str(port), "--cull-interval", "0.5", "--pool-size", "0")
    async with gateway(state_dir, args=args) as c:
        before = await asyncio.to_thread(scrape, url)
        made = await c.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        ok = await c.call_tool("execute_code", {"session_id": sid, "code": "1 + 1"})
        failed = await c.call_tool("execute_code", {"session_id": sid, "code": "1 / 0"})
        refused = await c.call_tool("read_file", {"session_id": sid, "path": "missing.txt"})
        assert not ok.is_error and failed.is_error and refused.is_error, text(refused)
        died = await c.call_tool(
            "execute_code", {"session_id": sid, "code": "import os\nos._exit(1)"}
        )
        assert died.structured_content["status"] == "died", text(died)

        # The sessions gauge is set by a housekeeping pass: read until it shows, under a deadline.
        deadline = time.monotonic() + 30
        while True:
            after = await asyncio.to_thread(scrape, url)
            if after.get(("mcpforge_sessions", labels(phase="Ready")), 0) >= 1:
                break
            assert time.monotonic() < deadline, "the sessions gauge never showed the session"
            await asyncio.sleep(0.2)

    def moved(name: str, **kv: str) -> float:
        key = (name, labels(**kv))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("mcpforge_executions_total", status="ok") == 1
    assert moved("mcpforge_executions_total", status="error") == 1
    assert moved("mcpforge_executions_total", status="died") == 1
    assert moved("mcpforge_tool_calls_total", tool="execute_code", outcome="ok") == 3
    assert moved("mcpforge_tool_calls_total", tool="read_file", outcome="error") == 1
    assert moved("mcpforge_tool_calls_total", tool="create_session", outcome="ok") == 1
    assert moved("mcpforge_tool_call_seconds_count", tool="execute_code") == 3
    assert moved("mcpforge_execution_seconds_count") == 3
    assert moved("mcpforge_kernel_restarts_total", reason="died") >= 1


async def test_a_metrics_port_in_use_is_a_clear_error(state_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            str(Path(__import__("sys").executable).parent / "mcp-forge"),
            "gateway", "--metrics", str(port), "--pool-size", "0",
            stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**__import__("os").environ, "MCPFORGE_STATE_DIR": str(state_dir)},
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(b""), 60)
    assert proc.returncode != 0
    assert f"{port}" in err.decode() and "in use" in err.decode(), err.decode()


async def test_300_half_sent_scrapes_hold_no_gateway_thread_and_a_scrape_still_answers(
    state_dir: Path,
) -> None:
    """Issue 23: the endpoint kept a thread per connection (300 half-sent requests, 300
    threads). It is served on the gateway's loop: its threads do not grow, connections
    past the cap are closed at once, the rest when the request deadline passes, and a
    real scrape is answered meanwhile."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(Path(__import__("sys").executable).parent / "mcp-forge"),
        "gateway", "--metrics", str(port), "--pool-size", "0",
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**__import__("os").environ, "MCPFORGE_STATE_DIR": str(state_dir)},
    )  # fmt: skip
    assert proc.stdin is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            while b"Prometheus metrics at" not in await proc.stderr.readline():
                pass
        await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        threads = threads_of(proc.pid)  # and a few more as the gateway starts its work
        sockets = await asyncio.to_thread(half_sent, port, 300)
        try:
            samples = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
            assert (
                "mcpforge_tool_calls_total",
                labels(tool="execute_code", outcome="ok"),
            ) in samples
            assert threads_of(proc.pid) <= threads + 16, "a thread per connection"
            early = await asyncio.to_thread(wait_closed, sockets, 1.0)
            assert len(early) >= 300 - metrics.CONNECTIONS_MAX, len(early)
            held = [s for s in sockets if s not in early]
            late = await asyncio.to_thread(wait_closed, held, metrics.HEADER_DEADLINE + 3)
            assert len(late) == len(held), "a half-sent request outlived its deadline"
        finally:
            for s in sockets:
                s.close()
    finally:
        proc.stdin.close()
        async with asyncio.timeout(60):
            await proc.wait()
