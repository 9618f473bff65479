"""The Deployments, the gateway's Service and the NetworkPolicies: who may reach whom,
on which ports, and what the probes and Prometheus find."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from manifests_support import (
    INSTALLS,
    NAMESPACES,
    SESSIONS,
    SYSTEM,
    TOKENS_SECRET,
    _session,
    build,
    container,
    env_of,
    find,
)

from mcp_forge.api.connection import BRIDGE_PORT, PORTS
from mcp_forge.control.render import GATEWAY_SELECTOR, labels

# ---- the Deployments, the Service and the network --------------------------------------------


def _http_port(args: list[str]) -> int:
    return int(args[args.index("--http") + 1].rpartition(":")[2])


@pytest.mark.parametrize("name", INSTALLS)
def test_the_gateway_pods_are_the_ones_kernel_policies_admit(name: str) -> None:
    objs = build(name)
    gateway = find(objs, "Deployment", "mcp-forge-gateway", SYSTEM)
    operator = find(objs, "Deployment", "mcp-forge-operator", SYSTEM)
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert GATEWAY_SELECTOR.items() <= pod_labels.items()
    op_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert not GATEWAY_SELECTOR.items() <= op_labels.items(), "the operator never reaches a kernel"
    # The operator renders kernel policies for gateways of its MCPFORGE_GATEWAY_NAMESPACE.
    field = env_of(container(objs, "mcp-forge-operator"))["MCPFORGE_GATEWAY_NAMESPACE"]
    assert field == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
    assert operator["metadata"]["namespace"] == gateway["metadata"]["namespace"]


def test_the_gateway_serves_its_tokens_file_from_a_secret_not_shipped_here() -> None:
    objs = build("base")
    c = container(objs, "mcp-forge-gateway")
    tokens_file = Path(c["args"][c["args"].index("--tokens-file") + 1])
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(tokens_file.parent))
    assert mount["readOnly"] is True
    pod = find(objs, "Deployment", "mcp-forge-gateway", SYSTEM)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == TOKENS_SECRET
    assert volume["secret"]["items"] == [{"key": "tokens", "path": tokens_file.name}]
    assert not [o for o in objs if o["kind"] == "Secret"]
    assert env_of(c)["MCPFORGE_SESSION_NAMESPACE"] == SESSIONS


def test_the_gateway_service_and_probes_point_at_the_port_it_listens_on() -> None:
    objs = build("base")
    c = container(objs, "mcp-forge-gateway")
    port = _http_port(c["args"])
    named = next(p for p in c["ports"] if p["name"] == "http")
    assert named["containerPort"] == port
    (svc_port,) = find(objs, "Service", "mcp-forge-gateway", SYSTEM)["spec"]["ports"]
    assert svc_port["port"] == port and svc_port["targetPort"] == named["name"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == named["name"]
    # Clients inside the cluster use the Service's name; the gateway must accept it as Host.
    hosts = [c["args"][i + 1] for i, a in enumerate(c["args"]) if a == "--allow-host"]
    assert f"mcp-forge-gateway.{SYSTEM}.svc:{port}" in hosts


@pytest.mark.parametrize("name", INSTALLS)
def test_the_operator_is_one_replica_probed_where_kopf_listens(name: str) -> None:
    objs = build(name)
    dep = find(objs, "Deployment", "mcp-forge-operator", SYSTEM)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    c = container(objs, "mcp-forge-operator")
    url = c["args"][c["args"].index("--liveness") + 1]
    assert url == "http://0.0.0.0:8080/healthz"
    probe = c["livenessProbe"]["httpGet"]
    port = next(p for p in c["ports"] if p["name"] == probe["port"])
    assert (probe["path"], port["containerPort"]) == ("/healthz", 8080)


def _selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """A label selector as the API server reads it (In and NotIn are all manifests/ use)."""
    for k, v in selector.get("matchLabels", {}).items():
        if pod_labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] in ("In", "NotIn"), e
        if (pod_labels.get(e["key"]) in e["values"]) != (e["operator"] == "In"):
            return False
    return True


@pytest.mark.parametrize("name", INSTALLS)
def test_prometheus_finds_both_by_their_annotations_and_may_reach_them(name: str) -> None:
    objs = build(name)
    policy = find(objs, "NetworkPolicy", "metrics", SYSTEM)["spec"]
    (rule,) = policy["ingress"]
    # Only from namespaces labelled for monitoring: not kernels allowed egress, not anyone.
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"mcpforge.dev/monitoring": "true"}}}
    ], rule
    for component in ("operator", "gateway"):
        template = find(objs, "Deployment", f"mcp-forge-{component}", SYSTEM)["spec"]["template"]
        c = container(objs, f"mcp-forge-{component}")
        host, _, port = c["args"][c["args"].index("--metrics") + 1].rpartition(":")
        assert host == "0.0.0.0", "served on the pod's address, not loopback"
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": port,
            "prometheus.io/path": "/metrics",
        }
        named = next(p for p in c["ports"] if p["name"] == "metrics")
        assert named["containerPort"] == int(port)
        assert _selects(policy["podSelector"], template["metadata"]["labels"]), component
        assert [(p["port"], p["protocol"]) for p in rule["ports"]] == [(int(port), "TCP")]
    assert not _selects(policy["podSelector"], labels(_session())), "no kernel is scraped"


def _policies(objs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == namespace
    ]


def test_every_namespace_denies_all_traffic_by_default() -> None:
    objs = build("base")
    for namespace in NAMESPACES:
        deny = [
            p["spec"]
            for p in _policies(objs, namespace)
            if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]
        ]
        assert {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]} in deny


def test_the_gateway_may_reach_kernels_only_on_their_zmq_ports() -> None:
    objs = build("base")
    policy = find(objs, "NetworkPolicy", "gateway", SYSTEM)["spec"]
    assert policy["podSelector"]["matchLabels"] == GATEWAY_SELECTOR
    (egress,) = policy["egress"]
    (peer,) = egress["to"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": SESSIONS}
    kernel = labels(_session())
    assert peer["podSelector"]["matchLabels"].items() <= kernel.items()
    assert sorted(p["port"] for p in egress["ports"]) == sorted([*PORTS.values(), BRIDGE_PORT])
    assert {p["protocol"] for p in egress["ports"]} == {"TCP"}
    (ingress,) = policy["ingress"]
    assert "from" not in ingress, "any MCP client; the token is the check"
    c = container(objs, "mcp-forge-gateway")
    assert [p["port"] for p in ingress["ports"]] == [_http_port(c["args"])]


def test_the_operator_and_gateway_may_reach_the_api_server_and_dns() -> None:
    objs = build("base")
    api = find(objs, "NetworkPolicy", "allow-api-server", SYSTEM)["spec"]
    (_name, component) = api["podSelector"]["matchExpressions"]
    assert component["values"] == ["operator", "gateway"]
    assert sorted(p["port"] for p in api["egress"][0]["ports"]) == [443, 6443]
    dns = find(objs, "NetworkPolicy", "allow-dns", SYSTEM)["spec"]
    assert {(p["port"], p["protocol"]) for p in dns["egress"][0]["ports"]} == {
        (53, "UDP"),
        (53, "TCP"),
    }
    # Nothing else leaves mcp-forge-system: no policy there allows egress to everything.
    for policy in _policies(objs, SYSTEM):
        for rule in policy["spec"].get("egress", []):
            assert rule.get("ports"), policy["metadata"]["name"]
