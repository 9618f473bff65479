"""The kernel pod's egress relay (kernelside/egress_relay.py): TCP on loopback carried to
a Unix socket, bytes unread, with back-pressure, half-closes and a bound on pairs. Real
sockets on this machine; the far end is a server of the test's own."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mcp_forge.kernelside.egress_relay import BUFFER, Relay, listen

DEADLINE = 10.0  # seconds any single socket operation of a test may wait


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()


def count_then_answer(conn: socket.socket) -> None:
    got = 0
    while data := conn.recv(65536):  # until the client's half-close arrives
        got += len(data)
    conn.sendall(f"got {got}".encode())
    conn.close()


@contextmanager
def far_end(handler: Callable[[socket.socket], None] | None) -> Iterator[str]:
    """A Unix socket server running `handler` per connection (None: no server at all)."""
    with tempfile.TemporaryDirectory(prefix="mf-relay-") as scratch:  # a short path
        yield from _serve(os.path.join(scratch, "egress.sock"), handler)


def _serve(path: str, handler: Callable[[socket.socket], None] | None) -> Iterator[str]:
    if handler is None:
        yield path
        return
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)

    def loop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.settimeout(DEADLINE)
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield path
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        Path(path).unlink()


@contextmanager
def relay_to(path: str, connections_max: int = 256) -> Iterator[tuple[int, Relay]]:
    """The relay on an ephemeral loopback port, serving in a thread; its port and it."""
    listener = listen(0)
    relay = Relay(listener, path, connections_max)
    thread = threading.Thread(target=relay.serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], relay
    finally:
        relay.stop()
        thread.join(DEADLINE)
        listener.close()
        assert not thread.is_alive()


def dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


def test_bytes_pass_both_ways_unchanged_past_the_buffer() -> None:
    payload = os.urandom(16 * BUFFER + 123)  # far more than a direction holds
    with far_end(echo) as path, relay_to(path) as (port, _), dial(port) as c:

        def write() -> None:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        assert read_to_end(c) == payload
        writer.join(DEADLINE)


def test_a_half_close_is_passed_on_and_the_answer_still_comes_back() -> None:
    with far_end(count_then_answer) as path, relay_to(path) as (port, _), dial(port) as c:
        c.sendall(b"x" * 1000)
        c.shutdown(socket.SHUT_WR)  # the server answers only once it sees this
        assert read_to_end(c) == b"got 1000"


def test_with_no_far_end_a_connection_is_closed_at_once() -> None:
    with far_end(None) as path, relay_to(path) as (port, _), dial(port) as c:
        assert c.recv(1) == b""  # closed, not left hanging


def test_pairs_past_the_bound_are_refused_and_the_others_carry_on() -> None:
    with far_end(echo) as path, relay_to(path, connections_max=2) as (port, relay):
        with dial(port) as a, dial(port) as b:
            for s in (a, b):  # both pairs made before the third is tried
                s.sendall(b"ping")
                assert s.recv(4) == b"ping"
            with dial(port) as c, contextlib.suppress(ConnectionResetError):
                assert c.recv(1) == b""  # closed (reset, if data was unread): refused
            a.sendall(b"still")
            assert a.recv(5) == b"still"
        with relay.changed:  # both pairs seen closed and dropped: room again
            assert relay.changed.wait_for(lambda: relay.pairs == 0, DEADLINE)
        with dial(port) as d:  # the two pairs closed: room again
            d.sendall(b"again")
            assert d.recv(5) == b"again"


def test_many_pairs_at_once_each_get_their_own_bytes() -> None:
    with far_end(echo) as path, relay_to(path) as (port, _):
        socks = [dial(port) for _ in range(20)]
        try:
            for i, s in enumerate(socks):
                s.sendall(f"pair {i:02d}".encode())
            for i, s in enumerate(socks):
                assert s.recv(7) == f"pair {i:02d}".encode()
        finally:
            for s in socks:
                s.close()


def refuse_early(conn: socket.socket) -> None:
    """As the proxy refusing a request: its head read, a 403 sent, the rest never read."""
    conn.recv(64)
    conn.sendall(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
    conn.close()


def test_a_refusal_sent_before_the_body_is_read_still_reaches_the_client() -> None:
    with far_end(refuse_early) as path, relay_to(path) as (port, _):
        for _ in range(5):
            with dial(port) as c:
                c.sendall(b"POST / HTTP/1.1\r\ncontent-length: 4000000\r\n\r\n")
                with contextlib.suppress(OSError):  # the far end stopped reading: so be it
                    c.sendall(b"x" * 4_000_000)
                assert read_to_end(c).startswith(b"HTTP/1.1 403 Forbidden")


def test_a_far_end_with_a_full_backlog_is_dialled_again_without_stalling_others() -> None:
    scratch = tempfile.TemporaryDirectory(prefix="mf-relay-")
    path = os.path.join(scratch.name, "egress.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)  # one connection waits in the backlog; the next finds it full
    try:
        with relay_to(path) as (port, relay):
            first = dial(port)
            with relay.changed:
                assert relay.changed.wait_for(lambda: relay.pairs == 1, DEADLINE)
            waiting = [dial(port) for _ in range(3)]
            with relay.changed:  # each made a pair being dialled
                assert relay.changed.wait_for(lambda: relay.pairs == 4, DEADLINE)
            accepted = []
            for _ in range(4):  # now the far end takes them, one by one
                conn, _ = server.accept()
                conn.settimeout(DEADLINE)
                accepted.append(conn)
            for i, c in enumerate([first, *waiting]):
                c.sendall(f"n{i}".encode())
            got = sorted(conn.recv(2) for conn in accepted)
            assert got == [b"n0", b"n1", b"n2", b"n3"]
            for sock in [first, *waiting, *accepted]:
                sock.close()
    finally:
        server.close()
        scratch.cleanup()
