"""The KernelSession schema: defaults, and a clear error naming the field for each rule."""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcp_forge.api import egress, kernelsession
from mcp_forge.errors import InvalidSession

BASE: dict[str, Any] = {
    "apiVersion": "mcpforge.dev/v1alpha1",
    "kind": "KernelSession",
    "metadata": {"name": "demo"},
    "spec": {},
}
REF: dict[str, Any] = {"valueFrom": {"secretKeyRef": {"name": "api-keys", "key": "token"}}}


def with_spec(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    body["spec"] = spec
    return body


def allow(*rules: dict[str, Any], egress: str = "None") -> dict[str, Any]:
    return with_spec(network={"egress": egress, "allow": list(rules)})


def test_defaults_fill_an_empty_spec() -> None:
    body = kernelsession.validate(BASE)
    spec = body["spec"]
    assert spec["image"] == kernelsession.default_image()
    assert spec["resources"] == {"memory": "1Gi", "cpu": "1", "pids": 256}
    assert spec["idleTimeout"] == "30m"
    assert spec["network"] == {"egress": "None"}
    assert spec["restartPolicy"] == "Always"
    assert body["metadata"]["namespace"] == "default"
    typed = kernelsession.load(body).spec
    assert typed.memory_bytes == 2**30
    assert typed.cpu_milli == 1000
    assert typed.idle_timeout == 1800
    assert (typed.operating_mode, typed.idle_action) == ("Running", "Delete")
    assert (typed.max_lifetime, typed.update_strategy) == (0.0, "OnRestart")


def test_the_input_object_is_not_modified() -> None:
    body = copy.deepcopy(BASE)
    kernelsession.validate(body)
    assert body == BASE


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({**BASE, "apiVersion": "v1"}, "apiVersion", "mcpforge.dev/v1alpha1"),
        ({**BASE, "kind": "Pod"}, "kind", "KernelSession"),
        ({**BASE, "metadata": {}}, "metadata.name", "required"),
        ({**BASE, "metadata": {"name": "Bad_Name"}}, "metadata.name", "a-z"),
        ({**BASE, "metadata": {"name": "x" * 41}}, "metadata.name", "40"),
        ({**BASE, "metadata": {"name": "9lives"}}, "metadata.name", "starting with a letter"),
        (with_spec(image=""), "spec.image", "non-empty"),
        (with_spec(image="bad image"), "spec.image", "pattern"),
        (with_spec(resources={"memory": "1GB"}), "spec.resources.memory", "pattern"),
        (with_spec(resources={"memory": "1Mi"}), "spec.resources.memory", "at least 64Mi"),
        (with_spec(resources={"cpu": "fast"}), "spec.resources.cpu", "pattern"),
        (with_spec(resources={"cpu": "10m"}), "spec.resources.cpu", "at least 50m"),
        (with_spec(resources={"pids": 5}), "spec.resources.pids", "minimum"),
        (with_spec(resources={"pids": "many"}), "spec.resources.pids", "integer"),
        (with_spec(idleTimeout="5 minutes"), "spec.idleTimeout", "pattern"),
        (with_spec(workspace={"persistent": "yes"}), "spec.workspace.persistent", "boolean"),
        (with_spec(workspace={"reclaimPolicy": "Keep"}), "spec.workspace.reclaimPolicy", "Retain"),
        (
            with_spec(workspace={"reclaimPolicy": "Retain"}),
            "spec.workspace.reclaimPolicy",
            "set spec.workspace.persistent: true",
        ),
        (
            with_spec(workspace={"persistent": False, "storageClassName": "fast"}),
            "spec.workspace.persistent",
            "contradicts spec.workspace.storageClassName",
        ),
        (
            with_spec(workspace={"storageClassName": "Fast!"}),
            "spec.workspace.storageClassName",
            "pattern",
        ),
        (with_spec(env=[{"value": "x"}]), "spec.env[0].name", "required"),
        (with_spec(env=[{"name": "1X"}]), "spec.env[0].name", "pattern"),
        (with_spec(env=[{"name": "A"}, {"name": "A"}]), "spec.env[1].name", "duplicate"),
        (with_spec(env=[{"name": "MCPFORGE_X"}]), "spec.env[0].name", "reserved"),
        (with_spec(env=[{"name": "A"}] * 65), "spec.env", "too long"),
        (with_spec(env="A=1"), "spec.env", "array"),
        (
            with_spec(env=[{"name": "A", "value": "1"}, {"name": "B", "value": "2", **REF}]),
            "spec.env[1].valueFrom",
            "exclude each other",
        ),
        (
            with_spec(env=[{"name": "A", "valueFrom": {}}]),
            "spec.env[0].valueFrom.secretKeyRef",
            "required",
        ),
        (
            with_spec(
                env=[{"name": "A", "valueFrom": {**REF["valueFrom"], "configMapKeyRef": {}}}]
            ),
            "spec.env[0].valueFrom.configMapKeyRef",
            "unknown field",
        ),
        (
            with_spec(env=[{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]),
            "spec.env[0].valueFrom.secretKeyRef.key",
            "required",
        ),
        (
            with_spec(
                env=[{"name": "A", "valueFrom": {"secretKeyRef": {"name": "Bad", "key": "k"}}}]
            ),
            "spec.env[0].valueFrom.secretKeyRef.name",
            "pattern",
        ),
        (
            with_spec(
                env=[{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s" * 254, "key": "k"}}}]
            ),
            "spec.env[0].valueFrom.secretKeyRef.name",
            "too long",
        ),
        (
            with_spec(
                env=[{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a/b"}}}]
            ),
            "spec.env[0].valueFrom.secretKeyRef.key",
            "pattern",
        ),
        (with_spec(workspace={"size": "lots"}), "spec.workspace.size", "pattern"),
        (with_spec(sharedGroup="Team A"), "spec.sharedGroup", "pattern"),
        (with_spec(network={"egress": "Some"}), "spec.network.egress", "one of None, All"),
        (with_spec(restartPolicy="Sometimes"), "spec.restartPolicy", "one of Always, Never"),
        (allow({"ports": [443]}), "spec.network.allow[0].host", "required"),
        (allow({"host": "a..example.com"}), "spec.network.allow[0].host", "label"),
        (allow({"host": "10.0.0.1"}), "spec.network.allow[0].host", "an IP address"),
        (allow({"host": "*.com"}), "spec.network.allow[0].host", "too broad"),
        (allow({"host": "x" * 254}), "spec.network.allow[0].host", "too long"),
        (allow({"host": "a.example", "ports": [0]}), "spec.network.allow[0].ports[0]", "minimum"),
        (allow({"host": "a.example", "ports": []}), "spec.network.allow[0].ports", "non-empty"),
        (
            allow({"host": "a.example", "methods": ["TRACE"]}),
            "spec.network.allow[0].methods[0]",
            "one of GET, HEAD",
        ),
        (allow({"host": "a.example", "paths": ["v1"]}), "spec.network.allow[0].paths", "'/'"),
        (
            allow({"host": "a.example", "paths": ["/v1/../admin"]}),
            "spec.network.allow[0].paths",
            "no '.' or '..' segment",
        ),
        (
            allow({"host": "a.example", "paths": ["/a"] * (egress.PATHS_MAX + 1)}),
            "spec.network.allow[0].paths",
            "too long",
        ),
        (
            allow({"host": "a.example", "addresses": ["127.0.0.0/8"]}),
            "spec.network.allow[0].addresses",
            "overlaps",
        ),
        (
            allow({"host": "a.example", "addresses": ["10.1.2.3/8"]}),
            "spec.network.allow[0].addresses",
            "host bits",
        ),
        (
            allow({"host": "a.example", "addresses": ["10.0.0.0/255.0.0.0"]}),
            "spec.network.allow[0].addresses[0]",
            "pattern",
        ),
        (allow({"host": "a.example", "proxy": "x"}), "spec.network.allow[0].proxy", "unknown"),
        (allow(*[{"host": "a.example"}] * 65), "spec.network.allow", "too long"),
        (
            allow({"host": "pypi.org"}, egress="All"),
            "spec.network.allow",
            "egress All already opens every destination; an allow-list needs egress None",
        ),
        (with_spec(mcpServers=[{"allow": ["x"]}]), "spec.mcpServers[0].name", "required"),
        (
            with_spec(mcpServers=[{"name": "a"}, {"name": "a"}]),
            "spec.mcpServers[1].name",
            "duplicate",
        ),
        (with_spec(files=[{"path": "../up", "content": ""}]), "spec.files[0].path", "pattern"),
        (with_spec(files=[{"path": "/etc/x", "content": ""}]), "spec.files[0].path", "pattern"),
        (with_spec(files=[{"path": "a/./b", "content": ""}]), "spec.files[0].path", "pattern"),
        (with_spec(files=[{"path": "a"}]), "spec.files[0].content", "required"),
        (
            with_spec(files=[{"path": "a", "content": "x" * 65537}]),
            "spec.files[0].content",
            "too long",
        ),
        (
            with_spec(files=[{"path": "a", "content": ""}, {"path": "a", "content": "2"}]),
            "spec.files[1].path",
            "duplicate",
        ),
        (with_spec(files=[{"path": "a", "content": ""}] * 17), "spec.files", "too long"),
        (with_spec(gpus=1), "spec.gpus", "unknown field"),
        (
            with_spec(resources={"memory": "1Gi", "disk": "1Gi"}),
            "spec.resources.disk",
            "unknown field",
        ),
    ],
)
def test_an_invalid_session_names_the_field(body: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidSession) as err:
        kernelsession.validate(body)
    assert err.value.field == field
    assert words in str(err.value)


def test_env_takes_a_value_a_secret_key_or_a_name_alone() -> None:
    body = kernelsession.validate(
        with_spec(env=[{"name": "A", "value": "1"}, {"name": "T", **REF}, {"name": "E"}])
    )
    assert body["spec"]["env"][2] == {"name": "E"}  # no value defaulted: valueFrom may follow
    env = kernelsession.load(body).spec.env
    assert [(e.name, e.value, e.secret) for e in env] == [
        ("A", "1", None),
        ("T", "", ("api-keys", "token")),
        ("E", "", None),
    ]
    dotted = {"valueFrom": {"secretKeyRef": {"name": "a.b-c", "key": "-._Ab9"}}}
    assert kernelsession.validate(with_spec(env=[{"name": "A", **dotted}]))


def test_mcp_servers_carry_a_policy_and_a_typo_is_named() -> None:
    body = kernelsession.validate(with_spec(mcpServers=[{"name": "time", "readOnly": True}]))
    assert body["spec"]["mcpServers"] == [{"name": "time", "readOnly": True}]
    with pytest.raises(InvalidSession) as err:
        kernelsession.validate(with_spec(mcpServers=[{"name": "time", "readonly": True}]))
    assert "readonly" in str(err.value)


def test_an_allow_list_is_parsed_into_egress_rules_and_stored_as_written() -> None:
    rules: list[dict[str, Any]] = [
        {"host": "pypi.org"},
        {"host": "*.PythonHosted.org."},
        {"host": "api.example.com", "ports": [8443, 443], "methods": ["GET"], "paths": ["/v1/"]},
        {"host": "mirror.internal.example", "addresses": ["10.20.0.0/16"]},
    ]
    body = kernelsession.validate(allow(*rules))
    assert body["spec"]["network"]["allow"] == rules  # no default written into the objects
    spec = kernelsession.load(body).spec
    assert spec.egress_rules == egress.parse_rules(rules)
    assert [(r.number, r.host, r.ports) for r in spec.egress_rules] == [
        (1, "pypi.org", (443,)),
        (2, "*.pythonhosted.org", (443,)),
        (3, "api.example.com", (443, 8443)),
        (4, "mirror.internal.example", (443,)),
    ]
    assert spec.egress_rules[2].methods == ("GET",) and spec.egress_rules[2].paths == ("/v1/",)
    assert spec.egress_rules[3].addresses == (ipaddress.ip_network("10.20.0.0/16"),)


def test_no_allow_list_is_no_rules_and_egress_all_may_come_with_an_empty_one() -> None:
    assert kernelsession.load(kernelsession.validate(BASE)).spec.egress_rules == ()
    spec = kernelsession.load(kernelsession.validate(allow(egress="All"))).spec
    assert (spec.egress, spec.egress_rules) == ("All", ())


def test_durations_parse_into_seconds() -> None:
    assert kernelsession.parse_duration("1h30m", field="f") == 5400
    assert kernelsession.parse_duration("90s", field="f") == 90
    assert kernelsession.parse_duration("0", field="f") == 0
    with pytest.raises(InvalidSession):
        kernelsession.parse_duration("", field="f")


def test_a_yaml_stream_names_the_bad_document() -> None:
    text = yaml.safe_dump_all([BASE, with_spec(restartPolicy="x")])
    with pytest.raises(InvalidSession, match=r"document 2: spec\.restartPolicy"):
        kernelsession.parse_documents(text)


def test_broken_yaml_is_reported_as_yaml() -> None:
    with pytest.raises(InvalidSession, match="not valid YAML"):
        kernelsession.parse_documents("spec: [unclosed")


def test_the_crd_is_structural_enough_for_the_api_server() -> None:
    crd = kernelsession.crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["ks"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Age", "Last Activity"} <= columns

    def walk(node: dict[str, Any], path: str) -> None:
        # A structural schema never mixes properties with additionalProperties.
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


EXAMPLES = sorted((Path(__file__).parents[2] / "manifests" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_session_validates(path: Path) -> None:
    assert kernelsession.parse_documents(path.read_text())


def test_the_crd_carries_the_rules_local_mode_checks_in_code() -> None:
    # The API server evaluates these CEL rules; local mode checks the same in spec_of.
    spec = kernelsession.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(rule["message"] for rule in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)

    walk(spec)
    messages = " ".join(found)
    for words in (
        "at least 64Mi",
        "at least 50m",
        "env names must be unique",
        "reserved",
        "value and valueFrom exclude each other",
        "spec.files paths must be unique",
        "Retain keeps a persistent workspace",
        "asks for a persistent workspace",
        "storageClassName cannot be changed",
        kernelsession.ALLOW_WITH_ALL,
    ):
        assert words in messages


def allow_schema() -> dict[str, Any]:
    spec = kernelsession.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    schema: dict[str, Any] = spec["spec"]["properties"]["network"]["properties"]["allow"]
    return schema


def test_the_crd_allow_list_has_the_policy_limits() -> None:
    schema = allow_schema()
    item = schema["items"]["properties"]
    assert schema["maxItems"] == egress.RULES_MAX
    assert item["host"]["maxLength"] == egress.HOST_MAX
    assert item["methods"]["items"]["enum"] == list(egress.METHODS)
    assert item["paths"]["maxItems"] == egress.PATHS_MAX
    assert item["paths"]["items"]["maxLength"] == egress.PATH_MAX
    assert item["addresses"]["maxItems"] == egress.ADDRESSES_MAX
    assert "default" not in item["ports"], "443 is the policy's default, not written in objects"


_MATCHES = re.compile(r'^(!?)self\.matches\(r"(.*)"\)$')

HOSTS = [
    "pypi.org", "API.Example.com.", "*.example.com", "*.a.b.", "xn--bcher-kva.example",
    "a1.b-2.c3", "a.1a", "a.0xg", "a" * 63 + ".com", ("a" * 62 + ".") * 4 + "b",
    "*.com", "*.com.", "*.", "*", "a..b", ".a.b", "-a.com", "a-.com", "a_b.com", "a b",
    "1.2.3.4", "1.2.3.4.", "0x7f.1", "a.0x", "a.0X1f", "127.1", "2130706433", "[::1]", "::1",
    "bücher.de", "a" * 64 + ".com", "a.*.b", "**.a.b", "example.com\n", "",
]  # fmt: skip
PATHS = [
    "/", "/v1", "/v1/", "//", "/a//b", "/...", "/.a", "/..a", "/~!$&'()*+,-:=@[]^_`{|}\"",
    "v1", "", "/.", "/..", "/a/.", "/a/./b", "/a/..", "/a b", "/a%20", "/a;b", "/a?b", "/a#b",
    "/a\\b", "/é", "/a\x7f", "/a\t", "/a\n",
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "values", "rule"),
    [
        ("host", HOSTS, lambda v: {"host": v}),
        ("paths", PATHS, lambda v: {"host": "a.example", "paths": [v]}),
    ],
)
def test_the_crd_cel_rules_accept_what_the_policy_accepts(
    name: str, values: list[str], rule: Callable[[str], dict[str, Any]]
) -> None:
    """The API server refuses a host or a path prefix by the CRD's CEL rules, local mode
    by parse_rules: both say the same of each value. The rules are `matches` of RE2
    regexes that Python reads alike (`$` is the end of the text in RE2: `\\Z` here)."""
    schema = allow_schema()["items"]["properties"][name]
    schema = schema.get("items", schema)
    checks = []
    for cel in schema["x-kubernetes-validations"]:
        found = _MATCHES.match(cel["rule"])
        assert found, f"not a matches() rule this test reads: {cel['rule']}"
        checks.append((found.group(1) == "!", re.compile(found.group(2).replace("$", r"\Z"))))
    for value in values:
        by_crd = len(value) <= schema["maxLength"] and all(
            (regex.search(value) is None) == negated for negated, regex in checks
        )
        try:
            egress.parse_rules([rule(value)])
        except InvalidSession:
            by_policy = False
        else:
            by_policy = True
        assert by_crd == by_policy, value
