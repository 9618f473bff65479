"""What the pool and claim tests share: a pool's kernels, its counts, when it is filled."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube

from .conftest import KubeAPI
from .harness import eventually

POOL = ksp.KIND
FILL = 120.0  # a pool of two to ready, on a busy 2-core machine


async def members(kube: Kube, ns: str, pool: str) -> list[dict[str, Any]]:
    listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={ksp.LABEL_POOL: pool})
    return [p for p in listed.get("items") or [] if not p["metadata"].get("deletionTimestamp")]


async def filled(
    kube: Kube, ns: str, pool: str, size: int, *, claimed: int = 0, hash_: str = ""
) -> dict[str, Any]:
    """The pool once its status counts `size` ready kernels (of template `hash_`) and
    `claimed` claimed ones."""

    def full(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (
            status.get("ready") == size
            and status.get("claimed", 0) == claimed
            and (not hash_ or status.get("templateHash") == hash_)
        )

    obj = await eventually(kube, POOL, ns, pool, full, timeout=FILL, what=f"{size} ready")
    assert obj is not None
    return obj


async def counted(kube: Kube, ns: str, pool: str, claims: int, misses: int) -> dict[str, Any]:
    """The pool once its status counts exactly these claims and misses (written after
    the claims, off their path)."""

    def right(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("claims", 0), status.get("misses", 0)) == (claims, misses)

    what = f"{claims} claims and {misses} misses counted"
    obj = await eventually(kube, POOL, ns, pool, right, timeout=30, what=what)
    assert obj is not None
    return obj


async def restarts(kube: Kube, ns: str, pod: str) -> int:
    obj = await asyncio.to_thread(kube.get, "Pod", ns, pod)
    assert obj is not None, f"pod {pod} is gone"
    return sum(int(c.get("restartCount", 0)) for c in obj["status"]["containerStatuses"])


def served_by(kube_api: KubeAPI, ns: str, service: str, pod: str, timeout: int = 30) -> bool:
    """Whether the Service's endpoints come to be `pod` within `timeout` (a watch)."""
    core = kubernetes.client.CoreV1Api(kube_api.api_client())
    stream = kubernetes.watch.Watch().stream(
        core.list_namespaced_endpoints,
        ns,
        field_selector=f"metadata.name={service}",
        timeout_seconds=timeout,
    )
    for event in stream:
        subsets = event["object"].subsets or []
        if any(
            a.target_ref and a.target_ref.name == pod for s in subsets for a in s.addresses or []
        ):
            return True
    return False
