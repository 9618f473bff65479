"""The kubelet's checkpoint of a kernel in a pod with a user namespace of its own, and a new
pod that wakes from it (issue 27's cluster side, its node half; docs/design.md §14).

The pod runs on the node's `userns` runtime handler (a newer runc, tests/kube/runc/build)
with `hostUsers: false`, as uid 1000, as kernels do. Its user namespace is made by the
runtime as the mapped root, not by root, and root here lacks CAP_SYS_RESOURCE: CRIU could
not read the kernel's limits (prlimit64) until images/criu/rlimits-from-proc.patch.

A pod wakes from a checkpoint on the node's `mcpforge-restore` handler (mcpforge-runc,
images/node/runc-restore), named by its annotation mcpforge.dev/restore-from; the attacks
on that handler (another namespace's checkpoint, names that climb out) are here too, as
the cluster's attacks are (docs/security.md).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes.stream

from mcp_forge.clients.kube import Kube
from mcp_forge.control.snapshots import refusal

from .cluster_common import NODE, ROOT
from .conftest import RESTRICTED, delete_namespace, make_namespace
from .harness import eventually, removed

RUNTIME_CLASS = "mcpforge-userns"
RESTORE_CLASS = "mcpforge-restore"  # the node's handler of that name: images/node/runc-restore
RESTORE_FROM = "mcpforge.dev/restore-from"
IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"
# Prints its user namespace's map, then holds a million ints and counts, as a kernel lives.
PROGRAM = """
import itertools, sys, time
print(open('/proc/self/uid_map').read().split(), flush=True)
x = list(range(1_000_000))
for i in itertools.count():
    print(i, flush=True)
    time.sleep(0.2)
"""


def _runtime_class(name: str, handler: str) -> None:
    api = kubernetes.client.NodeV1Api()
    body: Any = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": name},
        "handler": handler,
    }
    try:
        api.create_runtime_class(body)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def _pod(
    ns: str, name: str = "napper", runtime: str = RUNTIME_CLASS, restore: str | None = None
) -> dict[str, Any]:
    locked = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "annotations": {RESTORE_FROM: restore} if restore else {},
        },
        "spec": {
            "runtimeClassName": runtime,
            "hostUsers": False,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "kernel",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", PROGRAM],
                    "securityContext": locked,
                    "resources": {"limits": {"cpu": "200m", "memory": "256Mi"}},
                }
            ],
        },
    }


def _members(archive: Path) -> tuple[set[str], int]:
    """The checkpoint archive's members, and the size of the memory pages in it."""
    assert archive.is_relative_to(ROOT), archive  # the node's, under the test cluster's
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    pages = sum(m.size for m in members if m.name.startswith("checkpoint/pages-"))
    return {m.name for m in members}, pages


def _running(pod: dict[str, Any] | None) -> bool:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return any("running" in (c.get("state") or {}) for c in statuses)


def _refused(pod: dict[str, Any] | None) -> str:
    """What the handler said when it would not start the pod's container ("" if nothing)."""
    return refusal(pod or {})


class Log:
    """The lines a pod's kernel prints, each with the time it printed it."""

    def __init__(self, ns: str, pod: str) -> None:
        self.stream: Any = kubernetes.client.CoreV1Api().read_namespaced_pod_log(
            pod,
            ns,
            container="kernel",
            follow=True,
            timestamps=True,
            _preload_content=False,
            _request_timeout=(10, 60),
        )

    def _line(self) -> tuple[float, str]:
        stamp, _, text = bytes(self.stream.readline()).decode().strip().partition(" ")
        assert text, f"the kernel's log ended ({stamp!r}): did its container stop?"
        whole, _, fraction = stamp.rstrip("Z").partition(".")
        when = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
        return when.timestamp() + float(f"0.{fraction or 0}"), text

    async def next(self) -> tuple[float, str]:
        return await asyncio.wait_for(asyncio.to_thread(self._line), 30)

    def close(self) -> None:
        self.stream.close()  # its connection too: a reader still blocked on it ends


async def _napper(kube: Kube, ns: str) -> tuple[Log, int]:
    """The napper pod, running in a user namespace of its own, its log, and a count it
    printed a second after it started."""
    node: Any = await asyncio.to_thread(kubernetes.client.CoreV1Api().read_node, NODE)
    handlers = {h.name: h.features for h in node.status.runtime_handlers or []}
    assert {"userns", RESTORE_CLASS} <= handlers.keys(), (
        f"the node lacks the userns or {RESTORE_CLASS} runtime handler ({sorted(handlers)}): "
        "a cluster started before they were added; run tests/kube/cluster down, then up"
    )
    assert handlers["userns"].user_namespaces, handlers["userns"]
    await asyncio.to_thread(_runtime_class, RUNTIME_CLASS, "userns")
    await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
    await asyncio.to_thread(kube.create, _pod(ns))
    await eventually(kube, "Pod", ns, "napper", _running, timeout=120, what="running")
    log = Log(ns, "napper")
    try:
        # Its uid 0 is not the host's: a namespace of its own (the map: 0 <host uid> 65536).
        mapped = json.loads((await log.next())[1].replace("'", '"'))
        assert mapped[0] == "0" and mapped[1] != "0" and mapped[2] == "65536", mapped
        while (counted := int((await log.next())[1])) < 5:  # a second of counting
            pass
    except BaseException:
        log.close()
        raise
    return log, counted


async def _checkpoint(ns: str) -> tuple[Path, float]:
    """The kubelet's checkpoint of napper's kernel, through the API server's node proxy:
    the archive on the node, and when the call returned."""
    answer: Any = await asyncio.to_thread(
        kubernetes.client.CoreV1Api().connect_post_node_proxy_with_path,
        NODE,
        f"checkpoint/{ns}/napper/kernel",
        _preload_content=False,
        _request_timeout=120,
    )
    done = time.time()
    items = json.loads(answer.data)["items"]
    assert len(items) == 1 and items[0].endswith(".tar"), items
    return Path(items[0]), done


async def _runs_on(kube: Kube, ns: str, log: Log, counted: int, since: float) -> None:
    """napper's kernel ran on: a line printed after `since` (the node's clock is this
    machine's), counting on from `counted`, by the same container."""
    while (got := await log.next())[0] <= since:
        pass
    assert int(got[1]) > counted, (got, counted)
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "napper")
    assert pod is not None and _running(pod), pod
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]


def _uid_map(ns: str, pod: str) -> list[str]:
    out = kubernetes.stream.stream(
        kubernetes.client.CoreV1Api().connect_get_namespaced_pod_exec,
        pod,
        ns,
        container="kernel",
        command=["cat", "/proc/1/uid_map"],
        stderr=True,
        stdout=True,
        stdin=False,
        tty=False,
    )
    return str(out).split()


async def test_the_kubelet_checkpoints_a_kernel_in_its_own_user_namespace(
    kube: Kube, ns: str
) -> None:
    log, counted = await _napper(kube, ns)
    archive = None
    try:
        archive, done = await _checkpoint(ns)
        names, pages = await asyncio.to_thread(_members, archive)
        assert {"checkpoint/inventory.img", "checkpoint/pstree.img"} <= names, sorted(names)
        assert pages > 32 << 20, pages  # the million ints (some 40 MB) it holds were dumped
        await _runs_on(kube, ns, log, counted, done)
    finally:
        log.close()
        if archive is not None:
            await asyncio.to_thread(archive.unlink, missing_ok=True)


async def test_a_pod_wakes_from_a_checkpoint_in_a_user_namespace_of_its_own(
    kube: Kube, kube_api: Any
) -> None:
    """A pod of another namespace naming the checkpoint is refused; the woken pod's kernel
    goes on from it, in its own user namespace, while napper goes on too (a fork), and
    the archive is spent."""
    ns, kubeconfig = kube_api.namespace, kube_api.kubeconfig
    log, counted = await _napper(kube, ns)
    archive, woken, other = None, None, f"{ns[:50]}-other"
    try:
        archive, done = await _checkpoint(ns)
        # Another namespace's pod may not wake from it (its memory holds the session's keys).
        await asyncio.to_thread(make_namespace, kubeconfig, other, RESTRICTED)
        await asyncio.to_thread(
            kube.create, _pod(other, "thief", RESTORE_CLASS, restore=archive.name)
        )
        pod = await eventually(
            kube, "Pod", other, "thief", lambda p: bool(_refused(p)), timeout=60, what="refused"
        )
        assert f'sandbox-namespace "{ns}", not this container\'s "{other}"' in _refused(pod)
        assert not _running(pod)
        await asyncio.to_thread(kube.create, _pod(ns, "woken", RESTORE_CLASS, restore=archive.name))
        await eventually(kube, "Pod", ns, "woken", _running, timeout=60, what="running")
        woken = Log(ns, "woken")
        # Its first line is the next count after the checkpoint's (a kernel started afresh
        # would print its uid map first), and it has a host uid of its own.
        first = int((await woken.next())[1])
        assert counted <= first < counted + 50, (first, counted)
        theirs, ours = _uid_map(ns, "napper"), _uid_map(ns, "woken")
        assert ours[0] == "0" and ours[1] not in ("0", theirs[1]), (ours, theirs)
        await _runs_on(kube, ns, log, counted, done)
        assert await removed(archive), "woken from, a checkpoint is spent"
    finally:
        log.close()
        if woken is not None:
            woken.close()
        await asyncio.to_thread(delete_namespace, kubeconfig, other)
        if archive is not None:
            await asyncio.to_thread(archive.unlink, missing_ok=True)


async def test_the_restore_handler_opens_only_the_kubelets_checkpoints(kube: Kube, ns: str) -> None:
    """A name that climbs out of the kubelet's checkpoint directory, or names a file that
    is not there, or a pod in the host's user namespace, is refused before anything is
    read, and said in the pod's status."""
    await asyncio.to_thread(_runtime_class, RESTORE_CLASS, RESTORE_CLASS)
    refusals = {
        "climb": ("../../../../etc/shadow", "is not a checkpoint archive's name"),
        "absolute": ("/etc/shadow", "is not a checkpoint archive's name"),
        "missing": (f"checkpoint-none_{ns}-kernel-1.tar", "no such file or directory"),
    }
    for name, (value, _) in refusals.items():
        await asyncio.to_thread(kube.create, _pod(ns, name, RESTORE_CLASS, restore=value))
    # A restored process keeps its ids: never in the host's user namespace.
    shared = _pod(ns, "host-users", RESTORE_CLASS, restore=refusals["missing"][0])
    shared["spec"]["hostUsers"] = True
    await asyncio.to_thread(kube.create, shared)
    refusals["host-users"] = ("", "only in a user namespace of its own")
    for name, (_, said) in refusals.items():
        pod = await eventually(
            kube, "Pod", ns, name, lambda p: bool(_refused(p)), timeout=60, what="refused"
        )
        assert said in _refused(pod), (name, _refused(pod))
