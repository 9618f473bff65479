"""Benchmark: execute_code through real MCP clients next to a bare local ipykernel.

    sudo .venv/bin/python tests/bench/bench_mcp.py [--runs 100] [--creates 5]

In one run, medians (and p90) of:
  * the `1+1` round trip: the SDK client over stdio and over streamable HTTP to
    `mcp-forge gateway` (kernel in a Podman pod), next to jupyter-client straight to a
    bare local ipykernel, and next to a direct MCP call of a tool that does nothing
    (list_sessions), which is the MCP transport's own cost; the two calls alternate, so a
    change in the machine's load falls on both. A pod kernel of the same image (a second
    session's: a kernel's other clients would cost the gateway their IOPub messages) is
    also reached without MCP, interleaved with those calls: by jupyter-client, and by the
    gateway's own connection (KernelConnection: its relays, its checks). The last rows
    are what execute_code costs beyond the kernel's round trip and a tool call (issue 12
    asks for < 0.5 ms): against the bare kernel, and against the gateway's connection to
    a pod kernel (the MCP layer alone), each as a difference of medians and as the median
    of the differences within a round (paired);
  * create_session to Ready, next to a bare local ipykernel's start.
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
from jupyter_client import AsyncKernelClient
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

sys.path.insert(0, str(Path(__file__).parent))
from bench_local import bare_start, read_until_idle

from mcp_forge.image.kernel import image_ref
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import Collector
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


async def timed(fn: Callable[[], Awaitable[object]], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


class Twin:
    """A session like the one the gateway runs code in (same image and resources), made
    by this process in a store of its own, whose pod kernel the baselines reach.

    Not the gateway's own kernel: every client of a kernel gets all its IOPub messages,
    so the gateway would also read (and pass over) those of the baselines' requests, a
    cost a lone client never pays. Not a session of the gateway's store either: its
    list_sessions (the do-nothing tool) would have one more to list.
    """

    def __init__(self) -> None:
        self.runtime = LocalRuntime(
            Settings(state_dir=Path(tempfile.mkdtemp(prefix="mf-bench-twin-", dir="/tmp")))
        )
        self.name = f"twin-{os.getpid()}"

    async def __aenter__(self) -> Twin:
        body = {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": self.name},
            "spec": {"image": image_ref("minimal")},
        }
        await self.runtime.apply(body)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.runtime.delete(self.name)


class Direct:
    """A pod kernel reached without MCP: by jupyter-client and by the gateway's
    KernelConnection (made here, in this process, as the gateway makes it). `twin`'s,
    or (trace_mcp.py) a gateway session's in the store at `state`."""

    def __init__(
        self,
        twin: Twin | None,
        bare: AsyncKernelClient,
        *,
        state: str | None = None,
        name: str | None = None,
    ) -> None:
        if twin is not None:
            self.runtime, self.name = twin.runtime, twin.name
        else:
            assert state is not None and name is not None
            self.runtime = LocalRuntime(Settings(state_dir=Path(state)))
            self.name = name
        self.bare = bare

    async def __aenter__(self) -> Direct:
        info = await self.runtime.connection(await self.runtime.get(self.name))
        self.kc = AsyncKernelClient()
        self.kc.load_connection_info(info.to_jupyter())  # type: ignore[arg-type]
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)
        self.conn = KernelConnection(info, max_frame=1 << 20, max_message=1 << 20)
        await self.conn.wait_ready(60)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.kc.stop_channels()
        self.conn.close()

    async def bare_kernel(self) -> None:
        await read_until_idle(self.bare, self.bare.execute("1+1"))

    async def jupyter_client(self) -> None:
        await read_until_idle(self.kc, self.kc.execute("1+1"))

    async def gateway_connection(self) -> None:
        await self.conn.before_request()
        collector = Collector("", budget=100_000, spool_max=0)
        collector.msg_id = self.conn.send_execute("1+1", silent=False, store_history=True)
        assert await self.conn.pump(collector, 10)


async def measure(
    client: Client, twin: Twin, bare: AsyncKernelClient, runs: int, creates: int
) -> dict[str, list[float]]:
    async def execute() -> None:
        r = await client.call_tool("execute_code", {"code": "1+1", "session_id": sid})
        assert not r.is_error

    async def noop() -> None:
        await client.call_tool("list_sessions", {})

    made = await client.call_tool("create_session", {"variant": "minimal"})
    sid = made.structured_content["session_id"]
    await execute()
    result: dict[str, list[float]] = {"execute": [], "noop": [], "bare": [], "jc": [], "conn": []}
    async with Direct(twin, bare) as direct:
        for _ in range(runs):  # interleaved, so that the machine's load drifts on all alike
            result["bare"] += await timed(direct.bare_kernel, 1)
            result["execute"] += await timed(execute, 1)
            result["noop"] += await timed(noop, 1)
            result["jc"] += await timed(direct.jupyter_client, 1)
            result["conn"] += await timed(direct.gateway_connection, 1)
    create = []
    for _ in range(creates):
        t = time.perf_counter()
        r = await client.call_tool("create_session", {"variant": "minimal"})
        create.append(time.perf_counter() - t)
        await client.call_tool("close_session", {"session_id": r.structured_content["session_id"]})
    result["create"] = create
    return result


async def main(runs: int, creates: int) -> None:
    state = tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp")
    _, bare_km = await bare_start()  # the baseline, measured alongside the calls
    bare_kc = bare_km.client()
    bare_kc.start_channels()
    await bare_kc.wait_for_ready(timeout=60)
    env = {**os.environ, "MCPFORGE_STATE_DIR": state}
    params = StdioServerParameters(command=GATEWAY, args=["gateway"], env=env)
    async with Twin() as twin, Client(params) as client:
        stdio = await measure(client, twin, bare_kc, runs, creates)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "bench-token-0123456789abcdef"
    proc = await asyncio.create_subprocess_exec(
        GATEWAY, "gateway", "--http", f"127.0.0.1:{port}", "--token", token,
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while b"MCP over HTTP" not in await proc.stderr.readline():
            pass
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        Twin() as twin,
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http)) as client,
    ):
        over_http = await measure(client, twin, bare_kc, runs, 0)
    proc.terminate()
    await proc.wait()

    bare_kc.stop_channels()
    await bare_km.shutdown_kernel(now=True)
    bare_starts = []
    for _ in range(creates):
        took, km = await bare_start()
        bare_starts.append(took)
        await km.shutdown_kernel(now=True)
    bare = stdio["bare"] + over_http["bare"]

    bm, _ = stats(bare)
    title = f"execute 1+1 round trip, ms (n={runs})"
    print(f"{title:56}{'median':>8}{'p90':>8}{'vs bare':>9}")
    rows = [
        ("bare ipykernel, jupyter-client (baseline)", bare),
        ("MCP stdio: execute_code", stdio["execute"]),
        ("MCP HTTP: execute_code", over_http["execute"]),
        ("MCP stdio: list_sessions (transport only)", stdio["noop"]),
        ("MCP HTTP: list_sessions (transport only)", over_http["noop"]),
        ("pod kernel, jupyter-client", stdio["jc"] + over_http["jc"]),
        ("pod kernel, the gateway's connection", stdio["conn"] + over_http["conn"]),
    ]
    for label, xs in rows:
        m, p = stats(xs)
        print(f"{label:56}{m * 1000:>8.2f}{p * 1000:>8.2f}{m / bm:>8.2f}x")
    # The MCP layer's own cost of execute_code: what it adds to the kernel's round trip
    # (bare) beyond what any tool call costs (list_sessions), in ms.
    # And what it adds beyond the gateway's own connection to the same kernel, measured
    # alongside: the MCP layer alone.
    # Each is given twice: the difference of the rows' medians, and the median of the
    # differences within each round (paired: the calls of one round are a few ms apart, so
    # a change in the machine's load between rounds cancels out).
    print(f"{'':56}{'medians':>8}{'paired':>8}")
    for name, d in (("stdio", stdio), ("HTTP", over_http)):
        # Each transport against the baselines measured in its own rounds (the rows
        # above pool both transports' rounds).
        em, nm = stats(d["execute"])[0], stats(d["noop"])[0]
        for base, bxs in (("bare", d["bare"]), ("connection", d["conn"])):
            bmed = stats(bxs)[0]
            paired = statistics.median(
                e - n - b for e, n, b in zip(d["execute"], d["noop"], bxs, strict=True)
            )
            print(
                f"{'MCP ' + name + ': execute_code - ' + base + ' - list_sessions':56}"
                f"{(em - bmed - nm) * 1000:>8.2f}{paired * 1000:>8.2f}"
            )
    (cm, c90), (sm, s90) = stats(stdio["create"]), stats(bare_starts)
    print(
        f"\n{'start to ready, s (n=' + str(creates) + ')':56}{'median':>8}{'p90':>8}{'vs bare':>9}"
    )
    print(f"{'bare ipykernel start (baseline)':56}{sm:>8.2f}{s90:>8.2f}{1:>8.2f}x")
    print(f"{'MCP stdio: create_session to Ready':56}{cm:>8.2f}{c90:>8.2f}{cm / sm:>8.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--creates", type=int, default=5)
    a = p.parse_args()
    asyncio.run(main(a.runs, a.creates))
