"""What the operator's watches showed of pools and their kernels (control/watched.py), as
a claim starts from it: the pool's own kernels only, one claimed, deleted or no longer read
since gone from them, copies that a later event does not change."""

from __future__ import annotations

from typing import Any

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.control.watched import Watched


def pod(name: str, ns: str = "a", pool: str | None = "p", rv: str = "1") -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": "kernel"}
    if pool is not None:
        labels[ksp.LABEL_POOL] = pool
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels,
            "resourceVersion": rv,
            "managedFields": [{"manager": "kubelet"}],
        },
        "status": {"phase": "Running"},
    }


def pool(name: str = "p", ns: str = "a") -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": ksp.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": {"size": 2},
    }


def names(shown: tuple[dict[str, Any], list[dict[str, Any]]] | None) -> list[str]:
    assert shown is not None
    return sorted(p["metadata"]["name"] for p in shown[1])


def test_a_pool_never_shown_is_read_by_the_claim() -> None:
    w = Watched()
    w.saw(None, pod("k1"))  # its kernels alone say nothing of the pool
    assert w.pool("a", "p") is None


def test_a_pool_shows_its_own_kernels_of_its_namespace() -> None:
    w = Watched()
    w.saw(None, pool())
    w.saw("ADDED", pool(ns="b"))
    for p in (
        pod("k1"),
        pod("k2"),
        pod("other", pool="q"),
        pod("k3", ns="b"),
        pod("own", pool=None),
    ):
        w.saw("ADDED", p)
    shown = w.pool("a", "p")
    assert shown is not None and shown[0]["metadata"]["namespace"] == "a"
    assert names(shown) == ["k1", "k2"]
    assert names(w.pool("b", "p")) == ["k3"]


def test_a_kernel_claimed_or_deleted_since_is_no_longer_shown() -> None:
    w = Watched()
    w.saw(None, pool())
    w.saw("ADDED", pod("k1"))
    w.saw("ADDED", pod("k2"))
    w.saw("MODIFIED", pod("k1", pool=None, rv="2"))  # claimed: the pool's label is gone
    w.saw("DELETED", pod("k2"))
    assert names(w.pool("a", "p")) == []


def test_the_latest_version_is_shown_without_managed_fields() -> None:
    w = Watched()
    w.saw(None, pool())
    w.saw("ADDED", pod("k1", rv="1"))
    w.saw("MODIFIED", pod("k1", rv="7"))
    shown = w.pool("a", "p")
    assert shown is not None
    (kernel,) = shown[1]
    assert kernel["metadata"]["resourceVersion"] == "7"
    assert "managedFields" not in kernel["metadata"]


def test_what_is_kept_is_a_copy_of_the_event() -> None:
    w = Watched()
    event = pool()
    w.saw(None, event)
    event["spec"]["size"] = 9  # kopf replaces a body's contents with a later event's
    shown = w.pool("a", "p")
    assert shown is not None and shown[0]["spec"]["size"] == 2


def test_a_pool_deleted_or_forgotten_is_read_again() -> None:
    w = Watched()
    w.saw(None, pool())
    w.saw("DELETED", pool())
    assert w.pool("a", "p") is None
    w.saw("MODIFIED", pool())
    w.forget("a", "p")
    assert w.pool("a", "p") is None


def test_a_kernel_a_read_or_a_claim_no_longer_finds_is_no_longer_shown() -> None:
    """kopf, listing again after a broken watch, tells no deletions: a kernel deleted
    meanwhile goes once the pool's kernels are read, or a claim finds it gone."""
    w = Watched()
    w.saw(None, pool())
    for name in ("k1", "k2", "k3"):
        w.saw("ADDED", pod(name))
    w.saw("ADDED", pod("q1", pool="q"))
    w.listed("a", "p", [pod("k1"), pod("k3")])
    assert names(w.pool("a", "p")) == ["k1", "k3"]
    w.gone("a", "k3")
    assert names(w.pool("a", "p")) == ["k1"]
    w.saw(None, pool("q"))
    assert names(w.pool("a", "q")) == ["q1"], "another pool's kernels stay"


def test_a_pool_its_reconcile_found_gone_goes_with_its_kernels() -> None:
    w = Watched()
    w.saw(None, pool())
    w.saw("ADDED", pod("k1"))
    w.dropped("a", "p")
    assert w.pool("a", "p") is None
    w.saw(None, pool())  # made again: none of the old kernels is offered
    assert names(w.pool("a", "p")) == []
    assert w._kernels == {}, "nothing kept for the namespace"
