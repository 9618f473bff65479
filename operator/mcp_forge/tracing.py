"""OpenTelemetry traces of the gateway: one trace per MCP call, through the kernel's
execution, to each upstream tool call its code makes through the bridge.

The MCP SDK opens the call's server span (continuing a client's `traceparent` from the
request's `_meta`) and a client span for each request we send upstream (injecting
ours). Between them we add the execution's span, and each bridged call's span, which
runs in the bridge's own task and so is parented explicitly on the execution's context.

Off unless the standard variables ask for an exporter (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_TRACES_EXPORTER=otlp; OTEL_SDK_DISABLED=true
wins): then spans go by OTLP over HTTP, batched, configured by the other OTEL_*
variables (headers, timeout, OTEL_SERVICE_NAME, OTEL_BSP_*). Off, every span here is
the API's no-op and costs next to nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

log = logging.getLogger(__name__)

_tracer = trace.get_tracer("mcp-forge")
TRACE_ID_META = "mcpforge.dev/traceId"  # in a tool result's _meta: the call's trace
SERVICE = "mcp-forge-gateway"

Context = otel_context.Context


def wanted() -> bool:
    """Do the OTEL_* variables ask for traces?"""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return exporter == "otlp" or any(os.environ.get(v) for v in endpoints)


class Tracing:
    """The process's tracer provider while it runs, if traces are wanted; `close` sends
    what is still batched."""

    def __init__(self) -> None:
        self._provider: Any = None
        if not wanted():
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME") or SERVICE
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        self._provider = provider

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def close(self) -> None:
        if self._provider is not None:
            try:
                self._provider.shutdown()
            except Exception as exc:  # an exporter's failure never fails the gateway
                log.warning("traces: could not send the last spans: %s", exc)


@contextlib.contextmanager
def span(name: str, *, session: str, parent: Context | None = None) -> Iterator[Any]:
    """A span of `session` around the block, current within it (child of `parent` if
    given, else of the current span)."""
    attributes = {"mcpforge.session": session}
    with _tracer.start_as_current_span(name, context=parent, attributes=attributes) as s:
        yield s


def current() -> Context:
    """The context now: to parent spans made in another task on it."""
    return otel_context.get_current()


def trace_id() -> str | None:
    """The current trace's id (32 hex digits), if there is one."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def add_event(parent: Context, name: str, attributes: dict[str, Any]) -> None:
    """An event on the span current in `parent` (a call's, taken with `current`)."""
    trace.get_current_span(parent).add_event(name, attributes)
