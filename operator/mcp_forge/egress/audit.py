"""The egress proxy's verdicts in the gateway: counted in its metrics and, while a call
runs in the session, added to that call's trace as events.

The proxy writes one JSON record a verdict (server.py: `audit`); the gateway's side
(client.py) hands each here. A record names the session, never a credential or a value
added on the way out. Metrics carry only bounded labels (what was asked, the verdict);
the host, port and reason go to the trace event and the log.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from mcp_forge import metrics, tracing

EVENTS = frozenset(("connect", "request", "tls", "dial", "limit", "unknown", "closed"))
_running: dict[str, list[tracing.Context]] = {}  # session "ns/name": its calls' contexts
_waiting: list[asyncio.Future[None]] = []  # next(): told of the next record


@contextlib.contextmanager
def executing(session: str) -> Iterator[None]:
    """While a call runs in `session`: its verdicts join the current span."""
    contexts = _running.setdefault(session, [])
    contexts.append(tracing.current())
    try:
        yield
    finally:
        contexts.pop()
        if not contexts:
            _running.pop(session, None)


def record(entry: dict[str, Any]) -> None:
    """One verdict of the proxy: counted, and an event of the session's running call."""
    event = entry.get("event")
    kind = event if isinstance(event, str) and event in EVENTS else "other"
    allowed = entry.get("allowed")
    verdict = "allowed" if allowed is True else "refused" if allowed is False else "none"
    metrics.EGRESS.labels(kind, verdict).inc()
    for direction in ("out", "in"):
        moved = entry.get(f"bytes_{direction}")
        if kind == "closed" and isinstance(moved, int) and moved > 0:
            metrics.EGRESS_BYTES.labels(direction).inc(moved)
    for waiter in _waiting:
        if not waiter.done():
            waiter.set_result(None)
    _waiting.clear()
    session = entry.get("session")
    contexts = _running.get(session) if isinstance(session, str) else None
    if not contexts:
        return
    attributes = {
        f"mcpforge.egress.{k}": v
        for k, v in entry.items()
        if k
        in (
            "host",
            "port",
            "allowed",
            "reason",
            "method",
            "path",
            "added",
            "bytes_out",
            "bytes_in",
            "seconds",
        )
        and isinstance(v, str | int | bool)
    }
    tracing.add_event(contexts[-1], f"egress {kind}", attributes)


def next_record() -> asyncio.Future[None]:
    """A future done at the next record (for tests and tools that wait on verdicts)."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _waiting.append(waiter)
    return waiter
