"""The egress proxy driven from the host through a session's socket, as a kernel's relay
would (issue 28): the real proxy (confined, from .venv-egress) and stand-ins on this
machine's address. Its bound on a session's bandwidth and its bytes counted; and the
holes a review found, each closed: bytes that look like neither TLS nor HTTP are never
relayed unread, a value is never added to a request in clear text, a value a server
repeats in a redirect comes back as a placeholder, and only a session's own socket
speaks for it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from egress_standins import Recorded, Reply, StandIn, TestCA, own_address
from mcp_forge.api import keys
from mcp_forge.egress import audit, protocol
from mcp_forge.egress.client import EgressProxy, Given, default_python
from mcp_forge.egress.protocol import PLACEHOLDER
from mcp_forge.settings import Settings

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

RATE = 2 << 20  # bytes a second
SIZE = 8 << 20
VALUE = "v-" + os.urandom(12).hex()


class Redirecting(StandIn):
    """A stand-in that also answers /redirect by sending the client back, query and all."""

    def reply(self, request: Recorded, body_length: int) -> Reply:
        if request.path.startswith("/redirect"):
            query = request.path.partition("?")[2]
            body = Reply.of(302, b"moved\n")
            return dataclasses.replace(body, headers=(("Location", f"/bytes/1?{query}"),))
        return super().reply(request, body_length)


class Raw:
    """A TCP listener that counts the connections it gets (a server reached unread)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@dataclasses.dataclass
class Setup:
    proxy: EgressProxy
    path: Path
    token: str
    ca: TestCA
    session_ca: Path
    https: Redirecting
    plain: StandIn
    raw: Raw


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("egress-limits")


@pytest.fixture(scope="module")
def servers(tmp: Path) -> Iterator[tuple[TestCA, Redirecting, StandIn, Raw]]:
    address = own_address()
    names = ("api.test", "inj.test", "multi.test")
    ca = TestCA(tmp / "ca", names=names, addresses=(address,))
    ca.ca_path.chmod(0o644)
    raw = Raw(address)
    with Redirecting(address, ca) as https, StandIn(address) as plain:
        yield ca, https, plain, raw
    raw.close()


@pytest.fixture(scope="module")
async def setup(
    tmp: Path, servers: tuple[TestCA, Redirecting, StandIn, Raw]
) -> AsyncIterator[Setup]:
    ca, https, plain, raw = servers
    own = [f"{https.address}/32"]
    table = tmp / "resolve" / "resolve.json"  # read by the proxy, as nobody when root
    table.parent.mkdir(mode=0o755)
    names = ("api.test", "inj.test", "plain.test", "raw.test", "multi.test")
    table.write_text(json.dumps({n: [https.address] for n in names}))
    table.chmod(0o644)
    settings = Settings(
        state_dir=tmp / "state",
        egress_resolve=str(table),
        egress_upstream_ca=str(ca.ca_path),
        egress_bandwidth_max=RATE,
    )
    ref = {"secretKeyRef": {"name": "s", "key": "k"}}
    rules = [
        {"host": "api.test", "ports": [https.port], "addresses": own},
        {"host": "inj.test", "ports": [https.port, plain.port], "addresses": own,
         "inject": [{"query": "key", **ref}]},
        {"host": "raw.test", "ports": [raw.port], "addresses": own, "paths": ["/ok"]},
        # Two rules for one name: only the first opens its (non-public) address.
        {"host": "multi.test", "ports": [https.port], "addresses": own, "paths": ["/bytes/"]},
        {"host": "multi.test", "ports": [https.port], "methods": ["GET"]},
    ]  # fmt: skip
    session_ca = keys.new_egress_ca("default/limits")
    (tmp / "session-ca.pem").write_text(session_ca.cert)
    path = tmp / "egress.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    token = protocol.token_for(os.urandom(32))
    proxy = EgressProxy(settings)
    given = Given(token, rules, session_ca, [[2, 0, VALUE]])
    await proxy.open("default/limits", given, listener)
    yield Setup(proxy, path, token, ca, tmp / "session-ca.pem", https, plain, raw)
    await proxy.stop()


def tunnel(setup: Setup, host: str, port: int, token: str | None = None) -> socket.socket:
    """A CONNECT through the session's socket, answered 200: the socket, after the head."""
    auth = base64.b64encode(f"{protocol.PROXY_USER}:{token or setup.token}".encode()).decode()
    raw = socket.socket(socket.AF_UNIX)
    raw.settimeout(15)
    raw.connect(str(setup.path))
    raw.sendall(
        f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return raw


def exchange(sock: socket.socket | ssl.SSLSocket, request: bytes, *, end: bool = False) -> bytes:
    """Send `request` (then shut the writing side if `end`: what follows a head that
    never ends), and read until the far end closes."""
    sock.sendall(request)
    if end:
        sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


def get_through(setup: Setup, target: str) -> int:
    """An HTTPS GET of api.test through a tunnel; the body's length."""
    raw = tunnel(setup, "api.test", setup.https.port)
    with setup.ca.client_context().wrap_socket(raw, server_hostname="api.test") as tls:
        data = exchange(
            tls, f"GET {target} HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n".encode()
        )
    return len(data.split(b"\r\n\r\n", 1)[1])


def bytes_in() -> float:
    return REGISTRY.get_sample_value("mcpforge_egress_bytes_total", {"direction": "in"}) or 0.0


async def test_a_sessions_bandwidth_is_bounded_and_its_bytes_counted(setup: Setup) -> None:
    before = bytes_in()
    began = time.monotonic()
    got = await asyncio.to_thread(get_through, setup, f"/bytes/{SIZE}")
    took = time.monotonic() - began
    assert got == SIZE
    # A second's burst, then RATE: (SIZE - RATE) / RATE seconds at the least.
    assert took >= (SIZE - RATE) / RATE * 0.9, took
    async with asyncio.timeout(10):  # the connection's record, over the proxy's stderr
        while bytes_in() < before + SIZE:
            waiter = audit.next_record()
            if bytes_in() < before + SIZE:
                await waiter


@pytest.mark.parametrize(
    "first",
    [
        b"\r\nDELETE /admin HTTP/1.1\r\nHost: raw.test\r\n\r\n",  # HTTP after a blank line
        b"\x16\x03\x04\x00\x05hello",  # a TLS record version mitmproxy does not know
        b"\x00\x01\x02 binary\n",
    ],
)
async def test_bytes_neither_tls_nor_http_are_never_relayed_unread(
    setup: Setup, first: bytes
) -> None:
    """raw.test allows /ok only: whatever else comes through its tunnel is read (a 400, a
    403, or the connection closed), never passed to the server unseen (its listener gets
    no connection)."""
    before = setup.raw.accepted

    def send() -> bytes:
        with tunnel(setup, "raw.test", setup.raw.port) as sock:
            return exchange(sock, first, end=True)

    answer = await asyncio.to_thread(send)
    assert answer == b"" or answer.split(b" ", 2)[1] in (b"400", b"403"), answer[:200]
    assert setup.raw.accepted == before


async def test_a_value_is_never_added_in_clear_text(setup: Setup) -> None:
    """inj.test on the plain stand-in's port, through CONNECT: refused, nothing sent."""
    before = len(setup.plain.requests)

    def send() -> bytes:
        with tunnel(setup, "inj.test", setup.plain.port) as sock:
            return exchange(
                sock, b"GET /echo HTTP/1.1\r\nHost: inj.test\r\nConnection: close\r\n\r\n"
            )

    answer = await asyncio.to_thread(send)
    assert answer.startswith(b"HTTP/1.1 403") and b"TLS only" in answer, answer[:300]
    assert len(setup.plain.requests) == before


async def test_a_value_repeated_in_a_redirect_comes_back_as_a_placeholder(setup: Setup) -> None:
    def send() -> bytes:
        raw = tunnel(setup, "inj.test", setup.https.port)
        context = ssl.create_default_context(cafile=str(setup.session_ca))
        with context.wrap_socket(raw, server_hostname="inj.test") as tls:
            return exchange(
                tls, b"GET /redirect?x=1 HTTP/1.1\r\nHost: inj.test\r\nConnection: close\r\n\r\n"
            )

    answer = await asyncio.to_thread(send)
    seen = setup.https.wait_for(lambda r: r.path.startswith("/redirect"), timeout=10)
    assert f"key={VALUE}" in seen.path  # the server got the value
    assert answer.startswith(b"HTTP/1.1 302"), answer[:200]
    assert VALUE.encode() not in answer and f"key={PLACEHOLDER}".encode() in answer


async def test_only_a_sessions_own_socket_speaks_for_it(setup: Setup) -> None:
    """The session's credential, straight to mitmproxy's port (not through its socket):
    no one's (407)."""
    port = setup.proxy.port
    auth = base64.b64encode(f"{protocol.PROXY_USER}:{setup.token}".encode()).decode()

    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            return exchange(
                sock,
                f"CONNECT api.test:{setup.https.port} HTTP/1.1\r\nHost: api.test\r\n"
                f"Proxy-Authorization: Basic {auth}\r\nConnection: close\r\n\r\n".encode(),
            )

    answer = await asyncio.to_thread(send)
    assert answer.startswith(b"HTTP/1.1 407"), answer[:200]


async def test_a_request_is_allowed_only_by_a_rule_that_opens_its_address(setup: Setup) -> None:
    """multi.test resolves to a non-public address that only its first rule (paths
    /bytes/) opens: its second rule (any GET) does not speak for a request there."""

    def get(path: str) -> bytes:
        raw = tunnel(setup, "multi.test", setup.https.port)
        context = ssl.create_default_context(cafile=str(setup.session_ca))
        with context.wrap_socket(raw, server_hostname="multi.test") as tls:
            head = f"GET {path} HTTP/1.1\r\nHost: multi.test\r\nConnection: close\r\n\r\n"
            return exchange(tls, head.encode())

    assert (await asyncio.to_thread(get, "/bytes/3")).startswith(b"HTTP/1.1 200")
    refused = await asyncio.to_thread(get, "/echo")
    assert refused.startswith(b"HTTP/1.1 403") and b"/bytes/" in refused, refused[:300]
