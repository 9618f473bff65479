"""The Argo CD health scripts in manifests/argocd, run in Lua 5.1 (the Lua Argo CD embeds),
and a pool read alike by Argo CD and by kstatus (Flux)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests_support import MANIFESTS, SESSIONS

from kstatus import kstatus

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
