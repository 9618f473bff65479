"""The operator, through the real kopf runtime and real watch streams, against the test API.

There is no kubelet here: where a test needs a kernel's pod to run or die, it writes the
pod's status as a kubelet would. (tests/kube/test_cluster_e2e.py runs real kernels.)
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mcp_forge.kube import BUSY_PREFIX, RESTART, Kube

from .harness import (
    KS,
    condition,
    eventually,
    phase,
    running_operator,
    running_status,
    session_body,
    terminated_status,
)

NS = "default"


@pytest.fixture
async def operator(kube: Kube) -> AsyncIterator[Any]:
    async with running_operator(kube) as op:
        yield op


async def create(kube: Kube, name: str, **spec: Any) -> dict[str, Any]:
    return await asyncio.to_thread(kube.create, session_body(name, NS, **spec))


async def play_pod(kube: Kube, name: str, status: dict[str, Any]) -> None:
    await asyncio.to_thread(kube.patch, "Pod", NS, f"ks-{name}", {"status": status}, status=True)


async def ready(kube: Kube, name: str) -> dict[str, Any]:
    """Create-to-Ready as a kubelet would make it: the pod appears, then runs."""
    await eventually(kube, "Pod", NS, f"ks-{name}", lambda p: p is not None, what="pod made")
    await play_pod(kube, name, running_status())
    obj = await eventually(
        kube, KS, NS, name, lambda o: condition(o, "Ready").get("status") == "True", what="Ready"
    )
    assert obj is not None
    return obj


def key_in(secret: dict[str, Any]) -> str:
    data = secret.get("data") or {}
    text = (
        base64.b64decode(data["connection.json"]).decode()
        if "connection.json" in data
        else secret["stringData"]["connection.json"]
    )
    key: str = json.loads(text)["key"]
    return key


async def test_create_makes_every_child_owned_and_ready_follows_the_pod(
    kube: Kube, operator: Any
) -> None:
    made = await create(kube, "alpha", resources={"memory": "256Mi"})
    uid = made["metadata"]["uid"]
    pod = await eventually(kube, "Pod", NS, "ks-alpha", lambda p: p is not None, what="pod")
    assert pod is not None
    for kind, name in [
        ("Secret", "ks-alpha-conn"),
        ("Service", "ks-alpha"),
        ("NetworkPolicy", "ks-alpha"),
        ("Lease", "ks-alpha"),
        ("Pod", "ks-alpha"),
    ]:
        child = await asyncio.to_thread(kube.get, kind, NS, name)
        assert child is not None, f"{kind} {name} missing"
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == KS and owner["controller"] is True
    kernel = pod["spec"]["containers"][0]
    assert kernel["resources"]["limits"]["memory"] == "256Mi"
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "ks-alpha-conn"
    service = await asyncio.to_thread(kube.get, "Service", NS, "ks-alpha")
    assert service is not None
    ports = sorted(p["port"] for p in service["spec"]["ports"])
    assert ports == [5555, 5556, 5557, 5558, 5559, 5560]  # the channels, code mode's bridge
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", NS, "ks-alpha")
    assert policy is not None and policy["spec"]["egress"] == []

    starting = await eventually(kube, KS, NS, "alpha", lambda o: phase(o) == "Starting")
    assert starting is not None
    assert condition(starting, "Ready")["status"] == "False"

    obj = await ready(kube, "alpha")
    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["podIP"] == "10.88.0.7" and status["phase"] == "Ready"
    assert status["connection"]["host"] == "ks-alpha.default.svc"
    assert status["connection"]["secretName"] == "ks-alpha-conn"
    assert status["connection"]["generation"] == 1
    assert status["kernelId"] == pod["metadata"]["uid"]
    secret = await asyncio.to_thread(kube.get, "Secret", NS, "ks-alpha-conn")
    assert secret is not None
    assert key_in(secret) not in json.dumps(obj), "the key must never be in the status"


async def test_a_dead_kernel_is_recorded_and_recreated(kube: Kube, operator: Any) -> None:
    await create(kube, "beta", resources={"memory": "128Mi"})
    first = await ready(kube, "beta")
    secret = await asyncio.to_thread(kube.get, "Secret", NS, "ks-beta-conn")
    assert secret is not None
    await play_pod(kube, "beta", terminated_status(137, "OOMKilled"))

    def recreated(o: dict[str, Any] | None) -> bool:
        return (o or {}).get("status", {}).get("kernelId") not in (
            None,
            first["status"]["kernelId"],
        )

    obj = await eventually(kube, KS, NS, "beta", recreated, what="a new pod")
    assert obj is not None
    last = obj["status"]["lastTermination"]
    assert last["reason"] == "OOMKilled" and last["exitCode"] == 137
    assert "out of memory (limit 128Mi)" in last["message"]
    assert obj["status"]["restarts"] == 1
    assert obj["status"]["connection"]["generation"] == 2
    again = await asyncio.to_thread(kube.get, "Secret", NS, "ks-beta-conn")
    assert again is not None and key_in(again) == key_in(secret), "the key is kept"
    await play_pod(kube, "beta", running_status("10.88.0.8"))
    obj = await eventually(kube, KS, NS, "beta", lambda o: phase(o) == "Ready")
    assert obj is not None and obj["status"]["podIP"] == "10.88.0.8"


async def test_restart_policy_never_leaves_it_failed_with_the_pod_kept(
    kube: Kube, operator: Any
) -> None:
    await create(kube, "gamma", restartPolicy="Never")
    first = await ready(kube, "gamma")
    await play_pod(kube, "gamma", terminated_status(1, "Error"))
    obj = await eventually(kube, KS, NS, "gamma", lambda o: phase(o) == "Failed")
    assert obj is not None
    assert obj["status"]["lastTermination"]["message"] == "the kernel exited with code 1"
    assert condition(obj, "Ready")["reason"] == "Error"
    pod = await asyncio.to_thread(kube.get, "Pod", NS, "ks-gamma")
    assert pod is not None and pod["metadata"]["uid"] == first["status"]["kernelId"]


async def test_spec_update_waits_for_a_restart_by_default(kube: Kube, operator: Any) -> None:
    await create(kube, "delta")
    first = await ready(kube, "delta")
    await asyncio.to_thread(
        kube.patch, KS, NS, "delta", {"spec": {"resources": {"memory": "512Mi"}}}
    )
    obj = await eventually(
        kube,
        KS,
        NS,
        "delta",
        lambda o: condition(o, "UpdatePending").get("status") == "True",
        what="UpdatePending",
    )
    assert obj is not None
    assert condition(obj, "UpdatePending")["reason"] == "WaitingForRestart"
    assert obj["status"]["kernelId"] == first["status"]["kernelId"], "the busy kernel stays"
    assert obj["status"]["phase"] == "Ready"
    # A requested restart (what a gateway asks through the Lease) applies it.
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        NS,
        "ks-delta",
        {"metadata": {"annotations": {RESTART: first["status"]["kernelId"]}}},
    )
    pod = await eventually(
        kube,
        "Pod",
        NS,
        "ks-delta",
        lambda p: p is not None and p["metadata"]["uid"] != first["status"]["kernelId"],
        what="a new pod",
    )
    assert pod is not None
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "512Mi"
    await play_pod(kube, "delta", running_status())
    obj = await eventually(
        kube,
        KS,
        NS,
        "delta",
        lambda o: phase(o) == "Ready" and condition(o, "UpdatePending").get("status") == "False",
    )
    assert obj is not None and obj["status"]["connection"]["generation"] == 2


async def test_recreate_strategy_waits_while_the_kernel_is_busy(kube: Kube, operator: Any) -> None:
    await create(kube, "eps", updateStrategy="Recreate")
    first = await ready(kube, "eps")
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    far = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 300))
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        NS,
        "ks-eps",
        {
            "metadata": {"annotations": {BUSY_PREFIX + "gw-1": far, BUSY_PREFIX + "gw-2": None}},
            "spec": {"renewTime": now, "holderIdentity": "gw-1"},
        },
    )
    await asyncio.to_thread(kube.patch, KS, NS, "eps", {"spec": {"env": [{"name": "A"}]}})
    obj = await eventually(
        kube, KS, NS, "eps", lambda o: condition(o, "UpdatePending").get("reason") == "KernelBusy"
    )
    assert obj is not None and obj["status"]["kernelId"] == first["status"]["kernelId"]
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        NS,
        "ks-eps",
        {"metadata": {"annotations": {BUSY_PREFIX + "gw-1": None}}},
    )
    pod = await eventually(
        kube,
        "Pod",
        NS,
        "ks-eps",
        lambda p: p is not None and p["metadata"]["uid"] != first["status"]["kernelId"],
        what="the pod replaced once idle",
    )
    assert pod is not None
    assert {"name": "A", "value": ""} in pod["spec"]["containers"][0]["env"]


async def test_idle_delete_culls_and_activity_postpones_it(kube: Kube, operator: Any) -> None:
    await create(kube, "idle", idleTimeout="3s")
    await ready(kube, "idle")
    renewed = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(renewed))
    await asyncio.to_thread(
        kube.patch, "Lease", NS, "ks-idle", {"spec": {"renewTime": stamp, "holderIdentity": "t"}}
    )
    await eventually(kube, KS, NS, "idle", lambda o: o is None, timeout=20, what="culled")
    culled = time.time()
    # Activity at `renewed` moved the deadline: not culled before renewed + 3s.
    assert culled >= int(renewed) + 3 - 0.5, culled - renewed
    for kind in ("Pod", "Secret", "Service", "Lease"):
        gone = await eventually(
            kube, kind, NS, "ks-idle" + ("-conn" if kind == "Secret" else ""), lambda o: o is None
        )
        assert gone is None


async def test_idle_suspend_keeps_the_session_and_activity_resumes_it(
    kube: Kube, operator: Any
) -> None:
    await create(kube, "nap", idleTimeout="2s", idleAction="Suspend")
    first = await ready(kube, "nap")
    obj = await eventually(kube, KS, NS, "nap", lambda o: phase(o) == "Suspended", timeout=20)
    assert obj is not None and obj["status"]["reason"] == "Idle"
    assert condition(obj, "Ready")["status"] == "False"
    await eventually(kube, "Pod", NS, "ks-nap", lambda p: p is None, what="pod removed")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    await asyncio.to_thread(kube.patch, "Lease", NS, "ks-nap", {"spec": {"renewTime": stamp}})
    pod = await eventually(kube, "Pod", NS, "ks-nap", lambda p: p is not None, what="resumed")
    assert pod is not None and pod["metadata"]["uid"] != first["status"]["kernelId"]


async def test_operating_mode_suspended_and_back(kube: Kube, operator: Any) -> None:
    await create(kube, "mode")
    await ready(kube, "mode")
    await asyncio.to_thread(kube.patch, KS, NS, "mode", {"spec": {"operatingMode": "Suspended"}})
    obj = await eventually(kube, KS, NS, "mode", lambda o: phase(o) == "Suspended")
    assert obj is not None and obj["status"]["reason"] == "UserRequested"
    await eventually(kube, "Pod", NS, "ks-mode", lambda p: p is None)
    await asyncio.to_thread(kube.patch, KS, NS, "mode", {"spec": {"operatingMode": "Running"}})
    await eventually(kube, "Pod", NS, "ks-mode", lambda p: p is not None, what="pod again")


async def test_max_lifetime_expires_the_session(kube: Kube, operator: Any) -> None:
    await create(kube, "mortal", maxLifetime="3s")
    obj = await ready(kube, "mortal")
    assert obj["status"]["expiresAt"]
    obj = await eventually(kube, KS, NS, "mortal", lambda o: phase(o) == "Expired", timeout=20)
    assert obj is not None and condition(obj, "Ready")["reason"] == "Expired"
    await eventually(kube, "Pod", NS, "ks-mortal", lambda p: p is None)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"resources": {"memory": "10Mi"}}, "spec.resources.memory"),
        ({"resources": {"cpu": "10m"}}, "spec.resources.cpu"),
        ({"env": [{"name": "MCPFORGE_X"}]}, "spec.env[0].name"),
        ({"idleTimeout": "soon"}, "spec.idleTimeout"),
        ({"restartPolicy": "Sometimes"}, "spec.restartPolicy"),
        ({"nonsense": 1}, "spec"),
        ({"maxLifetime": "1d"}, "spec.maxLifetime"),
    ],
)
async def test_an_invalid_spec_is_a_permanent_error_with_no_children(
    kube: Kube, operator: Any, spec: dict[str, Any], field: str
) -> None:
    await create(kube, "bad", **spec)
    obj = await eventually(kube, KS, NS, "bad", lambda o: phase(o) == "Failed")
    assert obj is not None
    ready_cond = condition(obj, "Ready")
    assert ready_cond["reason"] == "InvalidSpec"
    assert field in ready_cond["message"], ready_cond["message"]
    for kind, name in [("Pod", "ks-bad"), ("Secret", "ks-bad-conn"), ("Service", "ks-bad")]:
        assert await asyncio.to_thread(kube.get, kind, NS, name) is None


async def test_delete_removes_every_child(kube: Kube, operator: Any) -> None:
    await create(kube, "gone")
    await ready(kube, "gone")
    await asyncio.to_thread(kube.delete, KS, NS, "gone")
    for kind, name in [
        ("Pod", "ks-gone"),
        ("Secret", "ks-gone-conn"),
        ("Service", "ks-gone"),
        ("NetworkPolicy", "ks-gone"),
        ("Lease", "ks-gone"),
    ]:
        assert await eventually(kube, kind, NS, name, lambda o: o is None, what="gone") is None


async def test_an_operator_restart_resumes_without_duplicates(kube_api: Any, kube: Kube) -> None:
    async with running_operator(kube):
        await create(kube, "phoenix")
        before = await ready(kube, "phoenix")
    secret = await asyncio.to_thread(kube.get, "Secret", NS, "ks-phoenix-conn")
    assert secret is not None
    emulator = kube_api.emulator
    posts_before = len(emulator["post", emulator.resource("v1/pods")]) if emulator else None
    async with running_operator(kube):
        # Resumed: a change it must see proves it is watching again.
        await play_pod(kube, "phoenix", running_status("10.88.0.9"))
        obj = await eventually(
            kube, KS, NS, "phoenix", lambda o: (o or {})["status"].get("podIP") == "10.88.0.9"
        )
    assert obj is not None
    assert obj["status"]["kernelId"] == before["status"]["kernelId"]
    assert obj["status"]["connection"]["generation"] == 1
    assert obj["status"]["restarts"] == 0
    after = await asyncio.to_thread(kube.get, "Secret", NS, "ks-phoenix-conn")
    assert after is not None and key_in(after) == key_in(secret)
    if emulator is not None:
        assert len(emulator["post", emulator.resource("v1/pods")]) == posts_before


async def test_a_new_session_never_takes_over_an_earlier_ones_children(
    kube: Kube, operator: Any
) -> None:
    # An earlier "again" whose children the garbage collector has not removed yet: they
    # name an owner that still exists (here a stand-in), so they are not collected.
    ghost = await asyncio.to_thread(
        kube.create,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ghost", "namespace": NS}},
    )
    owner = [
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": KS,
            "name": "again",
            "uid": ghost["metadata"]["uid"],
            "controller": True,
        }
    ]
    stale_key = "0" * 64
    await asyncio.to_thread(
        kube.create,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "ks-again-conn", "namespace": NS, "ownerReferences": owner},
            "stringData": {"connection.json": json.dumps({"key": stale_key})},
        },
    )
    made = await create(kube, "again")
    obj = await ready(kube, "again")
    secret = await asyncio.to_thread(kube.get, "Secret", NS, "ks-again-conn")
    assert secret is not None and key_in(secret) != stale_key, "the old key is not reused"
    (ref,) = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == made["metadata"]["uid"]
    assert obj["status"]["connection"]["generation"] == 1


async def test_a_kernel_that_keeps_dying_at_start_is_restarted_with_backoff(
    kube: Kube, operator: Any
) -> None:
    await create(kube, "loop")
    first = await ready(kube, "loop")
    died = terminated_status(1, "Error")
    died["containerStatuses"][0]["state"]["terminated"].update(
        startedAt="2026-11-29T20:00:00Z", finishedAt="2026-11-29T20:00:01Z"
    )
    await play_pod(kube, "loop", died)
    obj = await eventually(
        kube,
        KS,
        NS,
        "loop",
        lambda o: (o or {}).get("status", {}).get("reason") == "CrashLoopBackOff",
    )
    assert obj is not None
    assert obj["status"]["lastTermination"]["quickDeaths"] == 1
    assert "next start in" in obj["status"]["message"]
    pod = await asyncio.to_thread(kube.get, "Pod", NS, "ks-loop")
    assert pod is not None and pod["metadata"]["uid"] == first["status"]["kernelId"], "not yet"
    # After the backoff (5 s for a first quick death) a new pod comes.
    pod = await eventually(
        kube,
        "Pod",
        NS,
        "ks-loop",
        lambda p: p is not None and p["metadata"]["uid"] != first["status"]["kernelId"],
        timeout=20,
        what="recreated after the backoff",
    )
    assert pod is not None


async def test_a_pod_that_never_ran_takes_a_fixed_spec_at_once(kube: Kube, operator: Any) -> None:
    await create(kube, "typo", image="localhost/no-such-image:1")
    pod = await eventually(kube, "Pod", NS, "ks-typo", lambda p: p is not None)
    assert pod is not None
    waiting = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "kernel",
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}},
            }
        ],
    }
    await play_pod(kube, "typo", waiting)
    await eventually(kube, KS, NS, "typo", lambda o: phase(o) == "Failed")
    await asyncio.to_thread(
        kube.patch, KS, NS, "typo", {"spec": {"image": "localhost/mcp-forge-kernel:0.1.0"}}
    )
    fixed = await eventually(
        kube,
        "Pod",
        NS,
        "ks-typo",
        lambda p: p is not None and p["metadata"]["uid"] != pod["metadata"]["uid"],
        what="replaced although updateStrategy is OnRestart",
    )
    assert fixed is not None
    assert fixed["spec"]["containers"][0]["image"] == "localhost/mcp-forge-kernel:0.1.0"
