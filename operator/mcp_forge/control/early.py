"""A fresh session's kernel, claimed or made beside its children rather than after them.

A session's first reconcile makes its Secret, Service, NetworkPolicy and Lease side by
side (control/reconciler.py `_children`). Its kernel needs only some of them: a claim
needs to know the session holds no kernel yet, the namespace's closed policy and the
pool; a pod of its own needs its Secret (its env reads it), its NetworkPolicy (no kernel
runs before its own policy exists) and its workspace claim, not the Service or the
Lease. Each is started (`_at_once`'s `after`) as soon as what it needs is there: the
Service's create (its ClusterIP allocated, 15-40 ms on 2 cores) is no longer in the way.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time
from mcp_forge.control.poolkeeper import PodClaim, Seen
from mcp_forge.control.poolplan import LABEL_CLAIMED_FROM
from mcp_forge.control.render import TEMPLATE_HASH

if TYPE_CHECKING:
    from mcp_forge.control.reconciler import Reconciler


def early_start(session: KernelSession, now: float) -> bool:
    """Whether a fresh session's kernel may be claimed or made beside its children: it
    asks to run and is not past its maxLifetime or idleTimeout already (a session made
    while no operator ran: it stops, `stop_of`), and has no allow-list (its grant comes
    first: realize.py `start_kernel`)."""
    spec = session.spec
    created = parse_time(session.body["metadata"].get("creationTimestamp")) or now
    ends = [created + t for t in (spec.max_lifetime, spec.idle_timeout) if t]
    return (
        spec.operating_mode == "Running"
        and not spec.egress_rules
        and all(now < end for end in ends)
    )


def early_claim(session: KernelSession, now: float) -> bool:
    """Whether a fresh session's claim may be made beside its children (`claim`)."""
    return bool(session.spec.pool) and early_start(session, now)


def claim(
    r: Reconciler,
    session: KernelSession,
    want_pod: dict[str, Any],
    pod: Future[Any],
    baseline: Future[Any],
    pool: Future[Any],
) -> PodClaim | None:
    """A fresh session's claim, made beside its Service, NetworkPolicy and Lease (one API
    round trip sooner Ready; docs/security.md says why that is safe): once the session
    is known to hold no kernel yet, the namespace's baseline policy is in place and the
    pool is looked at (as the watches show it, control/watched.py)."""
    if pod.result() is not None:  # a claim of an earlier try, its status not written
        return None
    baseline.result()
    seen: Seen = pool.result()
    template = want_pod["metadata"]["annotations"][TEMPLATE_HASH]
    made = r.pools.claim(session, template, seen)
    if made.pod is not None:
        r.heard.wrote(session, made.pod)
    return made


def start(
    r: Reconciler,
    session: KernelSession,
    want_pod: dict[str, Any],
    pod: Future[Any],
    needed: list[Future[Any]],
) -> dict[str, Any] | None:
    """A fresh session's own kernel pod, made beside its Service and Lease once it holds
    none yet and what the pod needs (`needed`: its Secret, its NetworkPolicy, its
    workspace claim, the namespace's closed policy) is there. A call of those that failed
    fails this too: nothing is made, and the reconcile is tried again."""
    if pod.result() is not None:  # an earlier try's, its status not written
        return None
    for call in needed:
        call.result()
    made = r._ensure(want_pod, session, likely_new=True)
    r.heard.wrote(session, made)
    return made


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
