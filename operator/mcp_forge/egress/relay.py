"""The egress proxy's own relay: each client connection carried, bytes unread, to
mitmproxy's port on loopback, within its session's bounds.

Local mode: each session's socket (handed over by the gateway) is served here, and its
connections are the session's from their first byte; the relayed connection's port names
the session to the addon (`Policy.relayed`), so a credential speaks for a session only
through that session's socket.

Cluster mode: one TCP listener for every session. A connection belongs to no session
until the addon reads its credential at its first request and calls `admit`: from then
on it counts against that session's connection bound, is paced by the session's
buckets, and its bytes, those it moved before included, are the session's. Until then
it is one of at most `unidentified_max` such connections, each closed if it is not
identified within `unidentified_timeout` seconds, so that a client without a credential
cannot hold the proxy's descriptors. A session's grant names the addresses of its pod
(`bind`): its credential is good only from there, so one leaked to another kernel (a
token printed into an output another session reads) names no session from that kernel.

Standard library only: the tests read this module's behaviour through the real process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp_forge.egress import protocol

BUFFER = 1 << 20  # read at once by the relay: fewer, larger copies through its one thread
Audit = Callable[[dict[str, Any]], None]


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


@dataclass(frozen=True)
class Bounds:
    connections_max: int = protocol.CONNECTIONS_MAX  # open, per session
    bandwidth_max: int = 0  # bytes a second per session and direction; 0 none
    unidentified_max: int = protocol.UNIDENTIFIED_MAX  # cluster mode, per proxy
    unidentified_timeout: float = protocol.UNIDENTIFIED_TIMEOUT  # seconds


@dataclass(eq=False)
class Link:
    """One client connection through the relay, and its session once known."""

    writer: asyncio.StreamWriter
    session: str | None = None
    counts: Counter[str] | None = None  # the session's counters, once known
    moved: Counter[str] = field(default_factory=Counter)  # this connection's bytes
    out: Bucket = field(default_factory=lambda: Bucket(0))
    into: Bucket = field(default_factory=lambda: Bucket(0))
    upstream: asyncio.StreamWriter | None = None
    expiry: asyncio.TimerHandle | None = None
    began: float = field(default_factory=time.monotonic)
    peer: str = ""  # cluster mode: the client's address

    def close(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
        self.writer.close()
        if self.upstream is not None:
            self.upstream.close()


class Relays:
    """The sessions' connections through the relay, and what each session has open."""

    def __init__(self, audit: Audit, relayed: dict[int, str], bounds: Bounds) -> None:
        self.audit = audit
        # The addon's map (local mode): a relayed connection's local port, its session.
        self.relayed = relayed
        self.bounds = bounds
        self.port = 0  # mitmproxy's, on loopback
        self.servers: dict[str, asyncio.Server] = {}  # local mode: the sessions' sockets
        self.open: dict[str, set[Link]] = {}
        self.counts: dict[str, Counter[str]] = {}
        self.buckets: dict[str, tuple[Bucket, Bucket]] = {}  # out, in
        self.waiting: set[Link] = set()  # cluster mode: not identified yet
        self.by_port: dict[int, Link] = {}  # cluster mode: those, by their relayed port
        # Cluster mode: the addresses a session's credential is good from (its pod's);
        # a session without an entry is bound to none (a grant of an older operator).
        self.sources: dict[str, frozenset[str]] = {}

    # ---- sessions ------------------------------------------------------------------

    def add(self, name: str) -> None:
        self.counts[name] = Counter()
        self.open[name] = set()
        rate = self.bounds.bandwidth_max
        self.buckets[name] = (Bucket(rate), Bucket(rate))

    def bind(self, name: str, sources: list[str] | None) -> None:
        """Cluster mode: the session's credential is good from `sources` only (empty: from
        nowhere yet, its pod has no address); None: from anywhere. Connections already
        the session's are kept: they were admitted from where it was then."""
        if sources is None:
            self.sources.pop(name, None)
        else:
            self.sources[name] = frozenset(normal_address(a) for a in sources)

    def remove(self, name: str) -> None:
        """The session's socket closed and its connections ended."""
        self.sources.pop(name, None)
        server = self.servers.pop(name, None)
        if server is not None:
            server.close()
        for link in self.open.pop(name, set()):
            link.close()
        self.counts.pop(name, None)
        self.buckets.pop(name, None)

    async def serve(self, name: str, listener: socket.socket) -> None:
        """Local mode: relay the session's listening socket. OSError if it cannot."""
        self.servers[name] = await asyncio.start_unix_server(
            lambda r, w: self.session_link(name, r, w), sock=listener, limit=BUFFER
        )

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {**counts, "open": len(self.open.get(name, ()))}
            for name, counts in self.counts.items()
        }

    # ---- connections ---------------------------------------------------------------

    async def session_link(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Local mode: a connection through session `name`'s socket."""
        open_now = self.open.get(name)
        counts = self.counts.get(name)
        if open_now is None or counts is None:
            writer.close()
            return
        if len(open_now) >= self.bounds.connections_max:
            counts["over_limit"] += 1
            self.audit(
                {"event": "limit", "session": name, "allowed": False,
                 "reason": f"{self.bounds.connections_max} connections open already"}
            )  # fmt: skip
            writer.close()
            return
        out, into = self.buckets.get(name) or (Bucket(0), Bucket(0))
        link = Link(writer, name, counts, out=out, into=into)
        open_now.add(link)
        counts["connections"] += 1
        await self._carry(link, reader)

    async def unknown_link(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Cluster mode: a connection to the listener, no one's until `admit`."""
        peer = writer.get_extra_info("peername")
        shown = str(peer[0]) if isinstance(peer, tuple) else ""
        if len(self.waiting) >= self.bounds.unidentified_max:
            self.audit(
                {"event": "limit", "peer": shown, "allowed": False,
                 "reason": f"{self.bounds.unidentified_max} unidentified connections "
                 "open already"}
            )  # fmt: skip
            writer.close()
            return
        link = Link(writer, peer=normal_address(shown))
        self.waiting.add(link)
        loop = asyncio.get_running_loop()
        link.expiry = loop.call_later(self.bounds.unidentified_timeout, self._expire, link, shown)
        await self._carry(link, reader)

    def _expire(self, link: Link, shown: str) -> None:
        if link.session is not None:
            return
        seconds = self.bounds.unidentified_timeout
        self.audit(
            {"event": "limit", "peer": shown, "allowed": False,
             "reason": f"no credential within {seconds:g} s"}
        )  # fmt: skip
        link.close()

    def admit(self, port: int | None, name: str) -> str | None:
        """Cluster mode, called by the addon when a connection's credential first names
        session `name`: None once the connection is the session's, else why it is not."""
        link = self.by_port.get(port) if port is not None else None
        if link is None:
            return "refused: the connection did not come through the proxy's listener"
        if link.session is not None:
            return None if link.session == name else "refused: another session's connection"
        open_now, counts = self.open.get(name), self.counts.get(name)
        if open_now is None or counts is None:
            return f"refused: session {name} is closed"
        sources = self.sources.get(name)
        if sources is not None and link.peer not in sources:
            return f"refused: the credential of session {name} is good from its own pod only" + (
                "" if sources else ", and its pod has no address yet"
            )
        if len(open_now) >= self.bounds.connections_max:
            counts["over_limit"] += 1
            return (
                f"refused: {self.bounds.connections_max} connections of this session open "
                "already (its bound)"
            )
        self.waiting.discard(link)
        if link.expiry is not None:
            link.expiry.cancel()
        link.session, link.counts = name, counts
        counts.update(link.moved)  # what it moved before it was known
        counts["connections"] += 1
        link.out, link.into = self.buckets.get(name) or (Bucket(0), Bucket(0))
        open_now.add(link)
        return None

    async def _carry(self, link: Link, reader: asyncio.StreamReader) -> None:
        """Both directions to mitmproxy's port and back until both end; then its record."""
        try:
            up_reader, link.upstream = await asyncio.open_connection(
                "127.0.0.1", self.port, limit=BUFFER
            )
            port = int(link.upstream.get_extra_info("sockname")[1])
            if link.session is not None:
                self.relayed[port] = link.session
            else:
                self.by_port[port] = link
            try:
                await asyncio.gather(
                    _pipe(reader, link.upstream, link, "bytes_out"),
                    _pipe(up_reader, link.writer, link, "bytes_in"),
                )
            finally:
                self.relayed.pop(port, None)
                self.by_port.pop(port, None)
        except OSError:
            pass
        finally:
            self.waiting.discard(link)
            if link.session is not None:
                self.open.get(link.session, set()).discard(link)
            link.close()
            seconds = round(time.monotonic() - link.began, 3)
            named = {"session": link.session} if link.session is not None else {}
            if named or any(link.moved.values()):  # not a probe's connect and close
                self.audit({"event": "closed", **named, **link.moved, "seconds": seconds})

    def close_all(self) -> None:
        """Every connection ended (the proxy stops)."""
        for name in list(self.open):
            self.remove(name)
        for link in list(self.waiting):
            link.close()


def normal_address(text: str) -> str:
    """An address as compared: IPv4 for an IPv4-mapped IPv6 one, IPv6 compressed."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, key: str
) -> None:
    """One direction, until its end, at the session's pace (the session's as soon as it
    is known); the other side then hears the end too."""
    outward = key == "bytes_out"
    try:
        while data := await reader.read(BUFFER):
            link.moved[key] += len(data)
            if link.counts is not None:
                link.counts[key] += len(data)
            await (link.out if outward else link.into).take(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()
