"""The cluster install in manifests/ as tests/unit/test_manifests_*.py check it: it builds,
it validates, and it says what the code does. What those tests share is here: the
install's names and its kustomizations, built.

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
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from mcp_forge.api import kernelsession
from mcp_forge.cli import main as cli

ROOT = Path(__file__).parents[2]
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.33"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

SYSTEM = "mcp-forge-system"
SESSIONS = "mcp-forge-sessions"
EGRESS = "mcp-forge-egress"
NAMESPACES = (SYSTEM, SESSIONS, EGRESS)
OPERATOR_SA = (SYSTEM, "mcp-forge-operator")
GATEWAY_SA = (SYSTEM, "mcp-forge-gateway")
EGRESS_SA = (EGRESS, "mcp-forge-egress")
TOKENS_SECRET = "mcp-forge-gateway-tokens"
CLUSTER = "*"  # the scope of a grant made by a ClusterRoleBinding

KUSTOMIZATIONS = sorted(  # of the install; examples/ hold sessions (checked as such)
    p.parent.relative_to(MANIFESTS).as_posix()
    for p in MANIFESTS.rglob("kustomization.yaml")
    if "examples" not in p.relative_to(MANIFESTS).parts
)
INSTALLS = ["base", "overlays/gvisor", "overlays/namespace-scoped", "overlays/snapshots"]
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


def parse_cli(args: list[str]) -> None:
    """Parse `mcp-forge COMMAND FLAGS...` as the CLI would, without running it."""
    program, command, *flags = args
    assert Path(program).name == "mcp-forge"
    with click.Context(cli, info_name="mcp-forge") as ctx:
        sub = cli.get_command(ctx, command)
        assert sub is not None, f"mcp-forge has no command {command!r}"
        sub.make_context(command, flags, parent=ctx)  # raises on a flag it does not have
