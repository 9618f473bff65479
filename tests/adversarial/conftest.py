"""The adversarial suite: attacks run as a hostile model would run them.

Every case goes through the real gateway (a subprocess, reached with the official MCP
client over stdio) into a real kernel in a real Podman pod, and asserts the safe outcome
*and* its evidence: what the kernel saw, what the host still has, what the gateway said.
One file per class of attack (host resources, filesystem, network, privileges,
lifecycle, Jupyter protocol, bridge, MCP transport, multi-tenant isolation).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")


@asynccontextmanager
async def gateway(
    state_dir: Path,
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    **client: Any,
) -> AsyncIterator[Client]:
    """A real gateway over stdio (started in `cwd`, if given); on exit it deletes the
    sessions it created."""
    full_env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir), **(env or {})}
    params = StdioServerParameters(command=GATEWAY, args=["gateway", *args], env=full_env, cwd=cwd)
    async with Client(params, **client) as c:
        yield c


def gateway_peak_rss(state_dir: Path) -> int:
    """The peak resident memory (VmHWM, bytes) of the gateway serving `state_dir`: the
    newest `mcp-forge gateway` process whose environment names that state directory (an
    earlier test's may still be on its way out)."""
    want = f"MCPFORGE_STATE_DIR={state_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"gateway" not in argv or want not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            status = (proc / "status").read_text()
            # The start time: field 22 of stat, counted after the command's parenthesis.
            started = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue  # gone meanwhile, or not ours to read
        kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        found.append((started, int(kb) * 1024))
    assert found, f"no gateway serves {state_dir}"
    return max(found)[1]


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def call(c: Client, tool: str, args: dict[str, Any], **kw: Any) -> Any:
    """A tool call; its result (tool errors included: attacks often end in them)."""
    return await c.call_tool(tool, args, **kw)


async def run(c: Client, code: str, **args: Any) -> dict[str, Any]:
    """execute_code's structured result; the call must not be a protocol error."""
    r = await c.call_tool("execute_code", {"code": code, **args})
    assert r.structured_content is not None, text(r)
    out: dict[str, Any] = dict(r.structured_content)
    out["_text"] = text(r)
    return out


async def value(c: Client, expr: str, **args: Any) -> Any:
    """The value of a JSON-able expression evaluated in the kernel (JSON, never eval)."""
    r = await run(c, f"import json as _j; print(_j.dumps({expr}))", **args)
    assert r["status"] == "ok", r["_text"]
    return json.loads(r["stdout"].strip().splitlines()[-1])


@pytest.fixture
def canary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A host file with a secret no kernel may ever see."""
    path = tmp_path_factory.mktemp("canary") / f"canary-{uuid.uuid4().hex}"
    path.write_text(f"host-secret-{uuid.uuid4().hex}")
    return path


class Deadline:
    """A deadline for waits on events (never a sleep standing for the event)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.0)

    def __bool__(self) -> bool:
        return self.left > 0
