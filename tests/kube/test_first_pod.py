"""A fresh session's own kernel pod on the real test cluster waits for its NetworkPolicy,
held back by a leftover of an earlier session of that name that a finalizer of the test's
keeps on its way out. (Made beside the Service instead of after it, it started no sooner:
the Service's create and the policy's took alike, December 6, 7 cold sessions each way.)"""

from __future__ import annotations

import asyncio
from typing import Any

from mcp_forge.clients.kube import Kube
from mcp_forge.control.render import LABEL_SESSION

from .harness import HOLD, failed_tries, ready, session_body


def leftover_policy(name: str, ns: str) -> dict[str, Any]:
    """The NetworkPolicy of an earlier session of that name, held by a finalizer."""
    meta = {"name": name, "namespace": ns, "finalizers": [HOLD]}
    spec = {"podSelector": {"matchLabels": {LABEL_SESSION: "gone"}}, "policyTypes": ["Ingress"]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": spec}  # fmt: skip


async def test_a_fresh_sessions_pod_waits_for_its_network_policy(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """No kernel runs before its own NetworkPolicy exists: while the earlier one is being
    removed, tries fail and no pod is made; then the session starts."""
    await asyncio.to_thread(kube.create, leftover_policy("ks-zeta", ns))
    try:
        await asyncio.to_thread(kube.create, session_body("zeta", ns, image=images["minimal"]))
        await failed_tries(kube, ns, "zeta", 2, timeout=60)
        assert await asyncio.to_thread(kube.get, "Pod", ns, "ks-zeta") is None
    finally:
        let_go = {"metadata": {"finalizers": None}}
        await asyncio.to_thread(kube.patch, "NetworkPolicy", ns, "ks-zeta", let_go)
    obj = await ready(kube, ns, "zeta")
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, "ks-zeta")
    assert (
        policy is not None
        and policy["metadata"]["ownerReferences"][0]["uid"] == (obj["metadata"]["uid"])
    )
