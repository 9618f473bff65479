"""A fresh session's own kernel pod, made beside its children on the real test cluster
(control/early.py): it does not wait for the Service (nor the Lease), and it does wait for
its NetworkPolicy. Each held back by a leftover of an earlier session of that name that a
finalizer of the test's keeps on its way out."""

from __future__ import annotations

import asyncio
from typing import Any

from mcp_forge.clients.kube import Kube
from mcp_forge.control.render import LABEL_SESSION

from .harness import HOLD, eventually, failed_tries, phase, ready, session_body


def leftover(kind: str, name: str, ns: str) -> dict[str, Any]:
    """A child of an earlier session of that name, held by a finalizer."""
    meta = {"name": name, "namespace": ns, "finalizers": [HOLD]}
    if kind == "Service":
        spec: dict[str, Any] = {"selector": {LABEL_SESSION: "gone"}, "ports": [{"port": 1}]}
        return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": spec}
    spec = {"podSelector": {"matchLabels": {LABEL_SESSION: "gone"}}, "policyTypes": ["Ingress"]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": kind, "metadata": meta, "spec": spec}


async def let_go(kube: Kube, kind: str, ns: str, name: str) -> None:
    await asyncio.to_thread(kube.patch, kind, ns, name, {"metadata": {"finalizers": None}})


async def test_a_fresh_sessions_pod_is_made_before_its_service_is(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """The session's Service cannot be made while the earlier one is being removed: its
    kernel pod is made anyway, and every try after takes it up; once the Service can be
    made the session is Ready on that same pod."""
    await asyncio.to_thread(kube.create, leftover("Service", "ks-eps", ns))
    try:
        await asyncio.to_thread(kube.create, session_body("eps", ns, image=images["minimal"]))
        pod = await eventually(
            kube, "Pod", ns, "ks-eps", lambda p: p is not None, timeout=30, what="made"
        )
        assert pod is not None
        await failed_tries(kube, ns, "eps", 2, timeout=60)
        obj = await asyncio.to_thread(kube.get, "KernelSession", ns, "eps")
        assert phase(obj) != "Ready", obj
        again = await asyncio.to_thread(kube.get, "Pod", ns, "ks-eps")
        assert again is not None and again["metadata"]["uid"] == pod["metadata"]["uid"]
    finally:
        await let_go(kube, "Service", ns, "ks-eps")
    obj = await ready(kube, ns, "eps")
    assert obj["status"]["kernelId"] == pod["metadata"]["uid"], obj["status"]


async def test_a_fresh_sessions_pod_waits_for_its_network_policy(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """No kernel runs before its own NetworkPolicy exists: while the earlier one is being
    removed, tries fail and no pod is made; then the session starts."""
    await asyncio.to_thread(kube.create, leftover("NetworkPolicy", "ks-zeta", ns))
    try:
        await asyncio.to_thread(kube.create, session_body("zeta", ns, image=images["minimal"]))
        await failed_tries(kube, ns, "zeta", 2, timeout=60)
        assert await asyncio.to_thread(kube.get, "Pod", ns, "ks-zeta") is None
    finally:
        await let_go(kube, "NetworkPolicy", ns, "ks-zeta")
    obj = await ready(kube, ns, "zeta")
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, "ks-zeta")
    assert (
        policy is not None
        and policy["metadata"]["ownerReferences"][0]["uid"] == (obj["metadata"]["uid"])
    )
