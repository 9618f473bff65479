"""Local mode: the workspace is a volume of the session's, outliving every kernel it has.

A suspension, a spec change that needs a new pod and an OOM each end the kernel (its
variables are lost, and said to be) while the files written in /workspace stay. With
reclaimPolicy Retain the volume outlives the session too, for the next one of that name.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

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


async def test_files_outlive_a_suspension_an_update_and_an_oom_and_variables_do_not(
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

    # Suspended by its spec (as `mcp-forge apply` does), then running again.
    tags.append("suspend")
    await _write(gateway, name, "suspend")
    before = (await runtime.get(name)).status["kernelId"]
    await runtime.apply({**body, "spec": {**body["spec"], "operatingMode": "Suspended"}})
    assert (await runtime.get(name)).status["phase"] == "Suspended"
    await runtime.apply(body)
    await replaced(before)

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
