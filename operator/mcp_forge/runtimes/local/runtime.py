"""Local mode: KernelSessions in an embedded store, realized with `podman kube play`.

Layout under the state directory (0700, root):

    store.db                      the KernelSessions and their keys
    k/<id>/lock                   serializes apply / restart / refresh / delete across processes
    k/<id>/pod.yaml               what was played (no key in it)
    k/<id>/conf/connection.json   root-owned, mounted read-only at /etc/mcp-forge
    k/<id>/run/                   the kernel's Unix sockets, mounted at /run/mcp-forge
    k/<id>/workspace.img          the workspace's filesystem (sparse ext4, spec.workspace.size)
    k/<id>/workspace/             its mount point: /workspace in the pod, kept across restarts
    k/<id>/tmp/                   a tmpfs (256Mi, charged to the kernel): /tmp in the pod
    shared/<namespace>/<group>/   /shared for sessions of one sharedGroup

(see volumes.py for the two filesystems). Each pod runs in a user namespace of its own
(userns.py): the kernel's uid 1000 is a host uid that no account and no other stored
session has, chosen in the store's transaction before the session's first pod and used
for every later pod, so its files keep their owner. Everything the kernel must
own on the host (workspace, tmp, run/, the connection file's group) is given that uid.

The pod's network is `none`; the gateway reaches the kernel through the Unix sockets
in run/. run/ is writable by the kernel only while it starts and binds them: once it
answers, the directory is sealed (root-owned, 0755), so code in the kernel cannot swap
a socket for a link to some other socket on the host. Only root on the host can enter
the state directory at all.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_forge import metrics
from mcp_forge.api import kernelsession, quota
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import (
    BRIDGE_DIR_IN_POD,
    BRIDGE_SOCKET,
    IPC_PATH_MAX,
    PORTS,
    Address,
    ConnectionInfo,
    new_key,
)
from mcp_forge.api.kernelsession import KernelSession, parse_quantity
from mcp_forge.api.status import Termination, parse_time, stamp
from mcp_forge.clients import podman
from mcp_forge.control.lifecycle import QUICK_DEATH, Activity, after_death, idle_since, stop_of
from mcp_forge.control.render import (
    CONTAINER,
    SECCOMP_PROFILE_ROOT,
    HostPaths,
    podman_pod_name,
)
from mcp_forge.errors import (
    ForgeError,
    ImageError,
    InvalidSession,
    PackageError,
    PodmanError,
    SecretError,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.image.kernel import missing_image_message
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes import packages
from mcp_forge.runtimes.local import orphans, userns, volumes
from mcp_forge.runtimes.local.containers import Containers, lifetime
from mcp_forge.runtimes.local.pools import Pools
from mcp_forge.runtimes.local.secrets import Secrets
from mcp_forge.runtimes.local.store import Claimed, Store
from mcp_forge.sandbox import KERNEL_UID
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

# A busy mark (a gateway runs code in the kernel) lasts this long unless renewed: the
# gateway renews it while the code runs, so it lapses by itself if the gateway goes away.
BUSY_LEASE = 30.0
# A kernel that answered takes its environment's silent execute within this long.
GIVE_ENV_TIMEOUT = 10.0
# Spec fields that change no pod: applied without touching the kernel. Local mode
# applies every other change at once (there is no updateStrategy to wait on here).
_LIVE_FIELDS = (
    "idleTimeout",
    "mcpServers",
    "idleAction",
    "maxLifetime",
    "updateStrategy",
    "operatingMode",
)


_USER_SUSPENDED = (st.SUSPENDED, st.USER_REQUESTED, "spec.operatingMode is Suspended")


@dataclass(frozen=True)
class Applied:
    session: KernelSession
    action: str  # "created", "configured", "unchanged"
    seconds: float


def _state_dir(path: Path) -> None:
    """Create the state directory 0700, or check that an existing one is private."""
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        found = path.stat()
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            raise InvalidSession(
                f"the state directory {path} must be owned by uid {os.geteuid()} with mode "
                f"0700 (it holds kernel keys); it is uid {found.st_uid}, mode "
                f"{oct(found.st_mode & 0o777)}. Fix it (chmod 700) or set MCPFORGE_STATE_DIR"
            ) from None


class LocalRuntime:
    """The local realization of KernelSessions (see the module docstring)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        _state_dir(self.settings.state_dir)
        self.store = Store(self.settings.store_path)
        self.containers = Containers(self.store, self.settings)
        self.pools = Pools(self)
        self.secrets = Secrets(self.store)
        self._playing = asyncio.Lock()  # one `podman kube play` at a time (see _realize)

    # ---- paths and locks -----------------------------------------------------------------

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

    def lock_path(self, session: KernelSession) -> Path:
        return self._dir(session) / "lock"

    def locked(self, session: KernelSession) -> contextlib.AbstractAsyncContextManager[None]:
        """The session's lock (see _locked)."""
        return self._locked(session)

    @contextlib.asynccontextmanager
    async def _locked(self, session: KernelSession, *, create: bool = False) -> AsyncIterator[None]:
        """Hold the session's lock file, so two processes never realize it at once.

        Whoever holds it re-reads the session: it may have changed, or gone, meanwhile.

        Within this process the lock is first an asyncio lock (`_in_process`), so only
        one task at a time opens and waits on the file: tasks of this process queue on
        the loop, and the file lock is contended only by other processes. A wait for
        the file lock (`_flock`) takes a thread of its own, never one of the loop's
        default executor: that executor is small (6 threads on 2 cores) and the holder
        of the lock needs it to get on (asyncio.to_thread: the store, unmounts,
        rmtree). With the waits there, 10 sessions closed at once (each holding its
        lock, `podman pod rm` making the supervisor refresh each, under the same lock)
        filled every executor thread with waits on locks whose holders then waited for
        a thread: every close hung (tests/drills/neighbours.py; test_runtime_lock.py).
        """
        base = self._dir(session)
        if create:
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.lock_path(session)
        async with _in_process(path):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                raise SessionNotFound(f"no KernelSession {session.name!r}") from None
            try:
                # Closing the descriptor (finally) releases the lock even if we were
                # cancelled while waiting (see _flock).
                await _flock(fd)
                yield
            finally:
                os.close(fd)

    # ---- reading -------------------------------------------------------------------------

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        return kernelsession.load(self.store.get(namespace, name))

    async def list(self, namespace: str | None = None) -> builtins.list[KernelSession]:
        return [kernelsession.load(b) for b in self.store.list(namespace)]

    async def connection(self, session: KernelSession) -> ConnectionInfo:
        """The kernel's sockets and key, once its run directory is sealed."""
        run = Path(self.host_paths(session).run)
        problem = _unsealed(run, self.kernel_ids(session)[0])
        if problem:
            raise SessionNotReady(f"session {session.name!r} is not ready: {problem}")
        key = self.store.key(session.namespace, session.name)
        return ConnectionInfo("ipc", str(run / "kernel"), key)

    async def bridge_address(self, session: KernelSession) -> tuple[tuple[str | int, ...], Address]:
        """A Unix socket in the session's run dir; the peer must be its kernel container."""
        private = self.store.private(session.namespace, session.name)
        cgroup = str(private.get("cgroup") or "").strip("/")

        def ours(pid: int) -> bool:
            try:
                text = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                return False
            paths = [line.split(":", 2)[-1].strip("/") for line in text.splitlines()]
            return bool(cgroup) and any(p == cgroup or p.startswith(cgroup + "/") for p in paths)

        host = Path(self.host_paths(session).run) / "bridge" / BRIDGE_SOCKET
        inside = ("unix", f"{BRIDGE_DIR_IN_POD}/{BRIDGE_SOCKET}")
        return inside, Address("unix", path=str(host), peer_check=ours)

    # ---- apply / delete --------------------------------------------------------------------

    async def apply(self, body: dict[str, Any], *, wait: bool = True) -> Applied:
        """Create or update a session from a body; wait until Ready."""
        started = time.monotonic()
        body = kernelsession.validate(body)
        if body["spec"]["network"]["egress"] != "None":
            raise InvalidSession(
                "egress All is not available in local mode yet: pods on Podman's shared "
                "bridge could reach each other",
                field="spec.network.egress",
            )
        meta = body["metadata"]
        try:
            current = self.store.get(meta["namespace"], meta["name"])
        except SessionNotFound:
            current = None
        if current is None:
            claim = await self.pools.claim(body) if body["spec"].get("poolRef") else None
            if claim is not None and claim.session is not None:  # WarmStart is set
                return Applied(
                    await self.get(claim.session.name, claim.session.namespace),
                    "created",
                    time.monotonic() - started,
                )
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=stamp(), generation=1)
            body["status"] = {"phase": st.PENDING, "restarts": 0}
            await self.check_image(body["spec"]["image"])
            self.store.create(body, new_key())
            session = kernelsession.load(body)
            if claim is not None:
                self.set_warm_start(session, False, claim.reason, claim.message)
            async with self._locked(session, create=True):
                if session.spec.operating_mode == "Suspended":
                    await self._stop_locked(session, *_USER_SUSPENDED)
                else:
                    await self._realize(session, wait=wait)
            return Applied(
                await self.get(session.name, session.namespace),
                "created",
                time.monotonic() - started,
            )

        session = kernelsession.load(current)
        async with self._locked(session):
            current = self.store.get(session.namespace, session.name)
            if current["spec"] == body["spec"] and meta.get("labels") == current["metadata"].get(
                "labels"
            ):
                session = await self._refresh_locked(kernelsession.load(current), restart=True)
                if session.status.get("phase") == st.FAILED:
                    self._patch(session, lastTermination=None)  # applied again: a new count
                    await self._realize(session, wait=wait)
                    return Applied(
                        await self.get(session.name, session.namespace),
                        "configured",
                        time.monotonic() - started,
                    )
                return Applied(session, "unchanged", time.monotonic() - started)
            await self.check_image(body["spec"]["image"])
            self._check_workspace_size(session, current["spec"], body["spec"])
            needs_pod = _pod_spec(current["spec"]) != _pod_spec(body["spec"])
            current["spec"] = body["spec"]
            current["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            for k in ("labels", "annotations"):
                current["metadata"][k] = meta.get(k) or {}
            self.store.replace(current)
            session = kernelsession.load(current)
            phase = session.status.get("phase")
            if session.spec.operating_mode == "Suspended":
                await self._stop_locked(session, *_USER_SUSPENDED)
            elif (
                needs_pod
                or phase == st.EXPIRED  # a longer maxLifetime, or a changed spec: a new start
                or (phase == st.SUSPENDED and session.status.get("reason") != st.IDLE)
            ):
                await self._remove_pod(session)
                await self._realize(session, wait=wait)
            else:
                self._patch(session, observedGeneration=current["metadata"]["generation"])
        return Applied(
            await self.get(session.name, session.namespace),
            "configured",
            time.monotonic() - started,
        )

    def _check_workspace_size(
        self, session: KernelSession, current: dict[str, Any], new: dict[str, Any]
    ) -> None:
        """A workspace grows (volumes.py, when the next kernel mounts it) but never shrinks:
        a smaller size is refused before anything is stored."""
        want, was = new["workspace"]["size"], current["workspace"]["size"]
        if want == was:
            return
        image = Path(self.host_paths(session).workspace).with_name("workspace.img")
        held = max(volumes.workspace_size(image) or 0, parse_quantity(was, field="spec"))
        if parse_quantity(want, field="spec.workspace.size") < held:
            raise InvalidSession(
                f"the workspace holds {current['workspace']['size']} ({held} bytes) and "
                f"cannot be made smaller; ask for that or more, not {want}",
                field="spec.workspace.size",
            )

    async def create(self, body: dict[str, Any]) -> KernelSession:
        """Create a new session (never updates one) and wait until it is Ready."""
        meta = body.get("metadata") or {}
        try:
            self.store.get(meta.get("namespace", "default"), str(meta.get("name")))
        except SessionNotFound:
            return (await self.apply(body)).session
        raise InvalidSession(
            f"a session named {meta.get('name')!r} exists already", field="metadata.name"
        )

    async def check_image(self, image: str) -> None:
        if not await self.containers.image_exists(image):
            raise ImageError(missing_image_message(image))

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
            # This runtime's plays run one at a time. Podman 4.3.1's containers/storage
            # takes its locks in different orders on the way through a --userns=auto play:
            # ten played at once (tests/drills/neighbours.py) now and then all stuck until
            # podman_timeout (120 s). /proc/locks showed one play holding storage.lock,
            # layers.lock and userns.lock, sleeping between tries of another lock that a
            # second play held while it waited for layers.lock. Only the play itself is
            # serialized: the kernels it starts get ready side by side (_started).
            async with self._playing:
                await podman.run(
                    "kube",
                    "play",
                    "--replace",
                    "--network=none",
                    f"--seccomp-profile-root={SECCOMP_PROFILE_ROOT}",
                    userns_flag(idmap),
                    str(self._dir(session) / "pod.yaml"),
                    timeout=self.settings.podman_timeout,
                )
        except (PodmanError, volumes.VolumeError) as exc:
            self._fail(session, "PlayFailed", str(exc))
            raise
        await self._started(session, wait=wait)

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
            kernelId=str(uuid.uuid4()),
            startedAt=stamp(),
            lastActivity=stamp(),
            connection={
                "transport": "ipc",
                "host": self.host_paths(session).run + "/kernel",
                "ports": dict(PORTS),
                "generation": generation + 1,
            },
        )
        if wait:
            await self.wait_ready(session)

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
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        conn = KernelConnection(info, max_frame=100_000, max_message=100_000)
        try:
            # The shell reply alone says how it went: a silent execute broadcasts nothing
            # we need, so no IOPub subscription is waited for.
            code = ksp.claim_program(env, files)
            msg_id = conn.send_execute(code, silent=True, store_history=False)
            reply = await conn.reply(conn.shell, msg_id, GIVE_ENV_TIMEOUT)
            if reply is None:
                raise SessionNotReady(
                    f"the kernel did not take its environment in {GIVE_ENV_TIMEOUT:.0f}s"
                )
            status = reply["content"].get("status")
            if status != "ok":
                raise SessionNotReady(f"the kernel refused its environment ({str(status)[:40]})")
        finally:
            conn.close()

    async def give_packages(self, session: KernelSession) -> None:
        """Install spec.packages in the session's running kernel, unless its workspace
        has them (runtimes/packages.py); nothing to do without spec.packages."""
        if not session.spec.packages:
            return
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        conn = KernelConnection(info, max_frame=100_000, max_message=100_000)
        try:
            await packages.give_packages(session, conn, self.settings)
        finally:
            conn.close()

    async def kernel_packages(self, session: KernelSession, conn: KernelConnection) -> None:
        """Nothing: a local kernel has spec.packages before its session is Ready."""

    def mark_ready(self, session: KernelSession, message: str) -> None:
        self._patch(session, phase=st.READY, reason=st.KERNEL_READY, message=message)

    def set_warm_start(self, session: KernelSession, warm: bool, reason: str, message: str) -> None:
        """Condition WarmStart: whether the session claimed a pooled kernel, and why not."""
        with contextlib.suppress(SessionNotFound):
            body = self.store.get(session.namespace, session.name)
            old = (body.get("status") or {}).get("conditions") or []
            new = st.condition(
                old,
                ksp.WARM_START,
                warm,
                reason,
                message,
                generation=int(body["metadata"].get("generation", 1)),
                now=stamp(),
            )
            kept = [c for c in old if c.get("type") != ksp.WARM_START]
            self.store.patch_status(session.namespace, session.name, {"conditions": [*kept, new]})

    async def restart_cold(self, session: KernelSession) -> None:
        """A new pod for the session, from its own spec (a claim that went wrong)."""
        await self._remove_pod(session)
        await self._realize(session, wait=True)

    def _fail(self, session: KernelSession, reason: str, message: str) -> None:
        self._patch(
            session,
            phase=st.FAILED,
            reason=reason,
            message=message[:2000],
        )

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

    async def logs(self, session: KernelSession, lines: int = 20) -> str:
        return await self.containers.logs(self.container_name(session), lines)

    async def delete(self, name: str, namespace: str = "default") -> None:
        session = await self.get(name, namespace)
        async with self._locked(session):
            # Re-read: a pool's kernel may have been claimed (renamed) while we waited.
            current = self.store.get(namespace, name)
            if current["metadata"].get("uid") != session.uid:
                raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
            await self.delete_locked(session)

    # ---- what gateways share: quota reservations, call rates (api/quota.py) ----------------

    async def reserve(self, claim: quota.Claim) -> None:
        def change(bodies: builtins.list[dict[str, Any]], held: str) -> str:
            owned = {b["metadata"]["name"] for b in bodies if claim.owns(b)}
            reservations = quota.load_reservations(held)
            return json.dumps(
                quota.reserve(reservations, owned, claim.name, limit=claim.limit, now=time.time())
            )

        self.store.swap_reservations(claim.namespace, claim.owner, change)

    async def release(self, claim: quota.Claim) -> None:
        def change(_: builtins.list[dict[str, Any]], held: str) -> str:
            return json.dumps(quota.release(quota.load_reservations(held), claim.name))

        self.store.swap_reservations(claim.namespace, claim.owner, change)

    async def count_call(self, session: KernelSession, server: str, per_minute: int) -> bool:
        allowed = True

        def change(stored: Any) -> Any:
            nonlocal allowed
            rates = quota.load_rates(stored)
            counted = quota.count_call(rates, server, per_minute, now=time.time())
            allowed = counted is not None
            return rates if counted is None else counted

        try:
            self.store.update_private(session.namespace, session.name, "rates", change)
        except SessionNotFound:
            return True  # deleted meanwhile: its calls end with it
        return allowed

    async def delete_locked(self, session: KernelSession) -> None:
        """Delete a session whose lock is held: its pod, filesystems, row and directory."""
        self._patch(session, phase=st.TERMINATING)
        await self._remove_pod(session)
        await self._unmount(session)
        if session.spec.retain_workspace:
            self._retain(session)
        self.store.delete(session.namespace, session.name)
        await asyncio.to_thread(shutil.rmtree, self._dir(session), True)
        if ksp.ANNOTATION_CLAIMED_FROM in (session.body["metadata"].get("annotations") or {}):
            self.pools.wanted.set()  # a pool at its maximum may start one again

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

    # ---- observing: runtimes/local/containers.py --------------------------------------------

    async def running_containers(self) -> set[str]:
        return await self.containers.running()

    async def kernel_setup(self, session: KernelSession) -> str | None:
        return None  # given to each new kernel before it is Ready (_wait_ready, pools.py)

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        return self.containers.memory_usage(sessions)

    async def termination(self, session: KernelSession) -> Termination | None:
        return await self.containers.termination(session, self.container_name(session))

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        """Bring status in line with what Podman shows.

        With `restart`, a dead kernel is restarted per restartPolicy; without it, the
        death is only recorded (phase Restarting: the next use, or the gateway, restarts it).
        """
        async with self._locked(session):
            return await self._refresh_locked(
                await self.get(session.name, session.namespace), restart=restart
            )

    async def _refresh_locked(self, session: KernelSession, *, restart: bool) -> KernelSession:
        phase = session.status.get("phase")
        if phase == st.SUSPENDED and session.status.get("reason") == st.IDLE and restart:
            await self._realize(session, wait=True)  # used again: it resumes
            return await self.get(session.name, session.namespace)
        if phase not in (st.READY, st.STARTING, st.RESTARTING):
            return session
        term = await self.termination(session)
        if term is None and phase == st.STARTING and session.status.get("reason") == ksp.CLAIMED:
            if restart:  # a claim whose process went away before it was done
                await self.pools.finish(session)
        elif term is None:
            if phase != st.READY and restart:  # a process that was starting it went away
                await self.wait_ready(session)
        elif session.spec.restart_policy == "Never":
            self._fail(session, term.reason, term.message)
        elif restart:
            await self._restart_locked(
                session, reason=term.reason, crashed=True, message=term.message
            )
        elif phase == st.READY:
            await self._record_death(session, term.reason, term.message, phase=st.RESTARTING)
        return await self.get(session.name, session.namespace)

    async def _record_death(
        self,
        session: KernelSession,
        reason: str,
        message: str,
        *,
        phase: str,
        quick: bool | None = None,
    ) -> dict[str, Any]:
        """Count a death; one within QUICK_DEATH of its start is one more in a crash loop.

        Returns the new lastTermination (with quickDeaths, and nextStartAt: the backoff).
        """
        metrics.KERNEL_RESTARTS.labels(reason="oom" if reason == st.OOM_KILLED else "died").inc()
        body = self.store.get(session.namespace, session.name)
        status = body.get("status", {})
        if quick is None:
            lived = lifetime(await self.containers.inspect(self.container_name(session)))
            quick = lived is not None and lived < QUICK_DEATH
        last = status.get("lastTermination") or {}
        quick_deaths = int(last.get("quickDeaths") or 0) + 1 if quick else 0
        at = time.time()
        last = {
            "reason": reason,
            "message": message,
            "at": stamp(),
            "quickDeaths": quick_deaths,
            "nextStartAt": stamp(after_death(quick_deaths, at, message, now=at, local=True).at),
        }
        self._patch(
            session,
            phase=phase,
            restarts=int(status.get("restarts", 0)) + 1,
            reason=reason,
            message=message,
            lastTermination=last,
        )
        return last

    def _crash_loop(self, session: KernelSession) -> bool:
        """Hold back a crash-looping kernel: True if it must not be started now.

        In its backoff the session is Restarting (CrashLoopBackOff) and says when it starts
        again; past the restart limit it is Failed (CrashLoop) and says why.
        """
        status = self.store.get(session.namespace, session.name).get("status", {})
        last = status.get("lastTermination") or {}
        quick = int(last.get("quickDeaths") or 0)
        if not quick:
            return False
        verdict = after_death(
            quick,
            parse_time(last.get("at")) or time.time(),
            str(last.get("message") or last.get("reason")),
            now=time.time(),
            local=True,
        )
        if verdict.give_up:
            self._fail(session, verdict.reason, verdict.message)
            return True
        if not verdict.reason:  # its backoff is over
            return False
        self._patch(session, phase=st.RESTARTING, reason=verdict.reason, message=verdict.message)
        return True

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        """A fresh kernel process in the same pod: the workspace stays, variables go."""
        async with self._locked(session):
            await self._restart_locked(
                await self.get(session.name, session.namespace),
                reason=reason,
                crashed=crashed,
                message=message,
            )

    async def _restart_locked(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        if crashed and session.status.get("phase") != st.RESTARTING:
            await self._record_death(session, reason, message or reason, phase=st.RESTARTING)
        else:
            self._patch(session, phase=st.RESTARTING)
        if crashed and self._crash_loop(session):
            return
        try:
            await self._start_again(session)
        except SessionNotReady as exc:
            if await self.termination(session) is None:
                raise
            # It died while starting: one more quick death, and a backoff before the next.
            await self._record_death(
                session, "StartFailed", str(exc)[:1500], phase=st.RESTARTING, quick=True
            )
            self._crash_loop(session)
            status = self.store.get(session.namespace, session.name).get("status", {})
            raise SessionNotReady(
                f"session {session.name!r} is {status.get('phase')}: {status.get('message')}"
            ) from None
        if crashed:
            self._patch(session, reason=reason, message=message or reason)

    async def _start_again(self, session: KernelSession) -> None:
        """A new kernel: the pod is played again, with the same user namespace and mounts.

        Not `pod stop` + `pod start`: kube play gives pods the exit policy "stop", and the
        clean-up Podman runs after the old kernel exits could land after the infra came back
        but before the new kernel did, stopping the pod again (about one restart in six).
        A new pod has a new id, which no clean-up of the old one can reach. A pod played
        before user namespaces gets one now.
        """
        await self._remove_pod(session)
        await self._realize(session, wait=True, phase=st.RESTARTING)

    async def record_activity(self, session: KernelSession, *, busy: bool = False) -> None:
        with contextlib.suppress(SessionNotFound):
            self.store.patch_status(
                session.namespace,
                session.name,
                {"lastActivity": stamp()},
                private={"busyUntil": time.time() + BUSY_LEASE if busy else None},
            )

    async def cull_idle(self) -> builtins.list[str]:
        """Expire sessions past their maxLifetime; delete or suspend (idleAction) those idle
        past their idleTimeout. Returns their names."""
        culled = []
        for session in await self.list():
            status = session.status
            if status.get("phase") in st.NO_KERNEL:
                continue
            created = parse_time(session.body["metadata"]["creationTimestamp"]) or time.time()
            last = status.get("lastActivity")
            try:
                private = self.store.private(session.namespace, session.name)
            except SessionNotFound:
                continue
            activity = Activity(parse_time(last) or created, private.get("busyUntil"))
            floor = idle_since(activity, started=None, starting_since=None)
            verdict = stop_of(
                session, created=created, idle_from=floor, activity=activity, now=time.time()
            )
            stop = verdict.stop
            if stop is None or (stop.phase == st.SUSPENDED and stop.reason != st.IDLE):
                continue  # operatingMode Suspended is applied by apply, not here
            try:
                log.info(
                    "%s %s/%s: %s",
                    "deleting" if stop.delete else "stopping",
                    session.namespace,
                    session.name,
                    stop.message,
                )
                if stop.delete:
                    await self.delete(session.name, session.namespace)
                else:
                    await self._stop(session, stop.phase, stop.reason, stop.message)
            except SessionNotFound:
                continue
            except ForgeError as exc:
                log.warning("could not cull %s: %s", session.name, exc)
                continue
            culled.append(session.name)
        return culled

    async def _stop(self, session: KernelSession, phase: str, reason: str, message: str) -> None:
        async with self._locked(session):
            await self._stop_locked(session, phase, reason, message)

    async def _stop_locked(
        self, session: KernelSession, phase: str, reason: str, message: str
    ) -> None:
        """No kernel, the session kept: Suspended or Expired. Variables are lost."""
        await self._remove_pod(session)
        if self.host_paths(session).tmp:  # /tmp is memory: a stopped session holds none
            await volumes.unmount(Path(str(self.host_paths(session).tmp)))
        self._patch(
            session,
            phase=phase,
            reason=reason,
            message=message,
            kernelId=None,
            podName=None,
            suspendedAt=stamp() if phase == st.SUSPENDED else None,
        )

    def _patch(self, session: KernelSession, **patch: Any) -> None:
        """Write status fields; with a phase, reason or message, the conditions follow."""
        with contextlib.suppress(SessionNotFound):
            if {"phase", "reason", "message"} & patch.keys():
                body = self.store.get(session.namespace, session.name)
                old = body.get("status") or {}
                new = {**old, **patch}
                generation = int(body["metadata"].get("generation", 1))
                patch["observedGeneration"] = generation
                patch["conditions"] = st.conditions(
                    old.get("conditions"),
                    str(new.get("phase") or st.PENDING),
                    str(new.get("reason") or new.get("phase") or st.PENDING),
                    str(new.get("message") or ""),
                    generation=generation,
                    now=stamp(),
                )
            self.store.patch_status(session.namespace, session.name, patch)


def userns_flag(idmap: dict[str, int]) -> str:
    """`podman kube play`'s --userns for a session's map."""
    return (
        f"--userns=auto:uidmapping=0:{idmap['uid']}:{idmap['size']},"
        f"gidmapping=0:{idmap['gid']}:{idmap['size']}"
    )


def _unsealed(run: Path, kernel_uid: int) -> str:
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


def _pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in _LIVE_FIELDS}


# Per lock file, the asyncio lock its holder or waiter of this process holds (see
# LocalRuntime._locked). Weak: an entry lives as long as a task holds or awaits it.
_IN_PROCESS: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


def _in_process(path: Path) -> asyncio.Lock:
    """The in-process lock of the lock file at `path`."""
    key = str(path)
    lock = _IN_PROCESS.get(key)
    if lock is None:
        lock = _IN_PROCESS[key] = asyncio.Lock()
    return lock


async def _flock(fd: int) -> None:
    """Take an exclusive flock on `fd`, waiting as long as another process holds it.

    Free, it is taken at once on the loop. Otherwise a thread of its own waits (flock has
    no timeout and cannot be called back): not one of the loop's default executor, which
    the lock's holder may need to get on. The thread waits on a duplicate of `fd`, and
    closes it once flock returns: if our caller was cancelled and closed `fd` meanwhile,
    the lock, taken late, goes with that duplicate, and `fd`'s number, perhaps reused by
    then, is never touched.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    loop = asyncio.get_running_loop()
    taken: asyncio.Future[None] = loop.create_future()
    dup = os.dup(fd)

    def settle(error: BaseException | None) -> None:
        if taken.done():
            return
        if error is None:
            taken.set_result(None)
        else:
            taken.set_exception(error)

    def wait() -> None:
        error: BaseException | None = None
        try:
            fcntl.flock(dup, fcntl.LOCK_EX)
        except OSError as exc:
            error = exc
        finally:
            os.close(dup)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=wait, name="mcp-forge-session-lock", daemon=True).start()
    await taken
