"""Warm pools on the real test cluster: the operator (real kopf) fills KernelSessionPools
with real kernel pods on the real kubelet, and sessions claim them: a claimed pod is never
restarted or deleted by its pool, a pool at its maximum or of a missing image says so.
What a claim itself must never do is test_claims.py's.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kstatus import kstatus
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.poolkeeper import PoolKeeper
from mcp_forge.control.render import LABEL_SESSION
from mcp_forge.errors import ApiError
from mcp_forge.settings import Settings

from .conftest import KubeAPI
from .harness import (
    KS,
    SMALL,
    condition,
    events_of,
    eventually,
    kernel,
    key_in,
    phase,
    pod_ready,
    pool_body,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
)
from .pooling import FILL, POOL, counted, filled, members, restarts, served_by


async def test_a_pool_fills_with_kernels_each_with_its_own_key_and_a_claim_moves_one(
    kube: Kube, kube_api: KubeAPI, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("warm", ns, 2, images["minimal"]))
    pool = await filled(kube, ns, "warm", 2)
    assert condition(pool, "Ready")["status"] == "True"
    # `kubectl wait` reads the same condition (returns at once: it holds already).
    kube_api.kubectl("wait", "--for=condition=Ready", "ksp/warm", "--timeout=10s")
    pods = await members(kube, ns, "warm")
    assert len(pods) == 2 and all(pod_ready(p) for p in pods)
    # What `kubectl describe ksp` shows of an ordinary life: each kernel made, then filled.
    told = await events_of(kube, ns, "warm", {"Started", "Filled"})
    made = {e["message"] for e in told if e["reason"] == "Started"}
    assert made == {f"kernel {p['metadata']['name']} made" for p in pods}, told
    assert all(e["type"] == "Normal" for e in told), told
    keys = set()
    for pod in pods:
        meta = pod["metadata"]
        assert meta["ownerReferences"][0]["kind"] == POOL
        secret = await asyncio.to_thread(kube.get, "Secret", ns, f"{meta['name']}-conn")
        assert secret is not None
        assert secret["metadata"]["ownerReferences"][0]["uid"] == meta["uid"], "the pod owns it"
        keys.add(key_in(secret))
    assert len(keys) == 2, "never one key shared by two kernels"

    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    await asyncio.to_thread(
        kube.create,
        session_body(
            "alpha", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "warm"}
        ),
    )
    obj = await ready(kube, ns, "alpha")
    status = obj["status"]
    assert status["podName"] in before, status
    assert before[status["podName"]] == status["kernelId"], "the same pod: no new one"
    warm = condition(obj, ksp.WARM_START)
    assert (warm["status"], warm["reason"]) == ("True", ksp.CLAIMED), warm
    assert status["connection"]["secretName"] == f"{status['podName']}-conn"
    own = await asyncio.to_thread(kube.get, "Secret", ns, "ks-alpha-conn")
    assert own is None, "a claimed kernel's Secret came with it: the session makes none"
    claimed = await asyncio.to_thread(kube.get, "Pod", ns, status["podName"])
    assert claimed is not None
    assert claimed["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert ksp.LABEL_POOL not in claimed["metadata"]["labels"]
    assert await restarts(kube, ns, status["podName"]) == 0, "no restart on claim"
    async with kernel(kube, ns, "alpha") as conn:
        assert (await run_in_kernel(conn, "print(6 * 7)")).strip() == "42"
    # The session's Service now selects the claimed pod (kube-proxy routes to it).
    assert await asyncio.to_thread(served_by, kube_api, ns, "ks-alpha", status["podName"])

    # The pool refills; then its count says one is claimed, and one claim was served.
    await filled(kube, ns, "warm", 2, claimed=1)
    await counted(kube, ns, "warm", claims=1, misses=0)
    assert status["podName"] not in {p["metadata"]["name"] for p in await members(kube, ns, "warm")}

    # Deleting the session takes the claimed pod and its Secret with it (garbage collector).
    await asyncio.to_thread(kube.delete, KS, ns, "alpha")
    await eventually(
        kube, "Pod", ns, status["podName"], lambda p: p is None, timeout=60, what="pod gone"
    )
    await eventually(
        kube, "Secret", ns, f"{status['podName']}-conn", lambda s: s is None, what="Secret gone"
    )
    for kind in ("Service", "NetworkPolicy", "Lease"):
        await eventually(kube, kind, ns, "ks-alpha", lambda o: o is None, what=f"{kind} gone")
    left = await asyncio.to_thread(kube.list, "Secret", ns, labels={LABEL_SESSION: "alpha"})
    assert not left["items"], [s["metadata"]["name"] for s in left["items"]]


async def test_a_pool_at_its_maximum_keeps_fewer_ready_and_refills_when_a_claim_goes(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    bad = pool_body("capped", ns, 2, images["minimal"])
    bad["spec"]["maxSize"] = 1
    with pytest.raises(ApiError, match=r"spec\.maxSize must be at least spec\.size"):
        await asyncio.to_thread(kube.create, bad)  # the API server's own check (CEL)
    body = pool_body("capped", ns, 1, images["minimal"])
    body["spec"]["maxSize"] = 2
    await asyncio.to_thread(kube.create, body)
    await filled(kube, ns, "capped", 1)

    async def claim(name: str) -> dict[str, Any]:
        spec = {"image": images["minimal"], "resources": SMALL, "poolRef": {"name": "capped"}}
        await asyncio.to_thread(kube.create, session_body(name, ns, **spec))
        return await ready(kube, ns, name)

    assert condition(await claim("first"), ksp.WARM_START)["reason"] == ksp.CLAIMED
    await filled(kube, ns, "capped", 1, claimed=1)  # 1 claimed + 1 ready: the maximum
    assert condition(await claim("second"), ksp.WARM_START)["reason"] == ksp.CLAIMED
    pool = await filled(kube, ns, "capped", 0, claimed=2)
    at_max = condition(pool, "Ready")
    assert (at_max["status"], at_max["reason"]) == ("True", ksp.AT_MAXIMUM)
    assert "at its maximum of 2 (2 claimed)" in at_max["message"]
    assert await members(kube, ns, "capped") == []
    assert condition(await claim("third"), ksp.WARM_START)["reason"] == ksp.POOL_EXHAUSTED

    # A claimed session still counts while its kernel pod is replaced (deleted here, as a
    # restart or an update deletes it): a reconcile of the pool at once, before the
    # session has its next pod, starts nothing.
    listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={LABEL_SESSION: "second"})
    (pod,) = listed["items"]
    await asyncio.to_thread(kube.delete, "Pod", ns, pod["metadata"]["name"])
    keeper = PoolKeeper(kube, Settings.from_env())
    await asyncio.to_thread(keeper.reconcile, ns, "capped")
    assert await members(kube, ns, "capped") == []
    back = await eventually(
        kube,
        KS,
        ns,
        "second",
        lambda o: phase(o) == "Ready" and (o or {})["status"].get("restarts") == 1,
        timeout=FILL,
        what="second Ready on its next pod",
    )
    assert back is not None
    await asyncio.to_thread(keeper.reconcile, ns, "capped")
    assert await members(kube, ns, "capped") == []
    await filled(kube, ns, "capped", 0, claimed=2)

    # A claimed kernel going brings the pool back under its maximum: it refills at once
    # (the pod's deletion is heard), well before its periodic resync (60 s).
    await asyncio.to_thread(kube.delete, KS, ns, "first")

    def refilled(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("ready"), status.get("claimed")) == (1, 1)

    await eventually(kube, POOL, ns, "capped", refilled, timeout=45, what="refilled")
    # So does deleting "second", whose kernel now runs in a pod of its own (ks-second, no
    # claimed-from label to be heard going): the session's deletion is heard instead.
    await asyncio.to_thread(kube.delete, KS, ns, "second")

    def let_go(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("ready"), status.get("claimed")) == (1, 0)

    await eventually(kube, POOL, ns, "capped", let_go, timeout=45, what="second not counted")


async def test_a_session_the_pool_cannot_serve_starts_cold_and_says_why(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("small", ns, 1, images["minimal"]))
    await filled(kube, ns, "small", 1)
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        "big": (
            {
                "image": images["minimal"],
                "resources": {"memory": "1Gi"},
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "spec.resources",
        ),
        "nowhere": (
            {"image": images["minimal"], "resources": SMALL, "poolRef": {"name": "absent"}},
            ksp.POOL_NOT_FOUND,
            "absent",
        ),
        "startup": (
            {
                "image": images["minimal"],
                "resources": SMALL,
                "env": [{"name": "PYTHONHASHSEED", "value": "1"}],
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "PYTHONHASHSEED",
        ),
        "kept": (
            {
                "image": images["minimal"],
                "resources": SMALL,
                "workspace": {"persistent": True, "size": "16Mi"},
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "spec.workspace is persistent",
        ),
    }
    for name, (spec, _, _) in cases.items():
        await asyncio.to_thread(kube.create, session_body(name, ns, **spec))
    for name, (_, reason, names) in cases.items():
        obj = await ready(kube, ns, name)
        warm = condition(obj, ksp.WARM_START)
        assert (warm["status"], warm["reason"]) == ("False", reason), warm
        assert names in warm["message"] and "started cold" in warm["message"], warm
        assert obj["status"]["podName"] == f"ks-{name}", "its own pod"
    # None of them touched the pool; the three it could not serve are its misses (the
    # session naming a pool that does not exist is nobody's).
    assert len(await members(kube, ns, "small")) == 1
    await counted(kube, ns, "small", claims=0, misses=3)


async def test_a_template_change_replaces_unclaimed_kernels_only(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("roll", ns, 1, images["minimal"]))
    first = await filled(kube, ns, "roll", 1)
    await asyncio.to_thread(
        kube.create,
        session_body(
            "keep", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "roll"}
        ),
    )
    held = (await ready(kube, ns, "keep"))["status"]
    await filled(kube, ns, "roll", 1, claimed=1)
    old = {p["metadata"]["name"] for p in await members(kube, ns, "roll")}
    assert len(old) == 1, old
    await asyncio.to_thread(
        kube.patch, POOL, ns, "roll", {"spec": {"template": {"resources": {"memory": "320Mi"}}}}
    )
    changed = await eventually(
        kube,
        POOL,
        ns,
        "roll",
        lambda o: (
            (o or {}).get("status", {}).get("templateHash")
            not in (None, first["status"]["templateHash"])
        ),
        what="a new template hash",
    )
    assert changed is not None
    await filled(kube, ns, "roll", 1, claimed=1, hash_=changed["status"]["templateHash"])
    now = await members(kube, ns, "roll")
    # The old unclaimed kernel goes once the new one is ready (it may still be terminating).
    await eventually(
        kube, "Pod", ns, next(iter(old)), lambda p: p is None, timeout=60, what="old kernel gone"
    )
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["memory"] == "320Mi" for p in now)
    # The claimed one is untouched: same pod, never restarted, the session still Ready.
    pod = await asyncio.to_thread(kube.get, "Pod", ns, held["podName"])
    assert pod is not None and pod["metadata"]["uid"] == held["kernelId"]
    assert await restarts(kube, ns, held["podName"]) == 0
    assert phase(await asyncio.to_thread(kube.get, KS, ns, "keep")) == "Ready"

    # At its maximum (2: one claimed, room for one more), the next change has the old
    # kernel make way for the new one: never two unclaimed kernels alive at once.
    listed = await asyncio.to_thread(kube.list, "Pod", ns)
    rv = str(listed["metadata"]["resourceVersion"])
    alive: set[str] = set()
    most: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        nonlocal rv
        while not stop.is_set():
            for event in kube.watch("Pod", ns, resource_version=rv, timeout=5):
                meta = event.object["metadata"]
                rv = str(meta["resourceVersion"])
                if (meta.get("labels") or {}).get(ksp.LABEL_POOL) != "roll":
                    alive.discard(meta["name"])  # claimed, or not the pool's
                elif event.type == "DELETED" or meta.get("deletionTimestamp"):
                    alive.discard(meta["name"])
                else:
                    alive.add(meta["name"])
                most.append(len(alive))

    alive.update(p["metadata"]["name"] for p in await members(kube, ns, "roll"))
    watcher = asyncio.create_task(asyncio.to_thread(watch))
    try:
        patch = {"spec": {"maxSize": 2, "template": {"resources": {"memory": "300Mi"}}}}
        second = await asyncio.to_thread(kube.patch, POOL, ns, "roll", patch)
        hash_ = changed["status"]["templateHash"]
        newer = await eventually(
            kube,
            POOL,
            ns,
            "roll",
            lambda o: (o or {}).get("status", {}).get("templateHash") not in (None, hash_),
            what="a newer template hash",
        )
        assert newer is not None and second is not None
        await filled(kube, ns, "roll", 1, claimed=1, hash_=newer["status"]["templateHash"])
    finally:
        stop.set()
        await watcher
    assert most and max(most) == 1, most


async def test_deleting_a_pool_leaves_claimed_sessions_alone(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("gone", ns, 2, images["minimal"]))
    await filled(kube, ns, "gone", 2)
    await asyncio.to_thread(
        kube.create,
        session_body(
            "stay", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "gone"}
        ),
    )
    held = (await ready(kube, ns, "stay"))["status"]
    unclaimed = [p["metadata"]["name"] for p in await members(kube, ns, "gone")]
    await asyncio.to_thread(kube.delete, POOL, ns, "gone")
    for name in unclaimed:
        await eventually(kube, "Pod", ns, name, lambda p: p is None, timeout=60, what="GC'd")
    pod = await asyncio.to_thread(kube.get, "Pod", ns, held["podName"])
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")
    assert await asyncio.to_thread(kube.get, "Secret", ns, f"{held['podName']}-conn")
    async with kernel(kube, ns, "stay") as conn:
        assert (await run_in_kernel(conn, "print('alive')")).strip() == "alive"


async def test_a_pool_of_a_missing_image_backs_off_stalls_and_recovers_when_fixed(
    kube: Kube, ns: str, images: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad template makes a handful of pods, not a churn: each failure waits a backoff
    (1 s here, doubling), the third in a row makes the pool Stalled with the kubelet's
    reason (kstatus: Failed); a fixed template clears it and the pool fills."""
    monkeypatch.setenv("MCPFORGE_POOL_BACKOFF", "1")
    async with running_operator(kube):
        bad = pool_body("broken", ns, 1, "localhost/mcp-forge-no-such-image:0")
        await asyncio.to_thread(kube.create, bad)
        stalled = await eventually(
            kube, POOL, ns, "broken",
            lambda o: condition(o, "Stalled").get("status") == "True", timeout=FILL,
            what="Stalled",
        )  # fmt: skip
        assert stalled is not None
        said = condition(stalled, "Stalled")
        assert said["reason"] in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"), said
        failures = stalled["status"]["failures"]
        assert failures["count"] >= 3 and failures["reason"] == said["reason"], failures
        assert kstatus(stalled) == ["Failed"]
        made = await asyncio.to_thread(kube.list, "Event", ns, fields={"reason": "Scheduled"})
        assert len(made.get("items") or []) <= failures["count"] + 1, "a churn of pods"
        told = await events_of(kube, ns, "broken", {said["reason"], "Stalled"})
        warned = {e["reason"] for e in told if e["type"] == "Warning"}
        assert {said["reason"], "Stalled"} <= warned, told
        assert {e["reason"] for e in told if e["type"] == "Normal"} == {"Started"}, told

        fix = {"spec": {"template": {"image": images["minimal"]}}}
        await asyncio.to_thread(kube.patch, POOL, ns, "broken", fix)
        fixed = await filled(kube, ns, "broken", 1)
        assert condition(fixed, "Stalled")["status"] == "False"
        assert "failures" not in fixed["status"], fixed["status"]
        assert kstatus(fixed) == ["Current"]
