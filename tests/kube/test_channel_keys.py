"""A kernel pod's channels and bridge on the real cluster: Curve and mutual TLS.

The operator gives every session a Curve pair and a bridge certificate in its Secret; the
kernel binds its channels as Curve servers and its bridge listener takes only the peer
that presents the session's certificate. From this host (which reaches pod IPs, as a
gateway does) the tests connect as the gateway does, and as others would: a plain ZMQ
client, one with another server key, a raw TCP peer, a TLS peer with another session's
certificate. A session made by an older operator (no keys in its Secret) keeps working
in plaintext and gets its keys with its next kernel pod. Traffic goes only to the test's
own pods; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import zmq
import zmq.asyncio

from mcp_forge.api import kernelsession
from mcp_forge.api.connection import (
    BRIDGE_PORT,
    PORTS,
    Address,
    ConnectionInfo,
    new_key,
)
from mcp_forge.api.keys import CURVE_PUBLIC, CURVE_SECRET, new_bridge_cert, new_curve_keys
from mcp_forge.clients.kube import Kube, connection_file_of, key_of
from mcp_forge.control.render import render_kubernetes
from mcp_forge.errors import SessionNotReady
from mcp_forge.gateway import introspection
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import Collector
from mcp_forge.runtimes.cluster import KubernetesRuntime
from mcp_forge.settings import Settings
from support import read_to_end

from .conftest import KubeAPI
from .harness import (
    KS,
    bridge_inside,
    connection_of,
    kernel,
    kernel_dies,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
)

SILENCE = 3.0  # how long a refused client listens for the reply that must not come


async def secret_file(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    info = connection_file_of(await asyncio.to_thread(kube.get, "Secret", ns, f"ks-{name}-conn"))
    assert info is not None
    return info


async def unanswered(conn: KernelConnection, sock: zmq.asyncio.Socket) -> bool:
    """A kernel_info_request signed with the session's own key, sent on `sock`: True if no
    reply comes within SILENCE."""
    # A refused handshake leaves the socket no peer, and a send then blocks: bounded.
    sock.sndtimeo = int(SILENCE * 1000)
    try:
        conn.send(sock, "kernel_info_request", {})
    except zmq.Again:
        return True  # not even delivered
    return not await sock.poll(SILENCE * 1000)


async def test_the_channels_are_curve_and_a_client_without_the_kernels_key_gets_nothing(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    ns = kube_api.namespace
    await asyncio.to_thread(kube.create, session_body("curve", ns))
    obj = await ready(kube, ns, "curve")
    data = await secret_file(kube, ns, "curve")
    for secret in (data[CURVE_SECRET], data[CURVE_PUBLIC], data["key"]):
        assert secret not in json.dumps(obj), "no key is ever in the status"
    info = await connection_of(kube, ns, "curve")
    assert info.curve is not None and info.bridge is not None
    async with kernel(kube, ns, "curve") as conn:  # the gateway's way: Curve
        assert (await run_in_kernel(conn, "print(6 * 7)")).strip() == "42"
        ctx = zmq.asyncio.Context.instance()
        plain, wrong = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        other = new_curve_keys()
        wrong.curve_serverkey = other.public.encode()
        wrong.curve_publickey = other.public.encode()
        wrong.curve_secretkey = other.secret.encode()
        try:
            for label, sock in (("a plain client", plain), ("a wrong server key", wrong)):
                sock.linger = 0
                sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
                sock.connect(f"tcp://{info.host}:{PORTS['shell']}")
                assert await unanswered(conn, sock), f"{label} got a reply from the kernel"
        finally:
            plain.close(linger=0)
            wrong.close(linger=0)
        # Nor does the heartbeat echo for a client without the pair.
        bare = KernelConnection(replace(info, curve=None), max_frame=1 << 20, max_message=1 << 20)
        try:
            assert not await bare.heartbeat(SILENCE)
        finally:
            bare.close()
        assert await conn.heartbeat(10.0)
        assert (await run_in_kernel(conn, "print('still')")).strip() == "still"


async def _connected(conn: KernelConnection, wait: float = 0) -> bool:
    code = f"import mcp_tools; print(mcp_tools.wait_connected({wait}))"
    return (await run_in_kernel(conn, code)).strip() == "True"


async def test_the_bridge_port_takes_only_the_peer_with_the_sessions_certificate(
    kube_api: KubeAPI, kube: Kube, operator: Any, tmp_path: Path
) -> None:
    ns = kube_api.namespace
    await asyncio.to_thread(kube.create, session_body("tls", ns))
    await ready(kube, ns, "tls")
    info = await connection_of(kube, ns, "tls")
    assert info.bridge is not None
    async with kernel(kube, ns, "tls") as conn:
        program = introspection.bridge_program(bridge_inside(info))
        collector = Collector(conn.send_execute(program, silent=True, store_history=False), 1, 0)
        assert await conn.pump(collector, 30.0) and collector.error is None, collector.error
        # A raw TCP peer saying what a gateway says first: closed, and never sent a frame.
        reader, writer = await asyncio.open_connection(info.host, BRIDGE_PORT)
        hello = json.dumps({"v": 1, "type": "hello", "servers": {}}).encode()
        writer.write(len(hello).to_bytes(4, "big") + hello)
        got = await read_to_end(reader)
        writer.close()
        assert got == b"" or got[0] == 21, f"not just a TLS alert: {got[:64]!r}"
        assert not await _connected(conn)
        # A TLS peer with another session's certificate: refused in the handshake.
        foreign = new_bridge_cert(f"{ns}/another")
        pem = tmp_path / "foreign.pem"
        pem.write_text(foreign.cert + "\n" + foreign.key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(str(pem))
        reader, writer = await asyncio.open_connection(info.host, BRIDGE_PORT, ssl=context)
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            assert await read_to_end(reader) == b""
        writer.close()
        assert not await _connected(conn)
        # The gateway's way: mutual TLS with the session's certificate.
        bridge = Bridge("tls", {}, {})
        try:
            await bridge.open(Address("tcp", host=info.host, port=BRIDGE_PORT, tls=info.bridge))
            assert await _connected(conn, 10)
        finally:
            await bridge.close()


def _runtime(kube_api: KubeAPI) -> KubernetesRuntime:
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kube_api.kubeconfig), client_configuration=config)
    settings = Settings(kube_connect="pod-ip", session_namespace=kube_api.namespace)
    return KubernetesRuntime(settings, Kube(config))


async def _as_an_older_operator_made_it(kube: Kube, ns: str, name: str) -> str:
    """Secret, Service, NetworkPolicy and Pod as an operator before Curve rendered them (no
    Curve pair, no bridge certificate); the HMAC key."""
    await asyncio.to_thread(kube.create, session_body(name, ns))
    body = await asyncio.to_thread(kube.get, KS, ns, name)
    assert body is not None
    session = kernelsession.load(kernelsession.validate(body, default_namespace=ns))
    settings = Settings.from_env()
    old = ConnectionInfo("tcp", f"ks-{name}.{ns}.svc", new_key())
    for child in render_kubernetes(
        session,
        old,
        gateway_namespace=settings.gateway_namespace or None,
        runtime_class=settings.runtime_class or None,
        seccomp_profile=settings.seccomp_profile or None,
    ):
        await asyncio.to_thread(kube.create, child)
    return old.key


async def test_a_session_from_an_older_operator_stays_plaintext_until_its_next_kernel_pod(
    kube_api: KubeAPI, kube: Kube
) -> None:
    ns = kube_api.namespace
    key = await _as_an_older_operator_made_it(kube, ns, "legacy")
    runtime = _runtime(kube_api)
    try:
        async with running_operator(kube):
            first = await ready(kube, ns, "legacy")
            # The running kernel read its file without keys: the Secret is left as it is,
            # and the gateway reaches that kernel in plaintext, as before.
            assert CURVE_PUBLIC not in await secret_file(kube, ns, "legacy")
            session = await runtime.get("legacy", ns)
            info = await runtime.connection(session)
            assert info.curve is None and info.bridge is None and info.key == key
            async with kernel(kube, ns, "legacy") as conn:
                assert (await run_in_kernel(conn, "print('plain')")).strip() == "plain"
            # Its next pod (the kernel exits) comes with a Curve pair and a certificate.
            await kernel_dies(kube, ns, "legacy", "import os; os._exit(0)")
            second = await ready(kube, ns, "legacy", other_than=first["status"]["kernelId"])
            info = await runtime.connection(await runtime.get("legacy", ns))
            assert info.curve is not None and info.bridge is not None and info.key == key
            async with kernel(kube, ns, "legacy") as conn:
                assert (await run_in_kernel(conn, "print('curve')")).strip() == "curve"

            # A malformed Curve key in the Secret: the gateway says which, and where.
            data = await secret_file(kube, ns, "legacy")
            good = data[CURVE_SECRET]
            data[CURVE_SECRET] = "~" * 40  # ~ is not in Z85
            patch = {"stringData": {"connection.json": json.dumps(data)}}
            await asyncio.to_thread(kube.patch, "Secret", ns, "ks-legacy-conn", patch)
            with pytest.raises(SessionNotReady) as refused:
                await runtime.connection(await runtime.get("legacy", ns))
            message = str(refused.value)
            assert f"Secret {ns}/ks-legacy-conn: curve_secretkey is not a Curve key" in message
            assert "~~~~" not in message, "the key itself is never shown"
            # The operator makes it anew for the next pod; the HMAC key stays.
            await asyncio.to_thread(kube.delete, "Pod", ns, "ks-legacy")
            await ready(kube, ns, "legacy", other_than=second["status"]["kernelId"])
            data = await secret_file(kube, ns, "legacy")
            assert data[CURVE_SECRET] not in (good, "~" * 40) and data["key"] == key
            async with kernel(kube, ns, "legacy") as conn:
                assert (await run_in_kernel(conn, "print('again')")).strip() == "again"
    finally:
        runtime.close()
    assert key_of(await asyncio.to_thread(kube.get, "Secret", ns, "ks-legacy-conn")) == key
