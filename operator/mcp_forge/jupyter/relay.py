"""A byte relay between the gateway's ZMQ sockets and a kernel's, which bounds what the
kernel can make the gateway's libzmq hold.

libzmq hands a multipart message to its reader only once the last frame is in, and
ZMQ_MAXMSGSIZE bounds each frame, never their sum: a kernel that sends frames of 10 MB
with the MORE flag set, one after another, makes the gateway hold all of them (forty
such frames: 400 MB) before the gateway can read, count or drop a byte of them.

So the gateway's sockets do not connect to the kernel. Each connects to a relay: a Unix
socket in the abstract namespace (nothing on disk to leak when the gateway is killed)
that closes at once any connection not made by the gateway's own process; every other
connection is joined to a new connection to the kernel's endpoint, and bytes are copied both ways
unchanged (CurveZMQ passes through: the relay holds no key and parses no frame). Bytes
from the kernel are counted against what the gateway has read (`Relay.consumed`): once
`bound` bytes are unread the relay stops reading from the kernel, whose sends then wait
on the transport's own flow control. If the gateway's socket still has no whole message
to read `GRACE` seconds later, what its libzmq holds is part of one message already over
the bound: both connections are closed, libzmq drops the part, and the gateway sees the
channel dropped (kernel.py), as it does for a frame over ZMQ_MAXMSGSIZE.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

# Wire bytes a frame costs beyond its payload, credited with it when read: ZMTP's flags
# and length (up to 9 bytes), and under Curve the MESSAGE command, nonce and box (~33).
FRAME_OVERHEAD = 64
# How long the relay, having stopped reading from the kernel, waits for a whole message
# to become readable (the bytes it passed on may still be in flight to libzmq).
GRACE = 0.5
# Connecting to a kernel that is not listening yet is retried this often, as libzmq
# would (its ZMQ_RECONNECT_IVL), so a restarted kernel is reached as soon as before.
RETRY = 0.1
EARLY_MAX = 1 << 20  # bytes from the gateway held while the kernel's side connects
CONNECT_TIMEOUT = 10.0  # a pod address that drops the SYN is tried again


class Relay:
    """One channel, `name`: a listening socket whose every connection from this process
    is joined to a new one to `target` (`ipc://PATH` or `tcp://HOST:PORT`).

    `readable` says whether the gateway's socket holds a whole message now. Must be made
    with an event loop running; `close` ends the relay and every connection it joined.
    """

    def __init__(self, name: str, target: str, *, bound: int, readable: Callable[[], bool]) -> None:
        self.name = name
        self.target = target
        self.bound = bound
        self.readable = readable
        self._address = f"mcp-forge-relay-{secrets.token_hex(8)}-{name}"
        self._pairs: set[_Pair] = set()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self._address)  # the abstract namespace
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._server: asyncio.Server | None = None
        self._serving = asyncio.get_running_loop().create_task(self._serve())

    @property
    def url(self) -> str:
        return f"ipc://@{self._address}"

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Gateway(self), sock=self._listener)

    def consumed(self, nbytes: int) -> None:
        """The gateway read a message of `nbytes` wire bytes from this channel."""
        for pair in list(self._pairs):
            pair.credit(nbytes)

    def close(self) -> None:
        self._serving.cancel()
        if self._server is not None:
            self._server.close()
        self._listener.close()
        for pair in list(self._pairs):
            pair.close(abort=True)


class _Pair:
    """A connection from the gateway and the one made for it to the kernel."""

    def __init__(self, relay: Relay, gateway: asyncio.Transport) -> None:
        self.relay = relay
        self.gateway = gateway
        self.kernel: asyncio.Transport | None = None
        self.held = 0  # bytes passed to the gateway and not yet read by it
        self._full = False  # the gateway's side has more buffered than it takes
        self._paused = False  # not reading from the kernel
        self._stall: asyncio.TimerHandle | None = None
        self._closed = False
        # What the gateway sends before the kernel's side is connected (its greeting,
        # requests queued meanwhile) waits here; past EARLY_MAX, reading stops. Not
        # paused at once: Python before 3.11.3 reads anyway after a pause made in
        # connection_made (and still believes itself paused).
        self._early: list[bytes] = []
        self._early_size = 0
        self._early_paused = False
        relay._pairs.add(self)
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        scheme, _, where = self.relay.target.partition("://")
        while not self._closed:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    if scheme == "ipc":
                        await loop.create_unix_connection(lambda: _Kernel(self), where)
                    else:
                        host, _, port = where.rpartition(":")
                        await loop.create_connection(lambda: _Kernel(self), host, int(port))
                return
            except OSError:  # TimeoutError included
                # Not listening yet (a kernel starting), or gone: libzmq, connected
                # directly, would retry too. The gateway's connection waits meanwhile.
                await asyncio.sleep(RETRY)

    def kernel_made(self, transport: asyncio.Transport) -> None:
        if self._closed:
            transport.close()
            return
        self.kernel = transport
        transport.writelines(self._early)
        self._early.clear()
        if self._early_paused:
            self.gateway.resume_reading()

    def from_gateway(self, data: bytes) -> None:
        if self.kernel is not None:
            self.kernel.write(data)
            return
        self._early.append(data)
        self._early_size += len(data)
        if self._early_size >= EARLY_MAX and not self._early_paused:
            self._early_paused = True
            self.gateway.pause_reading()

    def from_kernel(self, data: bytes) -> None:
        self.gateway.write(data)
        self.held += len(data)
        self._flow()

    def credit(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)
        self._flow()

    def gateway_full(self, full: bool) -> None:
        self._full = full
        self._flow()

    def _flow(self) -> None:
        if self.kernel is None or self._closed:
            return
        over = self.held >= self.relay.bound
        pause = over or self._full
        if pause != self._paused:
            self._paused = pause
            if pause:
                self.kernel.pause_reading()
            else:
                self.kernel.resume_reading()
        if over and self._stall is None:
            self._stall = asyncio.get_running_loop().call_later(GRACE, self._check)

    def _check(self) -> None:
        self._stall = None
        if self._closed or self.held < self.relay.bound:
            return
        if self.relay.readable():  # whole messages wait to be read: the gateway is behind
            self._stall = asyncio.get_running_loop().call_later(GRACE, self._check)
            return
        log.warning(
            "the kernel sent %s more than %d bytes the gateway could not read as whole "
            "messages: the connection is closed",
            self.relay.name,
            self.relay.bound,
        )
        self.close(abort=True)

    def close(self, *, abort: bool = False) -> None:
        """Close both sides: at once if `abort`, else after what is buffered is sent."""
        if self._closed:
            return
        self._closed = True
        self.relay._pairs.discard(self)
        self._connecting.cancel()
        if self._stall is not None:
            self._stall.cancel()
        for transport in (self.gateway, self.kernel):
            if transport is not None:
                transport.abort() if abort else transport.close()


class _Gateway(asyncio.Protocol):
    """The gateway's side of a pair."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.pair: _Pair | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        pid, uid, _ = struct.unpack(
            "3i",
            transport.get_extra_info("socket").getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
            ),
        )
        if pid != os.getpid():
            log.warning(
                "refused a connection to the %s relay from pid %d (uid %d)",
                self.relay.name,
                pid,
                uid,
            )
            transport.abort()
            return
        self.pair = _Pair(self.relay, transport)

    def data_received(self, data: bytes) -> None:
        if self.pair is not None:
            self.pair.from_gateway(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pair is not None:
            self.pair.close()

    def pause_writing(self) -> None:
        if self.pair is not None:
            self.pair.gateway_full(True)

    def resume_writing(self) -> None:
        if self.pair is not None:
            self.pair.gateway_full(False)


class _Kernel(asyncio.Protocol):
    """The kernel's side of a pair."""

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.pair.kernel_made(transport)

    def data_received(self, data: bytes) -> None:
        self.pair.from_kernel(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close()

    def pause_writing(self) -> None:
        self.pair.gateway.pause_reading()

    def resume_writing(self) -> None:
        self.pair.gateway.resume_reading()
