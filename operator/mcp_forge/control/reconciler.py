"""The operator's reconciler: every KernelSession kept true on a cluster, by one
level-based `reconcile` whatever woke it (a change, an event of a child, a deadline).

It reads the session and its children afresh (a session's first reconcile starts from its
ADDED event, and a claim from the pool as the watches showed it: control/watched.py),
makes them what the spec says (Secret with
a key kept across reconciles, Service, NetworkPolicy, Lease, Pod: control/realize.py's
pipeline), and writes status only when it changed. Calls for one session are serialized;
sessions reconcile in parallel, their API calls side by side in a pool of threads. The
deadlines are the scheduler's (control/schedule.py); the kopf wiring that feeds it is
control/handlers.py.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mcp_forge import metrics
from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import ConnectionInfo, new_key
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.keys import new_bridge_cert, new_curve_keys, new_egress_ca, usable_keys
from mcp_forge.api.status import stamp
from mcp_forge.clients.kube import (
    Kube,
    connection_file_of,
    key_of,
)
from mcp_forge.clients.kubelet import Kubelet
from mcp_forge.control import events
from mcp_forge.control import workspace as ws
from mcp_forge.control.answers import Answers
from mcp_forge.control.baseline import Baseline
from mcp_forge.control.egress import EgressUnavailable, Grants
from mcp_forge.control.heard import Heard
from mcp_forge.control.poolkeeper import PodClaim, PoolKeeper, Seen
from mcp_forge.control.realize import Children, Outcome, early_claim, host_of, realize, unseen
from mcp_forge.control.render import (
    LABEL_COMPONENT,
    LABEL_SESSION,
    TEMPLATE_HASH,
    render_kubernetes,
    render_lease,
    secret_name,
)
from mcp_forge.control.render_egress import Route, ca_of
from mcp_forge.control.schedule import Key, Scheduler
from mcp_forge.control.watched import kept
from mcp_forge.egress import grant
from mcp_forge.errors import ApiError, ForgeError, InvalidSession
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

# A pool is refilled this long after a claim: the claimed session's client reads its
# Secret and connects meanwhile (on 2 cores, a refill's Secret and pod beside them cost
# it tens of ms), while a new kernel takes seconds to start either way.
REFILL_AFTER = 0.2
CALLS = 16  # API calls of those reconciles made side by side (threads)

KS = kernelsession.KIND
POOL = ksp.KIND


def _differs(current: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a child's spec lacks what we want (an API server adds fields of its own,
    and drops empty lists such as a NetworkPolicy's `egress: []`)."""
    empty: tuple[Any, ...] = ([], {}, None)
    return any(
        not (v in empty and current.get(k) in empty) and current.get(k) != v
        for k, v in want.items()
    )


class Reconciler:
    """Keeps sessions true; owns the deadlines. Lives in kopf's event loop."""

    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube = kube
        self.settings = settings
        self.baseline = Baseline(kube)
        self.events = events.Recorder(kube)
        self.pools = PoolKeeper(kube, settings, self.baseline)
        self._locks: dict[Key, asyncio.Lock] = {}
        self.schedule = Scheduler(self._one, settings.operator_resync)
        self.answers = Answers(kube, self.poke)
        self.egress = Grants(kube, settings)
        self._calls = concurrent.futures.ThreadPoolExecutor(CALLS, "mcp-forge-api")
        self.workspaces = ws.Claims(kube)
        # The uid of the newest KernelSession seen under each name (handlers.session_event).
        self.newest: dict[tuple[str, str], str | None] = {}
        # A session just made, as its ADDED event brought it: its first reconcile starts
        # from it rather than read it again (`arrived`).
        self._made: dict[tuple[str, str], dict[str, Any]] = {}
        # The uid of the session each name's reconciles last read (or started from): an
        # ADDED body of that uid is no news to them. Kept past `forget`, dropped with
        # that session's DELETED event.
        self._read: dict[tuple[str, str], str] = {}
        self.heard = Heard(self.answers.of)  # the watch's events of its own writes are not news
        # checkpoints (control/snapshots.py)
        self.kubelet = Kubelet(kube, settings.checkpoint_service_account)

    def close(self) -> None:
        # Calls already queued still run (each within the API client's timeouts), so a
        # reconcile waiting on them in _at_once ends, and the loop's executor with it. Not
        # cancel_futures: a future cancelled in the queue never wakes
        # concurrent.futures.wait, and the operator hung at its stop.
        self._calls.shutdown(wait=False)
        self.pools.tally.close()  # pending claim and miss counts written before the client goes
        self.events.close()  # and the Events recorded
        self.pools.events.close()
        self.kube.close()

    # ---- scheduling ----------------------------------------------------------------------

    def poke(self, namespace: str, name: str, at: float | None = None, *, kind: str = KS) -> None:
        """Reconcile the session (or pool) at `at` (now if None), or earlier if due."""
        self.schedule.poke((kind, namespace, name), at)

    def lock(self, namespace: str, name: str, *, kind: str = KS) -> asyncio.Lock:
        """The lock a reconcile of that object holds."""
        return self._locks.setdefault((kind, namespace, name), asyncio.Lock())

    def arrived(self, namespace: str, name: str, type: str | None, body: Any) -> None:
        """A watch event of a session. One just made (ADDED, no status yet) is kept for
        its first reconcile, one round trip sooner: the event is the object as the API
        server stored it, and any later event drops it (that reconcile reads again). Not
        if a reconcile has read that session already (one woken by an earlier session's
        child, say): it may have written its status since."""
        key, uid = (namespace, name), (body.get("metadata") or {}).get("uid")
        if type == "ADDED" and self._read.get(key) != uid and unseen(body.get("status") or {}):
            self._made[key] = kept(body)
        else:
            self._made.pop(key, None)
        if type == "DELETED" and self._read.get(key) == uid:
            del self._read[key]

    def forget(self, namespace: str, name: str, *, kind: str = KS) -> None:
        self.schedule.forget((kind, namespace, name))
        self._locks.pop((kind, namespace, name), None)
        if kind == KS:
            self._made.pop((namespace, name), None)
            self.workspaces.forget(namespace, name)
            self.heard.forget(namespace, name)
            self.answers.forget(namespace, name)

    async def run(self) -> None:
        """Reconcile sessions as they fall due; every session at least every resync."""
        await self.schedule.run()

    async def _one(self, kind: str, namespace: str, name: str) -> None:
        if kind == POOL:
            await self.reconcile_pool(namespace, name)
        else:
            await self.reconcile(namespace, name)

    async def reconcile_pool(self, namespace: str, name: str) -> None:
        """Keep a KernelSessionPool full (control/poolkeeper.py)."""
        key = (POOL, namespace, name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            try:
                with metrics.timed(metrics.RECONCILE_SECONDS, metrics.RECONCILE_ERRORS, kind=POOL):
                    due = await asyncio.to_thread(self.pools.reconcile, namespace, name)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                if await asyncio.to_thread(self.kube.get, POOL, namespace, name):
                    raise
                due = None  # deleted while we were at it: its kernels are GC'd
        if due is None:
            self.forget(namespace, name, kind=POOL)
        else:
            self.poke(namespace, name, time.time() + due, kind=POOL)

    async def reconcile(self, namespace: str, name: str) -> Outcome:
        key = (KS, namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        newest = self.newest.get((namespace, name))
        async with lock:
            try:
                with metrics.timed(metrics.RECONCILE_SECONDS, metrics.RECONCILE_ERRORS, kind=KS):
                    outcome = await asyncio.to_thread(self._reconcile, namespace, name)
            except Exception as exc:
                self.heard.forget(namespace, name)  # what it saw was not acted on: news again
                # Deleted while we were at it: nothing left to do (its children are GC'd).
                if not isinstance(exc, ApiError) or not exc.not_found:
                    raise
                if await asyncio.to_thread(self.kube.get, "KernelSession", namespace, name):
                    raise
                outcome = Outcome(gone=True)
        if self.heard.missed(namespace, name):  # its pod changed while it ran
            self.poke(namespace, name)
        if outcome.refill:  # soon, not beside the client's first reads of its claim
            self.poke(namespace, outcome.refill, time.time() + REFILL_AFTER, kind=POOL)
        if outcome.gone:
            self.forget(namespace, name)
            if self.newest.get((namespace, name)) not in (None, newest):
                self.poke(namespace, name)  # one of that name made meanwhile: its poke went
            return outcome
        resync = time.time() + self.settings.operator_resync
        self.poke(namespace, name, min(resync, outcome.due or resync))
        return outcome

    # ---- the reconcile -------------------------------------------------------------------

    def _reconcile(self, namespace: str, name: str) -> Outcome:
        key = (namespace, name)
        body = self._made.pop(key, None)
        if body is not None:  # not if it is no longer the newest, or was read already
            uid = body["metadata"].get("uid")
            if uid != self.newest.get(key) or uid == self._read.get(key):
                body = None
        if body is None:
            body = self.kube.get(KS, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome(gone=True)
        meta = body["metadata"]
        self._read[key] = str(meta.get("uid"))
        generation = int(meta.get("generation") or 1)
        old: dict[str, Any] = body.get("status") or {}
        now = time.time()
        try:
            spec_only = {k: v for k, v in body.items() if k != "status"}
            session = kernelsession.load(
                kernelsession.validate(spec_only, default_namespace=namespace)
            )
        except InvalidSession as exc:
            if old.get("reason") != st.INVALID_SPEC or old.get("observedGeneration") != generation:
                log.warning("KernelSession %s/%s is not valid: %s", namespace, name, exc)
            self._write(body, self._invalid(old, str(exc), generation, stamp(now)))
            return Outcome(invalid=str(exc))
        try:
            return realize(self, session, body, old, generation, now)
        except ForgeError as exc:  # said on the session too, for `kubectl describe`; retried
            if not (isinstance(exc, ApiError) and exc.not_found):
                self.events.record(body, [(events.WARNING, events.RECONCILE_ERROR, str(exc))])
            raise

    @staticmethod
    def _invalid(old: dict[str, Any], why: str, generation: int, now: str) -> dict[str, Any]:
        status = dict(old)
        status.update(
            phase=st.FAILED,
            reason=st.INVALID_SPEC,
            message=why,
            observedGeneration=generation,
            conditions=st.conditions(
                old.get("conditions"),
                st.FAILED,
                st.INVALID_SPEC,
                why,
                generation=generation,
                now=now,
            ),
        )
        return status

    def _owned(self, obj: dict[str, Any] | None, session: KernelSession) -> dict[str, Any] | None:
        """`obj` if it belongs to this session; an earlier session's leftover is deleted.

        Without a finalizer a KernelSession is gone at once while the garbage collector
        removes its children later: a new session of the same name must not take over
        the old one's key, or its running kernel.
        """
        if obj is None or not session.uid:
            return obj
        refs = obj["metadata"].get("ownerReferences") or []
        if any(r.get("uid") == session.uid and r.get("controller") for r in refs):
            return obj
        meta = obj["metadata"]
        log.info(
            "removing %s %s/%s, left by an earlier session of that name",
            obj.get("kind"),
            meta.get("namespace"),
            meta.get("name"),
        )
        self.kube.delete(obj["kind"], meta["namespace"], meta["name"], uid=meta.get("uid", ""))
        return None

    def _ensure(
        self, want: dict[str, Any], session: KernelSession, *, likely_new: bool = False
    ) -> dict[str, Any]:
        """The child `want` names, this session's: made if absent; an earlier session's
        leftover deleted first."""
        current, made = self.kube.ensure(want, likely_new=likely_new)
        if made or self._owned(current, session) is not None:
            return current
        current, made = self.kube.ensure(want, likely_new=True)  # the leftover is deleted
        if not made and self._owned(current, session) is None:  # still on its way out
            meta = want["metadata"]
            raise ApiError(
                409, "Conflict", f"an earlier {want['kind']} {meta['name']} is being removed"
            )
        return current

    def _at_once(
        self, *calls: Callable[[], Any], after: Callable[[list[Future[Any]]], Any] | None = None
    ) -> list[Any]:
        """The results of independent API calls made side by side; when one fails, the
        others still end before its error is raised (nothing of this reconcile runs on).

        `after` runs beside them, given their futures, and may wait on some: they were
        queued before it, so each is running or done when it starts (no thread of the
        pool waits on a call still queued). Its result comes last."""
        futures = [self._calls.submit(call) for call in calls]
        if after is not None:
            futures.append(self._calls.submit(after, list(futures)))
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def _kernel_pod(
        self, session: KernelSession, old: dict[str, Any], *, cached: bool = False
    ) -> dict[str, Any] | None:
        """The session's kernel pod: its own (ks-<name>), or the one it claimed from a pool.

        Found by the session's label and owner, so a claim whose status write was lost is
        found as well. Another live one (which no reconcile makes) is deleted: a session
        never holds two kernels. `cached` (a session no operator has seen yet): from the
        API server's cache, at once; a pod there is one a reconcile made before its
        status write was lost, a retry's backoff ago, long since in the cache.
        """
        listed = self.kube.list(
            "Pod",
            session.namespace,
            labels={LABEL_SESSION: session.name, LABEL_COMPONENT: "kernel"},
            cached=cached,
        )
        mine: list[dict[str, Any]] = [
            p for p in listed.get("items") or [] if self._owned(p, session) is not None
        ]
        if not mine:
            return None

        def rank(pod: dict[str, Any]) -> tuple[bool, bool, str]:
            meta = pod["metadata"]
            return (
                not meta.get("deletionTimestamp"),
                meta.get("uid") == old.get("kernelId"),
                str(meta.get("creationTimestamp")),
            )

        mine.sort(key=rank, reverse=True)
        for extra in mine[1:]:
            meta = extra["metadata"]
            if not meta.get("deletionTimestamp"):
                log.warning(
                    "deleting pod %s/%s: a second kernel of one session",
                    meta["namespace"],
                    meta["name"],
                )
                self.kube.delete("Pod", meta["namespace"], meta["name"], uid=meta["uid"])
        return mine[0]

    def _children(self, session: KernelSession, old: dict[str, Any], *, fresh: bool) -> Children:
        """Service, NetworkPolicy and Lease made right, the session's Secret read and its
        kernel pod found: side by side, as none needs another. A `fresh` session (no status
        yet) most likely has none of them: they are created first, read only if there.

        The NetworkPolicy is in place when this returns, so before the status that says
        Ready. A fresh session's claim is made beside it (`early_claim`): the claim moves
        the pod out of its pool's NetworkPolicy, and the namespace's baseline policy,
        looked at before the claim, keeps it closed until this one is there. Nothing of
        the client reaches a claimed kernel before Ready (docs/security.md).
        """
        ns = session.namespace
        # Only the Secret holds keys: these need none (no key made to be thrown away).
        _, service, policy, want_pod = self._rendered(session, ConnectionInfo("tcp", "", ""))

        def spec_of(child: dict[str, Any]) -> Callable[[], dict[str, Any]]:
            def made() -> dict[str, Any]:
                current = self._ensure(child, session, likely_new=fresh)
                if _differs(current.get("spec") or {}, child["spec"]):
                    self.kube.patch(
                        child["kind"], ns, child["metadata"]["name"], {"spec": child["spec"]}
                    )
                return current

            return made

        # Its first kernel, most likely a claim: the pool is read along with the rest.
        pool = session.spec.pool if fresh else None

        def secret() -> dict[str, Any] | None:
            if fresh and pool:  # a claimed kernel's Secret comes with its pod
                return None
            if fresh:  # made now, beside the rest, so that the pod can follow at once
                return self._ensure(self._render(session, None)[0], session, likely_new=True)
            return self._owned(self.kube.get("Secret", ns, secret_name(session)), session)

        early = bool(pool) and early_claim(session, time.time())
        # A claim's reads are queued first: the claim waits on them, then on its own
        # write, while each create beside it takes one write.
        got = self._at_once(
            lambda: self._kernel_pod(session, old, cached=fresh),
            # Looked at afresh before a claim: it is what keeps the claimed pod closed.
            lambda: self.baseline.ensure(ns, look=pool is not None),
            lambda: self.pools.look(ns, pool) if pool else None,
            spec_of(service),
            spec_of(policy),
            lambda: self._lease(session, fresh=fresh),
            secret,
            lambda: self.workspaces.ensure(session, old, fresh=fresh),
            after=(
                (lambda made: self._claim_early(session, want_pod, *made[:3])) if early else None
            ),
        )
        return Children(
            want_pod,
            secret=got[6],
            lease=got[5],
            pod=got[0],
            pool=got[2],
            workspace=got[7],
            claim=got[8] if len(got) > 8 else None,
        )

    def _lease(self, session: KernelSession, *, fresh: bool) -> dict[str, Any]:
        lease = self._ensure(render_lease(session), session, likely_new=fresh)
        self.heard.wrote(session, {"kind": "Lease", **lease})
        return lease

    def _claim_early(
        self,
        session: KernelSession,
        want_pod: dict[str, Any],
        pod: Future[Any],
        baseline: Future[Any],
        pool: Future[Any],
    ) -> PodClaim | None:
        """A fresh session's claim, made beside its Service, NetworkPolicy and Lease
        rather than after them (one API round trip sooner Ready; docs/security.md says
        why that is safe): once the session is known to hold no kernel yet, the
        namespace's baseline policy is in place and the pool is looked at (as the
        watches show it, control/watched.py): the futures of those calls of `_children`
        (`_at_once`'s `after`)."""
        if pod.result() is not None:  # a claim of an earlier try, its status not written
            return None
        baseline.result()
        seen: Seen = pool.result()
        template = want_pod["metadata"]["annotations"][TEMPLATE_HASH]
        claim = self.pools.claim(session, template, seen)
        if claim.pod is not None:
            self.heard.wrote(session, claim.pod)
        return claim

    def _render(
        self, session: KernelSession, secret: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        """Secret, Service, NetworkPolicy and Pod; the Secret's keys kept from `secret`,
        new where it has none."""
        curve, bridge = usable_keys(connection_file_of(secret) or {})
        name = f"{session.namespace}/{session.name}"
        ca = None
        if grant.reads_requests(session):
            ca = ca_of(_egress_data(secret)) or new_egress_ca(name)
        return self._rendered(
            session,
            ConnectionInfo(
                "tcp",
                host_of(session),
                key_of(secret) or new_key(),
                curve or new_curve_keys(),
                bridge or new_bridge_cert(name),
            ),
            ca,
        )

    def _rendered(
        self, session: KernelSession, conn: ConnectionInfo, egress_ca: Any = None
    ) -> list[dict[str, Any]]:
        return render_kubernetes(
            session,
            conn,
            gateway_namespace=self.settings.gateway_namespace or None,
            runtime_class=self.settings.kernel_runtime_class,
            seccomp_profile=self.settings.seccomp_profile or None,
            egress=self.egress_route(session),
            egress_ca=egress_ca,
            snapshots=bool(self.settings.snapshot_runtime_class),
        )

    def egress_route(self, session: KernelSession) -> Route | None:
        """Where the egress proxy is, for a session with an allow-list (None: no list, or
        no proxy installed: such a session's kernel is not started, realize.py)."""
        if not session.spec.egress_rules:
            return None
        try:
            return self.egress.route()
        except EgressUnavailable:
            return None

    def _own_secret(
        self, session: KernelSession, secret: dict[str, Any] | None, *, fresh: bool
    ) -> dict[str, Any] | None:
        """Make the Secret of the session's own pod (ks-<name>) right; the data to write
        before its next pod is made (None: it is complete).

        A Secret from an older operator has no Curve pair or bridge certificate (or one
        that is malformed): the kernel running now read it as it is, and the gateway uses
        what the Secret has, so it is completed only when the next kernel pod is made.
        A session whose kernel was claimed from a pool has no Secret of its own: its
        pod's Secret came with it.
        """
        ns = session.namespace
        if secret is None:
            self._ensure(self._render(session, None)[0], session, likely_new=fresh)
            return None
        want = self._render(session, secret)[0]
        if key_of(secret) is None:  # unreadable: a kernel cannot start with it
            self.kube.patch("Secret", ns, secret_name(session), {"stringData": want["stringData"]})
            return None
        curve, bridge = usable_keys(connection_file_of(secret) or {})
        if curve is None or bridge is None:
            return {"stringData": want["stringData"]}
        if _egress_missing(want["stringData"], _egress_data(secret)):
            return {"stringData": want["stringData"]}
        return None

    def _write(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        old = body.get("status") or {}
        patch = st.merge_patch(old, status)
        if not patch:
            return
        meta = body["metadata"]
        self.kube.patch(
            "KernelSession", meta["namespace"], meta["name"], {"status": patch}, status=True
        )
        self.events.record(body, events.changes(old, status))


def _egress_data(secret: dict[str, Any] | None) -> dict[str, str]:
    """The egress keys of a connection Secret as read (control/render_egress.py)."""
    data = (secret or {}).get("data") or {}
    out = {}
    for key, value in data.items():
        if key.startswith("egress-") and isinstance(value, str):
            with contextlib.suppress(ValueError):
                out[key] = base64.b64decode(value).decode()
    return out


def _egress_missing(want: dict[str, str], have: dict[str, str]) -> bool:
    """Whether the Secret lacks an egress key its next pod refers to, or holds another
    credential than its key's (the key was made again)."""
    return any(have.get(k) != v for k, v in want.items() if k.startswith("egress-"))
