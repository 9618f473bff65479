"""Upstream MCP servers for tests, in the `mcpServers` format of MCP client config files.

Three stdio servers: `time` (mcp-server-time, PyPI, in its own venv .venv-upstream),
`files` (@modelcontextprotocol/server-filesystem, npm, global) and `edge` (ours,
edge_server.py). .ci/setup installs the first two; `missing_servers` says which are not
there, so a test can fail with the command that fixes it.

`edge_over_http` runs the edge server over streamable HTTP and yields its config entry
(url and headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .edge_server import SECRET_ENV, TOKEN_ENV

ROOT = Path(__file__).resolve().parents[2]
EDGE_SERVER = ROOT / "tests" / "mcp_servers" / "edge_server.py"
PYTHON = ROOT / ".venv" / "bin" / "python"
TIME_SERVER = ROOT / ".venv-upstream" / "bin" / "mcp-server-time"
FILESYSTEM_BIN = "mcp-server-filesystem"
SETUP_HINT = "install the upstream MCP servers with: sudo bash .ci/setup"

HTTP_START_DEADLINE = 30.0  # the edge server prints its address, having bound the port
HTTP_STOP_DEADLINE = 10.0


@functools.cache
def filesystem_server() -> Path | None:
    """The npm server's bin: on PATH, or in npm's global prefix (None if not installed)."""
    found = shutil.which(FILESYSTEM_BIN)
    if found:
        return Path(found)
    npm = shutil.which("npm")
    if npm is None:
        return None
    prefix = subprocess.run(
        [npm, "prefix", "-g"], capture_output=True, text=True, check=False, timeout=30
    ).stdout.strip()
    path = Path(prefix) / "bin" / FILESYSTEM_BIN
    return path if prefix and path.exists() else None


def upstream_config(tmp_dir: Path) -> dict[str, Any]:
    """A config file's content: `{"mcpServers": {"time": ..., "files": ..., "edge": ...}}`.

    `files` may read and write only in `tmp_dir`. `edge` gets a fresh random secret in
    its env (config["mcpServers"]["edge"]["env"][SECRET_ENV]) for tests to look for where
    it must never be.
    """
    files = filesystem_server()
    return {
        "mcpServers": {
            "time": {
                # Not the host's zone: tzlocal fails on hosts without /etc/localtime or TZ.
                "command": str(TIME_SERVER),
                "args": ["--local-timezone", "UTC"],
            },
            "files": {
                "command": str(files) if files else FILESYSTEM_BIN,
                "args": [str(tmp_dir.resolve())],
            },
            "edge": {
                "command": str(PYTHON),
                "args": [str(EDGE_SERVER)],
                "env": {SECRET_ENV: secrets.token_urlsafe(16)},
                "cwd": str(ROOT),
            },
        }
    }


def missing_servers(config: dict[str, Any]) -> dict[str, str]:
    """The stdio servers whose command is not installed: name → what to do about it."""
    return {
        name: f"MCP server {name!r}: {entry['command']} not found; {SETUP_HINT}"
        for name, entry in config["mcpServers"].items()
        if "command" in entry and shutil.which(entry["command"]) is None
    }


@contextlib.asynccontextmanager
async def edge_over_http(**env: str) -> AsyncIterator[dict[str, Any]]:
    """Run edge_server.py --http on a free port; yield its entry `{"url", "headers"}`.

    The server refuses requests without the entry's bearer token. `env` is added to its
    environment, which otherwise is this process's without SECRET_ENV. The server is
    killed on exit (it may have crashed already).
    """
    token = secrets.token_urlsafe(16)
    inherited = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    process = await asyncio.create_subprocess_exec(
        str(PYTHON),
        str(EDGE_SERVER),
        "--http",
        "0",
        env={**inherited, TOKEN_ENV: token, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # inherited: its tracebacks show in the test's output
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(HTTP_START_DEADLINE):
            line = (await process.stdout.readline()).decode()
        if not line.startswith("MCP over HTTP at "):
            raise RuntimeError(f"edge server did not start (exit {await process.wait()})")
        yield {
            "url": line.removeprefix("MCP over HTTP at ").strip(),
            "headers": {"Authorization": f"Bearer {token}"},
        }
    finally:
        if process.returncode is None:
            process.kill()
        async with asyncio.timeout(HTTP_STOP_DEADLINE):
            await process.wait()
