"""Where an MCP call's time goes, stage by stage: execute_code next to list_sessions.

    sudo .venv/bin/python tests/bench/trace_mcp.py [--runs 200]

The gateway runs over stdio in a child process (this script with --serve) with
timestamps taken where the SDK reads a request line, where the tool starts and ends and
where the answer line is written, and in the gateway, around the kernel's round trip
(KernelConnection.pump). The client takes its own before and after the call. All are
CLOCK_MONOTONIC (time.perf_counter), one clock for both processes. Calls alternate, so
load falls on both tools alike. Printed: the median of each stage, in ms, then of
execute_code's parts in the gateway (each the sum of its spans within a call).

A stage both tools have costs both the same: what execute_code costs beyond the kernel
is its body minus the round trip, against list_sessions' body (which is not empty: it
reads the store and each kernel's memory).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_mcp import Direct

STAGES = (
    "client -> line read",
    "line read -> tool start",
    "tool body",
    "  of which the kernel round trip",
    "tool end -> line written",
    "line written -> client",
    "total",
)


def _tools() -> Any:
    from mcp_forge.gateway.mcp import tools

    return tools


def _tools_class() -> Any:
    return _tools().Tools


def _gateway() -> Any:
    from mcp_forge.gateway.core import Gateway

    return Gateway


def _connections() -> Any:
    from mcp_forge.gateway.connections import Connections

    return Connections


def _connection() -> Any:
    from mcp_forge.jupyter.client import KernelConnection

    return KernelConnection


# execute_code's parts, each timed where it runs (the sum of its spans within a call):
# (what holds it, its name, its label).
PARTS: tuple[tuple[Callable[[], Any], str, str], ...] = (
    (_tools_class, "_session_for", "resolving the session"),
    (_tools, "execution_result", "building the result"),
    (_gateway, "execute", "Gateway.execute"),
    (_connections, "_connect", "  its connection check"),
    (_gateway, "_record_activity", "  recording activity"),
    (_connection, "before_request", "  checking the channels"),
    (_connection, "send_execute", "  signing and sending"),
    (_connection, "pump", "  the kernel round trip"),
)


def serve(out: str) -> None:
    """The gateway, with timestamps kept in memory and written to `out` at exit."""
    import atexit

    import anyio
    import mcp_types

    from mcp_forge.gateway.mcp import tools
    from mcp_forge.jupyter import client

    events: list[tuple[str, float]] = []
    atexit.register(lambda: Path(out).write_text(json.dumps(events)))

    class Lines:  # the SDK parses each stdin line with this adapter: the line is read
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def validate_json(self, line: str, **kw: Any) -> Any:
            events.append(("in", time.perf_counter()))
            return self.inner.validate_json(line, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    mcp_types.jsonrpc_message_adapter = Lines(mcp_types.jsonrpc_message_adapter)  # type: ignore[assignment]

    wrap_file = anyio.wrap_file

    class Written:  # stdout: the answer is written
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def write(self, text: str) -> Any:
            events.append(("out", time.perf_counter()))
            return await self.inner.write(text)

        def __aiter__(self) -> Any:
            return self.inner.__aiter__()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def wrapped(file: Any) -> Any:
        return Written(wrap_file(file))

    anyio.wrap_file = wrapped  # type: ignore[assignment]

    def timed(owner: Any, name: str, label: str) -> None:
        fn: Callable[..., Awaitable[Any]] = getattr(owner, name)

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label + " start", time.perf_counter()))
            try:
                return await fn(*args, **kwargs)
            finally:
                events.append((label + " end", time.perf_counter()))

        setattr(owner, name, wrapper)

    def timed_sync(owner: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label + " start", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((label + " end", time.perf_counter()))

        setattr(owner, name, wrapper)

    timed(tools.Tools, "execute_code", "execute_code")
    timed(tools.Tools, "list_sessions", "list_sessions")
    timed(client.KernelConnection, "pump", "pump")
    for owner, name, label in PARTS:
        if asyncio.iscoroutinefunction(getattr(owner(), name)):
            timed(owner(), name, label)
        else:
            timed_sync(owner(), name, label)

    from mcp_forge.cli import main

    sys.argv = ["mcp-forge", "gateway"]
    main()


async def drive(runs: int) -> tuple[list[tuple[str, float, float]], str]:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    events_file = tempfile.mktemp(prefix="mf-trace-", suffix=".json", dir="/tmp")
    state = tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp")
    env = {**os.environ, "MCPFORGE_STATE_DIR": state, "MCPFORGE_POOL_SIZE": "0"}
    params = StdioServerParameters(
        command=sys.executable, args=[__file__, "--serve", events_file], env=env
    )
    calls: list[tuple[str, float, float]] = []
    async with Client(params) as client:
        made = await client.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        for _ in range(10):
            await client.call_tool("execute_code", {"code": "1+1", "session_id": sid})
        async with Direct(None, None, state=state, name=sid) as direct:  # type: ignore[arg-type]
            await trace_calls(client, direct, sid, runs, calls)
        await client.call_tool("close_session", {"session_id": sid})
    return calls, events_file


async def trace_calls(
    client: Any, direct: Any, sid: str, runs: int, calls: list[tuple[str, float, float]]
) -> None:
    for _ in range(runs):
        t0 = time.perf_counter()
        await direct.gateway_connection()
        calls.append(("direct", t0, time.perf_counter()))
        for tool, args in (
            ("execute_code", {"code": "1+1", "session_id": sid}),
            ("list_sessions", {}),
        ):
            t0 = time.perf_counter()
            await client.call_tool(tool, args)
            calls.append((tool, t0, time.perf_counter()))


def report(runs: int, calls: list[tuple[str, float, float]], events_file: str) -> None:
    events = json.loads(Path(events_file).read_text())
    os.unlink(events_file)

    def first(what: str, lo: float, hi: float) -> float:
        return min(t for w, t in events if w == what and lo < t < hi)

    def last(what: str, lo: float, hi: float) -> float:
        return max(t for w, t in events if w == what and lo < t < hi)

    stages: dict[tuple[str, str], list[float]] = {}
    direct = [t5 - t0 for tool, t0, t5 in calls if tool == "direct"]
    calls = [c for c in calls if c[0] != "direct"]
    for tool, t0, t5 in calls:
        start, end = first(f"{tool} start", t0, t5), first(f"{tool} end", t0, t5)
        read, written = last("in", t0, start), first("out", end, t5)
        kernel = sum(
            first("pump end", s, end) - s
            for w, s in events
            if w == "pump start" and start < s < end
        )
        got = (read - t0, start - read, end - start, kernel, written - end, t5 - written, t5 - t0)
        for stage, value in zip(STAGES, got, strict=True):
            stages.setdefault((tool, stage), []).append(value)
    print(f"{f'stage, ms (median, n={runs})':36}{'execute_code':>14}{'list_sessions':>15}")
    for stage in STAGES:
        row = [
            statistics.median(stages[(tool, stage)]) * 1000
            for tool in ("execute_code", "list_sessions")
        ]
        print(f"{stage:36}{row[0]:>14.3f}{row[1]:>15.3f}")
    body = stages[("execute_code", "tool body")]
    kernel = stages[("execute_code", "  of which the kernel round trip")]
    own = statistics.median(b - k for b, k in zip(body, kernel, strict=True)) * 1000
    print(f"{'execute_code body - kernel round trip':36}{own:>14.3f}")
    print("execute_code's parts:")
    executes = [(t0, t5) for tool, t0, t5 in calls if tool == "execute_code"]
    for _, _, label in PARTS:
        spans = [
            sum(
                first(label + " end", s, t5) - s
                for w, s in events
                if w == label + " start" and t0 < s < t5
            )
            for t0, t5 in executes
        ]
        print(f"  {label:34}{statistics.median(spans) * 1000:>14.3f}")
    print(
        f"{'the same kernel, from this process':36}{statistics.median(direct) * 1000:>14.3f}"
        "  (KernelConnection, as the gateway's; interleaved)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--runs", type=int, default=200)
        n = parser.parse_args().runs
        report(n, *asyncio.run(drive(n)))
