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
import contextlib
import json
import os
import re
import subprocess
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api.forks import FORKED_FROM
from mcp_forge.clients.kube import Kube
from mcp_forge.clients.kubelet import Kubelet
from mcp_forge.control import snapshots
from mcp_forge.control.sweeper import sizes_name
from mcp_forge.errors import ApiError, InvalidRequest
from mcp_forge.image.control_plane import build_control_plane, image_ref

from .cluster_common import ROOT
from .conftest import ClusterUnderTest
from .harness import (
    KS,
    SMALL,
    bridge_takes,
    condition,
    connection_of,
    eventually,
    kernel,
    phase,
    pool_body,
    ready,
    removed,
    run_in_kernel,
    running_operator,
    session_body,
    start_bridge,
)
from .pooling import filled, members
from .test_checkpoint import IMAGE, RESTORE_CLASS, _runtime_class
from .test_install import kubectl

CHECKPOINTS = ROOT / "kubelet" / "checkpoints"
ROOT_REPO = Path(__file__).resolve().parents[2]
PERSISTENT = {"persistent": True, "size": "64Mi"}
TASKS = ROOT / "containerd" / "state" / "io.containerd.runtime.v2.task" / "k8s.io"
OPEN_FILE = "log = open('log.txt', 'a'); log.write('a'); log.flush()\n"  # in /workspace
LAZY_VMA_MIN = 16 << 20  # the smallest mapping whose pages a wake reads lazily
BIG = "big = b'x' * (32 << 20)\n"  # a mapping of its own, large enough to be read lazily
STATE = """
x = 41
import threading, time
t = threading.Thread(target=lambda: time.sleep(1e9), daemon=True)
t.start()
print(x)
"""


@pytest.fixture
async def snapshotting(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    async with snapshot_operator(kube, ns, test_cluster, monkeypatch) as op:
        yield op


@contextlib.asynccontextmanager
async def snapshot_operator(
    kube: Kube, ns: str, cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    """The operator, keeping suspended kernels' memory; it shows kubelets the tokens of
    a checkpointer as the overlay grants it (in this test's namespace)."""
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_RUNTIME_CLASS", RESTORE_CLASS)
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_SIZE_RECHECK", "1")  # the sweeper's rounds here
    await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
    with checkpointer(cluster, ns) as account:
        monkeypatch.setenv("MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT", account)
        async with running_operator(kube) as op:
            yield op


@contextlib.contextmanager
def checkpointer(cluster: ClusterUnderTest, ns: str) -> Iterator[str]:
    """The overlay's checkpointer ServiceAccount and its grant, made in `ns` (the
    binding named for it); "<ns>/<name>" of the account."""
    built = kubectl(cluster, "kustomize", str(ROOT_REPO / "manifests" / "overlays" / "snapshots"))
    objects = [
        o for o in yaml.safe_load_all(built)
        if o and o["metadata"]["name"] == "mcp-forge-checkpointer"
    ]  # fmt: skip
    named = f"mcp-forge-checkpointer-{ns}"
    for o in objects:
        if o["kind"] == "ServiceAccount":
            o["metadata"]["namespace"] = ns
        if o["kind"] == "ClusterRole":
            o["metadata"]["name"] = named
        if o["kind"] == "ClusterRoleBinding":
            o["metadata"]["name"] = named
            o["roleRef"]["name"] = named
            o["subjects"][0]["namespace"] = ns
    kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objects))
    try:
        yield f"{ns}/mcp-forge-checkpointer"
    finally:
        kubectl(cluster, "delete", "clusterrolebinding,clusterrole", named, "--ignore-not-found")


async def test_the_kubelet_takes_a_checkpoint_from_the_checkpointers_token_and_no_other(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest
) -> None:
    """A token of a ServiceAccount without the grant is refused before anything is
    looked at; the checkpointer's gets as far as the pod (none of that name here)."""
    meta = {"name": "nobody", "namespace": ns}
    nobody = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    await asyncio.to_thread(kube.create, nobody)
    (node,) = [n["metadata"]["name"] for n in kube._call("GET", "/api/v1/nodes")["items"]]
    with checkpointer(test_cluster, ns) as account:
        for who, status in ((f"{ns}/nobody", 403), (account, 404)):
            kubelet = Kubelet(kube, who)
            with pytest.raises(ApiError) as refused:
                await asyncio.to_thread(kubelet.checkpoint, node, ns, "no-such-pod", "kernel")
            assert refused.value.status == status, (who, refused.value)
            assert kubelet.token() == kubelet.token(), "a token is kept while it lives"
        # A token of an account made again is not known to the kubelet (401): asked for
        # afresh, once (a Kubelet of its own: the kubelet caches tokens it accepted).
        kubelet = Kubelet(kube, account)
        stale = kubelet.token()
        name = account.split("/")[1]
        await asyncio.to_thread(kube.delete, "ServiceAccount", ns, name)
        meta = {"name": name, "namespace": ns}
        await asyncio.to_thread(
            kube.create, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
        )
        with pytest.raises(ApiError) as refused:
            await asyncio.to_thread(kubelet.checkpoint, node, ns, "no-such-pod", "kernel")
        assert refused.value.status == 404, refused.value
        assert kubelet.token() != stale
    with pytest.raises(InvalidRequest, match="<namespace>/<name>"):
        Kubelet(kube, "just-a-name")


def test_the_operator_may_ask_for_the_checkpointers_tokens_and_no_other_accounts(
    ns: str, test_cluster: ClusterUnderTest
) -> None:
    """The overlay's Role, as the API server's authorizer reads it (resourceNames on a
    subresource's create), made in this test's namespace for the operator's account."""
    built = kubectl(
        test_cluster, "kustomize", str(ROOT_REPO / "manifests" / "overlays" / "snapshots")
    )
    objects = [
        o for o in yaml.safe_load_all(built)
        if o and o["metadata"]["name"] == "mcp-forge-operator-checkpointer-token"
    ]  # fmt: skip
    assert {o["kind"] for o in objects} == {"Role", "RoleBinding"}
    for o in objects:
        o["metadata"]["namespace"] = ns
        for subject in o.get("subjects") or []:
            subject["namespace"] = ns
    kubectl(test_cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objects))
    operator = f"--as=system:serviceaccount:{ns}:mcp-forge-operator"
    for account, said in (("mcp-forge-checkpointer", "yes"), ("mcp-forge-gateway", "no")):
        done = subprocess.run(
            [test_cluster.bin("kubectl"), f"--kubeconfig={test_cluster.kubeconfig}", "-n", ns,
             "auth", "can-i", "create", f"serviceaccounts/{account}", "--subresource=token",
             operator],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.stdout.strip() == said, (account, done.stdout, done.stderr)


# What a woken kernel holds of userfaultfd (its descriptors), whether userfaultfd()
# gives it one (-1: refused), and whether it sees the node's /dev/userfaultfd.
# userfaultfd's syscall number by the kernel's machine (x86_64, aarch64).
NO_USERFAULTFD = (
    "import ctypes, os, platform\n"
    "fds = [f for f in os.listdir('/proc/self/fd')\n"
    "       if 'userfaultfd' in os.path.realpath(f'/proc/self/fd/{f}')]\n"
    "nr = {'x86_64': 323, 'aarch64': 282}[platform.machine()]\n"
    "print(fds, ctypes.CDLL(None, use_errno=True).syscall(nr, 0),"
    " os.path.exists('/dev/userfaultfd'))"
)


def _lazy_pages(pod: dict[str, Any]) -> int:
    """How many pages CRIU left to the node's page server (lazy pages: images/node/
    runc-restore/lazy.go) when it restored the kernel of this pod, from its restore log;
    each in a mapping of LAZY_VMA_MIN or more (images/criu/lazy-large-only.patch: a
    smaller one's pages come with the process)."""
    (status,) = pod["status"]["containerStatuses"]
    cid = status["containerID"].removeprefix("containerd://")
    work = TASKS / cid / "mcpforge-restore-work"
    assert (work / "lazy-pages.log").is_file(), sorted(p.name for p in work.iterdir())
    log = (work / "restore.log").read_text()
    # The root task logs every task's mappings, under its own pid: all are looked at.
    vmas = [(int(a, 16), int(b, 16)) for a, b in re.findall(r": vma 0x(\w+) 0x(\w+)$", log, re.M)]
    skipped = re.findall(r": Lazy restore skips (\d+) pages at (\w+)$", log, re.M)
    for _, at in skipped:
        around = [v for v in vmas if v[0] <= int(at, 16) < v[1]]
        assert around, f"{at}: in no mapping of the log"
        assert all(b - a >= LAZY_VMA_MIN for a, b in around), f"{at} of {around} left lazy"
    return sum(int(n) for n, _ in skipped)


async def _suspended(
    kube: Kube, ns: str, name: str, state: str = "", **spec: Any
) -> dict[str, Any]:
    """Suspend the session, a client connected to its kernel with some state in it (STATE,
    then `state`); the session once Suspended."""
    body = session_body(name, ns, image=IMAGE, resources=SMALL, **spec)
    await asyncio.to_thread(kube.create, body)
    await ready(kube, ns, name)
    async with kernel(kube, ns, name) as conn:
        assert await run_in_kernel(conn, STATE + state) == "41\n"
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
    """A suspended session wakes with its variables, its threads and the file of its
    persistent workspace it holds open, as its own: the node's handler mounts the
    workspace idmapped for CRIU, as runc does for a new container, and the kubelet leaves
    the files' modes as they were (CRIU checks them)."""
    obj = await _suspended(kube, ns, "napper", BIG + OPEN_FILE, workspace=PERSISTENT)
    snap = obj["status"].get("snapshot") or {}
    archive = CHECKPOINTS / str(snap.get("archive"))
    try:
        assert snap.get("node") and archive.is_file(), obj["status"]
        assert "its memory is kept" in obj["status"]["message"], obj["status"]
        # The handler kept the images unpacked beside the archive, which names them.
        kept = ROOT / "restore" / "+taken" / _token(archive)
        assert (kept / "inventory.img").is_file(), sorted(p.name for p in kept.iterdir())
        obj = await _resumed(kube, ns, "napper", before="")
        assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj
        assert not obj["status"].get("snapshot"), obj["status"]
        assert await removed(archive, kept), "woken from, the archive and its kept images are spent"
        pod = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
        assert pod is not None and pod["spec"]["hostUsers"] is False, pod
        assert _lazy_pages(pod) > 0, "its pages were read as the kernel touched them"
        async with kernel(kube, ns, "napper") as conn:
            said = await run_in_kernel(conn, "print(x + 1, t.is_alive(), big == b'x' * (32 << 20))")
            assert said == "42 True True\n", said
            # The userfaultfd its pages came through is the node's page server's, not the
            # kernel's, and the kernel can make none of its own.
            said = await run_in_kernel(conn, NO_USERFAULTFD)
            assert said == "[] -1 False\n", said
            said = await run_in_kernel(
                conn, "log.write('b'); log.flush(); print(open('log.txt').read())"
            )
            assert said == "ab\n", said
            # Code mode's bridge, first started in the woken kernel, whose pod has no
            # connection file (its launcher wrote it in the old pod's /tmp): it takes the
            # gateway with the session's certificate, which the gateway hands it.
            info = await connection_of(kube, ns, "napper")
            await start_bridge(conn, info)
            assert info.bridge is not None and await bridge_takes(conn, info, info.bridge)
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)


MEMORY = "import hashlib, os\ndata = os.urandom(96 << 20)\nprint(hashlib.sha256(data).hexdigest())"


async def test_a_kernel_suspended_as_soon_as_it_woke_wakes_whole_again(
    kube: Kube, ns: str, snapshotting: Any
) -> None:
    """A suspend right after a wake, while the node's page server may still be writing
    the kernel's pages in: the checkpoint waits for them (images/node/runc-restore:
    pagesIn), so the next wake has all 96 MiB, not zeros where pages were still out."""
    body = session_body("twice", ns, image=IMAGE, resources={"memory": "512Mi", "cpu": "500m"})
    await asyncio.to_thread(kube.create, body)
    obj = await ready(kube, ns, "twice")
    async with kernel(kube, ns, "twice") as conn:
        digest = await run_in_kernel(conn, MEMORY, timeout=120)
    suspend = {"spec": {"operatingMode": "Suspended"}}
    for turn in range(2):
        pod, before = str(obj["status"]["podName"]), str(obj["status"]["kernelId"])
        await asyncio.to_thread(kube.patch, KS, ns, "twice", suspend)  # at once after Ready
        await eventually(
            kube, KS, ns, "twice",
            lambda o: phase(o) == "Suspended" and bool((o or {})["status"].get("snapshot")),
            timeout=120, what=f"Suspended with a snapshot ({turn})",
        )  # fmt: skip
        await eventually(kube, "Pod", ns, pod, lambda o: o is None, timeout=120, what="gone")
        obj = await _resumed(kube, ns, "twice", before=before)
        assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj
        woken = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
        assert woken is not None and _lazy_pages(woken) > 0, "its pages came lazily"
    async with kernel(kube, ns, "twice") as conn:
        said = await run_in_kernel(conn, "print(hashlib.sha256(data).hexdigest())", timeout=60)
    assert said == digest, "pages lost across a suspend right after a wake"


async def test_an_ephemeral_sessions_files_come_back_with_its_memory(
    kube: Kube, ns: str, snapshotting: Any, tmp_path: Path
) -> None:
    """A session without a persistent workspace (or a sharedGroup) has no volume: its
    /workspace and /tmp are its container's writable layer, which the kubelet's archive
    holds and the node's handler puts back before CRIU restores the process
    (images/node/runc-restore/rootfs.go). Its files come back, one held open, with their
    owner; a link the kernel planted to a file of the node's comes back as a link, the
    node's file untouched (the handler, root, follows no link of the kernel's)."""
    node_file = tmp_path / "node-file"
    node_file.write_text("node")
    node_file.chmod(0o600)
    before = os.lstat(node_file)
    files = (
        "import os\n"
        "open('/tmp/scratch', 'w').write('t')\n"
        f"os.symlink({str(node_file)!r}, 'to-node')\n"
        "os.makedirs('d/e')\n"
        "open('d/e/f', 'w').write('deep')\n"
    )
    obj = await _suspended(kube, ns, "ephemeral", OPEN_FILE + files)
    archive = CHECKPOINTS / str((obj["status"].get("snapshot") or {}).get("archive"))
    try:
        assert archive.is_file(), obj["status"]
        obj = await _resumed(kube, ns, "ephemeral", before="")
        assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj
        async with kernel(kube, ns, "ephemeral") as conn:
            said = await run_in_kernel(
                conn,
                "log.write('b'); log.flush()\n"
                "print(x, open('log.txt').read(), open('/tmp/scratch').read(),"
                " open('d/e/f').read(), os.readlink('to-node'),"
                " os.stat('log.txt').st_uid == os.getuid() == os.stat('d/e').st_uid)",
            )
        assert said == f"41 ab t deep {node_file} True\n", said
        after = os.lstat(node_file)
        assert (after.st_uid, after.st_gid, after.st_mode) == (
            before.st_uid,
            before.st_gid,
            before.st_mode,
        )
        assert node_file.read_text() == "node"
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)


# The ticking thread stopped: it ticked, and its file holds what it remembers writing.
TICKED = (
    "ticking[1] = False; ticker.join()\n"
    "print(ticking[0] > 0, os.path.getsize('ticks') == 2 * ticking[0])"
)


async def test_a_shared_group_sessions_emptydir_files_come_back_with_its_memory(
    kube: Kube, ns: str, snapshotting: Any
) -> None:
    """A session of a sharedGroup without a persistent workspace has volumes: its
    /workspace an emptyDir on the node's disk, its /tmp a memory one. Both end with the
    pod, so the node's handler packs them into the checkpoint and writes them into the
    new pod's before CRIU restores the process (images/node/runc-restore/volumes.go):
    its files come back, one held open, with their owner, and /shared is left as it is.
    A thread writes to a file all along: containerd pauses the kernel from before CRIU's
    dump until its files are written (the handler packs the volumes meanwhile), so the
    session and its fork wake with files that are what their memory says."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "mcpforge-shared-team", "namespace": ns},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}},
    }
    await asyncio.to_thread(kube.create, claim)
    files = (
        "import os\n"
        "open('/tmp/scratch', 'w').write('t')\n"
        "os.makedirs('d/e')\n"
        "open('d/e/f', 'w').write('deep')\n"
        "open('/shared/mine', 'w').write('s1')\n"
        # A thread appending to an open file all along: the kernel is paused until its
        # volumes are packed, so the file is the length its memory counted.
        "ticks = open('ticks', 'a', buffering=1); ticking = [0, True]\n"
        "def _tick():\n"
        "    while ticking[1]:\n"
        "        ticks.write('.\\n'); ticking[0] += 1; time.sleep(0.0005)\n"
        "ticker = threading.Thread(target=_tick, daemon=True); ticker.start()\n"
    )
    obj = await _suspended(kube, ns, "grouped", OPEN_FILE + files, sharedGroup="team")
    archive = CHECKPOINTS / str((obj["status"].get("snapshot") or {}).get("archive"))
    try:
        assert archive.is_file(), obj["status"]
        obj = await _resumed(kube, ns, "grouped", before="")
        assert (obj["status"].get("lastRestore") or {}).get("outcome") == "Restored", obj
        async with kernel(kube, ns, "grouped") as conn:
            said = await run_in_kernel(
                conn,
                "log.write('b'); log.flush()\n"
                "print(x, open('log.txt').read(), open('/tmp/scratch').read(),"
                " open('d/e/f').read(), open('/shared/mine').read(),"
                " os.stat('log.txt').st_uid == os.getuid() == os.stat('d/e').st_uid,"
                " os.stat('/tmp/scratch').st_uid == os.getuid())",
            )
        assert said == "41 ab t deep s1 True True\n", said
        # A fork of it wakes with a copy of them, its own from then on.
        fork = session_body("grouped-copy", ns, image=IMAGE, resources=SMALL, sharedGroup="team")
        fork["metadata"]["annotations"] = {FORKED_FROM: "grouped"}
        await asyncio.to_thread(kube.create, fork)
        status = (await ready(kube, ns, "grouped-copy"))["status"]
        assert (status.get("lastRestore") or {}).get("outcome") == "Restored", status
        async with kernel(kube, ns, "grouped-copy") as conn:
            said = await run_in_kernel(
                conn,
                "log.write('c'); log.flush()\n"
                "print(open('log.txt').read(), open('/tmp/scratch').read())",
            )
            ticked = await run_in_kernel(conn, TICKED)
        assert said == "abc t\n", said
        assert ticked == "True True\n", f"the fork's ticks file is not its memory's: {ticked}"
        async with kernel(kube, ns, "grouped") as conn:
            assert await run_in_kernel(conn, "print(open('log.txt').read())") == "ab\n"
            ticked = await run_in_kernel(conn, TICKED)
        assert ticked == "True True\n", f"the ticks file is not its memory's: {ticked}"
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)
        for left in CHECKPOINTS.glob(f"checkpoint-ks-grouped_{ns}-*"):  # the fork's
            await asyncio.to_thread(left.unlink, missing_ok=True)


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


@pytest.fixture
async def brief_snapshots(kube: Kube, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """The operator, keeping suspended kernels' memory for 6 seconds."""
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_MAX_AGE", "6")
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_RUNTIME_CLASS", RESTORE_CLASS)
    monkeypatch.setenv("MCPFORGE_SNAPSHOT_SIZE_RECHECK", "1")  # the sweeper's rounds here
    await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
    async with running_operator(kube) as op:
        yield op


async def test_a_snapshot_past_its_age_is_dropped_by_itself_and_the_session_wakes_afresh(
    kube: Kube, ns: str, brief_snapshots: Any
) -> None:
    """Nothing else happens to the suspended session: the operator looks at it again
    when its snapshot is due to go, and the node's sweeper may then remove the archive."""
    obj = await _suspended(kube, ns, "aged")
    archive = CHECKPOINTS / str((obj["status"].get("snapshot") or {}).get("archive"))
    try:
        assert archive.is_file(), obj["status"]

        def dropped(o: dict[str, Any] | None) -> bool:
            last = ((o or {}).get("status") or {}).get("lastRestore") or {}
            return last.get("outcome") == "Discarded"

        seen = await eventually(kube, KS, ns, "aged", dropped, timeout=60, what="Discarded")
        assert seen is not None and not seen["status"].get("snapshot"), seen
        obj = seen
        assert "kept for its longest" in obj["status"]["lastRestore"]["message"], obj["status"]
        assert "variables are lost (no snapshot)" in obj["status"]["message"], obj["status"]
        assert phase(obj) == "Suspended"
        obj = await _resumed(kube, ns, "aged", before="")
        pod = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
        assert pod is not None, obj
        assert snapshots.RESTORE_FROM not in (pod["metadata"].get("annotations") or {}), pod
        async with kernel(kube, ns, "aged") as conn:
            assert await run_in_kernel(conn, "print('x' in globals())") == "False\n"
    finally:
        await asyncio.to_thread(archive.unlink, missing_ok=True)


def _token(archive: Path) -> str:
    """The token of the archive's images kept unpacked on the node (images/node/
    runc-restore/taken.go)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("checkpoint/mcpforge-taken")
        assert member is not None
        return member.read().decode().strip()


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


SWEEPER = "mcp-forge-snapshot-sweeper"
NODE_NS = "mcp-forge-node"


async def test_the_nodes_sweeper_removes_the_archives_no_session_holds(
    kube: Kube, ns: str, snapshotting: Any, test_cluster: ClusterUnderTest
) -> None:
    """manifests/overlays/snapshots' sweeper, as installed (but for the kubelet's
    directory, the test node's, and a round a second): an archive a session holds stays,
    however old, and its size reaches the session's status through the node's ConfigMap;
    one no session holds goes once past its grace, as does the held one when its session
    is deleted; nothing else in the directory is touched."""
    obj = await _suspended(kube, ns, "held")
    held = CHECKPOINTS / str((obj["status"].get("snapshot") or {}).get("archive"))
    stray = CHECKPOINTS / f"checkpoint-ks-gone_{ns}-kernel-2026-12-01T00:00:00Z.tar"
    young = CHECKPOINTS / f"checkpoint-ks-young_{ns}-kernel-2026-12-01T00:00:00Z.tar"
    other = CHECKPOINTS / f"checkpoint-web_{ns}-kernel-2026-12-01T00:00:00Z.tar"
    files = (held, stray, young, other)
    try:
        assert held.is_file(), obj["status"]
        async with sweeping(test_cluster) as removed:
            hour_ago = time.time() - 3600
            for f in (stray, young, other):
                f.write_bytes(b"not an archive")
            for f in (held, stray, other):
                os.utime(f, (hour_ago, hour_ago))
            await removed(stray.name)
            assert held.is_file() and young.is_file() and other.is_file()
            size = held.stat().st_size
            assert size > 1_000_000, size  # a kernel's memory, not a stand-in
            await eventually(
                kube, KS, ns, "held",
                lambda o: ((o or {}).get("status") or {}).get("snapshot", {}).get("size") == size,
                timeout=60, what=f"status.snapshot.size {size}",
            )  # fmt: skip
            shown = await asyncio.to_thread(
                kube.get, "ConfigMap", NODE_NS, sizes_name(obj["status"]["snapshot"]["node"])
            )
            assert shown is not None
            assert json.loads(shown["data"]["sizes.json"]) == {held.name: size}
            await asyncio.to_thread(kube.delete, KS, ns, "held")
            await removed(held.name)
            assert not held.exists() and not stray.exists()
            assert young.is_file() and other.is_file()
    finally:
        for f in files:
            f.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def sweeping(cluster: ClusterUnderTest) -> AsyncIterator[Any]:
    """The overlay's sweeper objects applied, its pod running; in the block, a call that
    waits (under a deadline) until its log says it removed the archive named."""
    await operator_image_on_node()
    built = kubectl(cluster, "kustomize", str(ROOT_REPO / "manifests" / "overlays" / "snapshots"))
    objects = [o for o in yaml.safe_load_all(built) if o and _sweepers(o)]
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
    volume["hostPath"]["path"] = str(CHECKPOINTS)
    args = pod["containers"][0]["args"]
    args[args.index("--every") + 1] = "1"
    logs = None
    try:
        kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objects))
        kubectl(cluster, "-n", NODE_NS, "rollout", "status", f"ds/{SWEEPER}", "--timeout=120s")
        logs = await asyncio.create_subprocess_exec(
            cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", NODE_NS,
            "logs", "-f", f"ds/{SWEEPER}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        stream = logs.stdout
        assert stream is not None

        seen: list[str] = []

        async def removed(name: str) -> None:
            try:
                async with asyncio.timeout(60):
                    while line := (await stream.readline()).decode():
                        seen.append(line)
                        if f" removed {name} " in line:
                            return
            except TimeoutError:
                raise AssertionError(f"{name} not removed in 60 s; the sweeper: {seen}") from None
            raise AssertionError(f"the sweeper's log ended: {seen}")

        yield removed
    finally:
        if logs is not None and logs.returncode is None:
            logs.terminate()
            await logs.wait()
        cluster_wide = [o for o in objects if not o["metadata"].get("namespace")]
        for o in sorted(cluster_wide, key=lambda o: o["kind"] == "Namespace"):
            with contextlib.suppress(AssertionError):  # the test's own failure shows
                kubectl(cluster, "delete", o["kind"], o["metadata"]["name"],
                        "--ignore-not-found", "--timeout=120s")  # fmt: skip


async def operator_image_on_node() -> None:
    """The control plane's image (the operator's, whose CLI the node pods run), built
    (cached by its inputs) and imported into the test node's containerd."""
    await build_control_plane(progress=lambda line: None)
    imported = await asyncio.to_thread(
        subprocess.run,
        [str(Path(__file__).parent / "cluster"), "import", image_ref("operator")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr


def _sweepers(o: dict[str, Any]) -> bool:
    """The sweeper's objects and its namespace's (not the key placer's: test_snapshot_key)."""
    labels = o["metadata"].get("labels") or {}
    if labels.get("app.kubernetes.io/component") == "snapshot-key":
        return False
    return (
        labels.get("app.kubernetes.io/component") == "snapshot-sweeper"
        or o["metadata"].get("namespace") == NODE_NS
        or (o["kind"] == "Namespace" and o["metadata"]["name"] == NODE_NS)
    )
