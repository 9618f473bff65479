"""The operator: kopf handlers that keep every KernelSession true on a cluster.

Thin wiring: what kopf sees (a KernelSession or pool created, changed or found at
start-up; an event of a kernel Pod, an activity Lease or a pool's kernel) pokes the
reconciler (control/reconciler.py), whose one level-based `reconcile` does all the work,
at once or at a deadline it keeps (control/schedule.py).

A session's first reconcile is the one users wait for: its children are created without
being read first (read only if there already), independent calls go side by side, and a
kernel claimed from a pool brings its own Secret (the session makes none). The claim
starts from the pool and its kernels as the watches here showed them (control/watched.py)
and is made beside the session's NetworkPolicy, under the namespace's closed policy; the
session's own NetworkPolicy exists before a pod of its own is made or the session is Ready.

No finalizer: children carry owner references and the API server's garbage collector
removes them, so deleting a namespace never waits on this operator. No timers or
daemons either (kopf would add a finalizer for them): deadlines are kept in one task.
One reconcile of a valid session is a pipeline of steps
(control/realize.py). Run it with `mcp-forge operator`, or
`kopf run -m mcp_forge.control.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from mcp_forge.api import forks
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api.kernelsession import GROUP
from mcp_forge.clients.kube import Kube
from mcp_forge.control import forkfiles
from mcp_forge.control.poolplan import LABEL_CLAIMED_FROM
from mcp_forge.control.reconciler import Reconciler
from mcp_forge.control.render import LABEL_COMPONENT, LABEL_SESSION, MANAGED_BY
from mcp_forge.errors import ApiError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)
SWEEP_EVERY = 600.0  # seconds between sweeps of egress grants

VERSION = "v1alpha1"
PLURAL = "kernelsessions"
CHILD_LABELS: dict[str, Any] = {
    "app.kubernetes.io/managed-by": MANAGED_BY,
    LABEL_SESSION: kopf.PRESENT,
}

POOL = ksp.KIND
# What kopf's change handlers kept on each object until the operator stopped using them
# (the last spec handled, a mark, a failed handler's retries): taken away when an object
# carrying them is seen.
KOPF_NOTES = tuple(
    f"{GROUP}/{k}" for k in ("last-handled-configuration", "kopf-managed", "touch-dummy")
)
KOPF_RETRIES = (f"{GROUP}/reconcile_session", f"{GROUP}/reconcile_pool")  # key prefixes


def kopf_notes(annotations: Mapping[str, Any]) -> list[str]:
    """The annotations of `annotations` that an older operator's kopf wrote."""
    return [k for k in annotations if k in KOPF_NOTES or k.startswith(KOPF_RETRIES)]


# ---- kopf ------------------------------------------------------------------------------


async def _release(reconciler: Reconciler, namespace: str) -> None:
    """Something of ours went from `namespace`: its baseline policy goes too if nothing is
    left (control/baseline.py). A failure is only logged: the next deletion tries again."""
    try:
        await asyncio.to_thread(reconciler.baseline.release, namespace)
    except ApiError as exc:
        log.warning("namespace %s: baseline policy not looked at: %s", namespace, exc)


def _reconciler(memo: Any) -> Reconciler:
    reconciler: Reconciler = memo.reconciler
    return reconciler


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    config = Settings.from_env()
    kube = await asyncio.to_thread(Kube, manager="mcp-forge-operator")
    reconciler = Reconciler(kube, config)
    memo.reconciler = reconciler
    memo.scheduler = asyncio.create_task(reconciler.run(), name="mcp-forge deadlines")
    memo.sweep = asyncio.create_task(_sweep_grants(reconciler), name="mcp-forge egress grants")


async def _sweep_grants(reconciler: Reconciler) -> None:
    """Grants whose session is gone or lists nothing (control/egress.py): at the start
    (sessions deleted while no operator ran), then every SWEEP_EVERY seconds (a list
    taken away from a session whose grant an earlier operator wrote)."""
    while True:
        try:
            removed = await asyncio.to_thread(reconciler.egress.sweep)
            if removed:
                log.info("%d egress grants of deleted sessions removed", removed)
        except ApiError as exc:  # no proxy installed (its namespace is not there), or no right
            log.info("egress grants not swept: %s", exc)
        await asyncio.sleep(SWEEP_EVERY)  # a period, not a wait for something


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in (memo.get("scheduler"), memo.get("sweep")):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if memo.get("reconciler") is not None:
        await memo.reconciler.answers.close()
        memo.reconciler.close()


def unhandled(type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether a KernelSession's or a pool's watch event asks for a reconcile: found at
    start-up (no type) or made, or a spec its status has not caught up with.

    Change is told by `metadata.generation` against `status.observedGeneration`, which
    every reconcile writes, not by kopf's change handlers: those keep a copy of the
    last spec handled in an annotation, one more write to the object beside a session's
    first reads (and an annotation git does not own). The events of the operator's own
    status writes carry the generation they observed, so they start nothing."""
    if type in (None, "ADDED"):
        return True
    if type != "MODIFIED":
        return False
    generation = (body.get("metadata") or {}).get("generation")
    return generation != (body.get("status") or {}).get("observedGeneration")


async def _unnote(
    reconciler: Reconciler, kind: str, namespace: str, name: str, body: Mapping[str, Any]
) -> None:
    """What an older operator's kopf kept on the object (KOPF_NOTES) taken off it."""
    stale = dict.fromkeys(kopf_notes((body.get("metadata") or {}).get("annotations") or {}))
    if not stale:
        return
    patch = {"metadata": {"annotations": stale}}
    try:
        await asyncio.to_thread(reconciler.kube.patch, kind, namespace, name, patch)
    except ApiError as exc:  # seen again at the next event or start-up
        log.info("%s %s/%s keeps kopf's annotations: %s", kind, namespace, name, exc)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def session_event(
    *, type: str | None, name: str, namespace: str | None, body: Any, memo: Any, **_: Any
) -> None:
    """Made, found at start-up or its spec changed: reconciled now (retried with backoff
    by control/schedule.py). Deleted: its grant and its pool's count let go."""
    reconciler, ns = _reconciler(memo), namespace or "default"
    uid = (body.get("metadata") or {}).get("uid")
    current = reconciler.newest  # kopf's memo is each object's own: this is shared
    reconciler.arrived(ns, name, type, body)
    if type != "DELETED":
        current[(ns, name)] = uid
        if unhandled(type, body):
            reconciler.poke(ns, name)
        await _unnote(reconciler, "KernelSession", ns, name, body)
        return
    try:  # its grant with the egress proxy (control/egress.py), after a reconcile under way
        async with reconciler.lock(ns, name):
            await asyncio.to_thread(reconciler.egress.remove, ns, name, known=True)
    except ApiError as exc:
        log.warning("the egress grant of %s/%s is left (%s): the next sweep removes it",
                    ns, name, exc)  # fmt: skip
    reconciler.forget(ns, name)
    # kopf handles each object apart: a new session of that name, made meanwhile, was
    # poked while this one's grant went, and `forget` dropped that poke.
    if current.get((ns, name), uid) != uid:
        reconciler.poke(ns, name)
    else:
        current.pop((ns, name), None)
    await _release(reconciler, ns)
    parent = ((body.get("metadata") or {}).get("annotations") or {}).get(forks.FORKED_FROM)
    if parent:  # a fork gone mid-copy holds its parent no longer (control/forkfiles.py)
        await asyncio.to_thread(forkfiles.let_go, reconciler, ns, name, str(uid), str(parent))
    # A session that claimed a kernel counted against its pool's maxSize until now,
    # whichever pod ran it (a replaced one carries no claimed-from label to be heard).
    pool = ((body.get("spec") or {}).get("poolRef") or {}).get("name")
    if pool and ksp.claimed_a_kernel(body.get("status") or {}):
        reconciler.poke(ns, pool, kind=POOL)


@kopf.on.event("", "v1", "pods", labels={**CHILD_LABELS, LABEL_COMPONENT: "kernel"})
@kopf.on.event("coordination.k8s.io", "v1", "leases", labels=CHILD_LABELS)
async def child_event(
    *,
    type: str,
    labels: Mapping[str, str],
    namespace: str | None,
    body: Any,
    memo: Any,
    **_: Any,
) -> None:
    """A kernel pod or an activity Lease changed: look at its session now; a starting
    kernel is asked whether it answers (control/answers.py)."""
    reconciler, ns, session = _reconciler(memo), namespace or "default", labels[LABEL_SESSION]
    if type == "DELETED":
        if body.get("kind") == "Pod":
            reconciler.heard.gone(ns, session, body)
        reconciler.poke(ns, session)
    elif reconciler.heard.news(ns, session, body):
        reconciler.poke(ns, session)
    if body.get("kind") == "Pod":
        reconciler.answers.consider(body)
        if type == "DELETED":
            await _release(reconciler, namespace or "default")


@kopf.on.event(GROUP, VERSION, ksp.PLURAL)
async def pool_event(
    *, type: str | None, name: str, namespace: str | None, body: Any, memo: Any, **_: Any
) -> None:
    """A pool made, found at start-up or changed: filled (in the deadlines' task)."""
    _reconciler(memo).pools.watched.saw(type, body)  # for claims (control/watched.py)
    if type == "DELETED":
        _reconciler(memo).forget(namespace or "default", name, kind=POOL)
        await _release(_reconciler(memo), namespace or "default")
    else:
        if unhandled(type, body):
            _reconciler(memo).poke(namespace or "default", name, kind=POOL)
        await _unnote(_reconciler(memo), POOL, namespace or "default", name, body)


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_COMPONENT: "kernel"},
)
async def pool_kernel_event(
    *,
    type: str,
    labels: Mapping[str, str],
    namespace: str | None,
    body: Any,
    memo: Any,
    **_: Any,
) -> None:
    """A pool's kernel changed (started, answered, died, went): look at its pool now.
    So too when a kernel claimed from a pool went: a pool at its maximum may start one."""
    _reconciler(memo).pools.watched.saw(type, body)  # for claims (control/watched.py)
    pool = labels.get(ksp.LABEL_POOL)
    if pool is None and type == "DELETED":
        pool = labels.get(LABEL_CLAIMED_FROM)
    if pool is not None:
        _reconciler(memo).poke(namespace or "default", pool, kind=POOL)
    if type == "DELETED" and ksp.LABEL_POOL in labels:
        await _release(_reconciler(memo), namespace or "default")
