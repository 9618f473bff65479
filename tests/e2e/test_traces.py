"""OpenTelemetry traces (issue 13): a real gateway exporting by OTLP/HTTP (its standard
OTEL_* variables) to a receiver this test runs on loopback; one MCP call is one trace,
from the SDK's server span through the kernel's execution to the bridged upstream call
its code makes, and the result's _meta names that trace."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from test_stdio import gateway, text

pytestmark = pytest.mark.podman

TRACE_ID_META = "mcpforge.dev/traceId"


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, by name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, str]] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                got = [
                    {
                        "name": span.name,
                        "trace": span.trace_id.hex(),
                        "id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(),
                    }
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                    for span in scope.spans
                ]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                with receiver.arrived:
                    receiver.spans += got
                    receiver.arrived.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def wait_for(self, trace: str, names: set[str], timeout: float) -> list[dict[str, str]]:
        """The spans of `trace`, once one of each name in `names` has arrived."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                mine = [s for s in self.spans if s["trace"] == trace]
                if names <= {s["name"] for s in mine}:
                    return mine
                left = deadline - time.monotonic()
                assert left > 0, f"spans of {trace}: {sorted(s['name'] for s in mine)}"
                self.arrived.wait(left)


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


async def test_one_trace_from_the_mcp_call_through_the_kernel_to_the_upstream_tool(
    state_dir: Path, tmp_path: Path
) -> None:
    from mcp_servers.config import upstream_config

    config = tmp_path / "mcp.json"
    config.write_text(json.dumps(upstream_config(tmp_path)))
    with receiving() as receiver:
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        saved = {k: os.environ.get(k) for k in otel}
        os.environ.update(otel)  # the gateway subprocess's environment
        try:
            async with gateway(state_dir, args=("--mcp-config", str(config))) as c:
                made = await c.call_tool(
                    "create_session", {"variant": "minimal", "mcp_servers": ["edge"]}
                )
                assert not made.is_error, text(made)
                sid = made.structured_content["session_id"]
                ran = await c.call_tool(
                    "execute_code",
                    {"session_id": sid, "code": "import mcp_tools\nmcp_tools.edge.add(a=40)"},
                )
                assert not ran.is_error and "42" in text(ran), text(ran)
                assert ran.meta is not None, "no _meta in the result"
                trace = ran.meta[TRACE_ID_META]
                names = {
                    "tools/call execute_code",
                    "kernel execute",
                    "bridge edge.add",
                    "MCP send tools/call add",
                }
                spans = await asyncio.to_thread(receiver.wait_for, trace, names, 30)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    by_name = {s["name"]: s for s in spans}
    chain = ["tools/call execute_code", "kernel execute", "bridge edge.add"]
    for parent, child in zip(chain, [*chain[1:], "MCP send tools/call add"], strict=True):
        assert by_name[child]["parent"] == by_name[parent]["id"], (child, parent, spans)


async def test_without_otel_variables_results_carry_no_trace(state_dir: Path) -> None:
    async with gateway(state_dir) as c:
        r = await c.call_tool("execute_code", {"code": "1"})
        assert not r.is_error, text(r)
        assert TRACE_ID_META not in (r.meta or {})
