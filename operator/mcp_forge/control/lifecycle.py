"""A session's lifecycle, decided once for the operator and local mode. Pure: no I/O.

Two decisions, each a function of the spec, what was recorded and the time, and each
applied by the operator (control/reconciler.py) and by local mode (runtimes/local/) with
its own means:

- `stop_of`: whether a session must have no kernel now (maxLifetime reached,
  operatingMode Suspended, idle past idleTimeout while no code runs) and, if not, when
  to look again.
- `after_death`: whether a kernel that died is started again now, after a backoff, or,
  in local mode, not at all.
- `plan_kernel` (the operator's): what to do with a session's kernel pod as the kubelet
  shows it: keep it, replace it (a death, a restart asked for, a new spec), or wait.

A kernel that dies sooner than QUICK_DEATH after it started is crash-looping (a
sitecustomize that exits, an import that segfaults). It is started again after a
backoff that doubles with each such death in a row, as a kubelet does; the operator
keeps waiting at CRASH_BACKOFF_MAX, local mode (nothing watches its kernels between
calls) gives up there and fails the session with the reason. Local mode starts a
kernel again at once after its first quick death: that death is most often the code of
the call that just ran (an OOM, an os._exit), the call is answered with it, and the
next call must find a kernel. It backs off from the second quick death in a row, one
step behind the operator.

Both realizers follow a kernel the same way (`follow`): observe it (a `Kernel`: the
operator reads its pod, local mode its container), record its death once
(`recorded_death`), decide (`plan_kernel`), then show the outcome (`shown`, the one
builder of phase, reason, message and conditions) and act: replace the kernel, wait
out a backoff, or leave it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import Termination, parse_time, stamp
from mcp_forge.control.pods import Observation

QUICK_DEATH = 10.0  # a kernel that dies sooner after starting is crash-looping
CRASH_BACKOFF = 5.0  # ... and is started again after this, doubling per death
CRASH_BACKOFF_MAX = 300.0
BUSY_MAX = 600.0  # a busy mark counts for at most this long ahead
START_GRACE = 120.0  # a starting kernel is not idle for this long


@dataclass(frozen=True)
class Activity:
    """What gateways recorded: the last use, and until when code is running (busy)."""

    last: float  # wall-clock time of the last activity (or of creation)
    busy_until: float | None = None  # a gateway runs code in the kernel until then

    def busy(self, now: float) -> bool:
        return self.busy_until is not None and min(self.busy_until, now + BUSY_MAX) > now


@dataclass(frozen=True)
class Stop:
    """The session must have no kernel: it is Suspended or Expired (or, `delete`, gone)."""

    phase: str
    reason: str
    message: str
    delete: bool = False  # idleAction Delete: the session itself is deleted


USER_SUSPENDED = Stop(st.SUSPENDED, st.USER_REQUESTED, "spec.operatingMode is Suspended")


@dataclass(frozen=True)
class Verdict:
    stop: Stop | None
    due: list[float] = field(default_factory=list)  # wall-clock times to look again


def idle_since(activity: Activity, *, started: float | None, starting_since: float | None) -> float:
    """When idleness counts from: the last use, or the current kernel's start, whichever is
    later; a kernel still starting gets START_GRACE more from when its pod was made (a
    slow pull or a busy node is not idleness, but one that never starts is culled)."""
    floor = max(activity.last, started or 0.0)
    if starting_since is not None:
        floor = max(floor, starting_since + START_GRACE)
    return floor


def stop_of(
    session: KernelSession, *, created: float, idle_from: float, activity: Activity, now: float
) -> Verdict:
    """Whether the session must have no kernel now, and when to look again if not."""
    spec, written = session.spec, session.body["spec"]
    expires = created + spec.max_lifetime if spec.max_lifetime else None
    if expires is not None and now >= expires:
        why = f"the session reached its maxLifetime of {written['maxLifetime']}"
        return Verdict(Stop(st.EXPIRED, st.EXPIRED, why))
    if spec.operating_mode == "Suspended":
        return Verdict(USER_SUSPENDED)
    busy = activity.busy(now)
    if spec.idle_timeout and not busy and now - idle_from >= spec.idle_timeout:
        why = f"no activity for {written['idleTimeout']}"
        if spec.idle_action == "Delete":
            return Verdict(Stop(st.SUSPENDED, st.IDLE, why, delete=True))
        return Verdict(Stop(st.SUSPENDED, st.IDLE, f"{why}; used again, it resumes"))
    due = []
    if expires is not None:
        due.append(expires)
    # Idle already but busy: looked at again when the busy mark ends (below), not at once
    # and again and again while the code runs.
    if spec.idle_timeout and idle_from + spec.idle_timeout > now:
        due.append(idle_from + spec.idle_timeout)
    if busy and activity.busy_until is not None:
        due.append(min(activity.busy_until, now + BUSY_MAX))
    return Verdict(None, due)


def crash_backoff(quick_deaths: int) -> float:
    """Seconds to wait before the next start, after `quick_deaths` quick deaths in a row."""
    if quick_deaths <= 0:
        return 0.0
    return min(CRASH_BACKOFF_MAX, CRASH_BACKOFF * 2.0 ** (quick_deaths - 1))


def _gives_up(quick_deaths: int) -> bool:
    return quick_deaths > 0 and CRASH_BACKOFF * 2.0 ** (quick_deaths - 1) > CRASH_BACKOFF_MAX


@dataclass(frozen=True)
class Restart:
    """What to do about a dead kernel: start one `at` (now or later), or `give_up`."""

    at: float
    give_up: bool = False
    reason: str = ""  # CrashLoopBackOff while waiting, CrashLoop when given up
    message: str = ""


def after_death(
    quick_deaths: int, died_at: float, death: str, *, now: float, local: bool
) -> Restart:
    """When the next kernel starts, `quick_deaths` quick deaths in a row after `death`.

    Local mode is one step behind the operator, and gives up where the operator keeps
    waiting at the longest backoff (see the module docstring).
    """
    steps = quick_deaths - 1 if local else quick_deaths
    at = died_at + crash_backoff(steps)
    why = f"{death}; it died {quick_deaths} time(s) in a row within {QUICK_DEATH:.0f}s of starting"
    if local and _gives_up(steps):
        return Restart(
            at,
            give_up=True,
            reason=st.CRASH_LOOP,
            message=f"{why}, so it is not started again. Fix the cause (the session's env, or a "
            "sitecustomize or startup file its PYTHONPATH finds in the workspace) and apply "
            "the session again",
        )
    if at <= now:
        return Restart(at)
    return Restart(
        at, reason=st.CRASH_LOOP_BACKOFF, message=f"{why}, next start in {at - now:.0f}s"
    )


def is_quick(lived: float | None, exit_code: int | None = None) -> bool:
    """A death within QUICK_DEATH of the kernel's start is one more in a crash loop; an
    exit 0 (a restart asked for, the user's exit()) never is, nor one of unknown age."""
    return exit_code != 0 and lived is not None and lived < QUICK_DEATH


def death_record(
    last: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    at: str,
    quick: bool,
    **more: Any,
) -> dict[str, Any]:
    """status.lastTermination for a death, `last` the one recorded before: the count of
    quick deaths in a row goes on, or starts again. `more` are what a realizer adds (the
    operator: exitCode, podUID; `recorded_death` the kernelId)."""
    quick_deaths = int(last.get("quickDeaths") or 0) + 1 if quick else 0
    return {"reason": reason, "message": message, "at": at, "quickDeaths": quick_deaths, **more}


@dataclass(frozen=True)
class KernelPlan:
    """What to do with a session's kernel pod, and what the session shows meanwhile."""

    seen: Observation
    replace: bool = False  # delete the pod: the next reconcile makes a new one
    pending: tuple[str, str] | None = None  # (reason, message) of a spec change waiting
    due: float | None = None  # look again then (the end of a crash-loop backoff)


def plan_kernel(
    session: KernelSession,
    seen: Observation,
    *,
    quick_deaths: int,
    died_at: float | None,
    outdated: bool,
    deleting: bool,
    restart_asked: bool,
    busy: bool,
    now: float,
    local: bool = False,
) -> KernelPlan:
    """What to do with a session's existing kernel, `seen` as its realizer reads it
    (control/pods.py, or local mode's container): `quick_deaths` and `died_at` are the
    recorded death's (lastTermination), `outdated` says the pod was made for an older
    spec, `restart_asked` that a gateway asked to restart this very kernel, `busy` that a
    gateway runs code in it."""
    spec = session.spec
    term = seen.termination
    if term is not None:
        # A restart asked for is one whatever restartPolicy says. On a cluster, so is an
        # exit 0 (how a kernel ends when a gateway restarts it, or the user's exit()),
        # and a pod for an older spec is replaced; local mode applies a new spec itself.
        again = restart_asked or spec.restart_policy == "Always"
        if not local:
            again = again or term.exit_code == 0 or outdated
        if not again or deleting:
            return KernelPlan(seen)
        start = after_death(quick_deaths, died_at or now, term.message, now=now, local=local)
        if start.give_up:
            return KernelPlan(Observation(st.FAILED, start.reason, start.message, term))
        if start.at > now:
            return KernelPlan(
                Observation(st.RESTARTING, start.reason, start.message, term), due=start.at
            )
        return KernelPlan(Observation(st.RESTARTING, term.reason, term.message, term), replace=True)
    if deleting:
        return KernelPlan(
            Observation(st.RESTARTING, "PodTerminating", "the kernel's pod is being deleted")
        )
    if restart_asked:
        why = "a gateway restarts the kernel"
        return KernelPlan(Observation(st.RESTARTING, st.RESTART_REQUESTED, why), replace=True)
    if outdated and (not seen.ready or (spec.update_strategy == "Recreate" and not busy)):
        # no kernel to keep (not started, stuck), or one Recreate may replace now
        why = "the kernel's pod is replaced for a new spec"
        return KernelPlan(Observation(st.RESTARTING, st.UPDATING, why), replace=True)
    if outdated and spec.update_strategy == "Recreate":
        why = "the kernel is running code; the update follows when it stops"
        return KernelPlan(seen, pending=(st.KERNEL_BUSY, why))
    if outdated:
        why = "the spec changed; the new pod comes at the kernel's next restart"
        why += " (updateStrategy OnRestart)"
        return KernelPlan(seen, pending=(st.WAITING_FOR_RESTART, why))
    return KernelPlan(seen)


@dataclass(frozen=True)
class Kernel:
    """A session's kernel as its realizer sees it now."""

    id: str  # which kernel: the pod's uid on a cluster, local mode's kernelId
    seen: Observation  # what it shows (a death: its Termination)
    lived: float | None = None  # how long it ran, if it died and that is known
    outdated: bool = False  # made for an older spec
    deleting: bool = False  # on its way out


def recorded(last: Mapping[str, Any], kernel_id: str, *, phase: str | None) -> bool:
    """Whether `last` (lastTermination) is the death of the kernel `kernel_id`. A record
    without a kernel's id (written before records had one) is taken for the current
    kernel's while the session shows Restarting, so that death is not counted twice."""
    if kernel_id in (last.get("kernelId"), last.get("podUID")):
        return True
    unnamed = bool(last) and not last.get("kernelId") and not last.get("podUID")
    return unnamed and phase == st.RESTARTING


def recorded_death(
    last: Mapping[str, Any],
    kernel: Kernel,
    *,
    now: float,
    local: bool,
    phase: str | None = None,
    **more: Any,
) -> dict[str, Any] | None:
    """The lastTermination to write for the kernel's death; None if it lives, or its death
    is recorded already (one record per kernel; `phase` the session's, see `recorded`).
    Local mode's says when the next start is (`nextStartAt`: a gateway's call waits out
    a short backoff)."""
    term = kernel.seen.termination
    if term is None or recorded(last, kernel.id, phase=phase):
        return None
    record = death_record(
        last,
        reason=term.reason,
        message=term.message,
        at=stamp(now),
        quick=is_quick(kernel.lived, term.exit_code),
        kernelId=kernel.id,
        **more,
    )
    if local:
        start = after_death(record["quickDeaths"], now, term.message, now=now, local=True)
        record["nextStartAt"] = stamp(start.at)
    return record


@dataclass(frozen=True)
class Followed:
    """A kernel followed: its plan, and its death if recorded just now."""

    plan: KernelPlan
    last: Mapping[str, Any]  # lastTermination as it is now
    died: dict[str, Any] | None  # lastTermination to write: a death recorded now


def follow(
    session: KernelSession,
    kernel: Kernel,
    status: Mapping[str, Any],
    *,
    restart_asked: bool = False,
    busy: bool = False,
    now: float,
    local: bool,
    **more: Any,
) -> Followed:
    """Decide for an existing kernel, as both realizers do: its death recorded once, then
    the plan (`plan_kernel`) from the deaths so far. `status` is the session's as
    recorded; `more` goes into a death's record (the operator's exitCode and podUID)."""
    last: Mapping[str, Any] = status.get("lastTermination") or {}
    phase = status.get("phase")
    died = recorded_death(last, kernel, now=now, local=local, phase=phase, **more)
    if died is not None:
        last = died
    seen, term = kernel.seen, kernel.seen.termination
    if term is not None and last.get("reason") and last.get("message"):
        # The death as recorded, which may say more than the kernel's exit (local mode's
        # StartFailed: it exited while starting, and its log).
        term = Termination(str(last["reason"]), term.exit_code, str(last["message"]))
        seen = Observation(seen.phase, term.reason, term.message, term, None, seen.pod_ip)
    plan = plan_kernel(
        session,
        seen,
        quick_deaths=int(last.get("quickDeaths") or 0),
        died_at=parse_time(last.get("at")),
        outdated=kernel.outdated,
        deleting=kernel.deleting,
        restart_asked=restart_asked,
        busy=busy,
        now=now,
        local=local,
    )
    return Followed(plan, last, died)


def shown(
    old: Mapping[str, Any],
    seen: Observation,
    *,
    generation: int,
    now: float,
    pending: tuple[str, str] | None = None,
    deadline: float = 0.0,
) -> dict[str, Any]:
    """The status fields that show `seen`: phase, reason, message, observedGeneration
    and the four conditions (api/status.py), as both realizers write them. In progress
    longer than `deadline` seconds (0: no deadline) without being Ready, it is Stalled
    (it still tries), saying how long."""
    message, overdue = seen.message, False
    since = st.since_true(old.get("conditions"), "Reconciling")
    if deadline > 0 and seen.phase in st.IN_PROGRESS and since is not None:
        overdue = now - since > deadline
        if overdue:
            message = f"not Ready after {deadline:g}s: {seen.message}"
    return {
        "phase": seen.phase,
        "reason": seen.reason,
        "message": message[:2000],
        "observedGeneration": generation,
        "conditions": st.conditions(
            old.get("conditions"),
            seen.phase,
            seen.reason,
            message,
            pending=pending,
            overdue=overdue,
            generation=generation,
            now=stamp(now),
        ),
    }


def stopped(old: Mapping[str, Any], stop: Stop, *, generation: int, now: float) -> dict[str, Any]:
    """The status of a session stopped by `stop`: what shows it, no kernel, and since
    when it is Suspended (kept while it stays so; none once Expired)."""
    since = old.get("suspendedAt") if old.get("phase") == st.SUSPENDED else None
    return {
        **shown(
            old, Observation(stop.phase, stop.reason, stop.message), generation=generation, now=now
        ),
        "suspendedAt": (since or stamp(now)) if stop.phase == st.SUSPENDED else None,
        "kernelId": None,
        "podName": None,
    }
