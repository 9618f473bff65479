"""Benchmark: code mode's bridged calls next to direct MCP calls, in one run.

    sudo .venv/bin/python tests/bench/bench_code_mode.py [--runs 200]

Medians (and p90) of:
  * one tool call (`edge.echo`) made by kernel code through `mcp_tools` (kernel in a
    Podman pod, bridge, gateway, SDK client, upstream server), timed inside the kernel,
    next to the same tool called directly by a host-side SDK client (the baseline);
  * 50 concurrent calls: from kernel code with asyncio (`.aio`), next to 50 concurrent
    direct calls from the host; as calls per second.
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from mcp_forge.gateway.codemode.upstream import Upstream, parse_config  # noqa: E402
from mcp_forge.gateway.core import Gateway  # noqa: E402
from mcp_forge.runtimes.local.runtime import LocalRuntime  # noqa: E402
from mcp_forge.settings import Settings  # noqa: E402
from mcp_servers.config import upstream_config  # noqa: E402

MINIMAL = "localhost/mcp-forge-kernel:0.1.0-minimal"


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


KERNEL_TIMING = """
import mcp_tools, time, json, asyncio
mcp_tools.edge.echo(text="warm")
_t = []
for _ in range(RUNS):
    _s = time.perf_counter(); mcp_tools.edge.echo(text="x"); _t.append(time.perf_counter() - _s)
async def _burst():
    _s = time.perf_counter()
    await asyncio.gather(*(mcp_tools.edge.echo.aio(text=str(i)) for i in range(50)))
    return time.perf_counter() - _s
_b = [await _burst() for _ in range(5)]
print(json.dumps({"one": _t, "burst": _b}))
"""


async def direct(upstream: Upstream, runs: int) -> tuple[list[float], list[float]]:
    await upstream.call("echo", {"text": "warm"}, timeout=30)
    one = []
    for _ in range(runs):
        t = time.perf_counter()
        await upstream.call("echo", {"text": "x"}, timeout=30)
        one.append(time.perf_counter() - t)
    burst = []
    for _ in range(5):
        t = time.perf_counter()
        await asyncio.gather(
            *(upstream.call("echo", {"text": str(i)}, timeout=30) for i in range(50))
        )
        burst.append(time.perf_counter() - t)
    return one, burst


async def main(runs: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-code-", dir="/tmp"))
    config = parse_config(upstream_config(tmp))
    upstreams = {"edge": Upstream(config["edge"])}
    runtime = LocalRuntime(Settings(state_dir=tmp / "state"))
    gw = Gateway(runtime, runtime.settings, upstreams=upstreams)
    name = f"b-{uuid.uuid4().hex[:8]}"
    await runtime.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": name},
            "spec": {"image": MINIMAL, "mcpServers": [{"name": "edge"}]},
        }
    )
    try:
        base_one, base_burst = await direct(upstreams["edge"], runs)
        result = await gw.execute(name, KERNEL_TIMING.replace("RUNS", str(runs)), timeout=600)
        assert result.status == "ok", (result.error, result.stderr)
        kernel = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        await gw.close()
        await runtime.delete(name)
        for u in upstreams.values():
            await u.close()

    def row(label: str, xs: list[float], ref: float | None) -> None:
        med, p90 = stats(xs)
        ratio = med / ref if ref else 1.0
        print(f"  {label:<52} {med * 1000:8.2f} ms  p90 {p90 * 1000:8.2f} ms  {ratio:5.2f}x")

    print(f"\ncode mode (medians; {runs} single calls, 5 bursts of 50)")
    ref = stats(base_one)[0]
    row("direct: host SDK client -> edge.echo (baseline)", base_one, None)
    row("bridged: kernel mcp_tools.edge.echo -> gateway -> edge", kernel["one"], ref)
    bref = stats(base_burst)[0]
    row("direct: 50 concurrent calls (baseline)", base_burst, None)
    row("bridged: 50 concurrent .aio calls from the kernel", kernel["burst"], bref)
    print(
        f"  throughput: direct {50 / bref:.0f} calls/s, "
        f"bridged {50 / stats(kernel['burst'])[0]:.0f} calls/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    asyncio.run(main(parser.parse_args().runs))
