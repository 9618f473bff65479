"""Faults that leave things behind: a claim that fails, pods whose gateway was killed, a
pool deleted, a request with a NUL byte.

Each case asserts that nothing is left (no row, pod, lock file or quota place), that
the pool's counts stay true, and that what the caller is told names what was wrong,
never a host path or a command line. Sessions and pools are made in a state dir of the
module's through the real LocalRuntime (a gateway's), or through the real gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import kernelsession
from mcp_forge.clients import podman
from mcp_forge.errors import ForgeError, SessionNotFound, SessionNotReady
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.orphans import STORE_LABEL, store_tag
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.runtimes.local.supervisor import supervise_once
from mcp_forge.settings import Settings
from support import scratch_state_dir

from .conftest import call, gateway, text

pytestmark = pytest.mark.podman

MINIMAL = "localhost/mcp-forge-kernel:0.1.0-minimal"


@pytest.fixture(scope="module")
def host_dir() -> Iterator[Path]:
    with scratch_state_dir("mff-") as path:
        yield path


@pytest.fixture(scope="module")
def runtime(host_dir: Path) -> LocalRuntime:
    return LocalRuntime(Settings(state_dir=host_dir, kernel_ready_timeout=60))


@pytest.fixture(scope="module")
async def pool(runtime: LocalRuntime) -> AsyncIterator[str]:
    """A filled pool of one minimal kernel (refilled by the cases that claim from it)."""
    name = f"p{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {"size": 1, "template": {"image": MINIMAL, "resources": {"memory": "512Mi"}}},
    }
    await runtime.pools.apply(body)
    yield name
    with contextlib.suppress(SessionNotFound):
        await runtime.pools.delete(name)


def session_body(pool: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"f-{uuid.uuid4().hex[:8]}"},
        "spec": {
            "image": MINIMAL,
            "resources": {"memory": "512Mi"},
            "poolRef": {"name": pool},
            **spec,
        },
    }


async def kernel_pods() -> dict[str, dict[str, str]]:
    """Every pod of ours on the host, by name: its labels."""
    rows = await podman.run_json(
        "pod", "ps", "--filter", "label=app.kubernetes.io/managed-by=mcp-forge", "--format", "json"
    )
    return {r["Name"]: r.get("Labels") or {} for r in rows or []}


def assert_no_host_detail(message: str, state_dir: Path) -> None:
    assert str(state_dir) not in message, message
    assert "pod.yaml" not in message and "--seccomp" not in message, message
    assert "kube play --" not in message and "/var/lib" not in message, message


async def test_a_nul_byte_in_a_session_request_is_refused_naming_the_field(
    runtime: LocalRuntime, pool: str, host_dir: Path
) -> None:
    for spec, field in (
        ({"env": [{"name": "A", "value": "x\0y"}]}, "spec.env[0].value"),
        ({"env": [{"name": "A\0", "value": "x"}]}, "spec.env[0].name"),
        ({"files": [{"path": "a\0.txt", "content": "x"}]}, "spec.files[0].path"),
    ):
        body = session_body(pool, **spec)
        with pytest.raises(ForgeError) as refused:
            await runtime.apply(body)
        assert field in str(refused.value) and "NUL" in str(refused.value)
        with pytest.raises(SessionNotFound):
            await runtime.get(body["metadata"]["name"])
    labelled = session_body(pool)
    labelled["metadata"]["labels"] = {"team": "a\0b"}
    with pytest.raises(ForgeError, match=r"metadata\.labels\.team: a NUL byte"):
        await runtime.apply(labelled)
    # Refused before any claim: the pool's kernel is still there, unclaimed.
    pool_status = runtime.pools.get(pool).body["status"]
    assert pool_status.get("claims", 0) == 0 and pool_status["ready"] == 1, pool_status


async def test_a_claim_that_fails_leaves_no_session_pod_or_stale_count(
    runtime: LocalRuntime, pool: str, host_dir: Path
) -> None:
    # Values that got past validation (the root fix must not rely on it): the kernel
    # refuses them, and so does the cold start that follows.
    files = [{"path": "ok.txt", "content": "x"}]
    body = kernelsession.validate(
        session_body(pool, env=[{"name": "A", "value": "ok"}], files=files)
    )
    bad = copy.deepcopy(body)
    bad["spec"]["env"][0]["value"] = "x\0y"
    bad["spec"]["files"][0]["path"] = "a\0.txt"
    [member] = runtime.pools.members(runtime.pools.get(pool))
    member_pod = str(member.status.get("podName"))
    assert member_pod in await kernel_pods()
    runtime.pools.wanted.clear()
    with pytest.raises(ForgeError) as failed:
        await runtime.pools.claim(bad)
    message = str(failed.value)
    assert "could not be made session" in message and "was removed" in message, message
    assert_no_host_detail(message, host_dir)
    name = bad["metadata"]["name"]
    with pytest.raises(SessionNotFound):  # no Failed row holding a place of a quota
        await runtime.get(name)
    assert member_pod not in await kernel_pods()
    assert not any(p.endswith(name) for p in await kernel_pods())
    # The counts are true (the claimed kernel is gone), and the keeper was told to refill.
    status = runtime.pools.get(pool).body["status"]
    assert status["ready"] == 0 and status["claimed"] == 0, status
    assert runtime.pools.wanted.is_set()
    await runtime.pools.fill(runtime.pools.get(pool))  # back to one ready kernel
    assert runtime.pools.get(pool).body["status"]["ready"] == 1


async def test_a_pod_no_session_owns_is_removed_by_its_own_stores_housekeeping_only(
    runtime: LocalRuntime, pool: str, host_dir: Path
) -> None:
    # As a gateway killed mid-way leaves it: a pod of this store whose row is gone.
    [member] = runtime.pools.members(runtime.pools.get(pool))
    orphan = str(member.status.get("podName"))
    pods = await kernel_pods()
    assert pods[orphan].get(STORE_LABEL) == store_tag(host_dir)
    runtime.store.delete(member.namespace, member.name)
    # Another store's housekeeping (another gateway, alive) never touches it.
    with scratch_state_dir("mfo-") as other_dir:
        other = LocalRuntime(Settings(state_dir=other_dir))
        await supervise_once(other)
        assert orphan in await kernel_pods()
    await runtime.pools.fill(runtime.pools.get(pool))  # a new kernel, with its row
    [kept] = runtime.pools.members(runtime.pools.get(pool))
    await supervise_once(runtime)
    pods = await kernel_pods()
    assert orphan not in pods, "the orphan pod is still there"
    assert str(kept.status.get("podName")) in pods, "a pod with its row was removed"


async def test_a_deleted_pool_leaves_no_lock_file(runtime: LocalRuntime, host_dir: Path) -> None:
    name = f"p{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {"size": 0, "template": {"image": MINIMAL}},
    }
    await runtime.pools.apply(body)  # filled: its lock was taken
    lock = host_dir / "pools" / f"default.{name}.lock"
    assert lock.exists()
    await runtime.pools.delete(name)
    assert not lock.exists()
    # A fill that holds the lock while the pool goes removes it when done.
    await runtime.pools.apply(body, wait=False)
    pool = runtime.pools.get(name)
    async with runtime.pools._filling(pool) as mine:
        assert mine
        await runtime.pools.delete(name)
        assert lock.exists()  # held: left to its holder
    assert not lock.exists()


async def test_a_nul_byte_sent_to_the_gateway_is_refused_and_takes_no_quota(
    host_dir: Path,
) -> None:
    env = {"MCPFORGE_SESSIONS_PER_CLIENT_MAX": "1"}
    async with gateway(host_dir, args=("--pool-size", "0"), env=env) as c:
        r = await call(c, "create_session", {"variant": "minimal", "env": {"A": "x\0y"}})
        assert r.is_error, text(r)
        assert "spec.env[0].value" in text(r) and "NUL" in text(r), text(r)
        assert_no_host_detail(text(r), host_dir)
        # The one place of the client's quota is free.
        r = await call(c, "create_session", {"variant": "minimal", "name": "after-nul"})
        assert not r.is_error, text(r)
        r = await call(c, "list_sessions", {})
        names = json.dumps(r.structured_content) if r.structured_content else text(r)
        assert "after-nul" in names


async def test_a_kernel_busy_with_a_gone_gateways_call_says_so_on_connecting(
    runtime: LocalRuntime,
) -> None:
    body = session_body("none")
    del body["spec"]["poolRef"]
    name = body["metadata"]["name"]
    await runtime.apply(body)
    settings = Settings(state_dir=runtime.settings.state_dir, busy_probe=3.0)
    first, second = Gateway(runtime, settings), Gateway(runtime, settings)
    started = asyncio.Event()
    # The first gateway's call runs on; that gateway is as good as gone (never asked again).
    running = asyncio.ensure_future(
        first.execute(
            name,
            "import time; print('started', flush=True); time.sleep(60)",
            timeout=90,
            on_stream=lambda _, __: started.set(),
        )
    )
    try:
        async with asyncio.timeout(30):
            await started.wait()
        begun = time.monotonic()
        with pytest.raises(SessionNotReady) as busy:
            async with asyncio.timeout(15):
                await second.execute(name, "print(1)")
        message = str(busy.value)
        assert time.monotonic() - begun < 10, message
        assert "busy with an earlier call" in message and "running for" in message, message
        assert "interrupt_kernel" in message and f"mcp-forge interrupt {name}" in message
        assert await second.interrupt(name)  # the way out it names works
        async with asyncio.timeout(30):
            assert (await running).status in ("error", "interrupted")
        async with asyncio.timeout(30):
            result = await second.execute(name, "print(1)")
        assert result.status == "ok" and result.stdout.strip() == "1", result
    finally:
        running.cancel()
        with contextlib.suppress(BaseException):
            await running
        await first.close()
        await second.close()
        await runtime.delete(name)
