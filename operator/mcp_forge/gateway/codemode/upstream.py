"""Upstream MCP servers: the ones kernel code may call in code mode (docs/bridge.md).

The gateway is their MCP client (the official SDK). Each server is configured in the
`mcpServers` JSON format MCP clients already use, from `--mcp-config FILE`:

    {"mcpServers": {
       "time":  {"command": "mcp-server-time", "args": [], "env": {}, "cwd": "/tmp",
                 "isolation": "session"},
       "files": {"url": "https://files.example/mcp", "headers": {"Authorization": "Bearer …"}}}}

A server is connected when first needed, and again after it died (the next call after a
failure reconnects; a call never waits longer than its timeout). Its secrets (env,
headers) stay in this process: a kernel only ever sees tool names, schemas and results.

`isolation` says who shares one connection (for stdio, one process) of a server, and so
whatever state it keeps: `shared` (every session), `client` (the sessions of one client,
the default for stdio servers) or `session` (each session its own). An HTTP server is
`shared` unless told: what it keeps apart is the remote's business. `UpstreamPool` hands
each session the `Upstream` objects it may use, starts isolated ones when a session
first needs them, bounds how many there are, and closes them after their last session
went (docs/bridge.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import referencing.exceptions
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import CallToolResult, ImageContent, TextContent

from mcp_forge import cpuweight
from mcp_forge.errors import InvalidRequest, UpstreamError
from mcp_forge.gateway.codemode.policy import Meter

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CONNECT_TIMEOUT = 30.0  # a Python server takes 1.5-3 s just to import the SDK
RESULT_LIMIT = 17 << 20  # one result, a little over what the bridge passes on
CONFIG_MAX = 1_000_000
STRING_MAX = 32_768
ISOLATIONS = ("shared", "client", "session")
PROCESSES_MAX = 32  # isolated upstream connections (stdio: processes) per gateway
# ... and per client: one client's sessions cannot take every one of the gateway's.
PROCESSES_PER_CLIENT_MAX = 8
LINGER = 60.0  # an isolated upstream outlives its last session by this (a kernel restart)
SCHEMA_MAX = 256 << 10  # a tool's input schema, as JSON: beyond it calls are refused


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str | None = None  # stdio
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None  # streamable HTTP
    headers: tuple[tuple[str, str], ...] = ()
    isolation: str = "client"  # shared | client | session (parse_config: shared for HTTP)

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
        unknown = set(raw) - {
            "command", "args", "env", "cwd", "url", "headers", "type", "isolation"
        }  # fmt: skip
        if unknown:
            raise InvalidRequest(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        command, url = raw.get("command"), raw.get("url")
        isolation = raw.get("isolation", "client" if command is not None else "shared")
        if isolation not in ISOLATIONS:
            raise InvalidRequest(f"{where}.isolation must be one of {', '.join(ISOLATIONS)}")
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
                isolation=isolation,
            )
        else:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise InvalidRequest(f"{where}.url must be an http(s) URL")
            servers[name] = ServerConfig(
                name,
                url=url,
                headers=_mapping(raw.get("headers", {}), f"{where}.headers"),
                isolation=isolation,
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
    _validators: dict[str, Any] = field(default_factory=dict)  # tool -> validator | why not

    def _target(self) -> Any:
        c = self.config
        if c.command:
            # Back to the host's CPU weight: a kernel's calls are not the gateway's work.
            argv = [*cpuweight.prefix(), c.command, *c.args]
            return StdioServerParameters(
                command=argv[0], args=argv[1:], env=dict(c.env) or None, cwd=c.cwd
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
                self._validators = {}
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
                async with asyncio.timeout(self.connect_timeout):
                    await self._ready.wait()
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

    def argument_problem(self, tool: dict[str, Any], arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit `tool`'s input schema (None: they do)."""
        name = str(tool.get("name"))
        checker = self._validators.get(name)
        if checker is None:
            checker = self._validators[name] = schema_validator(tool.get("inputSchema"))
        if isinstance(checker, str):
            return f"{self.config.name}.{name} cannot be called: {checker}"
        return argument_problem(checker, arguments, f"{self.config.name}.{name}")

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
                async with asyncio.timeout(5.0):
                    await asyncio.shield(self._runner)
            except (TimeoutError, Exception):
                self._runner.cancel()
                with contextlib.suppress(BaseException):
                    await self._runner


_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "dependentSchemas", "not")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_ERRORS = (
    jsonschema.exceptions.SchemaError,
    referencing.exceptions.Unresolvable,
    RecursionError,
    ValueError,
    TypeError,
)


def schema_validator(schema: Any) -> Any:
    """A validator for a tool's input schema, or why there can be none (a string).

    Unknown fields are refused unless the schema allows them: an object schema that says
    nothing of further properties (and composes no others) is closed. A schema that is
    not JSON, is over SCHEMA_MAX or is not a valid schema refuses every call; references
    are resolved within the schema only (never fetched).
    """
    if not isinstance(schema, dict):
        return "its input schema is not a JSON object"
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        return "its input schema is not JSON"
    if size > SCHEMA_MAX:
        return f"its input schema is {size} bytes of JSON, over the limit of {SCHEMA_MAX}"
    closed = dict(schema)
    if (
        closed.get("type", "object") == "object"
        and not any(k in closed for k in _OPEN)
        and not any(k in closed for k in _COMPOSED)
    ):
        closed["additionalProperties"] = False
    try:
        cls = jsonschema.validators.validator_for(closed, default=jsonschema.Draft202012Validator)
        cls.check_schema(closed)
        return cls(closed)
    except _SCHEMA_ERRORS as exc:
        return f"its input schema is invalid: {_clip(str(exc), 300)}"


def argument_problem(validator: Any, arguments: dict[str, Any], label: str) -> str | None:
    """The first way `arguments` break the schema, in words (None: they fit)."""
    try:
        error = next(iter(validator.iter_errors(arguments)), None)
    except _SCHEMA_ERRORS as exc:
        return (
            f"the arguments of {label} cannot be checked against its schema: {_clip(str(exc), 300)}"
        )
    if error is None:
        return None
    where = error.json_path if error.path else "the arguments"
    return f"{label}: {where}: {_clip(error.message, 500)}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


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


class Lease:
    """What one session's bridge holds: its upstreams, its meter; `release` when it goes.

    `refused` names the servers this session has no upstream for, and why (the limit
    of isolated upstreams was reached): calls to them fail with that message.
    """

    def __init__(
        self,
        upstreams: dict[str, Upstream],
        refused: dict[str, str],
        meter: Meter,
        release: Callable[[], None],
    ) -> None:
        self.upstreams = upstreams
        self.refused = refused
        self.meter = meter
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Let go (once; later calls do nothing)."""
        release, self._release = self._release, None
        if release is not None:
            release()


class UpstreamPool:
    """The gateway's upstream servers, handed to sessions by their isolation.

    A `shared` server is one Upstream for everyone. A `client` or `session` one is an
    Upstream per client (a session's owner; a session without one, declared rather than
    created by a client, counts as a client of its own) or per session, made when a
    session's bridge first leases it and connected when the bridge first needs it. At
    most `processes_max` isolated ones live at once, and at most `per_client_max` of
    one client's: past either a session gets none of that server, and its calls say
    why. When the last lease of a client or session is released, its upstreams (and
    the session's call meter) are closed `linger` seconds later unless leased again
    meanwhile: a kernel restart keeps them, and a rate limit (counted over a minute)
    outlives a new bridge. A session closed or deleted (`end`) frees its own at once.
    """

    def __init__(
        self,
        configs: dict[str, ServerConfig],
        *,
        processes_max: int = PROCESSES_MAX,
        per_client_max: int = PROCESSES_PER_CLIENT_MAX,
        linger: float = LINGER,
    ) -> None:
        self.configs = dict(configs)
        self.processes_max = processes_max
        self.per_client_max = per_client_max
        self.linger = linger
        self.shared = {n: Upstream(c) for n, c in configs.items() if c.isolation == "shared"}
        self._scoped: dict[tuple[str, str], Upstream] = {}  # (server, scope) -> upstream
        self._clients: dict[str, str] = {}  # scope -> the client whose upstreams it holds
        self._meters: dict[str, Meter] = {}  # session key -> its meter
        self._users: Counter[str] = Counter()  # scope -> leases holding it
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, upstreams: dict[str, Upstream]) -> UpstreamPool:
        """A pool in which every session shares these upstreams."""
        pool = cls({})
        pool.configs = {n: u.config for n, u in upstreams.items()}
        pool.shared = dict(upstreams)
        return pool

    def __contains__(self, name: object) -> bool:
        return name in self.configs

    @property
    def isolated(self) -> int:
        """How many isolated upstreams live now (each a process, once connected)."""
        return len(self._scoped)

    def isolation(self, name: str) -> str:
        return "shared" if name in self.shared else self.configs[name].isolation

    def lease(self, names: list[str], *, session: str, client: str | None) -> Lease:
        """The upstreams of `names` (servers of this pool) for one session's bridge.

        `session` is a key unique to the session (namespace, name and uid), `client` its
        owner, if it has one.
        """
        upstreams: dict[str, Upstream] = {}
        refused: dict[str, str] = {}
        scopes = {f"session:{session}"}  # the meter lives as long as the session's scope
        for name in names:
            if name in self.shared:
                upstreams[name] = self.shared[name]
                continue
            isolation = self.configs[name].isolation
            scope = f"client:{client}" if isolation == "client" and client else f"session:{session}"
            upstream = self._scoped.get((name, scope))
            if upstream is None:
                why = self._refusal(name, isolation, client or f"session:{session}")
                if why is not None:
                    refused[name] = why
                    continue
                upstream = self._scoped[(name, scope)] = Upstream(self.configs[name])
                self._clients[scope] = client or f"session:{session}"
            upstreams[name] = upstream
            scopes.add(scope)
        for scope in scopes:
            self._users[scope] += 1
            timer = self._expiry.pop(scope, None)
            if timer is not None:
                timer.cancel()
        meter = self._meters.setdefault(session, Meter())

        def release() -> None:
            for scope in scopes:
                if self._users[scope] <= 0:
                    continue  # ended (`end`) meanwhile
                self._users[scope] -= 1
                if self._users[scope] <= 0:
                    self._schedule_expiry(scope)

        return Lease(upstreams, refused, meter, release)

    def _refusal(self, name: str, isolation: str, client: str) -> str | None:
        """Why no new isolated upstream of server `name` is made for `client`, if not."""
        if len(self._scoped) >= self.processes_max:
            return (
                f"MCP server {name!r} runs one process per {isolation}, and this "
                f"gateway already runs {len(self._scoped)} such processes, its limit "
                "(mcp-forge gateway --mcp-processes-max): close other sessions, or "
                "configure the server with isolation shared"
            )
        held = sum(1 for _, scope in self._scoped if self._clients.get(scope) == client)
        if held >= self.per_client_max:
            return (
                f"MCP server {name!r} runs one process per {isolation}, and your sessions "
                f"already hold {held} such processes, the limit per client "
                "(MCPFORGE_MCP_PROCESSES_PER_CLIENT_MAX): close one of your sessions first"
            )
        return None

    def end(self, session: str) -> None:
        """The session of key `session` is gone (closed, deleted): its own upstreams and
        meter go now, not `linger` seconds after its last lease."""
        scope = f"session:{session}"
        timer = self._expiry.pop(scope, None)
        if timer is not None:
            timer.cancel()
        self._users[scope] = 0
        self._expire(scope)

    def _schedule_expiry(self, scope: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop any more (shutting down): nothing to wait for
            self._expire(scope)
            return
        self._expiry[scope] = loop.call_later(self.linger, self._expire, scope)

    def _expire(self, scope: str) -> None:
        self._expiry.pop(scope, None)
        if self._users[scope] > 0:
            return
        del self._users[scope]
        if scope.startswith("session:"):
            self._meters.pop(scope.removeprefix("session:"), None)
        self._clients.pop(scope, None)
        for key in [k for k in self._scoped if k[1] == scope]:
            upstream = self._scoped.pop(key)
            log.info("closing upstream MCP server %s of %s", key[0], scope)
            with contextlib.suppress(RuntimeError):  # no loop: the process ends with ours
                task = asyncio.get_running_loop().create_task(upstream.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every upstream, shared and isolated."""
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        every = [*self.shared.values(), *self._scoped.values()]
        self._scoped.clear()
        await asyncio.gather(*(u.close() for u in every), *self._closing)
