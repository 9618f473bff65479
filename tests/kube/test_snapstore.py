"""Snapshots kept in a claim of their session (issue 27; control/snapstore.py): with the
operator's MCPFORGE_SNAPSHOT_STORE=claim, a suspended session's archive is also copied
into `ks-<name>-snapshot` by the node's handler (images/node/runc-restore/store.go), signed
with the nodes' key; a node that no longer has the archive wakes the kernel from the
claim, and a copy changed by anyone who can write the claim is refused.

The test node is the only node: "its node lost the archive" is made by removing the
archive from the kubelet's checkpoint directory, which is what a new node would lack.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.clients.kube import Kube

from .cluster_common import ROOT
from .conftest import ClusterUnderTest
from .harness import KS, eventually, kernel, probe_pod, removed, run_in_kernel
from .test_snapshots import CHECKPOINTS, _resumed, _suspended, snapshot_operator


@pytest.fixture
async def storing(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_STORE", "claim")
    async with snapshot_operator(kube, ns, test_cluster, monkeypatch) as op:
        yield op


async def _stored(kube: Kube, ns: str, name: str) -> tuple[dict[str, Any], Path, Path]:
    """Suspend the session, wait for its snapshot's store to end; the session, its
    archive on the node, and the claim's directory on the node."""
    await _suspended(kube, ns, name)

    obj = await eventually(kube, KS, ns, name, _store_ended, timeout=60, what="stored")
    assert obj is not None
    snap = obj["status"]["snapshot"]
    assert snap["stored"]["outcome"] == "Stored", snap
    assert snap["stored"]["claim"] == f"ks-{name}-snapshot", snap
    claim = await asyncio.to_thread(kube.get, "PersistentVolumeClaim", ns, f"ks-{name}-snapshot")
    assert claim is not None
    owners = [o["uid"] for o in claim["metadata"].get("ownerReferences") or []]
    assert owners == [obj["metadata"]["uid"]], claim["metadata"]
    volume = claim["spec"]["volumeName"]
    pv = await asyncio.to_thread(kube._call, "GET", f"/api/v1/persistentvolumes/{volume}")
    where = Path((pv["spec"].get("hostPath") or pv["spec"].get("local") or {})["path"])
    assert where.is_relative_to(ROOT), where
    return obj, CHECKPOINTS / snap["archive"], where


async def test_a_snapshot_kept_in_its_claim_wakes_where_the_node_has_lost_its_archive(
    kube: Kube, ns: str, storing: Any
) -> None:
    """Stored root's alone (no pod that mounts the claim reads it), beside its HMAC; the
    store's pod gone; woken from the claim with its variables and threads (not seeing the
    claim), the copy is spent, and the pod only preferred the archive's node."""
    obj, archive, where = await _stored(kube, ns, "keeper")
    copy, mac = where / "snapshot.tar", where / "snapshot.mac"
    info = copy.lstat()
    assert stat.S_ISREG(info.st_mode) and info.st_uid == 0, info
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == archive.stat().st_size
    assert len(bytes.fromhex(mac.read_text().strip())) == 32
    store_pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-keeper-snapshot-store")
    assert store_pod is None or store_pod["metadata"].get("deletionTimestamp"), store_pod
    await asyncio.to_thread(archive.unlink)  # the node the kernel wakes on has no archive
    obj = await _resumed(kube, ns, "keeper", before="")
    last = obj["status"].get("lastRestore") or {}
    assert last.get("outcome") == "Restored", obj["status"]
    async with kernel(kube, ns, "keeper") as conn:
        assert await run_in_kernel(conn, "print(x + 1, t.is_alive())") == "42 True\n"
        # The woken process has its old mounts: the claim's is not among them.
        seen = "import os; print(os.path.ismount('/.mcpforge-snapshot'))"
        assert await run_in_kernel(conn, seen) == "False\n"
    pod = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
    assert pod is not None
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity, affinity
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"], affinity
    assert await removed(copy, mac), "woken from, the copy is spent"


async def test_a_claims_copy_changed_is_refused_and_links_planted_in_it_are_never_followed(
    kube: Kube, ns: str, storing: Any
) -> None:
    """Any pod of the namespace may write the claim. One byte of the copy changed (here by
    the test, on the node): the handler refuses it before CRIU reads it, and the session
    says so and starts a fresh kernel. Links planted where the next store writes (its
    temporary file, the copy, its HMAC) are replaced, and what they point at is untouched."""
    obj, archive, where = await _stored(kube, ns, "tampered")
    await asyncio.to_thread(archive.unlink)
    await asyncio.to_thread(_flip, where / "snapshot.tar")
    obj = await _resumed(kube, ns, "tampered", before="")
    last = obj["status"].get("lastRestore") or {}
    assert last.get("outcome") == "Failed" and "HMAC differs" in last["message"], last
    async with kernel(kube, ns, "tampered") as conn:
        assert await run_in_kernel(conn, "print('x' in globals())") == "False\n"
        victim = ROOT / f"snapstore-victim-{ns}"
        victim.write_text("untouched")
        try:
            for name in (".snapshot.tar.tmp", "snapshot.tar", "snapshot.mac"):
                (where / name).unlink(missing_ok=True)
                (where / name).symlink_to(victim)
            await asyncio.to_thread(
                kube.patch, KS, ns, "tampered", {"spec": {"operatingMode": "Suspended"}}
            )
            again = await eventually(
                kube, KS, ns, "tampered", _store_ended, timeout=60, what="stored again"
            )
            assert again is not None and _outcome(again) == "Stored", again
            obj = again
            assert victim.read_text() == "untouched"
            for name in ("snapshot.tar", "snapshot.mac"):
                assert stat.S_ISREG((where / name).lstat().st_mode), name
            assert not (where / ".snapshot.tar.tmp").exists()
        finally:
            victim.unlink()
            (CHECKPOINTS / str(obj["status"]["snapshot"]["archive"])).unlink(missing_ok=True)


def _outcome(o: dict[str, Any] | None) -> str:
    snap = ((o or {}).get("status") or {}).get("snapshot") or {}
    return str((snap.get("stored") or {}).get("outcome") or "")


def _store_ended(o: dict[str, Any] | None) -> bool:
    return _outcome(o) in ("Stored", "Failed")


def _flip(path: Path) -> None:
    """Change one byte in the middle of the file, in place."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        middle = os.fstat(fd).st_size // 2
        byte = os.pread(fd, 1, middle)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), middle)
    finally:
        os.close(fd)


async def test_a_store_that_cannot_be_made_says_why_and_the_snapshot_wakes_from_its_node(
    kube: Kube, ns: str, storing: Any
) -> None:
    """A pod of the store pod's name that is not this session's store (here another
    session's kernel pod could be one) is never touched: the store fails, saying so, and
    the snapshot wakes from its node as without a store."""
    squatter = probe_pod("ks-held-snapshot-store", ns, {}, "import time; time.sleep(600)")
    await asyncio.to_thread(kube.create, squatter)
    await _suspended(kube, ns, "held")
    obj = await eventually(kube, KS, ns, "held", _store_ended, timeout=60, what="store ended")
    assert obj is not None
    assert _outcome(obj) == "Failed", obj["status"]
    assert "in the way" in obj["status"]["snapshot"]["stored"]["message"], obj["status"]
    still = await asyncio.to_thread(kube.get, "Pod", ns, "ks-held-snapshot-store")
    assert still is not None and not still["metadata"].get("deletionTimestamp"), still
    obj = await _resumed(kube, ns, "held", before="")
    assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj["status"]
    async with kernel(kube, ns, "held") as conn:
        assert await run_in_kernel(conn, "print(x + 1)") == "42\n"


@pytest.fixture
async def storing_briefly(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_STORE", "claim")
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_MAX_AGE", "20")
    async with snapshot_operator(kube, ns, test_cluster, monkeypatch) as op:
        yield op


async def test_a_snapshot_dropped_past_its_age_takes_its_claims_copy_with_it(
    kube: Kube, ns: str, storing_briefly: Any
) -> None:
    """Memory is kept no longer than the snapshot: its claim goes when it is dropped."""
    _, archive, _ = await _stored(kube, ns, "brief")
    try:

        def dropped(o: dict[str, Any] | None) -> bool:
            last = ((o or {}).get("status") or {}).get("lastRestore") or {}
            return last.get("outcome") == "Discarded"

        await eventually(kube, KS, ns, "brief", dropped, timeout=60, what="Discarded")
        gone = await eventually(
            kube, "PersistentVolumeClaim", ns, "ks-brief-snapshot",
            lambda o: o is None or bool(o["metadata"].get("deletionTimestamp")),
            timeout=30, what="the claim deleted",
        )  # fmt: skip
        assert gone is None or gone["metadata"].get("deletionTimestamp")
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)
