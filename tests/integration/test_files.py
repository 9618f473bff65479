"""Working files (spec.files) in local mode: real kernels in real Podman pods. Every new
kernel finds them in its workspace before the session is Ready (cold, claimed from a
pool); a file the code changed is kept across a restart."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.gateway.core import Gateway

pytestmark = pytest.mark.podman

FILES = [
    {"path": "notes.md", "content": "# hello\n"},
    {"path": "data/config.json", "content": json.dumps({"k": "é 🔑 'q' \"x\""})},
]
READ = (
    "import json, os\n"
    "print(json.dumps({p: open(p, encoding='utf-8').read() if os.path.exists(p) else None"
    " for p in ['notes.md', 'data/config.json']}))"
)


def body(image: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"f-{uuid.uuid4().hex[:10]}"},
        "spec": {"image": image, "resources": {"memory": "512Mi"}, "files": FILES, **spec},
    }


async def files_in(gw: Gateway, name: str) -> dict[str, str | None]:
    r = await gw.execute(name, READ)
    assert r.status == "ok", (r.error, r.stderr)
    found: dict[str, str | None] = json.loads(r.stdout)
    return found


async def test_a_cold_session_starts_with_its_files_and_keeps_what_code_changed(
    runtime: Any, gateway: Gateway, images: dict[str, str], names: list[str]
) -> None:
    spec = body(images["minimal"])
    names.append(spec["metadata"]["name"])
    session = (await runtime.apply(spec)).session
    assert session.status["phase"] == st.READY
    want = {f["path"]: f["content"] for f in FILES}
    assert await files_in(gateway, session.name) == want
    # Giving them left no cell in the history (entry 0 is IPython's empty one, then the
    # cell that read them and this one) and no name in the namespace.
    r = await gateway.execute(
        session.name,
        "print(len(get_ipython().history_manager.input_hist_raw), "
        "[n for n in ('ENV', 'FILES', 'ROOT', 'MARK') if n in dir()])",
    )
    assert r.stdout.strip() == "3 []", r.stdout
    # The code changes one; a restart (a new kernel, the same workspace) keeps it.
    changed = await gateway.execute(session.name, "open('notes.md', 'w').write('mine')")
    assert changed.status == "ok"
    await gateway.restart(session.name)
    restarted = await runtime.get(session.name)
    assert restarted.status["kernelId"] != session.status["kernelId"]
    assert await files_in(gateway, session.name) == {**want, "notes.md": "mine"}


async def test_a_claimed_pool_kernel_gets_the_sessions_files(
    runtime: Any, gateway: Gateway, images: dict[str, str], names: list[str]
) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    await runtime.pools.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSessionPool",
            "metadata": {"name": pool},
            "spec": {
                "size": 1,
                "template": {"image": images["minimal"], "resources": {"memory": "512Mi"}},
            },
        }
    )
    try:
        spec = body(images["minimal"], poolRef={"name": pool})
        names.append(spec["metadata"]["name"])
        session = (await runtime.apply(spec)).session
        warm = [c for c in session.status["conditions"] if c["type"] == ksp.WARM_START]
        assert [(c["status"], c["reason"]) for c in warm] == [("True", ksp.CLAIMED)]
        assert await files_in(gateway, session.name) == {f["path"]: f["content"] for f in FILES}
    finally:
        await runtime.pools.delete(pool)
