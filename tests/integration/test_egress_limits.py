"""The egress proxy's bound on a session's bandwidth, and its bytes counted (issue 28):
the real proxy (confined, from .venv-egress) and a stand-in on this machine's address,
driven from the host through a session's socket as a kernel's relay would."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from egress_standins import StandIn, TestCA, own_address
from mcp_forge.egress import audit, protocol
from mcp_forge.egress.client import EgressProxy, Given, default_python
from mcp_forge.settings import Settings

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

RATE = 2 << 20  # bytes a second
SIZE = 8 << 20


def get_through(path: Path, token: str, host: str, port: int, ca: TestCA, target: str) -> int:
    """CONNECT through the session's socket, then an HTTPS GET; the body's length."""
    auth = base64.b64encode(f"{protocol.PROXY_USER}:{token}".encode()).decode()
    raw = socket.socket(socket.AF_UNIX)
    raw.settimeout(30)
    raw.connect(str(path))
    raw.sendall(
        f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    with ca.client_context().wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := tls.recv(1 << 20):
            data += chunk
    return len(data.split(b"\r\n\r\n", 1)[1])


def bytes_in() -> float:
    return REGISTRY.get_sample_value("mcpforge_egress_bytes_total", {"direction": "in"}) or 0.0


async def test_a_sessions_bandwidth_is_bounded_and_its_bytes_counted(tmp_path: Path) -> None:
    address = own_address()
    ca = TestCA(tmp_path / "ca", addresses=(address,))
    table = tmp_path / "resolve" / "resolve.json"  # read by the proxy, as nobody when root
    table.parent.mkdir(mode=0o755)
    table.write_text(json.dumps({"api.test": [address]}))
    table.chmod(0o644)
    settings = Settings(
        state_dir=tmp_path / "state",
        egress_resolve=str(table),
        egress_upstream_ca=str(ca.ca_path),
        egress_bandwidth_max=RATE,
    )
    ca.ca_path.chmod(0o644)
    path = tmp_path / "egress.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    token = protocol.token_for(os.urandom(32))
    proxy = EgressProxy(settings)
    with StandIn(address, ca) as standin:
        rule = {"host": "api.test", "ports": [standin.port], "addresses": [f"{address}/32"]}
        try:
            await proxy.open("default/limits", Given(token, [rule]), listener)
            before = bytes_in()
            began = time.monotonic()
            got = await asyncio.to_thread(
                get_through, path, token, "api.test", standin.port, ca, f"/bytes/{SIZE}"
            )
            took = time.monotonic() - began
            assert got == SIZE
            # A second's burst, then RATE: (SIZE - RATE) / RATE seconds at the least.
            assert took >= (SIZE - RATE) / RATE * 0.9, took
            async with asyncio.timeout(10):  # the connection's record, over the proxy's stderr
                while bytes_in() < before + SIZE:
                    waiter = audit.next_record()
                    if bytes_in() < before + SIZE:
                        await waiter
        finally:
            await proxy.stop()
