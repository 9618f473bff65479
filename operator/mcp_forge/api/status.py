"""A KernelSession's status as every part of MCP-Forge writes and reads it. Pure: no I/O.

Phases and the reasons the code decides on are named here once (plain strings: they
go into YAML and JSON as they are). `conditions` is the one builder of the four
conditions a session always carries, on a cluster and locally alike: Ready (the kernel
answered), UpdatePending, and Reconciling and Stalled, which Flux's kstatus reads.
"""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

# Phases (crds/kernelsession.yaml lists the same).
PENDING = "Pending"  # accepted, no kernel pod yet
STARTING = "Starting"  # the pod is made, the kernel has not answered yet
READY = "Ready"  # the kernel answered: code can run
RESTARTING = "Restarting"  # a new kernel is coming (death, restart asked, new spec)
FAILED = "Failed"  # it will not fix itself: a bad spec, a crash loop given up on
SUSPENDED = "Suspended"  # no kernel on purpose (operatingMode, or idle); the workspace kept
EXPIRED = "Expired"  # past its maxLifetime
TERMINATING = "Terminating"  # being deleted

IN_PROGRESS = frozenset({PENDING, STARTING, RESTARTING})
STUCK = frozenset({FAILED, EXPIRED})
NO_KERNEL = frozenset({SUSPENDED, EXPIRED, TERMINATING})  # none on purpose

# Reasons decided by our code (a pod's own, such as ImagePullBackOff, pass through).
KERNEL_READY = "KernelReady"
INVALID_SPEC = "InvalidSpec"
USER_REQUESTED = "UserRequested"  # spec.operatingMode: Suspended
IDLE = "Idle"
CRASH_LOOP_BACKOFF = "CrashLoopBackOff"
CRASH_LOOP = "CrashLoop"  # local mode gave up restarting it
RESTART_REQUESTED = "RestartRequested"
UPDATING = "Updating"
KERNEL_BUSY = "KernelBusy"
WAITING_FOR_RESTART = "WaitingForRestart"
UP_TO_DATE = "UpToDate"
SECRET_NOT_FOUND = "SecretNotFound"  # a Secret or key spec.env names is not there (Failed)
INVALID_SECRET = "InvalidSecret"  # its value is not text an env variable can hold (Failed)


class LastTermination(TypedDict, total=False):
    """How the last kernel ended, and how many quick deaths in a row led up to it."""

    reason: str
    exitCode: int | None
    message: str
    at: str
    podUID: str  # the operator's: the pod that died
    kernelId: str  # the kernel that died (status.kernelId): one record per kernel
    quickDeaths: int
    nextStartAt: str  # local mode's: when the crash-loop backoff ends


class Status(TypedDict, total=False):
    """A KernelSession's status, as the operator and local mode write it (the CRD's
    status schema says the same for the API server)."""

    phase: str
    reason: str | None
    message: str | None
    observedGeneration: int
    conditions: list[dict[str, Any]]
    connection: dict[str, Any]  # transport, host, ports, secretName, generation: no key
    kernelId: str | None
    podName: str | None
    podIP: str | None
    nodeName: str | None  # the operator's: the node the kernel's pod runs on
    serviceName: str
    templateHash: str | None
    startedAt: str | None
    lastActivity: str
    suspendedAt: str | None
    expiresAt: str | None
    restarts: int
    lastTermination: LastTermination
    # Live snapshots (local mode so far): the one a suspended kernel is kept in (size in
    # bytes, takenAt, seconds), and how the last restore went (outcome Restored, Failed or
    # Discarded; at; seconds or message).
    snapshot: dict[str, Any] | None
    lastRestore: dict[str, Any] | None
    # A fork on a cluster (control/forking.py): its parent (from), outcome Restoring,
    # Forked or Failed, at, message.
    fork: dict[str, Any] | None


def stamp(t: float | None = None) -> str:
    """A status time, as Kubernetes writes them: `2026-12-01T10:00:00Z` (now if None)."""
    when = dt.datetime.now(dt.UTC) if t is None else dt.datetime.fromtimestamp(t, dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> float | None:
    """Seconds since the epoch of a status or API time; None if it is not one."""
    if not isinstance(text, str) or not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


OOM_KILLED = "OOMKilled"  # a Termination's reason when the kernel ran out of memory
EVICTED = "Evicted"  # the kubelet evicted the kernel's pod (past its ephemeral storage)
POD_MISSING = "PodMissing"  # the kernel's pod is gone (or, on a cluster, replaced)


@dataclass(frozen=True)
class Termination:
    """Why a kernel stopped."""

    reason: str  # "OOMKilled", "Evicted", "Error", "Completed", "PodMissing"
    exit_code: int | None
    message: str


def termination_of(exit_code: int | None, *, oom: bool, memory_limit: str) -> Termination:
    """Name a kernel's death in words a person (or a model) can act on."""
    if oom:
        return Termination(
            OOM_KILLED,
            exit_code,
            f"the kernel ran out of memory (limit {memory_limit}) and was killed (OOM)",
        )
    if exit_code == 0:
        return Termination("Completed", exit_code, "the kernel exited")
    if isinstance(exit_code, int) and exit_code > 128:
        try:
            sig = signal.Signals(exit_code - 128).name
        except ValueError:
            sig = f"signal {exit_code - 128}"
        return Termination(
            "Error", exit_code, f"the kernel was killed by {sig} (exit code {exit_code})"
        )
    return Termination("Error", exit_code, f"the kernel exited with code {exit_code}")


def condition(
    old: Sequence[Mapping[str, Any]] | None,
    type_: str,
    value: bool,
    reason: str,
    message: str,
    *,
    generation: int,
    now: str,
) -> dict[str, Any]:
    """One condition, keeping lastTransitionTime while its status does not change."""
    status = "True" if value else "False"
    prev = next((c for c in old or [] if c.get("type") == type_), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else now
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:1000],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def conditions(
    old: Sequence[Mapping[str, Any]] | None,
    phase: str,
    reason: str,
    message: str,
    *,
    pending: tuple[str, str] | None = None,
    overdue: bool = False,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """Ready, UpdatePending, Reconciling and Stalled for a session in `phase`.

    `overdue`: in progress past its progress deadline (it still tries): Stalled, not
    Reconciling, so that kstatus reads it as Failed, as a Deployment past its
    progressDeadlineSeconds.

    `pending` is the (reason, message) of a spec change not yet on the kernel's pod.
    A Suspended session has no Ready condition: it has no kernel on purpose, which is
    its desired state, and kstatus (Flux, kpt) reads any Ready=False as progress still
    to come; without one it reads Reconciling and Stalled (both False): Current.
    `kubectl wait --for=condition=Ready` waits on, as it should, until it resumes.
    """
    busy, stuck = phase in IN_PROGRESS and not overdue, phase in STUCK or overdue

    def one(type_: str, value: bool, why: str, text: str) -> dict[str, Any]:
        return condition(old, type_, value, why, text, generation=generation, now=now)

    ready = [] if phase == SUSPENDED else [one("Ready", phase == READY, reason, message)]
    own = [
        *ready,
        one(
            "UpdatePending",
            pending is not None,
            pending[0] if pending else UP_TO_DATE,
            pending[1] if pending else "the kernel's pod matches the spec",
        ),
        one(
            "Reconciling",
            busy,
            reason if busy else "Settled",
            message if busy else "nothing in progress",
        ),
        one("Stalled", stuck, reason if stuck else "NotStalled", message if stuck else "not stuck"),
    ]
    # Conditions of other types (WarmStart) are kept as they are.
    return own + [dict(c) for c in old or [] if c.get("type") not in _OWN]


_OWN = frozenset({"Ready", "UpdatePending", "Reconciling", "Stalled"})


def since_true(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> float | None:
    """Since when condition `type_` is True (None: it is not)."""
    for c in conditions or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime"))
    return None


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: what changed, and None
    for each key `new` no longer has, at every depth (a merge patch of a whole object
    would keep the old one's other keys: a new snapshot must not inherit the last one's)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    patch: dict[str, Any] = {}
    for key, value in new.items():
        if key not in old:
            if value is not None:  # None: absent, as it is
                patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    for key in old:
        if key not in new:
            patch[key] = None
    return patch
