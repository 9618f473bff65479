"""The renderer: the security profile, and manifests valid for Kubernetes and Podman."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from mcp_forge import resource
from mcp_forge.connection import PORTS, ConnectionInfo
from mcp_forge.render import HostPaths, render_kubernetes, render_podman

K8S_VERSION = "1.33"


def session(**spec: Any) -> resource.KernelSession:
    body = resource.validate(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "demo", "namespace": "team", "uid": "1234-abcd"},
            "spec": spec,
        }
    )
    return resource.load(body)


CONN = ConnectionInfo("tcp", "", "k" * 64)
PATHS = HostPaths(
    "/var/lib/mcp-forge/k/x/conf",
    "/var/lib/mcp-forge/k/x/run",
    "/var/lib/mcp-forge/k/x/workspace",
    "/srv/shared",
)


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas() -> None:
    for obj in render_kubernetes(
        session(sharedGroup="team-a", env=[{"name": "A", "value": "1"}]), CONN
    ):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_child_is_owned_by_the_kernel_session_and_labelled() -> None:
    for obj in render_kubernetes(session(), CONN):
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "KernelSession"
        assert owner["uid"] == "1234-abcd"
        assert owner["controller"] is True
        assert obj["metadata"]["labels"]["mcpforge.dev/session"] == "demo"
        assert obj["metadata"]["namespace"] == "team"


@pytest.mark.parametrize("target", ["kubernetes", "podman"])
def test_the_pod_carries_the_restricted_security_profile(target: str) -> None:
    s = session(resources={"memory": "512Mi", "cpu": "500m"})
    objs = render_kubernetes(s, CONN) if target == "kubernetes" else render_podman(s, PATHS)
    pod = by_kind(objs)["Pod"]
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["runAsUser"] == 1000
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["limits"] == {"memory": "512Mi", "cpu": "500m"}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/workspace", "/tmp", "/etc/mcp-forge"} <= mounts
    conf = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/mcp-forge")
    assert conf["readOnly"] is True
    assert c["args"][:3] == ["python", "-P", "-m"]


def test_the_service_exposes_the_fixed_ports_and_the_secret_holds_the_key() -> None:
    objs = by_kind(render_kubernetes(session(), CONN))
    ports = {p["name"]: p["port"] for p in objs["Service"]["spec"]["ports"]}
    assert ports == {**PORTS, "bridge": 5560}  # the five channels, and code mode's bridge
    conn = yaml.safe_load(objs["Secret"]["stringData"]["connection.json"])
    assert conn["key"] == "k" * 64
    assert conn["ip"] == "0.0.0.0"
    assert conn["shell_port"] == PORTS["shell"]
    assert "k" * 64 not in yaml.safe_dump(objs["Pod"])


def test_the_network_policy_admits_only_the_gateway_and_no_egress_by_default() -> None:
    policy = by_kind(render_kubernetes(session(), CONN))["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []
    (rule,) = policy["ingress"]
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "mcp-forge",
                    "app.kubernetes.io/component": "gateway",
                }
            }
        }
    ]
    allowed = by_kind(render_kubernetes(session(network={"egress": "All"}), CONN))["NetworkPolicy"]
    assert allowed["spec"]["egress"] == [{}]


def test_the_podman_target_is_a_pod_without_secret_volumes() -> None:
    objs = render_podman(session(sharedGroup="team-a"), PATHS)
    assert [o["kind"] for o in objs] == ["Pod"]
    volumes = objs[0]["spec"]["volumes"]
    assert not any("secret" in v for v in volumes)
    paths = {v["hostPath"]["path"] for v in volumes if "hostPath" in v}
    assert paths == {PATHS.conf, PATHS.run, PATHS.workspace, "/srv/shared"}
    assert objs[0]["metadata"]["name"] == "mcpforge-team-demo"
    assert objs[0]["metadata"]["annotations"]["io.podman.annotations.pids-limit/kernel"] == "256"


def test_rendering_is_pure_and_repeatable() -> None:
    s = session()
    assert render_kubernetes(s, CONN) == render_kubernetes(s, CONN)
    assert render_podman(s, PATHS) == render_podman(s, PATHS)


def test_the_network_policy_can_admit_gateways_of_another_namespace() -> None:
    objs = render_kubernetes(session(), CONN, gateway_namespace="mcp-forge-system")
    (peer,) = by_kind(objs)["NetworkPolicy"]["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "mcp-forge-system"}
    }
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
