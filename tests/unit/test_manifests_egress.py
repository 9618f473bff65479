"""The egress proxy's install (manifests/base/common/egress.yaml and its NetworkPolicies):
where the operator and the kernels' policies look for it, what each of its two containers
runs and holds, and who may reach it."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest
from manifests_support import (
    EGRESS,
    EGRESS_SA,
    INSTALLS,
    VERSION,
    _session,
    build,
    find,
    parse_cli,
)

from mcp_forge.control.render import labels
from mcp_forge.control.render_egress import EGRESS_SELECTOR, PROXY_PORT
from mcp_forge.image import control_plane
from mcp_forge.settings import Settings

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objs, "Deployment", "mcp-forge-egress", EGRESS)


def pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment(objs)["spec"]["template"]["spec"]
    return spec


def containers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod(objs)["containers"]}


def flag(c: dict[str, Any], name: str) -> str:
    args: list[str] = c["args"]
    return args[args.index(name) + 1]


def mounted_at(c: dict[str, Any], path: str) -> str | None:
    """The volume `c` sees `path` in, if any."""
    for mount in c.get("volumeMounts", []):
        if PurePosixPath(path).is_relative_to(mount["mountPath"]):
            return str(mount["name"])
    return None


def test_the_operator_finds_the_proxy_where_its_settings_say() -> None:
    objs = build("base")
    settings = Settings()
    assert settings.egress_namespace == EGRESS
    service = find(objs, "Service", settings.egress_service, EGRESS)["spec"]
    assert service["type"] == "ClusterIP"
    (port,) = service["ports"]  # the operator takes the first
    assert port["port"] == PROXY_PORT
    proxy = containers(objs)["proxy"]
    named = next(p for p in proxy["ports"] if p["name"] == port["targetPort"])
    assert named["containerPort"] == PROXY_PORT
    assert flag(proxy, "--listen") == f"0.0.0.0:{PROXY_PORT}"
    assert proxy["readinessProbe"]["tcpSocket"]["port"] == port["targetPort"]
    pod_labels = deployment(objs)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"] == EGRESS_SELECTOR
    assert EGRESS_SELECTOR.items() <= pod_labels.items(), "what kernel policies let out to"


def test_both_containers_run_the_egress_image_the_proxy_as_its_entrypoint() -> None:
    objs = build("base")
    proxy, feeder = containers(objs)["proxy"], containers(objs)["feeder"]
    image = control_plane.image_ref("egress")
    assert proxy["image"] == feeder["image"] == image == f"ghcr.io/mcp-forge/egress:{VERSION}"
    assert "command" not in proxy
    assert proxy["args"] == control_plane.TARGETS["egress"][1], "the image's default"
    assert feeder["command"] == [f"{control_plane.VENV}/bin/mcp-forge", "egress-feeder"]


@pytest.mark.parametrize("install", INSTALLS)
def test_the_feeder_runs_a_command_the_cli_has_on_the_proxys_sockets(install: str) -> None:
    objs = build(install)
    proxy, feeder = containers(objs)["proxy"], containers(objs)["feeder"]
    parse_cli([*feeder["command"], *feeder["args"]])
    assert flag(feeder, "--namespace") == EGRESS, "where the operator writes the grants"
    for socket in ("--control-socket", "--audit-socket"):
        path = flag(proxy, socket)
        assert flag(feeder, socket) == path
        assert mounted_at(proxy, path) == mounted_at(feeder, path) == "run", socket
    volumes = {v["name"]: v for v in pod(objs)["volumes"]}
    assert volumes["run"]["emptyDir"]["medium"] == "Memory"
    assert mounted_at(proxy, "/tmp") != mounted_at(feeder, "/tmp"), "a /tmp each"
    assert mounted_at(proxy, flag(proxy, "--confdir")) == mounted_at(proxy, "/tmp")


def test_only_the_feeder_holds_an_api_credential() -> None:
    """The proxy parses the kernels' traffic: nothing in its container reaches the API."""
    objs = build("base")
    account = find(objs, "ServiceAccount", EGRESS_SA[1], EGRESS_SA[0])
    assert account["automountServiceAccountToken"] is False
    spec = pod(objs)
    assert spec["serviceAccountName"] == EGRESS_SA[1]
    assert spec["automountServiceAccountToken"] is False
    assert not spec.get("shareProcessNamespace"), "the feeder's files stay its own"
    proxy, feeder = containers(objs)["proxy"], containers(objs)["feeder"]
    volume = mounted_at(feeder, f"{TOKEN_DIR}/token")
    assert volume is not None and mounted_at(proxy, TOKEN_DIR) is None
    (projected,) = [v for v in spec["volumes"] if v["name"] == volume]
    sources = projected["projected"]["sources"]
    assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}} in sources
    assert not [v for v in spec["volumes"] if "secret" in v]


def test_the_proxy_may_be_replaced_by_a_new_pod_before_the_old_goes() -> None:
    spec = deployment(build("base"))["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def _policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]
        for o in objs
        if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == EGRESS
    }


def test_kernels_of_every_namespace_reach_the_proxy_on_its_port_only() -> None:
    objs = build("base")
    policy = _policies(objs)["egress-proxy"]
    assert policy["podSelector"]["matchLabels"] == EGRESS_SELECTOR
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {}
    assert peer["podSelector"]["matchLabels"].items() <= labels(_session()).items()
    assert rule["ports"] == [{"port": PROXY_PORT, "protocol": "TCP"}]
    ingress = [r for p in _policies(objs).values() for r in p.get("ingress", [])]
    assert [r["ports"] for r in ingress if r is not rule] == [[{"port": 9090, "protocol": "TCP"}]]


def test_the_proxy_goes_out_anywhere_and_the_feeder_to_the_api_server_and_dns() -> None:
    """A NetworkPolicy cannot name hosts: the proxy's own rules refuse private ones. The
    link-local ranges (metadata services), which no rule may list, are closed here too."""
    policies = _policies(build("base"))
    (out,) = policies["egress-proxy"]["egress"]
    assert out == {
        "to": [
            {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}},
            {"ipBlock": {"cidr": "::/0", "except": ["fe80::/10", "fd00:ec2::254/128"]}},
        ]
    }
    api = policies["allow-api-server"]
    assert sorted(p["port"] for p in api["egress"][0]["ports"]) == [443, 6443]
    dns = policies["allow-dns"]["egress"][0]
    assert dns["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}
    ]
    assert policies["default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}


def test_prometheus_finds_the_feeder_by_its_annotations_and_may_reach_it() -> None:
    objs = build("base")
    template = deployment(objs)["spec"]["template"]
    host, _, port = flag(containers(objs)["feeder"], "--metrics").rpartition(":")
    assert host == "0.0.0.0"
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": port,
        "prometheus.io/path": "/metrics",
    }
    named = next(p for p in containers(objs)["feeder"]["ports"] if p["name"] == "metrics")
    assert named["containerPort"] == int(port)
    (rule,) = _policies(objs)["metrics"]["ingress"]
    assert rule == {
        "from": [{"namespaceSelector": {"matchLabels": {"mcpforge.dev/monitoring": "true"}}}],
        "ports": [{"port": int(port), "protocol": "TCP"}],
    }
