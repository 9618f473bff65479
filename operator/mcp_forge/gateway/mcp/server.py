"""The gateway as an MCP server: the only module that imports the `mcp` SDK.

A thin adapter: each tool checks who is calling (the MCP connection), calls the
session service or the gateway core, and turns the answer into MCP content plus
structuredContent. Errors of ours (ForgeError) become tool errors (isError) with the
message; an exception raised by the user's code is an isError result with its
traceback, not a protocol error.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import inspect
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import ForgeError, InvalidRequest
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.sessions import Client, SessionRequest, SessionService, stdio_client
from mcp_forge.jupyter.execution import ExecutionResult

log = logging.getLogger(__name__)

IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/webp")
CLIENT_HEADER = "x-mcpforge-client"  # set by BearerAuth only
NOTIFY_INTERVAL = 0.2  # seconds between batches of log notifications, at least
LOG_FORWARD_MAX = 100_000  # characters of stream output sent as log messages per call

INSTRUCTIONS = """\
MCP-Forge runs Python for you in isolated, stateful kernels (ipykernel in a sandboxed
pod: no network, uid 1000, a writable /workspace). Variables, imports and files persist
between execute_code calls on the same session until it is restarted, closed, or idle
for its idle timeout. Call execute_code without session_id to use your own default
session; create_session makes more (e.g. variant "minimal" starts faster, "default" has
numpy, pandas, matplotlib and pillow)."""


class SessionInfo(BaseModel):
    session_id: str
    phase: str
    image: str
    memory: str
    cpu: str
    idle_timeout: str
    created: str | None = None
    last_activity: str | None = None
    restarts: int = 0
    execution_count: int | None = None
    memory_bytes: int | None = None
    owned: bool = True


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class Closed(BaseModel):
    session_id: str
    closed: bool


class ExecuteOutput(BaseModel):
    session_id: str
    status: Literal["ok", "error", "timeout", "interrupted", "died"]
    stdout: str
    stderr: str
    result: dict[str, Any] | None
    displays: list[dict[str, Any]]
    error: dict[str, Any] | None
    execution_count: int | None
    duration: float
    truncated: bool
    full_output_path: str | None
    state_lost: bool
    message: str


class Interrupted(BaseModel):
    session_id: str
    interrupted: bool


class Restarted(BaseModel):
    session_id: str
    restarted: bool
    message: str


class Variable(BaseModel):
    name: str
    type: str
    shape: list[int] | None = None
    dtype: str | None = None
    length: int | None = None
    size: int | None = None
    repr: str | None = None


class KernelTools(BaseModel):
    session_id: str
    servers: list[str]
    stubs: str


class Variables(BaseModel):
    session_id: str
    variables: list[Variable]


class FileEntry(BaseModel):
    name: str
    type: str
    size: int | None = None
    mtime: float | None = None


class FileList(BaseModel):
    session_id: str
    path: str
    entries: list[FileEntry]
    truncated: bool


class FileRead(BaseModel):
    session_id: str
    path: str
    size: int
    encoding: Literal["text", "base64"]
    mime_type: str | None = None


class FileWritten(BaseModel):
    session_id: str
    path: str
    size: int


def _info(
    session: KernelSession, client: Client, service: SessionService, gateway: Gateway
) -> SessionInfo:
    status = session.status
    return SessionInfo(
        session_id=session.name,
        phase=str(status.get("phase", "Pending")),
        image=session.spec.image,
        memory=session.spec.memory,
        cpu=session.spec.cpu,
        idle_timeout=session.body["spec"]["idleTimeout"],
        created=session.body["metadata"].get("creationTimestamp"),
        last_activity=status.get("lastActivity"),
        restarts=int(status.get("restarts", 0)),
        execution_count=gateway.execution_count(session),
        owned=service.owns(client, session),
    )


ToolFn = TypeVar("ToolFn", bound=Callable[..., Awaitable[Any]])


def _hints(*, read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations:
    """Tool annotations; no tool reaches outside the gateway and its kernels."""
    return ToolAnnotations(
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


def _tool_errors(fn: ToolFn) -> ToolFn:
    """Our errors reach the model as tool errors with their message (the SDK hides the
    text of any other exception)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ForgeError as exc:
            raise ToolError(str(exc)) from exc

    return wrapper  # type: ignore[return-value]


def _sniff_image(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def execution_content(result: ExecutionResult) -> list[ContentBlock]:
    """The result as text a model reads in one go, plus images as image content."""
    parts: list[str] = []
    if result.stdout:
        parts.append(f"[stdout]\n{result.stdout.rstrip()}")
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr.rstrip()}")
    if result.result is not None and "text/plain" in result.result["data"]:
        parts.append(f"[result]\n{result.result['data']['text/plain']}")
    for display in result.displays:
        text = display["data"].get("text/markdown") or display["data"].get("text/plain")
        if text and not any(m in display["data"] for m in IMAGE_MIMES):
            parts.append(f"[display]\n{text}")
    if result.error is not None:
        parts.append(
            "[error]\n"
            + "\n".join(result.error.traceback or (f"{result.error.ename}: {result.error.evalue}",))
        )
    if result.status not in ("ok", "error") or result.message:
        parts.append(f"[{result.status}] {result.message}".rstrip())
    if not parts:
        parts.append("[ok] (no output)")
    content: list[ContentBlock] = [TextContent(type="text", text="\n\n".join(parts))]
    for bundle in (*result.displays, *([result.result] if result.result else [])):
        for mime in IMAGE_MIMES:
            data = bundle["data"].get(mime)
            if isinstance(data, str):
                content.append(ImageContent(type="image", data=data.strip(), mime_type=mime))
                break
    return content


def build_server(
    service: SessionService, gateway: Gateway, *, transport: Literal["stdio", "http"]
) -> MCPServer:
    """The MCP server with the gateway's tools, for one transport."""
    server: MCPServer = MCPServer(name="mcp-forge", instructions=INSTRUCTIONS)
    read_only = _hints(read_only=True, destructive=False, idempotent=True)

    def tool(**options: Any) -> Callable[[ToolFn], ToolFn]:
        def register(fn: ToolFn) -> ToolFn:
            description = inspect.cleandoc(fn.__doc__ or "")
            server.tool(description=description, **options)(_tool_errors(fn))
            return fn

        return register

    the_stdio_client = stdio_client()

    def client_of(ctx: Context) -> Client:
        """Who is calling: the one stdio client, or the HTTP client its token names.

        MCP requests may each arrive on a connection of their own (the stateless
        protocol), so identity comes from the credential, set by BearerAuth in a header
        it controls (any client-sent value is dropped first). Over HTTP, a request
        without it is refused, never taken for the stdio client.
        """
        if transport == "stdio":
            return the_stdio_client
        name = (ctx.headers or {}).get(CLIENT_HEADER)
        if not name:
            raise ToolError("unauthenticated request")
        return Client(name)

    async def session_for(ctx: Context, session_id: str | None) -> KernelSession:
        client = client_of(ctx)
        if session_id is None:
            return await service.default(client)
        return await service.resolve(client, session_id)

    @tool(
        annotations=_hints(read_only=False, destructive=False, idempotent=False),
    )
    async def create_session(
        ctx: Context,
        name: Annotated[
            str | None,
            Field(
                description=(
                    "Optional name (a-z, 0-9, '-', at most 40, starting with a letter); a random"
                    " id otherwise."
                )
            ),
        ] = None,
        variant: Annotated[
            Literal["default", "minimal"],
            Field(
                description=(
                    "default: numpy, pandas, matplotlib, pillow. minimal: ipykernel only, starts "
                    "faster."
                )
            ),
        ] = "default",
        memory: Annotated[
            str | None,
            Field(
                description=(
                    "Memory limit such as 512Mi or 2Gi (default 1Gi); past it the kernel is "
                    "OOM-killed and restarted."
                )
            ),
        ] = None,
        cpu: Annotated[
            str | None, Field(description="CPU limit such as 1, 0.5 or 500m (default 1).")
        ] = None,
        env: Annotated[
            dict[str, str] | None, Field(description="Environment variables for the kernel.")
        ] = None,
        shared_group: Annotated[
            str | None,
            Field(description="Sessions with the same shared_group see one /shared directory."),
        ] = None,
        mcp_servers: Annotated[
            list[dict[str, Any]] | None,
            Field(
                description=(
                    "Code mode: upstream MCP servers code in this session may call through "
                    "`import mcp_tools`, each {name, allow?: [glob], deny?: [glob], readOnly?: "
                    "bool, callsPerExecution?: int, callsPerMinute?: int}; names are the "
                    "gateway's configured servers. None: no upstream server."
                )
            ),
        ] = None,
    ) -> SessionInfo:
        """Create a new isolated Python session and wait until its kernel is ready (~1-2 s).

        Returns its session_id (pass it to the other tools) and limits. The session keeps
        its variables and /workspace files until closed, restarted, or idle for its idle
        timeout (30 minutes). Errors name the invalid field (e.g. memory '1GB')."""
        client = client_of(ctx)
        session = await service.create(
            client,
            SessionRequest(
                name=name,
                variant=variant,
                memory=memory,
                cpu=cpu,
                env=env,
                shared_group=shared_group,
                mcp_servers=mcp_servers,
            ),
        )
        return _info(session, client, service, gateway)

    @tool(annotations=read_only)
    async def list_sessions(ctx: Context) -> SessionList:
        """List the sessions you can use: yours and those declared by an operator.

        Each has its phase (Ready, Starting, Restarting, Failed), creation and last
        activity times, restarts, execution count (when this gateway has run code) and
        the memory its kernel uses now (memory_bytes)."""
        client = client_of(ctx)
        sessions = await service.list(client)
        usage = await service.memory_usage(sessions)
        infos = [_info(s, client, service, gateway) for s in sessions]
        for info in infos:
            info.memory_bytes = usage.get(info.session_id)
        return SessionList(sessions=infos)

    @tool(
        annotations=_hints(read_only=False, destructive=True, idempotent=False),
    )
    async def close_session(ctx: Context, session_id: str) -> Closed:
        """Delete a session you created: its kernel, variables and /workspace files are gone.

        Sessions declared outside the gateway cannot be closed from here."""
        await service.close(client_of(ctx), session_id)
        return Closed(session_id=session_id, closed=True)

    @tool(
        annotations=_hints(read_only=False, destructive=False, idempotent=False),
    )
    async def execute_code(
        ctx: Context,
        code: Annotated[
            str,
            Field(
                description=(
                    "Python source to run, as in a Jupyter cell; the last expression's value is "
                    "returned."
                )
            ),
        ],
        session_id: Annotated[
            str | None,
            Field(
                description=(
                    "Session to run in; omit to use your default session (created on first use)."
                )
            ),
        ] = None,
        timeout: Annotated[
            float | None,
            Field(
                description="Seconds before the code is interrupted (default 300, at most 3600)."
            ),
        ] = None,
    ) -> Annotated[CallToolResult, ExecuteOutput]:
        """Run Python code in a stateful kernel and return what it printed and produced.

        State persists across calls on a session: variables, imports, files in
        /workspace. Returns stdout, stderr, the last expression's value, every display
        (matplotlib figures come back as PNG images) and, if the code raised, the
        traceback (isError is then true). Limits: code up to 1 MB; about 100 KB of text
        comes back, the full output is saved in /workspace/.mcp-forge/outputs/. Past the
        timeout the code is interrupted and variables are kept; if it does not stop, the
        kernel is restarted and variables are lost (state_lost). status 'died' means the
        kernel crashed or ran out of memory: it was restarted, variables are lost.
        In a session created with mcp_servers, code can call those servers' tools with
        `import mcp_tools` (code mode): see list_kernel_tools for what it may call.
        The kernel has no network access."""
        limit = gateway.check_code(code, timeout)  # bad input is refused before a kernel starts
        session = await session_for(ctx, session_id)
        pending: list[tuple[str, str]] = []
        arrived = asyncio.Event()
        forwarded = 0

        def on_stream(name: str, text: str) -> None:
            nonlocal forwarded
            if forwarded < LOG_FORWARD_MAX:
                piece = text[: LOG_FORWARD_MAX - forwarded]
                forwarded += len(piece)
                pending.append((name, piece))
                arrived.set()

        async def keep_client_informed(started: float) -> None:
            # Progress at least once a second (clients reset their request timeout on
            # it, so a long cell is not given up on) and the output as log messages,
            # gathered into one message per stream per second at most.
            last_progress = started
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(last_progress + 1 - time.monotonic(), 0)):
                        await arrived.wait()
                arrived.clear()
                batch, pending[:] = list(pending), []
                try:
                    for stream in ("stdout", "stderr"):
                        text = "".join(t for n, t in batch if n == stream)
                        if text:
                            await ctx.log("info", text, logger_name=stream)
                    now = time.monotonic()
                    if now - last_progress >= 1:
                        last_progress = now
                        elapsed = now - started
                        await ctx.report_progress(elapsed, limit, f"running for {elapsed:.0f}s")
                except Exception as exc:  # the adapter's edge: never lose the result
                    log.warning("could not notify the client: %s", exc)
                    return
                # Rate limit (not a wait for an event): at most one batch per interval.
                await asyncio.sleep(NOTIFY_INTERVAL)

        informer = asyncio.create_task(keep_client_informed(time.monotonic()))
        try:
            result = await gateway.execute(
                session.name,
                code,
                timeout=limit,
                namespace=session.namespace,
                on_stream=on_stream,
            )
        finally:
            informer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await informer
        structured = ExecuteOutput(session_id=session.name, **result.to_dict())
        return CallToolResult(
            content=execution_content(result),
            structured_content=structured.model_dump(mode="json"),
            is_error=result.status != "ok",
        )

    @tool(annotations=_hints(read_only=False, destructive=False, idempotent=True))
    async def interrupt_kernel(ctx: Context, session_id: str) -> Interrupted:
        """Interrupt the code a session is running (like Ctrl-C); variables are kept.

        The running execute_code call then returns with status 'interrupted'."""
        session = await session_for(ctx, session_id)
        acked = await gateway.interrupt(session.name, namespace=session.namespace)
        return Interrupted(session_id=session.name, interrupted=acked)

    @tool(annotations=_hints(read_only=False, destructive=True, idempotent=False))
    async def restart_kernel(ctx: Context, session_id: str) -> Restarted:
        """Restart a session's kernel: a fresh interpreter, all variables and imports are
        lost; files in /workspace are kept."""
        session = await session_for(ctx, session_id)
        await gateway.restart(session.name, namespace=session.namespace)
        return Restarted(
            session_id=session.name,
            restarted=True,
            message="variables cleared; workspace files kept",
        )

    @tool(annotations=read_only)
    async def list_kernel_tools(
        ctx: Context,
        session_id: Annotated[
            str | None, Field(description="Session; omit for your default session.")
        ] = None,
    ) -> KernelTools:
        """Code mode: the Python functions code in this session may call through
        `import mcp_tools` (one per upstream MCP server tool, with signatures and
        docstrings), as stubs. Call them from execute_code, e.g.
        `import mcp_tools; mcp_tools.files.read_text_file(path="a.txt")`; many at once
        with `await mcp_tools.<server>.<tool>.aio(...)`. Filter and combine results in
        the kernel and return only what matters."""
        session = await session_for(ctx, session_id)
        listing = await gateway.kernel_tools(session.name, namespace=session.namespace)
        return KernelTools(session_id=session.name, **listing)

    @tool(annotations=read_only)
    async def list_variables(ctx: Context, session_id: str) -> Variables:
        """The variables defined in a session: name, type, shape, dtype, length, size in
        bytes and a short repr. Computed inside the kernel; nothing changes. Each value
        gets about 2 s of its own code (repr, len, shape): one that takes longer shows a
        note in place of its repr."""
        session = await session_for(ctx, session_id)
        items = await gateway.variables(session.name, namespace=session.namespace)
        return Variables(session_id=session.name, variables=[Variable(**v) for v in items])

    @tool(annotations=read_only)
    async def inspect_variable(ctx: Context, session_id: str, name: str) -> Variable:
        """One variable in detail, with a longer repr (up to 2000 characters)."""
        session = await session_for(ctx, session_id)
        return Variable(
            **await gateway.inspect_variable(session.name, name, namespace=session.namespace)
        )

    @tool(annotations=read_only)
    async def read_file(
        ctx: Context,
        session_id: str,
        path: Annotated[
            str, Field(description="Path in the session's /workspace, relative or absolute.")
        ],
    ) -> Annotated[CallToolResult, FileRead]:
        """Read a file from the session's /workspace (up to 10 MB). Images come back as
        image content, UTF-8 text as text, other files as base64. Symbolic links are never
        followed, even to a file inside /workspace (SymlinkRefused: read the target's own
        path); FIFOs, sockets and devices are refused (NotARegularFile)."""
        session = await session_for(ctx, session_id)
        data = await gateway.read_file(session.name, path, namespace=session.namespace)
        mime = _sniff_image(data)
        content: list[ContentBlock]
        if mime is not None:
            encoding: Literal["text", "base64"] = "base64"
            content = [
                ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=mime)
            ]
        else:
            try:
                text = data.decode("utf-8")
                encoding = "text"
            except UnicodeDecodeError:
                text = base64.b64encode(data).decode()
                encoding = "base64"
            content = [TextContent(type="text", text=text)]
        info = FileRead(
            session_id=session.name, path=path, size=len(data), encoding=encoding, mime_type=mime
        )
        return CallToolResult(content=content, structured_content=info.model_dump(mode="json"))

    @tool(annotations=_hints(read_only=False, destructive=True, idempotent=True))
    async def write_file(
        ctx: Context,
        session_id: str,
        path: Annotated[
            str, Field(description="Path in the session's /workspace; directories are created.")
        ],
        content: str,
        encoding: Annotated[
            Literal["text", "base64"], Field(description="text: UTF-8; base64: binary data.")
        ] = "text",
    ) -> FileWritten:
        """Write a file into the session's /workspace (up to 10 MB), replacing it if it
        exists. Paths cannot leave /workspace; symbolic links on the path are never
        followed (SymlinkRefused), and a file with other hard links is not written
        (HardLinkRefused)."""
        session = await session_for(ctx, session_id)
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest("content is not valid base64") from exc
        else:
            data = content.encode()
        size = await gateway.write_file(session.name, path, data, namespace=session.namespace)
        return FileWritten(session_id=session.name, path=path, size=size)

    @tool(annotations=read_only)
    async def list_files(
        ctx: Context,
        session_id: str,
        path: Annotated[
            str | None, Field(description="Directory in /workspace; the top if omitted.")
        ] = None,
    ) -> FileList:
        """List a directory of the session's /workspace: name, type (file, dir, symlink,
        other), size, mtime; at most 1,000 entries, sorted by name (truncated says there are
        more). Links are listed, never followed. Name bytes that are not UTF-8 are shown as
        \\xNN escapes."""
        session = await session_for(ctx, session_id)
        listing = await gateway.list_files(session.name, path or ".", namespace=session.namespace)
        return FileList(
            session_id=session.name,
            path=listing["path"],
            entries=[FileEntry(**e) for e in listing["entries"]],
            truncated=listing["truncated"],
        )

    return server


# ---- transports ------------------------------------------------------------------------------

MAX_REQUEST_BODY = 16 * 1024 * 1024  # a 10 MB file, base64-encoded, in a JSON-RPC request


async def serve_stdio(server: MCPServer) -> None:
    """Serve one client on stdin/stdout until it closes stdin."""
    await server.run_stdio_async()


class BearerAuth:
    """ASGI middleware: 401 unless `Authorization: Bearer <token>` names a client.

    Each token is one client's credential (`tokens` maps token → client name). The
    client's name is passed on in the CLIENT_HEADER, which only this middleware sets,
    and as `scope["user"]`, which the SDK uses to bind an MCP session to the credential
    that opened it (another client's session id is then "not found").
    """

    def __init__(self, app: Any, tokens: dict[str, str]) -> None:
        self.app = app
        self.tokens = {t.encode(): name for t, name in tokens.items()}

    def _client(self, authorization: bytes) -> tuple[str, bytes] | None:
        scheme, _, presented = authorization.partition(b" ")
        found = None
        for token, name in self.tokens.items():  # every one compared: no early exit
            if hmac.compare_digest(presented.strip(), token):
                found = (name, token)
        return found if scheme.lower() == b"bearer" else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets and anything else: not served
            return
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != CLIENT_HEADER.encode()]
        found = self._client(dict(headers).get(b"authorization", b""))
        if found is None:
            body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"www-authenticate", b'Bearer realm="mcp-forge"'),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        name, token = found
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken

        user = AuthenticatedUser(
            AccessToken(token=hashlib.sha256(token).hexdigest(), client_id=name, scopes=[])
        )
        scope = {
            **scope,
            "headers": [*headers, (CLIENT_HEADER.encode(), name.encode())],
            "user": user,
        }
        await self.app(scope, receive, send)


def http_app(
    server: MCPServer,
    *,
    host: str,
    port: int,
    tokens: dict[str, str],
    allowed_origins: list[str],
    allowed_hosts: tuple[str, ...] = (),
) -> Any:
    """The streamable-HTTP app at /mcp: bearer token, Host/Origin allow-list, size limit."""
    from mcp.server.transport_security import TransportSecuritySettings

    named = f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header has it
    hosts = {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"{named}:{port}"}
    for h in allowed_hosts:
        if ":" in h.rsplit("]", 1)[-1]:
            hosts.add(h)
        else:  # a bare name: as a client reaching us directly, and through a proxy on 80/443
            hosts.update((h, f"{h}:{port}"))
    origins = {f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"}
    origins.update(allowed_origins)
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=sorted(hosts),
        allowed_origins=sorted(origins),
    )
    app = server.streamable_http_app(
        streamable_http_path="/mcp",
        transport_security=security,
        max_request_body_size=MAX_REQUEST_BODY,
        host=host,
    )
    return BearerAuth(app, tokens)


class HttpServer:
    """uvicorn on a socket bound before anyone is told the address, stopped gracefully."""

    def __init__(self, app: Any, *, host: str, port: int, grace: float) -> None:
        import uvicorn

        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.socket = socket.create_server((host, port), family=family)
            # Accepted connections inherit it. asyncio sets it only when the socket's
            # proto is TCP, which uvicorn's copy of a passed-in socket does not say, and
            # Nagle plus delayed ACKs then add ~40 ms to every response.
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise ForgeError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        # At shutdown, requests in flight (an open SSE stream, a long cell) get `grace`
        # seconds; then they are closed, so SIGTERM always ends the gateway.
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=max(1, round(grace))
        )
        self._server = uvicorn.Server(config)

    async def serve(self) -> None:
        await self._server.serve(sockets=[self.socket])

    def stop(self) -> None:
        """Finish the requests in flight, then return from serve()."""
        self._server.should_exit = True
