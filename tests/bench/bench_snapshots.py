"""Benchmark: suspend and resume with memory (runtimes/local/naps.py) next to what it
saves, in one run.

    sudo .venv/bin/python tests/bench/bench_snapshots.py [--sizes 50,500,2000] [--runs 3]
        [--archive]   (MCPFORGE_SNAPSHOT_IN_POD=false: the pod goes, the snapshot an archive)

For kernels holding about 50 MB, 500 MB and 2 GB of resident memory (a numpy array of
that many bytes, filled), medians of:
  * suspend: operatingMode Suspended applied, until the kernel is checkpointed and its
    pod gone; the snapshot's size;
  * resume: operatingMode Running applied, until the restored kernel answers a call
    that reads the array;
next to the baselines: a cold start alone (a new session, until its kernel answers a
call), and a cold start plus re-running the cell that built the state, timed the same
way. The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from mcp_forge.gateway.core import Gateway  # noqa: E402
from mcp_forge.runtimes.local.runtime import LocalRuntime  # noqa: E402
from mcp_forge.settings import Settings  # noqa: E402

DEFAULT = "localhost/mcp-forge-kernel:0.1.0"
BUILD = "import numpy as np\nstate = np.ones({n} // 8)\n"  # filled: every page resident
READ = "print(float(state[-1]))"


def body(name: str, megabytes: int, mode: str = "Running") -> dict[str, Any]:
    memory = f"{max(1024, megabytes * 2 + 512)}Mi"
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": DEFAULT,
            "resources": {"memory": memory, "cpu": "1"},
            "operatingMode": mode,
        },
    }


async def timed(step: Any) -> float:
    started = time.perf_counter()
    await step
    return time.perf_counter() - started


async def run_cell(gateway: Gateway, name: str, code: str) -> None:
    result = await gateway.execute(name, code, timeout=600)
    if result.status != "ok":
        raise RuntimeError(f"{name}: {result.error} {result.stderr}")


async def one_size(rt: LocalRuntime, gateway: Gateway, megabytes: int, runs: int) -> dict[str, Any]:
    build = BUILD.format(n=megabytes * 1_000_000)
    out: dict[str, list[float]] = {k: [] for k in ("suspend", "resume", "size", "new", "cold")}
    name = f"b{uuid.uuid4().hex[:8]}"
    await rt.apply(body(name, megabytes))
    try:
        await run_cell(gateway, name, build)
        for _ in range(runs):
            out["suspend"].append(await timed(rt.apply(body(name, megabytes, "Suspended"))))
            taken = (await rt.get(name)).status.get("snapshot") or {}
            if not taken:
                raise RuntimeError(f"{name}: suspended without a snapshot")
            out["size"].append(taken["size"] / 1e6)

            async def resume() -> None:
                await rt.apply(body(name, megabytes))
                await run_cell(gateway, name, READ)

            out["resume"].append(await timed(resume()))
            restored = (await rt.get(name)).status.get("lastRestore") or {}
            if restored.get("outcome") != "Restored":
                raise RuntimeError(f"{name}: not restored: {restored}")
    finally:
        await rt.delete(name)
    for _ in range(runs):  # the baselines: a new kernel alone, and with the cell again
        for key, cell in (("new", "1"), ("cold", build + READ)):
            cold = f"c{uuid.uuid4().hex[:8]}"

            async def start(cold: str = cold, cell: str = cell) -> None:
                await rt.apply(body(cold, megabytes))
                await run_cell(gateway, cold, cell)

            try:
                out[key].append(await timed(start()))
            finally:
                await rt.delete(cold)
    return {k: statistics.median(v) for k, v in out.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,500,2000", help="resident MB of each kernel")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--archive", action="store_true", help="snapshots out of the pod")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="mcpforge-bench-", dir="/tmp"))
    settings = Settings(state_dir=state, kernel_ready_timeout=120)
    rt = LocalRuntime(dataclasses.replace(settings, snapshot_in_pod=not args.archive))
    gateway = Gateway(rt, rt.settings)
    print("snapshots", "as archives (the pod goes)" if args.archive else "kept in the pod")
    print(
        f"{'kernel':>8} {'snapshot':>9} {'suspend':>8} {'resume':>8} {'new':>6} "
        f"{'new+cell':>9} {'ratio':>6}"
    )
    try:
        for mb in (int(x) for x in args.sizes.split(",")):
            m = await one_size(rt, gateway, mb, args.runs)
            print(
                f"{mb:>6}MB {m['size']:>7.0f}MB {m['suspend']:>7.2f}s {m['resume']:>7.2f}s "
                f"{m['new']:>5.2f}s {m['cold']:>8.2f}s {m['resume'] / m['cold']:>6.2f}",
                flush=True,
            )
    finally:
        await gateway.close()
    print("resume: applied Running until a call reads the state; new: a new session until")
    print("it runs `1`; new+cell: until it has built the state again; ratio: resume /")
    print("new+cell; medians of", args.runs)


if __name__ == "__main__":
    asyncio.run(main())
