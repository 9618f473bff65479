"""Benchmark: what a rate-limited bridged call adds now that callsPerMinute is counted where
every gateway replica sees it: `count_call` on a session's activity Lease (the test
cluster, in namespace default) and in the local store, beside a bare GET and PATCH of a
Lease for scale.

    KUBECONFIG=/var/lib/mcp-forge/test-cluster/conf/admin.kubeconfig \\
        PYTHONPATH=operator:tests .venv/bin/python tests/bench/bench_shared_state.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp_forge.api import quota
from mcp_forge.runtimes.cluster import KubernetesRuntime
from mcp_forge.runtimes.local.store import Store
from support import kernel_session

LEASE = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": {}}


async def timed(rounds: int, call: Callable[[], Awaitable[Any]]) -> str:
    took = []
    for _ in range(rounds):
        start = time.perf_counter()
        await call()
        took.append(time.perf_counter() - start)
    took.sort()
    return (
        f"p50 {statistics.median(took) * 1000:.2f} ms, p90 {took[int(rounds * 0.9)] * 1000:.2f} ms"
    )


async def main(rounds: int) -> None:
    session = kernel_session()  # "demo" in namespace default: its Lease is ks-demo
    runtime = KubernetesRuntime()
    kube = runtime.kube
    kube.create({**LEASE, "metadata": {"name": "ks-demo", "namespace": "default"}})
    try:

        async def counted() -> None:
            assert await runtime.count_call(session, "edge", 1_000_000)

        def get() -> Awaitable[Any]:
            return asyncio.to_thread(kube.get, "Lease", "default", "ks-demo")

        def patch() -> Awaitable[Any]:
            change = {"metadata": {"annotations": {"bench": str(time.time())}}}
            return asyncio.to_thread(kube.patch, "Lease", "default", "ks-demo", change)

        print("cluster count_call:", await timed(rounds, counted))
        print("cluster GET Lease: ", await timed(rounds, get))
        print("cluster PATCH Lease:", await timed(rounds, patch))
    finally:
        kube.delete("Lease", "default", "ks-demo")
        runtime.close()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store.db")
        store.create({"metadata": {"namespace": "default", "name": "demo"}}, "k" * 32)

        async def local() -> None:
            store.update_private(
                "default",
                "demo",
                "rates",
                lambda v: quota.count_call(quota.load_rates(v), "e", 1_000_000, now=time.time()),
            )

        print("local count_call (store):", await timed(rounds, local))
        store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    asyncio.run(main(parser.parse_args().rounds))
