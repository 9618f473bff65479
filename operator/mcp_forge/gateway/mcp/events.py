"""Resumable HTTP streams: what the gateway sent on a client's SSE streams, kept a while
so that a client whose connection dropped reconnects with `Last-Event-ID` and gets what
it missed (a cell's output, its result), and nothing else.

The SDK's transport (mcp 2.3) stores each message it sends, and a priming event at the
start of each stream, in one `EventStore` for all MCP sessions, naming only the stream
(a request's id, which every session reuses); its replay is asked for an event id alone.
So that one session can never be replayed another's events, each event is bound here to
the MCP session whose request or server task stored it (`Origin`, through a context
variable that `Resumable` sets for every HTTP request: a session's server task inherits
the one of the request that opened it), and a replay is given only events of the
requesting session, of the stream the named event was on, after it. Event ids are
random, so one cannot be guessed either.

Bounded: each session keeps its latest EVENTS_PER_SESSION events and SESSION_BYTES of
messages, all sessions together TOTAL_BYTES; an event is forgotten KEEP seconds after
it was stored. Kept in the gateway's memory: a client resumes on the replica it was
talking to, and a gateway's restart forgets them (the session's kernel keeps its state).
"""

from __future__ import annotations

import contextvars
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCError, JSONRPCMessage

EVENTS_PER_SESSION = 2000
SESSION_BYTES = 8 * 1024 * 1024
TOTAL_BYTES = 128 * 1024 * 1024
KEEP = 600.0  # seconds an event can be replayed
REQUEST_CANCELLED = -32800  # the SDK's answer to a cancelled request: never replayed (wire.py)
SESSION_HEADER = b"mcp-session-id"


@dataclass(eq=False)
class Origin:
    """The MCP session an HTTP request belongs to: its header's, or, for the request that
    opens one, the id its response gives (filled in by `Resumable` when it is sent).
    What is stored before a session has an id (the opening request's own stream) is not
    kept: nothing resumes it."""

    session: str | None


ORIGIN: contextvars.ContextVar[Origin | None] = contextvars.ContextVar(
    "mcp_forge_http_origin", default=None
)


@dataclass
class _Event:
    session: str
    stream: StreamId
    message: JSONRPCMessage | None
    size: int
    at: float


@dataclass
class _Session:
    events: deque[str] = field(default_factory=deque)  # its events' ids, oldest first
    size: int = 0  # bytes of their messages


class SessionEvents(EventStore):
    """The event store of the module docstring."""

    def __init__(
        self,
        *,
        per_session: int = EVENTS_PER_SESSION,
        session_bytes: int = SESSION_BYTES,
        total_bytes: int = TOTAL_BYTES,
        keep: float = KEEP,
    ) -> None:
        self.per_session = per_session
        self.session_bytes = session_bytes
        self.total_bytes = total_bytes
        self.keep = keep
        self._events: OrderedDict[str, _Event] = OrderedDict()  # oldest first
        self._sessions: dict[str, _Session] = {}
        self._size = 0

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = secrets.token_urlsafe(16)
        origin = ORIGIN.get()
        if origin is None or origin.session is None:  # see Origin: not replayable
            return event_id
        size = 0 if message is None else len(message.model_dump_json(exclude_none=True))
        now = time.monotonic()
        self._forget_before(now - self.keep)
        self._events[event_id] = _Event(origin.session, stream_id, message, size, now)
        mine = self._sessions.setdefault(origin.session, _Session())
        mine.events.append(event_id)
        mine.size += size
        self._size += size
        while len(mine.events) > self.per_session or mine.size > self.session_bytes:
            self._forget(mine.events[0])
        while self._events and self._size > self.total_bytes:
            self._forget(next(iter(self._events)))
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        self._forget_before(time.monotonic() - self.keep)
        asking = ORIGIN.get()
        last = self._events.get(last_event_id)
        if last is None or asking is None or last.session != asking.session:
            return None  # unknown, forgotten, or another session's: all alike
        ids = list(self._sessions[last.session].events)
        for event_id in ids[ids.index(last_event_id) + 1 :]:
            event = self._events.get(event_id)
            if event is None or event.stream != last.stream or event.message is None:
                continue
            if not _cancelled(event.message):
                await send_callback(EventMessage(event.message, event_id))
        return last.stream

    def count(self) -> int:
        """Events kept now. (Not __len__: the SDK tests the store for truth.)"""
        return len(self._events)

    def _forget_before(self, oldest: float) -> None:
        while self._events:
            event_id, event = next(iter(self._events.items()))
            if event.at >= oldest:
                return
            self._forget(event_id)

    def _forget(self, event_id: str) -> None:
        event = self._events.pop(event_id, None)
        if event is None:
            return
        self._size -= event.size
        mine = self._sessions[event.session]
        mine.size -= event.size
        if mine.events and mine.events[0] == event_id:
            mine.events.popleft()
        else:
            mine.events.remove(event_id)
        if not mine.events:
            del self._sessions[event.session]


def _cancelled(message: JSONRPCMessage) -> bool:
    return isinstance(message, JSONRPCError) and message.error.code == REQUEST_CANCELLED


class Resumable:
    """ASGI middleware in front of the SDK's app: each HTTP request runs with its Origin
    (ORIGIN), so that the events it stores, and those of the session it opens, are bound
    to that MCP session."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(SESSION_HEADER)
        origin = Origin(header.decode("latin-1") if header else None)

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and origin.session is None:
                given = dict(message.get("headers") or []).get(SESSION_HEADER)
                if given:
                    origin.session = given.decode("latin-1")
            await send(message)

        token = ORIGIN.set(origin)
        try:
            await self.app(scope, receive, sending)
        finally:
            ORIGIN.reset(token)
