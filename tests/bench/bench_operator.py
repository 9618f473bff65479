"""Benchmark: the operator on the real test cluster, with real kernels on its real kubelet.

    sudo .venv/bin/python tests/bench/bench_operator.py [--runs 10] [--sessions 200]

It uses the running test cluster (tests/kube/cluster up), or starts one and stops it at the
end. The operator is `mcp-forge operator` (a subprocess, as it runs in a cluster) with a
ServiceAccount token of its own, so the API server's audit log tells its requests from
everyone else's. In one run, medians (and p90) of:
  * baseline: one object created and read back (a Secret) by this script;
  * KernelSession created -> its kernel Pod exists; Pod running (as the kubelet reports
    it) -> KernelSession Ready;
  * create -> Ready, which on a cluster as locally means the kernel answered a
    kernel_info_request (the operator's, control/answers.py; local mode's gateway's),
    next to a bare local ipykernel start (jupyter-client) and local mode's create ->
    Ready (`mcp-forge apply`'s path); and create -> a new client's kernel_info answered at
    the pod IP (the Secret and status read, then connected, as a gateway does);
  * the same with `spec.poolRef`: a kernel claimed from a KernelSessionPool of 2 (refilled
    between runs, and the last claim's kernel gone, untimed), created and connected to by
    the gateway's own code (its KubernetesRuntime: create, wait for Ready, read the
    Secret): create -> Ready, and create -> kernel_info answered;
  * N KernelSessions created and reconciled (operatingMode Suspended: every child but the
    pod, so that N kernels need not fit in memory): the time, the operator's memory (RSS)
    and its API requests per session;
  * the operator's writes in a quiet minute after that, while it resyncs all N (zero).
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kubernetes

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from bench_local import bare_start  # noqa: E402

from kube import testcluster  # noqa: E402
from kube.conftest import (  # noqa: E402
    KERNEL_IMAGES,
    delete_namespace,
    install_crds,
    make_namespace,
)
from kube.harness import (  # noqa: E402
    KERNEL_DEADLINE,
    KS,
    _next_event,
    condition,
    eventually,
    kernel,
    session_body,
)
from mcp_forge.clients.kube import Kube  # noqa: E402
from mcp_forge.jupyter.client import KernelConnection  # noqa: E402
from mcp_forge.runtimes.cluster import KubernetesRuntime  # noqa: E402
from mcp_forge.settings import Settings  # noqa: E402

OPERATOR = str(Path(sys.executable).parent / "mcp-forge")
MINIMAL = "localhost/mcp-forge-kernel:0.1.0-minimal"
CLUSTER = str(ROOT / "tests" / "kube" / "cluster")
AUDIT = testcluster.ROOT / "logs" / "audit.log"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
QUIET = 60.0


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def cluster() -> Iterator[Path]:
    """The running test cluster, or one started for this run."""
    already = subprocess.run([CLUSTER, "status"], capture_output=True).returncode == 0
    if not already:
        subprocess.run([CLUSTER, "up"], check=True, stdout=subprocess.DEVNULL)
    try:
        subprocess.run([CLUSTER, "import", *KERNEL_IMAGES], check=True)
        kubeconfig = testcluster.ROOT / "conf" / "admin.kubeconfig"
        install_crds(kubeconfig)
        yield kubeconfig
    finally:
        if not already:
            subprocess.run([CLUSTER, "down"], check=False)


def operator_identity(admin: Path, ns: str, out: Path) -> str:
    """A ServiceAccount (cluster-admin) and a kubeconfig with its token; its user name."""
    kubectl = str(testcluster.ROOT / "bin" / "kubectl")
    base = [kubectl, f"--kubeconfig={admin}"]
    subprocess.run([*base, "-n", ns, "create", "serviceaccount", "bench-operator"], check=True)
    subprocess.run(
        [*base, "create", "clusterrolebinding", f"bench-operator-{ns}", "--clusterrole",
         "cluster-admin", f"--serviceaccount={ns}:bench-operator"],
        check=True,
    )  # fmt: skip
    token = subprocess.run(
        [*base, "-n", ns, "create", "token", "bench-operator", "--duration=2h"],
        check=True,
        text=True,
        capture_output=True,
    ).stdout.strip()
    config = json.loads(admin.read_text())
    config["users"] = [{"name": "bench-operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "bench-operator"
    out.write_text(json.dumps(config))
    out.chmod(0o600)
    return f"system:serviceaccount:{ns}:bench-operator"


def forget_operator(admin: Path, ns: str) -> None:
    kubectl = str(testcluster.ROOT / "bin" / "kubectl")
    subprocess.run(
        [kubectl, f"--kubeconfig={admin}", "delete", "clusterrolebinding", f"bench-operator-{ns}"],
        check=False,
        capture_output=True,
    )


@contextlib.asynccontextmanager
async def operator(kubeconfig: Path, ns: str) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(kubeconfig)
    log = open(kubeconfig.parent / "operator.log", "wb")  # noqa: SIM115, ASYNC230
    proc = await asyncio.create_subprocess_exec(
        OPERATOR, "operator", "--namespace", ns, env=env, stdout=log, stderr=log
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


class Audit:
    """The operator's requests, read from the API server's audit log between two marks."""

    def __init__(self, user: str) -> None:
        self.user = user
        self.at = AUDIT.stat().st_size if AUDIT.exists() else 0

    def since(self) -> Counter[str]:
        """Requests since the last call, by verb (the log is appended as requests finish)."""
        with AUDIT.open("rb") as f:
            f.seek(self.at)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.at += end
        verbs: Counter[str] = Counter()
        for line in data[:end].splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") == self.user:
                verbs[event["verb"]] += 1
        return verbs


def ready(o: dict[str, Any] | None) -> bool:
    return condition(o, "Ready").get("status") == "True"


def running(p: dict[str, Any] | None) -> bool:
    return ((p or {}).get("status") or {}).get("phase") == "Running"


async def operator_up(kube: Kube, ns: str) -> None:
    """The operator watches: a probe session gets its pod."""
    await asyncio.to_thread(kube.create, session_body("probe", ns, operatingMode="Suspended"))
    await eventually(kube, KS, ns, "probe", lambda o: bool((o or {}).get("status")), timeout=60)
    await asyncio.to_thread(kube.delete, KS, ns, "probe")


async def api_baseline(kube: Kube, ns: str, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        name = f"s-{uuid.uuid4().hex[:8]}"
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}}
        t = time.perf_counter()
        await asyncio.to_thread(kube.create, body)
        await asyncio.to_thread(kube.get, "Secret", ns, name)
        out.append(time.perf_counter() - t)
    return out


async def with_kernels(
    kube: Kube, ns: str, runs: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per cold session: create -> Pod, Pod running -> Ready, create -> Ready (the kernel
    answered the operator: local mode's Ready means the same), create -> a new client's
    kernel_info answered (the Secret and status read, then connected)."""
    to_pod, to_ready, to_answered, to_answer = [], [], [], []
    for _ in range(runs):
        name = f"k-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        await asyncio.to_thread(kube.create, session_body(name, ns, image=MINIMAL))
        await eventually(kube, "Pod", ns, f"ks-{name}", lambda p: p is not None, timeout=60)
        to_pod.append(time.perf_counter() - t0)
        await eventually(kube, "Pod", ns, f"ks-{name}", running, timeout=120)
        t1 = time.perf_counter()
        await eventually(kube, KS, ns, name, ready, timeout=60)
        to_ready.append(time.perf_counter() - t1)
        to_answered.append(time.perf_counter() - t0)
        async with kernel(kube, ns, name):  # kernel_info answered
            to_answer.append(time.perf_counter() - t0)
        await asyncio.to_thread(kube.delete, KS, ns, name)
        await eventually(kube, "Pod", ns, f"ks-{name}", lambda p: p is None, timeout=120)
    return to_pod, to_ready, to_answered, to_answer


async def warm_kernels(kube: Kube, ns: str, runs: int) -> tuple[list[float], list[float]]:
    small = {"cpu": "100m", "memory": "256Mi"}  # a pool of 2 and a claimed one fit 2 CPUs
    pool = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {"size": 2, "template": {"image": MINIMAL, "resources": small}},
    }
    await asyncio.to_thread(kube.create, pool)

    def full(o: dict[str, Any] | None) -> bool:
        """Two ready kernels in the pool: as its status says, and as its pods are (the
        status may still show a kernel the last claim took)."""
        if ((o or {}).get("status") or {}).get("ready") != 2:
            return False
        pods = kube.list("Pod", ns, labels={"mcpforge.dev/pool": "bench"}).get("items") or []
        return len(pods) == 2 and all(
            any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or [])
            for p in pods
        )  # fmt: skip

    gateway = KubernetesRuntime(Settings(session_namespace=ns, kube_connect="pod-ip"), kube)
    to_ready, to_answer = [], []
    try:
        for _ in range(runs):
            await eventually(kube, "KernelSessionPool", ns, "bench", full, timeout=120)
            name = f"w-{uuid.uuid4().hex[:8]}"
            body = session_body(name, ns, image=MINIMAL, resources=small, poolRef={"name": "bench"})
            t0 = time.perf_counter()
            session = await gateway.create(body)  # the gateway's path: created, Ready
            to_ready.append(time.perf_counter() - t0)
            assert condition({"status": session.status}, "WarmStart").get("status") == "True"
            info = await gateway.connection(session)
            conn = KernelConnection(info, max_frame=16 << 20, max_message=32 << 20)
            try:
                await conn.wait_ready(KERNEL_DEADLINE)  # kernel_info answered
                to_answer.append(time.perf_counter() - t0)
            finally:
                conn.close()
            await asyncio.to_thread(kube.delete, KS, ns, name)
            # Its kernel gone before the next claim: each claim into a settled cluster,
            # not beside the last one's teardown (the kubelet's, the garbage collector's).
            pod = str(session.status.get("podName") or "")
            await eventually(kube, "Pod", ns, pod, lambda p: p is None, timeout=120)
    finally:
        gateway.close()
    await asyncio.to_thread(kube.delete, "KernelSessionPool", ns, "bench")
    return to_ready, to_answer


async def local_baseline(runs: int) -> list[float]:
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    state = Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
    runtime = LocalRuntime(Settings(state_dir=state))
    out = []
    try:
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
    finally:
        shutil.rmtree(state, ignore_errors=True)  # its store; each session deleted above
    return out


async def many(kube: Kube, ns: str, count: int) -> float:
    names = [f"m-{i:04d}" for i in range(count)]
    t = time.perf_counter()
    for name in names:
        await asyncio.to_thread(
            kube.create, session_body(name, ns, image=MINIMAL, operatingMode="Suspended")
        )
    for name in names:
        await eventually(kube, KS, ns, name, lambda o: bool((o or {}).get("status")), timeout=300)
        await eventually(kube, "Lease", ns, f"ks-{name}", lambda o: o is not None, timeout=300)
    return time.perf_counter() - t


async def settled(kube: Kube, ns: str, count: int) -> None:
    """The operator's last writes for the `count` sessions `many` made are in: each
    one's Suspended Event (written in a thread of its own, after its status)."""
    deadline = time.monotonic() + 300
    while True:
        listed = await asyncio.to_thread(kube.list, "Event", ns)
        told = {
            e["involvedObject"]["name"]
            for e in listed.get("items") or []
            if e.get("reason") == "Suspended"
        }
        if sum(1 for n in told if n.startswith("m-")) >= count:
            return
        left = deadline - time.monotonic()
        assert left > 0, f"{len(told)} of {count} Suspended Events"
        rv = str(listed["metadata"].get("resourceVersion") or "0")
        await asyncio.to_thread(_next_event, kube, "Event", ns, None, rv, min(left, 2.0))


async def main(runs: int, sessions: int) -> None:
    bare = []
    for _ in range(runs):
        took, km = await bare_start()
        bare.append(took)
        await km.shutdown_kernel(now=True)
    local = await local_baseline(runs)
    with cluster() as admin:
        ns = f"bench-{secrets.token_hex(3)}"
        make_namespace(admin, ns, {})
        work = Path(tempfile.mkdtemp(prefix="bench-operator-"))
        user = operator_identity(admin, ns, work / "kubeconfig")
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(str(admin), client_configuration=config)
        kube = Kube(config)
        try:
            async with operator(work / "kubeconfig", ns) as proc:
                await operator_up(kube, ns)
                idle_rss = rss(proc.pid)
                base = await api_baseline(kube, ns, runs * 5)
                to_pod, to_ready, to_answered, to_answer = await with_kernels(kube, ns, runs)
                warm_ready, warm_answer = await warm_kernels(kube, ns, runs)
                audit = Audit(user)
                before = rss(proc.pid)
                took = await many(kube, ns, sessions)
                after = rss(proc.pid)
                await settled(kube, ns, sessions)
                burst = audit.since()
                await asyncio.sleep(QUIET)  # the measurement: a minute with nothing to do
                quiet = audit.since()
        finally:
            kube.close()
            delete_namespace(admin, ns)
            forget_operator(admin, ns)
            shutil.rmtree(work, ignore_errors=True)  # the operator's kubeconfig and log

    def row(label: str, xs: list[float], ref: float | None = None) -> None:
        med, p90 = stats(xs)
        ratio = f"{med / ref:6.2f}x" if ref else "  1.00x"
        print(f"  {label:<58} {med * 1000:9.1f} ms  p90 {p90 * 1000:9.1f} ms  {ratio}")

    print(f"\noperator on the real test cluster (medians, {runs} runs per kernel figure)")
    print("the operator's reaction, next to one API round trip:")
    row("baseline: create + get one object (API only)", base)
    api_ref = stats(base)[0]
    row("KernelSession created -> kernel Pod exists", to_pod, api_ref)
    row("Pod running (kubelet) -> KernelSession Ready", to_ready, api_ref)
    print("create -> kernel answering, minimal image:")
    row("baseline: bare local ipykernel start (jupyter-client)", bare)
    ref = stats(bare)[0]
    row("local mode: mcp-forge apply -> Ready (podman kube play)", local, ref)
    row("cluster: KernelSession -> Ready (the kernel answered)", to_answered, ref)
    row("cluster: KernelSession -> a new client's kernel_info", to_answer, ref)
    row("cluster, warm (poolRef): KernelSession -> Ready", warm_ready, ref)
    row("cluster, warm (poolRef): KernelSession -> kernel_info answered", warm_answer, ref)
    print(
        f"  cold cluster Ready / local mode Ready: "
        f"{stats(to_answered)[0] / stats(local)[0]:.2f}x (issue 26 asks at most 1.3x)"
    )
    total = sum(burst.values())
    writes = sum(n for verb, n in quiet.items() if verb in WRITES)
    print(
        f"{sessions} KernelSessions (Suspended: Secret, Service, NetworkPolicy, Lease) "
        f"reconciled in {took:.1f} s; operator RSS idle {idle_rss / 2**20:.1f} MiB, "
        f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
        f"(+{(after - before) / 2**10 / sessions:.1f} KiB per session); "
        f"its API requests: {total} ({total / sessions:.1f} per session: "
        f"{dict(burst.most_common())})"
    )
    print(
        f"a quiet minute after: {sum(quiet.values())} requests, {writes} writes "
        f"({dict(quiet.most_common())})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.sessions))
