"""Benchmark: the operator against the test API, with and without real kernels.

    sudo .venv/bin/python tests/bench/bench_operator.py [--runs 10] [--sessions 200]

The API server is the emulator of tests/kube (KMock); the operator is `mcp-forge
operator` (a subprocess, as it runs in a cluster); pods are played with Podman by the
test kubelet. In one run, medians (and p90) of:
  * the API's own cost: one object created and read back (a Secret), the baseline;
  * the operator's reaction: a KernelSession created → its kernel Pod exists, and the
    Pod reported running → the KernelSession Ready (no containers: the API only);
  * create → Ready with a real kernel in a Podman pod, next to a bare local ipykernel's
    start and local mode's create → Ready (`mcp-forge apply`'s path);
  * the operator's memory (RSS) with no session and with --sessions KernelSessions, all
    reconciled, and how long reconciling them all took.
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kubernetes
import yaml

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from bench_local import bare_start  # noqa: E402

from kube.conftest import CRD_PATH, declare_resources, prepare_cluster, write_kubeconfig  # noqa: E402
from kube.emulator import Emulator  # noqa: E402
from kube.harness import KS, condition, eventually, running_status, session_body  # noqa: E402
from kube.kubelet import Kubelet  # noqa: E402
from mcp_forge.kube import Kube  # noqa: E402

NS = "default"
OPERATOR = str(Path(sys.executable).parent / "mcp-forge")
MINIMAL = "localhost/mcp-forge-kernel:0.1.0-minimal"


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextlib.asynccontextmanager
async def api() -> AsyncIterator[tuple[Path, Kube]]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    async with Emulator(keep_requests=1) as emulator, kmock.Server(emulator):
        declare_resources(emulator, crd)
        kubeconfig = Path(tempfile.mkdtemp(prefix="bench-kube-")) / "kubeconfig"
        write_kubeconfig(kubeconfig, str(emulator.url).rstrip("/"))
        await asyncio.to_thread(prepare_cluster, kubeconfig, crd, False)
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
        kube = Kube(config)
        try:
            yield kubeconfig, kube
        finally:
            kube.close()


@contextlib.asynccontextmanager
async def operator(kubeconfig: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(kubeconfig)
    log = open(kubeconfig.parent / "operator.log", "wb")  # noqa: SIM115, ASYNC230
    proc = await asyncio.create_subprocess_exec(
        OPERATOR, "operator", "--all-namespaces", env=env, stdout=log, stderr=log
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


def ready(o: dict[str, Any] | None) -> bool:
    return condition(o, "Ready").get("status") == "True"


async def operator_up(kube: Kube) -> None:
    """The operator watches: a probe session gets its pod."""
    name = "probe"
    await asyncio.to_thread(kube.create, session_body(name, NS))
    await eventually(kube, "Pod", NS, f"ks-{name}", lambda p: p is not None, timeout=60)
    await asyncio.to_thread(kube.delete, KS, NS, name)


async def api_baseline(kube: Kube, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        name = f"s-{uuid.uuid4().hex[:8]}"
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}}
        t = time.perf_counter()
        await asyncio.to_thread(kube.create, body)
        await asyncio.to_thread(kube.get, "Secret", NS, name)
        out.append(time.perf_counter() - t)
    return out


async def reaction(kube: Kube, runs: int) -> tuple[list[float], list[float]]:
    to_pod, to_ready = [], []
    for _ in range(runs):
        name = f"r-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        await asyncio.to_thread(kube.create, session_body(name, NS))
        await eventually(kube, "Pod", NS, f"ks-{name}", lambda p: p is not None)
        to_pod.append(time.perf_counter() - t)
        t = time.perf_counter()
        await asyncio.to_thread(
            kube.patch, "Pod", NS, f"ks-{name}", {"status": running_status()}, status=True
        )
        await eventually(kube, KS, NS, name, ready)
        to_ready.append(time.perf_counter() - t)
        await asyncio.to_thread(kube.delete, KS, NS, name)
    return to_pod, to_ready


async def with_kernels(kube: Kube, kubeconfig: Path, runs: int) -> list[float]:
    out = []
    async with Kubelet(kubeconfig, [NS]) as kubelet:
        for _ in range(runs):
            name = f"k-{uuid.uuid4().hex[:8]}"
            t = time.perf_counter()
            await asyncio.to_thread(kube.create, session_body(name, NS, image=MINIMAL))
            await eventually(kube, KS, NS, name, ready, timeout=120)
            out.append(time.perf_counter() - t)
            await asyncio.to_thread(kube.delete, KS, NS, name)
            await kubelet.wait_removed(NS, f"ks-{name}", timeout=60)
        assert kubelet.errors == [], kubelet.errors
    return out


async def local_baseline(runs: int) -> list[float]:
    from mcp_forge.local import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))))
    out = []
    for _ in range(runs):
        name = f"l-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        await runtime.apply(
            {
                "apiVersion": "mcpforge.dev/v1alpha1",
                "kind": KS,
                "metadata": {"name": name},
                "spec": {"image": MINIMAL},
            }
        )
        out.append(time.perf_counter() - t)
        await runtime.delete(name)
    return out


async def memory(
    kube: Kube, proc: asyncio.subprocess.Process, count: int
) -> tuple[int, int, float]:
    before = rss(proc.pid)
    names = [f"m-{i:04d}" for i in range(count)]
    t = time.perf_counter()
    for name in names:
        await asyncio.to_thread(kube.create, session_body(name, NS))
    for name in names:
        await eventually(
            kube,
            KS,
            NS,
            name,
            lambda o: bool((o or {}).get("status", {}).get("phase")),
            timeout=300,
        )
    took = time.perf_counter() - t
    after = rss(proc.pid)
    for name in names:
        await asyncio.to_thread(kube.delete, KS, NS, name)
    return before, after, took


async def main(runs: int, sessions: int) -> None:
    bare = []
    for _ in range(runs):
        took, km = await bare_start()
        bare.append(took)
        await km.shutdown_kernel(now=True)
    local = await local_baseline(runs)
    async with api() as (kubeconfig, kube), operator(kubeconfig) as proc:
        await operator_up(kube)
        idle_rss = rss(proc.pid)
        base = await api_baseline(kube, runs * 5)
        to_pod, to_ready = await reaction(kube, runs * 2)
        cluster = await with_kernels(kube, kubeconfig, runs)
        before, after, took = await memory(kube, proc, sessions)

    def row(label: str, xs: list[float], ref: float | None = None) -> None:
        med, p90 = stats(xs)
        ratio = f"{med / ref:6.2f}x" if ref else "  1.00x"
        print(f"  {label:<58} {med * 1000:9.1f} ms  p90 {p90 * 1000:9.1f} ms  {ratio}")

    print(f"\noperator against the KMock-based emulator (medians, {runs} runs per kernel figure)")
    print("API round trip and the operator's reaction (no containers):")
    row("baseline: create + get one object (API only)", base)
    api_ref = stats(base)[0]
    row("KernelSession created -> kernel Pod exists", to_pod, api_ref)
    row("Pod reported running -> KernelSession Ready", to_ready, api_ref)
    print("create -> Ready with a real kernel (minimal image):")
    row("baseline: bare local ipykernel start (jupyter-client)", bare)
    ref = stats(bare)[0]
    row("local mode: mcp-forge apply -> Ready (podman kube play)", local, ref)
    row("cluster: KernelSession -> operator -> test kubelet -> Ready", cluster, ref)
    print(
        f"operator memory (RSS): idle {idle_rss / 2**20:.1f} MiB; before {before / 2**20:.1f} MiB; "
        f"with {sessions} KernelSessions {after / 2**20:.1f} MiB "
        f"(+{(after - before) / 2**10 / sessions:.1f} KiB per session); "
        f"{sessions} reconciled in {took:.1f} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.sessions))
