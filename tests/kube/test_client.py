"""The project's API client (mcp_forge.clients.kube) against the real API server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mcp_forge.clients.kube import Kube
from mcp_forge.errors import SessionNotFound
from mcp_forge.runtimes.cluster import KubernetesRuntime
from mcp_forge.settings import Settings

from .harness import KS, eventually, session_body


def _idle_sockets(kube: Kube) -> list[Any]:
    """The sockets of the calls' idle connections (urllib3's pool, last returned last)."""
    pools = kube.client.rest_client.pool_manager.pools
    queues = [pools[key].pool for key in pools.keys()]  # noqa: SIM118 (it refuses iteration)
    return [
        conn.sock
        for queue in queues
        if queue is not None
        for conn in list(queue.queue)
        if conn is not None and conn.sock is not None
    ]


async def test_a_watch_left_early_leaves_the_calls_connection_warm(kube: Kube, ns: str) -> None:
    """A watch that its caller leaves at the first event (the gateway's wait for Ready)
    must not cost the next call a new TLS connection: it did, 15-25 ms on a busy API
    server, in every warm claim's path (the Secret read right after Ready)."""
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "w", "namespace": ns}}
    made = await asyncio.to_thread(kube.create, body)
    warm = _idle_sockets(kube)
    assert len(warm) == 1, warm

    def first_event() -> str:
        rv = str(made["metadata"]["resourceVersion"])
        for event in kube.watch("Secret", ns, resource_version=rv, name="w", timeout=30):
            return event.type  # left with the stream still open
        raise AssertionError("the watch ended without an event")

    waiting = asyncio.create_task(asyncio.to_thread(first_event))
    await asyncio.to_thread(kube.patch, "Secret", ns, "w", {"metadata": {"labels": {"a": "b"}}})
    assert await asyncio.wait_for(waiting, 30) == "MODIFIED"
    assert await asyncio.to_thread(kube.get, "Secret", ns, "w") is not None
    assert _idle_sockets(kube) == warm, "the call after the watch opened a new connection"


async def test_the_gateways_wait_for_ready_ends_when_the_session_is_deleted(
    kube: Kube, ns: str
) -> None:
    """No operator runs here, so the session never becomes Ready: the gateway's create
    waits on the watch, and the session's deletion ends the wait at once with a clear
    error (the watch's DELETED event, not the 60 s deadline)."""
    runtime = KubernetesRuntime(Settings(session_namespace=ns), Kube(kube.client.configuration))
    body = session_body("doomed", ns, image="localhost/mcp-forge-kernel:0.1.0-minimal")
    try:
        creating = asyncio.create_task(runtime.create(body))
        await eventually(kube, KS, ns, "doomed", lambda o: o is not None)
        await asyncio.to_thread(kube.delete, KS, ns, "doomed")
        with pytest.raises(SessionNotFound, match="'doomed' was deleted"):
            await asyncio.wait_for(creating, 15)
    finally:
        runtime.close()
