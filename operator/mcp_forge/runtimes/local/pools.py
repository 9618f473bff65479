"""Local KernelSessionPools: kernels played ahead of time, claimed in milliseconds.

A pool's kernels are KernelSessions of the store, labelled with the pool (and the hash
of the template they were started with) and named `<pool>-<8 hex digits>`; they are
never culled. A claim turns one of them into the claiming session in one transaction
of the store (`Store.take`): the row is renamed and takes the session's metadata and
spec, and keeps its uid (so its directory and lock), its key, its user namespace and
its pod. Then, holding the kernel's lock, the claim gives the running kernel the
session's egress (a pool's kernel has none: its socket, rules and values from Secrets
are the claiming session's, read now) and environment over its own shell channel (a
silent execute, as code mode's module is given) and marks it Ready. Nothing restarts.

A claim that no pool can serve (no such pool, another image or other resources, a
variable read only at interpreter start, no ready kernel) starts cold, and the
session's condition WarmStart says why. Whoever keeps the pools (`fill`: the gateway in
the background, `mcp-forge apply` of a pool once) starts new kernels up to `size`,
`maxStarting` at a time, and replaces those of an older template once new ones answer
(or first, where the pool's maxSize leaves no room beside them: the plan is a cluster
pool's, control/poolplan.py);
a claimed kernel is a session like any other and is never touched. A file lock per
pool keeps two processes from filling one pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.kernelsessionpool import KernelSessionPool
from mcp_forge.control.poolplan import Member, Trouble, plan
from mcp_forge.control.poolplan import conditions as pool_conditions
from mcp_forge.control.poolplan import trouble as pool_trouble
from mcp_forge.errors import ForgeError, SecretError, SessionNotFound, SessionNotReady
from mcp_forge.runtimes.local import egress

if TYPE_CHECKING:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

log = logging.getLogger(__name__)

# A ready kernel whose lock is held (a refresh reads its container: milliseconds) is
# waited for this long, in steps, when no other ready kernel is free.
LOCK_PATIENCE = 1.0
_LOCK_STEP = 0.005


REFILL_SETTLE = 0.5  # seconds the keeper lets a claimed kernel's first call go first


@dataclass(frozen=True)
class SessionClaim:
    """What a claim came to: the session (None: start it cold) and condition WarmStart."""

    session: KernelSession | None
    reason: str
    message: str


@dataclass(frozen=True)
class AppliedPool:
    pool: KernelSessionPool
    action: str  # "created", "configured", "unchanged"
    seconds: float


class Pools:
    """The store's KernelSessionPools, their kernels, and claims on them."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.wanted = asyncio.Event()  # a claim took a kernel: the keeper refills
        self.backoff = runtime.settings.pool_backoff  # after a failed kernel, doubling

    # ---- the resource ------------------------------------------------------------------

    def get(self, name: str, namespace: str = "default") -> KernelSessionPool:
        body = self.store.get_pool(namespace, name)
        if body is None:
            raise SessionNotFound(f"no KernelSessionPool {name!r} in namespace {namespace!r}")
        return ksp.load(body)

    def all(self, namespace: str | None = None) -> list[KernelSessionPool]:
        return [ksp.load(b) for b in self.store.list_pools(namespace)]

    async def apply(self, body: dict[str, Any], *, wait: bool = True) -> AppliedPool:
        """Create or update a pool; with `wait`, until it holds `size` ready kernels."""
        started = time.monotonic()
        body = ksp.validate(body)
        meta = body["metadata"]
        current = self.store.get_pool(meta["namespace"], meta["name"])
        if current is None:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=st.stamp(), generation=1)
            body["status"] = {"ready": 0, "starting": 0, "claimed": 0, "claims": 0, "misses": 0}
            action = "created"
            await self.runtime.check_image(body["spec"]["template"]["image"])
        elif current["spec"] == body["spec"] and current["metadata"].get("labels") == meta.get(
            "labels"
        ):
            action = "unchanged"
            body = current
        else:
            for k in ("uid", "creationTimestamp"):
                meta[k] = current["metadata"][k]
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
            body["status"] = current.get("status") or {}
            action = "configured"
            await self.runtime.check_image(body["spec"]["template"]["image"])
        if action != "unchanged":
            self.store.put_pool(body)
        pool = ksp.load(body)
        if wait:
            await self.fill(pool)
        return AppliedPool(self.get(pool.name, pool.namespace), action, time.monotonic() - started)

    async def delete(self, name: str, namespace: str = "default") -> int:
        """Delete the pool and its unclaimed kernels (claimed ones are sessions now, and
        stay). Returns how many kernels were deleted."""
        pool = self.get(name, namespace)
        self.store.delete_pool(namespace, name)  # first: no keeper refills it meanwhile
        members = self.members(pool)
        done = await asyncio.gather(*(self._delete_member(pool, m) for m in members))
        self._remove_lock(pool)
        return sum(done)

    def _lock_path(self, pool: KernelSessionPool) -> Path:
        return self.runtime.settings.state_dir / "pools" / f"{pool.namespace}.{pool.name}.lock"

    def _remove_lock(self, pool: KernelSessionPool) -> None:
        """Remove a deleted pool's fill lock, unless a fill holds it (it sees the pool
        gone and ends; the lock goes with the next delete or keeper pass)."""
        path = self._lock_path(pool)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except BlockingIOError:
            return
        finally:
            os.close(fd)

    # ---- its kernels --------------------------------------------------------------------

    def members(self, pool: KernelSessionPool) -> list[KernelSession]:
        """The pool's unclaimed kernels, oldest first."""
        out = [
            kernelsession.load(b)
            for b in self.store.list(pool.namespace)
            if (b["metadata"].get("labels") or {}).get(ksp.LABEL_POOL) == pool.name
        ]
        return sorted(out, key=lambda s: str(s.body["metadata"].get("creationTimestamp", "")))

    def _fresh(self, pool: KernelSessionPool, member: KernelSession) -> bool:
        labels = member.body["metadata"].get("labels") or {}
        return labels.get(ksp.LABEL_TEMPLATE) == pool.template_hash

    def _member(self, pool: KernelSessionPool, member: KernelSession, age: int) -> Member:
        """A kernel as the plan sees it; `age`: its place, oldest first."""
        phase = member.status.get("phase")
        return Member(
            name=member.name,
            uid=member.uid,
            resource_version="",
            template=pool.template_hash if self._fresh(pool, member) else "",
            created=float(age),
            ready=phase == st.READY,
            failed=phase in st.STUCK,
            deleting=False,
            reason=str(member.status.get("reason") or ""),
            message=str(member.status.get("message") or ""),
        )

    async def _delete_member(self, pool: KernelSessionPool, member: KernelSession) -> int:
        """Delete a kernel of the pool unless it was claimed meanwhile."""
        try:
            async with self.runtime.locked(member):
                try:
                    current = self.store.get(member.namespace, member.name)
                except SessionNotFound:
                    return 0  # claimed (renamed) or deleted
                labels = current["metadata"].get("labels") or {}
                if labels.get(ksp.LABEL_POOL) != pool.name:
                    return 0
                await self.runtime.delete_locked(kernelsession.load(current))
                return 1
        except SessionNotFound:
            return 0
        except ForgeError as exc:
            log.warning("could not delete %s of pool %s: %s", member.name, pool.name, exc)
            return 0

    async def fill(self, pool: KernelSessionPool) -> None:
        """Bring the pool to `size` ready kernels of its current template (see the module
        docstring); returns once it holds them, or when starting one failed."""
        async with self._filling(pool) as mine:
            if not mine:
                return  # another process fills it
            while True:
                try:
                    pool = self.get(pool.name, pool.namespace)
                except SessionNotFound:
                    return  # deleted meanwhile
                members = self.members(pool)
                failed = [m for m in members if m.status.get("phase") in st.STUCK]
                claimed = self._claimed(pool)
                # The plan a cluster's pool follows: kernels of an older template go as new
                # ones answer (or sooner, to stay within maxSize), extras go, the newest first.
                seen = [self._member(pool, m, i) for i, m in enumerate(members)]
                todo = plan(
                    seen,
                    size=pool.wanted(claimed),
                    max_starting=pool.max_starting,
                    template=pool.template_hash,
                    room=pool.room(claimed),
                )
                gone = {m.name for m in todo.delete}
                drop = [m for m in members if m.name in gone]
                start = todo.start
                # As on a cluster: failed kernels in a row back the pool off, then stall it.
                now = time.time()
                old = Trouble.from_status((pool.body.get("status") or {}).get("failures"))
                failing = [m for m in todo.delete if m.failed]
                trouble = pool_trouble(old, seen, failing, template=pool.template_hash, now=now)
                if trouble is not None:
                    start = min(start, 0 if now < trouble.next_start(self.backoff) else 1)
                self._write_status(pool, starting=start, trouble=trouble)
                if not drop and not start:
                    return
                for member in failed:
                    log.warning(
                        "kernel %s of pool %s failed: %s",
                        member.name,
                        pool.name,
                        member.status.get("message"),
                    )
                await asyncio.gather(*(self._delete_member(pool, m) for m in drop))
                results = await asyncio.gather(
                    *(self._start_member(pool) for _ in range(start)), return_exceptions=True
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                for error in errors:
                    if not isinstance(error, Exception):
                        raise error
                if errors:
                    self._write_status(pool, error=str(errors[0]))
                    log.warning("pool %s: a kernel did not start: %s", pool.name, errors[0])
                    return  # the next keeper pass tries again

    async def _start_member(self, pool: KernelSessionPool) -> None:
        body = ksp.member_body(pool, f"{pool.name}-{secrets.token_hex(4)}")
        await self.runtime.apply(body)

    async def keep(self, stop: asyncio.Event, *, interval: float) -> None:
        """Keep every pool filled until `stop`: after each claim, and every `interval`."""
        while not stop.is_set():
            self.wanted.clear()
            await self.fill_all()
            waits = {asyncio.ensure_future(e.wait()) for e in (stop, self.wanted)}
            try:
                await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if self.wanted.is_set() and not stop.is_set():
                # A claim: its kernel's first call, which mostly comes at once, goes
                # first; a pod's start (podman's locks, a core's worth of work) after it.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REFILL_SETTLE):
                        await stop.wait()

    async def fill_all(self) -> None:
        """One keeper pass over every pool of the store."""
        for pool in self.all():
            try:
                await self.fill(pool)
            except ForgeError as exc:
                log.warning("could not fill pool %s: %s", pool.name, exc)

    @contextlib.asynccontextmanager
    async def _filling(self, pool: KernelSessionPool) -> AsyncIterator[bool]:
        """The pool's fill lock, if free (a file lock: other processes fill too)."""
        path = self._lock_path(pool)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
            if self.store.get_pool(pool.namespace, pool.name) is None:
                path.unlink(missing_ok=True)  # deleted meanwhile: its lock goes with it
        finally:
            os.close(fd)

    def _claimed(self, pool: KernelSessionPool, bodies: list[dict[str, Any]] | None = None) -> int:
        """Sessions that hold a kernel claimed from the pool now (a suspended or expired
        one's pod is gone: it does not, as on a cluster)."""
        return sum(
            1
            for b in (self.store.list(pool.namespace) if bodies is None else bodies)
            if (b["metadata"].get("annotations") or {}).get(ksp.ANNOTATION_CLAIMED_FROM)
            == pool.name
            and not (b["metadata"].get("labels") or {}).get(ksp.LABEL_POOL)
            and (b.get("status") or {}).get("phase") not in st.NO_KERNEL
        )

    def _write_status(
        self,
        pool: KernelSessionPool,
        *,
        starting: int = 0,
        error: str | None = None,
        trouble: Trouble | None = None,
    ) -> None:
        """Count the pool's kernels into its status (`starting`: about to be started)."""
        bodies = self.store.list(pool.namespace)
        ready = 0
        for b in bodies:
            meta, phase = b["metadata"], (b.get("status") or {}).get("phase")
            labels = meta.get("labels") or {}
            if (
                labels.get(ksp.LABEL_POOL) == pool.name
                and labels.get(ksp.LABEL_TEMPLATE) == pool.template_hash
            ):
                ready += phase == st.READY
                starting += phase in st.IN_PROGRESS
        claimed = self._claimed(pool, bodies)
        patch: dict[str, Any] = {
            "observedGeneration": pool.body["metadata"].get("generation", 1),
            "templateHash": pool.template_hash,
            "claimed": claimed,
            "ready": ready,
            "starting": starting,
        }
        if error is None:  # an error leaves the failures counted as they were
            patch["failures"] = trouble.as_status() if trouble is not None else None
        old = (pool.body.get("status") or {}).get("conditions")
        ok, reason, message = (
            (False, "KernelStartFailed", error[:1000]) if error else pool.condition(ready, claimed)
        )
        patch["conditions"] = pool_conditions(
            old,
            (ok, reason, message),
            trouble=trouble,
            generation=int(pool.body["metadata"].get("generation", 1)),
            now=st.stamp(),
        )
        self.store.patch_pool_status(pool.namespace, pool.name, patch)

    # ---- claims -------------------------------------------------------------------------

    async def claim(self, body: dict[str, Any]) -> SessionClaim:
        """Give the (validated) session `body` a ready kernel of its spec.poolRef's pool.

        SessionClaim.session is None when it must start cold; the reason says why.
        """
        meta, spec = body["metadata"], body["spec"]
        name, namespace = spec["poolRef"]["name"], meta["namespace"]
        raw = self.store.get_pool(namespace, name)
        if raw is None:
            return SessionClaim(
                None, ksp.POOL_NOT_FOUND, f"no KernelSessionPool {name!r}: started cold"
            )
        pool = ksp.load(raw)
        claiming = kernelsession.load(body)
        try:
            self.runtime.secrets.values(claiming)
            egress.values(claiming, lambda secret: self.runtime.secrets.find(secret, namespace))
        except SecretError as exc:  # the cold start fails with it, and says so
            return SessionClaim(None, ksp.CLAIM_FAILED, f"{exc}: not claimed")
        why = ksp.unservable(pool, spec)
        if why:
            self.store.patch_pool_status(namespace, name, {}, add={"misses": 1})
            return SessionClaim(None, ksp.POOL_MISMATCH, f"{why}: started cold")
        members = self.members(pool)
        ready = [m for m in members if self._fresh(pool, m) and m.status.get("phase") == st.READY]
        tried: list[str] = []
        for member in ready + ready:  # a second round waits for a lock held meanwhile
            try:
                session = await self._take(pool, member, body, wait=member.name in tried)
            except ForgeError:
                # The kernel taken is gone (_take): the counts say so, the keeper refills.
                self.store.patch_pool_status(namespace, name, {}, add={"misses": 1})
                self._write_status(pool)
                self.wanted.set()
                raise
            tried.append(member.name)
            if session is not None:
                self.store.patch_pool_status(namespace, name, {}, add={"claims": 1})
                self._write_status(pool)
                self.wanted.set()
                return SessionClaim(
                    session, ksp.CLAIMED, f"claimed a ready kernel of pool {name!r}"
                )
        self.store.patch_pool_status(namespace, name, {}, add={"misses": 1})
        self.wanted.set()
        starting = len([m for m in members if m.status.get("phase") in st.IN_PROGRESS])
        return SessionClaim(
            None,
            ksp.POOL_EXHAUSTED,
            f"pool {name!r} had no ready kernel (size {pool.size}, {starting} starting): "
            "started cold",
        )

    async def _take(
        self, pool: KernelSessionPool, member: KernelSession, body: dict[str, Any], *, wait: bool
    ) -> KernelSession | None:
        """Claim `member` for `body` (None if another claim, a fill or a delete has it).

        Its lock is taken at once, or with `wait` within LOCK_PATIENCE: never behind
        whatever long thing (a restart) its holder may be doing.
        """
        lock = self.runtime.lock_path(member)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            if not await _lock_within(fd, LOCK_PATIENCE if wait else 0.0):
                return None  # being refreshed, deleted or claimed: try the next one

            def claimable(stored: dict[str, Any]) -> bool:
                labels = stored["metadata"].get("labels") or {}
                return (
                    labels.get(ksp.LABEL_POOL) == pool.name
                    and labels.get(ksp.LABEL_TEMPLATE) == pool.template_hash
                    and (stored.get("status") or {}).get("phase") == st.READY
                )

            def make(stored: dict[str, Any]) -> dict[str, Any]:
                new = copy.deepcopy(body)
                new["metadata"].update(
                    uid=stored["metadata"]["uid"], creationTimestamp=st.stamp(), generation=1
                )
                annotations = new["metadata"].setdefault("annotations", {})
                annotations[ksp.ANNOTATION_CLAIMED_FROM] = pool.name
                new["status"] = {
                    **(stored.get("status") or {}),
                    "phase": st.STARTING,
                    "reason": ksp.CLAIMED,
                    "message": f"giving the kernel claimed from pool {pool.name!r} its environment",
                    "lastActivity": st.stamp(),
                }
                return new

            taken = self.store.take(member.namespace, member.name, claimable, make)
            if taken is None:
                return None
            session = kernelsession.load(taken)
            try:
                await self.finish(session)
            except (ForgeError, OSError, TimeoutError) as exc:
                await asyncio.shield(self._discard(session))
                raise SessionNotReady(
                    f"the kernel claimed from pool {pool.name!r} could not be made session "
                    f"{session.name!r} and was removed: {exc}"
                ) from exc
            return session
        finally:
            os.close(fd)

    async def _discard(self, session: KernelSession) -> None:
        """Delete a claimed kernel that neither took its environment nor started cold
        (its lock held): no row, pod or directory of it is left, and no client's quota
        counts it."""
        try:
            await self.runtime.delete_locked(session)
        except (ForgeError, OSError) as exc:
            log.warning("could not remove the failed claim %s: %s", session.name, exc)

    async def finish(self, session: KernelSession) -> None:
        """Give a claimed kernel its environment, then mark the session Ready; if it will
        not take it, a cold start. Called with the session's lock held: by the claim, or
        by a refresh that finds a claim some process began and did not finish."""
        pool = (session.body["metadata"].get("annotations") or {}).get(ksp.ANNOTATION_CLAIMED_FROM)
        try:
            await self._give(session)
        except (ForgeError, OSError, TimeoutError) as exc:
            log.warning("claimed kernel of %s did not take its environment: %s", session.name, exc)
            await self.runtime.restart_cold(session)
            message = f"the kernel claimed from pool {pool!r} failed ({exc}): started cold"
            self.runtime.set_warm_start(session, False, ksp.CLAIM_FAILED, message)
            return
        self.runtime.mark_ready(session, f"the kernel answered (claimed from pool {pool!r})")
        message = f"claimed a ready kernel of pool {pool!r}"
        self.runtime.set_warm_start(session, True, ksp.CLAIMED, message)

    async def _give(self, session: KernelSession) -> None:
        """The session's egress (its values read from its Secrets now) and environment
        (their values too), set in its claimed kernel."""
        await self.runtime.give_egress(session)
        env = ksp.claim_env(session, secret_values=self.runtime.secrets.values(session))
        await self.runtime.give_env(session, env, session.spec.files)
        await self.runtime.give_packages(session)


async def _lock_within(fd: int, patience: float) -> bool:
    """Take an exclusive flock on `fd` if it is free now or within `patience` seconds.

    flock has no timeout, and a thread blocked in it cannot be called back; polling
    without blocking, in small steps, bounds the wait and leaves nothing behind.
    """
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        await asyncio.sleep(_LOCK_STEP)
