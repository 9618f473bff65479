"""Agents through a real MCP client: the official SDK client over stdio, against the real
gateway (a subprocess), with real kernels in real Podman pods."""

from __future__ import annotations

import asyncio
import base64
import json
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
from mcp_types import ImageContent, TextContent

from support import gateway_pools, pod_of, pods

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
TOOLS = {
    "create_session", "list_sessions", "close_session", "fork_session", "execute_code",
    "interrupt_kernel", "restart_kernel", "list_variables", "inspect_variable", "read_file",
    "write_file", "list_files", "list_kernel_tools", "export_notebook", "install_packages",
}  # fmt: skip


@asynccontextmanager
async def gateway(
    state_dir: Path, *, args: tuple[str, ...] = (), **client: Any
) -> AsyncIterator[Client]:
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}
    params = StdioServerParameters(command=GATEWAY, args=["gateway", *args], env=env)
    async with Client(params, **client) as c:
        yield c


async def running_call(c: Client, args: dict[str, Any]) -> asyncio.Task[Any]:
    """An execute_code call in flight, once its first progress notification says it runs."""
    started = asyncio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    call = asyncio.create_task(c.call_tool("execute_code", args, progress_callback=on_progress))
    await asyncio.wait_for(started.wait(), 60)
    return call


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_the_tools_are_listed_with_schemas_and_annotations(state_dir) -> None:
    async with gateway(state_dir) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    assert set(tools) == TOOLS
    execute = tools["execute_code"]
    assert execute.description and "persist" in execute.description
    assert execute.input_schema["required"] == ["code"]
    assert execute.output_schema is not None
    assert {"status", "stdout", "execution_count"} <= set(execute.output_schema["properties"])
    listing, closing = tools["list_variables"].annotations, tools["close_session"].annotations
    assert listing is not None and listing.read_only_hint is True
    assert closing is not None and closing.destructive_hint is True
    for tool in tools.values():
        assert tool.description and tool.output_schema, tool.name


async def test_state_persists_across_calls_and_errors_are_tool_errors(state_dir) -> None:
    async with gateway(state_dir) as c:
        first = await c.call_tool("execute_code", {"code": "x = 41\nprint('set')"})
        assert not first.is_error
        assert first.structured_content["status"] == "ok"
        assert "[stdout]\nset" in text(first)
        second = await c.call_tool("execute_code", {"code": "x + 1"})
        assert second.structured_content["result"]["data"]["text/plain"] == "42"
        assert second.structured_content["session_id"] == first.structured_content["session_id"]
        failed = await c.call_tool("execute_code", {"code": "def f():\n    return 1/0\nf()"})
        assert failed.is_error
        assert failed.structured_content["error"]["ename"] == "ZeroDivisionError"
        assert "return 1/0" in text(failed)
        assert "\x1b[" not in text(failed)


async def test_a_figure_comes_back_as_image_content(state_dir) -> None:
    async with gateway(state_dir) as c:
        r = await c.call_tool(
            "execute_code",
            {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"},
        )
        assert not r.is_error, text(r)
        images = [b for b in r.content if isinstance(b, ImageContent)]
        assert len(images) == 1
        assert images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG")


async def test_a_long_cell_sends_progress_and_its_output_as_log_messages(state_dir) -> None:
    reported: list[float] = []
    logs: list[str] = []

    async def on_log(params: Any) -> None:
        logs.append(str(params.data))

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        reported.append(progress)

    async with gateway(state_dir, logging_callback=on_log, log_level="info") as c:
        r = await c.call_tool(
            "execute_code",
            {"code": "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n"
                     "    time.sleep(1)"},
            progress_callback=on_progress,
        )  # fmt: skip
    assert not r.is_error, text(r)
    assert reported and reported == sorted(reported)
    assert any("tick 0" in line for line in logs)


async def test_cancelling_a_call_interrupts_the_kernel_and_keeps_variables(state_dir) -> None:
    async with gateway(state_dir) as c:
        await c.call_tool("execute_code", {"code": "kept = 'yes'"})
        call = await running_call(c, {"code": "import time\ntime.sleep(120)"})
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        r = await asyncio.wait_for(c.call_tool("execute_code", {"code": "kept"}), 60)
        assert r.structured_content["result"]["data"]["text/plain"] == "'yes'"


async def test_sessions_files_and_variables_through_the_tools(state_dir) -> None:
    async with gateway(state_dir) as c:
        made = await c.call_tool("create_session", {"variant": "minimal", "memory": "512Mi"})
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        assert made.structured_content["memory"] == "512Mi"
        listed = await c.call_tool("list_sessions", {})
        mine = {s["session_id"]: s for s in listed.structured_content["sessions"]}
        assert (
            10_000_000 < mine[sid]["memory_bytes"] < 512 * 2**20
        )  # a live kernel, under its limit

        wrote = await c.call_tool(
            "write_file", {"session_id": sid, "path": "data/a.txt", "content": "hello"}
        )
        assert wrote.structured_content["size"] == 5
        png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
        await c.call_tool(
            "write_file",
            {"session_id": sid, "path": "data/p.png", "content": png, "encoding": "base64"},
        )
        back = await c.call_tool("read_file", {"session_id": sid, "path": "data/a.txt"})
        assert text(back) == "hello"
        image = await c.call_tool("read_file", {"session_id": sid, "path": "/workspace/data/p.png"})
        assert isinstance(image.content[0], ImageContent)
        files = await c.call_tool("list_files", {"session_id": sid, "path": "data"})
        assert [e["name"] for e in files.structured_content["entries"]] == ["a.txt", "p.png"]

        await c.call_tool("execute_code", {"session_id": sid, "code": "nums = list(range(10))"})
        names = await c.call_tool("list_variables", {"session_id": sid})
        assert [v["name"] for v in names.structured_content["variables"]] == ["nums"]
        one = await c.call_tool("inspect_variable", {"session_id": sid, "name": "nums"})
        assert one.structured_content["length"] == 10

        restarted = await c.call_tool("restart_kernel", {"session_id": sid})
        assert restarted.structured_content["restarted"] is True
        gone = await c.call_tool("execute_code", {"session_id": sid, "code": "nums"})
        assert gone.is_error and "NameError" in text(gone)
        assert (
            text(await c.call_tool("read_file", {"session_id": sid, "path": "data/a.txt"}))
            == "hello"
        )

        closed = await c.call_tool("close_session", {"session_id": sid})
        assert closed.structured_content["closed"] is True
        after = await c.call_tool("execute_code", {"session_id": sid, "code": "1"})
        assert after.is_error and "no session" in text(after)


@pytest.mark.parametrize(
    ("tool", "args", "words"),
    [
        ("execute_code", {"code": 123}, "code"),
        ("execute_code", {}, "code"),
        ("execute_code", {"code": "   "}, "code is empty"),
        ("execute_code", {"code": "x" * 1_000_001}, "limit"),
        ("execute_code", {"code": "1", "timeout": -1}, "timeout"),
        ("execute_code", {"code": "1", "session_id": "no-such"}, "no session 'no-such'"),
        (
            "read_file",
            {"session_id": "DEFAULT", "path": "../../etc/passwd"},
            "leaves the workspace",
        ),
        ("create_session", {"memory": "1GB"}, "memory"),
        ("create_session", {"name": "Bad Name"}, "metadata.name"),
    ],
)
async def test_bad_arguments_get_a_clear_tool_error_and_the_gateway_stays_up(
    state_dir, tool: str, args: dict[str, Any], words: str
) -> None:
    async with gateway(state_dir) as c:
        if args.get("session_id") == "DEFAULT":
            ok = await c.call_tool("execute_code", {"code": "1"})
            args = {**args, "session_id": ok.structured_content["session_id"]}
        r = await c.call_tool(tool, args)
        assert r.is_error
        assert words in text(r), text(r)
        still = await c.call_tool("list_sessions", {})
        assert not still.is_error


async def test_stdin_eof_leaves_no_pods_behind(state_dir) -> None:
    before = await pods()
    async with gateway(state_dir) as c:
        r = await c.call_tool("execute_code", {"code": "1"})
        made = await c.call_tool("create_session", {"variant": "minimal"})
        names = [r.structured_content["session_id"], made.structured_content["session_id"]]
        made_pods = {pod_of(state_dir, name) for name in names}  # one may be a pool's
        assert made_pods <= await pods()
    # Neither session's pod, nor any kernel of the gateway's own pool, is left.
    assert not made_pods & await pods()
    assert not gateway_pools(await pods() - before)


async def test_a_declared_session_is_usable_by_name_and_left_alone_at_exit(
    state_dir, images
) -> None:
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=state_dir))
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "declared"},
        "spec": {"image": images["minimal"], "resources": {"memory": "256Mi"}},
    }
    await runtime.apply(body)
    try:
        async with gateway(state_dir) as c:
            r = await c.call_tool("execute_code", {"session_id": "declared", "code": "6 * 7"})
            assert r.structured_content["result"]["data"]["text/plain"] == "42"
            listed = await c.call_tool("list_sessions", {})
            declared = [
                s for s in listed.structured_content["sessions"] if s["session_id"] == "declared"
            ]
            assert declared and declared[0]["owned"] is False
            refused = await c.call_tool("close_session", {"session_id": "declared"})
            assert refused.is_error and "declared outside the gateway" in text(refused)
        assert (await runtime.get("declared")).status["phase"] == "Ready"
    finally:
        await runtime.delete("declared")


async def test_interrupt_kernel_stops_a_running_call_which_reports_interrupted(state_dir) -> None:
    async with gateway(state_dir) as c:
        made = await c.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        call = await running_call(
            c, {"session_id": sid, "code": "kept = 1\nimport time\ntime.sleep(120)"}
        )
        stopped = await c.call_tool("interrupt_kernel", {"session_id": sid})
        assert stopped.structured_content["interrupted"] is True
        r = await asyncio.wait_for(call, 60)
        assert r.is_error
        assert r.structured_content["status"] == "interrupted"
        kept = await c.call_tool("execute_code", {"session_id": sid, "code": "kept"})
        assert kept.structured_content["result"]["data"]["text/plain"] == "1"


async def test_sigterm_with_stdin_still_open_cleans_up_and_exits(state_dir) -> None:
    import json
    import signal

    proc = await asyncio.create_subprocess_exec(
        GATEWAY, "gateway",
        env={**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None

    async def request(message: dict[str, Any]) -> dict[str, Any] | None:
        proc.stdin.write(json.dumps(message).encode() + b"\n")  # type: ignore[union-attr]
        if "id" not in message:
            return None
        while True:
            reply = json.loads(await proc.stdout.readline())  # type: ignore[union-attr]
            if reply.get("id") == message["id"]:
                return reply

    try:
        async with asyncio.timeout(120):
            await request(
                {
                    "jsonrpc": "2.0", "id": 1, "method": "initialize",
                    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "e2e", "version": "0"}},
                }
            )  # fmt: skip
            await request({"jsonrpc": "2.0", "method": "notifications/initialized"})
            made = await request(
                {
                    "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                    "params": {"name": "create_session", "arguments": {"variant": "minimal"}},
                }
            )  # fmt: skip
            assert made is not None
            sid = made["result"]["structuredContent"]["session_id"]
            proc.send_signal(signal.SIGTERM)  # stdin stays open
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    exists = await asyncio.to_thread(
        subprocess.run, ["podman", "pod", "exists", f"mcpforge-default-{sid}"]
    )
    assert exists.returncode == 1


async def test_code_mode_from_an_mcp_client(state_dir, tmp_path) -> None:
    """execute_code with code that calls an upstream server's tools through mcp_tools."""
    from mcp_servers.config import missing_servers, upstream_config

    config = upstream_config(tmp_path)
    assert not missing_servers(config), missing_servers(config)
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(config))
    async with gateway(state_dir, args=("--mcp-config", str(path))) as c:
        made = await c.call_tool(
            "create_session",
            {"variant": "minimal", "mcp_servers": [{"name": "edge", "deny": ["crash"]}]},
        )
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        stubs = await c.call_tool("list_kernel_tools", {"session_id": sid})
        assert "def add(" in stubs.structured_content["stubs"], stubs.structured_content
        assert stubs.structured_content["servers"] == ["edge"]
        ran = await c.call_tool(
            "execute_code",
            {"session_id": sid, "code": "import mcp_tools\nmcp_tools.edge.add(a=40)['sum']"},
        )
        assert "42" in text(ran), text(ran)
        bad = await c.call_tool(
            "create_session", {"variant": "minimal", "mcp_servers": [{"name": "nope"}]}
        )
        assert bad.is_error and "no MCP server named nope" in text(bad), text(bad)
