"""What a client hears while its code runs: progress at least once a second (clients
reset their request timeout on it, so a long cell is not given up on) and the code's
output, gathered into one message per stream per interval at most and bounded per call.
A client that cannot be told never costs the call its result.

The output goes as the negotiated protocol version has it. Up to 2025-11-25 it is a log
message (`notifications/message`, level info, the stream as logger), unless the client
set a higher level with `logging/setLevel` (`set_level`). 2026-07-28 deprecates logging
(SEP-2577): a log message only if the request opts in with its `_meta` log level, else
the output rides the progress notifications as their message. Sent with the session's
plain `send_notification`: the SDK's `Context.log` warns of the deprecation on every
call, whatever the version."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, get_args

from mcp.server.connection import allowed_log_levels
from mcp.server.mcpserver import Context
from mcp_types import (
    EmptyResult,
    LoggingLevel,
    LoggingMessageNotification,
    LoggingMessageNotificationParams,
    SetLevelRequestParams,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

log = logging.getLogger(__name__)

NOTIFY_INTERVAL = 0.2  # seconds between batches of output notifications, at least
LOG_FORWARD_MAX = 100_000  # characters of stream output sent to the client per call
OUTPUT_LEVEL: LoggingLevel = "info"
_LEVELS: tuple[str, ...] = get_args(LoggingLevel)  # by severity, least first

LEVEL_KEY = "mcp_forge.log_level"  # in the connection's state: what logging/setLevel chose


def _connection_state(session: Any) -> dict[str, Any]:
    """The scratch state of the connection a request came on. The SDK makes a session
    object per request; the connection (private to it: `_connection`, whose `state` is
    documented as per-connection scratch space) lives as long as the client's MCP
    session."""
    state: dict[str, Any] = session._connection.state
    return state


async def set_level(ctx: Any, params: SetLevelRequestParams) -> EmptyResult:
    """logging/setLevel: the connection's clients hear log messages of that level and up."""
    _connection_state(ctx.session)[LEVEL_KEY] = params.level
    return EmptyResult()


def _as_log(ctx: Context) -> bool:
    """Whether output goes to this call's client as log messages (see the docstring).
    What the SDK keeps for it is read defensively: a change there costs a call its log
    messages (the output still rides the progress), never its result."""
    try:
        version = ctx.protocol_version or ""
        if version in MODERN_PROTOCOL_VERSIONS:
            meta: Any = ctx.request_context.meta
            return OUTPUT_LEVEL in allowed_log_levels(version, meta)
        chosen = str(_connection_state(ctx.request_context.session).get(LEVEL_KEY, "debug"))
        return _LEVELS.index(chosen) <= _LEVELS.index(OUTPUT_LEVEL)
    except (AttributeError, LookupError, TypeError, ValueError) as exc:
        log.warning("cannot tell how this client hears output (%r): progress only", exc)
        return False


class _Informer:
    """One call's notifications: output gathered by on_stream, sent by run(), which starts
    with the first output or when the first progress is due, whichever comes first (most
    calls end before either, and then cost no task)."""

    def __init__(self, ctx: Context, total: float) -> None:
        self.ctx = ctx
        self.total = total
        self.as_log = _as_log(ctx)
        self.pending: list[tuple[str, str]] = []
        self.arrived = asyncio.Event()
        self.forwarded = 0
        self.started = time.monotonic()
        self.task: asyncio.Task[None] | None = None
        self.timer = asyncio.get_running_loop().call_later(1, self._start)

    def _start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.run(self.started))

    def on_stream(self, name: str, text: str) -> None:
        if self.forwarded < LOG_FORWARD_MAX:
            piece = text[: LOG_FORWARD_MAX - self.forwarded]
            self.forwarded += len(piece)
            self.pending.append((name, piece))
            self.arrived.set()
            self._start()

    async def stop(self) -> None:
        self.timer.cancel()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def run(self, started: float) -> None:
        last_progress = started
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(last_progress + 1 - time.monotonic(), 0)):
                    await self.arrived.wait()
            self.arrived.clear()
            batch, self.pending[:] = list(self.pending), []
            try:
                said = []
                for stream in ("stdout", "stderr"):
                    text = "".join(t for n, t in batch if n == stream)
                    if text and self.as_log:
                        await self._log(stream, text)
                    elif text:
                        said.append(text)
                now = time.monotonic()
                if now - last_progress >= 1 or said:
                    last_progress = now
                    elapsed = now - started
                    message = "".join(said) or f"running for {elapsed:.0f}s"
                    await self.ctx.report_progress(elapsed, self.total, message)
            except Exception as exc:  # the adapter's edge: never lose the result
                log.warning("could not notify the client: %s", exc)
                return
            # Rate limit (not a wait for an event): at most one batch per interval.
            await asyncio.sleep(NOTIFY_INTERVAL)

    async def _log(self, stream: str, text: str) -> None:
        params = LoggingMessageNotificationParams(level=OUTPUT_LEVEL, data=text, logger=stream)
        await self.ctx.request_context.session.send_notification(
            LoggingMessageNotification(params=params),
            related_request_id=self.ctx.request_context.request_id,
        )


@contextlib.asynccontextmanager
async def keeping_informed(ctx: Context, total: float) -> AsyncIterator[Callable[[str, str], None]]:
    """Notify the client of ctx until the block ends; yields the `on_stream(name, text)`
    callback to hand to the gateway. `total` is the call's timeout, the progress total."""
    informer = _Informer(ctx, total)
    try:
        yield informer.on_stream
    finally:
        await informer.stop()
