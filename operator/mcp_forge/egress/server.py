"""The egress proxy's process: mitmproxy with our addon, fed by the gateway.

    python -m mcp_forge.egress.server --control-fd N --confdir DIR [--resolve FILE]

Run by the gateway (`client.py`) in the egress venv, confined (an unprivileged user in a
sandbox with the host's network). mitmproxy listens on the host's loopback, on a port
the kernel never sees; each session's socket (handed over by the gateway, already bound
where its pod sees it) is relayed to that port here, and the relayed connection's port
names its session to the addon, so a credential read in one session's pod does not speak
for it through another session's socket.

The control socket carries one JSON object a line each way, requests answered in order:
`{"op": "open", "session", "token", "rules"}` with the listening socket beside it;
`{"op": "close", "session"}`; `{"op": "stats"}`. Its end is the gateway's end: the
proxy exits. Each verdict is a JSON line on stderr (the gateway logs them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from mitmproxy import certs, options
from mitmproxy.addons import default_addons, next_layer
from mitmproxy.master import Master
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import tls
from mitmproxy.proxy.layers.http import _http1

from mcp_forge.api import egress
from mcp_forge.egress import protocol
from mcp_forge.egress.addon import Policy, Session

BUFFER = 1 << 20  # read at once by the relay: fewer, larger copies through its one thread
HEAD_MAX = 64 << 10  # a request head's bytes, like nginx's large_client_header_buffers
HELLO_MAX = 64 << 10  # a TLS ClientHello's bytes (browsers' are a few KiB)


class Bucket:
    """A session's bandwidth in one direction: `rate` bytes a second, a second's worth
    of burst; 0 is no bound. One event loop: no lock."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.stamp = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(float(self.rate), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:  # paced: this direction waits its turn, the others go on
            await asyncio.sleep(-self.tokens / self.rate)


@dataclass
class Relays:
    """The sessions' listening sockets, and their open connections."""

    servers: dict[str, asyncio.Server] = field(default_factory=dict)
    open: dict[str, set[asyncio.StreamWriter]] = field(default_factory=dict)
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    buckets: dict[str, tuple[Bucket, Bucket]] = field(default_factory=dict)  # out, in


class Running:
    """The last addon: mitmproxy's servers are up when its `running` hook runs."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        table = json.loads(args.resolve.read()) if args.resolve else None
        self.policy = Policy(self.audit, table)
        self.relays = Relays()
        self.port = 0
        self.connections_max = args.connections_max
        self.master: Any = None

    def audit(self, record: dict[str, Any]) -> None:
        name = record.get("session")
        if isinstance(name, str) and name in self.relays.counts and "allowed" in record:
            verdict = "allowed" if record.get("allowed") else "refused"
            self.relays.counts[name][verdict] += 1
        print(json.dumps(record, separators=(",", ":")), file=sys.stderr, flush=True)

    async def start(self) -> Master:
        opts = options.Options(listen_host="127.0.0.1", listen_port=0)
        master = Master(opts)
        running = Running()
        master.addons.add(self.policy, *default_addons(), running)
        opts.update(
            confdir=self.args.confdir,
            connection_strategy="lazy",
            stream_large_bodies="256k",
            onboarding=False,
            http2=False,
            # Never relay bytes unread because they look like neither TLS nor HTTP: a
            # ClientHello in a record version mitmproxy does not know, or HTTP after a
            # blank line, would pass every check unseen. Such bytes get HTTP's 400.
            rawtcp=False,
        )
        if self.args.upstream_ca:
            opts.update(ssl_verify_upstream_trusted_ca=self.args.upstream_ca)
        self.master = master
        task = asyncio.create_task(master.run())
        waiter = asyncio.create_task(running.event.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not running.event.is_set():
            waiter.cancel()
            raise RuntimeError("mitmproxy did not start")
        proxyserver = master.addons.get("proxyserver")
        self.port = int(proxyserver.listen_addrs()[0][1])
        return master

    # ---- control -------------------------------------------------------------------

    async def handle(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = message.get("op")
        try:
            if op == "open":
                return await self._open(message, fds)
            if op == "close":
                await self._close(str(message.get("session")))
                return {"ok": True}
            if op == "stats":
                return {"ok": True, "sessions": self._stats()}
            return {"ok": False, "error": f"unknown op {str(op)[:32]!r}"}
        finally:
            for fd in fds:  # a descriptor nobody took
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def _open(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        name = str(message.get("session", ""))
        if len(fds) != 1 or not name:
            return {"ok": False, "error": "open needs a session name and one socket"}
        listener = socket.socket(fileno=fds.pop())
        try:
            rules = egress.parse_rules(message.get("rules", []))
        except ValueError as exc:  # InvalidSession is a ValueError
            listener.close()
            return {"ok": False, "error": str(exc)}
        try:
            certstore = self._certstore(message.get("ca"))
            values = {(int(n), int(i)): str(v) for n, i, v in message.get("values", [])}
        except (ValueError, TypeError, KeyError) as exc:
            listener.close()
            return {"ok": False, "error": f"the session's CA or values: {type(exc).__name__}"}
        await self._close(name)
        session = Session(name, str(message.get("token", "")), rules, certstore, values)
        self.policy.sessions[name] = session
        self.relays.counts[name] = Counter()
        self.relays.open[name] = set()
        rate = self.args.bandwidth_max
        self.relays.buckets[name] = (Bucket(rate), Bucket(rate))
        try:
            self.relays.servers[name] = await asyncio.start_unix_server(
                lambda r, w: self._relay(name, r, w), sock=listener, limit=BUFFER
            )
        except OSError as exc:
            listener.close()
            await self._close(name)
            return {"ok": False, "error": f"serving the session's socket: {exc}"}
        return {"ok": True, "port": self.port}

    def _certstore(self, ca: Any) -> Any:
        """The session's CA as a mitmproxy CertStore (its leaves are signed by it), or None."""
        if ca is None:
            return None
        key = serialization.load_pem_private_key(str(ca["key"]).encode(), None)
        cert = certs.Cert.from_pem(str(ca["cert"]).encode())
        dhparams = self.master.addons.get("tlsconfig").certstore.dhparams
        return certs.CertStore(key, cert, None, dhparams)

    async def _close(self, name: str) -> None:
        self.policy.sessions.pop(name, None)
        server = self.relays.servers.pop(name, None)
        if server is not None:
            server.close()
        for writer in self.relays.open.pop(name, set()):
            writer.close()
        self.relays.counts.pop(name, None)
        self.relays.buckets.pop(name, None)

    def _stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {**counts, "open": len(self.relays.open.get(name, ()))}
            for name, counts in self.relays.counts.items()
        }

    # ---- a session's connection ----------------------------------------------------

    async def _relay(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        open_now = self.relays.open.get(name)
        counts = self.relays.counts.get(name)
        if open_now is None or counts is None:
            writer.close()
            return
        if len(open_now) >= self.connections_max:
            counts["over_limit"] += 1
            self.audit(
                {"event": "limit", "session": name, "allowed": False,
                 "reason": f"{self.connections_max} connections open already"}
            )  # fmt: skip
            writer.close()
            return
        open_now.add(writer)
        counts["connections"] += 1
        up_writer = None
        out, into = self.relays.buckets.get(name) or (Bucket(0), Bucket(0))
        moved: Counter[str] = Counter()
        began = time.monotonic()
        try:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.port, limit=BUFFER
            )
            port = up_writer.get_extra_info("sockname")[1]
            self.policy.relayed[port] = name
            try:
                await asyncio.gather(
                    _pipe(reader, up_writer, (counts, moved), "bytes_out", out),
                    _pipe(up_reader, writer, (counts, moved), "bytes_in", into),
                )
            finally:
                self.policy.relayed.pop(port, None)
        except OSError:
            pass
        finally:
            open_now.discard(writer)
            writer.close()
            if up_writer is not None:
                up_writer.close()
            seconds = round(time.monotonic() - began, 3)
            self.audit({"event": "closed", "session": name, **moved, "seconds": seconds})


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    counts: tuple[Counter[str], ...],
    key: str,
    bucket: Bucket,
) -> None:
    """One direction, until its end, at the session's pace; the other side then hears
    the end too."""
    try:
        while data := await reader.read(BUFFER):
            for counter in counts:
                counter[key] += len(data)
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


def _control_loop(proxy: Proxy, control: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """The gateway's requests, one at a time, answered in order; at the end, exit."""
    reader = protocol.Reader(control)
    try:
        while (got := reader.read()) is not None:
            message, fds = got
            future = asyncio.run_coroutine_threadsafe(proxy.handle(message, fds), loop)
            protocol.send(control, future.result())
    except (OSError, ValueError) as exc:
        print(json.dumps({"event": "control", "error": str(exc)[:200]}), file=sys.stderr)
    finally:
        loop.call_soon_threadsafe(loop.stop)


async def serve(args: argparse.Namespace) -> None:
    control = socket.socket(fileno=args.control_fd)
    proxy = Proxy(args)
    await proxy.start()
    protocol.send(control, {"ready": True, "port": proxy.port})
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    thread = threading.Thread(
        target=_control_loop, args=(proxy, control, loop), name="control", daemon=True
    )
    thread.start()
    await done  # the control loop stops the event loop


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mcp_forge.egress.server")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--confdir", required=True, help="mitmproxy's own, private")
    parser.add_argument(
        "--resolve",
        type=argparse.FileType("r"),
        help="tests only: a JSON object of names to addresses, asked before DNS",
    )
    parser.add_argument("--upstream-ca", help="the CA file servers are checked against")
    parser.add_argument("--connections-max", type=int, default=protocol.CONNECTIONS_MAX)
    parser.add_argument(
        "--bandwidth-max", type=int, default=0, help="bytes a second per session and direction"
    )
    return parser.parse_args(argv)


# mitmproxy 11.0.2 has no bound on a request head: Http1Server.read_headers adds what the
# client sends to h11's buffer until the blank line ("FIXME: protect against header size
# DoS"). Nor on a TLS ClientHello: NextLayer._get_client_hello and ClientTLSLayer keep what
# the client sends until parse_client_hello finds the whole handshake, up to the 16 MB its
# header may claim, parsing it all again on each read (16 MB took 40 s of the proxy's one
# thread and grew it 62 MB). One session's connections could so stall the proxy or fill
# its address space, and take egress down for every session. No option bounds either, so
# read_headers and parse_client_hello are wrapped, for every client connection: plain
# requests, CONNECT heads, requests and ClientHellos inside a tunnel or inside TLS the proxy
# reads. The functions wrapped and their callers are checked by their source first, so that
# an upgrade fails here, loudly, until someone has looked whether the bounds still hold.
PATCHED = {  # the function, and the SHA-256 of its source
    _http1.Http1Server.read_headers:
        "a7d65fbcb32dc1505c296341f1a935c26a63dde366abfb246104cfccce903ea7",
    tls.parse_client_hello:
        "537b0089913d85d9ca7b1e468d9be1db7ae55d8d14018c04435e5c5b94f28c69",
    tls.ClientTLSLayer.receive_handshake_data:
        "a0ee021f92f6d0ff887b1bf9cea7fe70c63f2625bc0d1f148948809736fcc3cb",
    next_layer.NextLayer._get_client_hello:
        "6365f5a13cc5642a021b008b58a91dd7eb0db6c94bbad0720bb12f9251748d4f",
}  # fmt: skip


def bound_heads() -> None:
    """A request head over HEAD_MAX bytes is answered 431, and its connection closed once
    the client has ended it (what it sends until then is dropped); a ClientHello over
    HELLO_MAX bytes is not one (mitmproxy then closes the connection, or reads it as
    something else, as any bytes that are not a ClientHello)."""
    server = _http1.Http1Server
    read_headers, parse_client_hello = server.read_headers, tls.parse_client_hello
    if getattr(read_headers, "bounded", False):
        return
    for function, digest in PATCHED.items():
        source = inspect.getsource(function)
        if hashlib.sha256(source.encode()).hexdigest() != digest:
            raise RuntimeError(
                f"mitmproxy's {function.__qualname__} is not the one server.py bounds: "
                "check bound_heads against this mitmproxy"
            )
    if next_layer.parse_client_hello is not parse_client_hello:
        raise RuntimeError("mitmproxy's next_layer has a parse_client_hello of its own")

    def bounded_read_headers(self: Any, event: events.ConnectionEvent) -> Any:
        yield from read_headers(self, event)
        # Still reading the head (no blank line yet, or the one found opened no body), and
        # what is buffered is over the bound: the head is, but for one read of the socket.
        if self.state == self.read_headers and len(self.buf) > HEAD_MAX:
            self.buf = _http1.ReceiveBuffer()
            yield commands.SendData(self.conn, HEAD_TOO_LARGE)
            yield commands.CloseTcpConnection(self.conn, half_close=True)
            yield commands.Log(f"a request head over {HEAD_MAX} bytes: 431")
            self.state = functools.partial(discard, self)

    def discard(self: Any, event: events.Event) -> Any:
        # After the 431, what the client still sends is dropped, unbuffered, until its end:
        # closing at once would reset the connection, and the answer with it, unread.
        self.buf = _http1.ReceiveBuffer()
        if isinstance(event, events.ConnectionClosed):
            yield commands.CloseConnection(self.conn)

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

    bounded_read_headers.bounded = True  # type: ignore[attr-defined]
    server.read_headers = bounded_read_headers
    tls.parse_client_hello = next_layer.parse_client_hello = bounded_parse_client_hello


_BODY = f"The request head is over {HEAD_MAX} bytes (the egress proxy's bound).\n".encode()
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"Content-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    bound_heads()
    with contextlib.suppress(RuntimeError):  # the loop stopped: the gateway went away
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
