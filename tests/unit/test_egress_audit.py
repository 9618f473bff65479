"""The egress proxy's verdicts in the gateway (egress/audit.py): counted by bounded labels,
and events of the session's running call, never of another session's."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from mcp_forge.egress import audit


def count(event: str, verdict: str) -> float:
    labels = {"event": event, "verdict": verdict}
    return REGISTRY.get_sample_value("mcpforge_egress_total", labels) or 0.0


def test_verdicts_are_counted_by_bounded_labels() -> None:
    before = count("connect", "refused"), count("other", "none")
    audit.record({"event": "connect", "session": "ns/a", "allowed": False, "host": "x.test"})
    audit.record({"event": "made-up-by-someone", "session": "ns/a"})
    assert (count("connect", "refused"), count("other", "none")) == (before[0] + 1, before[1] + 1)


def test_a_verdict_is_an_event_of_its_sessions_running_call_only() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    refusal = {
        "event": "connect", "session": "ns/a", "host": "other.test", "port": 443,
        "allowed": False, "reason": "refused: no rule allows other.test on port 443",
        "token": "never-an-attribute",
    }  # fmt: skip
    with tracer.start_as_current_span("kernel execute a"), audit.executing("ns/a"):
        audit.record(refusal)
        audit.record({**refusal, "session": "ns/b"})  # b runs nothing: no event anywhere
    audit.record(refusal)  # a's call ended: no event
    (span,) = exporter.get_finished_spans()
    (event,) = span.events
    assert event.name == "egress connect"
    assert dict(event.attributes or {}) == {
        "mcpforge.egress.host": "other.test",
        "mcpforge.egress.port": 443,
        "mcpforge.egress.allowed": False,
        "mcpforge.egress.reason": "refused: no rule allows other.test on port 443",
    }
