"""Which watch events of a session's kernel pod and Lease are news to its reconcile
(control/heard.py, control/pods.py `signature`). The pods are shaped as the kubelet
writes a starting one, version by version; on the cluster: tests/kube/test_operator_writes.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mcp_forge.api import kernelsession
from mcp_forge.control.heard import Heard
from mcp_forge.control.render import CONTAINER


def session() -> kernelsession.KernelSession:
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s", "namespace": "ns", "uid": "ks-uid"},
        "spec": {"image": "img"},
    }
    return kernelsession.load(kernelsession.validate(body, default_namespace="ns"))


def pod(rv: str, **status: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": "ks-s",
            "namespace": "ns",
            "uid": "pod-uid",
            "resourceVersion": rv,
            "labels": {"mcpforge.dev/session": "s"},
            "ownerReferences": [{"uid": "ks-uid", "controller": True}],
        },
        "spec": {"nodeName": "node"},
        "status": status,
    }


WAITING = [
    {"name": CONTAINER, "ready": False, "state": {"waiting": {"reason": "ContainerCreating"}}}
]
RUNNING = [{"name": CONTAINER, "ready": False, "state": {"running": {"startedAt": "t"}}}]
PENDING = pod("1", phase="Pending", containerStatuses=WAITING)


def heard(answered: tuple[str, str] | None = None) -> Heard:
    h = Heard(lambda ns, name, uid: answered)
    h.wrote(session(), PENDING)
    return h


def later(**changes: Any) -> dict[str, Any]:
    """PENDING as the kubelet writes it next: a new version with `changes` to its status."""
    p = copy.deepcopy(PENDING)
    p["metadata"]["resourceVersion"] = "2"
    p["status"].update(changes)
    return p


def test_its_own_write_is_not_news_and_a_child_never_written_is() -> None:
    h = heard()
    assert not h.news("ns", "s", PENDING)
    assert h.news("ns", "other", PENDING)
    h.forget("ns", "s")  # a failed reconcile: what it saw was not acted on
    assert h.news("ns", "s", PENDING)


def test_kubelet_writes_that_change_nothing_a_reconcile_acts_on_are_not_news() -> None:
    h = heard()
    quiet = later(
        hostIP="192.0.2.2",
        startTime="2026-12-05T10:00:00Z",
        conditions=[{"type": "PodReadyToStartContainers", "status": "False"}],
    )
    assert not h.news("ns", "s", quiet)


@pytest.mark.parametrize(
    "changed",
    [
        later(podIP="10.0.0.7"),  # an address: the status shows it
        later(containerStatuses=RUNNING),  # the kernel runs
        later(phase="Failed"),
        later(containerStatuses=[{**WAITING[0], "state": {"waiting": {"reason": "ErrImagePull"}}}]),
    ],
)
def test_a_change_of_what_the_session_shows_is_news(changed: dict[str, Any]) -> None:
    assert heard().news("ns", "s", changed)


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("metadata", "deletionTimestamp", "2026-12-05T10:00:01Z"),
        ("metadata", "uid", "another-pod"),
        ("metadata", "labels", {"mcpforge.dev/session": "s", "x": "y"}),
        ("metadata", "annotations", {"mcpforge.dev/template-hash": "h2"}),
        ("metadata", "ownerReferences", []),
        ("spec", "nodeName", "another-node"),
    ],
)
def test_a_change_of_which_pod_it_is_is_news(where: str, key: str, value: Any) -> None:
    changed = later()
    changed[where][key] = value
    assert heard().news("ns", "s", changed)


def test_an_answer_heard_since_makes_a_later_version_news() -> None:
    """The operator's own kernel_info answered: Ready, whatever the kubelet says yet."""
    answers: dict[str | None, tuple[str, str]] = {}
    h = Heard(lambda ns, name, uid: answers.get(uid))
    h.wrote(session(), PENDING)
    assert not h.news("ns", "s", later())
    answers["pod-uid"] = ("2026-12-05T10:00:02Z", "10.0.0.7")
    assert h.news("ns", "s", later())


def test_a_pod_that_went_back_while_a_reconcile_read_it_is_looked_at_again() -> None:
    """A -> B -> A: the reconcile read B; the second A, weighed against the first while
    it ran, was no news then, and is once the reconcile has recorded B."""
    h = heard()
    b = later(containerStatuses=[{**WAITING[0], "state": {"waiting": {"reason": "ErrImagePull"}}}])
    assert h.news("ns", "s", b)
    back = later()
    back["metadata"]["resourceVersion"] = "3"
    assert not h.news("ns", "s", back)
    assert not h.missed("ns", "s")
    h.wrote(session(), b)  # the reconcile that read B ends
    assert h.missed("ns", "s")


def test_a_lease_is_news_at_every_version_but_its_own() -> None:
    h = Heard(lambda ns, name, uid: None)
    lease = {"kind": "Lease", "metadata": {"name": "ks-s", "resourceVersion": "5"}}
    h.wrote(session(), lease)
    assert not h.news("ns", "s", lease)
    assert h.news("ns", "s", {**lease, "metadata": {"name": "ks-s", "resourceVersion": "6"}})


def test_a_reconcile_that_stopped_the_kernel_misses_nothing() -> None:
    """It deleted the pod and acted on no pod: the events of the pod on its way out are
    news (each looked at once as it comes), never `missed` after each reconcile, which
    would reconcile a suspended session again and again."""
    h = heard()
    leaving = later()
    leaving["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:05Z"
    assert h.news("ns", "s", leaving)
    h.acted(session(), None)
    assert not h.missed("ns", "s")
    assert h.news("ns", "s", leaving)
    h.gone("ns", "s", leaving)
    assert not h.missed("ns", "s")


def test_another_pods_event_is_news_when_it_comes_and_never_missed() -> None:
    h = heard()
    other = later()
    other["metadata"]["uid"] = "a-replacement"
    assert h.news("ns", "s", other)
    h.acted(session(), PENDING)  # a reconcile that read the first pod ends
    assert not h.missed("ns", "s")
