"""A session's first reconcile starts from its ADDED event's body (Reconciler.arrived): a
real Reconciler whose API is never asked. The cluster side, that the session is not read
before its claim: tests/kube/test_claims.py."""

from __future__ import annotations

from typing import Any

import kubernetes

from mcp_forge.clients.kube import Kube
from mcp_forge.control.reconciler import Reconciler
from mcp_forge.settings import Settings


def body(uid: str = "u1", status: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s", "namespace": "a", "uid": uid, "resourceVersion": "1"},
        "spec": {"image": "x"},
    }
    if status is not None:
        out["status"] = status
    return out


def reconciler() -> Reconciler:
    return Reconciler(Kube(kubernetes.client.Configuration()), Settings.from_env())


def test_a_just_made_session_is_kept_for_its_first_reconcile_as_a_copy() -> None:
    r = reconciler()
    event = body()
    r.arrived("a", "s", "ADDED", event)
    event["spec"]["image"] = "changed"  # kopf's body is a view a later event replaces
    assert r._made[("a", "s")]["spec"]["image"] == "x"
    r.close()


def test_any_later_event_or_one_with_a_status_is_not_kept() -> None:
    r = reconciler()
    r.arrived("a", "s", "ADDED", body())
    r.arrived("a", "s", "MODIFIED", body())
    assert ("a", "s") not in r._made
    r.arrived("a", "s", None, body())  # found at start-up: read, as ever
    r.arrived("a", "s", "ADDED", body(status={"phase": "Ready", "observedGeneration": 1}))
    assert ("a", "s") not in r._made
    r.close()


def test_not_kept_once_a_reconcile_has_read_that_session() -> None:
    """A reconcile woken by an earlier session's child read the new session of that name
    and may have written its status: its ADDED body, coming later, is older than that.
    The session's DELETED event lets the next one of that name be kept again."""
    r = reconciler()
    r._read[("a", "s")] = "u1"  # as _reconcile notes what it read
    r.arrived("a", "s", "ADDED", body())
    assert ("a", "s") not in r._made
    r.forget("a", "s")  # a forget alone (the reconcile found it gone) does not clear it
    r.arrived("a", "s", "ADDED", body())
    assert ("a", "s") not in r._made
    r.arrived("a", "s", "DELETED", body())
    r.arrived("a", "s", "ADDED", body(uid="u2"))
    assert r._made[("a", "s")]["metadata"]["uid"] == "u2"
    r.close()
