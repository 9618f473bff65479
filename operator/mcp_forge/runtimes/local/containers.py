"""What Podman says about local kernel containers: their inspect data, which run, which
die (its event stream), how one ended (an OOM kill told from the kernel log, as Podman 4.3
cannot), the memory each uses, and the pids limit written into a new one's cgroup. For
LocalRuntime (runtime.py) and its supervisor. Through Podman's API (clients/podman_api.py):
an inspect there costs ~2-5 ms where `podman container inspect` costs ~50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import POD_MISSING, Termination, termination_of
from mcp_forge.clients import podman_api
from mcp_forge.clients.podman_api import PodmanApi
from mcp_forge.clients.podman_stream import Event
from mcp_forge.runtimes.local.store import Store
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

LABEL_SELECTOR = "app.kubernetes.io/managed-by=mcp-forge"


class Containers:
    """Podman's view of the kernel containers, with the bookkeeping kept in the store."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    async def api(self) -> PodmanApi:
        return await podman_api.connect(self.settings)

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """The container's inspect data; None only when there is no such container."""
        return await (await self.api()).inspect_container(name)

    async def running(self) -> set[str]:
        """Names of the kernel containers that run now, in one call."""
        rows = await (await self.api()).containers(LABEL_SELECTOR)
        names: set[str] = set()
        for row in rows:
            names.update(n for n in row.get("Names") or [] if isinstance(n, str))
        return names

    async def image_exists(self, image: str) -> bool:
        """Is the image in Podman's store? (~5 ms; `podman image exists` ~70 ms)"""
        return await (await self.api()).image_exists(image)

    async def logs(self, name: str, lines: int = 20) -> str:
        """The container's last lines, stdout and stderr in order, at most 1500 characters."""
        text = await (await self.api()).logs(name, tail=lines, limit=6000)
        if text is None:
            return f"(no container {name})"
        return text.strip()[-1500:]

    async def deaths(self, *, subscribed: Callable[[], None] | None = None) -> AsyncIterator[Event]:
        """Kernel containers that died or were removed, as Podman reports them (about
        0.2 s after the fact here), for ever; an Event with `resync` after the stream was
        broken, when deaths may have been missed. `subscribed` is called once the stream
        is live (again)."""
        api = await self.api()
        async for event in api.events(
            label=LABEL_SELECTOR, statuses=("died", "remove", "oom"), on_connect=subscribed
        ):
            yield event

    def memory_usage(self, sessions: list[KernelSession]) -> dict[str, int]:
        """Bytes of memory each running kernel uses now (its cgroup's count), by name.

        Read from the cgroup recorded when the kernel started: no podman call.
        """
        usage: dict[str, int] = {}
        for session in sessions:
            cgroup = self.store.private(session.namespace, session.name).get("cgroup")
            if not cgroup:
                continue
            for path in (
                Path("/sys/fs/cgroup/memory") / cgroup / "memory.usage_in_bytes",
                Path("/sys/fs/cgroup") / cgroup / "memory.current",
            ):
                with contextlib.suppress(OSError, ValueError):
                    usage[session.name] = int(path.read_text())
                    break
        return usage

    async def termination(self, session: KernelSession, name: str) -> Termination | None:
        """How the session's kernel container `name` ended; None while it runs."""
        info = await self.inspect(name)
        if info is None:
            return Termination(POD_MISSING, None, "the kernel's pod is gone")
        state = info.get("State", {})
        if state.get("Running"):
            return None
        code = state.get("ExitCode")
        oom = bool(state.get("OOMKilled")) or (
            code == 137 and await self._oom_killed(session, info)
        )
        return termination_of(code, oom=oom, memory_limit=session.spec.memory)

    def limit_pids(self, session: KernelSession, info: dict[str, Any]) -> None:
        """Apply spec.resources.pids to the kernel's cgroup.

        Podman 4.3.1's kube play has no per-container pids limit (no annotation, and
        `podman update` has no --pids-limit), so write pids.max of the container's
        cgroup, v1 or v2, right after each start.
        """
        cgroup = str(info.get("State", {}).get("CgroupPath", "")).lstrip("/")
        if not cgroup:
            # It died already (a kernel that exits at start): waiting for it says why.
            return
        for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
            target = root / cgroup / "pids.max"
            if target.is_file():
                target.write_text(str(session.spec.pids))
                return
        log.warning("no pids cgroup for %s: its pids limit is not applied", session.name)

    def weigh_cpu(self, session: KernelSession, info: dict[str, Any]) -> None:
        """Give the kernel's pod a CPU weight in proportion to spec.resources.cpu.

        Podman 4.3.1's kube play turns the CPU limit into a CFS quota but gives every pod
        and container the default weight (cpu.shares 1024), whatever its request: a
        session of one core and one of a quarter core weighed the same, and on a busy
        host a one-core session waiting to run `1+1` queued behind ten quarter-core
        kernels spinning at their caps (tests/drills/neighbours.py --kind spin: its
        execute_code p99 rose 160 ms). A request is a weight on Kubernetes (the
        kubelet's cpu.shares = millicores * 1024 / 1000, at least 2; cpu.weight on
        cgroup v2 converted as the kubelet does), so it is here: written to the pod's
        cgroup, where pods compete, and the container's, right after each start.
        """
        cgroup = str(info.get("State", {}).get("CgroupPath", "")).lstrip("/")
        pod = str(info.get("Pod", ""))
        if not cgroup:
            return  # it died already: waiting for it says why
        shares = max(2, session.spec.cpu_milli * 1024 // 1000)
        weight = 1 + ((shares - 2) * 9999) // 262142
        for root, name, value in (
            (Path("/sys/fs/cgroup/cpu"), "cpu.shares", shares),
            (Path("/sys/fs/cgroup"), "cpu.weight", weight),
        ):
            container = root / cgroup
            if not (container / name).is_file():
                continue
            targets = [container]
            if pod and pod in container.parent.name:  # the pod's own cgroup
                targets.append(container.parent)
            for target in targets:
                (target / name).write_text(str(value))
            return
        log.warning("no cpu cgroup for %s: its CPU weight is not applied", session.name)

    async def _oom_killed(self, session: KernelSession, info: dict[str, Any]) -> bool:
        """Was the kernel's last death an OOM kill?

        Podman's OOMKilled flag is only set when the container's init dies of it, and on
        cgroup v1 hosts not even then; the kernel (under tini) is a child. The Linux
        kernel logs every memory-cgroup OOM kill with the container's cgroup, which names
        the container id, so count those. The answer is kept per death (FinishedAt), so
        asking twice about one death gives one answer.
        """
        finished = str(info.get("State", {}).get("FinishedAt", ""))
        seen = self.store.private(session.namespace, session.name).get("oom", {})
        if seen.get("finishedAt") == finished:
            return bool(seen.get("oom"))
        count = await oom_kills(info.get("Id", ""))
        oom = count > int(seen.get("count", 0))
        self._set_oom(session, {"finishedAt": finished, "count": count, "oom": oom})
        return oom

    async def started(self, session: KernelSession, info: dict[str, Any]) -> None:
        """Note a new kernel container: the baseline for telling its later death by OOM."""
        count = await oom_kills(info.get("Id", ""))
        self._set_oom(session, {"finishedAt": None, "count": count, "oom": False})

    def _set_oom(self, session: KernelSession, value: dict[str, Any]) -> None:
        private = self.store.private(session.namespace, session.name)
        private["oom"] = value
        self.store.set_private(session.namespace, session.name, private)


async def oom_kills(container_id: str) -> int:
    """How many memory-cgroup OOM kills the kernel log records for this container."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "dmesg", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError:  # no dmesg: deaths are reported by exit code only
        return 0
    try:
        async with asyncio.timeout(10):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 0
    needle = f"libpod-{container_id}".encode()
    return sum(1 for line in out.splitlines() if b"oom-kill:" in line and needle in line)


def lifetime(info: dict[str, Any] | None) -> float | None:
    """Seconds the container ran before it stopped (None if it runs, or is unknown)."""
    state = (info or {}).get("State") or {}
    if state.get("Running"):
        return None
    try:
        started, finished = (podman_time(str(state.get(k))) for k in ("StartedAt", "FinishedAt"))
    except ValueError:
        return None
    return finished - started if finished >= started else None


def podman_time(text: str) -> float:
    """Podman's "2026-11-30T20:35:14.123456789Z" (or with an offset), in seconds."""
    m = PODMAN_TIME.match(text)
    if not m:
        raise ValueError(f"not a time: {text!r}")
    whole, frac, tz = m.groups()
    stamp = dt.datetime.fromisoformat(whole + ("+00:00" if tz == "Z" else tz))
    return stamp.timestamp() + (float("0." + frac) if frac else 0.0)


PODMAN_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")
