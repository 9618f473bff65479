"""The kustomizations of manifests/: they build objects valid for Kubernetes 1.33, in the
three namespaces, with the CRDs of crds/; the images can be replaced; what the overlays
change."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from manifests_support import (
    EGRESS,
    INSTALLS,
    K8S_VERSION,
    KUSTOMIZATIONS,
    MANIFESTS,
    NAMESPACES,
    ROOT,
    SESSIONS,
    SYSTEM,
    VERSION,
    build,
    container,
    env_of,
    find,
    key,
    kustomize,
)

# ---- kustomize and the Kubernetes schemas ----------------------------------------------------


def test_the_crds_in_every_install_are_the_ones_in_crds() -> None:
    crds = [
        yaml.safe_load((ROOT / "crds" / f).read_text())
        for f in ("kernelsession.yaml", "kernelsessionpool.yaml")
    ]
    for name in INSTALLS:
        built = [o for o in build(name) if o["kind"] == "CustomResourceDefinition"]
        assert sorted(built, key=str) == sorted(crds, key=str), name


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_builds_into_objects_valid_for_kubernetes(name: str) -> None:
    objs = build(name)
    assert objs
    keys = [key(o) for o in objs]
    assert len(keys) == len(set(keys))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", INSTALLS)
def test_every_namespaced_object_names_one_of_the_three_namespaces(name: str) -> None:
    """And the snapshot sweeper's own (tests/unit/test_manifests_pod_security.py)."""
    namespaces = (*NAMESPACES, "mcp-forge-node") if name == "overlays/snapshots" else NAMESPACES
    cluster_scoped = {
        "Namespace",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "RuntimeClass",
    }
    for obj in build(name):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert namespace is None, key(obj)
        else:
            assert namespace in namespaces, key(obj)
        if obj["kind"] != "CustomResourceDefinition":  # crds/ is taken as it is
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "mcp-forge", key(obj)


def test_every_namespace_enforces_the_restricted_pod_security_standard() -> None:
    objs = build("base")
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"} == set(NAMESPACES)
    for namespace in NAMESPACES:
        ns_labels = find(objs, "Namespace", namespace)["metadata"]["labels"]
        assert ns_labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_images_can_be_replaced_with_kustomize_images(tmp_path: Path) -> None:
    base = os.path.relpath(MANIFESTS / "base", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "bases": [base],
                "images": [
                    {
                        "name": "ghcr.io/mcp-forge/operator",
                        "newName": "registry.example/op",
                        "newTag": "dev",
                    },
                    {"name": "ghcr.io/mcp-forge/gateway", "newName": "registry.example/gw"},
                    {"name": "ghcr.io/mcp-forge/egress", "newName": "registry.example/eg"},
                ],
            }
        )
    )
    objs = kustomize(tmp_path)
    assert container(objs, "mcp-forge-operator")["image"] == "registry.example/op:dev"
    assert container(objs, "mcp-forge-gateway")["image"] == f"registry.example/gw:{VERSION}"
    egress = find(objs, "Deployment", "mcp-forge-egress", EGRESS)["spec"]["template"]["spec"]
    assert {c["image"] for c in egress["containers"]} == {f"registry.example/eg:{VERSION}"}


def test_the_gvisor_overlay_changes_only_the_operators_runtime_class() -> None:
    base = {key(o): o for o in build("base")}
    gvisor = {key(o): o for o in build("overlays/gvisor")}
    assert base.keys() == gvisor.keys()
    changed = [k for k in base if base[k] != gvisor[k]]
    assert changed == [("Deployment", SYSTEM, "mcp-forge-operator")]
    c = container(list(gvisor.values()), "mcp-forge-operator")
    assert env_of(c)["MCPFORGE_RUNTIME_CLASS"] == "gvisor"


def test_the_namespace_scoped_overlay_watches_the_session_namespace_only() -> None:
    objs = build("overlays/namespace-scoped")
    args = container(objs, "mcp-forge-operator")["args"]
    assert "--all-namespaces" not in args
    assert args[args.index("--namespace") + 1] == SESSIONS
    assert args.count("--namespace") == 1
    base = {key(o) for o in build("base")}
    scoped = {key(o) for o in objs}
    assert base - scoped == {
        ("ClusterRole", "", "mcp-forge-operator"),
        ("ClusterRoleBinding", "", "mcp-forge-operator"),
    }
    assert scoped - base == {
        ("Role", SESSIONS, "mcp-forge-operator"),
        ("RoleBinding", SESSIONS, "mcp-forge-operator"),
        ("Role", EGRESS, "mcp-forge-operator"),
        ("RoleBinding", EGRESS, "mcp-forge-operator"),
    }
