"""Live snapshots on the cluster (issue 27; control/snapshots.py): with the operator's
snapshot RuntimeClass set, a suspended session keeps its kernel's memory.

The operator has the kubelet checkpoint the kernel (at the kubelet, as nodes/checkpoint
allows) while a client is still connected to it, as a gateway would be; the next pod
wakes from the archive on the node's mcpforge-restore handler (tests/kube/
test_checkpoint.py tries the handler itself). A snapshot that cannot be restored gives a
fresh kernel that says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube

from .cluster_common import ROOT
from .harness import (
    KS,
    SMALL,
    condition,
    eventually,
    kernel,
    phase,
    pool_body,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
)
from .pooling import filled, members
from .test_checkpoint import IMAGE, RESTORE_CLASS, _runtime_class

CHECKPOINTS = ROOT / "kubelet" / "checkpoints"
STATE = """
x = 41
import threading, time
t = threading.Thread(target=lambda: time.sleep(1e9), daemon=True)
t.start()
print(x)
"""


@pytest.fixture
async def snapshotting(kube: Kube, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """The operator, keeping suspended kernels' memory."""
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_RUNTIME_CLASS", RESTORE_CLASS)
    await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
    async with running_operator(kube) as op:
        yield op


async def _suspended(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    """Suspend the session, a client connected to its kernel with some state in it; the
    session once Suspended."""
    await asyncio.to_thread(kube.create, session_body(name, ns, image=IMAGE, resources=SMALL))
    await ready(kube, ns, name)
    async with kernel(kube, ns, name) as conn:
        assert await run_in_kernel(conn, STATE) == "41\n"
        patch = {"spec": {"operatingMode": "Suspended"}}
        await asyncio.to_thread(kube.patch, KS, ns, name, patch)
        obj = await eventually(
            kube, KS, ns, name, lambda o: phase(o) == "Suspended", timeout=60, what="Suspended"
        )
    assert obj is not None
    return obj


async def _resumed(kube: Kube, ns: str, name: str, before: str) -> dict[str, Any]:
    await asyncio.to_thread(kube.patch, KS, ns, name, {"spec": {"operatingMode": "Running"}})
    return await ready(kube, ns, name, other_than=before)


async def test_a_suspended_session_wakes_with_its_variables_and_threads(
    kube: Kube, ns: str, snapshotting: Any
) -> None:
    obj = await _suspended(kube, ns, "napper")
    snap = obj["status"].get("snapshot") or {}
    archive = CHECKPOINTS / str(snap.get("archive"))
    try:
        assert snap.get("node") and archive.is_file(), obj["status"]
        assert "its memory is kept" in obj["status"]["message"], obj["status"]
        obj = await _resumed(kube, ns, "napper", before="")
        assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj
        assert not obj["status"].get("snapshot"), obj["status"]
        assert not archive.exists(), "woken from, the archive is spent"
        pod = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
        assert pod is not None and pod["spec"]["hostUsers"] is False, pod
        async with kernel(kube, ns, "napper") as conn:
            assert await run_in_kernel(conn, "print(x + 1, t.is_alive())") == "42 True\n"
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)


async def test_a_snapshot_that_cannot_be_restored_gives_a_fresh_kernel_that_says_so(
    kube: Kube, ns: str, snapshotting: Any
) -> None:
    obj = await _suspended(kube, ns, "broken")
    archive = CHECKPOINTS / str((obj["status"].get("snapshot") or {}).get("archive"))
    try:
        assert archive.is_file(), obj["status"]
        await asyncio.to_thread(_damage, archive)
        obj = await _resumed(kube, ns, "broken", before="")
        last = obj["status"].get("lastRestore") or {}
        assert last.get("outcome") == "Failed" and "mcpforge-runc" in last["message"], last
        assert not obj["status"].get("snapshot"), obj["status"]
        async with kernel(kube, ns, "broken") as conn:
            said = await run_in_kernel(conn, "print('x' in globals())")
        assert said == "False\n"
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)


def _damage(archive: Path) -> None:
    """Cut the archive short, as a full disk or a crash while it was written would."""
    assert archive.is_relative_to(ROOT), archive
    with archive.open("r+b") as f:
        f.truncate(4096)


async def test_a_pools_warm_kernel_is_not_checkpointed_and_the_suspend_says_so(
    kube: Kube, ns: str, snapshotting: Any
) -> None:
    """A claimed kernel's memory holds its pool's keys, not the session's Secret's: it is
    suspended without a snapshot, and says its variables are lost."""
    await asyncio.to_thread(kube.create, pool_body("warm", ns, 1, IMAGE))
    pool = await filled(kube, ns, "warm", 1)
    assert pool is not None
    [member] = await members(kube, ns, "warm")
    assert member["spec"]["hostUsers"] is False, "a pool's kernels run as sessions' do"
    body = session_body("claimer", ns, image=IMAGE, resources=SMALL, poolRef={"name": "warm"})
    await asyncio.to_thread(kube.create, body)
    claimed = await ready(kube, ns, "claimer")
    assert condition(claimed, ksp.WARM_START)["reason"] == ksp.CLAIMED, claimed["status"]
    before = set(CHECKPOINTS.iterdir())
    await asyncio.to_thread(kube.patch, KS, ns, "claimer", {"spec": {"operatingMode": "Suspended"}})
    obj = await eventually(
        kube, KS, ns, "claimer", lambda o: phase(o) == "Suspended", timeout=60, what="Suspended"
    )
    assert obj is not None
    assert not obj["status"].get("snapshot"), obj["status"]
    assert "variables are lost (no snapshot)" in obj["status"]["message"], obj["status"]
    assert set(CHECKPOINTS.iterdir()) == before
