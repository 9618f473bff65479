"""Benchmark: what metrics and traces cost an execute_code round trip.

    sudo .venv/bin/python tests/bench/bench_observe.py [--runs 200]

Three `mcp-forge gateway` processes over stdio, each with its own session (variant
minimal), run `1+1` in turn (each round starting with the next one), so that the
machine's load falls on all three alike:

  * off: no --metrics, no OTEL_* variables (the default);
  * metrics: `--metrics 127.0.0.1:0` (prometheus-client counters and histograms);
  * metrics + traces: the same, and OTEL_EXPORTER_OTLP_ENDPOINT set to an OTLP/HTTP
    receiver this script runs on loopback (every call's spans are exported, batched).

It prints medians and p90 of each, and each one's cost over "off" (ms and ratio).
The machines are shared and noisy: compare the ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")


class Receiver(http.server.ThreadingHTTPServer):
    """Accepts OTLP/HTTP exports (an empty reply is an empty ExportTraceServiceResponse)
    and counts their bytes, to show that spans arrived."""

    received = 0

    def __init__(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver.received += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


async def main(runs: int) -> None:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    base = {**os.environ, "MCPFORGE_POOL_SIZE": "0"}
    for var in [v for v in base if v.startswith("OTEL_")]:
        del base[var]
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
        "OTEL_SERVICE_NAME": "mcp-forge-bench",
    }
    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        "off": ([], {}),
        "metrics": (["--metrics", "127.0.0.1:0"], {}),
        "metrics + traces": (["--metrics", "127.0.0.1:0"], otel),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    async with AsyncExitStack() as stack:
        clients: dict[str, tuple[Client, str]] = {}
        for name, (args, extra) in variants.items():
            state = tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp")
            env = {**base, **extra, "MCPFORGE_STATE_DIR": state}
            params = StdioServerParameters(command=GATEWAY, args=["gateway", *args], env=env)
            client = await stack.enter_async_context(Client(params))
            made = await client.call_tool("create_session", {"variant": "minimal"})
            sid = made.structured_content["session_id"]
            clients[name] = (client, sid)
            for _ in range(10):  # warm: the connection made, the first spans exported
                await client.call_tool("execute_code", {"code": "1+1", "session_id": sid})
        names = list(clients)
        for i in range(runs):  # in turn, each round starting with the next one
            for name in names[i % 3 :] + names[: i % 3]:
                client, sid = clients[name]
                t = time.perf_counter()
                r = await client.call_tool("execute_code", {"code": "1+1", "session_id": sid})
                times[name].append(time.perf_counter() - t)
                assert not r.is_error, r
        for client, sid in clients.values():
            await client.call_tool("close_session", {"session_id": sid})
    receiver.shutdown()
    assert receiver.received > 0, "no spans reached the OTLP receiver"

    off, _ = stats(times["off"])
    print(f"{f'execute_code 1+1 over stdio, ms (n={runs})':40}{'median':>8}{'p90':>8}{'cost':>8}")
    for name, xs in times.items():
        m, p = stats(xs)
        print(f"{name:40}{m * 1000:>8.2f}{p * 1000:>8.2f}{(m - off) * 1000:>+7.2f} {m / off:.3f}x")
    print(f"spans exported: {receiver.received} bytes of OTLP")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    asyncio.run(main(parser.parse_args().runs))
