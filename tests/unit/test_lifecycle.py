"""The session lifecycle the operator and local mode share, as plain functions: when a
session must have no kernel, when a dead kernel starts again, what the operator does with
a kernel pod, and the conditions."""

from __future__ import annotations

from typing import Any

import pytest

from kstatus import kstatus
from mcp_forge.api import status as st
from mcp_forge.api.status import Termination
from mcp_forge.control.lifecycle import (
    BUSY_MAX,
    QUICK_DEATH,
    START_GRACE,
    USER_SUSPENDED,
    Activity,
    Kernel,
    Stop,
    after_death,
    crash_backoff,
    death_record,
    follow,
    idle_since,
    is_quick,
    plan_kernel,
    recorded,
    shown,
    stop_of,
    stopped,
)
from mcp_forge.control.pods import Observation
from support import kernel_session as session

T0 = 1_000_000.0  # the session's creation


# spec, seconds since creation, seconds since the last use, busy for how long more
# (None: not busy) -> (phase, reason, delete) of the stop, or None, and the times due.
STOPS: list[tuple[dict[str, Any], float, float, float | None, tuple[str, str, bool] | None]] = [
    ({}, 10, 10, None, None),
    ({"maxLifetime": "1h"}, 3599, 0, None, None),
    ({"maxLifetime": "1h"}, 3600, 0, None, (st.EXPIRED, st.EXPIRED, False)),
    ({"maxLifetime": "1h"}, 3600, 0, 60, (st.EXPIRED, st.EXPIRED, False)),  # busy or not
    ({"operatingMode": "Suspended"}, 5, 0, None, (st.SUSPENDED, st.USER_REQUESTED, False)),
    ({"idleTimeout": "5m"}, 400, 299, None, None),
    ({"idleTimeout": "5m"}, 400, 300, None, (st.SUSPENDED, st.IDLE, True)),  # Delete default
    (
        {"idleTimeout": "5m", "idleAction": "Suspend"},
        400,
        300,
        None,
        (st.SUSPENDED, st.IDLE, False),
    ),
    ({"idleTimeout": "5m"}, 400, 300, 30, None),  # code runs: not idle
    ({"idleTimeout": "5m"}, 400, 300, -1, (st.SUSPENDED, st.IDLE, True)),  # the mark lapsed
    ({"idleTimeout": "5m", "maxLifetime": "1h"}, 3600, 300, None, (st.EXPIRED, st.EXPIRED, False)),
]


@pytest.mark.parametrize(("spec", "age", "idle", "busy", "stop"), STOPS)
def test_when_a_session_must_have_no_kernel(
    spec: dict[str, Any],
    age: float,
    idle: float,
    busy: float | None,
    stop: tuple[str, str, bool] | None,
) -> None:
    now = T0 + age
    activity = Activity(now - idle, None if busy is None else now + busy)
    verdict = stop_of(
        session(**spec), created=T0, idle_from=activity.last, activity=activity, now=now
    )
    got = (
        None
        if verdict.stop is None
        else (verdict.stop.phase, verdict.stop.reason, verdict.stop.delete)
    )
    assert got == stop
    if verdict.stop is not None:
        assert verdict.due == []
        assert verdict.stop.message  # says why, in words
    else:  # looked at again when something can change
        assert all(t > now for t in verdict.due)


def test_a_running_session_is_looked_at_again_at_expiry_idleness_and_when_busy_lapses() -> None:
    now = T0 + 100
    activity = Activity(now - 10, now + 30)
    spec = {"maxLifetime": "1h", "idleTimeout": "5m"}
    verdict = stop_of(session(**spec), created=T0, idle_from=now - 10, activity=activity, now=now)
    assert verdict.stop is None
    assert sorted(verdict.due) == [now + 30, now - 10 + 300, T0 + 3600]


def test_a_busy_mark_far_ahead_counts_for_at_most_busy_max() -> None:
    now = T0
    activity = Activity(now, now + 10 * BUSY_MAX)
    assert activity.busy(now) and activity.busy(now + BUSY_MAX - 1)
    verdict = stop_of(
        session(idleTimeout="1h"), created=T0, idle_from=now, activity=activity, now=now
    )
    assert min(verdict.due) == now + BUSY_MAX


@pytest.mark.parametrize(
    ("last", "started", "starting_since", "floor"),
    [
        (100.0, None, None, 100.0),
        (100.0, 200.0, None, 200.0),  # a new kernel counts from its start
        (100.0, None, 150.0, 150.0 + START_GRACE),  # a starting kernel gets a grace
        (500.0, None, 150.0, 500.0),
    ],
)
def test_idleness_counts_from_the_last_use_or_the_kernel_s_start(
    last: float, started: float | None, starting_since: float | None, floor: float
) -> None:
    assert idle_since(Activity(last), started=started, starting_since=starting_since) == floor


@pytest.mark.parametrize(
    ("quick_deaths", "backoff"),
    [(0, 0.0), (1, 5.0), (2, 10.0), (6, 160.0), (7, 300.0), (12, 300.0)],
)
def test_the_operator_backs_off_doubling_up_to_the_cap_and_never_gives_up(
    quick_deaths: int, backoff: float
) -> None:
    assert crash_backoff(quick_deaths) == backoff
    verdict = after_death(quick_deaths, T0, "the kernel exited with code 1", now=T0, local=False)
    assert (verdict.at, verdict.give_up) == (T0 + backoff, False)
    if backoff:
        assert verdict.reason == st.CRASH_LOOP_BACKOFF
        assert f"next start in {backoff:.0f}s" in verdict.message
        assert verdict.message.startswith("the kernel exited with code 1; it died")
    else:
        assert verdict.reason == ""  # started again now


@pytest.mark.parametrize(
    ("quick_deaths", "backoff", "gives_up"),
    [(0, 0.0, False), (1, 0.0, False), (2, 5.0, False), (7, 160.0, False), (8, 300.0, True)],
)
def test_local_mode_restarts_at_once_after_one_quick_death_then_backs_off_and_gives_up(
    quick_deaths: int, backoff: float, gives_up: bool
) -> None:
    verdict = after_death(quick_deaths, T0, "the kernel exited with code 1", now=T0, local=True)
    assert (verdict.at, verdict.give_up) == (T0 + backoff, gives_up)
    if gives_up:
        assert verdict.reason == st.CRASH_LOOP and "not started again" in verdict.message


def test_a_backoff_that_is_over_starts_the_kernel_now() -> None:
    verdict = after_death(3, T0, "died", now=T0 + 20.0, local=False)
    assert (verdict.at, verdict.reason) == (T0 + 20.0, "")


PHASES = [
    # phase -> Ready, Reconciling, Stalled, and what kstatus (Flux, kpt) reads of it
    (st.PENDING, "False", "True", "False", "InProgress"),
    (st.STARTING, "False", "True", "False", "InProgress"),
    (st.READY, "True", "False", "False", "Current"),
    (st.RESTARTING, "False", "True", "False", "InProgress"),
    (st.FAILED, "False", "False", "True", "Failed"),
    (st.SUSPENDED, None, "False", "False", "Current"),  # no kernel on purpose: no Ready
    (st.EXPIRED, "False", "False", "True", "Failed"),
]


@pytest.mark.parametrize(("phase", "ready", "reconciling", "stalled", "health"), PHASES)
def test_the_four_conditions_follow_the_phase_and_kstatus_reads_them(
    phase: str, ready: str | None, reconciling: str, stalled: str, health: str
) -> None:
    got = st.conditions(None, phase, "Why", "because", generation=3, now="T1")
    by_type = {c["type"]: c for c in got}
    assert list(by_type) == ["Ready", "UpdatePending", "Reconciling", "Stalled"][ready is None :]
    assert (by_type.get("Ready", {}).get("status"), by_type["Reconciling"]["status"]) == (
        ready,
        reconciling,
    )
    assert by_type["Stalled"]["status"] == stalled
    assert by_type["UpdatePending"]["status"] == "False"
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == "T1" for c in got)
    seen = session_with(phase, got, generation=3, observed=3)
    pending = st.conditions(None, phase, "Why", "because", pending=("Updating", "later"),
                            generation=3, now="T1")  # fmt: skip
    assert kstatus(seen, session_with(phase, pending, generation=3, observed=3)) == [health] * 2
    # A spec the operator has not seen yet is in progress, whatever the phase says.
    assert kstatus(session_with(phase, got, generation=4, observed=3)) == ["InProgress"]


def session_with(
    phase: str, conditions: list[dict[str, Any]], *, generation: int, observed: int
) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s", "namespace": "default", "generation": generation},
        "spec": {},
        "status": {"phase": phase, "observedGeneration": observed, "conditions": conditions},
    }


def test_a_condition_keeps_its_transition_time_while_unchanged_and_says_what_is_pending() -> None:
    first = st.conditions(None, st.READY, st.KERNEL_READY, "ok", generation=1, now="T1")
    again = st.conditions(
        first,
        st.READY,
        st.KERNEL_READY,
        "ok",
        pending=(st.KERNEL_BUSY, "later"),
        generation=2,
        now="T2",
    )
    ready, pending = again[0], again[1]
    assert (ready["lastTransitionTime"], ready["observedGeneration"]) == ("T1", 2)
    assert (pending["status"], pending["reason"], pending["lastTransitionTime"]) == (
        "True",
        st.KERNEL_BUSY,
        "T2",
    )
    down = st.conditions(again, st.RESTARTING, "OOMKilled", "oom", generation=2, now="T3")
    assert (down[0]["status"], down[0]["lastTransitionTime"]) == ("False", "T3")


DIED = Termination("Error", 1, "the kernel exited with code 1")
CLEAN = Termination("Completed", 0, "the kernel exited")
RUNNING = Observation(st.READY, st.KERNEL_READY, "the kernel answered")
STARTING_POD = Observation(st.STARTING, "ContainerCreating", "the kernel is starting")


def dead(term: Termination, policy: str = "Always") -> Observation:
    return Observation(
        st.RESTARTING if policy == "Always" else st.FAILED, term.reason, term.message, term
    )


# spec, what the pod shows, and the facts -> (replace the pod?, phase, reason, pending reason)
PLANS: list[
    tuple[dict[str, Any], Observation, dict[str, Any], tuple[bool, str, str, str | None]]
] = [
    ({}, RUNNING, {}, (False, st.READY, st.KERNEL_READY, None)),
    ({}, dead(DIED), {}, (True, st.RESTARTING, "Error", None)),
    ({"restartPolicy": "Never"}, dead(DIED, "Never"), {}, (False, st.FAILED, "Error", None)),
    (
        {"restartPolicy": "Never"},
        dead(CLEAN, "Never"),
        {},
        (True, st.RESTARTING, "Completed", None),
    ),
    (
        {"restartPolicy": "Never"},
        dead(DIED, "Never"),
        {"outdated": True},
        (True, st.RESTARTING, "Error", None),
    ),
    ({}, dead(DIED), {"quick_deaths": 2}, (False, st.RESTARTING, st.CRASH_LOOP_BACKOFF, None)),
    ({}, dead(DIED), {"quick_deaths": 2, "died_at": T0 - 11}, (True, st.RESTARTING, "Error", None)),
    ({}, dead(DIED), {"deleting": True}, (False, st.RESTARTING, "Error", None)),
    ({}, RUNNING, {"deleting": True}, (False, st.RESTARTING, "PodTerminating", None)),
    ({}, RUNNING, {"restart_asked": True}, (True, st.RESTARTING, st.RESTART_REQUESTED, None)),
    ({}, RUNNING, {"outdated": True}, (False, st.READY, st.KERNEL_READY, st.WAITING_FOR_RESTART)),
    ({}, STARTING_POD, {"outdated": True}, (True, st.RESTARTING, st.UPDATING, None)),
    (
        {"updateStrategy": "Recreate"},
        RUNNING,
        {"outdated": True},
        (True, st.RESTARTING, st.UPDATING, None),
    ),
    (
        {"updateStrategy": "Recreate"},
        RUNNING,
        {"outdated": True, "busy": True},
        (False, st.READY, st.KERNEL_READY, st.KERNEL_BUSY),
    ),
]


@pytest.mark.parametrize(("spec", "seen", "facts", "want"), PLANS)
def test_what_the_operator_does_with_a_kernel_pod(
    spec: dict[str, Any],
    seen: Observation,
    facts: dict[str, Any],
    want: tuple[bool, str, str, str | None],
) -> None:
    given: dict[str, Any] = {
        "quick_deaths": 0,
        "died_at": T0,
        "outdated": False,
        "deleting": False,
        "restart_asked": False,
        "busy": False,
        **facts,
    }
    plan = plan_kernel(session(**spec), seen, now=T0, **given)
    pending = plan.pending[0] if plan.pending else None
    assert (plan.replace, plan.seen.phase, plan.seen.reason, pending) == want
    if plan.seen.reason == st.CRASH_LOOP_BACKOFF:
        assert plan.due == T0 + 10.0 and "next start in 10s" in plan.seen.message
    else:
        assert plan.due is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2026-12-01T10:00:00Z", 1796119200.0),
        ("2026-12-01T10:00:00.250000Z", 1796119200.25),  # a Lease's renewTime
        ("2026-12-01T11:00:00+01:00", 1796119200.0),
        ("2026-12-01T10:00:00", None),  # no zone: not a status time
        ("yesterday", None),
        ("", None),
        (None, None),
        (1796119200, None),
    ],
)
def test_status_times_are_read_one_way_everywhere(text: Any, seconds: float | None) -> None:
    assert st.parse_time(text) == seconds
    if seconds is not None:
        assert st.parse_time(st.stamp(seconds)) == int(seconds)


# lived (seconds), exit code -> one more quick death in a row?
QUICK = [
    (1.0, 1, True),
    (1.0, None, True),  # local mode: the exit code is not what it counts by
    (QUICK_DEATH - 0.01, 137, True),
    (QUICK_DEATH, 1, False),
    (600.0, 1, False),
    (1.0, 0, False),  # an exit 0: a restart asked for, or the user's exit()
    (None, 1, False),  # of unknown age
]


@pytest.mark.parametrize(("lived", "exit_code", "quick"), QUICK)
def test_a_quick_death_is_one_soon_after_the_start_and_not_an_exit_0(
    lived: float | None, exit_code: int | None, quick: bool
) -> None:
    assert is_quick(lived, exit_code) is quick


# quickDeaths recorded before, quick now -> quickDeaths after
RECORDS = [
    (None, True, 1),
    (None, False, 0),
    (0, True, 1),
    (3, True, 4),
    (3, False, 0),  # a death after a kernel lived long: the crash loop is over
]


@pytest.mark.parametrize(("before", "quick", "after"), RECORDS)
def test_a_death_record_counts_quick_deaths_in_a_row(
    before: int | None, quick: bool, after: int
) -> None:
    last = {} if before is None else {"reason": "Error", "quickDeaths": before, "podUID": "old"}
    record = death_record(
        last, reason="OOMKilled", message="out of memory", at="2026-12-03T12:00:00Z",
        quick=quick, podUID="new",
    )  # fmt: skip
    assert record == {
        "reason": "OOMKilled",
        "message": "out of memory",
        "at": "2026-12-03T12:00:00Z",
        "quickDeaths": after,
        "podUID": "new",
    }


# Both realizers follow a kernel through `follow`: what each one observed of it (its
# restartPolicy, what it shows, how long it lived, the record so far, a restart asked)
# -> (a death recorded now?, quickDeaths after, replace it now?, phase, reason).
OOM = Termination(st.OOM_KILLED, 137, "the kernel ran out of memory")
GATEWAY_KILL = Termination("Unresponsive", None, "the kernel did not answer an interrupt")
FOLLOWS: list[
    tuple[bool, str, Observation, float | None, dict[str, Any], bool, tuple[Any, ...]]
] = [
    # the operator: a death is recorded once per pod, and backs off from the first quick one
    (False, "Always", dead(DIED), 600.0, {}, False, (True, 0, True, st.RESTARTING, "Error")),
    (
        False,
        "Always",
        dead(DIED),
        2.0,
        {},
        False,
        (True, 1, False, st.RESTARTING, st.CRASH_LOOP_BACKOFF),
    ),
    (
        False,
        "Always",
        dead(DIED),
        2.0,
        {"kernelId": "k1", "quickDeaths": 1, "at": st.stamp(T0 - 60)},
        False,
        (False, 1, True, st.RESTARTING, "Error"),  # recorded long ago: the backoff is over
    ),
    (
        False,
        "Always",
        dead(DIED),
        2.0,
        {"podUID": "k1", "quickDeaths": 1},  # an older operator's record: the same pod
        False,
        (False, 1, False, st.RESTARTING, st.CRASH_LOOP_BACKOFF),
    ),
    (False, "Never", dead(DIED, "Never"), 600.0, {}, False, (True, 0, False, st.FAILED, "Error")),
    (
        False,
        "Never",
        dead(CLEAN, "Never"),
        2.0,
        {},
        False,
        (True, 0, True, st.RESTARTING, "Completed"),
    ),
    (False, "Never", dead(DIED, "Never"), 600.0, {}, True, (True, 0, True, st.RESTARTING, "Error")),
    # local mode: starts again at once after the first quick death, backs off from the
    # second, gives up past the longest backoff; an exit 0 is no restart it asked for
    (True, "Always", dead(OOM), 2.0, {}, False, (True, 1, True, st.RESTARTING, st.OOM_KILLED)),
    (
        True,
        "Always",
        dead(DIED),
        2.0,
        {"kernelId": "k0", "quickDeaths": 1},
        False,
        (True, 2, False, st.RESTARTING, st.CRASH_LOOP_BACKOFF),
    ),
    (
        True,
        "Always",
        dead(DIED),
        2.0,
        {"kernelId": "k0", "quickDeaths": 7},
        False,
        (True, 8, False, st.FAILED, st.CRASH_LOOP),
    ),
    (True, "Never", dead(CLEAN, "Never"), 2.0, {}, False, (True, 0, False, st.FAILED, "Completed")),
    (
        True,
        "Never",
        Observation(st.RESTARTING, GATEWAY_KILL.reason, GATEWAY_KILL.message, GATEWAY_KILL),
        None,  # it was running when the gateway gave up on it
        {},
        True,
        (True, 0, True, st.RESTARTING, "Unresponsive"),
    ),
    (True, "Never", RUNNING, None, {}, True, (False, 0, True, st.RESTARTING, st.RESTART_REQUESTED)),
    (
        True,
        "Always",
        RUNNING,
        None,
        {"kernelId": "k0", "quickDeaths": 2},
        False,
        (False, 2, False, st.READY, st.KERNEL_READY),
    ),
]


@pytest.mark.parametrize(("local", "policy", "seen", "lived", "last", "asked", "want"), FOLLOWS)
def test_both_realizers_follow_a_kernel_one_way(
    local: bool,
    policy: str,
    seen: Observation,
    lived: float | None,
    last: dict[str, Any],
    asked: bool,
    want: tuple[Any, ...],
) -> None:
    now = T0
    kernel = Kernel("k1", seen, lived)
    followed = follow(
        session(restartPolicy=policy),
        kernel,
        {"lastTermination": last} if last else {},
        restart_asked=asked,
        now=now,
        local=local,
    )
    plan = followed.plan
    got = (
        followed.died is not None,
        int(followed.last.get("quickDeaths") or 0),
        plan.replace,
        plan.seen.phase,
        plan.seen.reason,
    )
    assert got == want
    if followed.died is not None:
        assert followed.died["kernelId"] == "k1" and followed.died["at"] == st.stamp(now)
        assert followed.died["reason"] == seen.reason
        # local mode says when the next start is: the gateway's call waits for it
        assert ("nextStartAt" in followed.died) is local
        if local and plan.seen.reason == st.CRASH_LOOP_BACKOFF:
            assert followed.died["nextStartAt"] == st.stamp(now + 5.0)
    if plan.seen.reason == st.CRASH_LOOP_BACKOFF:
        assert plan.due == now + 5.0 and "next start in 5s" in plan.seen.message
    if plan.seen.reason == st.CRASH_LOOP:
        assert "is not started again" in plan.seen.message


def test_what_a_session_shows_is_written_one_way_with_its_conditions() -> None:
    seen = Observation(st.RESTARTING, st.CRASH_LOOP_BACKOFF, "x" * 5000)
    fields = shown({}, seen, generation=3, now=T0, pending=(st.KERNEL_BUSY, "busy"))
    assert (fields["phase"], fields["reason"], fields["observedGeneration"]) == (
        st.RESTARTING,
        st.CRASH_LOOP_BACKOFF,
        3,
    )
    assert len(fields["message"]) == 2000  # bounded: a kernel's output may be in it
    kinds = {c["type"]: c["status"] for c in fields["conditions"]}
    assert kinds == {
        "Ready": "False",
        "UpdatePending": "True",
        "Reconciling": "True",
        "Stalled": "False",
    }


def test_a_death_is_planned_for_as_it_was_recorded() -> None:
    """Local mode records a kernel that died while starting as StartFailed, with its log:
    what the session says of its crash loop is that, not the bare exit code."""
    recorded = {
        "kernelId": "k1",
        "reason": "StartFailed",
        "message": "the kernel exited while starting: ImportError",
        "quickDeaths": 2,
        "at": st.stamp(T0),
    }
    followed = follow(
        session(), Kernel("k1", dead(DIED), 0.5), {"lastTermination": recorded}, now=T0, local=True
    )
    assert followed.died is None  # recorded already
    assert followed.plan.seen.reason == st.CRASH_LOOP_BACKOFF
    assert followed.plan.seen.message.startswith("the kernel exited while starting: ImportError")


# the phase before, the stop -> suspendedAt after ("now", kept "T", or None)
STOPPED = [
    (st.READY, USER_SUSPENDED, "now"),
    (st.SUSPENDED, USER_SUSPENDED, "T"),  # suspended still: since when it first was
    (st.SUSPENDED, Stop(st.SUSPENDED, st.IDLE, "no activity for 5m"), "T"),
    (st.READY, Stop(st.EXPIRED, st.EXPIRED, "the session reached its maxLifetime"), None),
    (st.SUSPENDED, Stop(st.EXPIRED, st.EXPIRED, "the session reached its maxLifetime"), None),
]


@pytest.mark.parametrize(("before", "stop", "since"), STOPPED)
def test_a_stopped_session_shows_why_has_no_kernel_and_says_since_when(
    before: str, stop: Stop, since: str | None
) -> None:
    old = {"phase": before, "suspendedAt": "T", "kernelId": "k1", "podName": "p"}
    fields = stopped(old, stop, generation=2, now=T0)
    assert (fields["phase"], fields["reason"], fields["message"]) == (
        stop.phase,
        stop.reason,
        stop.message,
    )
    assert (fields["kernelId"], fields["podName"]) == (None, None)
    assert fields["suspendedAt"] == (st.stamp(T0) if since == "now" else since)
    ready = [c for c in fields["conditions"] if c["type"] == "Ready"]
    if stop.phase == st.SUSPENDED:  # no kernel on purpose: no Ready to be False
        assert ready == [], ready
    else:
        assert ready[0]["status"] == "False" and ready[0]["reason"] == stop.reason


@pytest.mark.parametrize(
    ("last", "phase", "want"),
    [
        ({}, st.READY, False),  # no death recorded yet
        ({"reason": "Error", "kernelId": "k1"}, st.READY, True),
        ({"reason": "Error", "podUID": "k1"}, st.READY, True),  # the operator's, before kernelId
        ({"reason": "Error", "kernelId": "k0"}, st.RESTARTING, False),  # an earlier kernel's
        # written before records named their kernel: this one's while it is restarting,
        # an earlier one's once a kernel is Ready again
        ({"reason": "Error"}, st.RESTARTING, True),
        ({"reason": "Error"}, st.READY, False),
    ],
)
def test_a_death_is_recorded_once_per_kernel_records_without_an_id_included(
    last: dict[str, Any], phase: str, want: bool
) -> None:
    assert recorded(last, "k1", phase=phase) is want
    seen = Observation(st.RESTARTING, DIED.reason, DIED.message, DIED)
    status = {"phase": phase, "lastTermination": last}
    followed = follow(session(), Kernel("k1", seen, 2.0), status, now=T0, local=True)
    assert (followed.died is None) is want


def test_a_session_in_progress_past_its_deadline_is_stalled_and_kstatus_says_failed() -> None:
    """As a Deployment past progressDeadlineSeconds: still trying, but Stalled (not
    Reconciling), so Flux's wait ends Failed instead of waiting for ever."""
    pending = Observation(st.PENDING, "Unschedulable", "0/1 nodes: Insufficient cpu")
    first = shown({}, pending, generation=1, now=T0, deadline=60.0)
    assert kstatus(session_with(st.PENDING, first["conditions"], generation=1, observed=1)) == [
        "InProgress"
    ]
    soon = shown(first, pending, generation=1, now=T0 + 59, deadline=60.0)
    assert kstatus(session_with(st.PENDING, soon["conditions"], generation=1, observed=1)) == [
        "InProgress"
    ]
    late = shown(soon, pending, generation=1, now=T0 + 61, deadline=60.0)
    by_type = {c["type"]: c for c in late["conditions"]}
    assert (by_type["Reconciling"]["status"], by_type["Stalled"]["status"]) == ("False", "True")
    assert by_type["Stalled"]["reason"] == "Unschedulable"
    assert late["message"].startswith("not Ready after 60s: 0/1 nodes"), late["message"]
    assert kstatus(session_with(st.PENDING, late["conditions"], generation=1, observed=1)) == [
        "Failed"
    ]
    # Ready at last: the stall is over.
    ready = shown(late, Observation(st.READY, "KernelReady", "ok"), generation=1, now=T0 + 70,
                  deadline=60.0)  # fmt: skip
    assert kstatus(session_with(st.READY, ready["conditions"], generation=1, observed=1)) == [
        "Current"
    ]
    # No deadline: in progress for ever, as before.
    never = shown(soon, pending, generation=1, now=T0 + 10_000, deadline=0.0)
    assert {c["type"]: c["status"] for c in never["conditions"]}["Stalled"] == "False"
