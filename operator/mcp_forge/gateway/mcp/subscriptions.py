"""Resource subscriptions (the handshake versions' `resources/subscribe` and
`resources/unsubscribe`): a client that subscribes to a session's file or notebook
(resources.py) is sent `notifications/resources/updated` when it changed.

Noticed without polling the kernel: a session's files change through the code run in it
and the tools that write to it, so when a tools/call on a session ends (the low-level
handler is wrapped, as tasks.py does) the files subscribed to in that session are read
again, through the same read and checks as resources/read, and compared with what was
read before (a digest); the notebook changes with every execute_code. A change made by a
thread the kernel left running is noticed at the session's next call. Subscribing reads
the file once (a path outside /workspace, or another client's session, is -32602 then);
a file that does not exist yet may be subscribed to.

Bounded: SUBSCRIPTIONS_PER_CONNECTION per connection (more are refused) and
SUBSCRIPTIONS_PER_CLIENT per client (its oldest goes: a connection that went away keeps
its subscriptions until then, or until a notification cannot reach it).

2026-07-28 has `subscriptions/listen` instead: a request whose response stream is the
subscription. Its resource URIs go through the same checks and bounds as a subscribe
(those refused are left out of the acknowledgement, which says what is honored), the
same notice of changes feeds it, and its subscriptions end with its stream (the client
closing it, or a backlog of STREAM_BUFFER unread notifications). Other kinds (list
changes) are never honored: the gateway sends none, and declares none.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from mcp import MCPError
from mcp.server.mcpserver import MCPServer
from mcp.shared.subscriptions import SUBSCRIPTION_ID_META_KEY
from mcp_types import (
    CallToolResult,
    EmptyResult,
    ResourceUpdatedNotification,
    ResourceUpdatedNotificationParams,
    SubscribeRequestParams,
    SubscriptionsAcknowledgedNotification,
    SubscriptionsAcknowledgedNotificationParams,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
    UnsubscribeRequestParams,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp_forge.errors import ForgeError, InvalidRequest, SessionNotFound

if TYPE_CHECKING:
    from mcp_forge.gateway.mcp.tools import Tools

log = logging.getLogger(__name__)

SUBSCRIPTIONS_PER_CONNECTION = 32
SUBSCRIPTIONS_PER_CLIENT = 128  # past it, the client's oldest subscription goes
STREAMS_PER_CLIENT = 8  # subscriptions/listen streams open at once
STREAM_BUFFER = 256  # notifications a listen stream holds unread before it is ended
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
_FILE = re.compile(r"forge://sessions/([^/]{1,253})/files/(.{1,4096})", re.DOTALL)
_NOTEBOOK = re.compile(r"forge://sessions/([^/]{1,253})/notebook")
NOTEBOOK = "notebook"  # the digest of a notebook: it changes with every execute_code


@dataclass
class _Subscriber:
    deliver: Callable[[str], Awaitable[None]]  # how a change of a URI reaches it
    owner: str  # its client
    seq: int


@dataclass
class _Watched:
    """One resource some connections subscribed to, and what it was when last read."""

    path: str | None  # a workspace file, or None: the notebook
    digest: str | None = None  # None: no such file
    subscribers: dict[int, _Subscriber] = field(default_factory=dict)  # by connection


class Subscriptions:
    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self._watched: dict[tuple[str, str], dict[str, _Watched]] = {}  # session -> uri -> it
        self._checks: set[asyncio.Task[None]] = set()
        self._seq = 0  # the order subscriptions were made in
        self._streams: dict[str, int] = {}  # listen streams open, per client
        self._stream_ids = itertools.count(-1, -1)  # a listen stream's key: never an id()

    def register(self, server: MCPServer) -> None:
        lowlevel = server._lowlevel_server
        call = lowlevel._request_handlers["tools/call"]

        async def call_tool(ctx: Any, params: Any) -> Any:
            result = await call.handler(ctx, params)
            self._after(params.name, result)
            return result

        lowlevel.add_request_handler("tools/call", call.params_type, call_tool)
        lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, self._subscribe)
        lowlevel.add_request_handler(
            "resources/unsubscribe", UnsubscribeRequestParams, self._unsubscribe
        )
        lowlevel.add_request_handler(
            "subscriptions/listen", SubscriptionsListenRequestParams, self._listen
        )
        declared = lowlevel.get_capabilities

        def get_capabilities(*args: Any, protocol_version: str | None = None, **kw: Any) -> Any:
            """Listen served, the SDK declares every kind of change on 2026-07-28; the
            gateway sends resource updates only."""
            capabilities = declared(*args, protocol_version=protocol_version, **kw)
            if protocol_version in MODERN_PROTOCOL_VERSIONS:
                for kind in (capabilities.tools, capabilities.resources, capabilities.prompts):
                    if kind is not None:
                        kind.list_changed = None
            return capabilities

        lowlevel.get_capabilities = get_capabilities  # type: ignore[method-assign]

    def _all(self) -> list[tuple[tuple[str, str], str, int, _Subscriber]]:
        return [
            (key, uri, connection, sub)
            for key, uris in self._watched.items()
            for uri, w in uris.items()
            for connection, sub in w.subscribers.items()
        ]

    async def _subscribe(self, ctx: Any, params: SubscribeRequestParams) -> EmptyResult:
        client = self.tools._client_from(getattr(ctx.request, "headers", None))
        session = ctx.session
        await self._watch(client, str(params.uri), _connection(ctx), session.send_resource_updated)
        return EmptyResult()

    async def _listen(
        self, ctx: Any, params: SubscriptionsListenRequestParams
    ) -> SubscriptionsListenResult:
        """One subscriptions/listen stream, open until its client closes it."""
        if ctx.request_id is None:
            raise MCPError(INVALID_PARAMS, "subscriptions/listen needs a request id")
        client = self.tools._client_from(getattr(ctx.request, "headers", None))
        if self._streams.get(client.owner, 0) >= STREAMS_PER_CLIENT:
            raise MCPError(INVALID_PARAMS, f"at most {STREAMS_PER_CLIENT} listen streams at once")
        meta = {SUBSCRIPTION_ID_META_KEY: ctx.request_id}
        stream = next(self._stream_ids)
        send, recv = anyio.create_memory_object_stream[str](STREAM_BUFFER)

        async def push(uri: str) -> None:  # raises when unread too long: the stream ends
            try:
                send.send_nowait(uri)
            except anyio.WouldBlock:
                send.close()
                raise

        self._streams[client.owner] = self._streams.get(client.owner, 0) + 1
        try:
            honored = []
            for uri in (params.notifications.resource_subscriptions or [])[
                :SUBSCRIPTIONS_PER_CONNECTION
            ]:
                try:
                    await self._watch(client, uri, stream, push)
                except MCPError as exc:  # not honored: the acknowledgement leaves it out
                    log.info("listen: not %s: %s", uri[:200], exc.error.message)
                    continue
                honored.append(uri)
            ack = {"notifications": {"resourceSubscriptions": honored}, "_meta": meta}
            await ctx.session.send_notification(
                SubscriptionsAcknowledgedNotification(
                    params=SubscriptionsAcknowledgedNotificationParams.model_validate(ack)
                ),
                related_request_id=ctx.request_id,
            )
            async for uri in recv:
                updated = {"uri": uri, "_meta": meta}
                await ctx.session.send_notification(
                    ResourceUpdatedNotification(
                        params=ResourceUpdatedNotificationParams.model_validate(updated)
                    ),
                    related_request_id=ctx.request_id,
                )
        finally:
            self._streams[client.owner] -= 1
            if not self._streams[client.owner]:
                del self._streams[client.owner]
            self._unwatch(stream)
            send.close()
            recv.close()
        return SubscriptionsListenResult.model_validate({"_meta": meta})

    def _unwatch(self, connection: int) -> None:
        for key, uri, held, _ in self._all():
            if held == connection:
                self._watched[key][uri].subscribers.pop(connection, None)
                self._forget_unwatched(key, uri)

    async def _watch(
        self, client: Any, uri: str, connection: int, deliver: Callable[[str], Awaitable[None]]
    ) -> None:
        """Subscribe `connection` (a client connection, or a listen stream) to `uri`."""
        name, path = _parse(uri)
        try:
            session = await self.tools.service.resolve(client, name)
        except ForgeError as exc:
            raise _error(exc) from exc
        key = (session.namespace, session.name)
        held = self._all()
        if sum(1 for *_, c, _s in held if c == connection) >= SUBSCRIPTIONS_PER_CONNECTION:
            raise MCPError(INVALID_PARAMS, f"at most {SUBSCRIPTIONS_PER_CONNECTION} subscriptions")
        clients = sorted((s.seq, k, u, c) for k, u, c, s in held if s.owner == client.owner)
        if len(clients) >= SUBSCRIPTIONS_PER_CLIENT:  # its oldest goes: a gone connection's
            _, k, u, c = clients[0]
            self._watched[k][u].subscribers.pop(c, None)
            self._forget_unwatched(k, u)
        watched = self._watched.get(key, {}).get(uri)
        if watched is None:
            watched = _Watched(path, await self._digest(session.namespace, session.name, path))
            self._watched.setdefault(key, {})[uri] = watched
        self._seq += 1
        watched.subscribers[connection] = _Subscriber(deliver, client.owner, self._seq)

    async def _unsubscribe(self, ctx: Any, params: UnsubscribeRequestParams) -> EmptyResult:
        uri = str(params.uri)
        for key, uris in list(self._watched.items()):
            watched = uris.get(uri)
            if watched is not None:
                watched.subscribers.pop(_connection(ctx), None)
                self._forget_unwatched(key, uri)
        return EmptyResult()

    def _forget_unwatched(self, key: tuple[str, str], uri: str) -> None:
        uris = self._watched.get(key, {})
        if uri in uris and not uris[uri].subscribers:
            del uris[uri]
        if not uris:
            self._watched.pop(key, None)

    def _after(self, tool: str, result: Any) -> None:
        """A tools/call ended: its session's subscribed resources are looked at again."""
        if not self._watched or not isinstance(result, CallToolResult):
            return
        name = (result.structured_content or {}).get("session_id")
        key = (self.tools.service.namespace, str(name))
        if name and key in self._watched:  # for those subscribed when the call ended
            executed, upto = tool == "execute_code", self._seq
            check = asyncio.create_task(self._check(key, executed=executed, upto=upto))
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    async def _check(self, key: tuple[str, str], *, executed: bool, upto: int) -> None:
        changed = []
        for uri, watched in sorted(self._watched.get(key, {}).items()):
            if watched.path is None:
                if executed:
                    changed.append((uri, watched))
                continue
            try:
                digest = await self._digest(*key, watched.path)
            except MCPError as exc:  # busy, or gone: looked at again after the next call
                log.info("cannot look at %s now: %s", uri, exc.error.message)
                continue
            if digest != watched.digest:
                watched.digest = digest
                changed.append((uri, watched))
        for uri, watched in changed:  # in the order of their URIs
            for sid, sub in list(watched.subscribers.items()):
                if sub.seq > upto:
                    continue  # subscribed after that call ended
                try:
                    await sub.deliver(uri)
                except Exception as exc:  # that connection is gone: its subscription goes
                    log.info("dropping a subscription to %s: %s", uri, exc)
                    watched.subscribers.pop(sid, None)
            self._forget_unwatched(key, uri)

    async def _digest(self, namespace: str, name: str, path: str | None) -> str | None:
        if path is None:
            return NOTEBOOK
        try:
            data = await self.tools.gateway.read_file(name, path, namespace=namespace)
        except InvalidRequest as exc:
            if str(exc).startswith("FileNotFound"):  # not yet: its creation is a change
                return None
            raise _error(exc) from exc
        except ForgeError as exc:
            raise _error(exc) from exc
        return hashlib.sha256(data).hexdigest()


def _connection(ctx: Any) -> int:
    """The client connection a request came on. The SDK makes a ServerSession per
    request; the connection behind it (`_connection`, private) lasts as long as the
    client's MCP session: subscriptions are that connection's."""
    return id(getattr(ctx.session, "_connection", ctx.session))


def _parse(uri: str) -> tuple[str, str | None]:
    """(session, path in /workspace, or None for the notebook) of one of our URIs."""
    if found := _NOTEBOOK.fullmatch(uri):
        return found.group(1), None
    if found := _FILE.fullmatch(uri):
        return found.group(1), found.group(2)
    raise MCPError(INVALID_PARAMS, f"not a resource of this gateway: {uri[:200]!r}")


def _error(exc: ForgeError) -> MCPError:
    missing = isinstance(exc, (SessionNotFound, InvalidRequest))
    return MCPError(code=INVALID_PARAMS if missing else INTERNAL_ERROR, message=str(exc))
