"""The project's API client (mcp_forge.clients.kube) against the real API server."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import pytest

from mcp_forge.clients.kube import Kube
from mcp_forge.errors import SessionNotFound
from mcp_forge.runtimes.cluster import KubernetesRuntime
from mcp_forge.settings import Settings

from .cluster_common import ROOT
from .harness import KS, eventually, session_body

AUDIT = ROOT / "logs" / "audit.log"  # the test cluster API server's (cluster_config.py)


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


def gateway_requests(since: int, ns: str) -> list[tuple[str, str]]:
    """The gateway's requests of sessions in `ns` in the audit log after byte `since`, as
    (verb, path), each once (a watch is logged when it starts and when it ends)."""
    with AUDIT.open("rb") as f:
        f.seek(since)
        data = f.read()
    seen: dict[str, tuple[str, str]] = {}
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        event = json.loads(line)
        uri = urllib.parse.unquote(event["requestURI"])
        if str(event.get("userAgent", "")).startswith("mcp-forge-gateway/") and uri.startswith(
            f"/apis/mcpforge.dev/v1alpha1/namespaces/{ns}/kernelsessions"
        ):
            seen[event["auditID"]] = (event["verb"], uri.split("?")[0])
    return list(seen.values())


async def test_the_gateways_wait_for_ready_reads_one_stream_from_the_create(
    kube: Kube, ns: str
) -> None:
    """The operator writes a session's status more than once before Ready (a claim, then
    Ready): the gateway's create follows them all on one watch, started where its create
    left off (no list first, no new watch per change: each cost a round trip, and a new
    TLS connection, right when the API server is busiest). No operator runs here: the
    test writes the statuses."""
    runtime = KubernetesRuntime(
        Settings(session_namespace=ns), Kube(kube.client.configuration, manager="mcp-forge-gateway")
    )
    body = session_body("steps", ns, image="localhost/mcp-forge-kernel:0.1.0-minimal")
    since = AUDIT.stat().st_size
    try:
        creating = asyncio.create_task(runtime.create(body))
        made = await eventually(kube, KS, ns, "steps", lambda o: o is not None)
        assert made is not None
        generation = made["metadata"]["generation"]
        for phase in ("Pending", "Starting", "Ready"):
            status = {"phase": phase, "observedGeneration": generation, "podName": f"ks-{phase}"}
            await asyncio.to_thread(kube.patch, KS, ns, "steps", {"status": status}, status=True)
        session = await asyncio.wait_for(creating, 30)
        assert session.status["phase"] == "Ready" and session.status["podName"] == "ks-Ready"
    finally:
        runtime.close()
    path = f"/apis/mcpforge.dev/v1alpha1/namespaces/{ns}/kernelsessions"
    assert gateway_requests(since, ns) == [("create", path), ("watch", path)]
