"""The upstream MCP servers code mode is tested with, through the official SDK's client.

Real servers from the registries (mcp-server-time from PyPI, the filesystem server from
npm; .ci/setup installs them) and our edge server, over stdio and streamable HTTP. Besides
checking that each answers as tests/mcp_servers/config.py configures it, these tests pin
down what the SDK's client does when an upstream server misbehaves: what the gateway's
MCP client code will see.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE, streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_PARAMS,
    ImageContent,
    TextContent,
    Tool,
    ToolAnnotations,
)

from mcp_servers.config import (
    EDGE_SERVER,
    PYTHON,
    SECRET_ENV,
    edge_over_http,
    missing_servers,
    upstream_config,
)

pytestmark = pytest.mark.servers  # not the fast loop (docs/testing.md)

CALL_DEADLINE = 60.0  # one MCP request, the handshake's included
EDGE_TOOLS = {
    "echo", "slow", "fail", "huge", "image", "add", "write_note", "crash", "count",
    "env_has_secret", "pid",
}  # fmt: skip


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    files = tmp_path / "files"
    files.mkdir()
    return upstream_config(files)


def installed(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The server's config entry; the test fails (not skips) if .ci/setup has not run."""
    if problem := missing_servers(config).get(name):
        pytest.fail(problem)
    entry: dict[str, Any] = config["mcpServers"][name]
    return entry


@pytest.fixture(params=["stdio", "http"])
async def edge(request: pytest.FixtureRequest, config: dict[str, Any]) -> AsyncIterator[dict]:
    """The edge server's config entry, for each transport (its secret env included)."""
    entry = config["mcpServers"]["edge"]
    if request.param == "stdio":
        yield entry
        return
    async with edge_over_http(**entry["env"]) as http_entry:
        yield http_entry


@asynccontextmanager
async def connect(
    entry: dict[str, Any],
    max_sse_event_size: int | None = DEFAULT_MAX_SSE_EVENT_SIZE,
    **client: Any,
) -> AsyncIterator[Client]:
    """The SDK's client connected to a config entry (stdio or streamable HTTP)."""
    client.setdefault("read_timeout_seconds", CALL_DEADLINE)
    if "url" not in entry:
        async with Client(StdioServerParameters(**entry), **client) as c:
            yield c
        return
    http = httpx2.AsyncClient(headers=entry.get("headers"), timeout=CALL_DEADLINE)
    async with (
        http,
        Client(
            streamable_http_client(
                entry["url"], http_client=http, max_sse_event_size=max_sse_event_size
            ),
            **client,
        ) as c,
    ):
        yield c


async def call_once(entry: dict[str, Any], tool: str) -> None:
    async with connect(entry) as c:
        await c.call_tool(tool, {})


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def annotations_of(tool: Tool) -> ToolAnnotations:
    """A tool's annotations, which every tool of these servers declares."""
    assert tool.annotations is not None, tool.name
    return tool.annotations


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG whose every chunk's CRC checks, and whose pixels inflate."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks[kind] = body
        pos += 12 + length
    assert set(chunks) == {b"IHDR", b"IDAT", b"IEND"}
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + 3 * width)
    return width, height


# ---- the configuration -----------------------------------------------------------------------


def test_the_config_has_three_stdio_servers_with_absolute_paths(tmp_path: Path) -> None:
    config = upstream_config(tmp_path)
    servers = config["mcpServers"]
    assert set(servers) == {"time", "files", "edge"}
    assert servers["time"]["args"] == ["--local-timezone", "UTC"]
    assert servers["files"]["args"] == [str(tmp_path.resolve())]
    assert servers["edge"] == {
        "command": str(PYTHON),
        "args": [str(EDGE_SERVER)],
        "env": {SECRET_ENV: servers["edge"]["env"][SECRET_ENV]},
        "cwd": str(EDGE_SERVER.parents[2]),
    }
    assert Path(servers["time"]["command"]).is_absolute()
    assert upstream_config(tmp_path)["mcpServers"]["edge"]["env"] != servers["edge"]["env"]


# ---- mcp-server-time (PyPI) ------------------------------------------------------------------


async def test_the_time_server_tells_the_current_time_in_utc(config: dict[str, Any]) -> None:
    async with connect(installed(config, "time")) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        now = await c.call_tool("get_current_time", {"timezone": "UTC"})
    assert set(tools) == {"get_current_time", "convert_time"}
    assert tools["get_current_time"].input_schema["required"] == ["timezone"]
    assert tools["convert_time"].input_schema["required"] == [
        "source_timezone", "time", "target_timezone",
    ]  # fmt: skip
    assert annotations_of(tools["get_current_time"]).read_only_hint is True
    assert not now.is_error, text(now)
    assert now.structured_content["timezone"] == "UTC"
    told = datetime.fromisoformat(now.structured_content["datetime"])
    assert abs(datetime.now(UTC) - told) < timedelta(minutes=5)


async def test_the_time_server_converts_and_reports_bad_input(config: dict[str, Any]) -> None:
    async with connect(installed(config, "time")) as c:
        tokyo = await c.call_tool(
            "convert_time",
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
        )
        nowhere = await c.call_tool("get_current_time", {"timezone": "Nowhere/Bogus"})
        # Not an error result: the time server rejects an unknown tool at the protocol level.
        with pytest.raises(MCPError) as unknown:
            await c.call_tool("get_weather", {})
    assert tokyo.structured_content["target"]["datetime"].endswith("T21:00:00+09:00")
    assert tokyo.structured_content["time_difference"] == "+9.0h"
    assert nowhere.is_error
    assert "Invalid timezone" in text(nowhere)
    assert unknown.value.code == INVALID_PARAMS


# ---- @modelcontextprotocol/server-filesystem (npm) -------------------------------------------


async def test_the_filesystem_server_lists_and_reads_its_directory(config: dict[str, Any]) -> None:
    entry = installed(config, "files")
    root = Path(entry["args"][0])
    for name, content in {"a.txt": "alpha\n", "b.txt": "beta\n", "c.md": "# gamma\n"}.items():
        (root / name).write_text(content)
    async with connect(entry) as c:
        tools = {t.name for t in (await c.list_tools()).tools}
        listing = await c.call_tool("list_directory", {"path": str(root)})
        read = await c.call_tool("read_text_file", {"path": str(root / "b.txt")})
        both = await c.call_tool(
            "read_multiple_files", {"paths": [str(root / "a.txt"), str(root / "c.md")]}
        )
        written = await c.call_tool("write_file", {"path": str(root / "d.txt"), "content": "delta"})
    assert {"list_directory", "read_text_file", "read_multiple_files", "write_file"} <= tools
    assert sorted(text(listing).splitlines()) == ["[FILE] a.txt", "[FILE] b.txt", "[FILE] c.md"]
    assert listing.structured_content == {"content": text(listing)}
    assert read.structured_content == {"content": "beta\n"}
    assert "alpha" in text(both) and "# gamma" in text(both)
    assert not written.is_error, text(written)
    assert (root / "d.txt").read_text() == "delta"


async def test_the_filesystem_server_refuses_paths_outside_its_directory(
    config: dict[str, Any],
) -> None:
    async with connect(installed(config, "files")) as c:
        outside = await c.call_tool("read_text_file", {"path": "/etc/passwd"})
    assert outside.is_error
    assert "Access denied" in text(outside)


# ---- the edge server (ours), over stdio and HTTP ---------------------------------------------


async def test_the_edge_server_describes_every_tool(edge: dict[str, Any]) -> None:
    async with connect(edge) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    assert set(tools) == EDGE_TOOLS
    for tool in tools.values():
        assert tool.description, tool.name
        assert tool.input_schema["type"] == "object", tool.name
    add = tools["add"].input_schema
    assert add["required"] == ["a"]
    assert add["properties"]["a"]["type"] == add["properties"]["b"]["type"] == "integer"
    assert add["properties"]["b"]["default"] == 2
    echo = tools["echo"].output_schema
    assert echo is not None and echo["properties"] == {"text": {"title": "Text", "type": "string"}}
    for name in ("echo", "add", "count"):
        assert annotations_of(tools[name]).read_only_hint is True, name
    assert annotations_of(tools["write_note"]).read_only_hint is False
    assert annotations_of(tools["write_note"]).destructive_hint is True


async def test_every_edge_tool_answers_as_described(edge: dict[str, Any]) -> None:
    async with connect(edge) as c:
        echo = await c.call_tool("echo", {"text": "héllo"})
        added = await c.call_tool("add", {"a": 40})
        added_b = await c.call_tool("add", {"a": 1, "b": -5})
        failed = await c.call_tool("fail", {"message": "it broke"})
        huge = await c.call_tool("huge", {"size": 100_000})
        image = await c.call_tool("image", {})
        slow = await c.call_tool("slow", {"seconds": 0})
        first_note = await c.call_tool("write_note", {"text": "one"})
        second_note = await c.call_tool("write_note", {"text": "two"})
        secret = await c.call_tool("env_has_secret", {})
        pid = await c.call_tool("pid", {})
        count = await c.call_tool("count", {})
    assert echo.structured_content == {"text": "héllo"}
    assert added.structured_content == {"sum": 42}
    assert added_b.structured_content == {"sum": -4}
    assert failed.is_error
    assert text(failed) == "it broke"
    assert text(huge) == "x" * 100_000
    assert huge.structured_content is None
    [block] = image.content
    assert isinstance(block, ImageContent)
    assert block.mime_type == "image/png"
    assert png_size(base64.b64decode(block.data)) == (4, 4)
    assert text(slow) == "slept 0 s"
    assert first_note.structured_content == {"previous": None}
    assert second_note.structured_content == {"previous": "one"}
    assert secret.structured_content == {"present": True}
    assert pid.structured_content is not None and pid.structured_content["pid"] > 1
    assert count.structured_content == {"calls": 12, "cancelled": 0}


async def test_a_cancelled_call_stops_the_slow_tool_on_the_server(edge: dict[str, Any]) -> None:
    started = asyncio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    async with connect(edge) as c:
        call = asyncio.create_task(
            c.call_tool("slow", {"seconds": 3600}, progress_callback=on_progress)
        )
        await asyncio.wait_for(started.wait(), CALL_DEADLINE)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # The client's notifications/cancelled and this next call race on the server: poll.
        # Each poll is a round trip, and the loop has a deadline.
        async with asyncio.timeout(CALL_DEADLINE):
            while not (counts := (await c.call_tool("count", {})).structured_content)["cancelled"]:
                pass
    assert counts["cancelled"] == 1


async def test_a_server_crash_over_stdio_fails_that_call_and_every_later_one(
    config: dict[str, Any],
) -> None:
    async with connect(config["mcpServers"]["edge"]) as c:
        with pytest.raises(MCPError) as crashed:
            await c.call_tool("crash", {})
        with pytest.raises(MCPError) as after:
            await c.call_tool("echo", {"text": "anyone?"})
    assert crashed.value.code == after.value.code == CONNECTION_CLOSED
    assert crashed.value.error.message == "Connection closed"


async def test_a_server_crash_over_http_tears_down_the_whole_client() -> None:
    # Not an MCPError for the call: the transport's task group fails, the call is
    # cancelled, and leaving the client raises the group (python-sdk#3522). A gateway
    # must keep each upstream HTTP client in a task of its own.
    async with edge_over_http() as entry:
        with pytest.raises(ExceptionGroup) as crashed:
            await call_once(entry, "crash")
    assert crashed.group_contains(httpx2.RemoteProtocolError)


async def test_a_stdio_server_that_exits_at_start_fails_the_connect() -> None:
    entry = {"command": str(PYTHON), "args": [str(EDGE_SERVER), "--no-such-option"]}
    with pytest.raises(ExceptionGroup) as failed:
        await call_once(entry, "echo")
    assert failed.group_contains(MCPError, match="Connection closed")


async def test_a_stdio_server_gets_its_configured_env_and_not_the_clients(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "the client's own")
    configured = config["mcpServers"]["edge"]
    unconfigured = {k: v for k, v in configured.items() if k != "env"}
    async with connect(configured) as c:
        with_env = await c.call_tool("env_has_secret", {})
    async with connect(unconfigured) as c:
        without_env = await c.call_tool("env_has_secret", {})
    assert with_env.structured_content == {"present": True}
    # The SDK passes a stdio server only HOME, LOGNAME, PATH, SHELL, TERM, USER + its env.
    assert without_env.structured_content == {"present": False}


async def test_an_http_server_refuses_a_client_without_the_configured_headers() -> None:
    async with edge_over_http() as entry:
        async with connect(entry) as c:
            assert (await c.call_tool("add", {"a": 1})).structured_content == {"sum": 3}
        with pytest.raises(ExceptionGroup) as refused:
            await call_once({"url": entry["url"]}, "add")
    # A 401 reaches the caller as a generic internal error, wrapped in task groups.
    assert refused.group_contains(MCPError, match="Server returned an error response")


async def test_a_result_over_1_mib_needs_a_larger_sse_limit_on_a_2025_http_connection() -> None:
    # The 2025-11-25 protocol answers over SSE, and the SDK's client refuses an SSE event
    # over max_sse_event_size (1 MiB by default); 2026-07-28 answers in plain JSON.
    size = 2 * 1024 * 1024
    async with edge_over_http() as entry:
        async with connect(entry) as c:
            modern = await c.call_tool("huge", {"size": size})
        async with connect(entry, mode="legacy") as c:
            with pytest.raises(MCPError, match="exceeded the 1048576 byte limit"):
                await c.call_tool("huge", {"size": size})
        async with connect(entry, mode="legacy", max_sse_event_size=2 * size) as c:
            legacy = await c.call_tool("huge", {"size": size})
    assert len(text(modern)) == len(text(legacy)) == size
