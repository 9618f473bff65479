"""The images in images/Containerfile.control-plane and what the Deployments run from them:
the version, the commands and flags the CLI has, the settings the package reads."""

from __future__ import annotations

import copy
import re
import shlex
from typing import Any

import pytest
import yaml
from manifests_support import (
    INSTALLS,
    ROOT,
    SYSTEM,
    VERSION,
    build,
    container,
    find,
    parse_cli,
)

from mcp_forge.image import control_plane
from mcp_forge.settings import Settings

CONTAINERFILE = ROOT / "images" / "Containerfile.control-plane"


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
    for name in ("operator", "gateway", "egress"):
        stage = stages[name]
        assert "bookworm" in stage["base"]
        assert stage["labels"]["org.opencontainers.image.version"] == VERSION
        uid, _, gid = stage["user"].partition(":")
        assert int(uid) > 0 and int(gid) > 0, "a numeric non-root user, so runAsNonRoot can check"
    installs = [r for r in stages["build"]["runs"] if re.search(r"pip install [^&]*\s\.(\s|$)", r)]
    assert installs, "the package is pip-installed from the repository (pip install .)"


def test_the_egress_venv_holds_the_pinned_mitmproxy_and_the_package_without_its_dependencies(
    stages: dict[str, dict[str, Any]],
) -> None:
    """The Containerfile's second venv, as control_plane.py makes it (MITMPROXY, --no-deps)."""
    venv = control_plane.EGRESS_VENV
    (run,) = [r for r in stages["build"]["runs"] if f"python -m venv {venv}" in r]
    steps = [s.split() for s in run.split("&&")]
    assert [f"{venv}/bin/pip", "install", "--no-cache-dir", "--disable-pip-version-check",
            control_plane.MITMPROXY] in steps  # fmt: skip
    assert [f"{venv}/bin/pip", "install", "--no-cache-dir", "--disable-pip-version-check",
            "--no-deps", "."] in steps  # fmt: skip
    assert stages["egress"]["entrypoint"][0] == f"{venv}/bin/python"
    assert control_plane.SMOKE_TESTS["egress"][0] == f"{venv}/bin/python"


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
