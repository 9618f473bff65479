"""Benchmark: a cluster's suspend and resume with memory (control/snapshots.py) next to
what it saves, in one run, on the real test cluster.

    sudo .venv/bin/python tests/bench/bench_cluster_snapshots.py [--sizes 50,500] [--runs 3]

It uses the running test cluster (tests/kube/cluster up), or starts one and stops it at
the end, and runs the operator in this process (as tests/kube do) with its snapshot
RuntimeClass set. For kernels holding about 50 MB and 500 MB of resident memory (a numpy
array of that many bytes, filled), medians of:
  * suspend: operatingMode Suspended applied, until the session is Suspended with its
    snapshot; the kubelet's checkpoint alone (status.snapshot.seconds); the archive's size;
  * resume: operatingMode Running applied (once the suspended pod is gone, as it is by an
    idle session's next use), until the woken kernel answers a call that reads the array
    (its pod made on the node, restored, the client connected again);
next to the baselines, timed the same way: a new session until its kernel answers `1`,
and a new session plus re-running the cell that built the state. Then forks
(control/forking.py): `--forks` KernelSessions naming a live 50 MB kernel as their
parent, made at once as one batch (one checkpoint, as the gateway makes its copies),
until each answers a call that reads its parent's array, next to as many new sessions
made at once until each has built the array itself. `--sizes ""` times forks only;
`--workspace-mb N` gives them persistent workspaces, the parent's with N MB of files (a
fork's is a copy). `--store claim` has each snapshot stored in its session's claim
(control/snapstore.py) and woken from there, the node's archive removed before each
resume: "store" is the copy's time from its pod's creation. The machines are shared and
noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
os.environ["MCPFORGE_SNAPSHOT_RUNTIME_CLASS"] = "mcpforge-restore"  # read at the operator's start

import kubernetes  # noqa: E402
from bench_operator import cluster  # noqa: E402

from kube.conftest import RESTRICTED, delete_namespace, make_namespace  # noqa: E402
from kube.harness import (  # noqa: E402
    KS,
    eventually,
    kernel,
    phase,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
)
from kube.test_checkpoint import RESTORE_CLASS, _runtime_class  # noqa: E402
from kube.testcluster import ROOT as NODE_ROOT  # noqa: E402
from mcp_forge.api.forks import FORK_BATCH, FORKED_FROM  # noqa: E402
from mcp_forge.clients.kube import Kube  # noqa: E402

IMAGE = "localhost/mcp-forge-kernel:0.1.0"  # numpy
BUILD = "import numpy as np\nstate = np.ones({n} // 8)\nprint('built')"
READ = "print(float(state[-1]))"
CHECKPOINTS = NODE_ROOT / "kubelet" / "checkpoints"


def spec(megabytes: int) -> dict[str, Any]:
    return {
        "image": IMAGE,
        "resources": {"memory": f"{max(1024, megabytes * 2 + 512)}Mi", "cpu": "1"},
    }


async def timed(step: Any) -> float:
    started = time.perf_counter()
    await step
    return time.perf_counter() - started


async def new_session(kube: Kube, ns: str, megabytes: int, cell: str) -> float:
    """A new session, until its kernel ran `cell`; then it goes."""
    name = f"c{uuid.uuid4().hex[:8]}"

    async def start() -> None:
        await asyncio.to_thread(kube.create, session_body(name, ns, **spec(megabytes)))
        await ready(kube, ns, name)
        async with kernel(kube, ns, name) as conn:
            await run_in_kernel(conn, cell, timeout=600)

    try:
        return await timed(start())
    finally:
        await asyncio.to_thread(kube.delete, KS, ns, name)


async def one_size(kube: Kube, ns: str, megabytes: int, runs: int, store: bool) -> dict[str, float]:
    build = BUILD.format(n=megabytes * 1_000_000)
    out: dict[str, list[float]] = {
        k: [] for k in ("suspend", "checkpoint", "size", "store", "resume", "new", "cold")
    }
    name = f"b{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(kube.create, session_body(name, ns, **spec(megabytes)))
    obj = await ready(kube, ns, name)
    async with kernel(kube, ns, name) as conn:
        await run_in_kernel(conn, build, timeout=600)
    for _ in range(runs):

        async def suspend() -> None:
            mode = {"spec": {"operatingMode": "Suspended"}}
            await asyncio.to_thread(kube.patch, KS, ns, name, mode)
            await eventually(
                kube, KS, ns, name,
                lambda o: phase(o) == "Suspended" and bool((o or {})["status"].get("snapshot")),
                timeout=600, what="Suspended with a snapshot",
            )  # fmt: skip

        out["suspend"].append(await timed(suspend()))
        # A resume comes later than this (an idle session's next use): the old pod has
        # gone by then, and its successor, of the same name, is not made before it has.
        pod = str(obj["status"]["podName"])
        await eventually(kube, "Pod", ns, pod, lambda o: o is None, timeout=120, what="gone")
        snap = (await asyncio.to_thread(kube.get, KS, ns, name) or {})["status"]["snapshot"]
        out["checkpoint"].append(float(snap["seconds"]))
        out["size"].append((CHECKPOINTS / snap["archive"]).stat().st_size / 1e6)
        if store:
            out["store"].append(await stored(kube, ns, name))
            (CHECKPOINTS / snap["archive"]).unlink()  # woken from the claim's copy
        before = str(obj["status"].get("kernelId") or "")

        async def resume(before: str = before) -> None:
            patch = {"spec": {"operatingMode": "Running"}}
            await asyncio.to_thread(kube.patch, KS, ns, name, patch)
            await ready(kube, ns, name, other_than=before)
            async with kernel(kube, ns, name) as conn:
                await run_in_kernel(conn, READ, timeout=600)

        out["resume"].append(await timed(resume()))
        now: dict[str, Any] | None = await asyncio.to_thread(kube.get, KS, ns, name)
        obj = now or obj
        last = obj["status"].get("lastRestore") or {}
        if last.get("outcome") != "Restored":
            raise RuntimeError(f"{name}: not restored: {last}")
    await asyncio.to_thread(kube.delete, KS, ns, name)
    for _ in range(runs):
        out["new"].append(await new_session(kube, ns, megabytes, "1"))
        out["cold"].append(await new_session(kube, ns, megabytes, build + "\n" + READ))
    return {k: statistics.median(v) if v else 0.0 for k, v in out.items()}


async def stored(kube: Kube, ns: str, name: str) -> float:
    """Seconds the store of the session's snapshot took, once it ended."""

    def outcome(o: dict[str, Any] | None) -> str:
        snap = ((o or {}).get("status") or {}).get("snapshot") or {}
        return str((snap.get("stored") or {}).get("outcome") or "")

    obj = await eventually(
        kube, KS, ns, name, lambda o: outcome(o) in ("Stored", "Failed"), timeout=600,
        what="stored",
    )  # fmt: skip
    if outcome(obj) != "Stored":
        raise RuntimeError(f"{name}: not stored: {(obj or {}).get('status')}")
    return float((obj or {})["status"]["snapshot"]["stored"]["seconds"])


FORK_SPEC = {"image": IMAGE, "resources": {"memory": "512Mi", "cpu": "100m"}}


def files_cell(megabytes: int) -> str:
    """Writes `megabytes` of files into the workspace (ten files), as a parent's state."""
    each = megabytes * 100_000
    return f"for i in range(10):\n    open(f'f{{i}}', 'wb').write(b'x' * {each})\n"


def files_read(megabytes: int) -> str:
    total = megabytes * 1_000_000
    return f"import os\nassert sum(os.path.getsize(f'f{{i}}') for i in range(10)) == {total}\n"


async def forks(
    kube: Kube, ns: str, count: int, runs: int, workspace_mb: int = 0
) -> tuple[float, float]:
    """Medians of: `count` forks of a 50 MB kernel made at once, until each read the
    array; `count` new sessions made at once, until each built it. With `workspace_mb`,
    each has a persistent workspace, the parent's holding that many MB of files: a
    fork's is a copy (control/forkfiles.py), a new session writes its own."""
    build = BUILD.format(n=50_000_000)
    fork_spec = dict(FORK_SPEC)
    if workspace_mb:
        size = f"{max(64, workspace_mb * 2)}Mi"
        fork_spec["workspace"] = {"persistent": True, "size": size}
        build += "\n" + files_cell(workspace_mb)
    read = READ + ("\n" + files_read(workspace_mb) if workspace_mb else "")
    parent = f"p{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(kube.create, session_body(parent, ns, **fork_spec))
    await ready(kube, ns, parent)
    async with kernel(kube, ns, parent) as conn:
        await run_in_kernel(conn, build, timeout=600)

    async def one(name: str, cell: str, annotations: dict[str, str]) -> None:
        body = session_body(name, ns, **fork_spec)
        body["metadata"]["annotations"] = annotations
        await asyncio.to_thread(kube.create, body)
        obj = await ready(kube, ns, name)
        if annotations and (obj["status"].get("fork") or {}).get("outcome") != "Forked":
            raise RuntimeError(f"{name}: not forked: {obj['status'].get('fork')}")
        async with kernel(kube, ns, name) as conn:
            await run_in_kernel(conn, cell, timeout=600)

    async def many(cell: str, annotations: dict[str, str]) -> float:
        names = [f"f{uuid.uuid4().hex[:8]}" for _ in range(count)]
        try:
            return await timed(asyncio.gather(*(one(n, cell, annotations) for n in names)))
        finally:
            for name in names:
                await asyncio.to_thread(kube.delete, KS, ns, name)

    forked, built = [], []
    for _ in range(runs):
        batch = {FORKED_FROM: parent, FORK_BATCH: uuid.uuid4().hex[:8]}  # as the gateway's
        forked.append(await many(read, batch))
        built.append(await many(build + "\n" + read, {}))
    await asyncio.to_thread(kube.delete, KS, ns, parent)
    return statistics.median(forked), statistics.median(built)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,500", help="resident MB of each kernel")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--forks", type=int, default=10, help="copies of one fork (0: none)")
    parser.add_argument(
        "--workspace-mb", type=int, default=0, help="MB of files in the forks' parent's workspace"
    )
    parser.add_argument("--store", choices=["node", "claim"], default="node")
    args = parser.parse_args()
    os.environ["MCPFORGE_SNAPSHOT_STORE"] = args.store  # read at the operator's start
    with cluster() as kubeconfig:
        # The library read $KUBECONFIG at its import: its copies too (kopf's Kube uses them).
        os.environ["KUBECONFIG"] = str(kubeconfig)
        kubernetes.config.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
        kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
        kubernetes.config.load_kube_config(str(kubeconfig))
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
        kube = Kube(config)
        ns = f"bench-snap-{uuid.uuid4().hex[:6]}"
        await asyncio.to_thread(make_namespace, kubeconfig, ns, RESTRICTED)
        await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
        print(
            f"{'kernel':>8} {'archive':>8} {'suspend':>8} {'(ckpt)':>7} {'store':>6} {'resume':>8} "
            f"{'new':>6} {'new+cell':>9} {'ratio':>6}"
        )
        try:
            async with running_operator(kube):
                for mb in (int(x) for x in args.sizes.split(",") if x):
                    m = await one_size(kube, ns, mb, args.runs, args.store == "claim")
                    print(
                        f"{mb:>6}MB {m['size']:>6.0f}MB {m['suspend']:>7.2f}s "
                        f"{m['checkpoint']:>6.2f}s {m['store']:>5.2f}s {m['resume']:>7.2f}s "
                        f"{m['new']:>5.2f}s "
                        f"{m['cold']:>8.2f}s {m['resume'] / m['cold']:>6.2f}",
                        flush=True,
                    )
                if args.forks:
                    forked, built = await forks(kube, ns, args.forks, args.runs, args.workspace_mb)
                    files = f" and {args.workspace_mb} MB of files" if args.workspace_mb else ""
                    print(
                        f"{args.forks} forks of a 50 MB kernel{files}, each answering: "
                        f"{forked:.2f}s; "
                        f"{args.forks} new sessions, each built it: {built:.2f}s; "
                        f"ratio {forked / built:.2f}",
                        flush=True,
                    )
        finally:
            await asyncio.to_thread(delete_namespace, kubeconfig, ns)
            kube.close()
    print("suspend: applied Suspended until Suspended with a snapshot (ckpt: the kubelet's")
    print("checkpoint); resume: applied Running until the woken kernel answers a call that")
    print("reads the state; new: a new session until it runs `1`; new+cell: until it has")
    print("built the state again; ratio: resume / new+cell; medians of", args.runs)


if __name__ == "__main__":
    asyncio.run(main())
