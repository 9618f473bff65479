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

LocalRuntime is three rooms: this one reads, applies and deletes sessions, holds their
locks (locks.py) and the quota gateways share; kernelpods.py makes and takes down a
session's pod (the realizer); lifecycle.py follows the kernel after it started (deaths,
restarts, the culler's stops).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_forge.api import kernelsession, quota
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import (
    BRIDGE_DIR_IN_POD,
    BRIDGE_SOCKET,
    Address,
    ConnectionInfo,
    new_key,
)
from mcp_forge.api.kernelsession import KernelSession, parse_quantity
from mcp_forge.api.status import stamp
from mcp_forge.control.lifecycle import USER_SUSPENDED
from mcp_forge.egress.client import EgressProxy, EgressUnavailable
from mcp_forge.egress.protocol import SOCKET_NAME
from mcp_forge.errors import (
    ImageError,
    InvalidSession,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.image.kernel import missing_image_message
from mcp_forge.runtimes.local import locks, volumes
from mcp_forge.runtimes.local.containers import Containers
from mcp_forge.runtimes.local.egress import proxy_name as egress_name
from mcp_forge.runtimes.local.forks import Forks
from mcp_forge.runtimes.local.kernelpods import pooled, unsealed
from mcp_forge.runtimes.local.pools import Pools
from mcp_forge.runtimes.local.secrets import Secrets
from mcp_forge.runtimes.local.store import Store
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

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


class LocalRuntime(Forks):
    """The local realization of KernelSessions (see the module docstring)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        _state_dir(self.settings.state_dir)
        self.store = Store(self.settings.store_path)
        self.containers = Containers(self.store, self.settings)
        self.pools = Pools(self)
        self.secrets = Secrets(self.store)
        self.egress = EgressProxy(self.settings)
        self._playing = locks.PodmanPlays(self.settings.state_dir)  # the host's one play
        self.releasers = []  # gateways of this process, told before a checkpoint (naps.py)

    # ---- paths and locks -----------------------------------------------------------------

    def lock_path(self, session: KernelSession) -> Path:
        return self._dir(session) / "lock"

    def locked(self, session: KernelSession) -> contextlib.AbstractAsyncContextManager[None]:
        """The session's lock (see _locked)."""
        return self._locked(session)

    @contextlib.asynccontextmanager
    async def _locked(self, session: KernelSession, *, create: bool = False) -> AsyncIterator[None]:
        """Hold the session's lock file, so two processes never realize it at once.

        Whoever holds it re-reads the session: it may have changed, or gone, meanwhile.

        Within this process the lock is first an asyncio lock (`locks.in_process`), so only
        one task at a time opens and waits on the file: tasks of this process queue on
        the loop, and the file lock is contended only by other processes. A wait for
        the file lock (`locks.flock`) takes a thread of its own, never one of the loop's
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
        async with locks.in_process(path):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                raise SessionNotFound(f"no KernelSession {session.name!r}") from None
            try:
                # Closing the descriptor (finally) releases the lock even if we were
                # cancelled while waiting (see locks.flock).
                await locks.flock(fd)
                yield
            finally:
                os.close(fd)

    @contextlib.asynccontextmanager
    async def locked_if_free(self, session: KernelSession) -> AsyncIterator[bool]:
        """The session's lock if no task or process holds it now: True while it is held,
        False at once if it is busy or the session's directory is gone. For housekeeping,
        which waits for no one: what it wanted to do waits for its next pass. Whoever
        holds it re-reads the session, as with `locked`."""
        path = self.lock_path(session)
        in_process = locks.in_process(path)
        if locks.contended(in_process):
            yield False
            return
        async with in_process:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                yield False
                return
            try:
                yield locks.try_flock(fd)
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
        problem = unsealed(run, self.kernel_ids(session)[0])
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
            session, action = await self._apply_new(body, wait=wait), "created"
        else:
            session, action = await self._apply_change(current, body, wait=wait)
        return Applied(session, action, time.monotonic() - started)

    async def _apply_new(self, body: dict[str, Any], *, wait: bool) -> KernelSession:
        """A new session: a pool's kernel if its poolRef has one, else a pod of its own."""
        claim = await self.pools.claim(body) if body["spec"].get("poolRef") else None
        if claim is not None and claim.session is not None:  # WarmStart is set
            return await self.get(claim.session.name, claim.session.namespace)
        body["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=stamp(), generation=1)
        body["status"] = {"phase": st.PENDING, "restarts": 0}
        await self.check_image(body["spec"]["image"])
        self.store.create(body, new_key())
        session = kernelsession.load(body)
        if claim is not None:
            self.set_warm_start(session, False, claim.reason, claim.message)
        async with self._locked(session, create=True):
            if session.spec.operating_mode == "Suspended":
                await self._stop_locked(session, USER_SUSPENDED)
            else:
                await self._realize(session, wait=wait)
        return await self.get(session.name, session.namespace)

    async def _apply_change(
        self, current: dict[str, Any], body: dict[str, Any], *, wait: bool
    ) -> tuple[KernelSession, str]:
        """A stored session applied again: unchanged (a failed one starts again), changed
        live, or changed in what its pod is made of (a new pod)."""
        meta = body["metadata"]
        session = kernelsession.load(current)
        async with self._locked(session):
            current = self.store.get(session.namespace, session.name)
            if current["spec"] == body["spec"] and meta.get("labels") == current["metadata"].get(
                "labels"
            ):
                session = await self._refresh_locked(kernelsession.load(current), restart=True)
                if session.status.get("phase") != st.FAILED:
                    return session, "unchanged"
                self._patch(session, lastTermination=None)  # applied again: a new count
                await self._realize(session, wait=wait)
                return await self.get(session.name, session.namespace), "configured"
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
                await self._stop_locked(session, USER_SUSPENDED)
            elif needs_pod or phase == st.EXPIRED:  # a longer maxLifetime, or a changed spec
                await self._forget_snapshot(session, "its pod's spec changed")
                await self._remove_pod(session)
                await self._realize(session, wait=wait)
            elif phase == st.SUSPENDED and session.status.get("reason") != st.IDLE:
                await self._wake(session, wait=wait)
            else:
                self._patch(session, observedGeneration=current["metadata"]["generation"])
        return await self.get(session.name, session.namespace), "configured"

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

    async def delete(self, name: str, namespace: str = "default") -> None:
        session = await self.get(name, namespace)
        async with self._locked(session):
            # Re-read: a pool's kernel may have been claimed (renamed) while we waited.
            current = self.store.get(namespace, name)
            if current["metadata"].get("uid") != session.uid:
                raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
            await self.delete_locked(session)

    # ---- what gateways share: quota reservations, call rates (api/quota.py) ----------------

    async def reserve(self, claim: quota.Seat) -> None:
        def change(bodies: builtins.list[dict[str, Any]], held: str) -> str:
            owned = {b["metadata"]["name"] for b in bodies if claim.owns(b)}
            reservations = quota.load_reservations(held)
            return json.dumps(
                quota.reserve(reservations, owned, claim.name, limit=claim.limit, now=time.time())
            )

        self.store.swap_reservations(claim.namespace, claim.owner, change)

    async def release(self, claim: quota.Seat) -> None:
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
        try:
            await self.egress.close(egress_name(session))
        except EgressUnavailable as exc:  # the proxy forgets it as it restarts
            log.warning("session %s: closing its egress: %s", session.name, exc)
        await asyncio.to_thread(shutil.rmtree, self._dir(session), True)
        if ksp.ANNOTATION_CLAIMED_FROM in (session.body["metadata"].get("annotations") or {}):
            self.pools.wanted.set()  # a pool at its maximum may start one again

    # ---- observing: runtimes/local/containers.py ---------------------------------------

    async def running_containers(self) -> set[str]:
        return await self.containers.running()

    async def kernel_setup(self, session: KernelSession) -> str | None:
        """Env and files are given to each new kernel before it is Ready (_wait_ready,
        pools.py). Egress too, by the process that started it: a gateway that finds a
        kernel started by another (one before it, or the CLI) serves its socket again."""
        if not session.spec.egress_rules or pooled(session) or self._egress_served(session):
            return None
        return await self.open_egress(session)

    def _egress_served(self, session: KernelSession) -> bool:
        """Does this process serve the session's socket, the one at its path now (another
        process that restarted the kernel bound a socket of its own there)?"""
        opened = self.egress.sessions.get(egress_name(session))
        return opened is not None and opened.serves(
            Path(self.host_paths(session).run) / SOCKET_NAME
        )

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        return self.containers.memory_usage(sessions)


def _pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in _LIVE_FIELDS}
