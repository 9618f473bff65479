"""One connection to one remote kernel: the Jupyter protocol over our own ZMQ sockets.

jupyter-client's `Session` signs, serializes and checks every message; the sockets are
ours, because the kernel is untrusted and we bound what it can make us hold:

* every frame is at most `max_frame` bytes (ZMQ_MAXMSGSIZE, set before connecting);
* the sockets reach the kernel through relays (relay.py) that stop reading from it once
  `max_message` bytes and a little more are unread, and close a connection whose unread
  bytes are part of one message over that: libzmq holds a multipart message whole
  before its reader sees a frame, and ZMQ_MAXMSGSIZE bounds only each frame;
* a message whose frames add up to more than `max_message` is dropped uncopied;
* few messages queue (ZMQ_RCVHWM);
* a channel that libzmq drops is noticed at once through a socket monitor: the read
  raises ChannelDropped instead of waiting for a status that will never come, and the
  channel is opened anew. libzmq never reconnects a connection it closed for a frame
  over ZMQ_MAXMSGSIZE (a protocol error ends its session for good), so without a new
  socket that channel would stay silent for the connection's life. A new IOPub socket
  is subscribed only once a message crosses it: the next request first sees one do so;
* a message that does not deserialize (nesting deep enough to exhaust the recursion
  limit included), whose header, parent or content is not a mapping, or whose content
  nests deeper than `DEPTH_MAX`, or holds more than `CONTAINERS_MAX` brackets, is dropped
  and logged, never raised into the caller.

On a cluster whose Secret holds a Curve pair (keys.py) every socket is a CurveZMQ client
of the kernel's public key, as jupyter-client's are: the channels are encrypted, and a
kernel that does not hold the pair's secret key completes no handshake.

The kernel runs in a pod we cannot signal from here: readiness is a `kernel_info` reply
on the control channel (answered even while the kernel is busy) together with an IOPub
message for it (so output of the next request cannot be missed); liveness is a heartbeat
echo; interrupt is an `interrupt_request` on the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import itertools
import logging
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client._version import protocol_version  # what Session puts in headers
from jupyter_client.session import Session
from zmq.utils.monitor import parse_monitor_message

from mcp_forge.api.connection import PORTS, ConnectionInfo, check_key
from mcp_forge.errors import KernelProtocolError, SessionNotReady
from mcp_forge.jupyter.execution import Collector
from mcp_forge.jupyter.relay import FRAME_OVERHEAD, Relay
from mcp_forge.jupyter.wire import (
    DELIMITER,
    Message,
    may_answer,
    pack,
    parse,
    read_now,
)

log = logging.getLogger(__name__)

# How long a request's shell reply may trail its idle status before the kernel is asked
# (a probe) whether one is coming at all.
REPLY_AFTER_IDLE = 0.5
IOPUB_FIRST_WAIT = 0.01  # wait_ready: first wait for its status on IOPub (see there)


# The channels a connection holds, and the socket each is.
_KINDS = {"shell": zmq.DEALER, "control": zmq.DEALER, "iopub": zmq.SUB}
# Channels whose drop a read raises (ChannelDropped): a request waits on them. A dropped
# control channel is opened anew before its next request (a reply lost meanwhile is a
# request not acknowledged).
_RAISING = frozenset({"shell", "iopub"})


class ChannelDropped(KernelProtocolError):
    """libzmq closed a channel's connection to the kernel (a frame over the limit, or the
    kernel closed it): messages in flight on it are lost."""

    def __init__(self, channel: str) -> None:
        super().__init__(f"the kernel's {channel} channel was dropped")
        self.channel = channel


class KernelReplaced(KernelProtocolError):
    """A different kernel process answers on this connection's sockets: the one that ran
    the request died and was restarted (e.g. by the supervisor)."""

    def __init__(self) -> None:
        super().__init__("a new kernel process answers: the one that ran the call is gone")


# Unread bytes a relay allows beyond `max_message`: frame overheads, the handshake, and
# bytes on their way into libzmq.
RELAY_SLACK = 1 << 20
# The heartbeat's echo is 16 bytes: a relay passes at most this much per beat.
HEARTBEAT_BOUND = 64 << 10


class KernelConnection:
    """Sockets to one kernel. Requests on shell are not concurrent: callers serialize.

    Made with an event loop running (the relays serve on it); `close` ends it."""

    def __init__(
        self,
        info: ConnectionInfo,
        *,
        max_frame: int,
        max_message: int,
        queue: int = 64,
        monitor: bool = False,
    ) -> None:
        check_key(info.key)
        self.info = info
        self.max_message = max_message
        self.session = Session(
            key=info.key.encode(), signature_scheme="hmac-sha256", username="mcp-forge"
        )
        self._signer = hmac.new(info.key.encode(), digestmod=hashlib.sha256)
        self._msg_prefix = f"{self.session.session}_{os.getpid()}_"
        self._msg_numbers = itertools.count()
        self._ctx = zmq.asyncio.Context.instance()
        self._max_frame = max_frame
        self._queue = queue
        self._monitor = monitor
        self._channels: dict[str, zmq.asyncio.Socket] = {}
        # Socket monitors (DISCONNECTED events) of the channels, when `monitor` is set.
        self._monitors: dict[zmq.asyncio.Socket, tuple[str, zmq.asyncio.Socket]] = {}
        self._subscribed = False  # has a message crossed the IOPub socket yet?
        self._relays = {
            channel: Relay(
                channel,
                self._kernel_url(channel),
                bound=HEARTBEAT_BOUND if channel == "hb" else max_message + RELAY_SLACK,
                readable=functools.partial(self._readable, channel),
            )
            for channel in (*_KINDS, "hb")
        }
        for channel in _KINDS:
            self._open(channel)
        self._control_lock = asyncio.Lock()
        self.refused = 0  # shell messages dropped (too large, malformed) that may have been awaited
        self.kernel_info: dict[str, Any] = {}
        self.kernel_session: Any = None  # header.session of the kernel process we reached

    def rekey(self, key: str) -> None:
        """Sign and verify with `key` from now on. A forked kernel is told its new key
        in a request signed with the old one and signs its reply with the new one
        (runtimes/local/forks.py): rekeyed after the send, before the reply is read."""
        check_key(key)
        self.session.key = key.encode()
        self._signer = hmac.new(key.encode(), digestmod=hashlib.sha256)

    def url(self, channel: str) -> str:
        """Where this connection's sockets connect for `channel`: its relay."""
        return self._relays[channel].url

    def _kernel_url(self, channel: str) -> str:
        port = PORTS[channel]
        if self.info.transport == "ipc":
            return f"ipc://{self.info.host}-{port}"
        return f"tcp://{self.info.host}:{port}"

    def _relay_of(self, sock: zmq.asyncio.Socket) -> Relay:
        channel = next(c for c, s in self._channels.items() if s is sock)
        return self._relays[channel]

    def _readable(self, channel: str) -> bool:
        sock = self._channels.get(channel)
        return sock is not None and bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _curve(self, sock: zmq.asyncio.Socket) -> None:
        """Before connecting: a Curve client of the kernel, with the session's pair as its
        own (as jupyter-client does; the kernel authenticates no client key)."""
        curve = self.info.curve
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.public.encode("ascii"))
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public.encode("ascii"))
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode("ascii"))

    @property
    def shell(self) -> zmq.asyncio.Socket:
        return self._channel("shell")

    @property
    def control(self) -> zmq.asyncio.Socket:
        return self._channel("control")

    @property
    def iopub(self) -> zmq.asyncio.Socket:
        return self._channel("iopub")

    def _channel(self, name: str) -> zmq.asyncio.Socket:
        try:
            return self._channels[name]
        except KeyError:  # closed (the gateway dropped it) while a call still settled
            raise SessionNotReady("the connection to the kernel was closed") from None

    def _open(self, channel: str) -> None:
        """Open `channel`'s socket, closing the one it had."""
        old = self._channels.pop(channel, None)
        if old is not None:
            self._close(old)
        kind = _KINDS[channel]
        sock = self._ctx.socket(kind)
        self._curve(sock)
        if self._monitor:
            self._monitors[sock] = (channel, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sock.setsockopt(zmq.RCVHWM, self._queue)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IDENTITY, uuid.uuid4().hex.encode())
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.url(channel))
        self._channels[channel] = sock
        if channel == "iopub":
            self._subscribed = False

    def _close(self, sock: zmq.asyncio.Socket) -> None:
        watched = self._monitors.pop(sock, None)
        if watched is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            watched[1].close(linger=0)
        sock.close(linger=0)

    def close(self) -> None:
        for sock in list(self._channels.values()):
            self._close(sock)
        self._channels.clear()
        for relay in self._relays.values():
            relay.close()

    async def _reopen_dropped(self, *channels: str) -> None:
        """Open anew those of `channels` whose connection was dropped since last seen."""
        for channel, mon in list(self._monitors.values()):
            if channel not in channels:
                continue
            dropped = False
            # EVENTS, not an awaited poll: this runs before every request, and a monitor
            # socket almost never has anything to read.
            while int(mon.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                event = parse_monitor_message(await mon.recv_multipart())
                dropped = dropped or event.get("event") == zmq.EVENT_DISCONNECTED
            if dropped:
                log.warning("the kernel's %s channel was dropped; it is opened anew", channel)
                self._open(channel)

    async def before_request(self, timeout: float = 5.0) -> None:
        """Make the channels whole before a new request: reopen any that was dropped
        unnoticed, and see that a new IOPub socket is subscribed (a control request's
        status crosses it), so the request's output cannot be missed. Within `timeout`;
        the request goes ahead either way (a kernel that does not answer is found out
        by the call's own checks)."""
        await self._reopen_dropped(*_KINDS)
        deadline = time.monotonic() + timeout
        while not self._subscribed and (left := deadline - time.monotonic()) > 0:
            async with self._control_lock:
                self.send(self.control, "kernel_info_request", {})
                with contextlib.suppress(ChannelDropped):
                    self._subscribed = await self._iopub_live(min(1.0, left))
        if not self._subscribed:
            log.warning("the kernel's new iopub socket saw no message within %.0fs", timeout)

    async def _wait(self, sock: zmq.asyncio.Socket, seconds: float) -> bool:
        """True when `sock` has a message within `seconds`; ChannelDropped if the
        connection of a monitored channel is lost first."""
        watched = self._monitors.get(sock)
        if watched is None:
            return bool(await sock.poll(seconds * 1000))
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            return True  # the hot path: a drop is seen when the channel runs dry
        channel, mon = watched
        if channel not in _RAISING:
            return bool(await sock.poll(seconds * 1000))
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        ready = dict(await poller.poll(seconds * 1000))
        if mon in ready:
            event = parse_monitor_message(await mon.recv_multipart())
            if event.get("event") == zmq.EVENT_DISCONNECTED:
                log.warning("the kernel's %s channel was dropped; it is opened anew", channel)
                self._open(channel)
                raise ChannelDropped(channel)
        return sock in ready

    # ---- messages ----------------------------------------------------------------------

    def send(self, sock: zmq.asyncio.Socket, msg_type: str, content: dict[str, Any]) -> str:
        """Sign and send a request; its msg_id.

        The wire format of jupyter-client's `Session.send` (header, parent, metadata,
        content, signed with the session's HMAC), made here: for a request of plain
        JSON it costs a quarter as much (no traitlets, no serializer fallbacks), and it
        is made before every execute.
        """
        msg_id = f"{self._msg_prefix}{next(self._msg_numbers)}"
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "username": "mcp-forge",
            "session": self.session.session,
            "date": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "version": protocol_version,
        }
        parts = [pack(header), b"{}", b"{}", pack(content)]
        signature = self._signer.copy()
        for part in parts:
            signature.update(part)
        sock.send_multipart([DELIMITER, signature.hexdigest().encode(), *parts])
        return msg_id

    async def recv(
        self, sock: zmq.asyncio.Socket, timeout: float, *, parents: tuple[str, ...] = ()
    ) -> Message | None:
        """The next well-formed message within `timeout`; None on timeout.

        Oversized and malformed messages are read to their end and dropped. With
        `parents`, so is a message that is surely not in reply to one of those requests
        (its parent header does not hold the msg_id's text): neither verified nor parsed,
        as the IOPub messages of other clients' requests, or late ones of earlier
        requests, would cost a tenth of a millisecond each. A message that holds it is
        verified and parsed; the caller still compares the parsed msg_id.
        """
        wanted = [p.encode() for p in parents]
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not await self._wait(sock, left):
                if time.monotonic() < deadline:
                    continue  # a monitor event that was not a drop
                return None
            # libzmq has the whole message before its first frame is readable (the relay
            # bounds how much that is): one read takes every frame, without copying
            # them, and only a message within max_message is copied out to be parsed.
            # It is read at once, without the asyncio socket's future (most of the cost
            # of a small message's read), unless it is not there after all.
            try:
                parts = read_now(sock)
            except zmq.Again:
                parts = await sock.recv_multipart(copy=False)
            total = sum(len(part) for part in parts)
            self._relay_of(sock).consumed(total + len(parts) * FRAME_OVERHEAD)
            if wanted and not may_answer(parts, wanted):
                continue
            if total > self.max_message:
                log.warning(
                    "dropped a %d-byte message from the kernel (limit %d)", total, self.max_message
                )
                self.refused += sock is self.shell
                continue
            msg = parse(self.session, [part.bytes for part in parts])
            if msg is not None:
                return msg
            self.refused += sock is self.shell

    async def reply(self, sock: zmq.asyncio.Socket, msg_id: str, timeout: float) -> Message | None:
        """The reply to `msg_id` on `sock` within `timeout`; other replies are dropped."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = await self.recv(sock, left, parents=(msg_id,))
            if msg is None:
                return None
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        return None

    # ---- requests ----------------------------------------------------------------------

    async def wait_ready(
        self, timeout: float, *, retry: float = 2.0, iopub: float = 0.1
    ) -> dict[str, Any]:
        """Wait until the kernel answers kernel_info and IOPub carries a message.

        The request is sent again every `retry` seconds: a kernel that was starting
        when the first one left may not have seen it. It is sent again, too, when
        nothing has crossed IOPub soon after the reply (`_iopub_live`): the kernel
        publishes the request's status (busy) before it replies, so a status still
        missing by then was almost always dropped, our subscription not having reached
        the kernel yet (a kernel that answers within milliseconds of binding its
        sockets, as ours do in a pod, or one already running, as a pool's is); a status
        that was only late costs one more request. The first wait is 10 ms, doubled each
        time up to `iopub` seconds. Waiting a second for a dropped status was a
        one-second tail on such starts (tests/bench/profile_cold.py counts them).
        """
        deadline = time.monotonic() + timeout
        patience = min(IOPUB_FIRST_WAIT, iopub)
        async with self._control_lock:
            while (left := deadline - time.monotonic()) > 0:
                msg_id = self.send(self.control, "kernel_info_request", {})
                got = await self.reply(self.control, msg_id, min(retry, left))
                if got is None:
                    continue
                self.kernel_info = got["content"]
                # Who answers: each kernel process signs with a session id of its own, so
                # a reply from a kernel started since (same sockets) is told apart.
                self.kernel_session = got["header"].get("session")
                with contextlib.suppress(ChannelDropped):  # asked again on the next turn
                    left = max(deadline - time.monotonic(), 0)
                    if await self._iopub_live(min(patience, left)):
                        self._subscribed = True
                        return self.kernel_info
                    patience = min(patience * 2, iopub)
        raise SessionNotReady(f"the kernel did not answer kernel_info within {timeout:.0f}s")

    async def _iopub_live(self, timeout: float) -> bool:
        """True once IOPub has a message within `timeout`: any message that crosses it
        says our subscription has reached the kernel, so the output of what we send next
        cannot be missed. Mostly it is ipykernel 7's greeting of each new subscriber
        (`iopub_welcome`, JEP 65), there before the kernel_info reply: a new connection
        to a running kernel costs one round trip. An older kernel's is the status of our
        request. It is left to be read, and dropped, by the next request's reader."""
        return await self._wait(self.iopub, timeout)

    async def heartbeat(self, timeout: float) -> bool:
        """True if the kernel process echoes a ping within `timeout` (even when busy)."""
        sock = self._ctx.socket(zmq.REQ)
        self._curve(sock)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)
        try:
            sock.connect(self.url("hb"))
            ping = uuid.uuid4().bytes
            await sock.send(ping)
            if not await sock.poll(timeout * 1000):
                return False
            return bool(await sock.recv() == ping)
        finally:
            sock.close(linger=0)

    async def wait_shell_caught_up(self, collector: Collector, timeout: float) -> bool:
        """After a drop: True once the kernel has finished `collector`'s request;
        KernelReplaced if another kernel process answers (the one that ran it is gone).

        Shell requests are handled in order, so the reply to a kernel_info_request sent
        now proves the request before it is done; its execute_reply, if it arrives, is
        fed to `collector`, and so is the output that IOPub still carries for it (up to
        the probe's own idle status). Drops meanwhile are survived, not raised.
        """
        deadline = time.monotonic() + timeout
        probe = self.send(self.shell, "kernel_info_request", {})
        replied = False
        while not replied and (left := deadline - time.monotonic()) > 0:
            try:
                msg = await self.recv(self.shell, left, parents=(collector.msg_id, probe))
            except ChannelDropped:
                continue
            if msg is None:
                return False
            parent = msg["parent_header"].get("msg_id")
            if parent == collector.msg_id:
                collector.feed(msg)
            if parent == probe and msg["header"].get("session") != self.kernel_session:
                raise KernelReplaced()
            replied = parent == probe
        while replied and (left := deadline - time.monotonic()) > 0:
            try:
                msg = await self.recv(self.iopub, min(left, 1.0), parents=(collector.msg_id, probe))
            except ChannelDropped:
                continue
            if msg is None:
                break
            parent = msg["parent_header"].get("msg_id")
            if parent == collector.msg_id:
                collector.feed(msg)
            elif parent == probe and msg["content"].get("execution_state") == "idle":
                break
        return replied

    def send_execute(
        self,
        code: str,
        *,
        silent: bool,
        store_history: bool,
        user_expressions: dict[str, str] | None = None,
    ) -> str:
        content = {
            "code": code,
            "silent": silent,
            "store_history": store_history,
            "user_expressions": user_expressions or {},
            "allow_stdin": False,
            "stop_on_error": False,
        }
        return self.send(self.shell, "execute_request", content)

    async def pump(self, collector: Collector, timeout: float, *, started: bool = False) -> bool:
        """Feed `collector` the messages of its request for up to `timeout` seconds.

        IOPub until the kernel is idle for the request, then the shell reply (the kernel
        sends the reply first, so it is waiting). Messages of other requests, such as the
        late output of an earlier one, are dropped. True once the request is done, or
        with `started` once the kernel has begun it.

        A reply that has not followed the idle status within REPLY_AFTER_IDLE is asked
        after: a kernel_info_request on shell (the probe), which the kernel answers after
        any reply it sent, as it handles shell requests in order. Answered first, it
        proves no reply is coming (Collector.reply_lost); answered by another kernel
        process, KernelReplaced.
        """
        deadline = time.monotonic() + timeout
        if collector.refused_before < 0:
            collector.refused_before = self.refused
        while not (collector.done or (started and collector.started)):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if collector.idle:
                msg = await self._reply(collector, left)
            else:
                msg = await self.recv(self.iopub, left, parents=(collector.msg_id,))
            if msg is None:
                if collector.idle and not collector.probe and time.monotonic() < deadline:
                    # Its reply did not follow its idle status: a kernel_info_request
                    # tells, as shell requests are answered in order.
                    collector.probe = self.send(self.shell, "kernel_info_request", {})
                    continue
                return False
            parent = msg["parent_header"].get("msg_id")
            if parent == collector.msg_id:
                collector.feed(msg)
            elif parent == collector.probe and collector.probe:
                said = msg["header"].get("session")
                if self.kernel_session is not None and said != self.kernel_session:
                    raise KernelReplaced()
                collector.reply_lost = True  # answered after it: no reply is coming
                collector.reply_refused = self.refused > collector.refused_before
        return True

    async def _reply(self, collector: Collector, timeout: float) -> Message | None:
        """The next shell message for an idle request: its reply, or the probe's answer.
        Until the probe is sent, within REPLY_AFTER_IDLE of the idle status (ipykernel
        sends the reply first: it is nearly always waiting already)."""
        if not collector.probe:
            wait = collector.idle_at + REPLY_AFTER_IDLE - time.monotonic()
            return await self.recv(
                self.shell, min(timeout, max(wait, 0.01)), parents=(collector.msg_id,)
            )
        return await self.recv(self.shell, timeout, parents=(collector.msg_id, collector.probe))

    async def interrupt(self, timeout: float) -> bool:
        """Send interrupt_request on the control channel; True if the kernel acknowledged."""
        await self._reopen_dropped("control")
        async with self._control_lock:
            msg_id = self.send(self.control, "interrupt_request", {})
            return await self.reply(self.control, msg_id, timeout) is not None
