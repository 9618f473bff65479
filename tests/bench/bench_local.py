"""Benchmark: MCP-Forge in local mode next to a bare local ipykernel, in one run.

    sudo .venv/bin/python tests/bench/bench_local.py [--runs 200] [--starts 5]

Prints medians (and p90) of:
  * start to ready: `mcp-forge apply` of a KernelSession (podman kube play, kernel_info
    reply) next to jupyter-client starting a bare local ipykernel;
  * trivial execute round trip (`1+1`): the gateway core over ZMQ ipc into the pod, next
    to jupyter-client driving the bare local kernel over TCP.
The machines are shared and noisy: compare the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager

from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


def body(name: str) -> dict[str, object]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {"image": IMAGE, "resources": {"memory": "512Mi"}},
    }


async def bare_start() -> tuple[float, AsyncKernelManager]:
    km = AsyncKernelManager(kernel_name="python3")
    t = time.perf_counter()
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    took = time.perf_counter() - t
    kc.stop_channels()
    return took, km


async def read_until_idle(kc: Any, msg_id: str) -> None:
    """Read `msg_id`'s output until the kernel is idle for it, then its shell reply."""
    while True:
        msg = await kc.get_iopub_msg(timeout=10)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            break
    while (await kc.get_shell_msg(timeout=10))["parent_header"].get("msg_id") != msg_id:
        pass


async def bare_execute(km: AsyncKernelManager, runs: int, code: str = "1+1") -> list[float]:
    """Seconds each of `runs` executions of `code` takes, all its output read until idle."""
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        await read_until_idle(kc, kc.execute(code))
        out.append(time.perf_counter() - t)
    kc.stop_channels()
    return out


async def main(runs: int, starts: int) -> None:
    state = Path(tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp"))
    rt = LocalRuntime(Settings(state_dir=state))
    gw = Gateway(rt, rt.settings)

    forge_starts, bare_starts = [], []
    names = []
    for _ in range(starts):
        name = f"bench-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        await rt.apply(body(name))
        forge_starts.append(time.perf_counter() - t)
        names.append(name)
        took, km = await bare_start()
        bare_starts.append(took)
        await km.shutdown_kernel(now=True)

    name = names[0]
    await gw.execute(name, "1+1")  # connect and warm up
    forge_exec = []
    for _ in range(runs):
        t = time.perf_counter()
        r = await gw.execute(name, "1+1")
        forge_exec.append(time.perf_counter() - t)
        assert r.status == "ok"
    _, km = await bare_start()
    bare_exec = await bare_execute(km, runs)
    await km.shutdown_kernel(now=True)

    await gw.close()
    for n in names:
        await rt.delete(n)

    print(f"{'':34}{'MCP-Forge (pod)':>18}{'bare ipykernel':>18}{'ratio':>8}")
    for label, forge, bare, unit in (
        (f"start to ready, s (n={starts})", forge_starts, bare_starts, 1),
        (f"execute 1+1 round trip, ms (n={runs})", forge_exec, bare_exec, 1000),
    ):
        (fm, f90), (bm, b90) = stats(forge), stats(bare)
        print(
            f"{label:34}{fm * unit:>10.2f} p90 {f90 * unit:<5.2f}"
            f"{bm * unit:>10.2f} p90 {b90 * unit:<5.2f}{fm / bm:>7.2f}x"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--starts", type=int, default=5)
    a = p.parse_args()
    asyncio.run(main(a.runs, a.starts))
