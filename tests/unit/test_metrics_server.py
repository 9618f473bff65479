"""The metrics endpoint (metrics.py) under a client that holds connections half-sent
(issue 23): a thread per connection kept 300 threads for 300 idle requests. Here the
threaded MetricsServer of the operator, in this process, on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from mcp_forge import metrics
from mcp_forge.metrics import MetricsServer
from support import half_sent, wait_closed

pytestmark = pytest.mark.servers  # not the fast loop (docs/testing.md)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    exporter = MetricsServer("127.0.0.1", 0)
    try:
        yield exporter
    finally:
        exporter.close()


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_300_half_sent_requests_hold_no_thread_and_a_scrape_is_still_answered(
    server: MetricsServer,
) -> None:
    threads = threading.active_count()
    sockets = half_sent(server.port, 300)
    try:
        status, body = scrape(server.port)  # while they are all held
        assert status == 200 and "mcpforge_executions_total" in body
        assert threading.active_count() <= threads + 1, "a thread per connection"
        # Past the cap, connections go at once (the oldest half-sent ones).
        early = wait_closed(sockets, 3.0)  # well before the 5 s request deadline
        assert len(early) >= 300 - metrics.CONNECTIONS_MAX, len(early)
        held = [s for s in sockets if s not in early]
        assert held, "the cap closed every connection, not just those past it"
        # The ones held are closed by the request deadline, not before, not much after.
        started = time.monotonic()
        late = wait_closed(held, metrics.HEADER_DEADLINE + 3)
        assert len(late) == len(held)
        assert time.monotonic() - started < metrics.HEADER_DEADLINE + 3
    finally:
        for s in sockets:
            s.close()


def test_an_oversized_request_is_closed_and_other_paths_are_not_found(
    server: MetricsServer,
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (metrics.REQUEST_MAX + 10))
        assert wait_closed([s], 2.0) == [s]
    assert scrape(server.port, "/admin")[0] == 404
    assert scrape(server.port, "/metrics?name[]=x")[0] == 200


async def test_a_flood_of_scrapes_renders_the_registry_about_once_a_second() -> None:
    """500 scrapes in a burst: each answered with the metrics, the registry rendered
    once or twice (a render is the one cost a scrape puts on the gateway's loop)."""
    endpoint = await metrics.MetricsEndpoint.start("127.0.0.1", 0)
    try:

        async def one() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
            answer = await reader.read()
            writer.close()
            return answer

        started = time.monotonic()
        answers = []
        for _ in range(10):
            answers += await asyncio.gather(*(one() for _ in range(50)))
        took = time.monotonic() - started
        assert all(b"200 OK" in a and b"mcpforge_executions_total" in a for a in answers)
        assert endpoint.renders <= 2 + took / metrics.RENDER_EVERY, (endpoint.renders, took)
    finally:
        await endpoint.close()
