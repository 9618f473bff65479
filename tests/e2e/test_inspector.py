"""The gateway through a second, independent MCP client: the MCP Inspector's CLI (the
TypeScript SDK), over stdio and streamable HTTP, with real kernels in real Podman pods.

`.ci/setup` installs the Inspector; its CLI flags and JSON output are those of the version
pinned here, so a missing or different Inspector fails the test with the command to run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_http import delete_sessions, running_gateway

from support import gateway_pools, pods

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
INSPECTOR_VERSION = "2.12.0"
INSTALL = (
    f"install it with: npm install -g @modelcontextprotocol/inspector@{INSPECTOR_VERSION} "
    "(or run: sudo bash .ci/setup)"
)
RUN_DEADLINE = 120.0  # one Inspector run: the gateway's start, a kernel's, and the cleanup
TOOLS = {
    "create_session", "list_sessions", "close_session", "fork_session", "execute_code",
    "interrupt_kernel", "restart_kernel", "list_variables", "inspect_variable", "read_file",
    "write_file", "list_files", "list_kernel_tools", "export_notebook", "install_packages",
}  # fmt: skip


async def run(
    *args: str, deadline: float = RUN_DEADLINE, cwd: Path | None = None
) -> tuple[int, str, str]:
    """A command's exit status, stdout and stderr; killed past `deadline` seconds."""
    process = await asyncio.create_subprocess_exec(
        *args,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(deadline):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.fixture(scope="module")
async def inspector() -> str:
    path = shutil.which("mcp-inspector")
    if path is None:
        pytest.fail(f"the MCP Inspector (mcp-inspector) is not on PATH; {INSTALL}")
    _, version, _ = await run(path, "--cli", "--version")
    if version.strip() != INSPECTOR_VERSION:
        pytest.fail(
            f"{path} is the MCP Inspector {version.strip() or '(unknown)'}, "
            f"not {INSPECTOR_VERSION}; {INSTALL}"
        )
    return path


async def inspect(inspector: str, state_dir: Path, *args: str) -> dict[str, Any]:
    """`mcp-inspector --cli` against `mcp-forge gateway` over stdio; its JSON result."""
    # The Inspector passes the server only a few variables of its own environment
    # (HOME, PATH, ...): the state directory goes through -e.
    code, out, err = await run(
        *(inspector, "--cli", "-e", f"MCPFORGE_STATE_DIR={state_dir}", "--format", "json"),
        *(GATEWAY, "gateway", *args),
    )
    assert code == 0, f"exit {code}\n{out}\n{err}"
    result: dict[str, Any] = json.loads(out)["result"]
    return result


async def test_the_inspector_lists_the_eleven_tools_with_portable_schemas(
    inspector: str, state_dir: Path
) -> None:
    # --strict: the Inspector exits non-zero if a tool schema has an error-severity
    # portability problem.
    listed = await inspect(inspector, state_dir, "--method", "tools/list", "--strict")
    tools = {t["name"]: t for t in listed["tools"]}
    assert set(tools) == TOOLS
    assert tools["execute_code"]["inputSchema"]["required"] == ["code"]
    for tool in tools.values():
        assert tool["description"] and tool["outputSchema"], tool["name"]


async def test_the_inspector_runs_code_and_gets_its_value_back(
    inspector: str, state_dir: Path
) -> None:
    before = await pods()
    called = await inspect(
        inspector,
        state_dir,
        *("--method", "tools/call", "--tool-name", "execute_code", "--tool-arg", "code=6*7"),
    )
    assert called["isError"] is False, called
    assert called["structuredContent"]["status"] == "ok"
    assert called["structuredContent"]["result"]["data"]["text/plain"] == "42"
    assert "[result]\n42" in [c["text"] for c in called["content"] if c["type"] == "text"]
    # The gateway deleted the default session it made when the Inspector closed stdin,
    # and the kernels of its own pool.
    session_id = called["structuredContent"]["session_id"]
    assert f"mcpforge-default-{session_id}" not in await pods()
    assert not gateway_pools(await pods() - before)


async def test_the_inspector_over_http_runs_code_and_reads_what_it_wrote(
    inspector: str, state_dir: Path, tmp_path: Path
) -> None:
    """The same client over streamable HTTP, its bearer token sent as a header."""
    async with running_gateway(state_dir, tmp_path) as gw:
        http = (
            gw.url,
            "--transport",
            "http",
            "--header",
            f"Authorization: Bearer {gw.tokens['bob']}",
        )
        code, out, err = await run(
            *(inspector, "--cli", "--format", "json", *http, "--method", "tools/call"),
            *(
                "--tool-name",
                "execute_code",
                "--tool-arg",
                "code=open('/workspace/i.txt','w').write('hi')",
            ),
        )
        assert code == 0, f"exit {code}\n{out}\n{err}"
        called = json.loads(out)["result"]
        assert called["isError"] is False and called["structuredContent"]["status"] == "ok", called
        sid = called["structuredContent"]["session_id"]
        code, out, err = await run(
            *(inspector, "--cli", "--format", "json", *http, "--method", "resources/read"),
            *("--uri", f"forge://sessions/{sid}/files/i.txt"),
        )
        assert code == 0, f"exit {code}\n{out}\n{err}"
        [content] = json.loads(out)["result"]["contents"]
        assert content["text"] == "hi", content
    await delete_sessions(state_dir, None)
