"""A session's pod, made and taken down: local mode's realizer (`KernelPods`, the base of
LocalRuntime).

What it owns on the host, under the state directory (see runtime.py for the layout): the
session's directory, its connection file, the run/ directory its kernel binds its
sockets in (unsealed while the kernel starts, sealed once it answers), its workspace
and /tmp filesystems (volumes.py), and the pod played from its manifest with
`podman kube play` in the session's own user namespace (userns.py). A kernel that
answers gets its environment, files and packages over its sealed channel, then the
session is Ready. Everything it learns it writes to the session's status in the store.

What happens to a pod after it started (deaths, restarts, idle stops) is lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import IPC_PATH_MAX, PORTS, ConnectionInfo
from mcp_forge.api.kernelsession import KernelSession, parse_quantity
from mcp_forge.api.status import Termination, stamp
from mcp_forge.clients import podman, podman_api
from mcp_forge.control.lifecycle import shown
from mcp_forge.control.pods import Observation
from mcp_forge.control.render import CONTAINER, SECCOMP_PROFILE_ROOT, HostPaths, podman_pod_name
from mcp_forge.egress.client import EgressProxy, EgressUnavailable
from mcp_forge.errors import (
    InvalidSession,
    PackageError,
    PodmanError,
    PodmanTimeout,
    SecretError,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes import spec_packages
from mcp_forge.runtimes.guard import GuardProgram, guard_program
from mcp_forge.runtimes.local import egress, locks, orphans, userns, volumes
from mcp_forge.runtimes.local.containers import Containers
from mcp_forge.runtimes.local.secrets import Secrets
from mcp_forge.runtimes.local.store import Claimed, Store
from mcp_forge.sandbox import KERNEL_UID
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

# A kernel that answered takes a silent execute of ours (its environment, its output
# guard: _tell) within this long.
TELL_TIMEOUT = 10.0


class KernelPods:
    """Sessions' pods in the store's state directory (see the module docstring). The
    store, the containers' observer, the Secrets and the play lock are LocalRuntime's."""

    settings: Settings
    store: Store
    containers: Containers
    secrets: Secrets
    egress: EgressProxy  # started when a session first has an allow-list
    _playing: locks.PodmanPlays  # one `podman kube play` at a time on this host
    _guard: GuardProgram | None = None  # the output guard new kernels get (_give_guard)

    # ---- where a session's pod and files are -------------------------------------------

    def _dir(self, session: KernelSession) -> Path:
        return self.settings.state_dir / "k" / session.uid.replace("-", "")[:16]

    def host_paths(self, session: KernelSession) -> HostPaths:
        base = self._dir(session)
        shared = None
        if session.spec.shared_group:
            shared = str(
                self.settings.state_dir / "shared" / session.namespace / session.spec.shared_group
            )
        return HostPaths(
            conf=str(base / "conf"),
            run=str(base / "run"),
            workspace=str(base / "workspace"),
            shared=shared,
            tmp=str(base / "tmp"),
        )

    def pod_name(self, session: KernelSession) -> str:
        """The session's pod: the one it was started in, as stored (a claimed kernel's is
        the pool's name for it), or the one it would be started in."""
        try:
            status = self.store.get(session.namespace, session.name).get("status") or {}
        except SessionNotFound:
            status = {}
        return str(status.get("podName") or podman_pod_name(session.namespace, session.name))

    def container_name(self, session: KernelSession) -> str:
        return f"{self.pod_name(session)}-{CONTAINER}"

    def idmap(self, session: KernelSession) -> dict[str, int] | None:
        """The user namespace of the session's pods ({uid, gid, size}: host ids of 0..size).

        None before its first start, and for a pod played before user namespaces (its
        kernel is host uid 1000 until the next new pod).
        """
        idmap = self.store.private(session.namespace, session.name).get("idmap")
        return dict(idmap) if isinstance(idmap, dict) else None

    def kernel_ids(self, session: KernelSession) -> tuple[int, int]:
        """The host uid and gid of the kernel's uid and gid 1000."""
        idmap = self.idmap(session)
        if idmap is None:
            return KERNEL_UID, KERNEL_UID
        return idmap["uid"] + KERNEL_UID, idmap["gid"] + KERNEL_UID

    # ---- its status, in the store ----------------------------------------------------------

    def _patch(self, session: KernelSession, **patch: Any) -> None:
        """Write status fields; with a phase, reason or message, the conditions follow."""
        with contextlib.suppress(SessionNotFound):
            if {"phase", "reason", "message"} & patch.keys():
                body = self.store.get(session.namespace, session.name)
                old = body.get("status") or {}
                new = {**old, **patch}
                phase = str(new.get("phase") or st.PENDING)
                seen = Observation(
                    phase, str(new.get("reason") or phase), str(new.get("message") or "")
                )
                generation = int(body["metadata"].get("generation", 1))
                patch.update(shown(old, seen, generation=generation, now=time.time()))
                patch["reason"], patch["message"] = new.get("reason"), new.get("message")
            self.store.patch_status(session.namespace, session.name, patch)

    def _show(self, session: KernelSession, seen: Observation) -> None:
        """Write what the session shows now (control/lifecycle.py's plan for its kernel)."""
        self._patch(session, phase=seen.phase, reason=seen.reason, message=seen.message[:2000])

    def _fail(self, session: KernelSession, reason: str, message: str) -> None:
        self._show(session, Observation(st.FAILED, reason, message))

    def mark_ready(self, session: KernelSession, message: str) -> None:
        self._patch(session, phase=st.READY, reason=st.KERNEL_READY, message=message)

    # ---- the pod, made --------------------------------------------------------------------

    def _prepare_dirs(self, session: KernelSession, info: ConnectionInfo) -> HostPaths:
        uid, gid = self.kernel_ids(session)
        paths = self.host_paths(session)
        if len(paths.run) + len("/kernel-5555") > IPC_PATH_MAX:
            raise InvalidSession(
                f"the state directory {self.settings.state_dir} is too long for Unix socket paths;"
                " set MCPFORGE_STATE_DIR to a shorter one"
            )
        base = self._dir(session)
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(base.parent, 0o700)
        conf = Path(paths.conf)
        conf.mkdir(exist_ok=True, mode=0o755)
        # The connection file is root's, readable by the kernel's group, and mounted
        # read-only: the kernel can read its key but change nothing the host relies on.
        tmp = conf / f".connection.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o440)
        with os.fdopen(fd, "w") as f:
            os.fchown(f.fileno(), 0, gid)
            f.write(info.to_file())
        os.replace(tmp, conf / "connection.json")
        Path(paths.workspace).mkdir(exist_ok=True)
        if paths.tmp:
            Path(paths.tmp).mkdir(exist_ok=True)
        if paths.shared:
            Path(paths.shared).mkdir(parents=True, exist_ok=True)
            os.chown(paths.shared, uid, gid)
            os.chmod(paths.shared, 0o770)
        self._unseal(session)
        return paths

    async def _mount(self, session: KernelSession) -> None:
        """The session's bounded /workspace and /tmp, mounted (again, after a reboot)."""
        uid, gid = self.kernel_ids(session)
        paths = self.host_paths(session)
        size = parse_quantity(session.spec.workspace_size, field="spec.workspace.size")
        workspace = Path(paths.workspace)
        image = workspace.with_name("workspace.img")
        kept = self._retained(session)
        if session.spec.persistent and not image.exists() and kept.exists():
            log.info(
                "%s/%s mounts the workspace kept (Retain) at %s",
                session.namespace,
                session.name,
                kept,
            )
            os.replace(kept, image)
        await volumes.ensure_workspace(image, workspace, size, uid, gid)
        # The volume (or a plain workspace kept from before) belongs to the kernel: its
        # files too, when they were written by another user namespace (a retained one's).
        await asyncio.to_thread(volumes.give, workspace, uid, gid)
        if paths.tmp:
            await volumes.ensure_tmp(Path(paths.tmp), uid, gid)

    def _unseal(self, session: KernelSession) -> None:
        """Let a starting kernel bind its sockets: a fresh run/ that its uid owns."""
        run = Path(self.host_paths(session).run)
        shutil.rmtree(run, ignore_errors=True)
        uid, gid = self.kernel_ids(session)
        run.mkdir(mode=0o700)
        os.chown(run, uid, gid)
        bridge = run / "bridge"  # code mode: the kernel binds its bridge socket here
        bridge.mkdir(mode=0o700)
        os.chown(bridge, uid, gid)

    def _seal(self, session: KernelSession) -> None:
        """Once the kernel has bound its sockets, take run/ back (root, 0755)."""
        run = Path(self.host_paths(session).run)
        fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)

    async def _realize(
        self, session: KernelSession, *, wait: bool, phase: str = st.STARTING
    ) -> None:
        try:
            self.secrets.values(session)  # a Secret that is not there: no pod at all
            egress.values(session, lambda name: self.secrets.find(name, session.namespace))
        except SecretError as exc:
            self._fail(session, exc.reason, str(exc))
            raise
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        idmap = self.idmap(session) or self._claim_idmap(session)
        paths = self._prepare_dirs(session, info)
        manifest = orphans.manifest(session, paths, orphans.store_tag(self.settings.state_dir))
        (self._dir(session) / "pod.yaml").write_text(manifest)
        # A restart keeps the death's reason and message until the new kernel is ready.
        cleared = {"reason": None, "message": None} if phase == st.STARTING else {}
        pod = podman_pod_name(session.namespace, session.name)
        self._patch(session, phase=phase, podName=pod, **cleared)
        try:
            await self._mount(session)
            # The host's plays run one at a time: Podman's storage locks stall plays at
            # once (locks.PodmanPlays). Only the play itself is serialized: the kernels
            # it starts get ready side by side (_started).
            async with self._playing():
                await self._play(session, idmap)
        except (PodmanError, volumes.VolumeError) as exc:
            self._fail(session, "PlayFailed", str(exc))
            raise
        await self._started(session, wait=wait)

    async def _play(
        self, session: KernelSession, idmap: dict[str, int], manifest: str = "pod.yaml"
    ) -> None:
        """`podman kube play` of the session's pod.yaml, its lock held.

        A play that finds its kernel container's name taken by a storage-only container
        (one an earlier pod of this session left, orphans.py) removes that container and
        plays once more: with the lock held no other play of this pod is under way in
        any process of this store, so the container is nobody's work in progress. A play
        that stalls in Podman's store (PodmanTimeout) is played once more too. Each once:
        a stall then a taken name (the stalled play's leftover) are both put right. So is
        a play whose old pod another process removed while it replaced it. The failed
        play's half-made pod goes with --replace."""
        args = (
            "kube",
            "play",
            "--replace",
            "--network=none",
            f"--seccomp-profile-root={SECCOMP_PROFILE_ROOT}",
            userns_flag(idmap),
            str(self._dir(session) / manifest),
        )
        tried: set[str] = set()
        while True:
            try:
                await podman.run(*args, timeout=self.settings.podman_timeout)
                return
            except PodmanTimeout as exc:
                # Podman's store stalled (clients/podman_locks.py); ours was killed. If
                # our own API service held the store, it goes too; then one more play.
                if "stalled" in tried:
                    raise
                tried.add("stalled")
                podman_api.release(exc.holding)
                log.warning("%s: podman kube play stalled; playing once more", session.name)
            except PodmanError as exc:
                if "no such pod" in exc.stderr and "gone" not in tried:
                    # --replace removes the pod it replaces; one removed meanwhile by
                    # another process (a person's `podman pod rm`) fails that: it is gone,
                    # as the play wanted (seen in CI: the session was left Failed).
                    tried.add("gone")
                    log.warning(
                        "%s: its old pod went while it played; playing once more", session.name
                    )
                    continue
                name = self.container_name(session)
                if (
                    "name" in tried
                    or orphans.name_in_use(exc.stderr) != name
                    or not await orphans.free_name(name)
                ):
                    raise
                tried.add("name")
                log.warning(
                    "%s: its kernel container's name is free again; playing once more", name
                )

    def _claim_idmap(self, session: KernelSession) -> dict[str, int]:
        """A user namespace: that of a stored session of its sharedGroup (so they can
        share /shared), else one disjoint from every stored session's (suspended ones
        included). Chosen and recorded in one transaction of the store, so two sessions
        of a new group started at once still get one namespace."""
        group = session.spec.shared_group

        def choose(others: list[Claimed]) -> dict[str, int]:
            for other in others:
                spec = other.body.get("spec") or {}
                same_group = group and spec.get("sharedGroup") == group
                if same_group and other.namespace == session.namespace and other.value:
                    return dict(other.value)
            return userns.choose(o.value for o in others if o.value is not None)

        idmap: dict[str, int] = self.store.claim(session.namespace, session.name, "idmap", choose)
        return idmap

    async def _started(self, session: KernelSession, *, wait: bool) -> None:
        await self._adopt(session)
        self._patch(session, kernelId=str(uuid.uuid4()), startedAt=stamp())
        if wait:
            await self.wait_ready(session)

    async def _adopt(self, session: KernelSession) -> None:
        """Take on the kernel container just started (or restored): its limits and
        cgroup noted, and a new connection generation, so that gateways connect anew."""
        info = await self.containers.inspect(self.container_name(session))
        if info is not None:
            self.containers.limit_pids(session, info)
            self.containers.weigh_cpu(session, info)
            private = self.store.private(session.namespace, session.name)
            private["cgroup"] = str(info.get("State", {}).get("CgroupPath", "")).lstrip("/")
            self.store.set_private(session.namespace, session.name, private)
            # The baseline for telling a later death by OOM.
            await self.containers.started(session, info)
        generation = int((session.status.get("connection") or {}).get("generation", 0))
        stored = self.store.get(session.namespace, session.name).get("status", {})
        generation = max(generation, int((stored.get("connection") or {}).get("generation", 0)))
        self._patch(
            session,
            lastActivity=stamp(),
            connection={
                "transport": "ipc",
                "host": self.host_paths(session).run + "/kernel",
                "ports": dict(PORTS),
                "generation": generation + 1,
            },
        )

    async def wait_ready(self, session: KernelSession) -> None:
        """Wait for a kernel_info reply, then seal run/; fail fast if the kernel exits."""
        try:
            await self._wait_ready(session)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                reason = exc.reason if isinstance(exc, SecretError) else "NotReady"
                if isinstance(exc, PackageError):
                    reason = "PackagesNotInstalled"
                self._fail(session, reason, str(exc))
            raise

    async def _wait_ready(self, session: KernelSession) -> None:
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        conn = KernelConnection(info, max_frame=1_000_000, max_message=1_000_000)
        ready = asyncio.ensure_future(conn.wait_ready(self.settings.kernel_ready_timeout))
        died = asyncio.ensure_future(self._wait_exited(session))
        try:
            await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (ready, died):
                task.cancel()
            await asyncio.gather(ready, died, return_exceptions=True)
            conn.close()
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            self._seal(session)
            await self._give_guard(session)
            await self.give_egress(session)
            # Variables from Secrets are never in the pod (podman inspect shows its env):
            # every new kernel gets them here, over its sealed channel, before it is Ready.
            # So are its working files, where none is yet (a restart keeps what code wrote).
            values = self.secrets.values(session)
            if values or session.spec.files:
                await self.give_env(session, values, session.spec.files)
            await self.give_packages(session)
            self.mark_ready(session, "the kernel answered")
            return
        if died.done() and not died.cancelled() and died.exception() is None:
            term = died.result()
            raise SessionNotReady(
                f"the kernel exited while starting ({term.message}): {await self.logs(session)}"
            )
        exc = ready.exception() if ready.done() and not ready.cancelled() else died.exception()
        raise exc if exc is not None else SessionNotReady("the kernel did not start")

    async def give_env(
        self,
        session: KernelSession,
        env: dict[str, str],
        files: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Set `env` in the session's running kernel, and write its missing working
        `files`, by a silent execute on its shell channel: no output, no history, no
        name left in its namespace. Errors say how it went, never what was given
        (values may come from Secrets)."""
        await self._tell(session, ksp.claim_program(env, files), "its environment")

    async def give_egress(self, session: KernelSession) -> None:
        """Serve the session's egress and give its kernel the settings, if it has an
        allow-list. A pool's kernel gets none: its claim gives it the claiming session's
        (pools.py), with the values its Secrets hold then."""
        if session.spec.egress_rules and not pooled(session):
            await self._tell(session, await self.open_egress(session), "its egress settings")

    async def open_egress(self, session: KernelSession) -> str:
        """Serve the session's egress socket (runtimes/local/egress.py); the program that
        gives its kernel the proxy settings. SessionNotReady if the proxy cannot."""
        key = self.store.key(session.namespace, session.name)
        paths = (Path(self.host_paths(session).run), self._dir(session))
        lookup = lambda name: self.secrets.find(name, session.namespace)  # noqa: E731
        try:
            return await egress.open_for(
                self.egress, session, paths, self.kernel_ids(session), key, lookup
            )
        except (EgressUnavailable, OSError) as exc:
            raise SessionNotReady(f"its egress proxy: {exc}") from None

    async def _give_guard(self, session: KernelSession) -> None:
        """Install the output guard in a new kernel, with these settings' limits and its
        fingerprint (runtimes/guard.py): a gateway of the same limits then keeps it. A
        kernel that will not take it starts all the same; the gateway's first connection
        tries again, and says so."""
        if self._guard is None:
            self._guard = guard_program(self.settings)
        try:
            await self._tell(session, self._guard.code, "its output guard")
        except SessionNotReady as exc:
            log.warning("session %s: %s", session.name, exc)

    async def _tell(self, session: KernelSession, code: str, what: str) -> None:
        """Run `code` silently in the session's kernel, over a connection of its own.
        The shell reply alone says how it went: a silent execute broadcasts nothing we
        need, so no IOPub subscription is waited for. SessionNotReady naming `what`."""
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        conn = KernelConnection(info, max_frame=100_000, max_message=100_000)
        try:
            msg_id = conn.send_execute(code, silent=True, store_history=False)
            reply = await conn.reply(conn.shell, msg_id, TELL_TIMEOUT)
            if reply is None:
                raise SessionNotReady(f"the kernel did not take {what} in {TELL_TIMEOUT:.0f}s")
            status = reply["content"].get("status")
            if status != "ok":
                raise SessionNotReady(f"the kernel refused {what} ({str(status)[:40]})")
        finally:
            conn.close()

    async def give_packages(self, session: KernelSession) -> None:
        """Install spec.packages in the session's running kernel, unless its workspace
        has them (runtimes/spec_packages.py); nothing to do without spec.packages."""
        if not session.spec.packages:
            return
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        conn = KernelConnection(info, max_frame=100_000, max_message=100_000)
        try:
            await spec_packages.give_packages(session, conn, self.settings)
        finally:
            conn.close()

    async def kernel_packages(self, session: KernelSession, conn: KernelConnection) -> None:
        """Nothing: a local kernel has spec.packages before its session is Ready."""

    async def restart_cold(self, session: KernelSession) -> None:
        """A new pod for the session, from its own spec (a claim that went wrong)."""
        await self._remove_pod(session)
        await self._realize(session, wait=True)

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
                interruptible=True,  # it only waits: cancelled when the kernel answers
            )
            term = await self.termination(session)
            if term is not None:
                return term

    async def _unmount(self, session: KernelSession) -> None:
        """Unmount the session's filesystems (their loop devices go with them)."""
        paths = self.host_paths(session)
        workspace = Path(paths.workspace)
        for target in (workspace, workspace.with_name("workspace.migrating"), paths.tmp):
            if target:
                await volumes.unmount(Path(target))

    async def _remove_pod(self, session: KernelSession) -> None:
        # -t 0: the kernel is being deleted, with its state; nothing to wait for. A pod
        # Podman leaves half removed is removed again (podman.remove_pod).
        await podman.remove_pod(self.pod_name(session))

    def _retained(self, session: KernelSession) -> Path:
        """Where a workspace kept after its session (reclaimPolicy Retain) waits for the
        next session of that name: mounted again by it when it is persistent."""
        return self.settings.state_dir / "retained" / session.namespace / f"{session.name}.img"

    def _retain(self, session: KernelSession) -> None:
        """Keep the (unmounted) workspace image of a session being deleted."""
        image = self._dir(session) / "workspace.img"
        if not image.exists():
            return
        kept = self._retained(session)
        kept.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if kept.exists():  # never over another: that one is kept under its session's uid
            kept = kept.with_name(f"{session.name}.{session.uid}.img")
        os.replace(image, kept)
        log.info(
            "kept the workspace of %s/%s (Retain) at %s", session.namespace, session.name, kept
        )

    # ---- the pod, observed: runtimes/local/containers.py --------------------------------

    async def termination(self, session: KernelSession) -> Termination | None:
        return await self.containers.termination(session, self.container_name(session))

    async def logs(self, session: KernelSession, lines: int = 20) -> str:
        return await self.containers.logs(self.container_name(session), lines)


def pooled(session: KernelSession) -> bool:
    """Whether the session is a pool's kernel, not claimed yet."""
    return ksp.LABEL_POOL in (session.body["metadata"].get("labels") or {})


def userns_flag(idmap: dict[str, int]) -> str:
    """`podman kube play`'s --userns for a session's map."""
    return (
        f"--userns=auto:uidmapping=0:{idmap['uid']}:{idmap['size']},"
        f"gidmapping=0:{idmap['gid']}:{idmap['size']}"
    )


def unsealed(run: Path, kernel_uid: int) -> str:
    """Why run/ cannot be trusted yet ("" if it can): root's, 0755, five real sockets."""
    try:
        found = run.lstat()
    except FileNotFoundError:
        return "its kernel has no sockets yet"
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0 or stat.S_IMODE(found.st_mode) != 0o755:
        return "its kernel is starting"
    bridge = run / "bridge"
    try:
        found = bridge.lstat()
    except FileNotFoundError:
        return "its bridge directory is missing"
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != kernel_uid:
        return "its bridge directory was replaced"  # e.g. by a symlink, while unsealed
    for port in PORTS.values():
        try:
            mode = (run / f"kernel-{port}").lstat().st_mode
        except FileNotFoundError:
            mode = 0
        if not stat.S_ISSOCK(mode):
            return f"kernel-{port} is not a socket"
    return ""
