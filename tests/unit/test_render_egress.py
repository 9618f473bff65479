"""A cluster session's egress as rendered (control/render_egress.py), its grant
(egress/grant.py) and the kernel's trust bundle (kernelside/launch.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from test_render import session as render_session

from mcp_forge.api import kernelsession
from mcp_forge.api.connection import ConnectionInfo
from mcp_forge.api.keys import new_egress_ca
from mcp_forge.api.secret import Secret
from mcp_forge.control import render_egress
from mcp_forge.control.egress import pod_addresses
from mcp_forge.control.render import render_kubernetes
from mcp_forge.control.render_egress import Route
from mcp_forge.egress import grant
from mcp_forge.egress.protocol import token_for
from mcp_forge.errors import SecretError
from mcp_forge.kernelside import launch

K8S_VERSION = "1.30.0"
ROUTE = Route("10.96.0.44:3128", "mcp-forge-egress")
CONN = ConnectionInfo("tcp", "", "k" * 64)
INJECT = {
    "header": "Authorization",
    "prefix": "Bearer ",
    "secretKeyRef": {"name": "api", "key": "t"},
}


def session(allow: list[dict[str, Any]] | None = None) -> kernelsession.KernelSession:
    return render_session(**({"network": {"allow": allow}} if allow else {}))


def rendered(s: kernelsession.KernelSession, **kw: Any) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in render_kubernetes(s, CONN, egress=ROUTE, **kw)}


def test_a_session_without_a_list_renders_no_way_out_even_with_a_proxy_installed() -> None:
    objs = rendered(session())
    env = {e["name"] for e in objs["Pod"]["spec"]["containers"][0]["env"]}
    assert not env & {"HTTP_PROXY", "HTTPS_PROXY", render_egress.TOKEN_ENV}
    assert objs["NetworkPolicy"]["spec"]["egress"] == []
    assert set(objs["Secret"]["stringData"]) == {"connection.json"}


def test_a_listed_session_reaches_the_proxy_only_with_its_credential_by_reference() -> None:
    objs = rendered(session([{"host": "pypi.org"}]))
    pod, policy, secret = objs["Pod"], objs["NetworkPolicy"], objs["Secret"]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    token = token_for("k" * 64)
    assert secret["stringData"][render_egress.TOKEN_KEY] == token
    assert env[render_egress.TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": render_egress.TOKEN_KEY,
    }
    url = f"http://session:$({render_egress.TOKEN_ENV})@10.96.0.44:3128"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[name]["value"] == url
    # The kubelet expands $(VAR) only for a variable defined before it.
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.index(render_egress.TOKEN_ENV) < names.index("HTTPS_PROXY")
    assert token not in json.dumps(pod), "the pod object holds no credential"
    assert "SSL_CERT_FILE" not in env, "no CA: the proxy reads none of its requests"
    (out,) = policy["spec"]["egress"]
    assert out["ports"] == [{"port": 3128, "protocol": "TCP"}]
    (to,) = out["to"]
    assert to["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "mcp-forge-egress"
    }
    assert to["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "egress"
    for obj in (pod, policy, secret):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_session_whose_requests_are_read_trusts_its_ca_and_never_gets_its_key() -> None:
    ca = new_egress_ca("team/demo")
    objs = rendered(session([{"host": "api.test", "inject": [INJECT]}]), egress_ca=ca)
    pod, secret = objs["Pod"], objs["Secret"]
    assert secret["stringData"][render_egress.CA_KEY] == ca.cert
    assert secret["stringData"][render_egress.CA_PRIVATE_KEY] == ca.key
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[launch.EGRESS_CA_ENV]["valueFrom"]["secretKeyRef"]["key"] == render_egress.CA_KEY
    for name in render_egress.CA_VARIABLES:
        assert env[name]["value"] == launch.EGRESS_BUNDLE
    refs = [e["valueFrom"]["secretKeyRef"]["key"] for e in env.values() if "valueFrom" in e]
    assert render_egress.CA_PRIVATE_KEY not in refs
    assert "PRIVATE KEY" not in json.dumps(pod)


def test_without_a_proxy_address_a_listed_session_renders_none_of_it() -> None:
    objs = {o["kind"]: o for o in render_kubernetes(session([{"host": "pypi.org"}]), CONN)}
    assert objs["NetworkPolicy"]["spec"]["egress"] == []
    assert "HTTPS_PROXY" not in json.dumps(objs["Pod"])


def test_the_grant_carries_rules_credential_ca_and_values_and_reads_back() -> None:
    ca = new_egress_ca("team/demo")
    s = session([{"host": "api.test", "inject": [INJECT]}])
    added = grant.values(
        s, lambda name: Secret("api", "team", {"t": b"s3cret"}, {}) if name == "api" else None
    )
    assert added == [[1, 0, "s3cret"]]
    body = grant.grant(s, "tok", ca, added, ["fd00::5", "10.244.0.7"])
    secret = grant.grant_secret(s, "mcp-forge-egress", body, {"a": "b"})
    assert secret["metadata"]["name"] == "team.demo"
    assert secret["metadata"]["labels"] == {"a": "b", grant.GRANT_LABEL: "true"}
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    back = grant.parse_grant(secret["stringData"][grant.GRANT_KEY])
    assert back == {
        "session": "team/demo",
        "token": "tok",
        "rules": [{"host": "api.test", "inject": [INJECT]}],
        "values": [[1, 0, "s3cret"]],
        "ca": {"cert": ca.cert, "key": ca.key},
        "sources": ["10.244.0.7", "fd00::5"],
    }
    assert "sources" not in grant.grant(s, "tok", ca, added)  # local mode: not bound


def test_a_pods_addresses_are_what_its_status_shows() -> None:
    assert pod_addresses(None) == [] and pod_addresses({"status": {}}) == []
    dual = {"podIP": "10.244.0.7", "podIPs": [{"ip": "10.244.0.7"}, {"ip": "fd00::5"}]}
    assert pod_addresses({"status": dual}) == ["10.244.0.7", "fd00::5"]
    assert pod_addresses({"status": {"podIP": "10.244.0.8"}}) == ["10.244.0.8"]
    # An ended pod's, or a deleting one's: given back by the kubelet, another pod's next.
    for phase in ("Succeeded", "Failed"):
        assert pod_addresses({"status": {**dual, "phase": phase}}) == []
    going = {"metadata": {"deletionTimestamp": "2026-12-05T08:00:00Z"}, "status": dual}
    assert pod_addresses(going) == []


def test_a_missing_value_is_named_by_its_field_and_never_shown() -> None:
    s = session([{"host": "api.test", "inject": [INJECT]}])
    with pytest.raises(SecretError, match=r"spec\.network\.allow\[0\]\.inject\[0\]: .*'api'"):
        grant.values(s, lambda name: None)
    with pytest.raises(SecretError, match="not a value to send") as caught:
        grant.values(s, lambda name: Secret("api", "team", {"t": b"line\nbreak"}, {}))
    assert "line" not in str(caught.value)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"session": "a/b", "token": 1, "rules": [], "values": []}',
        '{"session": "a/b", "token": "t", "rules": {}, "values": []}',
        '{"session": "a/b", "token": "t", "rules": [], "values": [], "ca": {"cert": "x"}}',
        '{"session": "a/b", "token": "t", "rules": [], "values": [], "sources": "10.0.0.1"}',
        '{"session": "a/b", "token": "t", "rules": [], "values": [], "sources": [1]}',
        "{" * 10,
    ],
)
def test_a_grant_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"grant|Expecting"):
        grant.parse_grant(text)


def test_a_grant_past_the_bound_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(ValueError, match="over"):
        grant.parse_grant(b" " * (grant.GRANT_MAX + 1))


def test_launch_writes_the_bundle_once_and_never_over_a_planted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = tmp_path / "system.pem"
    system.write_text("SYSTEM CAS\n")
    bundle, own = tmp_path / "e" / "bundle.pem", tmp_path / "e" / "own.pem"
    monkeypatch.setattr(launch, "SYSTEM_BUNDLE", str(system))
    monkeypatch.setattr(launch, "EGRESS_BUNDLE", str(bundle))
    monkeypatch.setattr(launch, "EGRESS_CA_FILE", str(own))
    launch.write_trust("SESSION CA\n")
    assert bundle.read_text() == "SYSTEM CAS\nSESSION CA\n"
    assert own.read_text() == "SESSION CA\n"
    assert os.stat(bundle.parent).st_mode & 0o777 == 0o700
    with pytest.raises(FileExistsError):
        launch.write_trust("ANOTHER CA\n")
