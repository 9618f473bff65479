"""Prometheus metrics of the gateway and the operator, served on a port of their own
(`--metrics [HOST:]PORT`, loopback unless a host is given) by prometheus-client.

Every metric is defined here, once, so both processes and the docs agree on names.
Each process registers only what it updates; counters and histograms are cheap enough
for every call (a lock and an add); gauges of sessions and pools are set by the
housekeeping pass that reads them anyway. Label values are bounded sets (statuses,
phases, tool names, configured server names, pool names), never user input.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from mcp_forge.errors import InvalidRequest

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


class MetricsServer:
    """The /metrics endpoint (any path answers), in a thread of its own."""

    def __init__(self, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host)
        except OSError as exc:
            raise InvalidRequest(
                f"cannot serve metrics at {host}:{port}: {exc.strerror or exc}"
            ) from exc
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.port = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
