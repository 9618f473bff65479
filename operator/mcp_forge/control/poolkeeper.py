"""Warm pools on a cluster: KernelSessionPools kept full, and their kernels claimed.

A pool's kernel is a Pod and its Secret (a key of its own: never one shared by two pods),
named ``ksp-<pool>-<8 hex digits>``, labelled with the pool and its template's hash and
owned by the pool. The Secret is owned by its Pod, so it goes wherever the Pod goes. A
NetworkPolicy per pool admits the gateways to its kernels, as a session's does; the
namespace's baseline policy (baseline.py) keeps them closed to all else, also while a
claim moves one from the pool's policy to its session's.

A claim is one write: a JSON merge patch of the Pod, guarded by the resourceVersion read,
that moves its owner reference from the pool to the session and its labels from the
pool's to the session's (the session's Service and NetworkPolicy select it from then on).
Two claims of one pod, or a claim racing the pool's own deletion of it, cannot both
succeed: the second write finds a newer resourceVersion and is refused. A claim whose
status write is lost is found again by its labels and owner; a pod that no write claimed
stays the pool's. The claimed kernel keeps running: no restart.

Claims and misses are counted in the pool's status (`claims`, `misses`), as local pools
count them: a miss is a session the pool could not serve (PoolMismatch) or had no ready
kernel for (PoolExhausted); a session naming no such pool, or one it could serve but
whose Secrets are missing (ClaimFailed), is no miss. The count is written off the
claim's path, by `Tally`'s one thread: a JSON merge patch of the status guarded by the
resourceVersion read, read again and retried on a conflict, so two claims at once (or
two operators) never write the same count. A count not yet written when the operator
stops is lost: a counter, not a ledger.

Which kernels to delete and how many to start is control/poolplan.py's (pure);
`PoolKeeper` does the I/O.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import ConnectionInfo, new_key
from mcp_forge.api.kernelsession import API_VERSION, KernelSession
from mcp_forge.api.kernelsessionpool import KernelSessionPool
from mcp_forge.api.keys import new_bridge_cert, new_curve_keys
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.clients.kube import Kube, secret_env
from mcp_forge.control import events
from mcp_forge.control.baseline import Baseline
from mcp_forge.control.pods import observe
from mcp_forge.control.poolplan import (
    LABEL_CLAIMED_FROM,
    Member,
    Plan,
    Trouble,
    claimed_from,
    label_value,
    member_pod_name,
    plan,
    pool_labels,
)
from mcp_forge.control.poolplan import conditions as pool_conditions
from mcp_forge.control.poolplan import trouble as pool_trouble
from mcp_forge.control.render import (
    KERNEL_LABELS,
    LABEL_COMPONENT,
    LABEL_NAMESPACE,
    LABEL_SESSION,
    TEMPLATE_HASH,
    connection_secret_of,
    give_connection_secret,
    render_kubernetes,
)
from mcp_forge.control.watched import Watched
from mcp_forge.errors import ApiError, InvalidSession, SecretError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

KIND = ksp.KIND
STARTING_RECHECK = 15.0
COUNT_ATTEMPTS = 8  # conflicting status writes before a count waits for the next one
# Counts are written this long after their claim, not beside it: the claimed session's
# status write and its client's first reads go first, and a burst's claims share a write.
COUNT_DELAY = 0.5


def _owner(kind: str, name: str, uid: str, api_version: str = API_VERSION) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}


@dataclass(frozen=True)
class Seen:
    """A pool as a claim starts from it: as the watches showed it, or read (`look`)."""

    body: dict[str, Any] | None  # the KernelSessionPool, if there is one
    pods: list[dict[str, Any]]  # its kernel pods (label pool=<name>)


@dataclass(frozen=True)
class PodClaim:
    pod: dict[str, Any] | None  # the claimed pod; None: start cold
    reason: str  # kernelsessionpool's WarmStart reasons
    message: str


class Tally:
    """Claims and misses added to pools' status counters, in a thread of its own.

    `add` returns at once; the writes follow in order, COUNT_DELAY after the first
    count of each (a claim's is most often written sooner, by the refill's reconcile:
    `flush`), one pool's pending counts in one write. A count whose write fails is kept
    for the pool's next reconcile, which flushes it.
    """

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], Counter[str]] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "mcp-forge-pool-counts")
        self._closing = threading.Event()

    def add(self, pool: KernelSessionPool, field: str) -> None:
        key = (pool.namespace, pool.name, pool.uid)
        with self._lock:
            scheduled = key in self._pending
            self._pending.setdefault(key, Counter())[field] += 1
        if not scheduled:
            self._writer.submit(self._flush_logged, key, time.monotonic() + COUNT_DELAY)

    def close(self) -> None:
        """Write what was added (at once, bounded by the API's timeouts), then stop."""
        self._closing.set()
        self._writer.shutdown(wait=True)

    def flush(self, namespace: str, name: str) -> None:
        """Write the pool's pending counts now (the pool's reconcile calls it)."""
        with self._lock:
            keys = [k for k in self._pending if k[:2] == (namespace, name)]
        for key in keys:
            self._flush(key)

    def _flush_logged(self, key: tuple[str, str, str], due: float) -> None:
        self._closing.wait(max(0.0, due - time.monotonic()))
        try:
            self._flush(key)
        except ApiError as exc:
            log.warning("pool %s/%s: counts kept for the next write: %s", *key[:2], exc)

    def _flush(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            add = self._pending.pop(key, None)
        if not add:
            return
        try:
            self._write(key, add)
        except ApiError:
            with self._lock:
                self._pending.setdefault(key, Counter()).update(add)
            raise

    def _write(self, key: tuple[str, str, str], add: Counter[str]) -> None:
        namespace, name, uid = key
        for attempt in range(COUNT_ATTEMPTS):
            if attempt:  # writers that collided go again apart, not in the same step
                time.sleep(random.uniform(0, 0.01 * 2**attempt))
            body = self.kube.get(KIND, namespace, name)
            if body is None or body["metadata"].get("uid") != uid:
                return  # that pool is gone: nothing left to count on
            meta, old = body["metadata"], body.get("status") or {}
            counts = {k: int(old.get(k) or 0) + n for k, n in add.items()}
            patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": counts}
            try:
                self.kube.patch(KIND, namespace, name, patch, status=True)
            except ApiError as exc:
                if exc.not_found:
                    return
                if exc.conflict:
                    continue  # written meanwhile (its reconcile, another count): read again
                raise
            return
        raise ApiError(409, "Conflict", f"{COUNT_ATTEMPTS} status writes of the pool conflicted")


class PoolKeeper:
    """Keeps KernelSessionPools full and serves claims; blocking calls, run in a thread."""

    def __init__(self, kube: Kube, settings: Settings, baseline: Baseline | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.baseline = baseline or Baseline(kube)
        self.tally = Tally(kube)
        self.events = events.Recorder(kube)
        self.watched = Watched()  # fed by the operator's watches (control/handlers.py)

    # ---- filling -------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> float | None:
        """Make the pool's kernels what its spec says; when to look again (None: gone)."""
        body = self.kube.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.watched.dropped(namespace, name)  # claims read it, if it comes back
            return None
        try:
            spec_only = {k: v for k, v in body.items() if k != "status"}
            pool = ksp.load(ksp.validate(spec_only, default_namespace=namespace))
        except InvalidSession as exc:
            self._write_status(body, None, None, 0, error=("InvalidSpec", str(exc)))
            return None
        # The sessions, then one list of the namespace's kernels, the pool's and those
        # claimed from it (see claimed_from).
        sessions = self.kube.list(kernelsession.KIND, namespace).get("items") or []
        kernels = self.kube.list("Pod", namespace, labels=KERNEL_LABELS).get("items") or []
        pods = [p for p in kernels if label_value(p, ksp.LABEL_POOL) == name]
        self.watched.listed(namespace, name, pods)  # for claims (control/watched.py)
        claimed = claimed_from(name, sessions, kernels)
        members = []
        for pod in pods:
            refs = pod["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == pool.uid for r in refs):
                self._delete_pod(pod, why="left by an earlier pool of that name")
                continue
            members.append(self._member(pool, pod))
        self._collect_secrets(pool, {p["metadata"]["name"] for p in pods})
        todo = plan(
            members,
            size=pool.wanted(claimed),
            max_starting=pool.max_starting,
            template=pool.template_hash,
            room=pool.room(claimed),
        )
        now, backoff = time.time(), self.settings.pool_backoff
        failed = [m for m in todo.delete if m.failed]
        old = Trouble.from_status((body.get("status") or {}).get("failures"))
        trouble = pool_trouble(old, members, failed, template=pool.template_hash, now=now)
        if failed and trouble is not None:  # what `kubectl describe ksp` shows
            said = f"kernel {failed[-1].name} failed: {trouble.message or trouble.reason}"
            told = [(events.WARNING, trouble.reason, said)]
            if trouble.stalled and (old is None or not old.stalled):
                told.append((events.WARNING, "Stalled", f"{trouble.count} failed in a row"))
            self.events.record(body, told)
        if trouble is not None:
            # Backing off: no new kernel before then, and one at a time after (a Stalled
            # pool still tries, a backoff apart: the kubelet's trouble may pass).
            allowed = 0 if now < trouble.next_start(backoff) else 1
            if todo.start > allowed:
                todo = replace(todo, start=allowed, starting=todo.starting - todo.start + allowed)
        for member in todo.delete:
            self._delete_member(pool, member)
        self.baseline.ensure(namespace, look=True)  # its kernels are claimed: see there
        self._ensure_policy(pool)
        error, started = None, []
        for _ in range(todo.start):
            try:
                started.append(self._start_member(pool))
            except ApiError as exc:
                error = ("KernelStartFailed", str(exc))
                log.warning("pool %s/%s could not start a kernel: %s", namespace, name, exc)
                break
        self.events.record(body, [(events.NORMAL, "Started", f"kernel {n} made") for n in started])
        self._write_status(body, pool, todo, claimed, error=error, trouble=trouble)
        self.tally.flush(namespace, name)
        if trouble is not None and now < trouble.next_start(backoff):
            return max(0.5, min(trouble.next_start(backoff) - now, self.settings.operator_resync))
        if todo.starting or todo.delete or error:
            return STARTING_RECHECK
        return self.settings.operator_resync

    @staticmethod
    def _member(pool: KernelSessionPool, pod: dict[str, Any]) -> Member:
        meta = pod["metadata"]
        seen = observe(_draft(pool, meta["name"]), pod)
        return Member(
            name=meta["name"],
            uid=meta["uid"],
            resource_version=meta["resourceVersion"],
            template=(meta.get("labels") or {}).get(ksp.LABEL_TEMPLATE, ""),
            created=parse_time(meta.get("creationTimestamp")) or 0.0,
            ready=seen.ready,
            failed=seen.phase in (st.FAILED, st.RESTARTING),
            deleting=bool(meta.get("deletionTimestamp")),
            reason=seen.reason,
            message=seen.message,
        )

    def _delete_member(self, pool: KernelSessionPool, member: Member) -> None:
        """Delete it unless a claim wrote it since we read it (its resourceVersion moved)."""
        log.info("pool %s/%s: removing kernel %s", pool.namespace, pool.name, member.name)
        self.kube.delete(
            "Pod",
            pool.namespace,
            member.name,
            uid=member.uid,
            resource_version=member.resource_version,
        )

    def _delete_pod(self, pod: dict[str, Any], *, why: str) -> None:
        meta = pod["metadata"]
        log.info("removing pod %s/%s, %s", meta["namespace"], meta["name"], why)
        self.kube.delete(
            "Pod",
            meta["namespace"],
            meta["name"],
            uid=meta["uid"],
            resource_version=meta["resourceVersion"],
        )

    def _collect_secrets(self, pool: KernelSessionPool, pods: set[str]) -> None:
        """A Secret still owned by the pool is one whose pod was never made, or made and
        not yet given the Secret (a reconcile cut short): hand it to its pod, or delete it."""
        listed = self.kube.list("Secret", pool.namespace, labels={ksp.LABEL_POOL: pool.name})
        for secret in listed.get("items") or []:
            meta = secret["metadata"]
            refs = meta.get("ownerReferences") or []
            if any(r.get("kind") == "Pod" for r in refs):
                continue
            pod_name = meta["name"].removesuffix("-conn")
            pod = self.kube.get("Pod", pool.namespace, pod_name) if pod_name in pods else None
            if pod is not None:
                self._give_secret(pool.namespace, meta["name"], pod)
            else:
                self.kube.delete("Secret", pool.namespace, meta["name"], uid=meta["uid"])

    def _give_secret(self, namespace: str, secret: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        owner = _owner("Pod", meta["name"], meta["uid"], api_version="v1")
        self.kube.patch("Secret", namespace, secret, {"metadata": {"ownerReferences": [owner]}})

    def _render(self, pool: KernelSessionPool, pod_name: str) -> list[dict[str, Any]]:
        ns = pool.namespace
        return render_kubernetes(
            _draft(pool, pod_name),
            ConnectionInfo(
                "tcp",
                f"{pod_name}.{ns}",
                new_key(),
                new_curve_keys(),
                new_bridge_cert(f"{ns}/{pod_name}"),
            ),
            gateway_namespace=self.settings.gateway_namespace or None,
            runtime_class=self.settings.kernel_runtime_class,
            seccomp_profile=self.settings.seccomp_profile or None,
            snapshots=bool(self.settings.snapshot_runtime_class),
        )

    def _start_member(self, pool: KernelSessionPool) -> str:
        """A new kernel for the pool: its Secret (owned by the pool until the Pod exists,
        then by the Pod), then its Pod; the Pod's name."""
        pod_name = member_pod_name(pool.name, secrets.token_hex(4))
        secret, _service, _policy, pod = self._render(pool, pod_name)
        owner = _owner(KIND, pool.name, pool.uid)
        labels = pool_labels(pool)
        secret["metadata"].update(
            name=connection_secret_of(pod_name), labels=labels, ownerReferences=[owner]
        )
        pod["metadata"].update(name=pod_name, labels=labels, ownerReferences=[owner])
        give_connection_secret(pod, connection_secret_of(pod_name))
        self.kube.create(secret)
        made = self.kube.create(pod)
        self._give_secret(pool.namespace, connection_secret_of(pod_name), made)
        log.info("pool %s/%s: started kernel %s", pool.namespace, pool.name, pod_name)
        return pod_name

    def _ensure_policy(self, pool: KernelSessionPool) -> None:
        """The pool's kernels admit what a session's kernel admits: the gateways only."""
        policy = self._render(pool, f"ksp-{pool.name}")[2]
        policy["metadata"].update(
            name=f"ksp-{pool.name}",
            labels={k: v for k, v in pool_labels(pool).items() if k != ksp.LABEL_TEMPLATE},
            ownerReferences=[_owner(KIND, pool.name, pool.uid)],
        )
        policy["spec"]["podSelector"] = {
            "matchLabels": {ksp.LABEL_POOL: pool.name, LABEL_COMPONENT: "kernel"}
        }
        current, _ = self.kube.ensure(policy)
        if current.get("spec", {}).get("egress") != policy["spec"]["egress"] and (
            policy["spec"]["egress"] or current.get("spec", {}).get("egress")
        ):
            self.kube.patch(
                "NetworkPolicy",
                pool.namespace,
                policy["metadata"]["name"],
                {"spec": policy["spec"]},
            )

    def _write_status(
        self,
        body: dict[str, Any],
        pool: KernelSessionPool | None,
        todo: Plan | None,
        claimed: int,
        *,
        error: tuple[str, str] | None,
        trouble: Trouble | None = None,
    ) -> None:
        meta = body["metadata"]
        generation = int(meta.get("generation") or 1)
        old = body.get("status") or {}
        status: dict[str, Any] = {"observedGeneration": generation}
        status["failures"] = trouble.as_status() if trouble is not None else None
        if pool is not None and todo is not None:
            status.update(
                templateHash=pool.template_hash,
                ready=todo.ready,
                starting=todo.starting,
                claimed=claimed,
            )
        if error is not None or pool is None or todo is None:
            ok, (reason, message) = False, error or ("InvalidSpec", "")
        else:
            ok, reason, message = pool.condition(todo.ready, claimed)
        status["conditions"] = pool_conditions(
            old.get("conditions"),
            (ok, reason, message),
            trouble=trouble,
            broken=pool is None,  # an invalid spec: it will not fix itself
            generation=generation,
            now=stamp(),
        )
        patch = {k: v for k, v in status.items() if old.get(k) != v}
        if patch:
            self.kube.patch(KIND, meta["namespace"], meta["name"], {"status": patch}, status=True)
        was: dict[str, Any] = next(
            (c for c in old.get("conditions") or [] if c.get("type") == "Ready"), {}
        )
        if ok and was.get("status") != "True":  # filled (again): what `describe` shows
            self.events.record(body, [(events.NORMAL, "Filled", message)])

    # ---- claims --------------------------------------------------------------------------

    def look(self, namespace: str, name: str) -> Seen:
        """The pool and its kernels, as a claim starts from them: as the operator's
        watches last showed them (control/watched.py), else read."""
        shown = self.watched.pool(namespace, name)
        if shown is not None:
            return Seen(*shown)
        return Seen(self.kube.get(KIND, namespace, name), self.members(namespace, name))

    def members(self, namespace: str, name: str, *, cached: bool = True) -> list[dict[str, Any]]:
        """The pool's kernel pods, ready or not, as a claim reads them when the watches
        have shown none of that pool (`look`): from the API server's cache, at once (a
        pod claimed meanwhile, shown as it was, is refused to the claim by its
        resourceVersion; one ready since, not shown so, is found by the claim's second,
        consistent read, `cached=False`)."""
        labels = {ksp.LABEL_POOL: name}
        listed = self.kube.list("Pod", namespace, labels=labels, cached=cached)
        return listed.get("items") or []

    def claim(
        self, session: KernelSession, template_hash: str, seen: Seen | None = None
    ) -> PodClaim:
        """Take a ready kernel of the session's pool for it, or say why it starts cold.

        `template_hash` is what the session's own pod would be: set on the claimed pod, so
        that a later change of the spec is seen as one. `seen`: the pool as read already
        (`look`); a pod claimed since is refused by its resourceVersion.
        """
        ns, name = session.namespace, session.spec.pool or ""
        seen = seen or self.look(ns, name)
        body = seen.body
        if body is None or body["metadata"].get("deletionTimestamp"):
            why = f"there is no KernelSessionPool {name!r} in {ns}: started cold"
            return PodClaim(None, ksp.POOL_NOT_FOUND, why)
        try:
            spec_only = {k: v for k, v in body.items() if k != "status"}
            pool = ksp.load(ksp.validate(spec_only, default_namespace=ns))
        except InvalidSession as exc:
            return PodClaim(
                None, ksp.POOL_NOT_FOUND, f"pool {name!r} is invalid ({exc}): started cold"
            )
        why = ksp.unservable(pool, session.body["spec"])
        if why:
            self.tally.add(pool, "misses")
            return PodClaim(None, ksp.POOL_MISMATCH, f"{why}: started cold")
        try:  # the gateway gives these when it connects: they must be there
            secret_env(self.kube, session)
        except SecretError as exc:  # no miss: the pool could have served it
            return PodClaim(None, ksp.CLAIM_FAILED, f"{exc}: started cold")
        for fresh in (False, True):
            if fresh:  # the cache had none to take: it may be behind, so read the pods afresh
                seen = Seen(body, self.members(ns, name, cached=False))
                self.watched.listed(ns, name, seen.pods)
            for pod in self._ready(pool, seen.pods, session):
                taken = self._take(pool, pod, session, template_hash)
                if taken is not None:
                    self.tally.add(pool, "claims")
                    why = f"claimed kernel {taken['metadata']['name']} of pool {name}"
                    return PodClaim(taken, ksp.CLAIMED, why)
        self.tally.add(pool, "misses")
        self.watched.forget(ns, name)  # a pool deleted while the watch was away is read next
        return PodClaim(
            None, ksp.POOL_EXHAUSTED, f"pool {name!r} had no ready kernel: started cold"
        )

    @staticmethod
    def _ready(
        pool: KernelSessionPool, pods: list[dict[str, Any]], session: KernelSession
    ) -> list[dict[str, Any]]:
        """The pool's ready kernels of its current template, oldest first."""
        ready = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(ksp.LABEL_TEMPLATE) == pool.template_hash
            and any(r.get("uid") == pool.uid for r in p["metadata"].get("ownerReferences") or [])
            and not p["metadata"].get("deletionTimestamp")
            and observe(session, p).ready
        ]
        return sorted(ready, key=lambda p: str(p["metadata"].get("creationTimestamp")))

    def _take(
        self, pool: KernelSessionPool, pod: dict[str, Any], session: KernelSession, hash_: str
    ) -> dict[str, Any] | None:
        meta = pod["metadata"]
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "labels": {
                    ksp.LABEL_POOL: None,
                    LABEL_SESSION: session.name,
                    LABEL_NAMESPACE: session.namespace,
                    LABEL_CLAIMED_FROM: pool.name,
                },
                "annotations": {TEMPLATE_HASH: hash_},
                "ownerReferences": [_owner(kernelsession.KIND, session.name, session.uid)],
            }
        }
        try:
            taken = self.kube.patch("Pod", session.namespace, meta["name"], patch)
        except ApiError as exc:
            if exc.not_found:  # the pool's own delete came first, or a watch missed it
                self.watched.gone(session.namespace, meta["name"])
            if exc.conflict or exc.not_found:
                return None  # another claim, or the pool's own delete, wrote it first
            raise
        log.info(
            "session %s/%s claimed kernel %s of pool %s",
            session.namespace,
            session.name,
            meta["name"],
            pool.name,
        )
        return taken


def _draft(pool: KernelSessionPool, pod_name: str) -> KernelSession:
    """The KernelSession a pool's kernel is rendered from: the pool's template."""
    return kernelsession.load(ksp.member_body(pool, pod_name.removeprefix("ksp-")))
