"""The kernel pod's end of its one way out (issue 28): TCP on the pod's loopback, relayed
to the Unix socket the host hands into the pod.

A local kernel's pod has no network but `lo`. Programs in it (pip, requests, curl) speak
to a proxy over TCP (`HTTP(S)_PROXY=http://127.0.0.1:PORT`); this relay accepts those
connections and carries their bytes, unread, to the egress socket mounted into the pod,
whose far end is the host's egress proxy. That proxy decides everything (api/egress.py);
the relay decides nothing and holds no secret, so code in the kernel that stops it, or
binds the port first, or dials the socket itself, gains nothing: it only breaks its own
way out.

One thread, one selector, non-blocking sockets:
* at most `connections_max` pairs; each direction holds at most `BUFFER` bytes (a side
  whose peer is slow stops being read);
* the far end is dialled without blocking the others: a full backlog is tried again
  every `RETRY` seconds for `CONNECT_TIMEOUT`, then the connection is closed;
* a half-close is passed on; a write that fails ends that direction only, so an answer
  still on its way (the proxy's 403 to a request whose body it did not want) is read
  and delivered;
* a socket is closed after its write side is shut and what it still sends is read and
  dropped for up to `LINGER` seconds, so that its peer gets the last bytes, not a reset;
* out of descriptors or memory, the relay stops accepting until a pair ends; any other
  fault ends the one pair it happened in, never the relay.

Run as `python -P -c <source> PORT SOCKET` beside the kernel (egress_start.py starts it):
the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import sys
import threading
import time

BUFFER = 64 * 1024  # bytes held per direction of a pair
CONNECTIONS_MAX = 256
CONNECT_TIMEOUT = 2.0  # seconds the far end may take to accept a connection
RETRY = 0.05  # seconds between two tries of a far end whose backlog is full
LINGER = 2.0  # seconds a closing socket's last bytes are read and dropped
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Side:
    """One socket of a pair: what was read from its peer and waits to be written to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # bytes for this socket
        self.peer: _Side
        self.read_done = False  # nothing more is read from this socket
        self.write_done = False  # nothing more is written to it (shut, or it failed)


class Relay:
    """Accept on `listener`; each connection relayed to the Unix socket `target`."""

    def __init__(
        self, listener: socket.socket, target: str, connections_max: int = CONNECTIONS_MAX
    ) -> None:
        self.listener = listener
        self.target = target
        self.connections_max = connections_max
        self.pairs = 0  # pairs made or being made
        self.changed = threading.Condition()  # notified when a pair is made or ends
        self.sel = selectors.DefaultSelector()
        self.stopped = threading.Event()
        self._wake, self._waker = socket.socketpair()  # stop() ends a select at once
        self._dialing: list[tuple[socket.socket, socket.socket, float]] = []
        self._closing: dict[socket.socket, float] = {}  # lingering sockets, their deadline
        self._accepting = False
        self._open: set[socket.socket] = set()  # sockets of pairs that have not ended

    def serve(self) -> None:
        """Relay until stop() is called; then every socket is closed."""
        self.listener.setblocking(False)
        self._listen(True)
        self.sel.register(self._wake, selectors.EVENT_READ, self._wake)
        try:
            while not self.stopped.is_set():
                for key, events in self.sel.select(self._timeout()):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, _Side):
                        self._guarded(key.data, events)
                    elif key.data == "closing":
                        self._linger(key.fileobj)  # type: ignore[arg-type]
                self._tick()
        finally:
            self._close_all()

    def stop(self) -> None:
        self.stopped.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"x")

    # ---- accepting and dialling ------------------------------------------------------

    def _listen(self, on: bool) -> None:
        if on and not self._accepting:
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        elif not on and self._accepting:
            self.sel.unregister(self.listener)
        self._accepting = on

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            if exc.errno in _SCARCE:
                self._listen(False)  # until a pair ends (_count), or it spins
            return
        if self.pairs >= self.connections_max:
            client.close()  # past the bound: the program sees its connection closed
            return
        self._count(+1)
        try:
            far = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            client.close()
            self._count(-1)
            return
        far.setblocking(False)
        self._dial(client, far, time.monotonic() + CONNECT_TIMEOUT)

    def _dial(self, client: socket.socket, far: socket.socket, deadline: float) -> None:
        """Connect `far`; a full backlog (EAGAIN, at once for a Unix socket) is tried
        again by _tick until `deadline`."""
        try:
            far.connect(self.target)
        except BlockingIOError:
            if time.monotonic() < deadline:
                self._dialing.append((client, far, deadline))
                return
            far.close()
            client.close()
            self._count(-1)
            return
        except OSError:
            far.close()
            client.close()
            self._count(-1)
            return
        client.setblocking(False)
        a, b = _Side(client), _Side(far)
        a.peer, b.peer = b, a
        for side in (a, b):
            self._open.add(side.sock)
            self.sel.register(side.sock, selectors.EVENT_READ, side)

    def _tick(self) -> None:
        """Dials to try again, lingering sockets past their time."""
        dialing, self._dialing = self._dialing, []
        for client, far, deadline in dialing:
            self._dial(client, far, deadline)
        now = time.monotonic()
        for sock, deadline in list(self._closing.items()):
            if now >= deadline:
                self._forget(sock)

    def _timeout(self) -> float | None:
        if self._dialing:
            return RETRY
        if self._closing:
            return max(0.0, min(self._closing.values()) - time.monotonic())
        return None

    # ---- relaying --------------------------------------------------------------------

    def _guarded(self, side: _Side, events: int) -> None:
        try:
            self._step(side, events)
        except Exception:  # a fault of one pair ends that pair, never the relay
            self._end(side)

    def _step(self, side: _Side, events: int) -> None:
        if side.sock not in self._open:
            return  # an event of this select for a pair that ended in it
        peer = side.peer
        if events & selectors.EVENT_WRITE:
            self._flush(side)
        room = BUFFER - len(peer.pending)
        if events & selectors.EVENT_READ and not side.read_done and room > 0:
            try:
                data = side.sock.recv(room)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""  # reset: this direction ends as at EOF
            if data == b"":
                side.read_done = True
            elif data:
                if peer.write_done:
                    pass  # its peer takes nothing more: dropped, as a closed socket would
                else:
                    peer.pending += data
            self._flush(peer)
        if side.read_done and peer.read_done and not side.pending and not peer.pending:
            self._end(side)
            return
        self._watch(side)
        self._watch(peer)

    def _flush(self, side: _Side) -> None:
        """Write what waits for `side`; once its peer is read out, shut its write side. A
        write that fails ends this direction: what waits is dropped, its source unread."""
        if side.pending and not side.write_done:
            try:
                sent = side.sock.send(side.pending)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                side.write_done = True
                side.pending.clear()
                side.peer.read_done = True
                return
            del side.pending[:sent]
        if side.peer.read_done and not side.pending and not side.write_done:
            side.write_done = True
            with contextlib.suppress(OSError):
                side.sock.shutdown(socket.SHUT_WR)

    def _watch(self, side: _Side) -> None:
        """Read while there is room for the peer; write while bytes wait."""
        mask = 0
        if not side.read_done and len(side.peer.pending) < BUFFER:
            mask |= selectors.EVENT_READ
        if side.pending and not side.write_done:
            mask |= selectors.EVENT_WRITE
        registered = side.sock in self.sel.get_map()
        if mask and registered:
            self.sel.modify(side.sock, mask, side)
        elif mask:
            self.sel.register(side.sock, mask, side)
        elif registered:
            self.sel.unregister(side.sock)

    def _end(self, side: _Side) -> None:
        """The pair is over: each socket's write side shut, then lingering (_linger)."""
        if side.sock not in self._open:
            return  # ended already
        for s in (side, side.peer):
            self._open.discard(s.sock)
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(s.sock)
            with contextlib.suppress(OSError):
                s.sock.shutdown(socket.SHUT_WR)
            self._closing[s.sock] = time.monotonic() + LINGER
            self.sel.register(s.sock, selectors.EVENT_READ, "closing")
        self._count(-1)

    def _linger(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(BUFFER)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        self._closing.pop(sock, None)
        sock.close()

    def _count(self, change: int) -> None:
        with self.changed:
            self.pairs += change
            self.changed.notify_all()
        if change < 0 and not self.stopped.is_set():
            self._listen(True)

    def _close_all(self) -> None:
        socks = [*self._open, *self._closing, self._wake, self._waker]
        for client, far, _ in self._dialing:
            socks += [client, far]
        for sock in socks:
            sock.close()
        self.sel.close()


def listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock


def main(argv: list[str]) -> None:
    """`PORT SOCKET`, or `fd:N SOCKET` for a listening socket inherited as descriptor N
    (egress_start.py binds it, so the port is served before the kernel's next call)."""
    where, target = argv[0], argv[1]
    if where.startswith("fd:"):
        listener = socket.socket(fileno=int(where[3:]))
    else:
        listener = listen(int(where))
    Relay(listener, target).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
