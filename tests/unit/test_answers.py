"""Which kernel pods the operator asks whether their kernel answers (control/answers.py),
and the state an operator first sees of a session (control/realize.py `unseen`)."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.control.answers import _made_by_a_session, askable
from mcp_forge.control.realize import unseen


def pod(**status: Any) -> dict[str, Any]:
    kernel = {"name": "kernel", "ready": False, "state": {"running": {}}}
    kernel.update(status.pop("kernel", {}))
    return {
        "metadata": status.pop("metadata", {"name": "ks-a"}),
        "status": {"phase": "Running", "podIP": "10.0.0.9", "containerStatuses": [kernel]} | status,
    }


def test_a_starting_kernel_with_an_address_is_asked() -> None:
    assert askable(pod())
    assert askable(pod(phase="Pending", kernel={"state": {"waiting": {}}}))


@pytest.mark.parametrize(
    "why",
    [
        {"podIP": None},  # nowhere to ask yet
        {"kernel": {"ready": True}},  # the kubelet has said it answered
        {"kernel": {"state": {"terminated": {"exitCode": 1}}}},
        {"phase": "Failed"},
        {"metadata": {"name": "ks-a", "deletionTimestamp": "2026-12-04T10:00:00Z"}},
    ],
)
def test_a_kernel_that_cannot_be_starting_is_not_asked(why: dict[str, Any]) -> None:
    assert not askable(pod(**why))


def test_a_status_only_the_crd_defaulted_is_unseen() -> None:
    """The CRD defaults status to observedGeneration 0: that is no operator's status, and
    a new session's children are made without being read first."""
    assert unseen({}) and unseen({"observedGeneration": 0})
    assert not unseen({"observedGeneration": 1, "phase": "Starting"})
    assert not unseen({"observedGeneration": 0, "phase": "Failed"})


def test_only_a_pod_a_session_controls_is_asked() -> None:
    """Labels anyone who may make pods can write; an owner reference to a KernelSession
    as controller is the operator's (or a claim's) doing."""
    owned = {"kind": "KernelSession", "name": "a", "uid": "u", "controller": True}
    assert _made_by_a_session(pod(metadata={"name": "ks-a", "ownerReferences": [owned]}))
    assert not _made_by_a_session(pod())
    pooled = dict(owned, kind="KernelSessionPool")
    assert not _made_by_a_session(pod(metadata={"name": "ks-a", "ownerReferences": [pooled]}))
