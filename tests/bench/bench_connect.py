"""Benchmark: a new connection to a kernel that already runs (a pool's, a gateway's after
its restart), to its first kernel_info with status on IOPub, in one run, interleaved.

    sudo .venv/bin/python tests/bench/bench_connect.py [--rounds 40]

KernelConnection.wait_ready asks again when the kernel's status has not crossed IOPub
soon after the reply (the subscription had not reached the kernel yet). It compares the
first wait of 100 ms (as it was) with 10 ms doubling (as it is): p50 and p90 of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import mcp_forge.jupyter.client as jc
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="mcpforge-bench-") as state:
        rt = LocalRuntime(Settings(state_dir=Path(state)))
        body = {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "connect"},
            "spec": {"image": IMAGE},
        }
        session = await rt.create(body)
        try:
            info = await rt.connection(session)
            times: dict[float, list[float]] = {0.1: [], jc.IOPUB_FIRST_WAIT: []}
            for _ in range(rounds):
                for first in times:
                    jc.IOPUB_FIRST_WAIT = first
                    conn = KernelConnection(info, max_frame=1 << 20, max_message=1 << 20)
                    began = time.perf_counter()
                    await conn.wait_ready(30)
                    times[first].append((time.perf_counter() - began) * 1000)
                    conn.close()
        finally:
            await rt.delete("connect")
    print(f"n={rounds}, new connection to a running kernel until ready    p50      p90")
    for first, xs in times.items():
        xs.sort()
        p90 = xs[min(len(xs) - 1, int(len(xs) * 0.9))]
        label = f"first IOPub wait {first * 1000:.0f} ms"
        print(f"  {label:<58}{statistics.median(xs):6.1f}  {p90:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    asyncio.run(main(parser.parse_args().rounds))
