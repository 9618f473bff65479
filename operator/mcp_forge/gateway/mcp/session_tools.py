"""The gateway's session tools and the machinery that registers every tool. `tool` records
each tool's name and hints in the order the methods are defined; SessionTools.register adds
them to the server in that order, each through `_tool_errors`, which turns our errors
(ForgeError) into tool errors and counts and times each call. SessionTools holds what every
tool needs (who is calling, which session a call names) and the tools that create, list,
close and fork sessions; Tools (tools.py) extends it with the tools that use a session. tools.py
imports this module before it defines its own tools, so the session tools are listed first."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field, WithJsonSchema

from mcp_forge import metrics
from mcp_forge.api import forks
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import ForgeError, InvalidSession
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.mcp.content import session_info
from mcp_forge.gateway.mcp.http import CLIENT_HEADER
from mcp_forge.gateway.mcp.models import Closed, Forked, ForkedSession, SessionInfo, SessionList
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
    """Mark a method of SessionTools or Tools as a tool with these annotations."""

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


_ALLOW_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "host": {"type": "string"},
                    "ports": {"type": "array", "items": {"type": "integer"}},
                    "methods": {"type": "array", "items": {"type": "string"}},
                    "paths": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["host"],
            },
        },
        {"type": "null"},
    ]
}


_MCP_SERVERS_DESCRIPTION = (
    "Code mode: upstream MCP servers code in this session may call through "
    '`import mcp_tools`, each a name ("time": all its tools, the default '
    "policy) or {name, allow?: [glob], deny?: [glob], readOnly?: bool, "
    "callsPerExecution?: int, callsPerMinute?: int}; names are the gateway's "
    "configured servers. None: no upstream server."
)
_ALLOW_DESCRIPTION = (
    "Hosts the kernel may reach through the gateway's egress proxy (pip, requests, curl "
    "use it unasked), each {host: 'pypi.org' or '*.example.com', ports?: [443], "
    "methods?: [...], paths?: ['/v1/']}, within what this gateway lets clients choose; "
    "anything else gets a 403 naming why. None: no network at all."
)


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


class SessionTools:
    """The session tools of one server, and what every tool uses: `transport` says how a
    caller is identified."""

    def __init__(
        self, service: SessionService, gateway: Gateway, *, transport: Literal["stdio", "http"]
    ) -> None:
        self.service = service
        self.gateway = gateway
        self.transport = transport
        self.stdio_client = stdio_client()

    def register(self, server: MCPServer) -> None:
        """Add every tool to the server, in the order they are defined: these, then
        those of Tools (tools.py)."""
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
            Field(description=_MCP_SERVERS_DESCRIPTION),
        ] = None,
        allow: Annotated[
            Any,
            WithJsonSchema(_ALLOW_SCHEMA),
            Field(description=_ALLOW_DESCRIPTION),
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
                allow=allow,
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
    async def fork_session(
        self,
        ctx: Context,
        session_id: str,
        count: Annotated[
            int,
            Field(description=f"How many copies, 1 to {forks.FORK_MAX}.", ge=1, le=forks.FORK_MAX),
        ] = 1,
        env: Annotated[
            dict[str, str] | None,
            Field(
                description=(
                    "Environment variables for the copies, in place of the ones this session "
                    "was created with; omit to keep those."
                )
            ),
        ] = None,
    ) -> Forked:
        """Copy a live session: each copy starts with its variables, imports, open files and
        /workspace and /tmp files (a snapshot of its kernel's memory), then goes its own way,
        to try several approaches from one state. Code running in the session is waited for.

        Returns the copies' session_ids; restored false means a copy could not be made
        from the snapshot and started with a fresh kernel (message says why), and phase
        Failed one that could not start at all (it is deleted). Only sessions you created
        can be forked. Each copy is a session of yours (it counts against your quota) with
        its own kernel and key; values the code copied from the original's environment
        stay in its variables."""
        client = self._client_of(ctx)
        parent = await self.service.resolve(client, session_id)
        async with self.gateway.held(parent.name, namespace=parent.namespace) as parent:
            made = await self.service.fork(client, parent, count, env)
        for child in made:
            if child.status.get("phase") == st.READY:
                self.gateway.prepare(child)  # its first call finds it connected
        return Forked(
            session_id=parent.name,
            forks=[
                ForkedSession(
                    session_id=child.name,
                    phase=str(child.status.get("phase")),
                    restored=(child.status.get("lastRestore") or {}).get("outcome") == "Restored",
                    message=str(child.status.get("message") or ""),
                )
                for child in made
            ],
        )
