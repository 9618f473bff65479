"""One jupyter-client connection to one remote kernel, over ZMQ.

The kernel runs in a pod we do not control from here, so there is no local process
to signal: readiness is a kernel_info reply, liveness a heartbeat echo, interrupt an
``interrupt_request`` on the control channel. Sizes are bounded at the socket
(ZMQ_MAXMSGSIZE), so a kernel cannot make us hold an unbounded message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient

from .connection import ConnectionInfo
from .errors import SessionNotReady
from .execution import Collector

log = logging.getLogger(__name__)


class _BoundedClient(AsyncKernelClient):
    """An AsyncKernelClient whose sockets refuse messages over a size limit."""

    max_message_size: int = 32_000_000

    def _create_connected_socket(
        self, channel: str, identity: bytes | None = None
    ) -> zmq.Socket[Any]:
        from jupyter_client.connect import channel_socket_types

        sock: zmq.Socket[Any] = self.context.socket(channel_socket_types[channel])
        sock.linger = 1000
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_size)
        if identity:
            sock.identity = identity
        sock.connect(self._make_url(channel))
        return sock


class KernelConnection:
    """Channels to one kernel. Not safe for concurrent requests: callers serialize."""

    def __init__(self, info: ConnectionInfo, *, max_message_size: int) -> None:
        self.info = info
        self.client = _BoundedClient()
        self.client.max_message_size = max_message_size
        self.client.load_connection_info(info.to_jupyter())  # type: ignore[arg-type]
        self.client.session.key = info.key.encode()
        self.client.start_channels(hb=False)
        self._ctx = zmq.asyncio.Context.instance()
        self._hb_url = self.client._make_url("hb")
        self.kernel_info: dict[str, Any] = {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_channels()

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait for a kernel_info reply, re-asking every 2 s, under `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionNotReady(
                    f"the kernel did not answer kernel_info within {timeout:.0f}s"
                )
            msg_id = self.client.kernel_info()
            try:
                reply = await self._shell_reply(msg_id, min(2.0, left))
            except TimeoutError:
                continue
            self.kernel_info = reply.get("content", {})
            return self.kernel_info

    async def _shell_reply(self, msg_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                msg: dict[str, Any] = await self.client.get_shell_msg(timeout=left)
            except queue.Empty:
                raise TimeoutError from None
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    async def heartbeat(self, timeout: float) -> bool:
        """True if the kernel process echoes a ping within `timeout` (even when busy)."""
        sock = self._ctx.socket(zmq.REQ)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)
        try:
            sock.connect(self._hb_url)
            ping = uuid.uuid4().bytes
            await sock.send(ping)
            try:
                async with asyncio.timeout(timeout):
                    return bool(await sock.recv() == ping)
            except TimeoutError:
                return False
        finally:
            sock.close(linger=0)

    def send_execute(self, code: str, *, silent: bool, store_history: bool) -> str:
        msg_id: str = self.client.execute(
            code, silent=silent, store_history=store_history, allow_stdin=False, stop_on_error=False
        )
        return msg_id

    async def pump(self, collector: Collector, timeout: float) -> bool:
        """Feed `collector` the messages of its request for up to `timeout` seconds.

        IOPub until the kernel is idle for the request, then the shell reply (the kernel
        sends the reply first, so it is waiting). Messages of other requests, such as the
        late output of an earlier one, are dropped. True once the request is done.
        """
        deadline = time.monotonic() + timeout
        while not collector.done:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if not collector.idle:
                    msg = await self.client.get_iopub_msg(timeout=left)
                else:
                    msg = await self.client.get_shell_msg(timeout=left)
            except queue.Empty:
                return False
            if msg.get("parent_header", {}).get("msg_id") == collector.msg_id:
                collector.feed(msg)
        return True

    async def interrupt(self, timeout: float) -> bool:
        """Send interrupt_request on the control channel; True if the kernel acknowledged."""
        msg = self.client.session.msg("interrupt_request", {})
        self.client.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                reply = await self.client.get_control_msg(timeout=left)
            except queue.Empty:
                return False
            if reply.get("parent_header", {}).get("msg_id") == msg["header"]["msg_id"]:
                return True
