"""The egress proxy in cluster mode (issue 28), as its pod runs it: one TCP listener for
every session's kernels, the sessions told over a Unix control socket as the feeder tells
them, verdicts read from the audit socket. The real proxy (from .venv-egress, not
confined: in its pod it is the container's one process) and stand-ins on this machine's
address (tests/egress_standins.py) that its resolver maps the test names to.

Each test waits on what the proxy does (an answer, a record on the audit socket, a
connection's end), never on time passing.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_proxy import Process
from egress_standins import StandIn, TestCA, own_address
from mcp_forge.api import keys
from mcp_forge.egress import protocol
from mcp_forge.egress.client import default_python

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

DEADLINE = 5.0  # seconds any one wait of a test may take
CONNECTIONS_MAX = 3  # a session's open connections, lowered for these tests
AUDIT_BUFFER = 4096  # what an audit reader may fall behind, lowered to see records dropped
RATE = 4 << 20  # a session's bytes a second each way (the other tests move a few KB)
VALUE = "v-" + os.urandom(12).hex()  # added to session A's requests to inj.test
A, B = "team-a/alpha", "team-b/beta"


# ---- the proxy's process and its two sockets -------------------------------------------


class Control:
    """A controller, as the feeder is: one request, one answer."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(DEADLINE)
        self.sock.connect(str(path))
        self.reader = protocol.Reader(self.sock)

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        protocol.send(self.sock, message)
        got = self.reader.read()
        assert got is not None, "the proxy closed the control socket"
        return got[0]

    def open(self, session: Session) -> dict[str, Any]:
        return self.call({"op": "open", **session.grant})

    def leave(self) -> None:
        """Go away, and see the proxy let go (it closes its end after ours)."""
        self.sock.shutdown(socket.SHUT_WR)
        assert self.sock.recv(1) == b""
        self.sock.close()


class Tap:
    """A reader of the audit socket that keeps up: every record, in order."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.lines = self.sock.makefile("rb")
        assert json.loads(self.lines.readline()) == {"event": "audit", "dropped": 0}
        self.records: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self.lines:
                with self.changed:
                    self.records.append(json.loads(line))
                    self.changed.notify_all()

    def wait_for(
        self, match: Callable[[dict[str, Any]], bool], count: int = 1
    ) -> list[dict[str, Any]]:
        """The first `count` records that match, waiting for them to come."""
        found: list[dict[str, Any]] = []

        def enough() -> bool:
            found[:] = [r for r in self.records if match(r)]
            return len(found) >= count

        with self.changed:
            if not self.changed.wait_for(enough, DEADLINE):
                raise AssertionError(f"{len(found)} of {count} records; last: {self.records[-5:]}")
        return found[:count]

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class Session:
    name: str
    token: str
    rules: list[dict[str, Any]]
    ca: keys.BridgeCert | None = None
    values: list[list[Any]] = dataclasses.field(default_factory=list)
    sources: list[str] | None = None  # its pod's addresses; None: not bound

    @property
    def grant(self) -> dict[str, Any]:
        ca = {"cert": self.ca.cert, "key": self.ca.key} if self.ca else None
        bound = {"sources": self.sources} if self.sources is not None else {}
        return {"session": self.name, "token": self.token, "rules": self.rules,
                "values": self.values, "ca": ca, **bound}  # fmt: skip


@dataclasses.dataclass
class Cluster:
    flags: tuple[str, ...]  # the resolver's table and the stand-ins' CA
    process: Process
    control: Control
    tap: Tap
    ca: TestCA
    https: StandIn
    plain: StandIn
    sessions: dict[str, Session]

    def rules(self, *names: str) -> list[dict[str, Any]]:
        own = [f"{self.https.address}/32"]
        ports = [self.https.port, self.plain.port]
        return [{"host": n, "ports": ports, "addresses": own} for n in names]

    def session(self, name: str, *hosts: str) -> Session:
        """A session of the test's own, opened; closed at the test's end by `cleanup`."""
        session = Session(name, protocol.token_for(os.urandom(32)), self.rules(*hosts))
        assert self.control.open(session) == {"ok": True}
        return session


@dataclasses.dataclass
class Answer:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    address = own_address()
    ca = TestCA(tmp / "ca", names=("a.test", "b.test", "c.test", "inj.test"), addresses=(address,))
    table = tmp / "resolve.json"
    table.write_text(json.dumps({n: [address] for n in ("a.test", "b.test", "c.test", "inj.test")}))
    flags = ("--resolve", str(table), "--upstream-ca", str(ca.ca_path))
    with StandIn(address, ca) as https, StandIn(address) as plain:
        process = Process(
            tmp / "proxy", *flags, "--connections-max", str(CONNECTIONS_MAX),
            "--audit-buffer", str(AUDIT_BUFFER), "--bandwidth-max", str(RATE),
        )  # fmt: skip
        control = Control(process.control_path)
        tap = Tap(process.audit_path)
        here = Cluster(flags, process, control, tap, ca, https, plain, {})
        inject = {"header": "X-Api-Key", "secretKeyRef": {"name": "s", "key": "k"}}
        a = Session(A, protocol.token_for(os.urandom(32)), here.rules("a.test", "inj.test"))
        a.rules[1]["inject"] = [inject]
        a.ca, a.values = keys.new_egress_ca(A), [[2, 0, VALUE]]
        b = Session(B, protocol.token_for(os.urandom(32)), here.rules("b.test", "inj.test"))
        for session in (a, b):
            assert control.open(session) == {"ok": True}
            here.sessions[session.name] = session
        yield here
        tap.close()
        process.stop()


@pytest.fixture
def cleanup(cluster: Cluster) -> Iterator[list[str]]:
    """Sessions a test opened: closed after it."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.control.call({"op": "close", "session": name})


# ---- a kernel's requests, byte by byte -----------------------------------------------------


def auth(token: str, user: str = protocol.PROXY_USER) -> str:
    return base64.b64encode(f"{user}:{token}".encode()).decode()


def read_answer(sock: socket.socket | ssl.SSLSocket) -> Answer:
    """One HTTP answer: its head, and a body of its Content-Length."""
    head = b""
    while b"\r\n\r\n" not in head:
        byte = sock.recv(1)
        assert byte, f"closed after {head!r}"
        head += byte
    lines = head.decode("latin-1").split("\r\n")
    _, status, reason = [*lines[0].split(" ", 2), ""][:3]
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    body, length = bytearray(), int(headers.get("content-length", "0"))
    while len(body) < length:
        more = sock.recv(min(length - len(body), 1 << 20))  # not past it: an answer may follow
        assert more, f"closed inside the body of {lines[0]!r}"
        body += more
    return Answer(int(status), reason, headers, bytes(body))


def dial(cluster: Cluster) -> socket.socket:
    return socket.create_connection(cluster.process.address, timeout=DEADLINE)


def tunnel(cluster: Cluster, token: str, host: str) -> tuple[socket.socket, Answer]:
    """A CONNECT to host on the stand-in's port: the socket, and the proxy's answer."""
    sock = dial(cluster)
    return sock, send_connect(sock, f"{host}:{cluster.https.port}", auth(token))


def get(sock: socket.socket, host: str, path: str, context: ssl.SSLContext) -> Answer:
    """An HTTPS GET through an open tunnel, trusting `context`'s CAs."""
    tls = context.wrap_socket(sock, server_hostname=host)
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return read_answer(tls)


def https(cluster: Cluster, session: Session, host: str, path: str = "/echo") -> Answer:
    """A GET of host through a tunnel of its own, the server's certificate checked."""
    sock, answer = tunnel(cluster, session.token, host)
    with sock:
        assert answer.status == 200, answer
        return get(sock, host, path, cluster.ca.client_context())


def ended(sock: socket.socket) -> bool:
    """Whether the far end closes the connection (within the deadline)."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, ssl.SSLEOFError):
        return True


def connect_head(authority: str, credential: str | None) -> bytes:
    header = f"Proxy-Authorization: Basic {credential}\r\n" if credential else ""
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{header}\r\n".encode()


def send_connect(sock: socket.socket, authority: str, credential: str | None) -> Answer:
    sock.sendall(connect_head(authority, credential))
    return read_answer(sock)


def marker() -> str:
    return f"/echo/{uuid.uuid4().hex[:12]}"


def header(recorded: Any, name: str) -> str | None:
    return next((v for k, v in recorded.headers if k.lower() == name.lower()), None)


def verdict(session: str, host: str, allowed: bool) -> Callable[[dict[str, Any]], bool]:
    def match(record: dict[str, Any]) -> bool:
        return (
            record.get("event") == "connect"
            and record.get("session") == session
            and (record.get("allowed") is allowed and record.get("host") == host)
        )

    return match


# ---- the tests -----------------------------------------------------------------------------


def test_two_sessions_on_one_listener_each_reach_only_their_own_hosts(cluster: Cluster) -> None:
    a, b = cluster.sessions[A], cluster.sessions[B]
    assert https(cluster, a, "a.test").status == 200
    assert https(cluster, b, "b.test").status == 200
    for session, elsewhere in ((a, "b.test"), (b, "a.test")):
        sock, answer = tunnel(cluster, session.token, elsewhere)
        sock.close()
        assert answer.status == 403, answer
        assert f"no rule allows {elsewhere}" in answer.reason, answer
        assert f"session {session.name}:" in answer.body.decode(), answer


def test_a_connection_speaks_only_for_the_session_it_named_first(cluster: Cluster) -> None:
    """On one connection: A's request, then B's credential for B's own host: no one's."""
    a, b = cluster.sessions[A], cluster.sessions[B]
    ours, theirs = marker(), marker()
    with dial(cluster) as sock:
        for session, host, path in ((a, "a.test", ours), (b, "b.test", theirs)):
            target = f"{host}:{cluster.plain.port}"
            sock.sendall(
                f"GET http://{target}{path} HTTP/1.1\r\nHost: {target}\r\n"
                f"Proxy-Authorization: Basic {auth(session.token)}\r\n\r\n".encode()
            )
            answer = read_answer(sock)
            assert answer.status == (200 if session is a else 407), answer
    cluster.plain.wait_for(lambda r: r.path == ours, DEADLINE)
    assert not [r for r in cluster.plain.requests if r.path == theirs]


def test_a_connection_straight_to_mitmproxys_port_is_no_sessions(cluster: Cluster) -> None:
    """From inside the proxy's pod (the feeder's container shares its loopback): no
    session's bound or pace would hold, so no session's credential works."""
    (port,) = listening_ports(cluster.process.proc.pid) - {cluster.process.address[1]}
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        answer = send_connect(sock, f"a.test:{cluster.https.port}", auth(cluster.sessions[A].token))
    assert answer.status == 403 and "the proxy's listener" in answer.reason, answer


def listening_ports(pid: int) -> set[int]:
    """The IPv4 TCP ports process `pid` listens on (its sockets, in /proc)."""
    fds = Path(f"/proc/{pid}/fd")
    held = {os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()}
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # local address, ..., state (0A: LISTEN), ..., inode
        if fields[3] == "0A" and f"socket:[{fields[9]}]" in held:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.parametrize(
    "credential", ["none", "another token", "another user", "a longer token", "not ascii"]
)
def test_a_missing_or_wrong_credential_gets_a_407(cluster: Cluster, credential: str) -> None:
    token = cluster.sessions[A].token
    sent = {
        "none": None,
        "another token": auth(protocol.token_for(os.urandom(8))),
        "another user": auth(token, "kernel"),
        "a longer token": auth(token + "0"),
        "not ascii": auth(token[:-1] + "\u00e9"),
    }[credential]
    with dial(cluster) as sock:
        answer = send_connect(sock, f"a.test:{cluster.https.port}", sent)
    assert answer.status == 407, answer
    assert "proxy-authenticate" in answer.headers


def test_a_value_is_added_over_https_for_its_own_session_only(cluster: Cluster) -> None:
    """A's rule for inj.test adds a header: the proxy reads A's tunnel with A's CA and
    adds it. B's rule for inj.test adds nothing: its tunnel passes unread."""
    a, b = cluster.sessions[A], cluster.sessions[B]
    assert a.ca is not None
    ours, theirs = marker(), marker()
    sock, answer = tunnel(cluster, a.token, "inj.test")
    with sock:
        assert answer.status == 200, answer
        context = ssl.create_default_context(cadata=a.ca.cert)  # the proxy's certificate
        assert get(sock, "inj.test", ours, context).status == 200
    assert header(cluster.https.wait_for(lambda r: r.path == ours, DEADLINE), "X-Api-Key") == VALUE
    sock, answer = tunnel(cluster, b.token, "inj.test")
    with sock:
        assert answer.status == 200, answer
        assert get(sock, "inj.test", theirs, cluster.ca.client_context()).status == 200
    seen = cluster.https.wait_for(lambda r: r.path == theirs, DEADLINE)
    assert header(seen, "X-Api-Key") is None
    assert all(VALUE not in value for _, value in seen.headers)


def test_sessions_serve_on_while_the_controller_is_away_and_one_controller_at_a_time(
    cluster: Cluster,
) -> None:
    a = cluster.sessions[A]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as second:
        second.settimeout(DEADLINE)
        second.connect(str(cluster.process.control_path))
        refused = json.loads(second.makefile("rb").readline())
    assert refused == {"ok": False, "error": "another controller is connected"}
    held, answer = tunnel(cluster, a.token, "a.test")
    assert answer.status == 200, answer
    cluster.control.leave()
    try:
        assert https(cluster, a, "a.test").status == 200  # a new connection
        with held:  # and one from before
            assert get(held, "a.test", "/echo", cluster.ca.client_context()).status == 200
    finally:
        cluster.control = Control(cluster.process.control_path)
    sessions = cluster.control.call({"op": "stats"})["sessions"]
    assert {A, B} <= set(sessions), sessions


def test_opening_a_session_again_keeps_its_connections_unless_it_changed(
    cluster: Cluster, cleanup: list[str]
) -> None:
    c = cluster.session("team-c/gamma", "c.test")
    cleanup.append(c.name)
    sock, answer = tunnel(cluster, c.token, "c.test")
    assert answer.status == 200, answer
    with cluster.ca.client_context().wrap_socket(sock, server_hostname="c.test") as tls:
        assert cluster.control.open(c) == {"ok": True}  # the same grant again
        tls.sendall(b"GET /echo HTTP/1.1\r\nHost: c.test\r\n\r\n")
        assert read_answer(tls).status == 200  # kept
        old, c.token = c.token, protocol.token_for(os.urandom(32))
        assert cluster.control.open(c) == {"ok": True}  # changed: a new credential
        assert ended(tls)
    sock, answer = tunnel(cluster, old, "c.test")
    sock.close()
    assert answer.status == 407, answer
    assert https(cluster, c, "c.test").status == 200


def test_a_credential_is_good_from_its_pods_address_only(
    cluster: Cluster, cleanup: list[str]
) -> None:
    """A grant names its pod's addresses: the same credential from elsewhere (a kernel
    it leaked to) names no session. The addresses follow the pod without closing what
    the session has open; none (no pod yet) admits nothing."""
    e = cluster.session("team-e/epsilon", "c.test")
    cleanup.append(e.name)
    e.sources = ["192.0.2.77"]  # not this host's loopback, where the test dials from
    assert cluster.control.open(e) == {"ok": True}
    sock, answer = tunnel(cluster, e.token, "c.test")
    sock.close()
    assert answer.status == 403 and "from its own pod only" in answer.reason, answer
    e.sources = ["::ffff:127.0.0.1"]  # as an IPv6 socket shows an IPv4 peer
    assert cluster.control.open(e) == {"ok": True}
    held, answer = tunnel(cluster, e.token, "c.test")
    with cluster.ca.client_context().wrap_socket(held, server_hostname="c.test") as tls:
        assert answer.status == 200, answer
        e.sources = []  # its pod gone: nothing new is admitted, what is open stays
        assert cluster.control.open(e) == {"ok": True}
        sock, answer = tunnel(cluster, e.token, "c.test")
        sock.close()
        assert answer.status == 403 and "no address yet" in answer.reason, answer
        tls.sendall(b"GET /echo HTTP/1.1\r\nHost: c.test\r\n\r\n")
        assert read_answer(tls).status == 200
    bad = cluster.control.call({"op": "open", **e.grant, "sources": ["x"] * 9})
    assert not bad["ok"] and "sources" in bad["error"], bad


def test_sync_closes_the_sessions_it_does_not_name(cluster: Cluster, cleanup: list[str]) -> None:
    d = cluster.session("team-d/delta", "c.test")
    cleanup.append(d.name)
    held, answer = tunnel(cluster, d.token, "c.test")
    with held:
        assert answer.status == 200, answer
        synced = cluster.control.call({"op": "sync", "sessions": [A, B]})
        assert synced["ok"] and d.name in synced["closed"], synced
        assert A not in synced["closed"] and B not in synced["closed"], synced
        assert ended(held)
    sock, answer = tunnel(cluster, d.token, "c.test")
    sock.close()
    assert answer.status == 407, answer
    assert d.name not in cluster.control.call({"op": "stats"})["sessions"]
    assert https(cluster, cluster.sessions[A], "a.test").status == 200


def test_a_sessions_connection_bound_holds_on_the_shared_listener(
    cluster: Cluster, cleanup: list[str]
) -> None:
    e = cluster.session("team-e/epsilon", "a.test")
    cleanup.append(e.name)
    held = [tunnel(cluster, e.token, "a.test") for _ in range(CONNECTIONS_MAX)]
    try:
        assert [answer.status for _, answer in held] == [200] * CONNECTIONS_MAX
        sock, answer = tunnel(cluster, e.token, "a.test")
        with sock:
            assert answer.status == 403, answer
            assert f"{CONNECTIONS_MAX} connections of this session open" in answer.reason
            assert answer.headers.get("connection") == "close" and ended(sock)
        cluster.tap.wait_for(
            lambda r: r.get("event") == "limit" and r.get("session") == e.name
            and r.get("allowed") is False
        )  # fmt: skip
        assert https(cluster, cluster.sessions[B], "b.test").status == 200  # B unaffected
        held.pop()[0].close()
        cluster.tap.wait_for(lambda r: r.get("event") == "closed" and r.get("session") == e.name)
        held.append(tunnel(cluster, e.token, "a.test"))
        assert held[-1][1].status == 200  # a place again
        stats = cluster.control.call({"op": "stats"})["sessions"][e.name]
        assert stats["over_limit"] == 1 and stats["open"] == CONNECTIONS_MAX, stats
        # Its bytes: each connection's CONNECT, sent before the proxy knew its session.
        head = connect_head(f"a.test:{cluster.https.port}", auth(e.token))
        assert stats["bytes_out"] == (CONNECTIONS_MAX + 1) * len(head), stats
    finally:
        for sock, _ in held:
            sock.close()


def test_a_sessions_bandwidth_is_bounded_once_its_connection_is_known(
    cluster: Cluster, cleanup: list[str]
) -> None:
    """A second's burst, then RATE: twice RATE takes a second at the least (unbounded,
    a few tens of milliseconds here)."""
    g = cluster.session("team-g/eta", "a.test")
    cleanup.append(g.name)
    sock, answer = tunnel(cluster, g.token, "a.test")
    assert answer.status == 200, answer
    began = time.monotonic()
    with cluster.ca.client_context().wrap_socket(sock, server_hostname="a.test") as tls:
        tls.sendall(f"GET /bytes/{2 * RATE} HTTP/1.1\r\nHost: a.test\r\n\r\n".encode())
        assert len(read_answer(tls).body) == 2 * RATE
    assert time.monotonic() - began >= 0.9
    stats = cluster.control.call({"op": "stats"})["sessions"][g.name]
    assert stats["bytes_in"] > 2 * RATE, stats


def test_unidentified_connections_are_bounded_in_number_and_in_time(
    cluster: Cluster, tmp_path: Path
) -> None:
    process = Process(
        tmp_path / "p", *cluster.flags, "--unidentified-max", "2",
        "--unidentified-timeout", "0.5",
    )  # fmt: skip
    try:
        control, tap = Control(process.control_path), Tap(process.audit_path)
        f = Session("team-f/zeta", protocol.token_for(os.urandom(32)), cluster.rules("a.test"))
        assert control.open(f) == {"ok": True}
        known = socket.create_connection(process.address, timeout=DEADLINE)
        authority = f"a.test:{cluster.https.port}"
        assert send_connect(known, authority, auth(f.token)).status == 200
        began = time.monotonic()
        silent = socket.create_connection(process.address, timeout=DEADLINE)
        wrong = socket.create_connection(process.address, timeout=DEADLINE)
        assert send_connect(wrong, authority, auth("x" * 64)).status == 407
        with socket.create_connection(process.address, timeout=DEADLINE) as third:
            assert ended(third)
        tap.wait_for(lambda r: "2 unidentified connections open" in r.get("reason", ""))
        assert ended(silent) and ended(wrong)
        assert time.monotonic() - began >= 0.45
        expired = tap.wait_for(lambda r: "no credential within 0.5 s" in r.get("reason", ""), 2)
        assert all(r["event"] == "limit" and r["peer"] == "127.0.0.1" for r in expired)
        with known:  # identified: not bounded in time
            assert get(known, "a.test", "/echo", cluster.ca.client_context()).status == 200
        tap.close()
    finally:
        process.stop()


def test_audit_readers_get_each_verdict_and_a_slow_one_stalls_nothing(cluster: Cluster) -> None:
    a = cluster.sessions[A]
    assert https(cluster, a, "a.test").status == 200
    tunnel(cluster, a.token, "b.test")[0].close()
    for allowed, host in ((True, "a.test"), (False, "b.test")):
        cluster.tap.wait_for(verdict(A, host, allowed))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        slow.settimeout(DEADLINE)
        slow.connect(str(cluster.process.audit_path))
        lines = slow.makefile("rb")
        assert json.loads(lines.readline()) == {"event": "audit", "dropped": 0}
        # Then it reads nothing while 300 requests are refused, one record each.
        name, n = f"m-{uuid.uuid4().hex[:8]}.test", 300
        with dial(cluster) as sock:
            sock.sendall(f"GET http://{name}/ HTTP/1.1\r\nHost: {name}\r\n\r\n".encode() * n)
            assert {read_answer(sock).status for _ in range(n)} == {407}
        cluster.tap.wait_for(lambda r: r.get("event") == "unknown" and r.get("host") == name, n)
        seen = 0
        for line in lines:  # what it had, then the count of what it lost
            record = json.loads(line)
            if record.get("event") == "audit":
                break
            seen += record.get("host") == name
        assert record["dropped"] > 0 and seen < n <= seen + record["dropped"], (seen, record)


def test_sigterm_ends_the_proxy_promptly_and_cleanly(tmp_path: Path) -> None:
    process = Process(tmp_path / "p")
    idle = socket.create_connection(process.address, timeout=DEADLINE)
    began = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    assert process.proc.wait(DEADLINE) == 0
    assert time.monotonic() - began < 2.0
    with idle:
        assert ended(idle)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(process.address, timeout=DEADLINE).close()
    assert not process.control_path.exists() and not process.audit_path.exists()
