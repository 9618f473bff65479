"""spec.packages in local mode: real kernels in real Podman pods, wheels from the real
package index through this host's proxy. A new kernel has them before the session is
Ready; a restarted one finds them in its workspace without a download; a package the
policy refuses fails the session with the reason, naming it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from typing import Any

import pytest

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.errors import PackageDenied, SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = pytest.mark.podman


def body(image: str, packages: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"p-{uuid.uuid4().hex[:10]}"},
        "spec": {"image": image, "resources": {"memory": "512Mi"}, "packages": packages},
    }


async def test_a_session_starts_with_its_packages_and_a_restart_keeps_them(
    runtime: Any, gateway: Gateway, images: dict[str, str], names: list[str]
) -> None:
    spec = body(images["minimal"], ["tabulate==0.9.0"])
    names.append(spec["metadata"]["name"])
    session = (await runtime.apply(spec)).session
    assert session.status["phase"] == st.READY
    probe = (
        "import json, os, tabulate\n"
        "print(json.dumps([tabulate.__version__, tabulate.__file__,"
        " os.stat(tabulate.__file__).st_mtime_ns, os.path.exists('/workspace/.mcp-forge/wheels')]))"
    )
    r = await gateway.execute(session.name, probe)
    assert r.status == "ok", (r.error, r.stderr)
    version, path, installed_at, wheels_left = json.loads(r.stdout)
    assert (version, path) == ("0.9.0", "/workspace/.packages/tabulate/__init__.py")
    assert wheels_left is False  # deleted once installed
    # A new kernel on the same workspace: the mark says they are there, so nothing is
    # installed again (the files are the same ones), and they import.
    await gateway.restart(session.name)
    assert (await runtime.get(session.name)).status["kernelId"] != session.status["kernelId"]
    r = await gateway.execute(session.name, probe)
    assert r.status == "ok", (r.error, r.stderr)
    assert json.loads(r.stdout) == [version, path, installed_at, False]


async def test_a_denied_spec_package_fails_the_session_naming_it(
    settings: Any, images: dict[str, str]
) -> None:
    strict = LocalRuntime(dataclasses.replace(settings, packages_deny="tabulate"))
    spec = body(images["minimal"], ["Tabulate>=0.9"])
    name = spec["metadata"]["name"]
    try:
        with pytest.raises(PackageDenied, match="'Tabulate' is refused: it is on the gateway's"):
            await strict.apply(spec)
        failed = await strict.get(name)
        assert failed.status["phase"] == st.FAILED
        assert failed.status["reason"] == "PackagesNotInstalled"
        assert "PackageDenied: 'Tabulate'" in str(failed.status["message"])
    finally:
        with contextlib.suppress(SessionNotFound):
            await strict.delete(name)


async def test_a_kernel_claimed_from_a_pool_gets_the_sessions_packages(
    gateway: Gateway, images: dict[str, str], names: list[str], runtime: Any, minimal_pool: str
) -> None:
    spec = body(images["minimal"], ["tabulate==0.9.0"])
    spec["spec"]["poolRef"] = {"name": minimal_pool}
    names.append(spec["metadata"]["name"])
    session = (await runtime.apply(spec)).session
    warm = [c for c in session.status["conditions"] if c["type"] == ksp.WARM_START]
    assert [(c["status"], c["reason"]) for c in warm] == [("True", ksp.CLAIMED)], warm
    r = await gateway.execute(session.name, "import tabulate; print(tabulate.__version__)")
    assert r.stdout == "0.9.0\n", (r.error, r.stderr)
