"""Stand-ins for internet hosts, for the egress tests (issue 28): servers on this machine's
own address that answer for test names (api.test, pypi.test, ...) with a test CA's
certificate. The proxy's resolver maps those names to `own_address()` in tests only.

- `TestCA`: a CA and one server certificate for a list of names, as PEM files.
- `StandIn`: a threaded HTTP(S) server: `/bytes/<n>`, `/echo...`, 404 otherwise; every
  request recorded, `wait_for` a matching one. Hostile answers too: `/endless-head...`,
  `/endless-chunk...`, and `/after/<key>` (held until `/echo/release/<key>` comes).
- `Mute`: a TCP listener that accepts and never says a word (a TLS handshake that hangs).
- `PackageIndex` (egress_index.py): a StandIn that is also a PEP 503 simple index.

tests/ is on sys.path: `from egress_standins import StandIn, TestCA`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import http.client
import ipaddress
import json
import os
import re
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("api.test", "other.test", "files.test", "pypi.test", "*.wild.test")
BYTES_MAX = 64 * 1024 * 1024  # the largest /bytes/<n> served
CHUNK = 64 * 1024  # bytes per write of a streamed body
IDLE_DEADLINE = 30.0  # seconds a connection may sit between requests (or in its handshake)
STOP_DEADLINE = 10.0  # seconds stop() waits for each connection's thread once its socket is shut
ENDLESS_MAX = 96 * 1024 * 1024  # bytes of an endless answer sent before the stand-in gives up


# --- the CA ---------------------------------------------------------------------------------


class TestCA:
    """A test CA (EC P-256) and one server certificate it signed, as files in `directory`:
    `ca.pem` (what clients trust), `server.pem` and `server.key` (mode 0600).

    The server certificate's SANs are `names` (DNS; a `*.suffix` is a wildcard) and
    `addresses` (IP). The CA's key is kept in memory only.
    """

    __test__ = False  # a support class, not a test class, whatever pytest makes of its name

    def __init__(
        self,
        directory: Path | str,
        names: Sequence[str] = DEFAULT_NAMES,
        addresses: Sequence[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self.names = tuple(names)
        self.addresses = tuple(addresses)
        self.ca_path = self.directory / "ca.pem"
        self.cert_path = self.directory / "server.pem"
        self.key_path = self.directory / "server.key"

        now = datetime.datetime.now(datetime.UTC)
        not_before, not_after = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcp-forge egress test CA")])
        ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(ca_ski, critical=False)
            .sign(ca_key, hashes.SHA256())
        )

        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in self.names]
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in self.addresses]
        subject = self.names[0] if self.names else "egress stand-in"
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )

        self.directory.mkdir(parents=True, exist_ok=True)
        self.ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
            f.write(pem_key)

    def server_context(self) -> ssl.SSLContext:
        """A server-side context with the server certificate, speaking HTTP/1.1 only."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_path, self.key_path)
        context.set_alpn_protocols(["http/1.1"])
        return context

    def client_context(self) -> ssl.SSLContext:
        """A client-side context that trusts this CA only, hostname checked."""
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.set_alpn_protocols(["http/1.1"])
        return context


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


# --- this machine's address -----------------------------------------------------------------

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1


def own_address() -> str:
    """This machine's first IPv4 address that is neither loopback nor link-local, read from
    its interfaces (Linux ioctls; no packet is sent).

    Raises RuntimeError when no interface that is up has one.
    """
    seen: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from(
                    "H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request), 16
                )[0]
                if not flags & _IFF_UP:
                    continue
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # EADDRNOTAVAIL: no IPv4 address on this interface
                continue
            address = ipaddress.IPv4Address(answer[20:24])  # the sockaddr_in's sin_addr
            seen.append(f"{name} {address}")
            if not (address.is_loopback or address.is_link_local or address.is_unspecified):
                return str(address)
    raise RuntimeError(
        "no IPv4 address on this machine but loopback or link-local "
        f"(interfaces up with IPv4: {', '.join(seen) or 'none'}): the egress stand-ins "
        "need one the proxy can reach as if it were an internet host"
    )


# --- the server -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One request as a stand-in received it. `server_name` is the TLS SNI (None over plain
    HTTP or when the client sent none); `headers` are in the order received."""

    method: str
    host: str | None
    path: str
    headers: tuple[tuple[str, str], ...]
    server_name: str | None


@dataclass(frozen=True)
class Reply:
    """What a stand-in answers: `length` bytes in `chunks` (read only for non-HEAD requests)."""

    status: int
    content_type: str
    length: int
    chunks: Iterable[bytes]
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, status: int, body: bytes, content_type: str = "text/plain") -> Reply:
        return cls(status, content_type, len(body), (body,))

    @classmethod
    def json(cls, status: int, value: Any) -> Reply:
        return cls.of(status, json.dumps(value).encode(), "application/json")


_tls_server_name = threading.local()  # set by the SNI callback, in the handshaking thread


def _remember_server_name(_sock: Any, server_name: str | None, _context: Any) -> None:
    _tls_server_name.value = server_name


class StandIn(ThreadingHTTPServer):
    """A threaded HTTP/1.1 server (keep-alive) on (`address`, an ephemeral port), with TLS
    when given a TestCA. It serves from construction until `stop()` (or the end of a `with`).

    - `GET /bytes/<n>` (a query ignored): n bytes (at most BYTES_MAX), streamed, Content-Length set;
    - any method on `/echo...`: JSON {method, path, headers (pairs), body_length};
    - `/after/<key>`: the same JSON, once a request for `/echo/release/<key>` has come
      (within IDLE_DEADLINE; a 504 if none does);
    - `/endless-head...`: a status line, then header lines and never the blank line;
      `/endless-chunk...`: a chunked head, then a chunk's size line that never ends. Each
      until the client closes (or ENDLESS_MAX bytes); `wait_cut` says how much went;
    - anything else: 404.

    `requests` lists every request received (a copy); `wait_for` waits for one to match.
    Subclasses answer more paths by overriding `reply`.
    """

    daemon_threads = True  # a leaked connection thread must not hold interpreter exit

    def __init__(self, address: str | None = None, ca: TestCA | None = None) -> None:
        self.address = own_address() if address is None else address
        if ipaddress.ip_address(self.address).version == 6:
            self.address_family = socket.AF_INET6
        self.ca = ca
        self.scheme = "https" if ca else "http"
        self._tls = ca.server_context() if ca else None
        if self._tls:
            self._tls.sni_callback = _remember_server_name
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._requests: list[Recorded] = []
        self._cut: dict[str, int] = {}  # an endless answer's path, bytes sent until the end
        self._connections: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._stopping = False
        super().__init__((self.address, 0), _Handler)
        self.port: int = self.server_address[1]
        self._serving = threading.Thread(
            target=self.serve_forever, args=(0.05,), name=f"stand-in :{self.port}", daemon=True
        )  # polls every 50 ms for stop(): how long stop() waits for it
        self._serving.start()

    # -- what tests use

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def wait_for(self, predicate: Callable[[Recorded], bool], timeout: float) -> Recorded:
        """The first recorded request that matches `predicate`, waiting up to `timeout`
        seconds for one to arrive. Raises TimeoutError, listing what did arrive."""
        found: list[Recorded] = []

        def match() -> bool:
            found[:] = [r for r in self._requests if predicate(r)][:1]
            return bool(found)

        with self._changed:
            if self._changed.wait_for(match, timeout):
                return found[0]
            seen = [f"{r.method} {r.host} {r.path}" for r in self._requests]
        raise TimeoutError(f"no matching request in {timeout} s on :{self.port}; got {seen}")

    def wait_cut(self, path: str, timeout: float) -> int:
        """The bytes of the endless answer to `path` sent before the client closed (or
        ENDLESS_MAX), waiting up to `timeout` seconds for that end."""
        with self._changed:
            if self._changed.wait_for(lambda: path in self._cut, timeout):
                return self._cut[path]
        raise TimeoutError(f"the endless answer to {path} still goes on after {timeout} s")

    def url(self, name: str, path: str = "/") -> str:
        """This stand-in's URL under a test name, e.g. url("api.test", "/echo")."""
        return f"{self.scheme}://{name}:{self.port}{path}"

    def client(self, name: str, timeout: float = 10.0) -> http.client.HTTPConnection:
        """A connection to this stand-in's address, sent as `name` (Host header and, over
        TLS, the SNI, the certificate checked for that name against the CA): what a client
        that resolved `name` here would make."""
        connection = http.client.HTTPConnection(name, self.port, timeout=timeout)
        sock = socket.create_connection((self.address, self.port), timeout=timeout)
        if self.ca:
            try:
                sock = self.ca.client_context().wrap_socket(sock, server_hostname=name)
            except BaseException:
                sock.close()
                raise
        connection.sock = sock
        return connection

    def reply(self, request: Recorded, body_length: int) -> Reply:
        """The answer to a request whose body (`body_length` bytes) has been read.
        Subclasses extend this."""
        if request.path.startswith("/echo"):
            return Reply.json(
                200,
                {
                    "method": request.method,
                    "path": request.path,
                    "headers": [list(pair) for pair in request.headers],
                    "body_length": body_length,
                },
            )
        if match := re.fullmatch(r"/after/(\w+)", request.path):
            release = f"/echo/release/{match[1]}"
            try:
                self.wait_for(lambda r: r.path == release, IDLE_DEADLINE)
            except TimeoutError:
                return Reply.of(504, f"no {release} came\n".encode())
            return self.reply(replace(request, path="/echo" + request.path), body_length)
        if match := re.fullmatch(r"/bytes/(\d+)(\?.*)?", request.path):  # a query ignored
            n = int(match[1])
            if n > BYTES_MAX:
                return Reply.of(400, f"at most {BYTES_MAX} bytes\n".encode())
            return Reply(200, "application/octet-stream", n, _pattern(n))
        return Reply.of(404, b"not found\n")

    def stop(self) -> None:
        """Stop accepting, end every connection and close; idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self.shutdown()  # serve_forever returns: nothing more is accepted
        self._serving.join(STOP_DEADLINE)
        with self._lock:
            connections, workers = list(self._connections), list(self._workers)
        for conn in connections:
            _shut(conn)
        for worker in workers:
            worker.join(STOP_DEADLINE)
        self.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the server's machinery

    def process_request(self, request: Any, client_address: Any) -> None:
        worker = threading.Thread(
            target=self._work, args=(request, client_address), name=f"stand-in :{self.port}"
        )
        worker.daemon = True
        with self._lock:
            self._workers.add(worker)
        worker.start()

    def _work(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._workers.discard(threading.current_thread())

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The handshake runs here, in the connection's thread, not in the accepting one.
        conn: socket.socket = request
        if not self._track(conn):
            return
        try:
            conn.settimeout(IDLE_DEADLINE)
            if self._tls:
                _tls_server_name.value = None
                tls_conn = self._tls.wrap_socket(conn, server_side=True)  # detaches `conn`
                self._untrack(conn)
                conn = tls_conn
                if not self._track(conn):
                    return
            _Handler(conn, client_address, self, getattr(_tls_server_name, "value", None))
        finally:
            self._untrack(conn)
            _shut(conn, socket.SHUT_WR)
            conn.close()

    def _track(self, conn: socket.socket) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._connections.add(conn)
            return True

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def record(self, request: Recorded) -> None:
        with self._changed:
            self._requests.append(request)
            self._changed.notify_all()

    def cut(self, path: str, sent: int) -> None:
        with self._changed:
            self._cut[path] = sent
            self._changed.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away, a handshake refused, a socket stop() shut: not our errors.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class Mute:
    """A TCP listener on (`address`, an ephemeral port) that accepts and then neither reads
    nor writes: a host whose TLS handshake never ends. Its connections are closed by
    `close()` (or the end of a `with`)."""

    def __init__(self, address: str | None = None) -> None:
        self.address = own_address() if address is None else address
        family = (
            socket.AF_INET6 if ipaddress.ip_address(self.address).version == 6 else socket.AF_INET
        )
        self.sock = socket.create_server((self.address, 0), family=family)
        self.port: int = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name=f"mute :{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.accepted.append(conn)

    def close(self) -> None:
        _shut(self.sock)
        self.sock.close()
        self._thread.join(STOP_DEADLINE)
        for conn in self.accepted:
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _shut(conn: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    # socket.socket's own shutdown, not SSLSocket's: that one drops its TLS state, which
    # the connection's thread may be using at this moment.
    with contextlib.suppress(OSError):  # already closed, or detached by the TLS wrap
        socket.socket.shutdown(conn, how)


def _pattern(n: int) -> Iterator[bytes]:
    """n bytes of 0, 1, ..., 255, 0, 1, ... (a shifted or dropped chunk shows)."""
    block = bytes(range(256)) * (CHUNK // 256)
    while n > 0:
        yield block[: min(n, CHUNK)]
        n -= CHUNK


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every reply carries a Content-Length
    disable_nagle_algorithm = True
    server: StandIn

    def __init__(
        self, request: Any, client_address: Any, server: StandIn, sni: str | None = None
    ) -> None:
        self.sni = sni
        super().__init__(request, client_address, server)

    def dispatch(self) -> None:
        request = Recorded(
            method=self.command,
            host=self.headers.get("Host"),
            path=self.path,
            headers=tuple(self.headers.items()),
            server_name=self.sni,
        )
        self.server.record(request)
        if self.path.startswith(("/endless-head", "/endless-chunk")):
            self._endless()
            return
        body_length = self._read_body()
        reply = self.server.reply(request, body_length)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(reply.length))
        for name, value in reply.headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            for chunk in reply.chunks:
                self.wfile.write(chunk)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = dispatch

    def _endless(self) -> None:
        """An answer that never ends, written until the client goes (or ENDLESS_MAX)."""
        self.close_connection = True
        if self.path.startswith("/endless-head"):
            first, block = b"HTTP/1.1 200 OK\r\n", (b"X-Filler: " + b"a" * 1000 + b"\r\n") * 64
        else:  # hex digits: a chunk's size, and never the line's end
            first, block = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"f" * CHUNK
        sent = 0
        try:
            self.wfile.write(first)
            while sent < ENDLESS_MAX:
                self.wfile.write(block)
                sent += len(block)
        except OSError:
            pass
        self.server.cut(self.path, sent)

    def _read_body(self) -> int:
        """Read the request's body (Content-Length or chunked), keeping only its length."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            total = 0
            while size := int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16):
                total += self._discard(size)
                self.rfile.readline(1024)  # the CRLF after the chunk
            while self.rfile.readline(8192).strip():  # trailers, up to the empty line
                pass
            return total
        return self._discard(int(self.headers.get("Content-Length") or 0))

    def _discard(self, n: int) -> int:
        left = n
        while left > 0:
            data = self.rfile.read(min(left, CHUNK))
            if not data:
                raise ConnectionError("the client closed the connection inside a body")
            left -= len(data)
        return n

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the recorded requests say what came; stderr stays for failures


# --- the package index ----------------------------------------------------------------------
