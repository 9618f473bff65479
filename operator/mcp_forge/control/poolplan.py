"""Warm pools' plan, on a cluster and locally alike (pure): how many sessions hold a
kernel claimed from a pool (`claimed_from`), which of a pool's kernels go and how many
start (`plan`), and the names and labels of a pool's kernels. The I/O is the keeper's:
control/poolkeeper.py on a cluster, runtimes/local/pools.py locally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.kernelsessionpool import KernelSessionPool
from mcp_forge.control.render import (
    KERNEL_LABELS,
    LABEL_SESSION,
)

# On a claimed pod: the pool it came from (a label, so a pool counts its claimed kernels).
LABEL_CLAIMED_FROM = ksp.ANNOTATION_CLAIMED_FROM


def member_pod_name(pool: str, suffix: str) -> str:
    return f"ksp-{pool}-{suffix}"


def pool_labels(pool: KernelSessionPool) -> dict[str, str]:
    return {
        **KERNEL_LABELS,
        ksp.LABEL_POOL: pool.name,
        ksp.LABEL_TEMPLATE: pool.template_hash,
    }


def label_value(obj: dict[str, Any], key: str) -> str | None:
    return (obj["metadata"].get("labels") or {}).get(key)


def claimed_from(
    pool: str, sessions: Sequence[dict[str, Any]], kernels: Sequence[dict[str, Any]]
) -> int:
    """How many sessions hold a kernel claimed from `pool`, counted against its maxSize.

    A session counts from its claim until it is deleted or has no kernel on purpose
    (Suspended, Expired), whichever pod runs its kernel: its status says it claimed one
    (WarmStart True) while a restart or an update replaces its pod. A claimed pod counts
    its session too, by its labels, while the session's status does not say so yet (its
    write is still to come, or was lost). `sessions` must be listed before `kernels`: a
    claim between the two lists is then seen in the pods alone, and a session seen in
    both is counted once. (Counted from one of them only, a claim between two lists
    would count twice and, near maxSize, have the plan delete a ready kernel.)
    """
    holders: set[str] = set()
    for body in sessions:
        meta, status = body["metadata"], body.get("status") or {}
        if ((body.get("spec") or {}).get("poolRef") or {}).get("name") != pool:
            continue
        if meta.get("deletionTimestamp") or status.get("phase") in st.NO_KERNEL:
            continue
        if ksp.claimed_a_kernel(status):
            holders.add(meta["name"])
    for pod in kernels:
        if (
            label_value(pod, LABEL_CLAIMED_FROM) == pool
            and not label_value(pod, ksp.LABEL_POOL)
            and not pod["metadata"].get("deletionTimestamp")
        ):
            holders.add(label_value(pod, LABEL_SESSION) or pod["metadata"]["name"])
    return len(holders)


@dataclass(frozen=True)
class Member:
    """One of a pool's unclaimed kernel pods, as the plan sees it."""

    name: str
    uid: str
    resource_version: str
    template: str  # the template hash it was started with
    created: float
    ready: bool
    failed: bool
    deleting: bool
    reason: str = ""  # why it failed: the kubelet's (ErrImagePull, ...) or the kernel's
    message: str = ""


@dataclass(frozen=True)
class Plan:
    delete: tuple[Member, ...]
    start: int
    ready: int  # current and ready, once the deletes are done
    starting: int


def plan(
    members: Sequence[Member],
    *,
    size: int,
    max_starting: int,
    template: str,
    room: int | None = None,
) -> Plan:
    """What makes the pool `size` ready kernels of `template`, rolling.

    Failed kernels go. Kernels of an older template go only as ready ones of the current
    template take their place, so a template change never leaves the pool emptier than it
    was, unless `room` (the pool's maxSize less its claimed kernels) leaves no place for a
    new kernel beside them: then older kernels make way, those not ready and the oldest
    first, and a new one starts once they are gone (a kernel being deleted counts until
    then): the pool holds at most `room` kernels throughout. Beyond `size`, starting
    kernels go before ready ones, the newest first. At most `max_starting` kernels start
    at once.
    """
    going = sum(1 for m in members if m.deleting)  # still alive until they are gone
    live = [m for m in members if not m.deleting]
    delete = [m for m in live if m.failed]
    live = [m for m in live if not m.failed]
    current = [m for m in live if m.template == template]
    older = [m for m in live if m.template != template]
    excess = len(current) - size
    if excess > 0:
        order = sorted(current, key=lambda m: (m.ready, -m.created))
        delete += order[:excess]
        current = order[excess:]
    ready = [m for m in current if m.ready]
    starting = len(current) - len(ready)
    # Each ready kernel of the current template retires one of an older one.
    retire = max(0, len(older) + len(ready) - size)
    by_age = sorted(older, key=lambda m: (m.ready, m.created))
    delete += by_age[:retire]
    older = by_age[retire:]
    start = max(0, min(size - len(current), max_starting - starting))
    over = 0 if room is None else going + len(current) + len(older) + start - room
    if over > 0:
        delete += older[:over]
        start = max(0, start - max(0, over - len(older)))
    return Plan(tuple(delete), start, len(ready), starting + start)


BACKOFF_FIRST = 10.0  # seconds after a pool's kernel failed before another starts
BACKOFF_MAX = 300.0  # doubling up to this, as a session's restarts do
STALL_AFTER = 3  # kernels of one template failed in a row: the pool is Stalled


@dataclass(frozen=True)
class Trouble:
    """A pool's kernels of one template that failed in a row, and the last one's why."""

    count: int
    reason: str
    message: str
    at: float  # when the last one was seen failed
    template: str

    @property
    def stalled(self) -> bool:
        return self.count >= STALL_AFTER

    def next_start(self, first: float = BACKOFF_FIRST) -> float:
        """No kernel starts before then: the backoff after the last failure (`first`,
        doubling with each failure, at most BACKOFF_MAX)."""
        return self.at + min(first * 2.0 ** (self.count - 1), BACKOFF_MAX)

    def as_status(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "reason": self.reason,
            "message": self.message[:1000],
            "at": st.stamp(self.at),
            "template": self.template,
        }

    @classmethod
    def from_status(cls, value: Any) -> Trouble | None:
        if not isinstance(value, dict):
            return None
        try:
            at = st.parse_time(value.get("at"))
            count = int(value["count"])
        except (KeyError, TypeError, ValueError):
            return None
        if at is None or count < 1:
            return None
        return cls(count, str(value.get("reason") or ""), str(value.get("message") or ""),
                   at, str(value.get("template") or ""))  # fmt: skip


def trouble(
    old: Trouble | None, members: Sequence[Member], failed: Sequence[Member], *,
    template: str, now: float,
) -> Trouble | None:  # fmt: skip
    """The pool's trouble after this look: none once a kernel of `template` is ready, or
    the template changed (a fixed one starts afresh); one more for each kernel of it
    that failed (`failed`: those the plan deletes for it, each seen once)."""
    if old is not None and old.template != template:
        old = None
    if any(m.ready and not m.failed and m.template == template and not m.deleting for m in members):
        old = None
    mine = [m for m in failed if m.template == template]
    if not mine:
        return old
    last = mine[-1]
    count = (old.count if old is not None else 0) + len(mine)
    return Trouble(count, last.reason or "Failed", last.message, now, template)


def conditions(
    old: Any,
    ready: tuple[bool, str, str],
    *,
    trouble: Trouble | None,
    broken: bool = False,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """A pool's Ready and Stalled conditions, on a cluster and locally alike: `ready` as
    the pool says it (filled, at its maximum, filling); in trouble and not ready, the
    trouble's reason; Stalled once the trouble is, or when `broken` (an invalid spec)."""
    ok, reason, message = ready
    if trouble is not None and not ok:
        said = f"{trouble.count} kernels failed in a row, the last: {trouble.reason}"
        reason, message = trouble.reason, f"{said}: {trouble.message}"[:1000]
    stalled = broken or (trouble is not None and trouble.stalled)
    return [
        st.condition(old, "Ready", ok, reason, message, generation=generation, now=now),
        st.condition(
            old,
            "Stalled",
            stalled,
            reason if stalled else "NotStalled",
            message if stalled else "not stuck",
            generation=generation,
            now=now,
        ),
    ]
