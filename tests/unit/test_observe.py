"""What a kernel Pod's status (as the kubelet reports it) says about its session."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.control.pods import observe
from support import kernel_session as session


def pod(
    state: dict[str, Any], phase: str = "Running", started: bool = True, **status: Any
) -> dict[str, Any]:
    """A kernel pod; `started`: its startupProbe (the kernel answered) has passed."""
    answered = started and "running" in state
    kernel = {"name": "kernel", "state": state, "started": answered, "ready": answered}
    return {
        "metadata": {"name": "ks-demo"},
        "status": {"phase": phase, "podIP": "10.1.2.3", "containerStatuses": [kernel], **status},
    }


def test_no_pod_is_pending() -> None:
    assert observe(session(), None).phase == "Pending"


def test_a_running_kernel_that_has_not_answered_yet_is_starting() -> None:
    seen = observe(
        session(), pod({"running": {"startedAt": "2026-11-29T10:00:00Z"}}, started=False)
    )
    assert (seen.phase, seen.ready, seen.reason) == ("Starting", False, "KernelStarting")


def test_a_kernel_s_start_is_when_it_answered_which_idleness_counts_from() -> None:
    answered = {"type": "ContainersReady", "status": "True", "lastTransitionTime": "T2"}
    seen = observe(session(), pod({"running": {"startedAt": "T1"}}, conditions=[answered]))
    assert (seen.phase, seen.started_at) == ("Ready", "T2")


def test_a_running_kernel_is_ready_with_its_ip_and_start() -> None:
    seen = observe(session(), pod({"running": {"startedAt": "2026-11-29T10:00:00Z"}}))
    assert (seen.phase, seen.ready, seen.pod_ip) == ("Ready", True, "10.1.2.3")
    assert seen.started_at == "2026-11-29T10:00:00Z"


def test_an_oom_kill_is_named_with_the_memory_limit() -> None:
    seen = observe(
        session(), pod({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, phase="Failed")
    )
    assert seen.phase == "Restarting"
    assert seen.termination is not None and seen.termination.reason == "OOMKilled"
    assert "limit 512Mi" in seen.message


def test_an_eviction_is_named_with_the_kubelets_words_not_as_a_signal() -> None:
    why = "Pod ephemeral local storage usage exceeds the total limit of containers 335544320. "
    seen = observe(
        session(),
        pod(
            {"terminated": {"exitCode": 143, "reason": "Error"}},
            "Failed",
            reason="Evicted",
            message=why,
        ),
    )
    assert seen.phase == "Restarting"
    assert seen.termination is not None and seen.termination.reason == "Evicted"
    assert seen.termination.message == f"the kernel's pod was evicted: {why.strip()}"
    assert "SIGTERM" not in seen.message


@pytest.mark.parametrize(
    ("code", "words"), [(139, "SIGSEGV"), (1, "exited with code 1"), (0, "exited")]
)
def test_a_dead_kernel_is_named_by_signal_or_code(code: int, words: str) -> None:
    seen = observe(session(), pod({"terminated": {"exitCode": code, "reason": "Error"}}, "Failed"))
    assert words in seen.message


def test_restart_policy_never_makes_a_death_final() -> None:
    seen = observe(
        session(restartPolicy="Never"), pod({"terminated": {"exitCode": 1}}, phase="Failed")
    )
    assert seen.phase == "Failed"


def test_the_kubelets_secret_cache_timing_out_is_a_start_not_a_failure() -> None:
    """The kubelet waits a second for a new Secret reflector and tries again 10 s later: a
    busy node's transient error, not the session's fault (a missing key still fails it)."""
    why = "failed to sync secret cache: timed out waiting for the condition"
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": why}}
    seen = observe(session(), pod(waiting, phase="Pending"))
    assert seen.phase == "Starting" and seen.message == why
    missing = "couldn't find key token in Secret team/api"
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": missing}}
    assert observe(session(), pod(waiting, phase="Pending")).phase == "Failed"


def test_an_image_that_cannot_be_pulled_fails_the_session() -> None:
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}
    seen = observe(session(), pod(waiting, phase="Pending"))
    assert (seen.phase, seen.reason, seen.message) == (
        "Failed",
        "ImagePullBackOff",
        "no such image",
    )


def test_a_kernel_being_created_is_starting() -> None:
    seen = observe(session(), pod({"waiting": {"reason": "ContainerCreating"}}, phase="Pending"))
    assert (seen.phase, seen.ready) == ("Starting", False)


def test_a_kernel_that_answered_the_operator_is_ready_before_its_startup_probe() -> None:
    """control/answers.py: the operator's own kernel_info, answered, is Ready at once,
    whatever the kubelet has written so far (still creating, running not started)."""
    for state in ({"running": {"startedAt": "T1"}}, {"waiting": {"reason": "ContainerCreating"}}):
        seen = observe(session(), pod(state, started=False), answered=("T2", "10.1.2.3"))
        assert (seen.phase, seen.started_at, seen.pod_ip) == ("Ready", "T2", "10.1.2.3")
        assert seen.message == "the kernel answered the operator"
    # A pod read from a cache that does not show its address yet: Ready carries the
    # address the kernel answered at (a gateway connecting by pod IP needs one).
    stale = pod({"waiting": {"reason": "ContainerCreating"}}, started=False, podIP=None)
    seen = observe(session(), stale, answered=("T2", "10.1.2.4"))
    assert (seen.phase, seen.pod_ip) == ("Ready", "10.1.2.4")
    # The kubelet's own Ready reads apart, so a test can tell which came first.
    probed = observe(session(), pod({"running": {"startedAt": "T1"}}))
    assert probed.message == "the kernel answered its startup probe"


def test_an_answer_does_not_outlive_the_kernel() -> None:
    died = pod({"terminated": {"exitCode": 1}}, phase="Failed")
    seen = observe(session(), died, answered=("T2", "10.1.2.3"))
    assert seen.phase == "Restarting" and seen.termination is not None
