"""The operator, through the real kopf runtime, on the real test cluster.

Every kernel here is a real pod on the real kubelet: kernels answer, die of real OOM kills
and real exits, and the garbage collector removes what a deleted session owned. Each test
has a namespace of its own (`kube_api.namespace`), enforcing the restricted Pod Security
Standard.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import time
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from kstatus import kstatus
from mcp_forge.clients.kube import BUSY_PREFIX, RESTART, Kube
from mcp_forge.control.render import BASELINE_POLICY, connection_secret_in

from .conftest import CRD_PATH, KubeAPI, install_crd
from .harness import (
    KS,
    condition,
    events_of,
    eventually,
    kernel,
    kernel_dies,
    key_in,
    phase,
    ready,
    running_operator,
    session_body,
)


async def create(kube: Kube, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    return await asyncio.to_thread(kube.create, session_body(name, ns, **spec))


async def new_pod(kube: Kube, ns: str, name: str, old_uid: str, **kw: Any) -> dict[str, Any]:
    pod = await eventually(
        kube,
        "Pod",
        ns,
        f"ks-{name}",
        lambda p: p is not None and p["metadata"]["uid"] != old_uid,
        what="a new pod",
        **kw,
    )
    assert pod is not None
    return pod


async def test_create_makes_every_child_owned_and_ready_follows_the_pod(
    kube: Kube, ns: str, operator: Any
) -> None:
    made = await create(kube, ns, "alpha", resources={"memory": "256Mi"})
    uid = made["metadata"]["uid"]
    pod = await eventually(kube, "Pod", ns, "ks-alpha", lambda p: p is not None, what="pod")
    assert pod is not None
    for kind, name in [
        ("Secret", "ks-alpha-conn"),
        ("Service", "ks-alpha"),
        ("NetworkPolicy", "ks-alpha"),
        ("Lease", "ks-alpha"),
        ("Pod", "ks-alpha"),
    ]:
        child = await asyncio.to_thread(kube.get, kind, ns, name)
        assert child is not None, f"{kind} {name} missing"
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == KS and owner["controller"] is True
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["memory"] == "256Mi"
    assert connection_secret_in(pod) == "ks-alpha-conn"  # a secretKeyRef: no volume
    service = await asyncio.to_thread(kube.get, "Service", ns, "ks-alpha")
    assert service is not None
    ports = sorted(p["port"] for p in service["spec"]["ports"])
    assert ports == [5555, 5556, 5557, 5558, 5559, 5560]  # the channels, code mode's bridge
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, "ks-alpha")
    assert policy is not None and "Egress" in policy["spec"]["policyTypes"]
    assert not policy["spec"].get("egress"), "no egress rule: the kernel reaches nothing"

    obj = await ready(kube, ns, "alpha")
    status = obj["status"]
    running = await asyncio.to_thread(kube.get, "Pod", ns, "ks-alpha")
    assert running is not None
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["podIP"] == running["status"]["podIP"] and status["phase"] == "Ready"
    assert status["nodeName"] == running["spec"]["nodeName"]  # kubectl get ks -o wide
    assert status["connection"]["host"] == f"ks-alpha.{ns}.svc"
    assert status["connection"]["secretName"] == "ks-alpha-conn"
    assert status["connection"]["generation"] == 1
    assert status["kernelId"] == pod["metadata"]["uid"]
    # Ready as soon as the kernel answered the operator's own kernel_info, not at the
    # kubelet's next startup probe (control/answers.py); the Service reaches the pod
    # from its start, so a gateway dialing it need not wait for the kubelet either.
    assert status["message"] == "the kernel answered the operator", status
    assert service["spec"]["publishNotReadyAddresses"] is True
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-alpha-conn")
    assert secret is not None
    assert key_in(secret) not in json.dumps(obj), "the key must never be in the status"
    # The kernel answers with the key of that Secret, at that address.
    async with kernel(kube, ns, "alpha") as conn:
        assert conn.kernel_info["implementation"] == "ipython"


async def test_an_oom_killed_kernel_is_named_and_recreated_with_its_key(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "beta", resources={"memory": "128Mi"})
    first = await ready(kube, ns, "beta")
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-beta-conn")
    assert secret is not None
    dead = await kernel_dies(kube, ns, "beta", "x = bytearray(512 * 2**20)")
    (state,) = dead["status"]["containerStatuses"]
    assert state["state"]["terminated"]["reason"] == "OOMKilled", state

    obj = await ready(kube, ns, "beta", other_than=first["status"]["kernelId"])
    last = obj["status"]["lastTermination"]
    assert last["reason"] == "OOMKilled" and last["exitCode"] == 137
    assert "out of memory (limit 128Mi)" in last["message"]
    assert obj["status"]["restarts"] == 1
    # What `kubectl describe` shows: made, Ready, and the OOM kill with its limit.
    told = await events_of(kube, ns, "beta", {"Starting", "Ready", "OOMKilled"})
    oom = next(e for e in told if e["reason"] == "OOMKilled" and e["type"] == "Warning")
    assert oom["type"] == "Warning" and "limit 128Mi" in oom["message"], oom
    assert oom["involvedObject"]["uid"] == obj["metadata"]["uid"]
    assert {e["source"]["component"] for e in told} == {"mcp-forge-operator"}
    assert obj["status"]["connection"]["generation"] == 2
    again = await asyncio.to_thread(kube.get, "Secret", ns, "ks-beta-conn")
    assert again is not None and key_in(again) == key_in(secret), "the key is kept"
    async with kernel(kube, ns, "beta") as conn:  # the new kernel answers with that key
        assert conn.kernel_info


async def test_restart_policy_never_leaves_it_failed_with_the_pod_kept(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "gamma", restartPolicy="Never")
    first = await ready(kube, ns, "gamma")
    await kernel_dies(kube, ns, "gamma", "import os; os._exit(1)")
    obj = await eventually(kube, KS, ns, "gamma", lambda o: phase(o) == "Failed")
    assert obj is not None
    assert obj["status"]["lastTermination"]["message"] == "the kernel exited with code 1"
    assert condition(obj, "Ready")["reason"] == "Error"
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-gamma")
    assert pod is not None and pod["metadata"]["uid"] == first["status"]["kernelId"]


async def test_spec_update_waits_for_a_restart_by_default(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "delta")
    first = await ready(kube, ns, "delta")
    await asyncio.to_thread(
        kube.patch, KS, ns, "delta", {"spec": {"resources": {"memory": "512Mi"}}}
    )
    obj = await eventually(
        kube,
        KS,
        ns,
        "delta",
        lambda o: condition(o, "UpdatePending").get("status") == "True",
        what="UpdatePending",
    )
    assert obj is not None
    assert condition(obj, "UpdatePending")["reason"] == "WaitingForRestart"
    assert obj["status"]["kernelId"] == first["status"]["kernelId"], "the kernel stays"
    assert obj["status"]["phase"] == "Ready"
    # A requested restart (what a gateway asks through the Lease) applies it.
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        ns,
        "ks-delta",
        {"metadata": {"annotations": {RESTART: first["status"]["kernelId"]}}},
    )
    pod = await new_pod(kube, ns, "delta", first["status"]["kernelId"])
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "512Mi"
    obj = await ready(kube, ns, "delta", other_than=first["status"]["kernelId"])
    assert condition(obj, "UpdatePending").get("status") == "False"
    assert obj["status"]["connection"]["generation"] == 2


async def test_recreate_strategy_waits_while_the_kernel_is_busy(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "eps", updateStrategy="Recreate")
    first = await ready(kube, ns, "eps")
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    far = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 300))
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        ns,
        "ks-eps",
        {
            "metadata": {"annotations": {BUSY_PREFIX + "gw-1": far, BUSY_PREFIX + "gw-2": None}},
            "spec": {"renewTime": now, "holderIdentity": "gw-1"},
        },
    )
    await asyncio.to_thread(kube.patch, KS, ns, "eps", {"spec": {"env": [{"name": "A"}]}})
    obj = await eventually(
        kube, KS, ns, "eps", lambda o: condition(o, "UpdatePending").get("reason") == "KernelBusy"
    )
    assert obj is not None and obj["status"]["kernelId"] == first["status"]["kernelId"]
    await asyncio.to_thread(
        kube.patch,
        "Lease",
        ns,
        "ks-eps",
        {"metadata": {"annotations": {BUSY_PREFIX + "gw-1": None}}},
    )
    pod = await new_pod(kube, ns, "eps", first["status"]["kernelId"])
    # The server stores an empty value as no value.
    assert {"name": "A"} in pod["spec"]["containers"][0]["env"]
    await ready(kube, ns, "eps", other_than=first["status"]["kernelId"])


async def test_idle_delete_culls_and_activity_postpones_it(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "idle", idleTimeout="3s")
    await ready(kube, ns, "idle")
    renewed = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(renewed))
    await asyncio.to_thread(
        kube.patch, "Lease", ns, "ks-idle", {"spec": {"renewTime": stamp, "holderIdentity": "t"}}
    )
    await eventually(kube, KS, ns, "idle", lambda o: o is None, timeout=30, what="culled")
    culled = time.time()
    # Activity at `renewed` moved the deadline: not culled before renewed + 3s.
    assert culled >= int(renewed) + 3 - 0.5, culled - renewed
    for kind in ("Pod", "Secret", "Service", "Lease", "NetworkPolicy"):
        name = "ks-idle" + ("-conn" if kind == "Secret" else "")
        gone = await eventually(kube, kind, ns, name, lambda o: o is None, timeout=60)
        assert gone is None, f"the garbage collector left {kind} {name}"


async def test_idle_suspend_keeps_the_session_and_activity_resumes_it(
    kube: Kube, kube_api: KubeAPI, ns: str, operator: Any
) -> None:
    await create(kube, ns, "nap", idleTimeout="2s", idleAction="Suspend")
    first = await ready(kube, ns, "nap")
    # As a user waits for it (manifests/README.md's table: a phase, not a condition).
    await asyncio.to_thread(
        kube_api.kubectl, "wait", "--for=jsonpath={.status.phase}=Suspended", "ks/nap",
        "--timeout=30s",
    )  # fmt: skip
    obj = await asyncio.to_thread(kube.get, KS, ns, "nap")
    assert obj is not None and obj["status"]["reason"] == "Idle"
    assert condition(obj, "Ready") == {}, "no kernel on purpose: no Ready (kstatus: Current)"
    assert kstatus(obj) == ["Current"]
    await eventually(kube, "Pod", ns, "ks-nap", lambda p: p is None, timeout=60, what="no pod")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    await asyncio.to_thread(kube.patch, "Lease", ns, "ks-nap", {"spec": {"renewTime": stamp}})
    await ready(kube, ns, "nap", other_than=first["status"]["kernelId"])
    told = await events_of(kube, ns, "nap", {"Ready", "Suspended", "Resumed"})
    assert {e["type"] for e in told} == {"Normal"}, told


async def test_a_session_no_operator_has_seen_reads_as_in_progress(kube: Kube, ns: str) -> None:
    """The CRD's status default (observedGeneration 0): with no operator running, a new
    session is not taken for done by kstatus (Flux's health checks, kpt)."""
    made = await create(kube, ns, "unseen")
    got = await asyncio.to_thread(kube.get, KS, ns, "unseen")
    assert got is not None and got["status"] == {"observedGeneration": 0}, got
    assert made["metadata"]["generation"] == 1
    assert kstatus(got) == ["InProgress"]


async def test_a_session_no_node_can_hold_stalls_at_its_progress_deadline(
    kube: Kube, kube_api: KubeAPI, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu 64 on a 2-core node: Starting, Unschedulable; past the progress deadline (2 s
    here) Stalled with the scheduler's reason, so kstatus (Flux) says Failed, and
    `kubectl wait --for=condition=Stalled` returns."""
    monkeypatch.setenv("MCPFORGE_PROGRESS_DEADLINE", "2")
    async with running_operator(kube):
        await create(kube, ns, "huge", resources={"cpu": "64", "memory": "128Mi"})
        await asyncio.to_thread(
            kube_api.kubectl, "wait", "--for=condition=Stalled", "ks/huge", "--timeout=60s"
        )
        obj = await asyncio.to_thread(kube.get, KS, ns, "huge")
    assert obj is not None
    assert obj["status"]["phase"] == "Starting", obj["status"]  # still trying
    assert condition(obj, "Stalled")["reason"] == "Unschedulable", condition(obj, "Stalled")
    assert condition(obj, "Reconciling")["status"] == "False"
    assert "not Ready after 2s" in obj["status"]["message"], obj["status"]["message"]
    assert kstatus(obj) == ["Failed"]


def reconciles() -> float:
    """KernelSession reconciles this process's operator ran (its metrics)."""
    count = REGISTRY.get_sample_value("mcpforge_reconcile_seconds_count", {"kind": KS})
    return count or 0.0


async def test_operating_mode_suspended_and_back(kube: Kube, ns: str, operator: Any) -> None:
    await create(kube, ns, "mode")
    first = await ready(kube, ns, "mode")
    await asyncio.to_thread(kube.patch, KS, ns, "mode", {"spec": {"operatingMode": "Suspended"}})
    obj = await eventually(kube, KS, ns, "mode", lambda o: phase(o) == "Suspended")
    assert obj is not None and obj["status"]["reason"] == "UserRequested"
    assert kstatus(obj) == ["Current"]
    await eventually(kube, "Pod", ns, "ks-mode", lambda p: p is None, timeout=60)
    # Stopped, it is looked at as its events and deadlines ask, not again and again (a
    # leaving pod's last event weighed after each reconcile made ~75 a second). The count
    # is the process's: other tests' sessions, their namespaces going, may reconcile too.
    before = reconciles()
    listed = await asyncio.to_thread(kube.list, KS, ns)
    rv = str(listed["metadata"]["resourceVersion"])
    writes = await asyncio.to_thread(
        lambda: list(kube.watch(KS, ns, resource_version=rv, timeout=3))
    )
    assert reconciles() - before <= 20 + len(writes), (reconciles() - before, writes)
    await asyncio.to_thread(kube.patch, KS, ns, "mode", {"spec": {"operatingMode": "Running"}})
    await ready(kube, ns, "mode", other_than=first["status"]["kernelId"])


async def test_max_lifetime_expires_the_session(kube: Kube, ns: str, operator: Any) -> None:
    await create(kube, ns, "mortal", maxLifetime="10s")
    obj = await ready(kube, ns, "mortal")
    assert obj["status"]["expiresAt"]
    expired = await eventually(kube, KS, ns, "mortal", lambda o: phase(o) == "Expired", timeout=30)
    assert expired is not None and condition(expired, "Ready")["reason"] == "Expired"
    await eventually(kube, "Pod", ns, "ks-mortal", lambda p: p is None, timeout=60)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"resources": {"memory": "10Mi"}}, "spec.resources.memory"),
        ({"resources": {"memory": "1GB"}}, "spec.resources.memory"),
        ({"resources": {"cpu": "10m"}}, "spec.resources.cpu"),
        ({"env": [{"name": "MCPFORGE_X"}]}, "spec.env[0].name"),
        ({"idleTimeout": "soon"}, "spec.idleTimeout"),
        ({"restartPolicy": "Sometimes"}, "spec.restartPolicy"),
        ({"nonsense": 1}, "spec.nonsense"),
        ({"maxLifetime": "1d"}, "spec.maxLifetime"),
        ({"workspace": {"reclaimPolicy": "Retain"}}, "spec.workspace"),
    ],
)
def test_an_invalid_spec_is_refused_at_admission_naming_the_field(
    kube_api: KubeAPI, spec: dict[str, Any], field: str
) -> None:
    body = session_body("bad", kube_api.namespace, **spec)
    out = subprocess.run(
        [
            kube_api.cluster.bin("kubectl"),
            f"--kubeconfig={kube_api.kubeconfig}",
            "create",
            "-f",
            "-",
        ],
        input=json.dumps(body),
        text=True,
        capture_output=True,
        check=False,
    )
    assert out.returncode != 0, f"accepted: {spec}"
    assert field in out.stderr, out.stderr
    # One clear error, not a second one about what the first made unreadable (the server's
    # own "<nil>: some validation rules were not checked" note aside).
    errors = [e for e in out.stderr.split("\n* ")[1:] if not e.startswith("<nil>")]
    assert len(errors) <= 1, out.stderr


async def test_delete_removes_every_child(kube: Kube, ns: str, operator: Any) -> None:
    await create(kube, ns, "gone")
    await ready(kube, ns, "gone")
    await asyncio.to_thread(kube.delete, KS, ns, "gone")
    for kind, name in [
        ("Pod", "ks-gone"),
        ("Secret", "ks-gone-conn"),
        ("Service", "ks-gone"),
        ("NetworkPolicy", "ks-gone"),
        ("Lease", "ks-gone"),
    ]:
        left = await eventually(kube, kind, ns, name, lambda o: o is None, timeout=60, what="gone")
        assert left is None


async def test_an_operator_restart_resumes_without_duplicates(kube: Kube, ns: str) -> None:
    async with running_operator(kube):
        await create(kube, ns, "phoenix")
        before = await ready(kube, ns, "phoenix")
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-phoenix-conn")
    assert secret is not None
    async with running_operator(kube):
        # Resumed: a change it must act on proves it is watching again.
        await asyncio.to_thread(kube.patch, KS, ns, "phoenix", {"spec": {"idleTimeout": "1h"}})
        obj = await eventually(
            kube,
            KS,
            ns,
            "phoenix",
            lambda o: (o or {})["status"].get("observedGeneration") == 2,
            what="the new generation observed",
        )
    assert obj is not None
    assert obj["status"]["kernelId"] == before["status"]["kernelId"], "the same kernel pod"
    assert obj["status"]["connection"]["generation"] == 1
    assert obj["status"]["restarts"] == 0
    after = await asyncio.to_thread(kube.get, "Secret", ns, "ks-phoenix-conn")
    assert after is not None and key_in(after) == key_in(secret)


async def test_a_new_session_never_takes_over_an_earlier_ones_children(
    kube: Kube, ns: str, operator: Any
) -> None:
    # The Secret of an earlier "again" that the garbage collector has not removed yet.
    owner = [
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": KS,
            "name": "again",
            "uid": "00000000-0000-4000-8000-000000000000",
            "controller": True,
        }
    ]
    stale_key = "0" * 64
    await asyncio.to_thread(
        kube.create,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "ks-again-conn", "namespace": ns, "ownerReferences": owner},
            "stringData": {"connection.json": json.dumps({"key": stale_key})},
        },
    )
    made = await create(kube, ns, "again")
    obj = await ready(kube, ns, "again")
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-again-conn")
    assert secret is not None and key_in(secret) != stale_key, "the old key is not reused"
    (ref,) = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == made["metadata"]["uid"]
    assert obj["status"]["connection"]["generation"] == 1


async def test_a_kernel_that_keeps_dying_at_start_is_restarted_with_backoff(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "loop")
    first = await ready(kube, ns, "loop")
    await kernel_dies(kube, ns, "loop", "import os; os._exit(3)")
    obj = await eventually(
        kube,
        KS,
        ns,
        "loop",
        lambda o: (o or {}).get("status", {}).get("reason") == "CrashLoopBackOff",
    )
    assert obj is not None
    assert obj["status"]["lastTermination"]["quickDeaths"] == 1
    assert "next start in" in obj["status"]["message"]
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-loop")
    assert pod is not None and pod["metadata"]["uid"] == first["status"]["kernelId"], "not yet"
    # After the backoff (5 s for a first quick death) a new pod comes.
    await new_pod(kube, ns, "loop", first["status"]["kernelId"], timeout=30)
    await ready(kube, ns, "loop", other_than=first["status"]["kernelId"])


async def test_a_pod_that_never_ran_takes_a_fixed_spec_at_once(
    kube: Kube, ns: str, operator: Any
) -> None:
    await create(kube, ns, "typo", image="localhost/no-such-image:1")
    failed = await eventually(kube, KS, ns, "typo", lambda o: phase(o) == "Failed", timeout=60)
    assert failed is not None, "an image the node cannot have fails the session"
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-typo")
    assert pod is not None
    await asyncio.to_thread(
        kube.patch, KS, ns, "typo", {"spec": {"image": "localhost/mcp-forge-kernel:0.1.0"}}
    )
    fixed = await new_pod(kube, ns, "typo", pod["metadata"]["uid"])
    assert fixed["spec"]["containers"][0]["image"] == "localhost/mcp-forge-kernel:0.1.0"
    await ready(kube, ns, "typo", other_than=pod["metadata"]["uid"])


async def test_an_invalid_session_stored_before_the_schema_refused_it_fails_naming_the_field(
    kube_api: KubeAPI, kube: Kube, ns: str, operator: Any
) -> None:
    """Objects can bypass admission: stored under an older, looser CRD. The operator checks
    again and fails the session without making anything for it."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    loose = copy.deepcopy(crd)
    loose["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    try:
        await asyncio.to_thread(install_crd, kube_api.kubeconfig, loose)
        await create(kube, ns, "bad", idleTimeout="soon")
    finally:
        await asyncio.to_thread(install_crd, kube_api.kubeconfig, crd)
    obj = await eventually(kube, KS, ns, "bad", lambda o: phase(o) == "Failed")
    assert obj is not None
    ready_cond = condition(obj, "Ready")
    assert ready_cond["reason"] == "InvalidSpec"
    assert "spec.idleTimeout" in ready_cond["message"], ready_cond["message"]
    for kind, name in [("Pod", "ks-bad"), ("Secret", "ks-bad-conn"), ("Service", "ks-bad")]:
        assert await asyncio.to_thread(kube.get, kind, ns, name) is None


async def test_a_namespace_s_baseline_policy_goes_with_its_last_kernel(
    kube: Kube, ns: str, operator: Any
) -> None:
    """Nothing of ours is left behind in a namespace (nor after an uninstall): once its
    last session is deleted and its kernel pod is gone, so is the NetworkPolicy that kept
    its kernels closed (control/baseline.py `release`)."""
    await create(kube, ns, "last", resources={"memory": "256Mi"})
    await ready(kube, ns, "last")
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, BASELINE_POLICY)
    assert policy is not None, "a namespace with kernels is closed by default"
    await asyncio.to_thread(kube.delete, KS, ns, "last")
    await eventually(kube, "Pod", ns, "ks-last", lambda p: p is None, timeout=60, what="pod gone")
    await eventually(
        kube, "NetworkPolicy", ns, BASELINE_POLICY, lambda o: o is None, timeout=30,
        what="the baseline policy removed",
    )  # fmt: skip
