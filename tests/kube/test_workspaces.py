"""Persistent workspaces on the real test cluster: a PersistentVolumeClaim of the session's,
provisioned for real (the cluster's default StorageClass, local-path-provisioner), mounted by
every kernel pod the session has and deleted with it unless its reclaimPolicy is Retain.

Each replacement of the kernel pod (a suspension, a Recreate update, an OOM kill) is seen as
users see it: a new kernelId, a kernel without the variables, and the files still there.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from mcp_forge.clients.kube import Kube
from mcp_forge.control.workspace import WORKSPACE_SIZED as SIZED
from mcp_forge.errors import ApiError

from .cluster_common import PROVISIONER
from .harness import (
    KS,
    condition,
    eventually,
    kernel,
    kernel_dies,
    ready,
    run_in_kernel,
    session_body,
)

CLAIM = "PersistentVolumeClaim"
LOOK = (
    "import json, os\n"
    "print(json.dumps(['x' in dir(), sorted(f[:-4] for f in os.listdir() if f.endswith('.txt'))]))"
)
GONE = 90.0  # the garbage collector, then the claim's protection until its pod is gone
CLASS = "mcpforge-test-expandable"
EXPANDABLE = {  # the default class, but that claims of it may grow
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": CLASS},
    "provisioner": PROVISIONER,
    "volumeBindingMode": "WaitForFirstConsumer",
    "reclaimPolicy": "Delete",
    "allowVolumeExpansion": True,
}


class Workspace:
    """A session's kernel as a user sees it across replacements: files written, then looked
    at in the next kernel."""

    def __init__(self, kube: Kube, ns: str, name: str) -> None:
        self.kube, self.ns, self.name = kube, ns, name
        self.tags: list[str] = []

    async def write(self, tag: str) -> None:
        self.tags.append(tag)
        async with kernel(self.kube, self.ns, self.name) as conn:
            await run_in_kernel(conn, f"x = 1\nopen('{tag}.txt', 'w').write('{tag}')")

    async def replaced(self, before: str) -> str:
        """The next kernel's id, once it is Ready: its variables gone, every file there."""
        obj = await ready(self.kube, self.ns, self.name, other_than=before)
        async with kernel(self.kube, self.ns, self.name) as conn:
            seen = json.loads(await run_in_kernel(conn, LOOK))
        assert seen == [False, sorted(self.tags)], "variables lost, files kept"
        kernel_id: str = obj["status"]["kernelId"]
        return kernel_id


async def _create(kube: Kube, ns: str, name: str, **workspace: Any) -> dict[str, Any]:
    body = session_body(
        name,
        ns,
        resources={"memory": "128Mi", "cpu": "100m"},
        updateStrategy="Recreate",
        workspace={"persistent": True, "size": "64Mi", **workspace},
    )
    made: dict[str, Any] = await asyncio.to_thread(kube.create, body)
    return made


async def _patch(kube: Kube, ns: str, name: str, spec: dict[str, Any]) -> None:
    await asyncio.to_thread(kube.patch, KS, ns, name, {"spec": spec})


async def test_files_outlive_a_suspension_a_recreate_and_an_oom_and_go_with_the_session(
    kube: Kube, ns: str, operator: Any
) -> None:
    made = await _create(kube, ns, "ws")
    kernel_id = (await ready(kube, ns, "ws"))["status"]["kernelId"]
    claim = await asyncio.to_thread(kube.get, CLAIM, ns, "ks-ws-workspace")
    assert claim is not None and claim["status"]["phase"] == "Bound", claim
    (owner,) = claim["metadata"]["ownerReferences"]
    assert owner["uid"] == made["metadata"]["uid"], "owned: deleted with the session"
    assert claim["spec"]["resources"]["requests"]["storage"] == "64Mi"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-ws")
    assert pod is not None
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "workspace"]
    assert volume["persistentVolumeClaim"] == {"claimName": "ks-ws-workspace"}
    ws = Workspace(kube, ns, "ws")

    await ws.write("suspended")
    await _patch(kube, ns, "ws", {"operatingMode": "Suspended"})
    await eventually(kube, "Pod", ns, "ks-ws", lambda p: p is None, timeout=60, what="no pod")
    await _patch(kube, ns, "ws", {"operatingMode": "Running"})
    kernel_id = await ws.replaced(kernel_id)

    await ws.write("recreated")
    await _patch(kube, ns, "ws", {"env": [{"name": "A", "value": "1"}]})
    kernel_id = await ws.replaced(kernel_id)

    await ws.write("oom")
    dead = await kernel_dies(kube, ns, "ws", "big = bytearray(512 * 2**20)")
    (state,) = dead["status"]["containerStatuses"]
    assert state["state"]["terminated"]["reason"] == "OOMKilled", state
    await ws.replaced(kernel_id)

    await asyncio.to_thread(kube.delete, KS, ns, "ws")
    await eventually(
        kube, CLAIM, ns, "ks-ws-workspace", lambda c: c is None, timeout=GONE, what="deleted"
    )


async def test_retain_keeps_the_claim_for_the_next_session_of_that_name(
    kube: Kube, ns: str, operator: Any
) -> None:
    await _create(kube, ns, "keep", reclaimPolicy="Retain")
    await ready(kube, ns, "keep")
    claim = await asyncio.to_thread(kube.get, CLAIM, ns, "ks-keep-workspace")
    assert claim is not None and not claim["metadata"].get("ownerReferences"), claim
    assert claim["metadata"]["labels"]["mcpforge.dev/session"] == "keep"
    ws = Workspace(kube, ns, "keep")
    await ws.write("kept")
    await asyncio.to_thread(kube.delete, KS, ns, "keep")
    # The garbage collector has done its work once the owned children are gone.
    for kind, child in (("Pod", "ks-keep"), ("Secret", "ks-keep-conn")):
        await eventually(kube, kind, ns, child, lambda o: o is None, timeout=GONE, what="gone")
    claim = await asyncio.to_thread(kube.get, CLAIM, ns, "ks-keep-workspace")
    assert claim is not None and not claim["metadata"].get("deletionTimestamp"), claim

    # The next session of that name mounts it, and owns it (reclaimPolicy Delete).
    again = await _create(kube, ns, "keep")
    await ws.replaced("")
    owned = await eventually(
        kube,
        CLAIM,
        ns,
        "ks-keep-workspace",
        lambda c: (
            [r["uid"] for r in (c or {})["metadata"].get("ownerReferences") or []]
            == [again["metadata"]["uid"]]
        ),
        what="owned by the new session",
    )
    assert owned is not None
    await asyncio.to_thread(kube.delete, KS, ns, "keep")
    await eventually(
        kube, CLAIM, ns, "ks-keep-workspace", lambda c: c is None, timeout=GONE, what="deleted"
    )


async def test_a_workspace_grows_where_its_storage_class_allows_and_says_why_it_cannot(
    kube: Kube, kube_api: Any, ns: str, operator: Any
) -> None:
    """spec.workspace.size grown: the claim is asked to grow where its StorageClass allows
    expansion (this cluster has no resizer, so it stays Resizing), refused by the API server
    where it does not (the default class here), and never shrunk; the kernel runs on."""
    kube_api.kubectl("apply", "-f", "-", input=json.dumps(EXPANDABLE))
    await asyncio.gather(
        _create(kube, ns, "fixed"), _create(kube, ns, "grows", storageClassName=CLASS)
    )
    fixed, grows = await asyncio.gather(ready(kube, ns, "fixed"), ready(kube, ns, "grows"))
    for obj in (fixed, grows):
        assert not condition(obj, SIZED), "no size asked for but the first: no condition"

    def sized(reason: str) -> Callable[[dict[str, Any] | None], bool]:
        return lambda o: condition(o, SIZED).get("reason") == reason

    await asyncio.gather(
        _patch(kube, ns, "fixed", {"workspace": {"persistent": True, "size": "128Mi"}}),
        _patch(kube, ns, "grows", {"workspace": {"persistent": True, "size": "128Mi",
                                                 "storageClassName": CLASS}}),
    )  # fmt: skip
    refused = await eventually(kube, KS, ns, "fixed", sized("ResizeRefused"), what="refused")
    said = condition(refused, SIZED)
    assert said["status"] == "False" and "ks-fixed-workspace" in said["message"], said
    assert "resize" in said["message"], "the API server's reason, as it gave it"
    claim = await asyncio.to_thread(kube.get, CLAIM, ns, "ks-fixed-workspace")
    assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "64Mi"

    await eventually(kube, KS, ns, "grows", sized("Resizing"), what="resizing")
    claim = await asyncio.to_thread(kube.get, CLAIM, ns, "ks-grows-workspace")
    assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "128Mi"

    # Smaller: the API server refuses it (the CRD's rule), and nothing changes.
    with pytest.raises(ApiError) as shrink:
        await _patch(kube, ns, "grows", {"workspace": {"persistent": True, "size": "64Mi",
                                                       "storageClassName": CLASS}})  # fmt: skip
    assert shrink.value.status == 422 and "cannot shrink" in str(shrink.value), shrink.value
    after = await asyncio.to_thread(kube.get, KS, ns, "grows")
    assert after is not None and after["spec"]["workspace"]["size"] == "128Mi"
    # An emptyDir workspace may shrink: the rule is for claims only.
    await _patch(kube, ns, "fixed", {"workspace": {"persistent": False, "size": "32Mi"}})

    # The kernels run on, replaced for their new size (Recreate: it bounds files too).
    def settled(o: dict[str, Any] | None) -> bool:
        ready = condition(o, "Ready")
        return (
            ready.get("status") == "True"
            and ready.get("observedGeneration") == (o or {})["metadata"]["generation"]
            and condition(o, "UpdatePending").get("status") == "False"
        )

    for name in ("fixed", "grows"):
        await eventually(kube, KS, ns, name, settled, timeout=120, what="Ready, up to date")
        async with kernel(kube, ns, name) as conn:
            assert await run_in_kernel(conn, "print(6 * 7)") == "42\n"
    gone = await asyncio.to_thread(kube.get, KS, ns, "fixed")
    assert not condition(gone, SIZED), "no claim in use: no condition"
