"""Local mode: KernelSessions in an embedded store, realized with `podman kube play`.

Layout under the state directory (0700, root):

    store.db                      the KernelSessions and their keys
    k/<id>/pod.yaml               what was played (no key in it)
    k/<id>/run/                   0700, uid 1000: connection file and the kernel's sockets
    k/<id>/workspace/             uid 1000: /workspace in the pod, kept across restarts
    shared/<namespace>/<group>/   uid 1000: /shared for sessions of one sharedGroup

The pod's network is `none` unless the spec allows egress; the gateway reaches the
kernel through Unix sockets in run/, which only root on the host and that one pod
can reach (the state directory is 0700).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import podman, resource
from .connection import IPC_PATH_MAX, PORTS, ConnectionInfo, new_key
from .errors import ImageError, InvalidSession, PodmanError, SessionNotFound, SessionNotReady
from .kernel import KernelConnection
from .render import CONTAINER, KERNEL_UID, HostPaths, podman_pod_name, render_podman
from .resource import KernelSession
from .runtime import Termination
from .settings import Settings

log = logging.getLogger(__name__)

LABEL_SELECTOR = "app.kubernetes.io/managed-by=mcp-forge"


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


@dataclass(frozen=True)
class Applied:
    session: KernelSession
    action: str  # "created", "configured", "unchanged"
    seconds: float


class LocalRuntime:
    """The local realization of KernelSessions (see the module docstring)."""

    def __init__(self, settings: Settings | None = None) -> None:
        from .store import Store

        self.settings = settings or Settings.from_env()
        root = self.settings.state_dir
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        self.store = Store(self.settings.store_path)

    # ---- paths -------------------------------------------------------------------------

    def _dir(self, session: KernelSession) -> Path:
        return self.settings.state_dir / "k" / session.uid.replace("-", "")[:16]

    def host_paths(self, session: KernelSession) -> HostPaths:
        base = self._dir(session)
        shared = None
        if session.spec.shared_group:
            shared = str(
                self.settings.state_dir / "shared" / session.namespace / session.spec.shared_group
            )
        return HostPaths(run=str(base / "run"), workspace=str(base / "workspace"), shared=shared)

    def pod_name(self, session: KernelSession) -> str:
        return podman_pod_name(session.namespace, session.name)

    def container_name(self, session: KernelSession) -> str:
        return f"{self.pod_name(session)}-{CONTAINER}"

    # ---- reading -----------------------------------------------------------------------

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        return resource.load(self.store.get(namespace, name))

    async def list(self, namespace: str | None = None) -> builtins.list[KernelSession]:
        return [resource.load(b) for b in self.store.list(namespace)]

    async def connection(self, session: KernelSession) -> ConnectionInfo:
        key = self.store.key(session.namespace, session.name)
        return ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)

    # ---- apply / delete ------------------------------------------------------------------

    async def apply(self, body: dict[str, Any], *, wait: bool = True) -> Applied:
        """Create or update a session from a validated body; wait until Ready."""
        started = time.monotonic()
        body = resource.validate(body)
        meta = body["metadata"]
        try:
            current = self.store.get(meta["namespace"], meta["name"])
        except SessionNotFound:
            current = None
        if current is not None and current["spec"] == body["spec"]:
            session = resource.load(current)
            if session.status.get("phase") in ("Ready", "Starting", "Restarting"):
                return Applied(session, "unchanged", time.monotonic() - started)
            action = "unchanged"
        elif current is not None:
            current["spec"] = body["spec"]
            current["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            for k in ("labels", "annotations"):
                if k in meta:
                    current["metadata"][k] = meta[k]
            self.store.replace(current)
            session = resource.load(current)
            await self._remove_pod(session)
            action = "configured"
        else:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            body["status"] = {"phase": "Pending", "restarts": 0}
            await self._check_image(resource.load(body))
            self.store.create(body, new_key())
            session = resource.load(body)
            action = "created"
        await self._realize(session, wait=wait)
        return Applied(
            await self.get(session.name, session.namespace), action, time.monotonic() - started
        )

    async def _check_image(self, session: KernelSession) -> None:
        image = session.spec.image
        done = await podman.run("image", "exists", image, check=False)
        if done.returncode != 0:
            from .image import missing_image_message

            raise ImageError(missing_image_message(image))

    def _prepare_dirs(self, session: KernelSession, info: ConnectionInfo) -> HostPaths:
        paths = self.host_paths(session)
        if len(paths.run) + len("/kernel-5555") > IPC_PATH_MAX:
            raise InvalidSession(
                f"the state directory {self.settings.state_dir} is too long for Unix socket paths;"
                " set MCPFORGE_STATE_DIR to a shorter one"
            )
        base = self._dir(session)
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(base.parent, 0o700)
        for d, mode in ((paths.run, 0o700), (paths.workspace, 0o755)):
            Path(d).mkdir(exist_ok=True)
            os.chown(d, KERNEL_UID, KERNEL_UID)
            os.chmod(d, mode)
        if paths.shared:
            Path(paths.shared).mkdir(parents=True, exist_ok=True)
            os.chown(paths.shared, KERNEL_UID, KERNEL_UID)
            os.chmod(paths.shared, 0o770)
        conn = Path(paths.run) / "connection.json"
        # run/ belongs to the kernel's uid: never follow or reuse what is there (a symlink,
        # a FIFO), and change ownership through our own descriptor, not by name.
        with contextlib.suppress(FileNotFoundError):
            conn.unlink()
        fd = os.open(conn, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchown(f.fileno(), KERNEL_UID, KERNEL_UID)
            f.write(info.to_file())
        return paths

    async def _realize(self, session: KernelSession, *, wait: bool) -> None:
        info = await self.connection(session)
        paths = self._prepare_dirs(session, info)
        manifest = yaml.safe_dump_all(render_podman(session, paths), sort_keys=False)
        pod_file = self._dir(session) / "pod.yaml"
        pod_file.write_text(manifest)
        self._patch(
            session, phase="Starting", reason=None, message=None, podName=self.pod_name(session)
        )
        network = "none" if session.spec.egress == "None" else "bridge"
        try:
            await podman.run(
                "kube",
                "play",
                "--replace",
                f"--network={network}",
                str(pod_file),
                timeout=self.settings.podman_timeout,
            )
        except PodmanError as exc:
            self._patch(session, phase="Failed", reason="PlayFailed", message=str(exc)[:1000])
            raise
        await self._started(session, wait=wait)

    async def _started(self, session: KernelSession, *, wait: bool) -> None:
        info = await self._inspect(session)
        if info is not None:
            self._limit_pids(session, info)
            # The baseline for telling a later death by OOM.
            count = await self._oom_count(info.get("Id", ""))
            self._set_oom(session, {"finishedAt": None, "count": count, "oom": False})
        self._patch(
            session,
            kernelId=str(uuid.uuid4()),
            startedAt=now(),
            lastActivity=now(),
            connection={
                **(await self.connection(session)).public(),
                "generation": self._generation(session) + 1,
            },
        )
        if wait:
            await self.wait_ready(session)

    def _generation(self, session: KernelSession) -> int:
        body = self.store.get(session.namespace, session.name)
        return int(body.get("status", {}).get("connection", {}).get("generation", 0))

    async def wait_ready(self, session: KernelSession) -> None:
        """Wait for a kernel_info reply; fail fast if the container exits meanwhile."""
        conn = KernelConnection(await self.connection(session), max_message_size=1_000_000)
        try:
            ready = asyncio.ensure_future(conn.wait_ready(self.settings.kernel_ready_timeout))
            died = asyncio.ensure_future(self._wait_exited(session))
            done, _ = await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
            for task in (ready, died):
                if task not in done:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            if ready in done:
                ready.result()  # raises SessionNotReady on timeout
                self._patch(session, phase="Ready", reason=None, message=None)
                return
            term = died.result()
            logs = await self.logs(session)
            message = f"the kernel exited while starting ({term.message}): {logs}"
            self._patch(session, phase="Failed", reason=term.reason, message=message[:2000])
            raise SessionNotReady(message)
        except SessionNotReady as exc:
            if "exited while starting" not in str(exc):
                self._patch(session, phase="Failed", reason="NotReady", message=str(exc))
            raise
        finally:
            conn.close()

    async def _wait_exited(self, session: KernelSession) -> Termination:
        """Return when the kernel container stops (`podman wait`, no polling)."""
        while True:
            await podman.run(
                "wait",
                "--condition=exited",
                "--condition=stopped",
                self.container_name(session),
                check=False,
                timeout=self.settings.kernel_ready_timeout + 60,
            )
            term = await self.termination(session)
            if term is not None:
                return term

    async def logs(self, session: KernelSession, lines: int = 20) -> str:
        done = await podman.run(
            "logs", "--tail", str(lines), self.container_name(session), check=False
        )
        return (done.stdout.decode(errors="replace") + done.stderr).strip()[-1500:]

    async def delete(self, name: str, namespace: str = "default") -> None:
        session = await self.get(name, namespace)
        self._patch(session, phase="Terminating")
        await self._remove_pod(session)
        shutil.rmtree(self._dir(session), ignore_errors=True)
        self.store.delete(namespace, name)

    async def _remove_pod(self, session: KernelSession) -> None:
        done = await podman.run("pod", "rm", "-f", "-t", "2", self.pod_name(session), check=False)
        if done.returncode != 0 and "no pod with name" not in done.stderr.lower():
            raise PodmanError(["pod", "rm", self.pod_name(session)], done.returncode, done.stderr)

    # ---- observing -----------------------------------------------------------------------

    async def _inspect(self, session: KernelSession) -> dict[str, Any] | None:
        done = await podman.run("container", "inspect", self.container_name(session), check=False)
        if done.returncode != 0:
            return None
        data = json.loads(done.stdout or b"[]")
        return data[0] if data else None

    async def termination(self, session: KernelSession) -> Termination | None:
        info = await self._inspect(session)
        if info is None:
            return Termination("PodMissing", None, "the kernel's pod is gone")
        state = info.get("State", {})
        if state.get("Running"):
            return None
        code = state.get("ExitCode")
        if state.get("OOMKilled") or (code == 137 and await self._oom_killed(session, info)):
            limit = session.spec.memory
            return Termination(
                "OOMKilled",
                code,
                f"the kernel ran out of memory (limit {limit}) and was killed (OOM)",
            )
        if code == 0:
            return Termination("Completed", code, "the kernel exited")
        if isinstance(code, int) and code > 128:
            try:
                sig = signal.Signals(code - 128).name
            except ValueError:
                sig = f"signal {code - 128}"
            return Termination("Error", code, f"the kernel was killed by {sig} (exit code {code})")
        return Termination("Error", code, f"the kernel exited with code {code}")

    def _limit_pids(self, session: KernelSession, info: dict[str, Any]) -> None:
        """Apply spec.resources.pids to the kernel's cgroup.

        Podman 4.3.1's kube play has no per-container pids limit (no annotation, and
        `podman update` has no --pids-limit), so write pids.max of the container's
        cgroup, v1 or v2, right after each start.
        """
        cgroup = str(info.get("State", {}).get("CgroupPath", "")).lstrip("/")
        if not cgroup:
            raise PodmanError(["inspect"], 1, "the kernel container has no cgroup path")
        for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
            target = root / cgroup / "pids.max"
            if target.is_file():
                target.write_text(str(session.spec.pids))
                return
        log.warning("no pids cgroup for %s: its pids limit is not applied", session.name)

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
        count = await self._oom_count(info.get("Id", ""))
        oom = count > int(seen.get("count", 0))
        self._set_oom(session, {"finishedAt": finished, "count": count, "oom": oom})
        return oom

    async def _oom_count(self, container_id: str) -> int:
        try:
            proc = await asyncio.create_subprocess_exec(
                "dmesg", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
            )
        except OSError:  # no dmesg: deaths are reported by exit code only
            return 0
        out, _ = await proc.communicate()
        needle = f"libpod-{container_id}".encode()
        return sum(1 for line in out.splitlines() if b"oom-kill:" in line and needle in line)

    def _set_oom(self, session: KernelSession, value: dict[str, Any]) -> None:
        private = self.store.private(session.namespace, session.name)
        private["oom"] = value
        self.store.set_private(session.namespace, session.name, private)

    async def running_containers(self) -> set[str]:
        """Names of the kernel containers that run now, in one podman call."""
        rows = await podman.run_json(
            "ps",
            "--filter",
            f"label={LABEL_SELECTOR}",
            "--format",
            "json",
            timeout=self.settings.podman_timeout,
        )
        names: set[str] = set()
        for row in rows or []:
            names.update(n for n in row.get("Names") or [] if isinstance(n, str))
        return names

    async def refresh(self, session: KernelSession) -> KernelSession:
        """Bring status in line with what Podman shows; restart a dead kernel per policy."""
        phase = session.status.get("phase")
        if phase not in ("Ready", "Starting", "Restarting"):
            return session
        term = await self.termination(session)
        if term is None:
            if phase != "Ready":  # e.g. a process that was starting it went away
                await self.wait_ready(session)
        elif session.spec.restart_policy == "Always":
            await self.restart_kernel(
                session, reason=term.reason, crashed=True, message=term.message
            )
        else:
            self._patch(session, phase="Failed", reason=term.reason, message=term.message)
        return await self.get(session.name, session.namespace)

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        """A fresh kernel process in the same pod: the workspace stays, variables go."""
        body = self.store.get(session.namespace, session.name)
        restarts = int(body.get("status", {}).get("restarts", 0)) + (1 if crashed else 0)
        patch: dict[str, Any] = {"phase": "Restarting", "restarts": restarts}
        if crashed:
            patch.update(
                reason=reason,
                message=message or reason,
                lastTermination={"reason": reason, "message": message or reason, "at": now()},
            )
        self._patch(session, **patch)
        if await self._inspect(session) is None:
            await self._realize(session, wait=True)
            return
        # A kube-played pod stops with its last container: restart the pod, not the container.
        pod = self.pod_name(session)
        await podman.run("pod", "stop", "-t", "1", pod, timeout=self.settings.podman_timeout)
        await podman.run("pod", "start", pod, timeout=self.settings.podman_timeout)
        await self._started(session, wait=True)
        if crashed:
            self._patch(session, reason=reason, message=message or reason)

    async def record_activity(self, session: KernelSession) -> None:
        self._patch(session, lastActivity=now())

    async def cull_idle(self) -> builtins.list[str]:
        """Delete sessions idle past their idleTimeout; return their names."""
        culled = []
        for session in await self.list():
            timeout = session.spec.idle_timeout
            last = session.status.get("lastActivity") or session.body["metadata"].get(
                "creationTimestamp"
            )
            if timeout <= 0 or not last:
                continue
            if time.time() - parse_time(last) >= timeout:
                log.info(
                    "culling %s/%s: idle for more than %ss",
                    session.namespace,
                    session.name,
                    timeout,
                )
                await self.delete(session.name, session.namespace)
                culled.append(session.name)
        return culled

    def _patch(self, session: KernelSession, **patch: Any) -> None:
        with contextlib.suppress(SessionNotFound):
            self.store.patch_status(session.namespace, session.name, patch)


__all__ = ["PORTS", "Applied", "LocalRuntime"]
