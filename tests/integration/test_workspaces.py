"""Local mode: the workspace is a volume of the session's, outliving every kernel it has.

A suspension, a spec change that needs a new pod and an OOM each end the kernel (its
variables are lost, and said to be) while the files written in /workspace stay. With
reclaimPolicy Retain the volume outlives the session too, for the next one of that name.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.errors import InvalidSession
from mcp_forge.runtimes.local import volumes

pytestmark = pytest.mark.podman

LOOK = (
    "import json, os\n"
    "print(json.dumps(['x' in dir(), sorted(f[:-4] for f in os.listdir() if f.endswith('.txt'))]))"
)


async def _write(gateway: Any, name: str, tag: str) -> None:
    r = await gateway.execute(name, f"x = 1\nopen('{tag}.txt', 'w').write('{tag}')")
    assert r.status == "ok", (r.error, r.stderr)


async def _look(gateway: Any, name: str) -> list[Any]:
    r = await gateway.execute(name, LOOK)
    assert r.status == "ok", (r.error, r.stderr)
    found: list[Any] = json.loads(r.stdout)
    return found


async def test_files_outlive_a_suspension_an_update_and_an_oom_and_variables_only_the_first(
    runtime: Any, gateway: Any, make_session: Any
) -> None:
    name = await make_session(
        resources={"memory": "256Mi", "cpu": "1"}, workspace={"persistent": True}
    )
    stored = runtime.store.get("default", name)
    body = {k: stored[k] for k in ("apiVersion", "kind", "metadata", "spec")}
    tags: list[str] = []

    async def replaced(before: str) -> None:
        kernel = (await runtime.get(name)).status.get("kernelId")
        assert kernel and kernel != before, "a new kernel answers"
        assert await _look(gateway, name) == [False, sorted(tags)], "variables lost, files kept"

    # Suspended by its spec (as `mcp-forge apply` does), then running again: the same
    # kernel, its memory restored (naps.py), and the files.
    tags.append("suspend")
    await _write(gateway, name, "suspend")
    before = (await runtime.get(name)).status["kernelId"]
    await runtime.apply({**body, "spec": {**body["spec"], "operatingMode": "Suspended"}})
    assert (await runtime.get(name)).status["phase"] == "Suspended"
    await runtime.apply(body)
    assert (await runtime.get(name)).status["kernelId"] == before
    assert await _look(gateway, name) == [True, sorted(tags)], "variables and files kept"

    # A spec change that needs a new pod.
    tags.append("update")
    await _write(gateway, name, "update")
    before = (await runtime.get(name)).status["kernelId"]
    await runtime.apply({**body, "spec": {**body["spec"], "env": [{"name": "V", "value": "2"}]}})
    await replaced(before)

    # Out of memory: the kernel dies, is restarted, and says what was lost.
    tags.append("oom")
    await _write(gateway, name, "oom")
    before = (await runtime.get(name)).status["kernelId"]
    r = await gateway.execute(
        name, "chunks = []\nwhile True:\n    chunks.append(bytearray(50_000_000))"
    )
    assert r.status == "died" and r.state_lost, r.message
    assert "variables are lost (workspace files are kept)" in r.message
    await replaced(before)


async def test_retain_keeps_the_workspace_for_the_next_session_of_that_name(
    runtime: Any, gateway: Any, images: dict[str, str], names: list[str]
) -> None:
    name = f"t-{uuid.uuid4().hex[:10]}"
    names.append(name)

    def body(**workspace: Any) -> dict[str, Any]:
        spec = {"image": images["minimal"], "workspace": {"persistent": True, **workspace}}
        meta = {"name": name}
        return {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": meta,
            "spec": spec,
        }

    tags: list[str] = []
    first = (await runtime.apply(body(reclaimPolicy="Retain"))).session
    tags.append("kept")
    await _write(gateway, name, "kept")
    await runtime.delete(name)
    kept = runtime.settings.state_dir / "retained" / "default" / f"{name}.img"
    assert kept.is_file(), "the retained workspace waits for the next session"

    # The next session of that name (another user namespace) mounts it, and owns its files.
    second = (await runtime.apply(body())).session
    assert second.uid != first.uid
    assert not kept.exists(), "taken over by the new session"
    tags.append("again")
    await _write(gateway, name, "again")  # writes beside, and over, the kept files
    r = await gateway.execute(
        name, "open('kept.txt', 'a').write('!')\nprint(open('kept.txt').read())"
    )
    assert (r.status, r.stdout) == ("ok", "kept!\n"), (r.error, r.stderr)
    assert await _look(gateway, name) == [True, sorted(tags)]

    # reclaimPolicy Delete (the default): deleted with its session.
    await runtime.delete(name)
    assert not kept.exists()
    await runtime.apply(body())
    assert await _look(gateway, name) == [False, []]


MI = 2**20
SIZE = "import os\ns = os.statvfs('/workspace')\nprint(s.f_blocks * s.f_frsize)"


async def test_a_workspace_grows_keeping_its_files_and_never_shrinks(
    runtime: Any, gateway: Any, make_session: Any
) -> None:
    """A larger spec.workspace.size, applied: the next kernel has the room, the files are
    there. A smaller one is refused, naming the field, and nothing stored changes."""
    # (Grown offline between the two kernels: an online resize needs CAP_SYS_RESOURCE.)
    name = await make_session(workspace={"persistent": True, "size": "64Mi"})
    stored = runtime.store.get("default", name)
    body = {k: stored[k] for k in ("apiVersion", "kind", "metadata", "spec")}
    await _write(gateway, name, "kept")
    before = int((await gateway.execute(name, SIZE)).stdout)
    assert 40 * 2**20 < before <= 64 * 2**20, before

    grown = {**body, "spec": {**body["spec"], "workspace": {"persistent": True, "size": "256Mi"}}}
    await runtime.apply(grown)
    after = int((await gateway.execute(name, SIZE)).stdout)
    assert 200 * 2**20 < after <= 256 * 2**20, after
    assert await _look(gateway, name) == [False, ["kept"]]

    small = {**body, "spec": {**body["spec"], "workspace": {"persistent": True, "size": "128Mi"}}}
    with pytest.raises(InvalidSession) as refused:
        await runtime.apply(small)
    assert refused.value.field == "spec.workspace.size", refused.value
    assert "256Mi" in str(refused.value) and "128Mi" in str(refused.value), refused.value
    assert runtime.store.get("default", name)["spec"]["workspace"]["size"] == "256Mi"
    assert int((await gateway.execute(name, SIZE)).stdout) == after


def _room(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_blocks * s.f_frsize


async def test_a_grow_cut_short_is_finished_and_one_in_use_waits(tmp_path: Path) -> None:
    """The volume code itself, on real loop devices: a grow interrupted after the image
    grew (its marker left) is finished at the next mount; an image still mounted elsewhere
    (a process that outlived its pod) is mounted from that same device, not resized."""
    image, target, other = tmp_path / "workspace.img", tmp_path / "ws", tmp_path / "elsewhere"
    marker = image.with_name("workspace.img.growing")
    other.mkdir()
    await volumes.ensure_workspace(image, target, 64 * MI, 1000, 1000)
    try:
        (target / "kept.txt").write_text("kept")
        small = _room(target)
        # Cut short: the image made larger and marked, its filesystem not grown yet.
        await volumes.unmount(target)
        os.truncate(image, 128 * MI)
        marker.touch()
        await volumes.ensure_workspace(image, target, 128 * MI, 1000, 1000)
        assert _room(target) > small + 48 * MI and not marker.exists()
        assert (target / "kept.txt").read_text() == "kept"

        # In use elsewhere: the same filesystem mounted here again, left as it is, marked.
        grown = _room(target)
        await volumes.unmount(target)
        mount = ["mount", "-o", "loop", str(image), str(other)]
        await asyncio.to_thread(subprocess.run, mount, check=True)
        await volumes.ensure_workspace(image, target, 256 * MI, 1000, 1000)
        assert _room(target) == grown and marker.exists()
        (target / "seen.txt").write_text("one filesystem")
        assert (other / "seen.txt").read_text() == "one filesystem"
        await volumes.unmount(other)
        await volumes.unmount(target)
        await volumes.ensure_workspace(image, target, 256 * MI, 1000, 1000)
        assert _room(target) > grown + 96 * MI and not marker.exists()
        assert sorted(p.name for p in target.iterdir()) == ["kept.txt", "seen.txt"]
    finally:
        await volumes.unmount(other)
        await volumes.unmount(target)
