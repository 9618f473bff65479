"""The event store of resumable HTTP streams (gateway/mcp/events.py): a replay gives the
requesting MCP session what came after the named event on that stream, nothing of
another session's, and the store stays within its bounds per session, in all and in time.
The same store behind the real gateway: tests/e2e/test_protocol.py."""

from __future__ import annotations

from typing import Any

import pytest
from mcp.server.streamable_http import EventMessage
from mcp_types import ErrorData, JSONRPCError, JSONRPCNotification

from mcp_forge.gateway.mcp import events
from mcp_forge.gateway.mcp.events import ORIGIN, Origin, SessionEvents


def note(text: str) -> JSONRPCNotification:
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/message", params={"data": text})


async def store(s: SessionEvents, session: str | None, stream: str, message: Any) -> str:
    token = ORIGIN.set(Origin(session))
    try:
        return await s.store_event(stream, message)
    finally:
        ORIGIN.reset(token)


async def replay(s: SessionEvents, session: str, last: str) -> tuple[str | None, list[Any]]:
    got: list[EventMessage] = []

    async def collect(event: EventMessage) -> None:
        got.append(event)

    token = ORIGIN.set(Origin(session))
    try:
        stream = await s.replay_events_after(last, collect)
    finally:
        ORIGIN.reset(token)
    return stream, [getattr(e.message, "params", {}).get("data") for e in got]


async def test_a_replay_is_what_came_after_on_that_stream_of_that_session_only() -> None:
    s = SessionEvents()
    prime = await store(s, "A", "7", None)
    await store(s, "A", "7", note("one"))
    await store(s, "A", "8", note("another call's"))
    await store(s, "B", "7", note("another session's"))
    cancelled = JSONRPCError(jsonrpc="2.0", id=7, error=ErrorData(code=-32800, message="x"))
    await store(s, "A", "7", cancelled)
    await store(s, "A", "7", note("two"))
    assert await replay(s, "A", prime) == ("7", ["one", "two"])
    assert await replay(s, "B", prime) == (None, [])  # as if it did not exist
    assert await replay(s, "A", "no-such-event") == (None, [])


async def test_what_a_session_stores_before_it_has_an_id_is_not_kept() -> None:
    s = SessionEvents()
    event_id = await store(s, None, "1", note("initialize's"))
    assert event_id and s.count() == 0
    assert await replay(s, "A", event_id) == (None, [])


async def test_each_session_keeps_its_latest_events_within_its_bounds() -> None:
    s = SessionEvents(per_session=3, session_bytes=10_000, total_bytes=1_000_000)
    ids = [await store(s, "A", "1", note(f"m{i}")) for i in range(5)]
    await store(s, "B", "1", note("b"))
    assert s.count() == 4  # A's latest three, and B's
    assert await replay(s, "A", ids[0]) == (None, [])  # forgotten
    assert await replay(s, "A", ids[2]) == ("1", ["m3", "m4"])
    big = SessionEvents(per_session=100, session_bytes=300, total_bytes=1_000_000)
    sizes = [len(note("x" * 100).model_dump_json(exclude_none=True))]
    for _ in range(5):
        await store(big, "A", "1", note("x" * 100))
    assert big.count() == 300 // sizes[0]


async def test_all_sessions_together_stay_within_the_total() -> None:
    s = SessionEvents(per_session=100, session_bytes=100_000, total_bytes=1_000)
    for i in range(50):
        await store(s, f"S{i % 5}", "1", note("y" * 50))
    size = len(note("y" * 50).model_dump_json(exclude_none=True))
    assert s.count() == 1_000 // size


async def test_an_event_is_forgotten_after_the_time_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: now[0])
    s = SessionEvents(keep=60.0)
    first = await store(s, "A", "1", note("old"))
    now[0] += 30
    await store(s, "A", "1", note("newer"))
    assert await replay(s, "A", first) == ("1", ["newer"])
    now[0] += 31  # the first is past its time; the second not
    assert await replay(s, "A", first) == (None, [])
    assert s.count() == 1
