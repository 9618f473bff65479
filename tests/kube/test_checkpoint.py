"""The kubelet's checkpoint of a kernel in a pod with a user namespace of its own (issue 27's
cluster side, its first half: the restore is still to come; docs/design.md §14).

The pod runs on the node's `userns` runtime handler (a newer runc, tests/kube/runc/build)
with `hostUsers: false`, as uid 1000, as kernels do. Its user namespace is made by the
runtime as the mapped root, not by root, and root here lacks CAP_SYS_RESOURCE: CRIU could
not read the kernel's limits (prlimit64) until images/criu/rlimits-from-proc.patch.
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

from mcp_forge.clients.kube import Kube

from .cluster_common import NODE, ROOT
from .harness import eventually

RUNTIME_CLASS = "mcpforge-userns"
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


def _runtime_class() -> None:
    api = kubernetes.client.NodeV1Api()
    body: Any = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": RUNTIME_CLASS},
        "handler": "userns",
    }
    try:
        api.create_runtime_class(body)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def _pod(ns: str) -> dict[str, Any]:
    locked = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "napper", "namespace": ns},
        "spec": {
            "runtimeClassName": RUNTIME_CLASS,
            "hostUsers": False,
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


def _read_archive(archive: Path) -> tuple[set[str], int]:
    """The checkpoint archive's members, and the size of the memory pages in it; then it
    goes (the node's, under the test cluster's directory, root's)."""
    assert archive.is_relative_to(ROOT), archive
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
        pages = sum(m.size for m in members if m.name.startswith("checkpoint/pages-"))
        return {m.name for m in members}, pages
    finally:
        archive.unlink(missing_ok=True)


def _running(pod: dict[str, Any] | None) -> bool:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return any("running" in (c.get("state") or {}) for c in statuses)


async def test_the_kubelet_checkpoints_a_kernel_in_its_own_user_namespace(
    kube: Kube, ns: str
) -> None:
    node: Any = await asyncio.to_thread(kubernetes.client.CoreV1Api().read_node, NODE)
    handlers = {h.name: h.features for h in node.status.runtime_handlers or []}
    assert "userns" in handlers, (
        f"the node has no userns runtime handler ({sorted(handlers)}): a cluster started "
        "before it was added; run tests/kube/cluster down, then up"
    )
    assert handlers["userns"].user_namespaces, handlers["userns"]
    await asyncio.to_thread(_runtime_class)
    await asyncio.to_thread(kube.create, _pod(ns))
    pod = await eventually(kube, "Pod", ns, "napper", _running, timeout=120, what="running")
    assert pod is not None
    core = kubernetes.client.CoreV1Api()
    stream: Any = core.read_namespaced_pod_log(
        "napper",
        ns,
        container="kernel",
        follow=True,
        timestamps=True,
        _preload_content=False,
        _request_timeout=(10, 60),
    )

    def line() -> tuple[float, str]:  # the next line the kernel prints, and when it did
        stamp, _, text = bytes(stream.readline()).decode().strip().partition(" ")
        assert text, f"the kernel's log ended ({stamp!r}): did its container stop?"
        whole, _, fraction = stamp.rstrip("Z").partition(".")
        when = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
        return when.timestamp() + float(f"0.{fraction or 0}"), text

    async def next_line() -> tuple[float, str]:
        return await asyncio.wait_for(asyncio.to_thread(line), 30)

    items: list[str] = []
    try:
        # Its uid 0 is not the host's: a namespace of its own (the map: 0 <host uid> 65536).
        mapped = json.loads((await next_line())[1].replace("'", '"'))
        assert mapped[0] == "0" and mapped[1] != "0" and mapped[2] == "65536", mapped
        while (counted := int((await next_line())[1])) < 5:  # a second of counting
            pass

        path = f"checkpoint/{ns}/napper/kernel"
        answer: Any = await asyncio.to_thread(
            core.connect_post_node_proxy_with_path,
            NODE,
            path,
            _preload_content=False,
            _request_timeout=120,
        )
        done = time.time()
        items = json.loads(answer.data)["items"]
        assert len(items) == 1 and items[0].endswith(".tar"), items
        names, pages = await asyncio.to_thread(_read_archive, Path(items[0]))
        assert {"checkpoint/inventory.img", "checkpoint/pstree.img"} <= names, sorted(names)
        assert pages > 32 << 20, pages  # the million ints (some 40 MB) it holds were dumped
        # The kernel ran on: a line printed after the checkpoint returned (the node's clock
        # is this machine's), counting on from where it was, by the same container.
        while (got := await next_line())[0] <= done:
            pass
        assert int(got[1]) > counted, (got, counted)
        pod = await asyncio.to_thread(kube.get, "Pod", ns, "napper")
        assert pod is not None and _running(pod), pod
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]
    finally:
        stream.close()  # its connection too: a reader still blocked on it ends
        for item in items:
            await asyncio.to_thread(Path(item).unlink, missing_ok=True)
