"""Profile: where a cold local session start spends its time, next to a bare ipykernel.

    sudo .venv/bin/python tests/bench/profile_cold.py [--starts 10] [--images minimal,default]

Each round starts one cold session per image (`LocalRuntime.apply`, then deletes it) and
one bare local ipykernel (jupyter-client, as bench_local.py does), in turn, and prints
the median and p90 of each phase. The product is not changed: its methods are wrapped
here, and the rest comes from timestamps the system keeps:

  before realize   validation, image check, store row, lock
  prepare dirs     LocalRuntime._prepare_dirs (state dir, connection file, run/)
  mount workspace  volumes.ensure_workspace (sparse image, mkfs.ext4, loop mount)
  mount tmp        volumes.ensure_tmp (tmpfs)
  kube play        `podman kube play`, from exec to exit, and inside it:
    → infra        play's exec to the infra container's State.StartedAt
    → kernel ctr   infra's StartedAt to the kernel container's StartedAt
    → play exits   kernel container's StartedAt to play's exit
  started          LocalRuntime._started before wait_ready (inspect, pids, OOM baseline)
  kernel: exec → bound   the kernel's python process start (/proc/PID/stat) to its
                         sockets' creation (ctime of run/kernel-*): interpreter, imports
  kernel: bound → reply  sockets bound to the host's kernel_info reply + IOPub status
  wait_ready       LocalRuntime.wait_ready, whole
  total            apply, whole

The machine is shared and noisy: compare ratios, and run enough starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import bench_local  # tests/bench, beside this script

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients import podman
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.local import volumes
from mcp_forge.runtimes.local.containers import podman_time
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

IMAGES = {
    "minimal": "localhost/mcp-forge-kernel:0.1.0-minimal",
    "default": "localhost/mcp-forge-kernel:0.1.0",
}
PHASES = (
    "before realize",
    "prepare dirs",
    "mount workspace",
    "mount tmp",
    "kube play",
    "  → infra",
    "  → kernel ctr",
    "  → play exits",
    "started",
    "kernel: exec → bound",
    "kernel: bound → reply",
    "wait_ready",
    "kernel_info sent",
    "IOPub missed",
    "total",
)
COUNTS = ("kernel_info sent", "IOPub missed")


class Probe:
    """Wall-clock marks (time.time()) of one start, set by the wrappers below."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.counts: dict[str, int] = defaultdict(int)

    def span(self, name: str, start: float, end: float) -> None:
        self.marks[name + ".start"], self.marks[name + ".end"] = start, end


PROBE = Probe()


def timed_async(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.time()
        try:
            return await fn(*args, **kwargs)
        finally:
            PROBE.span(name, t, time.time())

    return wrapper


def instrument(rt: LocalRuntime) -> None:
    """Wrap what a cold start calls; behaviour stays the same."""
    realize, prepare, started, wait_ready = (
        rt._realize,
        rt._prepare_dirs,
        rt._started,
        rt.wait_ready,
    )

    async def _realize(*args: Any, **kwargs: Any) -> None:
        PROBE.marks["realize"] = time.time()
        await realize(*args, **kwargs)

    def _prepare_dirs(*args: Any, **kwargs: Any) -> Any:
        t = time.time()
        try:
            return prepare(*args, **kwargs)
        finally:
            PROBE.span("prepare dirs", t, time.time())

    async def _started(session: KernelSession, *, wait: bool) -> None:
        t = time.time()
        PROBE.marks["started.end"] = 0.0
        await started(session, wait=wait)
        if not PROBE.marks["started.end"]:  # wait=False: no wait_ready call
            PROBE.span("started", t, time.time())
        PROBE.marks["started.start"] = t

    async def _wait_ready(session: KernelSession) -> None:
        PROBE.marks["started.end"] = t = time.time()
        await wait_ready(session)
        PROBE.span("wait_ready", t, time.time())

    rt._realize = _realize  # type: ignore[method-assign]
    rt._prepare_dirs = _prepare_dirs  # type: ignore[method-assign]
    rt._started = _started  # type: ignore[method-assign]
    rt.wait_ready = _wait_ready  # type: ignore[method-assign]
    volumes.ensure_workspace = timed_async("mount workspace", volumes.ensure_workspace)  # type: ignore[assignment]
    volumes.ensure_tmp = timed_async("mount tmp", volumes.ensure_tmp)  # type: ignore[assignment]

    run = podman.run

    async def podman_run(*args: str, **kwargs: Any) -> Any:
        if args[:2] != ("kube", "play"):
            return await run(*args, **kwargs)
        return await timed_async("kube play", run)(*args, **kwargs)

    podman.run = podman_run

    send, iopub_live = KernelConnection.send, KernelConnection._iopub_live

    def counted_send(self: KernelConnection, sock: Any, msg_type: str, *a: Any, **k: Any) -> Any:
        if msg_type == "kernel_info_request":
            PROBE.counts["kernel_info sent"] += 1
        return send(self, sock, msg_type, *a, **k)

    async def counted_iopub(self: KernelConnection, timeout: float) -> bool:
        got = await iopub_live(self, timeout)
        if not got:
            PROBE.counts["IOPub missed"] += 1
        return got

    KernelConnection.send = counted_send  # type: ignore[method-assign]
    KernelConnection._iopub_live = counted_iopub  # type: ignore[method-assign]


def _ticks_to_wall() -> Callable[[int], float]:
    """/proc/PID/stat's starttime (clock ticks since boot) as wall-clock seconds."""
    hz = os.sysconf("SC_CLK_TCK")
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return lambda ticks: boot + ticks / hz


def _kernel_exec(tini_pid: int) -> float | None:
    """Wall-clock start of the kernel's python process (tini's child, else tini)."""
    to_wall = _ticks_to_wall()
    pid = tini_pid
    try:
        children = Path(f"/proc/{tini_pid}/task/{tini_pid}/children").read_text().split()
        if children:
            pid = int(children[0])
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return to_wall(int(stat.rsplit(")", 1)[1].split()[19]))


async def _inspect(*args: str) -> Any:
    done = await podman.run(*args, check=False)
    return json.loads(done.stdout or b"null")


async def system_marks(rt: LocalRuntime, session: KernelSession) -> dict[str, float]:
    """After the start: timestamps the system kept (Podman's, /proc's, the sockets')."""
    marks: dict[str, float] = {}
    pod = await _inspect("pod", "inspect", rt.pod_name(session))
    pod = pod[0] if isinstance(pod, list) else pod
    infra = (pod or {}).get("InfraContainerID")
    if infra:
        info = await _inspect("container", "inspect", infra)
        marks["infra"] = podman_time(info[0]["State"]["StartedAt"])
    kernel = await rt.containers.inspect(rt.container_name(session))
    if kernel:
        marks["kernel ctr"] = podman_time(kernel["State"]["StartedAt"])
        exec_at = _kernel_exec(int(kernel["State"]["Pid"]))
        if exec_at is not None:
            marks["exec"] = exec_at
    marks.update(_bound(Path(rt.host_paths(session).run)))
    return marks


def _bound(run: Path) -> dict[str, float]:
    """When the kernel bound its last socket: the socket files' creation (ctime)."""
    sockets = list(run.glob("kernel-*"))
    return {"bound": max(s.lstat().st_ctime for s in sockets)} if sockets else {}


def phases(m: dict[str, float], counts: dict[str, int], t0: float, t1: float) -> dict[str, float]:
    def d(a: str, b: str) -> float | None:
        return m[b] - m[a] if a in m and b in m else None

    out = {
        "before realize": d("t0", "realize"),
        "prepare dirs": d("prepare dirs.start", "prepare dirs.end"),
        "mount workspace": d("mount workspace.start", "mount workspace.end"),
        "mount tmp": d("mount tmp.start", "mount tmp.end"),
        "kube play": d("kube play.start", "kube play.end"),
        "  → infra": d("kube play.start", "infra"),
        "  → kernel ctr": d("infra", "kernel ctr"),
        "  → play exits": d("kernel ctr", "kube play.end"),
        "started": d("started.start", "started.end"),
        "kernel: exec → bound": d("exec", "bound"),
        "kernel: bound → reply": d("bound", "wait_ready.end"),
        "wait_ready": d("wait_ready.start", "wait_ready.end"),
        "kernel_info sent": float(counts["kernel_info sent"]),
        "IOPub missed": float(counts["IOPub missed"]),
        "total": t1 - t0,
    }
    return {k: v for k, v in out.items() if v is not None}


def body(name: str, image: str) -> dict[str, object]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {"image": image, "resources": {"memory": "512Mi"}},
    }


async def cold_start(rt: LocalRuntime, image: str) -> dict[str, float]:
    global PROBE
    PROBE = Probe()
    name = f"prof-{uuid.uuid4().hex[:8]}"
    t0 = time.time()
    PROBE.marks["t0"] = t0
    applied = await rt.apply(body(name, image))
    t1 = time.time()
    PROBE.marks.update(await system_marks(rt, applied.session))
    result = phases(PROBE.marks, PROBE.counts, t0, t1)
    await rt.delete(name)
    return result


async def bare_start() -> float:
    took, km = await bench_local.bare_start()
    await km.shutdown_kernel(now=True)
    return took


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


async def main(starts: int, images: list[str], raw: bool) -> None:
    state = Path(tempfile.mkdtemp(prefix="mf-prof-", dir="/tmp"))
    rt = LocalRuntime(Settings(state_dir=state))
    instrument(rt)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in images}
    bare: list[float] = []
    try:
        for variant in images:  # one start each first, not counted: caches, the API service
            await cold_start(rt, IMAGES[variant])
        await bare_start()
        for i in range(starts):
            for variant in images:
                results[variant].append(await cold_start(rt, IMAGES[variant]))
                if raw:
                    last = results[variant][-1]
                    print(variant, i, " ".join(f"{k.strip()}={v:.3f}" for k, v in last.items()))
            bare.append(await bare_start())
    finally:
        for s in await rt.list():
            await rt.delete(s.name, s.namespace)
        shutil.rmtree(state, ignore_errors=True)

    bm, b90 = stats(bare)
    head = "".join(f"{v + ' p50':>13}{'p90':>8}" for v in images)
    print(f"\ncold start, seconds (n={starts} each, one of each in turn)")
    print(f"{'phase':24}{head}")
    for phase in PHASES:
        row = f"{phase:24}"
        for variant in images:
            xs = [r[phase] for r in results[variant] if phase in r]
            if not xs:
                row += f"{'-':>13}{'-':>8}"
                continue
            m, p90 = stats(xs)
            fmt = ".0f" if phase in COUNTS else ".3f"
            row += f"{m:>13{fmt}}{p90:>8{fmt}}"
        print(row)
    print(f"{'bare ipykernel':24}" + f"{bm:>13.3f}{b90:>8.3f}" * len(images))
    ratios = ""
    for variant in images:
        tm, t90 = stats([r["total"] for r in results[variant]])
        ratios += f"{tm / bm:>12.2f}x{t90 / b90:>7.2f}x"
    print(f"{'total / bare':24}{ratios}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--images", default="minimal,default")
    p.add_argument("--raw", action="store_true", help="print every start's phases too")
    a = p.parse_args()
    asyncio.run(main(a.starts, a.images.split(","), a.raw))
