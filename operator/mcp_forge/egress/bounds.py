"""Bounds on what mitmproxy keeps of a connection's bytes, wrapped into mitmproxy 11.0.2
when the proxy starts (`install`, before anything is served).

mitmproxy reads a socket as fast as bytes come (it waits only while a socket it writes to
is slow), and keeps what it cannot pass on yet without bound: one session's connections
could fill the proxy's memory, or stall its one thread, and take egress down for every
session. No option bounds any of these:

- a request head: `Http1Server.read_headers` adds what the client sends to h11's buffer
  until the blank line ("FIXME: protect against header size DoS"). Over HEAD_MAX: a 431,
  and what the client still sends is dropped, unbuffered, until it closes.
- a TLS ClientHello: `NextLayer._get_client_hello` and `ClientTLSLayer` keep what the
  client sends until `parse_client_hello` finds the whole handshake, up to the 16 MB its
  header may claim, parsing it all again at each read (16 MB took 40 s of the proxy's
  thread and grew it 62 MB). One claiming more than HELLO_MAX is not a ClientHello.
- what a server sends that is neither an answer's head nor its body, yet: `Http1Client`
  keeps a response head until its blank line (the same FIXME), a chunk's size line or
  trailers until their end, and whatever comes after a whole answer. Over HEAD_MAX: the
  server's connection is closed, and the client answered a 502 whose reason names the
  bound (closed, if the answer's head has gone to it already).
- a chunk's size line or trailers from a client: the same in `Http1Server`. Over
  HEAD_MAX: the connection closed, as h11 closes one on a malformed chunk.
- what a client sends while its request waits: `Http1Server` keeps what comes after a
  request until the answer has gone (pipelined requests), and an `HttpStream` paused on a
  hook or on its server connection (a host slow to accept, or to finish TLS) queues the
  body that comes meanwhile. Over HELD_MAX: mitmproxy stops reading that client until
  it has passed them on (its read loop waits in `drain_writers`, as it waits there for a
  slow reader), and TCP stops the client, as a server reading slowly would.

An endless response head of 100 MB grew the proxy 397 MB (538 over TLS) and came back to
the kernel whole, quoted in a 502's body; an endless chunk size line 100 MB either way;
96 MB pipelined behind a request its host does not answer, or sent as a body while the
host's TLS handshake hangs, 97 to 103 MB. Each is now cut off within 1 MB, or held: the
client stalls after a few MB of socket buffers, of which the proxy keeps about 4 MB,
most in its relay (tests/adversarial/test_egress_exhaustion.py).

The functions wrapped, and those whose behaviour the bounds rely on, are checked by their
source first: an upgrade fails here, loudly, until someone has looked whether the bounds
still hold.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import weakref
from typing import Any

from mitmproxy.addons import next_layer
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer, server
from mitmproxy.proxy.layers import tls
from mitmproxy.proxy.layers.http import (
    HttpStream,
    RequestData,
    RequestProtocolError,
    ResponseProtocolError,
    _http1,
)
from mitmproxy.proxy.layers.http._base import ReceiveHttp

HEAD_MAX = 64 << 10  # a head's bytes, like nginx's large_client_header_buffers; a chunk's framing
HELLO_MAX = 64 << 10  # a TLS ClientHello's bytes (browsers' are a few KiB)
# A client's bytes read and not passed on yet. More than a head and a read (64 KiB): a head
# too large is answered, never held.
HELD_MAX = 256 << 10

PATCHED = {  # the function, and the SHA-256 of its source
    _http1.Http1Server.read_headers:
        "a7d65fbcb32dc1505c296341f1a935c26a63dde366abfb246104cfccce903ea7",
    tls.parse_client_hello:
        "537b0089913d85d9ca7b1e468d9be1db7ae55d8d14018c04435e5c5b94f28c69",
    tls.ClientTLSLayer.receive_handshake_data:
        "a0ee021f92f6d0ff887b1bf9cea7fe70c63f2625bc0d1f148948809736fcc3cb",
    next_layer.NextLayer._get_client_hello:
        "6365f5a13cc5642a021b008b58a91dd7eb0db6c94bbad0720bb12f9251748d4f",
    _http1.Http1Connection._handle_event:
        "2ac8db3e43ae743fd21f78709327091ff712e8c0addf4466f1f1f972c24750d2",
    _http1.Http1Connection.read_body:
        "303e41dd550c1819f89b335b7abb4f12c035a9d9451c2e53dded1b3b20a9699a",
    _http1.Http1Connection.wait:
        "533c8ecb0e8c3708b5783cd960e05fbc664f2299ec2f16c7814da5d05fe3c552",
    _http1.Http1Client.read_headers:
        "1a492ce73b45a592fb3d6143bb0bd9f3f605aa8d87d9319f41ec2b01d9967a6f",
    _http1.Http1Server.send:
        "f530fe5b569e08d4bbd5139839e62c1cf2d9effeb3034db6010a0efb8ee8f51c",
    layer.Layer.handle_event:
        "fd88b0fb09ceddbb1915fe0d588c206e8310d6883a77048a665675e49e43de2b",
    server.ConnectionHandler.drain_writers:
        "6b57434604561e3e9b58146e7e4fb0d12199906ca8a5bcc4e1a0d1ee3b85c410",
    server.ConnectionHandler.handle_connection:
        "95c3f93e9824e527cd3c1af9656c0e04690562abcd23f0b029d547257fb53f94",
}  # fmt: skip


def install() -> None:
    """Wrap mitmproxy's readers, once. RuntimeError if its code is not the one checked."""
    if getattr(_http1.Http1Server.read_headers, "bounded", False):
        return
    for function, digest in PATCHED.items():
        source = inspect.getsource(function)
        if hashlib.sha256(source.encode()).hexdigest() != digest:
            raise RuntimeError(
                f"mitmproxy's {function.__qualname__} is not the one bounds.py bounds: "
                "check bounds.py against this mitmproxy"
            )
    if next_layer.parse_client_hello is not tls.parse_client_hello:
        raise RuntimeError("mitmproxy's next_layer has a parse_client_hello of its own")
    if HttpStream.handle_event is not layer.Layer.handle_event:
        raise RuntimeError("mitmproxy's HttpStream handles its events itself")
    _bound_request_heads()
    _bound_client_hellos()
    _bound_framing()
    _hold_clients()


# ---- heads and hellos ----------------------------------------------------------------


def _bound_request_heads() -> None:
    """A request head over HEAD_MAX bytes is answered 431, and its connection closed once
    the client has ended it (what it sends until then is dropped)."""
    read_headers = _http1.Http1Server.read_headers

    def bounded_read_headers(self: Any, event: events.ConnectionEvent) -> Any:
        yield from read_headers(self, event)
        # Still reading the head (no blank line yet, or the one found opened no body), and
        # what is buffered is over the bound: the head is, but for one read of the socket.
        if self.state == self.read_headers and len(self.buf) > HEAD_MAX:
            self.buf = _http1.ReceiveBuffer()
            yield commands.SendData(self.conn, HEAD_TOO_LARGE)
            yield commands.CloseTcpConnection(self.conn, half_close=True)
            yield commands.Log(f"a request head over {HEAD_MAX} bytes: 431")
            self.state = functools.partial(_discard, self)

    bounded_read_headers.bounded = True  # type: ignore[attr-defined]
    _http1.Http1Server.read_headers = bounded_read_headers


def _discard(self: Any, event: events.Event) -> Any:
    # After a bound, what the peer still sends is dropped, unbuffered, until its end:
    # closing at once would reset the connection, and an answer with it, unread.
    self.buf = _http1.ReceiveBuffer()
    if isinstance(event, events.ConnectionClosed):
        yield commands.CloseConnection(self.conn)


def _cut_off(self: Any, message: str, error: Any) -> Any:
    """A connection past a bound: nothing it sent kept, the rest dropped as it comes
    (`_discard`), closed, logged, and `error` handed to the stream that was waiting."""
    self.buf = _http1.ReceiveBuffer()
    self.state = functools.partial(_discard, self)
    yield commands.CloseConnection(self.conn)
    yield commands.Log(message)
    yield ReceiveHttp(error)


def _bound_client_hellos() -> None:
    """A ClientHello over HELLO_MAX bytes is not one (mitmproxy then closes the
    connection, or reads it as something else, as any bytes that are not a ClientHello)."""
    parse_client_hello = tls.parse_client_hello

    def bounded_parse_client_hello(data: bytes) -> Any:
        # The length the handshake claims is in its first four bytes: a longer one is
        # refused before it is buffered, and so are records so small their headers double
        # it (each parse joins them all again).
        claimed = b""
        for body in tls.handshake_record_contents(data):
            claimed += body
            if len(claimed) >= 4:
                if int.from_bytes(claimed[1:4], "big") + 4 > HELLO_MAX:
                    raise ValueError(f"a ClientHello over {HELLO_MAX} bytes")
                break
        if len(data) > 2 * HELLO_MAX:
            raise ValueError(f"a ClientHello in records over {2 * HELLO_MAX} bytes")
        return parse_client_hello(data)

    tls.parse_client_hello = next_layer.parse_client_hello = bounded_parse_client_hello


# ---- what neither side may leave unfinished ------------------------------------------


class _FromServerOverBound(ResponseProtocolError):  # type: ignore[misc]  # mitmproxy: Any here
    """A server sent more than HEAD_MAX bytes that are neither a head nor a body yet: the
    client's side answers it with a 502 of ours (the reason naming the bound)."""


def _bound_framing() -> None:
    """Over HEAD_MAX bytes buffered by mitmproxy's HTTP/1 reader of a server (a response
    head, a chunk's size line, trailers, bytes after an answer) closes that server's
    connection; of a client reading a body (a chunk's size line, trailers) closes the
    client's. Every read of a client also tells `_note` what its reader keeps."""
    handle_event = _http1.Http1Connection._handle_event

    def from_client(self: Any, event: events.Event) -> Any:
        if isinstance(event, _FromServerOverBound):
            yield from _bad_gateway(self, event)
            return
        yield from handle_event(self, event)
        if self.state == self.read_body and len(self.buf) > HEAD_MAX:
            message = f"a request's chunk framing over {HEAD_MAX} bytes (the egress proxy's bound)"
            yield from _cut_off(self, message, RequestProtocolError(self.stream_id, message))
        _note(self.conn, self, len(self.buf))

    def from_server(self: Any, event: events.Event) -> Any:
        yield from handle_event(self, event)
        if len(self.buf) > HEAD_MAX and self.stream_id is not None:
            what = (
                "a response head"
                if self.state == self.read_headers
                else "a response's chunk framing, trailers or bytes after its end"
            )
            message = f"{what} over {HEAD_MAX} bytes (the egress proxy's bound)"
            yield from _cut_off(self, message, _FromServerOverBound(self.stream_id, message))

    _http1.Http1Server._handle_event = from_client
    _http1.Http1Client._handle_event = from_server


def _bad_gateway(self: Any, event: _FromServerOverBound) -> Any:
    # As Http1Server.send answers a ResponseProtocolError, with the message as the reason
    # phrase too: urllib and pip show that, not the body.
    if not self.conn.state & ConnectionState.CAN_WRITE:
        return
    if not self.response:
        body = f"egress proxy: {event.message}\n".encode()
        yield commands.SendData(
            self.conn,
            b"HTTP/1.1 502 Bad Gateway: %s\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (event.message.encode(), len(body), body),
        )
    yield commands.CloseConnection(self.conn)


# ---- what a client sends while its request waits -------------------------------------


class _Held:
    """One client's bytes that mitmproxy has read and not passed on, by the layer keeping
    them; `less` is set whenever they are within HELD_MAX."""

    def __init__(self) -> None:
        self.by: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.less = asyncio.Event()

    def over(self) -> bool:
        return sum(self.by.values()) > HELD_MAX


_HELD: weakref.WeakKeyDictionary[Any, _Held] = weakref.WeakKeyDictionary()  # by client


def _note(client: Any, where: Any, kept: int) -> None:
    """`where` (a layer) keeps `kept` bytes of `client`'s."""
    held = _HELD.get(client)
    if held is None:
        if not kept:
            return
        held = _HELD[client] = _Held()
    if kept:
        held.by[where] = kept
    else:
        held.by.pop(where, None)
    if not held.over():
        held.less.set()


def _hold_clients() -> None:
    """A client's read loop waits, after each read, while mitmproxy keeps more than
    HELD_MAX of its bytes: those after a request still waiting for its answer (its
    Http1Server's buffer, noted by `_bound_framing`), and the body a stream paused on a
    hook or on its server connection has queued."""
    handle_event = layer.Layer.handle_event
    drain_writers = server.ConnectionHandler.drain_writers

    def stream_event(self: Any, event: events.Event) -> Any:
        yield from handle_event(self, event)
        queued = self._paused_event_queue
        _note(
            self.context.client,
            self,
            sum(len(e.data) for e in queued if isinstance(e, RequestData)),
        )

    async def held_drain_writers(self: Any) -> None:
        await drain_writers(self)
        # handle_connection awaits this after handing each read to the layers: in the
        # client's own loop, this is where its reading stops until the layers catch up.
        io = self.transports.get(self.client)
        held = _HELD.get(self.client)
        if io is None or held is None or io.handler is not asyncio.current_task():
            return
        while held.over():
            held.less.clear()
            await held.less.wait()

    HttpStream.handle_event = stream_event
    server.ConnectionHandler.drain_writers = held_drain_writers


_BODY = f"The request head is over {HEAD_MAX} bytes (the egress proxy's bound).\n".encode()
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"Content-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)
