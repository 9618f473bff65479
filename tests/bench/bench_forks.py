"""Benchmark: a fork of N sessions from a live kernel (runtimes/local/forks.py) next to
what it saves, N warm claims from a pool and N cold starts, in one run.

    sudo .venv/bin/python tests/bench/bench_forks.py [--count 10] [--sizes 50,500] [--runs 3]

For a parent kernel holding about 50 MB and 500 MB of resident memory (a numpy array of
that many bytes, filled), medians of:
  * fork: LocalRuntime.fork of N new sessions (api/forks.body, names), from the call
    until all N exist (each restored from the parent's snapshot, Ready); the snapshot's
    size; fork+read: that, then until each fork answers a call that reads the array
    (run in all N at once);
next to the baselines, N new sessions of the same image and resources made at once:
  * warm: each created with spec.poolRef, claiming a kernel of a local pool of size N
    (filled, untimed, until it holds N ready kernels), until each answers a call;
    warm+state: that, then until each has run the cell that built the state again;
  * cold: each a new pod (no pool), until each answers a call; cold+state: the same.
N copies of S MB are N*S MB of memory: on the 24 GB machine, keep N*S within about 5 GB.
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from mcp_forge.api import forks  # noqa: E402
from mcp_forge.api import status as st  # noqa: E402
from mcp_forge.api.kernelsessionpool import ANNOTATION_CLAIMED_FROM  # noqa: E402
from mcp_forge.errors import SessionNotFound  # noqa: E402
from mcp_forge.gateway.core import Gateway  # noqa: E402
from mcp_forge.runtimes.local import snapshots  # noqa: E402
from mcp_forge.runtimes.local.runtime import LocalRuntime  # noqa: E402
from mcp_forge.settings import Settings  # noqa: E402

DEFAULT = "localhost/mcp-forge-kernel:0.1.0"
BUILD = "import numpy as np\nstate = np.ones({n} // 8)\n"  # filled: every page resident
READ = "print(float(state[-1]))"
T = TypeVar("T")
TAKEN: list[int] = []  # bytes of each snapshot a fork took (see sized_take)


def template(megabytes: int) -> dict[str, Any]:
    memory = f"{max(1024, megabytes * 2 + 512)}Mi"
    return {"image": DEFAULT, "resources": {"memory": memory, "cpu": "1"}}


def body(name: str, megabytes: int, pool: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {**template(megabytes), "operatingMode": "Running"}
    if pool:
        spec["poolRef"] = {"name": pool}
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": spec,
    }


def pool_body(name: str, megabytes: int, size: int) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {"size": size, "maxStarting": 2, "template": template(megabytes)},
    }


def sized_take() -> None:
    """snapshots.take, recording each snapshot's size (the fork's archive is gone once
    its forks are made, and its status keeps no size)."""
    take = snapshots.take

    async def taking(*args: Any, **kwargs: Any) -> snapshots.Taken:
        taken = await take(*args, **kwargs)
        TAKEN.append(taken.size)
        return taken

    snapshots.take = taking


async def run_cell(gateway: Gateway, name: str, code: str) -> None:
    result = await gateway.execute(name, code, timeout=600)
    if result.status != "ok":
        raise RuntimeError(f"{name}: {result.error} {result.stderr}")


async def in_each(gateway: Gateway, names: list[str], code: str) -> None:
    await asyncio.gather(*(run_cell(gateway, n, code) for n in names))


async def remove(rt: LocalRuntime, gateway: Gateway, names: list[str]) -> None:
    """Delete the sessions (those never made, or already gone, are skipped), and the
    gateway's connections to them (as close_session does: each holds ZeroMQ sockets)."""
    done = await asyncio.gather(*(rt.delete(n) for n in names), return_exceptions=True)
    for name in names:
        gateway.ended("default", name)
    for name, result in zip(names, done, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, SessionNotFound):
            print(f"could not delete session {name}: {result!r}", file=sys.stderr)


async def two_steps(
    make: Awaitable[T], then: Callable[[], Awaitable[Any]]
) -> tuple[T, float, float]:
    """What `make` gave; seconds until it was done, and until `then()` was after it."""
    started = time.perf_counter()
    made = await make
    first = time.perf_counter() - started
    await then()
    return made, first, time.perf_counter() - started


async def fork_runs(
    rt: LocalRuntime, gateway: Gateway, megabytes: int, count: int, runs: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"fork": [], "fork+read": [], "size": [], "restored": []}
    parent = f"b{uuid.uuid4().hex[:8]}"
    await rt.apply(body(parent, megabytes))
    try:
        await run_cell(gateway, parent, BUILD.format(n=megabytes * 1_000_000))
        for _ in range(runs):
            session = await rt.get(parent)
            names = forks.names(parent, count)
            bodies = [forks.body(session, n, annotations={}) for n in names]
            TAKEN.clear()
            try:
                made, took, read = await two_steps(
                    rt.fork(parent, "default", bodies), partial(in_each, gateway, names, READ)
                )
                restored = 0
                for child in made:
                    last = child.status.get("lastRestore") or {}
                    if last.get("outcome") == "Restored" and child.status.get("phase") == st.READY:
                        restored += 1
                    else:
                        print(f"fork {child.name} not restored: {last}", file=sys.stderr)
                out["fork"].append(took)
                out["fork+read"].append(read)
                out["restored"].append(restored)
                if TAKEN:
                    out["size"].append(TAKEN[-1] / 1e6)
            finally:
                await remove(rt, gateway, names)
    finally:
        await remove(rt, gateway, [parent])
    return out


async def start_runs(
    rt: LocalRuntime, gateway: Gateway, megabytes: int, count: int, runs: int, pool: str | None
) -> dict[str, list[float]]:
    """N sessions made at once, until each answers; then until each built the state
    again. From `pool` (filled first, untimed; every session must claim), else cold."""
    build = BUILD.format(n=megabytes * 1_000_000)
    out: dict[str, list[float]] = {"start": [], "start+state": []}
    for _ in range(runs):
        if pool:
            await rt.pools.fill(rt.pools.get(pool))
            members = rt.pools.members(rt.pools.get(pool))
            ready = [m for m in members if m.status.get("phase") == st.READY]
            if len(ready) != count:
                raise RuntimeError(f"pool {pool}: {len(ready)} of {count} kernels ready")
        names = [f"c{uuid.uuid4().hex[:8]}" for _ in range(count)]

        async def start(name: str) -> None:
            await rt.apply(body(name, megabytes, pool))
            await run_cell(gateway, name, "1")

        try:
            starts = asyncio.gather(*(start(n) for n in names))
            _, took, state = await two_steps(starts, partial(in_each, gateway, names, build + READ))
            if pool:
                for name in names:
                    meta = (await rt.get(name)).body["metadata"]
                    if (meta.get("annotations") or {}).get(ANNOTATION_CLAIMED_FROM) != pool:
                        raise RuntimeError(f"{name} did not claim a kernel of pool {pool}")
            out["start"].append(took)
            out["start+state"].append(state)
        finally:
            await remove(rt, gateway, names)
    return out


async def one_size(
    rt: LocalRuntime, gateway: Gateway, megabytes: int, count: int, runs: int
) -> dict[str, float]:
    got = await fork_runs(rt, gateway, megabytes, count, runs)
    pool = f"p{uuid.uuid4().hex[:8]}"
    try:
        await rt.pools.apply(pool_body(pool, megabytes, count))
        warm = await start_runs(rt, gateway, megabytes, count, runs, pool)
    finally:
        with contextlib.suppress(SessionNotFound):
            await rt.pools.delete(pool)
    cold = await start_runs(rt, gateway, megabytes, count, runs, None)
    got.update({"warm": warm["start"], "warm+state": warm["start+state"]})
    got.update({"cold": cold["start"], "cold+state": cold["start+state"]})
    return {k: statistics.median(v) if v else float("nan") for k, v in got.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10, help="new sessions of each fork")
    parser.add_argument("--sizes", default="50,500", help="resident MB of the parent kernel")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    count = forks.check_count(args.count)
    sized_take()
    state = Path(tempfile.mkdtemp(prefix="mcpforge-bench-", dir="/tmp"))
    rt = LocalRuntime(Settings(state_dir=state, kernel_ready_timeout=300))
    gateway = Gateway(rt, rt.settings)
    print(f"{count} new sessions each; seconds, medians of {args.runs}")
    print(
        f"{'kernel':>8} {'snapshot':>9} {'restored':>8} {'fork':>7} {'+read':>7} "
        f"{'warm':>7} {'+state':>7} {'cold':>7} {'+state':>7} {'÷warm':>6} {'÷cold':>6}"
    )
    try:
        for mb in (int(x) for x in args.sizes.split(",")):
            m = await one_size(rt, gateway, mb, count, args.runs)
            warm, cold = m["fork+read"] / m["warm+state"], m["fork+read"] / m["cold+state"]
            print(
                f"{mb:>6}MB {m['size']:>7.0f}MB {m['restored']:>5.0f}/{count:<2} "
                f"{m['fork']:>6.2f}s {m['fork+read']:>6.2f}s {m['warm']:>6.2f}s "
                f"{m['warm+state']:>6.2f}s {m['cold']:>6.2f}s {m['cold+state']:>6.2f}s "
                f"{warm:>6.2f} {cold:>6.2f}",
                flush=True,
            )
    finally:
        await gateway.close()
        await asyncio.to_thread(shutil.rmtree, state, True)
        if await asyncio.to_thread(state.exists):
            print(f"could not remove the state directory {state}", file=sys.stderr)
    print("fork: LocalRuntime.fork until all exist; +read: until each answers a call reading")
    print("the state; warm: sessions claiming from a pool of that many ready kernels, until")
    print("each answers `1`; cold: new pods, the same; +state: until each has built the state")
    print("again; restored: forks whose lastRestore is Restored; ÷warm, ÷cold: fork+read /")
    print("warm+state, / cold+state")


if __name__ == "__main__":
    asyncio.run(main())
