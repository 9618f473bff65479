"""Prometheus metrics of the gateway and the operator, served on a port of their own
(`--metrics [HOST:]PORT`, loopback unless a host is given): prometheus-client's text,
by a small asyncio server (MetricsEndpoint) with deadlines and a connection cap, so a
scraper, or anyone who reaches the port, holds no thread and no unbounded memory.

Every metric is defined here, once, so both processes and the docs agree on names.
Each process registers only what it updates; counters and histograms are cheap enough
for every call (a lock and an add); gauges of sessions and pools are set by the
housekeeping pass that reads them anyway. Label values are bounded sets (statuses,
phases, tool names, configured server names, pool names), never user input.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from mcp_forge.errors import InvalidRequest

# The endpoint: what a scraper may hold of it (MetricsEndpoint).
HEADER_DEADLINE = 5.0  # seconds to send a whole request head
WRITE_DEADLINE = 10.0  # seconds to read the answer
REQUEST_MAX = 8192  # bytes of a request head
CONNECTIONS_MAX = 64  # open at once (MetricsEndpoint: who is closed past it)
RENDER_EVERY = 1.0  # seconds: scrapes within one of the last render get that text
PATHS = (b"/metrics", b"/")
CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

# Seconds: a kernel round trip is milliseconds, a cell may run an hour.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)

# ---- the gateway ------------------------------------------------------------------------

EXECUTIONS = Counter(
    "mcpforge_executions", "Code executions, by how they ended.", ["status"]
)  # ok, error, timeout, interrupted, died
EXECUTION_SECONDS = Histogram(
    "mcpforge_execution_seconds", "Time a kernel took to run a cell.", buckets=_LATENCY
)
TOOL_CALLS = Counter(
    "mcpforge_tool_calls", "MCP tool calls, by tool and outcome.", ["tool", "outcome"]
)
TOOL_SECONDS = Histogram(
    "mcpforge_tool_call_seconds",
    "MCP tool call latency in the gateway.",
    ["tool"],
    buckets=_LATENCY,
)
KERNEL_RESTARTS = Counter(
    "mcpforge_kernel_restarts", "Kernels restarted after a death, by reason.", ["reason"]
)  # died, oom, timeout, replaced
SESSIONS = Gauge("mcpforge_sessions", "Sessions the gateway sees, by phase.", ["phase"])
POOL_KERNELS = Gauge(
    "mcpforge_pool_kernels", "Kernels of a pool, by state.", ["pool", "state"]
)  # ready, starting, claimed
BRIDGE_CALLS = Counter(
    "mcpforge_bridge_calls",
    "Code mode: upstream tool calls made by kernel code, by server and outcome.",
    ["server", "status"],
)  # ok, error, refused

EGRESS = Counter(
    "mcpforge_egress",
    "Egress proxy verdicts, by what was asked and the verdict.",
    ["event", "verdict"],
)  # connect, request, tls, dial, limit, unknown, other; allowed, refused, none

EGRESS_BYTES = Counter(
    "mcpforge_egress_bytes",
    "Bytes through the egress proxy's session sockets, by direction (out: from kernels).",
    ["direction"],
)

# ---- the operator -----------------------------------------------------------------------

RECONCILE_SECONDS = Histogram(
    "mcpforge_reconcile_seconds", "Time one reconcile took, by kind.", ["kind"], buckets=_LATENCY
)
RECONCILE_ERRORS = Counter(
    "mcpforge_reconcile_errors", "Reconciles that raised (and are retried), by kind.", ["kind"]
)

PHASES = ("Pending", "Starting", "Ready", "Restarting", "Suspended", "Failed")


def set_sessions(phases: Iterator[str] | list[str]) -> None:
    """The sessions gauge from the phases of every session seen now."""
    counts = dict.fromkeys(PHASES, 0)
    for phase in phases:
        counts[phase] = counts.get(phase, 0) + 1
    for phase, n in counts.items():
        SESSIONS.labels(phase=phase).set(n)


@contextmanager
def timed(histogram: Histogram, errors: Counter | None = None, **labels: str) -> Iterator[None]:
    """Observe the block's duration (labelled); count it in `errors` if it raises."""
    metric = histogram.labels(**labels) if labels else histogram
    with metric.time():
        try:
            yield
        except BaseException:
            if errors is not None:
                errors.labels(**labels).inc()
            raise


class MetricsEndpoint:
    """GET /metrics, served by asyncio on the loop that starts it: no thread per
    connection. A client has HEADER_DEADLINE to send its request (at most REQUEST_MAX
    bytes) and WRITE_DEADLINE to read the answer. At most CONNECTIONS_MAX are open: past
    it, the oldest still sending its request is closed to make room (none: the new one
    is closed at once). Every answer closes its connection (HTTP/1.0)."""

    def __init__(
        self, registry: CollectorRegistry, header_deadline: float, connections_max: int
    ) -> None:
        """Use `start`."""
        self._registry = registry
        self._header_deadline = header_deadline
        self._connections_max = connections_max
        self._open: set[asyncio.Task[None]] = set()
        # Connections still sending their request, oldest first: the first to go when
        # the cap is reached, so that a scraper's request is answered while a client
        # that holds connections half-sent loses them.
        self._waiting: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self._rendered: tuple[float, bytes] | None = None  # (when, text)
        self.renders = 0
        self.port = 0

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        *,
        registry: CollectorRegistry = REGISTRY,
        header_deadline: float = HEADER_DEADLINE,
        connections_max: int = CONNECTIONS_MAX,
    ) -> MetricsEndpoint:
        """Listen at host:port (port 0: any free one, then `port`); InvalidRequest if it
        cannot (a port in use)."""
        endpoint = cls(registry, header_deadline, connections_max)
        try:
            server = await asyncio.start_server(endpoint._connection, host, port, limit=REQUEST_MAX)
        except OSError as exc:
            raise InvalidRequest(
                f"cannot serve metrics at {host}:{port}: {exc.strerror or exc}"
            ) from exc
        endpoint._server = server
        endpoint.port = server.sockets[0].getsockname()[1]
        return endpoint

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._open):
            task.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WRITE_DEADLINE):
                await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None and len(self._open) >= self._connections_max and self._waiting:
            oldest = next(iter(self._waiting))
            self._open.discard(oldest)
            self._waiting.pop(oldest).transport.abort()
        if task is None or len(self._open) >= self._connections_max:
            writer.transport.abort()  # every one open is being answered: no room
            return
        self._open.add(task)
        self._waiting[task] = writer
        try:
            async with asyncio.timeout(self._header_deadline):
                head = await reader.readuntil(b"\r\n\r\n")
            del self._waiting[task]
            writer.write(self._answer(head))
            writer.close()  # once what is buffered is sent
            async with asyncio.timeout(WRITE_DEADLINE):
                await writer.wait_closed()
        except (
            TimeoutError,
            ValueError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,  # not a ValueError
        ):
            pass  # too slow, too long, or gone: closed below
        finally:
            self._open.discard(task)
            self._waiting.pop(task, None)
            writer.transport.abort()  # at once, if it is not closed yet

    def _answer(self, head: bytes) -> bytes:
        """The whole HTTP response to a request's head."""
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(b"405 Method Not Allowed", b"GET /metrics only\n", b"text/plain")
        if path not in PATHS:
            return _response(b"404 Not Found", b"GET /metrics only\n", b"text/plain")
        body = self._render()
        return _response(b"200 OK", body if method == b"GET" else b"", CONTENT_TYPE, len(body))

    def _render(self) -> bytes:
        """The registry's text, rendered at most once per RENDER_EVERY: rendering is the
        one cost a scrape puts on the loop, so a flood of scrapes costs writes only."""
        now = time.monotonic()
        if self._rendered is None or now - self._rendered[0] >= RENDER_EVERY:
            self._rendered = (now, generate_latest(self._registry))
            self.renders += 1
        return self._rendered[1]


def _response(status: bytes, body: bytes, kind: bytes, length: int | None = None) -> bytes:
    head = (
        b"HTTP/1.0 " + status + b"\r\nContent-Type: " + kind
        + b"\r\nContent-Length: " + str(len(body) if length is None else length).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )  # fmt: skip
    return head + body


class MetricsServer:
    """A MetricsEndpoint on a thread of its own running its own loop: for a process
    whose loop is not at hand where metrics start (the operator: kopf.run makes its
    loop). One thread, however many connections."""

    def __init__(self, host: str, port: int, **options: Any) -> None:
        """Listen at host:port (InvalidRequest if it cannot); `options` as for
        MetricsEndpoint.start."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metrics", daemon=True)
        self._thread.start()
        started = MetricsEndpoint.start(host, port, **options)
        try:
            self._endpoint = asyncio.run_coroutine_threadsafe(started, self._loop).result()
        except BaseException:
            self._stop()
            raise
        self.port = self._endpoint.port

    def close(self) -> None:
        closing = asyncio.run_coroutine_threadsafe(self._endpoint.close(), self._loop)
        with contextlib.suppress(TimeoutError):
            closing.result(WRITE_DEADLINE + 1)
        self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
