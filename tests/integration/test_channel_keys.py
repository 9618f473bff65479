"""A cluster session's keys, on a real kernel without a cluster.

A bare ipykernel (the venv's, the version the kernel image pins) runs with the connection
file the operator puts in a session's Secret, bound on a loopback address of its own
(127.x.y.z: the fixed ports cannot clash), as a kernel pod binds its pod IP. Through it:
the gateway's own connection over Curve, clients without the key, the bridge's mutual TLS
against raw, certificate-less and foreign peers, and the startup probe that makes a
cluster session Ready when its kernel answers. tests/kube/test_channel_keys.py shows
the same on the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from mcp_forge.api.connection import BRIDGE_PORT, PORTS, Address, ConnectionInfo, new_key
from mcp_forge.api.keys import new_bridge_cert, new_curve_keys
from mcp_forge.errors import SessionNotReady
from mcp_forge.gateway import introspection
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import Collector
from mcp_forge.kernelside import compiled, probe, run_silently
from mcp_forge.sandbox import KERNEL_CMD
from support import read_to_end

READY = 30.0
SILENCE = 2.0  # how long a refused client listens for a reply that must not come


@contextlib.asynccontextmanager
async def a_kernel(
    tmp_path: Path, curve: bool = True
) -> AsyncIterator[tuple[ConnectionInfo, Path, str]]:
    """An ipykernel with a Curve pair (unless not `curve`) and a bridge certificate: (its
    connection, its file, what the file held)."""
    ip = f"127.{secrets.randbelow(250) + 2}.{secrets.randbelow(256)}.{secrets.randbelow(250) + 2}"
    pair = new_curve_keys() if curve else None
    info = ConnectionInfo("tcp", ip, new_key(), pair, new_bridge_cert("t/keys"))
    path = tmp_path / "connection.json"
    written = json.dumps(info.to_jupyter())
    path.write_text(written)  # as the kernel reads it, at its address
    # The pods' own command line (python, its launcher), on this file.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *KERNEL_CMD[1:-1],
        str(path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield info, path, written
    finally:
        process.kill()
        await process.wait()


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[tuple[ConnectionInfo, Path]]:
    """`a_kernel`, which must never write its file: a pod's connection file is a read-only
    mount (ipykernel_launcher rewrites a file with Curve keys, and then dies in a pod)."""
    async with a_kernel(tmp_path) as (info, path, written):
        yield info, path
        assert path.read_text() == written, "the kernel rewrote its connection file"


@contextlib.asynccontextmanager
async def connected(info: ConnectionInfo) -> AsyncIterator[KernelConnection]:
    conn = KernelConnection(info, max_frame=16 << 20, max_message=32 << 20)
    try:
        await conn.wait_ready(READY)
        yield conn
    finally:
        conn.close()


async def run(conn: KernelConnection, code: str) -> str:
    collector = Collector(conn.send_execute(code, silent=False, store_history=False), 10_000, 0)
    assert await conn.pump(collector, READY)
    assert collector.error is None, collector.error
    return "".join(collector.stdout)


async def no_reply(sock: zmq.asyncio.Socket, conn: KernelConnection) -> bool:
    """Send a kernel_info_request signed with the session's key; True if nothing answers."""
    conn.send(sock, "kernel_info_request", {})
    return not await sock.poll(SILENCE * 1000)


async def test_the_gateway_runs_code_over_curve_and_a_client_without_the_key_gets_nothing(
    kernel: tuple[ConnectionInfo, Path],
) -> None:
    info, _ = kernel
    async with connected(info) as conn:
        assert (await run(conn, "print(6 * 7)")).strip() == "42"
        assert await conn.heartbeat(5.0)
        ctx = zmq.asyncio.Context.instance()
        plain = ctx.socket(zmq.DEALER)
        wrong = ctx.socket(zmq.DEALER)
        other = new_curve_keys()  # a client that knows some key, not the kernel's
        wrong.curve_serverkey = other.public.encode()
        wrong.curve_publickey = other.public.encode()
        wrong.curve_secretkey = other.secret.encode()
        try:
            for sock in (plain, wrong):
                sock.linger = 0
                sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
                sock.connect(f"tcp://{info.host}:{PORTS['shell']}")
                assert await no_reply(sock, conn), "a client without the kernel's key got a reply"
        finally:
            plain.close(linger=0)
            wrong.close(linger=0)
        # And the kernel still answers the gateway.
        assert (await run(conn, "print('still')")).strip() == "still"


async def test_a_gateway_without_the_curve_pair_cannot_reach_a_curve_kernel(
    kernel: tuple[ConnectionInfo, Path],
) -> None:
    info, _ = kernel
    async with connected(info):
        pass  # the kernel is up
    plain = KernelConnection(replace(info, curve=None), max_frame=1 << 20, max_message=1 << 20)
    try:
        with pytest.raises(SessionNotReady, match="did not answer kernel_info"):
            await plain.wait_ready(SILENCE)
        assert not await plain.heartbeat(SILENCE)
    finally:
        plain.close()


async def _start_bridge(conn: KernelConnection, info: ConnectionInfo, path: Path) -> None:
    assert info.bridge is not None
    address = ("tls", info.host, BRIDGE_PORT, info.bridge.cert, info.bridge.key)
    collector = Collector(
        conn.send_execute(introspection.bridge_program(address), silent=True, store_history=False),
        10_000,
        0,
    )
    assert await conn.pump(collector, READY)
    assert collector.error is None, collector.error


async def _bridge_state(conn: KernelConnection) -> str:
    return (await run(conn, "import mcp_tools; print(mcp_tools.wait_connected(0))")).strip()


async def test_the_bridge_takes_the_gateway_over_mutual_tls_and_closes_on_anyone_else(
    kernel: tuple[ConnectionInfo, Path],
) -> None:
    info, path = kernel
    assert info.bridge is not None
    async with connected(info) as conn:
        await _start_bridge(conn, info, path)
        # A raw TCP peer that says what a gateway says first (on a plain listener this hello
        # would make it the bridge): closed, never a frame back, never connected.
        reader, writer = await asyncio.open_connection(info.host, BRIDGE_PORT)
        frame = json.dumps({"v": 1, "type": "hello", "servers": {}})
        writer.write(len(frame).to_bytes(4, "big") + frame.encode())
        got = await read_to_end(reader)
        writer.close()
        # Nothing but, at most, a TLS alert record (content type 21): no frame, no hello.
        assert got == b"" or got[0] == 21, got[:64]
        assert await _bridge_state(conn) == "False"
        # TLS without a client certificate, and TLS with another session's certificate.
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.check_hostname = False
        anonymous.verify_mode = ssl.CERT_NONE
        foreign = new_bridge_cert("t/other")
        for label, cert in (("no certificate", None), ("another session's", foreign)):
            context = anonymous
            if cert is not None:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                key_file = path.parent / "foreign.pem"
                key_file.write_text(cert.cert + "\n" + cert.key)
                context.load_cert_chain(str(key_file))
            reader, writer = await asyncio.open_connection(info.host, BRIDGE_PORT, ssl=context)
            with contextlib.suppress(ssl.SSLError, ConnectionError):
                got = await read_to_end(reader)
                assert got == b"", f"{label}: the listener sent {got[:64]!r}"
            writer.close()
            with contextlib.suppress(ssl.SSLError, ConnectionError):
                await writer.wait_closed()
            assert await _bridge_state(conn) == "False", label
        # The gateway, with the session's certificate: connected, its hello applied.
        bridge = Bridge("keys", {}, {})
        try:
            await bridge.open(Address("tcp", host=info.host, port=BRIDGE_PORT, tls=info.bridge))
            assert (await run(conn, "print(mcp_tools.wait_connected(10))")).strip() == "True"
        finally:
            await bridge.close()


async def test_a_kernel_that_presents_another_certificate_is_not_taken_for_the_bridge(
    kernel: tuple[ConnectionInfo, Path],
) -> None:
    info, path = kernel
    async with connected(info) as conn:
        await _start_bridge(conn, info, path)
        bridge = Bridge("keys", {}, {})
        wrong = Address("tcp", host=info.host, port=BRIDGE_PORT, tls=new_bridge_cert("t/other"))
        with pytest.raises(ssl.SSLCertVerificationError):
            await bridge.open(wrong)
        await bridge.close()
        assert await _bridge_state(conn) == "False"


async def test_the_startup_probe_passes_once_the_kernel_answers_and_never_on_a_wrong_key(
    kernel: tuple[ConnectionInfo, Path],
) -> None:
    info, path = kernel
    written = json.loads(path.read_text())
    async with connected(info):  # the kernel answers the gateway: the probe must pass too
        assert await asyncio.to_thread(probe.answers, written, info.host)
        forged = {**written, "key": new_key()}  # replies signed with the real key are refused
        assert not await asyncio.to_thread(probe.answers, forged, info.host, 1000)
        other = new_curve_keys()  # Curve with a pair that is not the kernel's: no handshake
        foreign = {**written, "curve_publickey": other.public, "curve_secretkey": other.secret}
        assert not await asyncio.to_thread(probe.answers, foreign, info.host, 1000)
    # Nothing listening on that address: a refusal within the probe's timeout, not a hang.
    nobody = f"127.{secrets.randbelow(250) + 2}.{secrets.randbelow(256)}.1"
    assert not await asyncio.to_thread(probe.answers, written, nobody, 500)


def _silently(code: str) -> dict[str, Any]:
    return {"code": code, "silent": True, "store_history": False, "allow_stdin": False}


async def test_a_kernel_given_new_transport_keys_answers_in_them_and_no_longer_in_the_old(
    tmp_path: Path,
) -> None:
    """A cluster fork's woken kernel is given its own Curve pair and bridge certificate
    (kernelside/rebind.py, as control/forking.py sends it): every channel answers in the
    new pair only, a connection made in the old one is cut, the bridge takes only the
    new certificate, and the connection file holds the new keys."""
    async with a_kernel(tmp_path) as (info, path, _):
        theirs = info.to_jupyter()
        async with connected(info) as conn:
            await _start_bridge(conn, info, path)
            old_bridge = Bridge("keys", {}, {})
            await old_bridge.open(Address("tcp", host=info.host, port=BRIDGE_PORT, tls=info.bridge))
            assert (
                await run(conn, "import mcp_tools; print(mcp_tools.wait_connected(10))")
            ).strip() == "True"
            assert info.curve is not None
            held = zmq.asyncio.Context.instance().socket(zmq.DEALER)  # stays connected, in the old
            held.linger = 0
            held.curve_serverkey = held.curve_publickey = info.curve.public.encode()
            held.curve_secretkey = info.curve.secret.encode()
            held.connect(f"tcp://{info.host}:{PORTS['shell']}")
            assert not await no_reply(held, conn), "the old client is not connected"
            await held.recv_multipart()
            own = replace(info, curve=new_curve_keys(), bridge=new_bridge_cert("t/fork"))
            mine = own.to_jupyter()
            names = {"INFO": repr(mine)}
            check = run_silently(compiled("rebind"), {**names, "CHECK": "True"})
            said = await asyncio.to_thread(
                probe.ask, theirs, info.host, "execute_request", _silently(check), 10_000
            )
            assert said is not None and said["status"] == "ok", said
            rebind = _silently(run_silently(compiled("rebind"), names))
            await asyncio.to_thread(probe.tell, theirs, info.host, "execute_request", rebind)
            assert await asyncio.to_thread(probe.answers, mine, info.host, 10_000)
            assert await no_reply(held, conn), "a connection made in the old pair was kept"
            held.close(linger=0)
            await old_bridge.close()
        assert not await asyncio.to_thread(probe.answers, theirs, info.host, 1000)
        async with connected(own) as conn:  # shell, iopub and heartbeat in the new pair
            assert (await run(conn, "print(6 * 7)")).strip() == "42"
            assert await conn.heartbeat(5.0)
            bridge = Bridge("keys", {}, {})
            stale = Address("tcp", host=info.host, port=BRIDGE_PORT, tls=info.bridge)
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await bridge.open(stale)
            await bridge.close()
            assert await _bridge_state(conn) == "False"
            bridge = Bridge("keys", {}, {})
            try:
                await bridge.open(Address("tcp", host=info.host, port=BRIDGE_PORT, tls=own.bridge))
                assert (
                    await run(conn, "import mcp_tools; print(mcp_tools.wait_connected(10))")
                ).strip() == "True"
            finally:
                await bridge.close()
        old = KernelConnection(info, max_frame=1 << 20, max_message=1 << 20)
        try:
            with pytest.raises(SessionNotReady, match="did not answer kernel_info"):
                await old.wait_ready(SILENCE)
            assert not await old.heartbeat(SILENCE)
        finally:
            old.close()


async def test_a_kernel_without_curve_keys_is_refused_new_ones_and_nothing_changes(
    tmp_path: Path,
) -> None:
    async with a_kernel(tmp_path, curve=False) as (info, path, written):
        async with connected(info) as conn:
            mine = replace(info, curve=new_curve_keys()).to_jupyter()
            names = {"INFO": repr(mine), "CHECK": "True"}
            check = _silently(run_silently(compiled("rebind"), names))
            theirs = info.to_jupyter()
            said = await asyncio.to_thread(
                probe.ask, theirs, info.host, "execute_request", check, 10_000
            )
            assert said is not None and said["status"] == "error", said
            assert "no Curve keys" in said["evalue"], said
            assert (await run(conn, "print('still')")).strip() == "still"
        assert path.read_text() == written


async def test_a_bridge_that_cannot_take_a_new_certificate_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    """A bridge started by an older gateway (its listener does not keep its TLS where
    rebind.py finds it) may well have TLS: the check refuses, so the operator keeps the
    fork's parent's keys, and nothing changed."""
    async with a_kernel(tmp_path) as (info, path, _), connected(info) as conn:
        await _start_bridge(conn, info, path)
        forget = (
            "import threading\nfor t in threading.enumerate():\n    t.__dict__.pop('tls', None)"
        )
        await run(conn, forget)
        mine = replace(info, curve=new_curve_keys()).to_jupyter()
        check = _silently(run_silently(compiled("rebind"), {"INFO": repr(mine), "CHECK": "True"}))
        said = await asyncio.to_thread(
            probe.ask, info.to_jupyter(), info.host, "execute_request", check, 10_000
        )
        assert said is not None and said["status"] == "error", said
        assert "cannot take a new certificate" in said["evalue"], said
        assert (await run(conn, "print('still')")).strip() == "still"
