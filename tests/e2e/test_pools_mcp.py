"""Warm starts through MCP: the official SDK client over stdio against the real gateway,
which keeps a pool of real kernels in real Podman pods (its own, or one named --pool)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

from mcp_forge.runtimes.local.store import Store

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
FILL_DEADLINE = 120.0


@asynccontextmanager
async def gateway(state_dir: Path, *args: str) -> AsyncIterator[Client]:
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}
    params = StdioServerParameters(command=GATEWAY, args=["gateway", *args], env=env)
    async with Client(params) as c:
        yield c


async def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [GATEWAY, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def filled(state_dir: Path, name: str | None = None, *, size: int) -> str:
    """Wait until the pool `name` (else the gateway's own) has `size` ready kernels."""
    store = Store(state_dir / "store.db")
    async with asyncio.timeout(FILL_DEADLINE):
        while True:
            for body in store.list_pools("default"):
                pool = body["metadata"]["name"]
                ours = (name is None and pool.startswith("gateway-")) or pool == name
                if ours and (body.get("status") or {}).get("ready") == size:
                    return str(pool)
            await asyncio.sleep(0.1)


async def create(c: Client, **args: Any) -> dict[str, Any]:
    r = await c.call_tool("create_session", args)
    assert not r.is_error, text(r)
    assert r.structured_content is not None
    return r.structured_content


async def test_create_session_is_warm_from_the_gateways_pool_and_says_so(
    state_dir: Path,
) -> None:
    async with gateway(state_dir, "--pool-size", "2") as c:
        pool = await filled(state_dir, size=2)
        first = await create(c)
        assert (first["start"], first["start_reason"], first["phase"]) == ("warm", None, "Ready")
        second = await create(c, env={"WHO": "second"})
        assert second["start"] == "warm"
        # The pool has no third ready kernel yet: a cold start, which says why.
        third = await create(c)
        assert third["start"] == "cold" and "had no ready kernel" in third["start_reason"]
        # Another image than the pool's: cold, naming the field.
        other = await create(c, variant="minimal")
        assert other["start"] == "cold" and "spec.image" in other["start_reason"]

        ran = await c.call_tool(
            "execute_code",
            {"session_id": second["session_id"], "code": "import os; os.environ['WHO']"},
        )
        assert ran.structured_content is not None
        assert ran.structured_content["result"]["data"]["text/plain"] == "'second'"
        # A pool's unclaimed kernels are nobody's session.
        listed = await c.call_tool("list_sessions", {})
        assert listed.structured_content is not None
        ids = {s["session_id"] for s in listed.structured_content["sessions"]}
        assert ids == {s["session_id"] for s in (first, second, third, other)}
        starts = {s["session_id"]: s["start"] for s in listed.structured_content["sessions"]}
        assert starts[first["session_id"]] == "warm" and starts[other["session_id"]] == "cold"
        # The gateway refills its pool in the background.
        assert await filled(state_dir, pool, size=2) == pool


async def test_the_default_session_comes_from_the_pool(state_dir: Path) -> None:
    async with gateway(state_dir, "--pool-size", "1") as c:
        pool = await filled(state_dir, size=1)
        ran = await c.call_tool(
            "execute_code", {"code": "import os; os.environ['MCPFORGE_SESSION']"}
        )
        assert ran.structured_content is not None
        sid = ran.structured_content["session_id"]
        assert ran.structured_content["result"]["data"]["text/plain"] == repr(sid)
        listed = await c.call_tool("list_sessions", {})
        assert listed.structured_content is not None
        (info,) = listed.structured_content["sessions"]
        assert (info["session_id"], info["start"]) == (sid, "warm")
        status = Store(state_dir / "store.db").get("default", sid)["status"]
        assert status["podName"].startswith(f"mcpforge-default-{pool}-")


async def test_a_declared_pool_named_with_pool_is_used_and_refilled(
    state_dir: Path, images: dict[str, str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(
        "apiVersion: mcpforge.dev/v1alpha1\nkind: KernelSessionPool\n"
        "metadata: {name: declared}\n"
        f"spec: {{size: 1, template: {{image: '{images['default']}'}}}}\n"
    )
    applied = await cli("apply", "-f", str(manifest), env=cli_env)
    assert applied.returncode == 0, applied.stderr
    assert "kernelsessionpool/declared created (1/1 ready" in applied.stdout
    try:
        async with gateway(state_dir, "--pool", "declared") as c:
            made = await create(c)
            assert made["start"] == "warm"
            await filled(state_dir, "declared", size=1)  # refilled by the gateway
        # The gateway leaves a declared pool, and its kernels, alone.
        body = Store(state_dir / "store.db").get_pool("default", "declared")
        assert body is not None and body["status"]["ready"] == 1
    finally:
        assert (await cli("delete", "pool/declared", env=cli_env)).returncode == 0


async def test_a_missing_pool_stops_the_gateway_with_an_error_naming_it(state_dir: Path) -> None:
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}
    done = await cli("gateway", "--pool", "nowhere", env=env)
    assert done.returncode != 0
    assert "no KernelSessionPool 'nowhere'" in done.stderr


async def test_without_a_pool_sessions_start_cold_and_say_nothing_of_pools(
    state_dir: Path,
) -> None:
    async with gateway(state_dir, "--pool-size", "0") as c:
        made = await create(c, variant="minimal")
        assert (made["start"], made["start_reason"]) == ("cold", None)
    assert Store(state_dir / "store.db").list_pools() == []
