"""Benchmark: warm starts from a pool, next to cold starts and a bare ipykernel, in one run.

    sudo .venv/bin/python tests/bench/bench_pool.py [--starts 10] [--density 20]

Through the official MCP client over stdio, against two real gateways on one store:
one with `--pool bench` (a KernelSessionPool of the default image, applied first), one
with `--pool-size 0`. Each round, interleaved (the machine is shared and noisy):
  * bare: jupyter-client starts a local ipykernel and waits for its kernel_info reply;
  * cold: create_session → Ready, a new pod (podman kube play, the kernel's imports);
  * warm: create_session → Ready, a kernel claimed from the pool (the pool is refilled
    between rounds, untimed, so every claim finds one ready);
  * warm + first result: create_session, then execute_code `1+1` until its result.
Prints p50 and p90 of each, and each one's ratio to the bare start.

With --density N, a pool of N idle kernels is filled, and the memory each holds is
reported: what its kernel container's cgroup is charged, and the proportional set size
of every process of its pod (the kernel, the infra container, their conmons).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import bench_local  # tests/bench, beside this script
from bench_local import stats
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
IMAGE = "localhost/mcp-forge-kernel:0.1.0"  # what create_session's default variant runs


def pool(name: str, size: int) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {"size": size, "maxStarting": 2, "template": {"image": IMAGE}},
    }


@asynccontextmanager
async def gateway(state: Path, *args: str) -> AsyncIterator[Client]:
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state)}
    params = StdioServerParameters(command=GATEWAY, args=["gateway", *args], env=env)
    async with Client(params) as c:
        yield c


async def bare_start() -> float:
    took, km = await bench_local.bare_start()
    await km.shutdown_kernel(now=True)
    return took


async def create(c: Client) -> tuple[float, str, str]:
    t = time.perf_counter()
    r = await c.call_tool("create_session", {})
    took = time.perf_counter() - t
    assert not r.is_error and r.structured_content is not None, r
    return took, r.structured_content["session_id"], r.structured_content["start"]


async def refilled(rt: LocalRuntime, name: str, size: int) -> None:
    """Until the gateway (another process) has refilled the pool: its status, polled."""
    async with asyncio.timeout(300):
        while (rt.pools.get(name).body.get("status") or {}).get("ready") != size:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def rounds(state: Path, rt: LocalRuntime, starts: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"bare": [], "cold": [], "warm": [], "first": []}
    size = 2
    await rt.pools.apply(pool("bench", size))
    async with (
        gateway(state, "--pool", "bench") as warm,
        gateway(state, "--pool-size", "0") as cold,
    ):
        for _ in range(starts):
            out["bare"].append(await bare_start())

            took, sid, start = await create(cold)
            assert start == "cold", start
            out["cold"].append(took)
            await cold.call_tool("close_session", {"session_id": sid})

            await refilled(rt, "bench", size)
            took, sid, start = await create(warm)
            assert start == "warm", start
            out["warm"].append(took)
            await warm.call_tool("close_session", {"session_id": sid})

            await refilled(rt, "bench", size)
            t = time.perf_counter()
            _, sid, start = await create(warm)
            r = await warm.call_tool("execute_code", {"session_id": sid, "code": "1+1"})
            out["first"].append(time.perf_counter() - t)
            assert start == "warm" and not r.is_error, r
            await warm.call_tool("close_session", {"session_id": sid})
    await rt.pools.delete("bench")
    return out


def pss(pid: int) -> int:
    """Proportional set size of a process, in bytes (shared pages split among sharers)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


async def pod_pids(pod: str) -> list[int]:
    """Every process a kernel pod costs the machine: each container's processes (the
    kernel, the infra's catatonit) and its conmon."""
    proc = await asyncio.create_subprocess_exec(
        "podman", "pod", "inspect", pod, "--format", "{{range .Containers}}{{.Id}} {{end}}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    ids = (await proc.communicate())[0].decode().split()
    pids: list[int] = []
    for cid in ids:
        proc = await asyncio.create_subprocess_exec(
            "podman", "inspect", cid, "--format", "{{.State.Pid}} {{.State.ConmonPid}}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        main, conmon = map(int, (await proc.communicate())[0].decode().split())
        pids += [conmon, main, *children(main)]
    return pids


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def density(rt: LocalRuntime, size: int) -> tuple[float, float]:
    """MiB per idle pooled kernel: its kernel container's cgroup (median), and the
    proportional set size of every process of its pod, conmon included (median)."""
    await rt.pools.apply(pool("density", size))
    members = rt.pools.members(rt.pools.get("density"))
    usage = await rt.memory_usage(members)
    totals = [sum(pss(p) for p in await pod_pids(rt.pod_name(m))) for m in members]
    await rt.pools.delete("density")
    return statistics.median(usage.values()) / 2**20, statistics.median(totals) / 2**20


async def main(starts: int, density_size: int) -> None:
    state = Path(tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp"))
    rt = LocalRuntime(Settings(state_dir=state))
    got = await rounds(state, rt, starts)
    bm, _ = stats(got["bare"])
    print(f"{'n=' + str(starts):40}{'p50':>10}{'p90':>10}{'p50 / bare':>12}")
    for key, label in (
        ("bare", "bare ipykernel start to ready, ms"),
        ("cold", "cold create_session to Ready, ms"),
        ("warm", "warm create_session to Ready, ms"),
        ("first", "warm create + first execute_code, ms"),
    ):
        m, p90 = stats(got[key])
        print(f"{label:40}{m * 1000:>10.1f}{p90 * 1000:>10.1f}{m / bm:>11.2f}x")
    if density_size:
        cgroup, whole = await density(rt, density_size)
        print(
            f"\nidle pooled kernels (pool of {density_size}, {IMAGE}), each: "
            f"{cgroup:.1f} MiB charged to its kernel's cgroup, {whole:.1f} MiB PSS of all "
            f"its pod's processes (conmon, infra, kernel); 24 GiB holds about "
            f"{24 * 1024 / max(whole, cgroup):.0f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--density", type=int, default=0)
    a = p.parse_args()
    asyncio.run(main(a.starts, a.density))
