"""Env from a Secret through MCP: a session declared with `mcp-forge apply` (a Secret and
a KernelSession whose env names it), used by the official SDK client over stdio against
the real gateway. The kernel sees the value; no tool result and no line the gateway
logs (at debug level) holds it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

pytestmark = pytest.mark.podman

CLI = str(Path(sys.executable).parent / "mcp-forge")
CODE = "import os, hashlib as h; print(h.sha256(os.environ['API_TOKEN'].encode()).hexdigest())"


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_a_declared_session_gets_its_secret_through_mcp_and_no_result_or_log_shows_it(
    state_dir: Path, images: dict[str, str], tmp_path: Path
) -> None:
    value = f"s3cr3t-{secrets.token_hex(8)}"
    secret, name = f"keys-{uuid.uuid4().hex[:8]}", f"m-{uuid.uuid4().hex[:8]}"
    docs = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}},
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": name},
            "spec": {
                "image": images["minimal"],
                "resources": {"memory": "512Mi"},
                "env": [
                    {
                        "name": "API_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}},
                    }
                ],
            },
        },
    ]
    docs[0]["stringData"] = {"token": value}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump_all(docs))
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=300)

    applied = await asyncio.to_thread(cli, "apply", "-f", str(tmp_path / "s.yaml"))
    assert applied.returncode == 0, applied.stderr
    log = tmp_path / "gateway.log"
    gateway = f"exec {shlex.quote(CLI)} --log-level debug gateway 2>>{shlex.quote(str(log))}"
    params = StdioServerParameters(command="sh", args=["-c", gateway], env=env)
    results: list[str] = []
    try:
        async with Client(params) as c:
            listed = await c.call_tool("list_sessions", {})
            results.append(text(listed))
            assert name in text(listed)
            for attempt in ("first kernel", "restarted kernel"):
                if attempt == "restarted kernel":
                    restarted = await c.call_tool("restart_kernel", {"session_id": name})
                    results.append(text(restarted))
                    assert not restarted.is_error, text(restarted)
                r = await c.call_tool("execute_code", {"code": CODE, "session_id": name})
                results.append(text(r))
                assert not r.is_error, (attempt, text(r))
                assert hashlib.sha256(value.encode()).hexdigest() in text(r), attempt
    finally:
        deleted = await asyncio.to_thread(cli, "delete", name)
        await asyncio.to_thread(cli, "delete", f"secret/{secret}")
    assert deleted.returncode == 0, deleted.stderr
    logged = log.read_text()
    assert "DEBUG" in logged  # the gateway did log at debug level
    for out in [*results, logged, applied.stdout, applied.stderr]:
        assert value not in out
