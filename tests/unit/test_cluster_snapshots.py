"""A cluster's live snapshots, the parts that are pure: the kernel pod as rendered for
them (control/render.py, control/snapshots.py), the handler's refusals read from a pod,
and the kubelet's address (clients/kubelet.py). tests/kube/test_snapshots.py runs them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes
import kubernetes_validate
import pytest
from kubernetes.config.incluster_config import InClusterConfigLoader
from test_render import CONN, K8S_VERSION, by_kind, session

from mcp_forge.api.status import merge_patch, stamp
from mcp_forge.clients.kubelet import dial, endpoint
from mcp_forge.control import forkfiles, snapshots, snapstore
from mcp_forge.control.lifecycle import Activity
from mcp_forge.control.realize import Children, Pass
from mcp_forge.control.render import TEMPLATE_HASH, render_baseline_policy, render_kubernetes
from mcp_forge.errors import ApiError, InvalidRequest
from mcp_forge.settings import Settings, service_account


def pod(snapshots_on: bool) -> dict[str, Any]:
    objs = render_kubernetes(
        session(), CONN, runtime_class="mcpforge-restore", snapshots=snapshots_on
    )
    return by_kind(objs)["Pod"]


def test_a_pod_for_snapshots_has_a_user_namespace_of_its_own() -> None:
    on, off = pod(True), pod(False)
    assert on["spec"]["hostUsers"] is False and "hostUsers" not in off["spec"]
    assert on["spec"]["runtimeClassName"] == "mcpforge-restore"
    # The kubelet leaves a woken kernel's workspace files' modes as CRIU saw them.
    assert on["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # A change of the setting is a change of the pod: kernels made before are outdated.
    assert (
        on["metadata"]["annotations"][TEMPLATE_HASH]
        != off["metadata"]["annotations"][TEMPLATE_HASH]
    )
    kubernetes_validate.validate(on, K8S_VERSION, strict=True)


def test_a_pod_wakes_on_the_node_that_holds_the_snapshot_and_is_not_outdated_for_it() -> None:
    woken, plain = pod(True), pod(True)
    status: dict[str, Any] = {
        "snapshot": {
            "node": "node-7",
            "archive": "checkpoint-ks-demo_team-kernel-1.tar",
        }
    }
    snapshots.waking(status, woken)
    assert woken["metadata"]["annotations"][snapshots.RESTORE_FROM] == (
        "checkpoint-ks-demo_team-kernel-1.tar"
    )
    terms = woken["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]}
    ]
    assert (
        woken["metadata"]["annotations"][TEMPLATE_HASH]
        == (plain["metadata"]["annotations"][TEMPLATE_HASH])
    )
    kubernetes_validate.validate(woken, K8S_VERSION, strict=True)
    assert snapshots.woke_from(woken) == "checkpoint-ks-demo_team-kernel-1.tar"
    assert snapshots.woke_from(plain) == "" and snapshots.woke_from(None) == ""
    # A fork's batch shares its archive: the handler leaves it for the sweeper.
    shared = pod(True)
    snapshots.waking({"snapshot": {**status["snapshot"], "shared": True}}, shared)
    value = shared["metadata"]["annotations"][snapshots.RESTORE_FROM]
    assert value == "shared:checkpoint-ks-demo_team-kernel-1.tar"
    assert snapshots.woke_from(shared) == "checkpoint-ks-demo_team-kernel-1.tar"
    nothing: list[dict[str, Any]] = [{}, {"snapshot": None}, {"snapshot": {"node": "n"}}]
    for status in nothing:
        untouched = pod(True)
        snapshots.waking(status, untouched)
        assert untouched == plain


def test_a_snapshot_is_expired_once_its_age_is_reached_and_never_without_a_limit() -> None:
    now = 1_800_000_000.0
    snap = {"takenAt": stamp(now - 100)}
    assert snapshots.expired(snap, 100, now) and not snapshots.expired(snap, 101, now)
    assert not snapshots.expired(snap, 0, now)
    assert not snapshots.expired({}, 100, now)  # no time: not judged
    assert not snapshots.expired({"takenAt": "yesterday"}, 100, now)


def _with_state(state: dict[str, Any], last: dict[str, Any] | None = None) -> dict[str, Any]:
    status = {"name": "kernel", "state": state, "lastState": last or {}}
    return {"status": {"containerStatuses": [status]}}


def test_the_handlers_refusal_is_read_from_the_pods_status() -> None:
    said = (
        "failed to create containerd task: failed to create shim task: OCI runtime create "
        "failed: mcpforge-runc: checkpoint x.tar: unexpected EOF"
    )
    waiting = _with_state({"waiting": {"reason": "RunContainerError", "message": said}})
    assert snapshots.refusal(waiting) == "mcpforge-runc: checkpoint x.tar: unexpected EOF"
    earlier = _with_state(
        {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"message": said}}
    )
    assert snapshots.refusal(earlier).startswith("mcpforge-runc: ")
    others: list[dict[str, Any]] = [
        _with_state({"running": {"startedAt": "2026-12-05T00:00:00Z"}}),
        _with_state({"waiting": {"reason": "ErrImagePull", "message": "not found"}}),
        {"status": {}},
    ]
    for other in others:
        assert snapshots.refusal(other) == ""


def test_a_woken_kernel_that_started_again_before_it_answered_is_a_failed_wake() -> None:
    """Its next start is a fresh one (the handler wakes a container at its first start
    only): a page server that ended early killed it, or it died; never Restored."""
    killed = _with_state(
        {"running": {"startedAt": "2026-12-05T00:00:01Z"}},
        {"terminated": {"reason": "Error", "exitCode": 137}},
    )
    killed["status"]["containerStatuses"][0]["restartCount"] = 1
    said = snapshots.ended_early(killed)
    assert "ended before it answered (Error, exit code 137)" in said, said
    # restartPolicy Never, as kernel pods run: terminated, never started again
    dead = _with_state({"terminated": {"reason": "Error", "exitCode": 137}})
    assert "(Error, exit code 137)" in snapshots.ended_early(dead)
    assert snapshots.ended_early(_with_state({"waiting": {}}, {"terminated": {}}))
    running = _with_state({"running": {"startedAt": "2026-12-05T00:00:00Z"}})
    running["status"]["containerStatuses"][0]["restartCount"] = 0
    for first in (running, _with_state({"waiting": {"reason": "ContainerCreating"}}), {}):
        assert snapshots.ended_early(first) == ""


@pytest.mark.parametrize(
    ("addresses", "port", "url"),
    [
        (
            [{"type": "Hostname", "address": "n1"}, {"type": "InternalIP", "address": "10.0.0.5"}],
            10250,
            "https://10.0.0.5:10250",
        ),
        ([{"type": "InternalIP", "address": "fd00::5"}], 10255, "https://[fd00::5]:10255"),
        ([{"type": "Hostname", "address": "n1"}], None, "https://n1:10250"),
    ],
)
def test_the_kubelet_is_dialled_at_its_nodes_internal_address(
    addresses: list[dict[str, str]], port: int | None, url: str
) -> None:
    ends = {"kubeletEndpoint": {"Port": port}} if port else {}
    node = {"metadata": {"name": "n1"}, "status": {"addresses": addresses, "daemonEndpoints": ends}}
    assert endpoint(node) == url


def test_a_node_without_an_address_is_named() -> None:
    with pytest.raises(ApiError, match="node n1 has no address"):
        endpoint({"metadata": {"name": "n1"}, "status": {}})


def test_the_snapshot_runtime_class_takes_the_place_of_the_runtime_class() -> None:
    base = Settings()
    assert base.kernel_runtime_class is None
    assert dataclasses.replace(base, runtime_class="gvisor").kernel_runtime_class == "gvisor"
    both = dataclasses.replace(base, runtime_class="gvisor", snapshot_runtime_class="restore")
    assert both.kernel_runtime_class == "restore"


def test_the_kubelet_is_dialled_with_an_in_cluster_token_not_at_the_api_server(
    tmp_path: Path,
) -> None:
    """An in-cluster configuration's refresh hook sets its host back to the API server's
    at every call: the kubelet's configuration is a new one, with the token read."""
    (tmp_path / "token").write_text("secret-token")
    (tmp_path / "ca.crt").write_text("not checked here")
    api = kubernetes.client.Configuration()
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    InClusterConfigLoader(
        token_filename=str(tmp_path / "token"),
        cert_filename=str(tmp_path / "ca.crt"),
        environ=env,
    ).load_and_set(api)
    config = dial(api, "https://10.0.0.5:10250")
    client = kubernetes.client.ApiClient(config)
    try:
        _, url, headers, _, _ = client.param_serialize(
            "POST", "/checkpoint/a/b/c", auth_settings=["BearerToken"]
        )
    finally:
        client.close()
    assert url == "https://10.0.0.5:10250/checkpoint/a/b/c"
    assert headers["authorization"].lower() == "bearer secret-token"
    assert config.ssl_ca_cert == str(tmp_path / "ca.crt")


NOW = 1_800_000_000.0
HELD = {"node": "node-7", "archive": "checkpoint-ks-demo_team-kernel-1.tar"}


def _pass(snap: dict[str, Any], pod: dict[str, Any] | None) -> Pass:
    old = {"phase": "Suspended", "snapshot": snap}
    found = Children(want_pod=pod or {}, secret=None, lease={}, pod=pod, pool=None, workspace=None)
    return Pass(
        session=session(), body={}, old=old, generation=1, now=NOW, found=found,
        act=Activity(NOW), restart="", expires=None, stop=None, status=dict(old), due=[],
        kernel_gen=0, pod=pod,
    )  # fmt: skip


def test_a_snapshot_past_its_age_is_dropped_unless_a_pod_is_waking_from_it() -> None:
    """The operator alone judges a snapshot's age (the node's sweeper removes what no
    status holds): a pod already waking from it is followed to its end, never orphaned."""
    r: Any = SimpleNamespace(
        settings=Settings(snapshot_runtime_class="mcpforge-restore", snapshot_max_age=100.0)
    )
    young, old = {**HELD, "takenAt": stamp(NOW - 40)}, {**HELD, "takenAt": stamp(NOW - 100)}
    p = _pass(young, None)
    snapshots.settle(r, p)
    assert p.status["snapshot"] == young and p.due == [NOW + 60]  # looked at again then
    p = _pass(old, None)
    snapshots.settle(r, p)
    assert p.status["snapshot"] is None
    assert p.status["lastRestore"]["outcome"] == "Discarded"
    assert "(100 s)" in p.status["lastRestore"]["message"]
    waking = pod(True)
    snapshots.waking({"snapshot": old}, waking)
    p = _pass(old, waking)
    snapshots.settle(r, p)
    assert p.status["snapshot"] == old and "lastRestore" not in p.status and p.due == []
    p = _pass(old, pod(True))  # a pod that is not waking from it
    snapshots.settle(r, p)
    assert p.status["snapshot"] is None
    r.settings = Settings(snapshot_runtime_class="mcpforge-restore", snapshot_max_age=0.0)
    p = _pass(old, None)
    snapshots.settle(r, p)
    assert p.status["snapshot"] == old and p.due == []  # no limit


def test_the_checkpointer_is_named_namespace_slash_name_or_refused_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert service_account("mcp-forge-system/mcp-forge-checkpointer") == (
        "mcp-forge-system",
        "mcp-forge-checkpointer",
    )
    assert service_account("") == ("", "")
    for bad in ("checkpointer", "a/b/c", "/b", "a/", "A/b", "a/b c", "../x/y"):
        with pytest.raises(InvalidRequest, match="MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT"):
            service_account(bad)
    monkeypatch.setenv("MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT", "no-slash")
    with pytest.raises(InvalidRequest, match="no-slash"):
        Settings.from_env()


def test_a_snapshots_size_is_read_from_its_nodes_configmap_only_when_it_makes_sense() -> None:
    """What a node's sweeper wrote is read with care: only a whole number of bytes for
    that archive counts (tests/kube/test_snapshots.py reads a real one)."""
    archive = "checkpoint-ks-a_team-kernel-2026-12-06T01:02:03Z.tar"

    def shown(text: Any) -> dict[str, Any]:
        return {"data": {"sizes.json": text}}

    assert snapshots._size_in(shown(f'{{"{archive}": 536870912}}'), archive) == 536870912
    assert snapshots._size_in(shown(f'{{"{archive}": 0}}'), archive) == 0
    assert snapshots._size_in(shown(f'{{"{archive}": {2**53 - 1}}}'), archive) == 2**53 - 1
    for bad in (
        f'{{"{archive}": -1}}',
        f'{{"{archive}": true}}',
        f'{{"{archive}": "12"}}',
        f'{{"{archive}": 1.5}}',
        '{"another.tar": 12}',
        "[1, 2]",
        "not json",
        12,
        f'{{"{archive}": 1, "pad": "{"x" * (1 << 20)}"}}',  # past what is parsed
        "[" * 100_000 + "]" * 100_000,  # nested past the parser's recursion
        f'{{"{archive}": {"9" * 4000}}}',  # past what the API server takes
        f'{{"{archive}": {2**53}}}',
    ):
        assert snapshots._size_in(shown(bad), archive) is None, bad
    assert snapshots._size_in(None, archive) is None
    assert snapshots._size_in({"data": None}, archive) is None


def test_only_a_container_runc_could_not_freeze_is_checkpointed_again() -> None:
    """The kubelet's answer when runc's freezer lost a race (CI, December 6) is tried
    again; CRIU's own failures, refusals and a missing container are not."""
    from mcp_forge.clients.kubelet import unfrozen

    frozen_out = (
        "checkpointing of ns/ks-a/kernel failed (rpc error: code = Unknown desc = checkpointing "
        'container "44ba" failed: OCI runtime pause failed: unable to freeze)'
    )
    assert unfrozen(ApiError(500, "CheckpointFailed", frozen_out))
    for status, said in (
        (500, "checkpointing of ns/ks-a/kernel failed: criu failed: type NOTIFY errno 0"),
        (403, "unable to freeze"),  # not the runtime's answer
        (404, "container not found"),
        (0, "kubelet of node: unable to freeze"),  # never reached the kubelet
    ):
        assert not unfrozen(ApiError(status, "CheckpointFailed", said)), said


def test_a_forks_workspace_is_copied_by_a_pod_confined_as_its_kernel() -> None:
    """control/forkfiles.py: the copy's pod mounts the parent's claim read-only and the
    fork's own, runs as the kernel's pod does (user namespace, user, seccomp, runtime
    class, no capability, no token, a read-only root), is no kernel to any watch, and its
    `cp` follows no link and opens no special file."""
    persistent = {"persistent": True, "size": "64Mi"}
    fork_pod = by_kind(
        render_kubernetes(
            session(workspace=persistent), CONN, runtime_class="mcpforge-restore", snapshots=True
        )
    )["Pod"]
    parent = dataclasses.replace(session(workspace=persistent), name="elder")
    copier = forkfiles.render(fork_pod, session(workspace=persistent), parent, "node-1")
    kubernetes_validate.validate(copier, K8S_VERSION, strict=True)
    spec, meta = copier["spec"], copier["metadata"]
    assert meta["name"] == "ks-demo-fork-files" and "annotations" not in meta
    assert meta["labels"]["app.kubernetes.io/component"] == "fork-files"
    assert meta["ownerReferences"] == fork_pod["metadata"]["ownerReferences"]
    assert spec["hostUsers"] is False and spec["runtimeClassName"] == "mcpforge-restore"
    assert spec["securityContext"] == fork_pod["spec"]["securityContext"]
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == forkfiles.COPY_DEADLINE
    # Where the fork wakes, and its claim attaches; selected by the namespace's baseline.
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]
    (component,) = render_baseline_policy("team")["spec"]["podSelector"]["matchExpressions"]
    assert meta["labels"]["app.kubernetes.io/component"] in component["values"]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"]}
    assert claims == {
        "from": {"claimName": "ks-elder-workspace", "readOnly": True},
        "to": {"claimName": "ks-demo-workspace"},
    }
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["runAsUser"] == context["runAsGroup"] == 1000
    assert context["capabilities"] == {"drop": ["ALL"]} and context["readOnlyRootFilesystem"]
    assert context["allowPrivilegeEscalation"] is False
    assert {"name": "from", "mountPath": "/from", "readOnly": True} in container["volumeMounts"]
    # The image's Python copies (kernelside/treecopy.py, tests/unit/test_treecopy.py).
    assert container["command"] == forkfiles.COMMAND
    assert container["command"][-2:] == ["/from", "/to"]


def test_a_snapshot_is_stored_by_a_pod_confined_as_its_kernel_on_the_archives_node() -> None:
    """control/snapstore.py: the store's pod is named and imaged as the kernel's container
    (the handler checks the archive is of both), runs as the kernel's pod does, does
    nothing, and mounts the session's snapshot claim read-only where the handler looks;
    the claim has room for the kernel's memory and writable layer, and goes with the
    session."""
    kernel_pod = pod(True)
    archive = "checkpoint-ks-demo_team-kernel-1.tar"
    store = snapstore.render(kernel_pod, session(), archive, "node-3")
    kubernetes_validate.validate(store, K8S_VERSION, strict=True)
    spec, meta = store["spec"], store["metadata"]
    assert meta["name"] == "ks-demo-snapshot-store"
    assert meta["annotations"] == {snapshots.RESTORE_FROM: f"store:{archive}"}
    assert meta["ownerReferences"] == kernel_pod["metadata"]["ownerReferences"]
    (component,) = render_baseline_policy("team")["spec"]["podSelector"]["matchExpressions"]
    assert meta["labels"]["app.kubernetes.io/component"] == "snapshot-store"
    assert "snapshot-store" in component["values"]
    assert spec["hostUsers"] is False and spec["runtimeClassName"] == "mcpforge-restore"
    assert spec["securityContext"] == kernel_pod["spec"]["securityContext"]
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["node-3"]}]
    (container,) = spec["containers"]
    (kernel,) = kernel_pod["spec"]["containers"]
    assert container["name"] == kernel["name"] == "kernel"
    assert container["image"] == kernel["image"]
    assert container["command"] == ["python", "-I", "-S", "-c", ""]
    context = container["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]} and context["readOnlyRootFilesystem"]
    assert container["volumeMounts"] == [
        {"name": snapstore.VOLUME, "mountPath": "/.mcpforge-snapshot", "readOnly": True}
    ]
    assert spec["volumes"] == [
        {"name": snapstore.VOLUME, "persistentVolumeClaim": {"claimName": "ks-demo-snapshot"}}
    ]
    claim = snapstore.render_claim(session(), "fast")
    kubernetes_validate.validate(claim, K8S_VERSION, strict=True)
    assert claim["metadata"]["name"] == "ks-demo-snapshot"
    assert claim["metadata"]["ownerReferences"] == kernel_pod["metadata"]["ownerReferences"]
    assert claim["spec"]["storageClassName"] == "fast"
    room = int(claim["spec"]["resources"]["requests"]["storage"])
    assert room >= session().spec.memory_bytes + snapstore.HEADROOM
    assert "storageClassName" not in snapstore.render_claim(session(), "")["spec"]


def test_a_pod_waking_from_a_stored_snapshot_mounts_its_claim_and_only_prefers_its_node() -> None:
    settings = Settings(snapshot_runtime_class="mcpforge-restore", snapshot_store="claim")
    r: Any = SimpleNamespace(settings=settings, kube=None)
    snap = {"node": "node-7", "archive": "checkpoint-ks-demo_team-kernel-1.tar"}
    stored = {"snapshot": {**snap, "stored": {"outcome": "Stored", "claim": "ks-demo-snapshot"}}}
    woken = pod(True)
    snapshots.waking(stored, woken)
    snapstore.waking(r, session(), stored, woken)
    kubernetes_validate.validate(woken, K8S_VERSION, strict=True)
    affinity = woken["spec"]["affinity"]["nodeAffinity"]
    assert list(affinity) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    (preferred,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["preference"]["matchFields"][0]["values"] == ["node-7"]
    (kernel,) = woken["spec"]["containers"]
    mount = {"name": snapstore.VOLUME, "mountPath": "/.mcpforge-snapshot", "readOnly": True}
    assert mount in kernel["volumeMounts"]
    volume = {"name": snapstore.VOLUME, "persistentVolumeClaim": {"claimName": "ks-demo-snapshot"}}
    assert volume in woken["spec"]["volumes"]
    # Not stored (failed, or the store off): on the archive's node only, no claim.
    for status, on in (
        ({"snapshot": {**snap, "stored": {"outcome": "Failed"}}}, settings),
        (stored, dataclasses.replace(settings, snapshot_store="node")),
    ):
        plain = pod(True)
        snapshots.waking(status, plain)
        snapstore.waking(SimpleNamespace(settings=on, kube=None), session(), status, plain)  # type: ignore[arg-type]
        assert (
            "requiredDuringSchedulingIgnoredDuringExecution"
            in plain["spec"]["affinity"]["nodeAffinity"]
        )
        assert snapstore.VOLUME not in str(plain["spec"].get("volumes"))


def test_the_snapshot_store_is_node_or_claim_or_refused_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings.from_env().snapshot_store == "node"
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_STORE", "claim")
    assert Settings.from_env().snapshot_store == "claim"
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_STORE", "s3")
    with pytest.raises(
        InvalidRequest, match="MCPFORGE_SNAPSHOT_STORE='s3': expected node or claim"
    ):
        Settings.from_env()


def test_a_status_write_takes_away_what_the_new_status_no_longer_has_at_every_depth() -> None:
    """A merge patch of a whole new snapshot would keep the last one's other keys (its
    store's outcome, its size): the patch says None for each, and nothing unchanged."""
    old = {
        "phase": "Suspended",
        "snapshot": {"archive": "a.tar", "size": 5, "stored": {"outcome": "Stored"}},
        "kernelId": None,
    }
    new = {"phase": "Suspended", "snapshot": {"archive": "b.tar"}, "podName": None}
    assert merge_patch(old, new) == {
        "snapshot": {"archive": "b.tar", "size": None, "stored": None},
        "kernelId": None,
    }
    assert merge_patch(old, old) == {}
    assert merge_patch({"snapshot": {"stored": {"outcome": "Storing"}}}, {"snapshot": None}) == {
        "snapshot": None
    }
