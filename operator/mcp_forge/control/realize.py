"""One reconcile of a valid KernelSession, as a pipeline of steps over one `Pass`.

    begin           read the children, the activity and the stop verdict (a session past
                    its lifetime, or idle with idleAction Delete, is deleted here)
    then one of     stop_kernel: a stopped session (suspended, expired) has no kernel pod
                    start_kernel: no pod yet: claim one from the pool, or make one
                    follow_kernel: a pod: its death, crash loop, replacement or restart
    fill_status     the status fields every phase has
    add_conditions  Ready/Reconciling/Stalled, WorkspaceSized, WarmStart
    outcome         when to look again, and the pool to refill

Each step reads and writes the Pass, and asks the API through the reconciler (its Kube,
its PoolKeeper, its Secret rules): the decisions themselves are control/lifecycle.py's,
shared with local mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcp_forge import metrics
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import PORTS
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.clients.kube import BUSY_PREFIX, RESTART
from mcp_forge.control import forkfiles, forking, snapshots, snapstore
from mcp_forge.control import workspace as ws
from mcp_forge.control.egress import EgressUnavailable, pod_addresses
from mcp_forge.control.lifecycle import (
    Activity,
    Kernel,
    Stop,
    follow,
    idle_since,
    shown,
    stop_of,
    stopped,
)
from mcp_forge.control.pods import Observation, observe
from mcp_forge.control.poolkeeper import PodClaim, Seen
from mcp_forge.control.poolplan import LABEL_CLAIMED_FROM
from mcp_forge.control.render import (
    TEMPLATE_HASH,
    child_name,
    connection_secret_of,
    secret_name,
)
from mcp_forge.errors import ApiError, SecretError

if TYPE_CHECKING:
    from mcp_forge.control.reconciler import Reconciler

log = logging.getLogger(__name__)

STARTING_RECHECK = 15.0  # a pod not Ready after this is looked at again, events or not
RESIZE_RECHECK = 30.0  # a workspace claim smaller than asked is looked at again after this
LAST_ACTIVITY_STEP = 30.0  # status.lastActivity mirrors the Lease to this resolution


@dataclass(frozen=True)
class Outcome:
    invalid: str | None = None  # the spec is wrong: a permanent error
    gone: bool = False  # the session no longer exists (or was just deleted: idle)
    due: float | None = None  # wall-clock time it must be looked at again
    refill: str | None = None  # the pool it claimed a kernel of, to be refilled


@dataclass(frozen=True)
class Children:
    """What a reconcile found of a session's children (Service and NetworkPolicy made)."""

    want_pod: dict[str, Any]  # its own kernel pod, as the spec says it should be
    secret: dict[str, Any] | None  # its own connection Secret (not read for a fresh one)
    lease: dict[str, Any]
    pod: dict[str, Any] | None  # its kernel pod: its own, or one it claimed
    pool: Seen | None  # the pool it names, as its first claim starts from it (`look`)
    workspace: tuple[bool, str, str] | None  # its claim's WorkspaceSized condition, if shown
    claim: PodClaim | None = None  # a fresh session's claim, made beside the rest (early_claim)


@dataclass
class Pass:
    """One reconcile of one session: what it found, and what its steps decided."""

    session: KernelSession
    body: dict[str, Any]
    old: dict[str, Any]  # the status as read
    generation: int
    now: float
    found: Children
    act: Activity
    restart: str  # the kernelId a gateway asked to restart ("" none)
    expires: float | None
    stop: Stop | None  # why it is stopped, if it is
    status: dict[str, Any]  # the status to write
    due: list[float]
    kernel_gen: int  # the connection's generation: one more per kernel pod
    pod: dict[str, Any] | None = None
    seen: Observation | None = None
    pending: tuple[str, str] | None = None
    claim: PodClaim | None = None
    notes: list[str] = field(default_factory=list)
    deadline: float = 0.0  # in progress this long: Stalled (settings.progress_deadline)

    @property
    def fresh(self) -> bool:
        return unseen(self.old)  # its first reconcile, most likely: no child made yet


def unseen(status: dict[str, Any]) -> bool:
    """No operator has written this status: it is empty, or only what the CRD defaults
    (`observedGeneration: 0`). Such a session's children most likely do not exist yet."""
    return not status.get("phase") and not status.get("observedGeneration")


def host_of(session: KernelSession) -> str:
    """The kernel's address: the session's Service, whichever pod it selects."""
    return f"{child_name(session)}.{session.namespace}.svc"


def activity(lease: dict[str, Any], created: float, now: float) -> tuple[Activity, str]:
    """What gateways wrote on the Lease (a time in the future counts as now), and the
    kernelId a gateway asked to restart ("" none)."""
    spec = lease.get("spec") or {}
    notes = (lease.get("metadata") or {}).get("annotations") or {}
    renewed = min(now, parse_time(spec.get("renewTime")) or 0.0)
    marks = [parse_time(v) for k, v in notes.items() if k.startswith(BUSY_PREFIX)]
    until = max((t for t in marks if t), default=None)
    return Activity(max(created, renewed), until), str(notes.get(RESTART) or "")


def lifetime(pod: dict[str, Any]) -> float | None:
    """How long the pod's kernel ran before it stopped, if the kubelet says."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        ended = (status.get("state") or {}).get("terminated") or {}
        start, end = parse_time(ended.get("startedAt")), parse_time(ended.get("finishedAt"))
        if start is not None and end is not None:
            return end - start
    return None


def realize(
    r: Reconciler,
    session: KernelSession,
    body: dict[str, Any],
    old: dict[str, Any],
    generation: int,
    now: float,
) -> Outcome:
    """Make the session's kernel what its spec and its life so far say; write status."""
    p = begin(r, session, body, old, generation, now)
    if p is None:
        return Outcome(gone=True)
    if not session.spec.egress_rules:  # an allow-list taken away: its grant goes
        r.egress.remove(session.namespace, session.name)
    snapshots.settle(r, p)
    forking.abandoned(r, p)
    if p.stop is not None:
        stop_kernel(r, p)
    elif p.pod is None:
        start_kernel(r, p)
    else:
        follow_kernel(r, p)
    forking.after(r, p)
    snapshots.sized(r, p)
    snapstore.tidy(r, p)
    fill_status(p)
    add_conditions(p)
    r._write(body, p.status)
    r.heard.acted(session, p.pod)  # a later version alike is no news (control/heard.py)
    return outcome(p)


def begin(
    r: Reconciler,
    session: KernelSession,
    body: dict[str, Any],
    old: dict[str, Any],
    generation: int,
    now: float,
) -> Pass | None:
    """Read the children and decide whether the session stops; None if it was deleted."""
    spec = session.spec
    found = r._children(session, old, fresh=unseen(old))
    pod = found.pod
    created = parse_time(body["metadata"].get("creationTimestamp")) or now
    act, restart = activity(found.lease, created, now)
    starting = pod is not None and old.get("phase") in (None, *st.IN_PROGRESS)
    made = parse_time(pod["metadata"].get("creationTimestamp")) if pod is not None else None
    floor = idle_since(
        act,
        started=parse_time(old.get("startedAt")),
        starting_since=(made or now) if starting else None,
    )
    verdict = stop_of(session, created=created, idle_from=floor, activity=act, now=now)
    if verdict.stop is not None and verdict.stop.delete:
        log.info("deleting %s/%s: %s", session.namespace, session.name, verdict.stop.message)
        r.kube.delete("KernelSession", session.namespace, session.name, uid=session.uid)
        return None
    claim = found.claim
    if claim is None and pod is not None and unseen(old):
        claim = adopted(pod)
    if verdict.stop is not None and claim is not None:
        pod, claim = pod or claim.pod, None  # a claimed kernel not to run: it goes (stop_kernel)
    return Pass(
        session=session,
        body=body,
        old=old,
        generation=generation,
        now=now,
        found=found,
        act=act,
        restart=restart,
        expires=created + spec.max_lifetime if spec.max_lifetime else None,
        stop=verdict.stop,
        status=dict(old),
        due=list(verdict.due),
        kernel_gen=int((old.get("connection") or {}).get("generation") or 0),
        pod=pod,
        deadline=r.settings.progress_deadline,
        claim=claim,
    )


def early_claim(session: KernelSession, now: float) -> bool:
    """Whether a fresh session's claim may be made beside its children (`_children`): it
    names a pool, asks to run and is not past its maxLifetime or idleTimeout already (a
    session made while no operator ran: it stops, `stop_of`), and has no allow-list (a
    grant's route and checks come before such a claim: `_claim`)."""
    spec = session.spec
    created = parse_time(session.body["metadata"].get("creationTimestamp")) or now
    ends = [created + t for t in (spec.max_lifetime, spec.idle_timeout) if t]
    return (
        bool(spec.pool)
        and forking.parent_of(session) is None  # a fork wakes from its parent's memory
        and spec.operating_mode == "Running"
        and not spec.egress_rules
        and all(now < end for end in ends)
    )


def adopted(pod: dict[str, Any]) -> PodClaim | None:
    """The claim of a kernel that a session with no status yet holds: an earlier try's
    (its status write lost, or a call beside the claim failed), said as the claim would
    have been (WarmStart, its start, the pool's refill). None for a pod of its own, and
    for one being deleted (a claim undone: its grant could not be written)."""
    meta = pod["metadata"]
    pool = (meta.get("labels") or {}).get(LABEL_CLAIMED_FROM)
    if not pool or meta.get("deletionTimestamp"):
        return None
    why = f"claimed kernel {pod['metadata']['name']} of pool {pool}"
    return PodClaim(pod, ksp.CLAIMED, why)


def stop_kernel(r: Reconciler, p: Pass) -> None:
    """A stopped session: its kernel pod goes; its Secret stays, for the next kernel."""
    if p.stop is not None and p.stop.phase == st.SUSPENDED:
        snapshots.take(r, p)  # its memory kept, where it can be
        snapshots.said(r, p)
    else:
        snapshots.discard(p, f"the session is {p.stop.phase if p.stop else 'stopped'}")
    stop = p.stop
    assert stop is not None
    pod = p.pod
    if pod is not None and not pod["metadata"].get("deletionTimestamp"):
        meta = pod["metadata"]
        r.kube.delete("Pod", p.session.namespace, meta["name"], uid=meta["uid"])
    if stop.phase == st.SUSPENDED:
        snapstore.step(r, p)  # and a copy in its claim, with the store set so
    r._own_secret(p.session, p.found.secret, fresh=p.fresh)
    if p.session.spec.egress_rules:  # no pod, no grant: the next start writes it again
        r.egress.clear(p.session.namespace, p.session.name)
    p.seen = Observation(stop.phase, stop.reason, stop.message)
    p.status.update(stopped(p.old, stop, generation=p.generation, now=p.now))
    p.pod = None


def start_kernel(r: Reconciler, p: Pass) -> None:
    """No kernel pod: the first one may be claimed warm from the pool; else it is made
    (the Secret completed first if an older operator left it without keys). A session
    with an allow-list starts once its grant is with the egress proxy."""
    session, old, want_pod = p.session, p.old, p.found.want_pod
    ns = session.namespace
    egress = bool(session.spec.egress_rules)
    if egress and r.egress_route(session) is None:
        return _waiting(p, "EgressUnavailable", egress_missing(r))
    waits = forking.begin(r, p)  # a fork's first kernel wakes from its parent's memory
    waits = waits or forkfiles.step(r, p)  # and its files: a copy of its parent's
    if waits is not None:
        return _waiting(p, "Forking", waits)
    if session.spec.pool and not old.get("kernelId") and not p.status.get("snapshot"):  # warm?
        try:
            p.pod = _claim(r, p)
        except SecretError as exc:  # a Secret its rules name: no kernel without it
            return _failed(p, exc)
    if p.pod is None:
        forking.before_pod(r, p)  # never on a parent's keys, unless it wakes with them
        secret = p.found.secret
        complete = r._own_secret(session, secret, fresh=p.fresh)
        if complete is not None:
            log.info(
                "adding the Curve pair and the bridge certificate to the Secret of %s/%s "
                "(kept from an older operator, or malformed) before its next kernel pod",
                ns,
                session.name,
            )
            secret = r.kube.patch("Secret", ns, secret_name(session), complete)
        if egress:  # the grant first, from the Secret as it is now (patched just above)
            try:
                secret = r.kube.get("Secret", ns, secret_name(session))
                r.egress.ensure(session, secret, [], verify=True)  # no pod, no address yet
            except SecretError as exc:
                return _failed(p, exc)
        if r.settings.snapshot_runtime_class:  # it wakes from the snapshot still held
            snapshots.waking(p.status, want_pod)
            snapstore.waking(r, session, p.status, want_pod)  # from its claim, if stored
        p.pod, _ = r.kube.ensure(want_pod, likely_new=p.fresh)
    pod = p.pod
    r.heard.wrote(session, pod)
    if pod["metadata"].get("uid") != old.get("kernelId"):
        if old.get("kernelId"):
            p.status["restarts"] = int(old.get("restarts") or 0) + 1
            last = (old.get("lastTermination") or {}).get("reason")
            reason = "oom" if last == st.OOM_KILLED else "replaced"
            metrics.KERNEL_RESTARTS.labels(reason=reason).inc()
        p.kernel_gen += 1
        p.status["startedAt"] = None
    p.seen = observe(session, pod, r.answers.of(ns, session.name, pod["metadata"].get("uid")))
    p.due.append(p.now + STARTING_RECHECK)


def _claim(r: Reconciler, p: Pass) -> dict[str, Any] | None:
    """A ready kernel of the session's pool, claimed for it (None: none, it starts cold).

    With an allow-list, what the grant needs is checked first (its values there, its size
    within bounds), and the grant is written from the claimed kernel's Secret before the
    session is Ready. A claimed kernel whose grant could not be written is deleted (no
    kernel without its grant): the session starts cold next, and WarmStart says why."""
    session = p.session
    if session.spec.egress_rules:
        r.egress.check(session)
    template = p.found.want_pod["metadata"]["annotations"][TEMPLATE_HASH]
    p.claim = claim = p.claim or r.pools.claim(session, template, p.found.pool)
    pod = claim.pod
    if pod is None or not session.spec.egress_rules:
        return pod
    try:
        r.egress.claimed(session, pod, verify=True)
    except (SecretError, ApiError) as exc:
        meta = pod["metadata"]
        why = f"{claim.message}, but its egress grant could not be written ({exc}): deleted"
        p.claim = PodClaim(None, ksp.CLAIM_FAILED, why)
        log.warning("session %s/%s: %s", session.namespace, session.name, why)
        r.kube.delete("Pod", session.namespace, meta["name"], uid=meta.get("uid"))
        raise
    return pod


def _failed(p: Pass, exc: SecretError) -> None:
    """No kernel without a Secret its rules name: Failed, naming it; looked at again."""
    p.seen = Observation(st.FAILED, exc.reason, str(exc))
    p.due.append(p.now + STARTING_RECHECK)


def _waiting(p: Pass, reason: str, message: str) -> None:
    """No kernel pod yet, for a reason that may pass: looked at again soon."""
    p.seen = Observation(st.PENDING, reason, message)
    p.due.append(p.now + STARTING_RECHECK)


def egress_missing(r: Reconciler) -> str:
    try:
        r.egress.route()
    except EgressUnavailable as exc:
        return str(exc)
    return "the egress proxy's Service has no address yet"


def follow_grant(
    r: Reconciler,
    session: KernelSession,
    pod: dict[str, Any],
    secret: dict[str, Any] | None,
    *,
    claimed: bool,
) -> None:
    """The grant follows its kernel pod's addresses (its credential is good from there
    only) and the values its rules name: a changed value reaches the proxy, one taken
    away is no longer added, and the session has no way out. A `claimed` pod's Secret
    is its own; else `secret` is the session's."""
    try:
        if claimed:
            r.egress.claimed(session, pod, verify=False)
        elif secret is not None:
            r.egress.ensure(session, secret, pod_addresses(pod))
    except SecretError as exc:
        log.warning("egress grant of %s/%s removed: %s", session.namespace, session.name, exc)
        r.egress.remove(session.namespace, session.name, known=True)
    except EgressUnavailable:  # its kernel keeps the grant the proxy has
        pass


def follow_kernel(r: Reconciler, p: Pass) -> None:
    """A kernel pod: what it shows, its death (lastTermination), and the lifecycle's plan
    for it (replace it, wait out a crash loop's backoff, restart it on request)."""
    session, old, pod = p.session, p.old, p.pod
    assert pod is not None
    own = pod["metadata"]["name"] == child_name(session)  # not a claimed one
    if own:
        r._own_secret(session, p.found.secret, fresh=p.fresh)
    if session.spec.egress_rules:
        follow_grant(r, session, pod, p.found.secret, claimed=not own)
    uid = pod["metadata"].get("uid")
    if uid != old.get("kernelId"):  # made by a reconcile whose status write was lost
        p.kernel_gen += 1
    seen = snapshots.follow(
        r, p, observe(session, pod, r.answers.of(session.namespace, session.name, uid))
    )
    seen = forking.made_own(r, p, seen)
    if seen.reason in ("RestoreFailed", "ForkFailed"):  # its pod goes: the next starts afresh
        p.seen = seen
        p.due.append(p.now + STARTING_RECHECK)
        return
    hashes = (pod["metadata"].get("annotations") or {}).get(TEMPLATE_HASH)
    kernel = Kernel(
        uid,
        seen,
        lifetime(pod),
        outdated=hashes != p.found.want_pod["metadata"]["annotations"][TEMPLATE_HASH],
        deleting=bool(pod["metadata"].get("deletionTimestamp")),
    )
    followed = follow(
        session,
        kernel,
        old,
        restart_asked=bool(p.restart) and p.restart == uid,
        busy=p.act.busy(p.now),
        now=p.now,
        local=False,
        exitCode=seen.termination.exit_code if seen.termination else None,
        podUID=uid,
    )
    if followed.died is not None:
        log.info("kernel of %s/%s died: %s", session.namespace, session.name, seen.message)
        p.status["lastTermination"] = followed.died
    plan = followed.plan
    if plan.replace:
        r.kube.delete("Pod", session.namespace, pod["metadata"]["name"], uid=uid)
    p.seen, p.pending = plan.seen, plan.pending
    if plan.due is not None:
        p.due.append(plan.due)
    if p.seen.phase in st.IN_PROGRESS:
        p.due.append(p.now + STARTING_RECHECK)


def fill_status(p: Pass) -> None:
    """The fields every phase has: phase, the kernel, the connection, activity, times."""
    session, old, pod, seen = p.session, p.old, p.pod, p.seen
    assert seen is not None
    status = p.status
    pod_name = pod["metadata"]["name"] if pod is not None else None
    meta = pod["metadata"] if pod is not None else {}
    deadline = p.deadline
    status.update(
        shown(old, seen, generation=p.generation, now=p.now, pending=p.pending, deadline=deadline)
    )
    if deadline > 0 and seen.phase in st.IN_PROGRESS:  # looked at again when it passes
        p.due.append((st.since_true(old.get("conditions"), "Reconciling") or p.now) + deadline)
    status.update(
        serviceName=child_name(session),
        podName=pod_name,
        podIP=seen.pod_ip,
        nodeName=(pod.get("spec") or {}).get("nodeName") if pod is not None else None,
        kernelId=meta.get("uid") if pod is not None else None,
        templateHash=(meta.get("annotations") or {}).get(TEMPLATE_HASH) if pod else None,
        expiresAt=stamp(p.expires) if p.expires is not None else None,
        connection={
            "transport": "tcp",
            "host": host_of(session),
            "ports": dict(PORTS),
            "secretName": connection_secret_of(pod_name or child_name(session)),
            "generation": p.kernel_gen,
        },
    )
    if p.claim is not None and p.claim.pod is not None:
        status["startedAt"] = stamp(p.now)  # it ran in the pool before: this is its start
    elif seen.ready and seen.started_at and not old.get("startedAt"):
        status["startedAt"] = seen.started_at
        # The idle floor was a starting pod's (START_GRACE): now that the kernel runs,
        # idleness counts from its start, or nothing would wake us before the grace ends.
        if session.spec.idle_timeout and p.stop is None:
            started = parse_time(seen.started_at) or p.now
            since = idle_since(p.act, started=started, starting_since=None)
            p.due.append(since + session.spec.idle_timeout)
    status.setdefault("restarts", 0)
    if p.stop is None:
        status["suspendedAt"] = None
    mirrored = parse_time(old.get("lastActivity")) or 0.0
    if p.act.last - mirrored >= LAST_ACTIVITY_STEP or not old.get("lastActivity"):
        status["lastActivity"] = stamp(p.act.last)


def add_conditions(p: Pass) -> None:
    """After the phase's conditions (fill_status), WorkspaceSized (persistent
    workspaces only) and WarmStart (kept from the first kernel's claim on)."""
    old, now = p.old.get("conditions"), stamp(p.now)
    conditions: list[dict[str, Any]] = p.status["conditions"]  # the phase's: fill_status
    sized = None
    if p.session.spec.persistent and p.found.workspace is not None:
        value, why, text = p.found.workspace
        sized = st.condition(
            old, ws.WORKSPACE_SIZED, value, why, text, generation=p.generation, now=now
        )
        if why == ws.RESIZING:  # claims are not watched: looked at again
            p.due.append(p.now + RESIZE_RECHECK)
    if not p.session.spec.persistent or sized is not None:  # none to say, or a new one
        conditions = _replaced(conditions, ws.WORKSPACE_SIZED, sized)
    if p.claim is not None:
        claim = p.claim
        warm = st.condition(
            old,
            ksp.WARM_START,
            claim.pod is not None,
            claim.reason,
            claim.message,
            generation=p.generation,
            now=now,
        )
        conditions = _replaced(conditions, ksp.WARM_START, warm)
    p.status["conditions"] = conditions


def _replaced(
    conditions: list[dict[str, Any]], kind: str, new: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """`conditions` without those of type `kind`, and `new` (if any) at the end."""
    kept = [c for c in conditions if c["type"] != kind]
    return [*kept, new] if new is not None else kept


def outcome(p: Pass) -> Outcome:
    """When to look again; and the pool to refill: a session that claimed a kernel now,
    or that stopped on purpose having claimed one, stops counting against its pool's
    maxSize (after this status write, which the pool's count reads)."""
    claimed_now = p.claim is not None and p.claim.pod is not None
    let_go = (
        p.stop is not None and p.old.get("phase") != p.stop.phase and ksp.claimed_a_kernel(p.old)
    )
    refill = p.session.spec.pool if claimed_now or let_go else None
    return Outcome(due=min(p.due) if p.due else None, refill=refill)
