"""What a client hears while its code runs: progress at least once a second (clients
reset their request timeout on it, so a long cell is not given up on) and the code's
output as log messages, gathered into one message per stream per interval at most and
bounded per call. A client that cannot be told never costs the call its result."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from mcp.server.mcpserver import Context

log = logging.getLogger(__name__)

NOTIFY_INTERVAL = 0.2  # seconds between batches of log notifications, at least
LOG_FORWARD_MAX = 100_000  # characters of stream output sent as log messages per call


class _Informer:
    """One call's notifications: output gathered by on_stream, sent by run(), which starts
    with the first output or when the first progress is due, whichever comes first (most
    calls end before either, and then cost no task)."""

    def __init__(self, ctx: Context, total: float) -> None:
        self.ctx = ctx
        self.total = total
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
                for stream in ("stdout", "stderr"):
                    text = "".join(t for n, t in batch if n == stream)
                    if text:
                        await self.ctx.log("info", text, logger_name=stream)
                now = time.monotonic()
                if now - last_progress >= 1:
                    last_progress = now
                    elapsed = now - started
                    await self.ctx.report_progress(
                        elapsed, self.total, f"running for {elapsed:.0f}s"
                    )
            except Exception as exc:  # the adapter's edge: never lose the result
                log.warning("could not notify the client: %s", exc)
                return
            # Rate limit (not a wait for an event): at most one batch per interval.
            await asyncio.sleep(NOTIFY_INTERVAL)


@contextlib.asynccontextmanager
async def keeping_informed(ctx: Context, total: float) -> AsyncIterator[Callable[[str, str], None]]:
    """Notify the client of ctx until the block ends; yields the `on_stream(name, text)`
    callback to hand to the gateway. `total` is the call's timeout, the progress total."""
    informer = _Informer(ctx, total)
    try:
        yield informer.on_stream
    finally:
        await informer.stop()
