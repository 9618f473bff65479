"""The RBAC of every install, read as the API server grants it."""

from __future__ import annotations

from typing import Any

import pytest
from manifests_support import (
    CLUSTER,
    EGRESS,
    EGRESS_SA,
    GATEWAY_SA,
    INSTALLS,
    OPERATOR_SA,
    SESSIONS,
    SYSTEM,
    build,
    find,
    key,
)

# ---- RBAC, read as the API server grants it --------------------------------------------------


Grant = tuple[str, str, str, str]  # scope (a namespace or CLUSTER), apiGroup, resource, verb


def grants(objs: list[dict[str, Any]], subject: tuple[str, str]) -> set[Grant]:
    """What a ServiceAccount may do: every rule of every role bound to it, with its scope."""
    roles = {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs
    }
    out: set[Grant] = set()
    for binding in objs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        bound = {
            (s.get("namespace", ""), s["name"])
            for s in binding["subjects"]
            if s["kind"] == "ServiceAccount"
        }
        if subject not in bound:
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace", "")
        role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else "", ref["name"])]
        scope = CLUSTER if binding["kind"] == "ClusterRoleBinding" else namespace
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            named = rule.get("resourceNames")  # `resource:name` for each name
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        for each in [f"{res}:{n}" for n in named] if named else [res]:
                            out.add((scope, group, each, verb))
    return out


def expand(scope: str, table: dict[tuple[str, str], str]) -> set[Grant]:
    return {
        (scope, group, res, verb) for (group, res), verbs in table.items() for verb in verbs.split()
    }


OPERATOR_RULES = {
    # delete: a session idle past its idleTimeout with idleAction Delete is deleted.
    ("mcpforge.dev", "kernelsessions"): "get list watch patch delete",
    ("mcpforge.dev", "kernelsessions/status"): "get patch",
    # Pools: filled and counted (status); patched only to take an older kopf's notes off.
    ("mcpforge.dev", "kernelsessionpools"): "get list watch patch",
    ("mcpforge.dev", "kernelsessionpools/status"): "get patch",
    ("", "pods"): "get list watch create patch delete",
    ("", "services"): "get list watch create patch delete",
    ("", "secrets"): "get list create patch delete",  # never watched
    ("networking.k8s.io", "networkpolicies"): "get list watch create patch delete",
    ("coordination.k8s.io", "leases"): "get list watch create patch delete",
    # A persistent workspace's claim: made, its owner set per reclaimPolicy; deleted by the
    # garbage collector with its session, never by the operator. A snapshot claim: deleted
    # with its snapshot, dropped unwoken (control/snapstore.py, the one delete of a claim).
    ("", "persistentvolumeclaims"): "get create patch delete",
    # get: an Event's count, read when it happens again after a restart (control/events.py).
    ("", "events"): "get create patch",
}
# The egress proxy's namespace: a grant (a Secret) per session, listed at start to delete
# orphans (control/egress.py); the proxy's Service read for its address.
OPERATOR_EGRESS_RULES = {
    ("", "secrets"): "get list create patch delete",
    ("", "services"): "get",
}
OPERATOR_SCANNING = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): "list watch",
    ("", "namespaces"): "list watch",
}
GATEWAY_RULES = {
    ("mcpforge.dev", "kernelsessions"): "get list watch create delete",
    ("mcpforge.dev", "kernelsessions/status"): "get",
    # Without --pool it picks, per new session, a pool that serves it.
    ("mcpforge.dev", "kernelsessionpools"): "list",
    ("", "secrets"): "get",
    # delete: a client's quota Lease once it holds no reservation.
    ("coordination.k8s.io", "leases"): "get create patch delete",
}


def test_no_rule_uses_a_wildcard() -> None:
    for name in INSTALLS:
        for obj in build(name):
            for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[field], (key(obj), rule)


# Its clients' tasks (gateway/mcp/tasks_kube.py): a Secret per task, in its own namespace.
GATEWAY_TASK_RULES = {("", "secrets"): "get list create patch delete"}


@pytest.mark.parametrize("name", INSTALLS)
def test_the_gateway_reads_kernel_secrets_and_keeps_tasks_in_its_own_namespace_only(
    name: str,
) -> None:
    granted = grants(build(name), GATEWAY_SA)
    assert granted == expand(SESSIONS, GATEWAY_RULES) | expand(SYSTEM, GATEWAY_TASK_RULES)
    secrets = {(scope, verb) for scope, _, res, verb in granted if res == "secrets"}
    assert {verb for scope, verb in secrets if scope == SESSIONS} == {"get"}, "kernels' keys"
    assert not any(scope == CLUSTER for scope, *_ in granted)
    assert not any(res.startswith("pods") for _, _, res, _ in granted), "no pods, no exec"


def test_the_cluster_wide_operator_has_exactly_its_rules_everywhere() -> None:
    for name in ("base", "overlays/gvisor"):
        granted = grants(build(name), OPERATOR_SA)
        assert granted == expand(CLUSTER, OPERATOR_RULES | OPERATOR_SCANNING)
        assert expand(CLUSTER, OPERATOR_EGRESS_RULES) <= granted, "the egress grants"


def test_the_snapshots_operator_may_checkpoint_at_the_kubelet_through_a_token_and_no_more() -> None:
    """The operator reads nodes, asks for the checkpointer's tokens and reads the
    sweepers' ConfigMaps of sizes; the checkpointer may create nodes/checkpoint and
    nothing else: not nodes/proxy (which runs commands in any pod of a node), and no pod
    runs as it."""
    objs = build("overlays/snapshots")
    granted = grants(objs, OPERATOR_SA)
    base = expand(CLUSTER, OPERATOR_RULES | OPERATOR_SCANNING)
    assert granted - base == {
        (CLUSTER, "", "nodes", "get"),
        (SYSTEM, "", "serviceaccounts/token:mcp-forge-checkpointer", "create"),
        ("mcp-forge-node", "", "configmaps", "get"),
    }
    assert base <= granted
    checkpointer = (SYSTEM, "mcp-forge-checkpointer")
    assert grants(objs, checkpointer) == {(CLUSTER, "", "nodes/checkpoint", "create")}
    account = find(objs, "ServiceAccount", "mcp-forge-checkpointer", SYSTEM)
    assert account["automountServiceAccountToken"] is False
    env = {
        e["name"]: e.get("value")
        for e in find(objs, "Deployment", "mcp-forge-operator", SYSTEM)["spec"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert env["MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT"] == "/".join(checkpointer)


def test_the_snapshot_sweeper_lists_sessions_and_sees_only_the_checkpoints_of_its_node() -> None:
    """It lists sessions and writes ConfigMaps of its own namespace (the sizes), no more:
    not sessions' status, nor anything in another namespace."""
    objs = build("overlays/snapshots")
    granted = grants(objs, ("mcp-forge-node", "mcp-forge-snapshot-sweeper"))
    assert granted == {(CLUSTER, "mcpforge.dev", "kernelsessions", "list")} | expand(
        "mcp-forge-node", {("", "configmaps"): "get create patch"}
    )
    pod = find(objs, "DaemonSet", "mcp-forge-snapshot-sweeper", "mcp-forge-node")["spec"][
        "template"
    ]["spec"]
    assert [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v] == [
        "/var/lib/kubelet/checkpoints"
    ]
    (c,) = pod["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    for name in ("base", "overlays/gvisor", "overlays/namespace-scoped"):
        assert not any(o["kind"] == "DaemonSet" for o in build(name)), name


def test_the_namespace_scoped_operator_has_no_cluster_wide_grant() -> None:
    granted = grants(build("overlays/namespace-scoped"), OPERATOR_SA)
    assert granted == expand(SESSIONS, OPERATOR_RULES) | expand(EGRESS, OPERATOR_EGRESS_RULES)


@pytest.mark.parametrize("name", INSTALLS)
def test_the_egress_feeder_reads_the_secrets_of_its_own_namespace_only(name: str) -> None:
    """Only grants live there; it writes nothing."""
    granted = grants(build(name), EGRESS_SA)
    assert granted == expand(EGRESS, {("", "secrets"): "get list watch"})


def test_users_get_kernel_sessions_through_the_built_in_roles() -> None:
    objs = build("base")
    edit = find(objs, "ClusterRole", "mcp-forge-kernelsession-edit")["metadata"]["labels"]
    view = find(objs, "ClusterRole", "mcp-forge-kernelsession-view")["metadata"]["labels"]
    assert edit["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
