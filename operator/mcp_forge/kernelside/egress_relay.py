"""The kernel pod's end of its one way out (issue 28): TCP on the pod's loopback, relayed
to the Unix socket the host hands into the pod.

A local kernel's pod has no network but `lo`. Programs in it (pip, requests, curl) speak
to a proxy over TCP (`HTTP(S)_PROXY=http://127.0.0.1:PORT`); this relay accepts those
connections and carries their bytes, unread, to the egress socket mounted into the pod,
whose far end is the host's egress proxy. That proxy decides everything (api/egress.py);
the relay decides nothing and holds no secret, so code in the kernel that stops it, or
binds the port first, or dials the socket itself, gains nothing: it only breaks its own
way out.

One thread, one selector, non-blocking sockets: at most `connections_max` pairs, each
with a buffer of at most `BUFFER` bytes per direction (a side whose peer is slow stops
being read), half-closes passed on, and a pair whose far end cannot be reached closed at
once. Run as `python -P -c <source> PORT SOCKET` beside the kernel: the standard library
only.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import struct
import sys
import threading

BUFFER = 64 * 1024  # bytes held per direction of a pair
CONNECTIONS_MAX = 256
CONNECT_TIMEOUT = 2.0  # seconds the far end may take to accept a connection


class _Side:
    """One socket of a pair: what was read from its peer and waits to be written to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # bytes for this socket
        self.peer: _Side | None = None
        self.read_done = False  # this socket's reader saw EOF
        self.shut = False  # this socket's write side was shut

    def close(self, sel: selectors.BaseSelector) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(self.sock)
        self.sock.close()


class Relay:
    """Accept on `listener`; each connection relayed to the Unix socket `target`."""

    def __init__(
        self, listener: socket.socket, target: str, connections_max: int = CONNECTIONS_MAX
    ) -> None:
        self.listener = listener
        self.target = target
        self.connections_max = connections_max
        self.pairs = 0
        self.changed = threading.Condition()  # notified when a pair is made or dropped
        self.sel = selectors.DefaultSelector()
        self.stopped = threading.Event()
        self._wake, self._waker = socket.socketpair()  # stop() ends a select at once

    def serve(self) -> None:
        """Relay until stop() is called."""
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.sel.register(self._wake, selectors.EVENT_READ, self._wake)
        while not self.stopped.is_set():
            for key, events in self.sel.select():
                if key.data is None:
                    self._accept()
                elif key.data is not self._wake:
                    self._step(key.data, events)

    def stop(self) -> None:
        self.stopped.set()
        self._waker.send(b"x")

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if self.pairs >= self.connections_max:
            client.close()  # past the bound: the program sees its connection refused
            return
        far = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A local socket answers at once, or has a full backlog for a moment (a burst of
        # connections): the relay waits that long, no longer, then refuses the pair.
        # (A Unix socket's connect with a timeout in Python is non-blocking: a full backlog
        # fails at once. Blocking, it waits up to SO_SNDTIMEO, which the kernel applies.)
        far.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(CONNECT_TIMEOUT), 0)
        )
        try:
            far.connect(self.target)
        except OSError:
            far.close()
            client.close()
            return
        client.setblocking(False)
        far.setblocking(False)
        a, b = _Side(client), _Side(far)
        a.peer, b.peer = b, a
        self._count(+1)
        for side in (a, b):
            self.sel.register(side.sock, selectors.EVENT_READ, side)

    def _step(self, side: _Side, events: int) -> None:
        peer = side.peer
        assert peer is not None
        if events & selectors.EVENT_WRITE and not self._flush(side):
            return
        room = BUFFER - len(peer.pending)
        if events & selectors.EVENT_READ and not side.read_done and room > 0:
            try:
                data = side.sock.recv(room)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._drop(side)
                return
            if data == b"":
                side.read_done = True
            elif data:
                peer.pending += data
            if not self._flush(peer):
                return
        self._watch(side)
        self._watch(peer)
        if side.read_done and peer.read_done and not side.pending and not peer.pending:
            self._drop(side)

    def _flush(self, side: _Side) -> bool:
        """Write what waits for `side`; shut its write side once its peer is done. False
        if the pair was dropped."""
        peer = side.peer
        assert peer is not None
        if side.pending:
            try:
                sent = side.sock.send(side.pending)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(side)
                return False
            del side.pending[:sent]
        if peer.read_done and not side.pending and not side.shut:
            side.shut = True
            try:
                side.sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    self._drop(side)
                    return False
        return True

    def _watch(self, side: _Side) -> None:
        """Read while there is room for the peer; write while bytes wait."""
        peer = side.peer
        assert peer is not None
        mask = 0
        if not side.read_done and len(peer.pending) < BUFFER:
            mask |= selectors.EVENT_READ
        if side.pending:
            mask |= selectors.EVENT_WRITE
        try:
            if mask:
                self.sel.modify(side.sock, mask, side)
            else:
                self.sel.unregister(side.sock)
        except (KeyError, ValueError):
            if mask:
                self.sel.register(side.sock, mask, side)

    def _drop(self, side: _Side) -> None:
        peer = side.peer
        assert peer is not None
        if side.sock.fileno() < 0 and peer.sock.fileno() < 0:
            return
        side.close(self.sel)
        peer.close(self.sel)
        self._count(-1)

    def _count(self, change: int) -> None:
        with self.changed:
            self.pairs += change
            self.changed.notify_all()


def listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock


def main(argv: list[str]) -> None:
    port, target = int(argv[0]), argv[1]
    Relay(listen(port), target).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
