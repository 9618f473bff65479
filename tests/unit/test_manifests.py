"""The cluster install in manifests/: it builds, it validates, and it says what the code does.

Every kustomization is built with the kubectl on PATH (`.ci/setup` installs Debian's
kubernetes-client when there is none: kustomize v2.0.3, which the manifests are written
for). Built objects are checked against the Kubernetes 1.33 schemas; the RBAC is read
as the API server would grant it; pods are held to the Pod Security Standards'
"restricted" profile by a checker written from the PSS page; the Argo CD health script
runs in Lua 5.1, the Lua that Argo CD embeds.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from kstatus import kstatus
from mcp_forge.api import kernelsession
from mcp_forge.api.connection import BRIDGE_PORT, PORTS, ConnectionInfo
from mcp_forge.api.status import Status
from mcp_forge.cli import main as cli
from mcp_forge.control.render import GATEWAY_SELECTOR, labels, render_kubernetes
from mcp_forge.errors import InvalidSession
from mcp_forge.image import control_plane
from mcp_forge.settings import Settings

ROOT = Path(__file__).parents[2]
MANIFESTS = ROOT / "manifests"
CONTAINERFILE = ROOT / "images" / "Containerfile.control-plane"
K8S_VERSION = "1.33"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

SYSTEM = "mcp-forge-system"
SESSIONS = "mcp-forge-sessions"
OPERATOR_SA = (SYSTEM, "mcp-forge-operator")
GATEWAY_SA = (SYSTEM, "mcp-forge-gateway")
TOKENS_SECRET = "mcp-forge-gateway-tokens"
CLUSTER = "*"  # the scope of a grant made by a ClusterRoleBinding

KUSTOMIZATIONS = sorted(  # of the install; examples/ hold sessions (checked as such)
    p.parent.relative_to(MANIFESTS).as_posix()
    for p in MANIFESTS.rglob("kustomization.yaml")
    if "examples" not in p.relative_to(MANIFESTS).parts
)
INSTALLS = ["base", "overlays/gvisor", "overlays/namespace-scoped"]
EXAMPLES = sorted((MANIFESTS / "examples").glob("*.yaml"))


# ---- building --------------------------------------------------------------------------------


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("no kubectl on PATH: run .ci/setup (it installs Debian's kubernetes-client)")
    return kubectl


def kustomize(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@functools.cache
def _built(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(MANIFESTS / name))


def build(name: str) -> list[dict[str, Any]]:
    """The objects of manifests/<name>, a fresh copy each call."""
    return copy.deepcopy(list(_built(name)))


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def find(objs: list[dict[str, Any]], kind: str, name: str, namespace: str = "") -> dict[str, Any]:
    found = [o for o in objs if key(o) == (kind, namespace, name)]
    assert found, f"no {kind} {namespace}/{name}"
    return found[0]


def container(objs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec = find(objs, "Deployment", deployment, SYSTEM)["spec"]["template"]["spec"]
    c: dict[str, Any]
    (c,) = spec["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# ---- the images ------------------------------------------------------------------------------


def containerfile_stages(text: str) -> dict[str, dict[str, Any]]:
    """Each stage's FROM, ENTRYPOINT, CMD, USER, LABELs and RUNs, inherited from its parent."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    stages: dict[str, dict[str, Any]] = {}
    stage: dict[str, Any] = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            parts = rest.split()
            base = parts[0]
            stage = copy.deepcopy(stages[base]) if base in stages else {"base": base, "labels": {}}
            stage["runs"] = []
            stages[parts[2] if len(parts) == 3 else f"#{len(stages)}"] = stage
        elif word in ("ENTRYPOINT", "CMD"):
            stage[word.lower()] = yaml.safe_load(rest)  # the exec form is a JSON array
        elif word == "USER":
            stage["user"] = rest
        elif word == "LABEL":
            stage["labels"].update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "RUN":
            stage["runs"].append(rest)
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, dict[str, Any]]:
    return containerfile_stages(CONTAINERFILE.read_text())


def argv(stages: dict[str, dict[str, Any]], objs: list[dict[str, Any]], name: str) -> list[str]:
    """What the Deployment's container runs: the image's entrypoint, then its args."""
    c = container(objs, f"mcp-forge-{name}")
    assert "command" not in c, "the entrypoint comes from the image"
    return [*stages[name]["entrypoint"], *c["args"]]


def test_the_images_are_built_from_this_repository_on_debian_bookworm(
    stages: dict[str, dict[str, Any]],
) -> None:
    for name in ("operator", "gateway"):
        stage = stages[name]
        assert "bookworm" in stage["base"]
        assert stage["labels"]["org.opencontainers.image.version"] == VERSION
        uid, _, gid = stage["user"].partition(":")
        assert int(uid) > 0 and int(gid) > 0, "a numeric non-root user, so runAsNonRoot can check"
    installs = [r for r in stages["build"]["runs"] if re.search(r"pip install [^&]*\s\.(\s|$)", r)]
    assert installs, "the package is pip-installed from the repository (pip install .)"


def test_the_images_run_the_operator_and_the_cluster_gateway(
    stages: dict[str, dict[str, Any]],
) -> None:
    assert stages["operator"]["entrypoint"] == ["/opt/mcp-forge/bin/mcp-forge", "operator"]
    assert stages["gateway"]["entrypoint"] == [
        "/opt/mcp-forge/bin/mcp-forge",
        "gateway",
        "--kubernetes",
    ]


def test_the_offline_build_makes_the_containerfiles_targets(
    stages: dict[str, dict[str, Any]],
) -> None:
    """`mcp-forge image build --control-plane` and the Containerfile make the same images."""
    for name, (entrypoint, cmd) in control_plane.TARGETS.items():
        assert stages[name]["entrypoint"] == entrypoint, name
        assert stages[name]["cmd"] == cmd, name
        assert stages[name]["user"] == f"{control_plane.UID}:{control_plane.UID}"
        assert control_plane.image_ref(name) == f"ghcr.io/mcp-forge/{name}:{VERSION}"


def test_the_deployments_use_the_images_of_this_version() -> None:
    objs = build("base")
    assert container(objs, "mcp-forge-operator")["image"] == f"ghcr.io/mcp-forge/operator:{VERSION}"
    assert container(objs, "mcp-forge-gateway")["image"] == f"ghcr.io/mcp-forge/gateway:{VERSION}"
    crd = find(objs, "CustomResourceDefinition", "kernelsessions.mcpforge.dev")
    image = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["image"]
    assert image["default"] == f"localhost/mcp-forge-kernel:{VERSION}"


def parse_cli(args: list[str]) -> None:
    """Parse `mcp-forge COMMAND FLAGS...` as the CLI would, without running it."""
    program, command, *flags = args
    assert Path(program).name == "mcp-forge"
    with click.Context(cli, info_name="mcp-forge") as ctx:
        sub = cli.get_command(ctx, command)
        assert sub is not None, f"mcp-forge has no command {command!r}"
        sub.make_context(command, flags, parent=ctx)  # raises on a flag it does not have


@pytest.mark.parametrize("install", INSTALLS)
def test_the_deployments_run_commands_and_flags_the_cli_has(
    install: str, stages: dict[str, dict[str, Any]]
) -> None:
    objs = build(install)
    for name in ("operator", "gateway"):
        parse_cli(argv(stages, objs, name))


def test_each_image_run_without_arguments_runs_what_the_cli_has(
    stages: dict[str, dict[str, Any]],
) -> None:
    for name in ("operator", "gateway"):
        parse_cli([*stages[name]["entrypoint"], *stages[name]["cmd"]])


@pytest.mark.parametrize("install", INSTALLS)
@pytest.mark.parametrize("name", ["operator", "gateway"])
def test_every_setting_a_deployment_gives_is_one_the_package_reads(
    install: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dep = find(build(install), "Deployment", f"mcp-forge-{name}", SYSTEM)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    expected = {}
    for var in c.get("env", []):
        assert var["name"].startswith("MCPFORGE_"), var
        if "valueFrom" in var:
            assert var["valueFrom"] == {
                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}
            }
            value = dep["metadata"]["namespace"]
        else:
            value = var["value"]
        monkeypatch.setenv(var["name"], value)
        expected[var["name"].removeprefix("MCPFORGE_").lower()] = value
    settings = Settings.from_env()
    for field, value in expected.items():
        assert getattr(settings, field) == value, f"MCPFORGE_{field.upper()}"


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
def test_every_namespaced_object_names_one_of_the_two_namespaces(name: str) -> None:
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    for obj in build(name):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert namespace is None, key(obj)
        else:
            assert namespace in (SYSTEM, SESSIONS), key(obj)
        if obj["kind"] != "CustomResourceDefinition":  # crds/ is taken as it is
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "mcp-forge", key(obj)


def test_both_namespaces_enforce_the_restricted_pod_security_standard() -> None:
    objs = build("base")
    for namespace in (SYSTEM, SESSIONS):
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
                ],
            }
        )
    )
    objs = kustomize(tmp_path)
    assert container(objs, "mcp-forge-operator")["image"] == "registry.example/op:dev"
    assert container(objs, "mcp-forge-gateway")["image"] == f"registry.example/gw:{VERSION}"


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
    }


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
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.add((scope, group, res, verb))
    return out


def expand(scope: str, table: dict[tuple[str, str], str]) -> set[Grant]:
    return {
        (scope, group, res, verb) for (group, res), verbs in table.items() for verb in verbs.split()
    }


OPERATOR_RULES = {
    # delete: a session idle past its idleTimeout with idleAction Delete is deleted.
    ("mcpforge.dev", "kernelsessions"): "get list watch patch delete",
    ("mcpforge.dev", "kernelsessions/status"): "get patch",
    # Pools: filled and counted (status); kopf's own annotations are patches.
    ("mcpforge.dev", "kernelsessionpools"): "get list watch patch",
    ("mcpforge.dev", "kernelsessionpools/status"): "get patch",
    ("", "pods"): "get list watch create patch delete",
    ("", "services"): "get list watch create patch delete",
    ("", "secrets"): "get list create patch delete",  # never watched
    ("networking.k8s.io", "networkpolicies"): "get list watch create patch delete",
    ("coordination.k8s.io", "leases"): "get list watch create patch delete",
    # A persistent workspace's claim: made, its owner set per reclaimPolicy; deleted by the
    # garbage collector with its session, never by the operator.
    ("", "persistentvolumeclaims"): "get create patch",
    ("", "events"): "create patch",
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


def test_the_namespace_scoped_operator_has_no_cluster_wide_grant() -> None:
    granted = grants(build("overlays/namespace-scoped"), OPERATOR_SA)
    assert granted == expand(SESSIONS, OPERATOR_RULES)


def test_users_get_kernel_sessions_through_the_built_in_roles() -> None:
    objs = build("base")
    edit = find(objs, "ClusterRole", "mcp-forge-kernelsession-edit")["metadata"]["labels"]
    view = find(objs, "ClusterRole", "mcp-forge-kernelsession-view")["metadata"]["labels"]
    assert edit["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["rbac.authorization.k8s.io/aggregate-to-view"] == "true"


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


def test_both_namespaces_deny_all_traffic_by_default() -> None:
    objs = build("base")
    for namespace in (SYSTEM, SESSIONS):
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


# ---- Pod Security Standards, "restricted" ----------------------------------------------------

# From https://kubernetes.io/docs/concepts/security/pod-security-standards/ (v1.33).
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _context_violations(where: str, sc: dict[str, Any]) -> list[str]:
    """Baseline rules that read the same in a pod's and a container's securityContext."""
    out = []
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}: hostProcess")
    se = sc.get("seLinuxOptions") or {}
    if se.get("user") or se.get("role") or se.get("type", "") not in SELINUX_TYPES:
        out.append(f"{where}: seLinuxOptions")
    if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") == "Unconfined":
        out.append(f"{where}: appArmorProfile Unconfined")
    if sc.get("runAsUser") == 0:
        out.append(f"{where}: runAsUser 0")
    return out


def pss_restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every way `pod_spec` breaks the restricted profile (which includes baseline)."""
    out: list[str] = []
    psc = pod_spec.get("securityContext") or {}
    containers = [
        *pod_spec.get("initContainers", []),
        *pod_spec.get("containers", []),
        *pod_spec.get("ephemeralContainers", []),
    ]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(host):
            out.append(f"{host}")
    out += _context_violations("pod", psc)
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {volume['name']}: {', '.join(sorted(kinds - ALLOWED_VOLUMES))}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    for c in containers:
        name = c["name"]
        sc = c.get("securityContext") or {}
        out += _context_violations(name, sc)
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        added = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"{name}: capabilities add {', '.join(sorted(added))}")
    return out


CONN = ConnectionInfo("tcp", "", "k" * 64)


def _session(**spec: Any) -> kernelsession.KernelSession:
    body = kernelsession.validate(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "demo", "namespace": SESSIONS, "uid": "1234-abcd"},
            "spec": spec,
        }
    )
    return kernelsession.load(body)


def kernel_pod(**spec: Any) -> dict[str, Any]:
    objs = render_kubernetes(_session(**spec), CONN, gateway_namespace=SYSTEM)
    (pod,) = [o for o in objs if o["kind"] == "Pod"]
    return pod


@pytest.mark.parametrize(
    "spec",
    [{}, {"sharedGroup": "team", "network": {"egress": "All"}}],
    ids=["default", "shared-and-egress"],
)
def test_the_kernel_pod_passes_the_restricted_pod_security_standard(spec: dict[str, Any]) -> None:
    assert pss_restricted_violations(kernel_pod(**spec)["spec"]) == []


@pytest.mark.parametrize("name", INSTALLS)
def test_the_operator_and_gateway_pods_pass_the_restricted_pod_security_standard(
    name: str,
) -> None:
    for dep in (o for o in build(name) if o["kind"] == "Deployment"):
        assert pss_restricted_violations(dep["spec"]["template"]["spec"]) == [], key(dep)


_REMOVE = object()


def _break(path: str, value: Any) -> Any:
    """A change to a pod spec at a dotted path (list items by index), or its removal."""

    def change(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        index: Any = int(last) if last.isdigit() else last
        if value is _REMOVE:
            node.pop(index)
        else:
            node[index] = value

    return change


VIOLATIONS = {
    "privileged": (_break("containers.0.securityContext.privileged", True), "privileged"),
    "host network": (_break("hostNetwork", True), "hostNetwork"),
    "host PID": (_break("hostPID", True), "hostPID"),
    "hostPath": (
        _break("volumes", [{"name": "host", "hostPath": {"path": "/etc"}}]),
        "hostPath",
    ),
    "hostPort": (_break("containers.0.ports.0.hostPort", 5555), "hostPort"),
    "root user": (_break("containers.0.securityContext.runAsUser", 0), "runAsUser 0"),
    "root pod": (_break("securityContext.runAsUser", 0), "runAsUser 0"),
    "no runAsNonRoot": (
        lambda s: (
            s["securityContext"].pop("runAsNonRoot"),
            s["containers"][0]["securityContext"].pop("runAsNonRoot"),
        ),
        "runAsNonRoot",
    ),
    "escalation": (
        _break("containers.0.securityContext.allowPrivilegeEscalation", True),
        "allowPrivilegeEscalation",
    ),
    "escalation unset": (
        _break("containers.0.securityContext.allowPrivilegeEscalation", _REMOVE),
        "allowPrivilegeEscalation",
    ),
    "capability added": (
        _break("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
        "SYS_ADMIN",
    ),
    "capabilities kept": (
        _break("containers.0.securityContext.capabilities.drop", ["NET_RAW"]),
        "drop ALL",
    ),
    "seccomp unconfined": (
        _break("containers.0.securityContext.seccompProfile", {"type": "Unconfined"}),
        "seccompProfile",
    ),
    "no seccomp": (
        lambda s: (
            s["securityContext"].pop("seccompProfile"),
            s["containers"][0]["securityContext"].pop("seccompProfile"),
        ),
        "seccompProfile",
    ),
    "unsafe sysctl": (
        _break("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
        "kernel.msgmax",
    ),
    "unmasked proc": (_break("containers.0.securityContext.procMount", "Unmasked"), "procMount"),
    "SELinux user": (_break("securityContext.seLinuxOptions", {"user": "system_u"}), "seLinux"),
    "AppArmor off": (
        _break("containers.0.securityContext.appArmorProfile", {"type": "Unconfined"}),
        "appArmorProfile",
    ),
    "host IPC": (_break("hostIPC", True), "hostIPC"),
    "bare init container": (
        _break("initContainers", [{"name": "init", "image": "busybox"}]),
        "init: allowPrivilegeEscalation",
    ),
}


@pytest.mark.parametrize("violation", VIOLATIONS, ids=list(VIOLATIONS))
def test_the_pod_security_checker_catches_a_violating_pod(violation: str) -> None:
    change, words = VIOLATIONS[violation]
    spec = kernel_pod()["spec"]
    change(spec)
    found = pss_restricted_violations(spec)
    assert any(words in v for v in found), found


# ---- the example sessions --------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_a_valid_kernel_session(path: Path) -> None:
    for body in kernelsession.parse_documents(path.read_text()):
        assert body["metadata"]["namespace"] in ("default", SESSIONS)


def test_the_gitops_example_suspends_when_idle_and_keeps_its_updates_for_a_restart() -> None:
    (body,) = kernelsession.parse_documents((MANIFESTS / "examples" / "gitops.yaml").read_text())
    spec = body["spec"]
    assert spec["idleAction"] == "Suspend"
    assert spec["operatingMode"] == "Running"
    assert spec["updateStrategy"] == "OnRestart"
    assert body["metadata"]["namespace"] == SESSIONS


def _gitops(**spec: Any) -> dict[str, Any]:
    (body,) = yaml.safe_load_all((MANIFESTS / "examples" / "gitops.yaml").read_text())
    body["spec"].update(spec)
    return dict(body)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (_gitops(idleAction="Hibernate"), "spec.idleAction", "one of Delete, Suspend"),
        (_gitops(operatingMode="Paused"), "spec.operatingMode", "one of Running, Suspended"),
        (_gitops(updateStrategy="Now"), "spec.updateStrategy", "one of OnRestart, Recreate"),
        (_gitops(maxLifetime="1 day"), "spec.maxLifetime", "pattern"),
        (_gitops(resources={"memory": "2GB"}), "spec.resources.memory", "pattern"),
        (_gitops(idleActions="Suspend"), "spec.idleActions", "unknown field"),
    ],
    ids=["idleAction", "operatingMode", "updateStrategy", "maxLifetime", "memory", "typo"],
)
def test_an_invalid_variant_of_an_example_is_rejected_naming_the_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidSession) as err:
        kernelsession.validate(body)
    assert err.value.field == field
    assert words in str(err.value)


# ---- Argo CD health --------------------------------------------------------------------------

HEALTH_LUA = MANIFESTS / "argocd" / "health.lua"


def lua_literal(value: Any) -> str:
    """A Python value as a Lua 5.1 table constructor (JSON-shaped data only)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(v) for v in value) + "}"
    return "{" + ", ".join(f"[{lua_literal(k)}] = {lua_literal(v)}" for k, v in value.items()) + "}"


@pytest.fixture(scope="module")
def lua() -> str:
    found = shutil.which("lua5.1")
    if found is None:
        pytest.fail("no lua5.1 on PATH: run .ci/setup (Argo CD's health scripts are Lua 5.1)")
    return found


def argocd_health(
    lua: str, obj: dict[str, Any], tmp_path: Path, script: Path = HEALTH_LUA
) -> tuple[str, str]:
    harness = tmp_path / "harness.lua"
    harness.write_text(
        f"obj = {lua_literal(obj)}\n"
        f"local hs = dofile({lua_literal(str(script))})\n"
        'io.write(hs.status, "\\n", hs.message or "")\n'
    )
    done = subprocess.run([lua, str(harness)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    status, _, message = done.stdout.partition("\n")
    return status, message


def _session_status(generation: int = 3, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "research", "namespace": SESSIONS, "generation": generation},
        "spec": {},
    }
    if status:
        obj["status"] = status
    return obj


def _ready(value: str, message: str = "", **extra: Any) -> list[dict[str, Any]]:
    return [{"type": "Ready", "status": value, "reason": "R", "message": message, **extra}]


HEALTH_CASES = {
    "no status yet": (_session_status(), "Progressing"),
    "ready": (
        _session_status(observedGeneration=3, phase="Ready", conditions=_ready("True", "up")),
        "Healthy",
    ),
    "ready for an older spec": (
        _session_status(observedGeneration=2, phase="Ready", conditions=_ready("True")),
        "Progressing",
    ),
    "ready condition of an older spec": (
        _session_status(
            observedGeneration=3, phase="Ready", conditions=_ready("True", observedGeneration=2)
        ),
        "Progressing",
    ),
    "starting": (
        _session_status(observedGeneration=3, phase="Starting", conditions=_ready("False")),
        "Progressing",
    ),
    "restarting": (
        _session_status(observedGeneration=3, phase="Restarting", conditions=_ready("False")),
        "Progressing",
    ),
    "suspended": (
        _session_status(observedGeneration=3, phase="Suspended", conditions=_ready("False")),
        "Suspended",
    ),
    "failed": (
        _session_status(
            observedGeneration=3, phase="Failed", conditions=_ready("False", "OOMKilled at 1Gi")
        ),
        "Degraded",
    ),
    "expired": (
        _session_status(observedGeneration=3, phase="Expired", message="maxLifetime 8h passed"),
        "Degraded",
    ),
    "no progress past its deadline": (
        _session_status(
            observedGeneration=3,
            phase="Starting",
            conditions=[
                *_ready("False", "not Ready after 600s: 0/1 nodes are available"),
                {"type": "Stalled", "status": "True", "reason": "Unschedulable"},
            ],
        ),
        "Degraded",
    ),
}


@pytest.mark.parametrize("case", HEALTH_CASES, ids=list(HEALTH_CASES))
def test_the_argocd_health_script_reads_a_session_as_argocd_should(
    case: str, lua: str, tmp_path: Path
) -> None:
    obj, expected = HEALTH_CASES[case]
    status, message = argocd_health(lua, obj, tmp_path)
    assert status == expected, message
    assert message


def test_the_argocd_health_script_passes_on_the_operators_message(lua: str, tmp_path: Path) -> None:
    _, message = argocd_health(lua, HEALTH_CASES["failed"][0], tmp_path)
    assert message == "OOMKilled at 1Gi"
    _, message = argocd_health(lua, HEALTH_CASES["expired"][0], tmp_path)
    assert message == "maxLifetime 8h passed"


def test_the_argocd_cm_snippet_carries_the_health_scripts_verbatim() -> None:
    snippet = yaml.safe_load((MANIFESTS / "argocd" / "argocd-cm.yaml").read_text())
    key = "resource.customizations.health.mcpforge.dev_"
    assert snippet == {
        "data": {
            key + "KernelSession": HEALTH_LUA.read_text(),
            key + "KernelSessionPool": POOL_HEALTH_LUA.read_text(),
        }
    }


POOL_HEALTH_LUA = MANIFESTS / "argocd" / "pool-health.lua"


def _pool(generation: int = 2, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": "warm", "namespace": SESSIONS, "generation": generation},
        "spec": {"size": 2},
    }
    if status:
        obj["status"] = status
    return obj


def _pool_conditions(ready: str, reason: str, stalled: str = "False") -> list[dict[str, Any]]:
    return [
        {"type": "Ready", "status": ready, "reason": reason, "message": f"{reason} message"},
        {"type": "Stalled", "status": stalled, "reason": reason, "message": f"{reason} stuck"},
    ]


# A pool's status -> Argo CD health (pool-health.lua) and kstatus (Flux), side by side.
POOL_CASES = {
    "not seen yet (the CRD's default)": (_pool(observedGeneration=0), "Progressing", "InProgress"),
    "filling": (
        _pool(observedGeneration=2, conditions=_pool_conditions("False", "Filling")),
        "Progressing",
        "InProgress",
    ),
    "filled": (
        _pool(observedGeneration=2, conditions=_pool_conditions("True", "Filled")),
        "Healthy",
        "Current",
    ),
    "at its maximum": (
        _pool(observedGeneration=2, conditions=_pool_conditions("True", "AtMaximum")),
        "Healthy",
        "Current",
    ),
    "backing off": (
        _pool(observedGeneration=2, conditions=_pool_conditions("False", "ErrImagePull")),
        "Progressing",
        "InProgress",
    ),
    "stalled": (
        _pool(observedGeneration=2, conditions=_pool_conditions("False", "ErrImagePull", "True")),
        "Degraded",
        "Failed",
    ),
    "filled for an older spec": (
        _pool(observedGeneration=1, conditions=_pool_conditions("True", "Filled")),
        "Progressing",
        "InProgress",
    ),
}


@pytest.mark.parametrize("case", POOL_CASES, ids=list(POOL_CASES))
def test_argocd_and_kstatus_read_a_pool_alike(case: str, lua: str, tmp_path: Path) -> None:
    obj, argocd, flux = POOL_CASES[case]
    status, message = argocd_health(lua, obj, tmp_path, POOL_HEALTH_LUA)
    assert (status, kstatus(obj)) == (argocd, [flux]), message
    if argocd == "Degraded":
        assert message == "ErrImagePull stuck"


def test_the_crds_apply_with_f_and_with_k_alike() -> None:
    """`kubectl apply -f crds/` takes the directory's .yaml, .yml and .json files: the CRDs
    and nothing else (no kustomization), the same objects `-k crds` builds."""
    crds = MANIFESTS.parent / "crds"
    read = [p for p in crds.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    objs = [o for p in sorted(read) for o in yaml.safe_load_all(p.read_text()) if o]
    assert {o["kind"] for o in objs} == {"CustomResourceDefinition"}, [p.name for p in read]
    assert sorted(key(o) for o in objs) == sorted(key(o) for o in kustomize(crds))


@pytest.mark.parametrize("crd", ["kernelsession.yaml", "kernelsessionpool.yaml"])
def test_kubectl_explain_has_a_description_for_every_field(crd: str) -> None:
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / crd).read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = [] if schema.get("description") else ["(the kind)"]

    def walk(node: dict[str, Any], path: str) -> None:
        for name, prop in (node.get("properties") or {}).items():
            if name in ("apiVersion", "kind", "metadata"):
                continue
            if not prop.get("description"):
                missing.append(f"{path}.{name}")
            walk(prop, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    assert missing == [], missing


def test_kubectl_get_o_wide_shows_reason_image_pod_pool_node_and_snapshot() -> None:
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / "kernelsession.yaml").read_text())
    columns = doc["spec"]["versions"][0]["additionalPrinterColumns"]
    wide = {c["name"]: c["jsonPath"] for c in columns if c.get("priority") == 1}
    assert wide == {
        "Reason": ".status.reason",
        "Image": ".spec.image",
        "Pod": ".status.podName",
        "Pool": ".spec.poolRef.name",
        "Node": ".status.nodeName",
        "Snapshot": ".status.snapshot.takenAt",
        "Restore": ".status.lastRestore.outcome",
    }


def test_every_status_field_is_in_the_crd_so_the_api_server_keeps_it() -> None:
    """The API server prunes what the schema does not name: each field of Status (and of
    its snapshot and lastRestore) is in the CRD's status schema."""
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / "kernelsession.yaml").read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert set(Status.__annotations__) <= set(schema["properties"])
    snapshot = schema["properties"]["snapshot"]["properties"]
    assert set(snapshot) == {"size", "takenAt", "seconds", "inPod"}
    assert set(schema["properties"]["lastRestore"]["properties"]) == {
        "outcome",
        "at",
        "seconds",
        "message",
    }


GITOPS = MANIFESTS / "examples" / "gitops"


def test_the_gitops_examples_sync_what_the_repository_has() -> None:
    """Argo CD Applications and Flux Kustomizations point at directories that exist and
    build; the sessions folder holds valid KernelSessions that suspend when idle (not
    delete: auto-sync would make them again); the CRDs go apart, never pruned."""
    root = MANIFESTS.parent
    paths = {}
    for doc in (GITOPS / "argocd").glob("*.yaml"):
        (app,) = yaml.safe_load_all(doc.read_text())
        assert app["kind"] == "Application", doc
        paths[app["metadata"]["name"]] = app["spec"]["source"]["path"]
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"], doc
    for doc in (GITOPS / "flux").glob("*.yaml"):
        for obj in yaml.safe_load_all(doc.read_text()):
            if obj["kind"] == "Kustomization":
                paths[obj["metadata"]["name"]] = obj["spec"]["path"].removeprefix("./")
                assert obj["spec"]["wait"] is True, doc
    assert set(paths.values()) == {"crds", "manifests/base", "manifests/examples/gitops/sessions"}
    for path in paths.values():
        assert kustomize(root / path), path
    sessions = kustomize(GITOPS / "sessions")
    for body in sessions:
        (session,) = kernelsession.parse_documents(yaml.safe_dump(body))
        assert session["spec"]["idleAction"] == "Suspend", body["metadata"]["name"]
    for crd in kustomize(root / "crds"):
        notes = crd["metadata"]["annotations"]
        assert notes["argocd.argoproj.io/sync-options"] == "Prune=false,Delete=false"
        assert notes["kustomize.toolkit.fluxcd.io/prune"] == "disabled"
