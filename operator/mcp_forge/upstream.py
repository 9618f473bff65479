"""Upstream MCP servers: the ones kernel code may call in code mode (docs/bridge.md).

The gateway is their MCP client (the official SDK). Each server is configured in the
`mcpServers` JSON format MCP clients already use, from `--mcp-config FILE`:

    {"mcpServers": {
       "time":  {"command": "mcp-server-time", "args": [], "env": {}, "cwd": "/tmp"},
       "files": {"url": "https://files.example/mcp", "headers": {"Authorization": "Bearer …"}}}}

A server is connected when first needed, and again after it died (the next call after a
failure reconnects; a call never waits longer than its timeout). Its secrets (env,
headers) stay in this process: a kernel only ever sees tool names, schemas and results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import CallToolResult, ImageContent, TextContent

from .errors import InvalidRequest

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CONNECT_TIMEOUT = 30.0  # a Python server takes 1.5-3 s just to import the SDK
RESULT_LIMIT = 17 << 20  # one result, a little over what the bridge passes on
CONFIG_MAX = 1_000_000
STRING_MAX = 32_768


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str | None = None  # stdio
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None  # streamable HTTP
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"


def _strings(value: Any, field_name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, str) and len(v) <= STRING_MAX for v in value
    ):
        raise InvalidRequest(f"{field_name} must be a list of strings")
    return tuple(value)


def _mapping(value: Any, field_name: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) <= STRING_MAX for k, v in value.items()
    ):
        raise InvalidRequest(f"{field_name} must map strings to strings")
    return tuple(sorted(value.items()))


def parse_config(data: Any, *, source: str = "the MCP config") -> dict[str, ServerConfig]:
    """Servers from an `mcpServers` document; InvalidRequest naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise InvalidRequest(f'{source}: expected {{"mcpServers": {{NAME: {{...}}}}}}')
    servers: dict[str, ServerConfig] = {}
    for name, raw in data["mcpServers"].items():
        where = f"{source}: mcpServers.{name}"
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidRequest(f"{where}: a name is 1-64 of A-Z a-z 0-9 _ . - ")
        if not isinstance(raw, dict):
            raise InvalidRequest(f"{where}: must be an object")
        unknown = set(raw) - {"command", "args", "env", "cwd", "url", "headers", "type"}
        if unknown:
            raise InvalidRequest(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        command, url = raw.get("command"), raw.get("url")
        if (command is None) == (url is None):
            raise InvalidRequest(f"{where}: give either command (stdio) or url (HTTP)")
        if command is not None:
            if not isinstance(command, str) or not command:
                raise InvalidRequest(f"{where}.command must be a non-empty string")
            cwd = raw.get("cwd")
            if cwd is not None and not isinstance(cwd, str):
                raise InvalidRequest(f"{where}.cwd must be a string")
            servers[name] = ServerConfig(
                name,
                command=command,
                args=_strings(raw.get("args", []), f"{where}.args"),
                env=_mapping(raw.get("env", {}), f"{where}.env"),
                cwd=cwd,
            )
        else:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise InvalidRequest(f"{where}.url must be an http(s) URL")
            servers[name] = ServerConfig(
                name, url=url, headers=_mapping(raw.get("headers", {}), f"{where}.headers")
            )
    return servers


def load_config(path: str | Path) -> dict[str, ServerConfig]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read the MCP config {p}: {exc.strerror}") from None
    if len(text) > CONFIG_MAX:
        raise InvalidRequest(f"the MCP config {p} is larger than {CONFIG_MAX} bytes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"the MCP config {p} is not JSON: {exc}") from None
    return parse_config(data, source=str(p))


class UpstreamError(Exception):
    """An upstream server could not be reached or did not answer in time."""


@dataclass
class Upstream:
    """One upstream server, connected on demand, reconnected after it dies."""

    config: ServerConfig
    connect_timeout: float = CONNECT_TIMEOUT
    tools: list[dict[str, Any]] = field(default_factory=list)
    _client: Client | None = None
    _runner: asyncio.Task[None] | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _failure: BaseException | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def _target(self) -> Any:
        c = self.config
        if c.command:
            return StdioServerParameters(
                command=c.command, args=list(c.args), env=dict(c.env) or None, cwd=c.cwd
            )
        return c.url

    async def _run(self) -> None:
        """Hold the client open (its context must live in one task) until stopped or dead."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                target = self._target()
                if self.config.url:
                    import httpx2
                    from mcp.client.streamable_http import streamable_http_client

                    http = await stack.enter_async_context(  # headers: where secrets go
                        httpx2.AsyncClient(headers=dict(self.config.headers), timeout=30.0)
                    )
                    # The SDK's default (1 MiB per SSE event) is below what we accept.
                    target = streamable_http_client(
                        self.config.url, http_client=http, max_sse_event_size=RESULT_LIMIT
                    )
                client = await stack.enter_async_context(Client(target))
                listed = await client.list_tools()
                self.tools = [t.model_dump(by_alias=True, exclude_none=True) for t in listed.tools]
                self._client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # a server that died, or never started
            self._failure = exc
            if not isinstance(exc, asyncio.CancelledError):
                log.warning("upstream MCP server %s: %s", self.config.name, _describe(exc))
        finally:
            self._client = None
            self._ready.set()  # wake waiters: they see no client

    async def connect(self) -> Client:
        """The live client, connecting (again) if there is none."""
        async with self._lock:
            if self._client is not None and self._runner is not None and not self._runner.done():
                return self._client
            if self._runner is not None and not self._runner.done():
                self._runner.cancel()
                with contextlib.suppress(BaseException):
                    await self._runner
            self._ready, self._stop, self._failure = asyncio.Event(), asyncio.Event(), None
            self._runner = asyncio.create_task(self._run(), name=f"upstream {self.config.name}")
            try:
                await asyncio.wait_for(self._ready.wait(), self.connect_timeout)
            except TimeoutError:
                self._runner.cancel()
                raise UpstreamError(
                    f"MCP server {self.config.name!r} did not start within "
                    f"{self.connect_timeout:.0f}s"
                ) from None
            if self._client is None:
                raise UpstreamError(
                    f"MCP server {self.config.name!r} is unavailable: {_describe(self._failure)}"
                )
            return self._client

    async def call(self, tool: str, arguments: dict[str, Any], *, timeout: float) -> CallToolResult:
        deadline = time.monotonic() + timeout
        client = await self.connect()
        left = deadline - time.monotonic()
        # In a task of its own: when a server dies the SDK cancels its calls in flight
        # (python-sdk#3522), which must not look like a cancellation of our caller.
        inner = asyncio.create_task(client.call_tool(tool, arguments))
        try:
            done, _ = await asyncio.wait({inner}, timeout=max(0.001, left))
        except asyncio.CancelledError:  # our caller was cancelled (the kernel's code was)
            inner.cancel()
            raise
        if not done:
            inner.cancel()
            raise UpstreamError(f"{self.config.name}.{tool} did not answer within {timeout:.0f}s")
        if inner.cancelled():
            self._client = None  # the next call reconnects
            raise UpstreamError(f"{self.config.name}.{tool} failed: the server went away")
        exc = inner.exception()
        if exc is not None:  # the server died mid-call, or broke the protocol
            self._client = None
            raise UpstreamError(f"{self.config.name}.{tool} failed: {_describe(exc)}")
        return inner.result()

    async def close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._runner), 5.0)
            except (TimeoutError, Exception):
                self._runner.cancel()
                with contextlib.suppress(BaseException):
                    await self._runner


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "it stopped"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"[:500]


def result_frame(result: CallToolResult) -> dict[str, Any]:
    """A tool's result as the bridge sends it to the kernel (docs/bridge.md)."""
    content: list[dict[str, Any]] = []
    for item in result.content:
        if isinstance(item, TextContent):
            content.append({"type": "text", "text": item.text})
        elif isinstance(item, ImageContent):
            content.append({"type": "image", "data": item.data, "mimeType": item.mime_type})
        else:
            content.append({"type": getattr(item, "type", "unknown")})
    return {
        "ok": True,
        "structured": result.structured_content,
        "content": content,
        "isError": bool(result.is_error),
    }
