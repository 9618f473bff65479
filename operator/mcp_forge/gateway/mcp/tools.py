"""The gateway's MCP tools: the methods of Tools, which is given the session service and
the gateway core. Each tool's docstring is its description, written for a model; its body
is a thin step to the service or the core. An error of ours (ForgeError) reaches the model
as a tool error with its message; an exception raised by the user's code is not an error
here but an isError result of execute_code, with its traceback."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field, WithJsonSchema

from mcp_forge import metrics, tracing
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import ForgeError, InvalidRequest, InvalidSession
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.mcp.content import execution_result, file_result, session_info
from mcp_forge.gateway.mcp.http import CLIENT_HEADER
from mcp_forge.gateway.mcp.models import (
    Closed,
    ExecuteOutput,
    FileEntry,
    FileList,
    FileRead,
    FileWritten,
    InstalledPackage,
    Interrupted,
    KernelTools,
    NotebookExported,
    PackagesInstalled,
    Restarted,
    SessionInfo,
    SessionList,
    Variable,
    Variables,
)
from mcp_forge.gateway.mcp.notifications import keeping_informed
from mcp_forge.gateway.sessions import Client, SessionRequest, SessionService, stdio_client

ToolFn = TypeVar("ToolFn", bound=Callable[..., Awaitable[Any]])

_ANNOTATIONS: dict[str, ToolAnnotations] = {}  # tool name -> its hints, in the order listed


def _hints(*, read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations:
    """Tool annotations; no tool reaches outside the gateway and its kernels."""
    return ToolAnnotations(
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


READ_ONLY = _hints(read_only=True, destructive=False, idempotent=True)


def tool(annotations: ToolAnnotations) -> Callable[[ToolFn], ToolFn]:
    """Mark a method of Tools as a tool with these annotations."""

    def mark(fn: ToolFn) -> ToolFn:
        _ANNOTATIONS[fn.__name__] = annotations
        return fn

    return mark


_OUTCOMES = ("ok", "error", "cancelled", "failed")  # failed: not an error of ours


def _tool_errors(fn: ToolFn) -> ToolFn:
    """Our errors reach the model as tool errors with their message (the SDK hides the
    text of any other exception). Each call is counted and timed (metrics.py)."""

    seconds = metrics.TOOL_SECONDS.labels(tool=fn.__name__)
    outcomes = {o: metrics.TOOL_CALLS.labels(tool=fn.__name__, outcome=o) for o in _OUTCOMES}

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        outcome = "failed"
        try:
            answer = await fn(*args, **kwargs)
            outcome = "ok"
            return answer
        except ForgeError as exc:
            outcome = "error"
            raise ToolError(str(exc)) from exc
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            seconds.observe(time.perf_counter() - started)
            outcomes[outcome].inc()

    return wrapper  # type: ignore[return-value]


# mcp_servers as published: the SDK validates nothing of it (Any), so that anything else
# gets _server_policies' error, which names the item, not pydantic's union report.
_MCP_SERVERS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                ]
            },
        },
        {"type": "null"},
    ]
}


def _server_policies(value: Any) -> list[dict[str, Any]] | None:
    """create_session's mcp_servers as spec.mcpServers: a plain name is that server with
    the default policy; an object is passed on whole (the policy's own fields are checked
    where spec.mcpServers is). Anything else is InvalidSession naming the item."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidSession(
            'must be a list of server names ("time") or objects with a name',
            field="mcp_servers",
        )
    policies = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            policies.append({"name": item})
        elif isinstance(item, dict):
            policies.append(item)
        else:
            got = "an empty string" if item == "" else type(item).__name__
            raise InvalidSession(
                'must be a server name ("time") or an object with a name '
                f'({{"name": "time", "readOnly": true}}), got {got}',
                field=f"mcp_servers[{i}]",
            )
    return policies


class Tools:
    """The tools of one server: `transport` says how a caller is identified."""

    def __init__(
        self, service: SessionService, gateway: Gateway, *, transport: Literal["stdio", "http"]
    ) -> None:
        self.service = service
        self.gateway = gateway
        self.transport = transport
        self.stdio_client = stdio_client()

    def register(self, server: MCPServer) -> None:
        """Add every tool to the server, in the order they are defined here."""
        for name, hints in _ANNOTATIONS.items():
            fn = getattr(self, name)
            description = inspect.cleandoc(fn.__doc__ or "")
            server.tool(description=description, annotations=hints)(_tool_errors(fn))

    def _client_of(self, ctx: Context) -> Client:
        """Who is calling: the one stdio client, or the HTTP client its token names.

        MCP requests may each arrive on a connection of their own (the stateless
        protocol), so identity comes from the credential, set by BearerAuth in a header
        it controls (any client-sent value is dropped first). Over HTTP, a request
        without it is refused, never taken for the stdio client.
        """
        return self._client_from(ctx.headers)

    def _client_from(self, headers: Mapping[str, str] | None) -> Client:
        """`_client_of`, from a request's headers (None: it came over stdio)."""
        if self.transport == "stdio":
            return self.stdio_client
        name = (headers or {}).get(CLIENT_HEADER)
        if not name:
            raise ToolError("unauthenticated request")
        return Client(name)

    async def _session_for(self, ctx: Context, session_id: str | None) -> KernelSession:
        client = self._client_of(ctx)
        if session_id is None:
            return await self.service.default(client)
        return await self.service.resolve(client, session_id)

    def _info(self, session: KernelSession, client: Client) -> SessionInfo:
        return session_info(
            session,
            execution_count=self.gateway.execution_count(session),
            owned=self.service.owns(client, session),
        )

    @tool(_hints(read_only=False, destructive=False, idempotent=False))
    async def create_session(
        self,
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
            Any,
            WithJsonSchema(_MCP_SERVERS_SCHEMA),
            Field(
                description=(
                    "Code mode: upstream MCP servers code in this session may call through "
                    '`import mcp_tools`, each a name ("time": all its tools, the default '
                    "policy) or {name, allow?: [glob], deny?: [glob], readOnly?: bool, "
                    "callsPerExecution?: int, callsPerMinute?: int}; names are the gateway's "
                    "configured servers. None: no upstream server."
                )
            ),
        ] = None,
    ) -> SessionInfo:
        """Create a new isolated Python session and wait until its kernel is ready: tens of
        milliseconds when the gateway has a kernel of that image and resources ready
        (start "warm"), about a second otherwise (start "cold", start_reason says why).

        Returns its session_id (pass it to the other tools) and limits. The session keeps
        its variables and /workspace files until closed, restarted, or idle for its idle
        timeout (30 minutes). Errors name the invalid field (e.g. memory '1GB')."""
        client = self._client_of(ctx)
        session = await self.service.create(
            client,
            SessionRequest(
                name=name,
                variant=variant,
                memory=memory,
                cpu=cpu,
                env=env,
                shared_group=shared_group,
                mcp_servers=_server_policies(mcp_servers),
            ),
        )
        self.gateway.prepare(session)  # its first execute_code finds it connected
        return self._info(session, client)

    @tool(READ_ONLY)
    async def list_sessions(self, ctx: Context) -> SessionList:
        """List the sessions you can use: yours and those declared by an operator.

        Each has its phase (Ready, Starting, Restarting, Failed), creation and last
        activity times, restarts, execution count (when this gateway has run code) and
        the memory its kernel uses now (memory_bytes)."""
        client = self._client_of(ctx)
        sessions = await self.service.list(client)
        usage = await self.service.memory_usage(sessions)
        infos = [self._info(s, client) for s in sessions]
        for info in infos:
            info.memory_bytes = usage.get(info.session_id)
        return SessionList(sessions=infos)

    @tool(_hints(read_only=False, destructive=True, idempotent=False))
    async def close_session(self, ctx: Context, session_id: str) -> Closed:
        """Delete a session you created: its kernel, variables and /workspace files are gone.

        Sessions declared outside the gateway cannot be closed from here."""
        closed = await self.service.close(self._client_of(ctx), session_id)
        self.gateway.ended(closed.namespace, closed.name)  # its upstream processes go now
        return Closed(session_id=session_id, closed=True)

    @tool(_hints(read_only=False, destructive=False, idempotent=False))
    async def execute_code(
        self,
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
        limit = self.gateway.check_code(
            code, timeout
        )  # bad input is refused before a kernel starts
        session = await self._session_for(ctx, session_id)
        async with keeping_informed(ctx, limit) as on_stream:
            result = await self.gateway.execute(
                session.name,
                code,
                timeout=limit,
                namespace=session.namespace,
                on_stream=on_stream,
                read=session,  # just read, to check who may use it: not read again
            )
        answer = execution_result(session.name, result)
        if (trace_id := tracing.trace_id()) is not None:  # the SDK's span of this call
            answer.meta = {tracing.TRACE_ID_META: trace_id}
        return answer

    @tool(_hints(read_only=False, destructive=False, idempotent=True))
    async def interrupt_kernel(self, ctx: Context, session_id: str) -> Interrupted:
        """Interrupt the code a session is running (like Ctrl-C); variables are kept.

        The running execute_code call then returns with status 'interrupted'."""
        session = await self._session_for(ctx, session_id)
        acked = await self.gateway.interrupt(session.name, namespace=session.namespace)
        return Interrupted(session_id=session.name, interrupted=acked)

    @tool(_hints(read_only=False, destructive=True, idempotent=False))
    async def restart_kernel(self, ctx: Context, session_id: str) -> Restarted:
        """Restart a session's kernel: a fresh interpreter, all variables and imports are
        lost; files in /workspace are kept."""
        session = await self._session_for(ctx, session_id)
        await self.gateway.restart(session.name, namespace=session.namespace)
        return Restarted(
            session_id=session.name,
            restarted=True,
            message="variables cleared; workspace files kept",
        )

    @tool(READ_ONLY)
    async def list_kernel_tools(
        self,
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
        session = await self._session_for(ctx, session_id)
        listing = await self.gateway.kernel_tools(session.name, namespace=session.namespace)
        return KernelTools(session_id=session.name, **listing)

    @tool(READ_ONLY)
    async def list_variables(self, ctx: Context, session_id: str) -> Variables:
        """The variables defined in a session: name, type, shape, dtype, length, size in
        bytes and a short repr. Computed inside the kernel; nothing changes. Each value
        gets about 2 s of its own code (repr, len, shape): one that takes longer shows a
        note in place of its repr."""
        session = await self._session_for(ctx, session_id)
        items = await self.gateway.variables(session.name, namespace=session.namespace)
        return Variables(session_id=session.name, variables=[Variable(**v) for v in items])

    @tool(READ_ONLY)
    async def inspect_variable(self, ctx: Context, session_id: str, name: str) -> Variable:
        """One variable in detail, with a longer repr (up to 2000 characters)."""
        session = await self._session_for(ctx, session_id)
        return Variable(
            **await self.gateway.inspect_variable(session.name, name, namespace=session.namespace)
        )

    @tool(READ_ONLY)
    async def read_file(
        self,
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
        session = await self._session_for(ctx, session_id)
        data = await self.gateway.read_file(session.name, path, namespace=session.namespace)
        return file_result(session.name, path, data)

    @tool(_hints(read_only=False, destructive=True, idempotent=True))
    async def write_file(
        self,
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
        session = await self._session_for(ctx, session_id)
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest("content is not valid base64") from exc
        else:
            data = content.encode()
        size = await self.gateway.write_file(session.name, path, data, namespace=session.namespace)
        return FileWritten(session_id=session.name, path=path, size=size)

    @tool(_hints(read_only=False, destructive=True, idempotent=True))
    async def export_notebook(
        self,
        ctx: Context,
        session_id: Annotated[
            str | None,
            Field(description="Session to export; omit for your default session."),
        ] = None,
        path: Annotated[
            str, Field(description="Where to save it in the session's /workspace.")
        ] = "notebook.ipynb",
    ) -> NotebookExported:
        """Save every cell run in the session so far as a Jupyter notebook (.ipynb,
        nbformat 4): code, outputs, images, errors, execution counts and timings, in
        order; a kernel restart is marked where variables were lost. It is written to
        `path` in /workspace (replacing a file there) for a person to open in JupyterLab;
        read_file returns it. Cells are recorded as they run, so they outlive a gateway
        restart; outputs are as execute_code returned them (bounded). The notebook is at
        most 10 MB (the file limit): past it, cells are kept without their outputs
        (outputs_omitted counts them), and if the code of the cells alone is over it, the
        export is refused. A client runs one export at a time: another one meanwhile is
        an error."""
        session = await self._session_for(ctx, session_id)
        nb = await self.gateway.export_notebook(
            session.name,
            namespace=session.namespace,
            save_to=path,
            client=self._client_of(ctx).owner,
        )
        return NotebookExported(
            session_id=session.name,
            path=path,
            cells=nb.cells,
            size=len(nb.text.encode()),
            skipped=nb.skipped,
            outputs_omitted=nb.omitted,
        )

    @tool(READ_ONLY)
    async def list_files(
        self,
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
        session = await self._session_for(ctx, session_id)
        listing = await self.gateway.list_files(
            session.name, path or ".", namespace=session.namespace
        )
        return FileList(
            session_id=session.name,
            path=listing["path"],
            entries=[FileEntry(**e) for e in listing["entries"]],
            truncated=listing["truncated"],
        )

    @tool(_hints(read_only=False, destructive=False, idempotent=True))
    async def install_packages(
        self,
        ctx: Context,
        packages: Annotated[
            list[str],
            Field(
                description=(
                    'Requirements, e.g. ["tabulate", "msgpack==1.0.8", "rich>=13"]: names with '
                    "optional extras and version specifiers; no URLs, paths or pip options."
                )
            ),
        ],
        session_id: Annotated[
            str | None, Field(description="Session; omit for your default session.")
        ] = None,
    ) -> PackagesInstalled:
        """Install Python packages from the package index into a session, though its
        kernel has no network: the gateway resolves and downloads wheels (dependencies
        included), the kernel installs them offline into /workspace/.packages, which is on
        its sys.path at once and after a restart. Import them in execute_code straight
        after. Returns each distribution installed (name, version, size) and the total.

        The gateway's policy may refuse a package or a dependency (PackageDenied, named),
        or one over its size limit (PackageTooLarge); PackageNotFound names a requirement
        with no wheel for the kernel (CPython 3.11, Linux x86_64); PackageBusy says you (or
        the gateway) have as many installs running as allowed: wait for one to finish. A
        package the session imported already keeps its loaded version until
        restart_kernel."""
        session = await self._session_for(ctx, session_id)
        done = await self.gateway.install_packages(
            session.name,
            packages,
            namespace=session.namespace,
            read=session,
            client=self._client_of(ctx).owner,
        )
        return PackagesInstalled(
            session_id=session.name,
            installed=[InstalledPackage(**p) for p in done["installed"]],
            total_bytes=done["total_bytes"],
            path=done["path"],
        )
