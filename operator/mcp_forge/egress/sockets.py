"""The egress proxy's two Unix sockets in cluster mode (server.py `--listen`), in a
directory its pod's containers share.

* The control socket (`--control-socket`): the feeder's requests, one JSON object a line,
  each answered in order, as over the local mode's socket pair (without descriptors).
  One controller at a time: a second one is answered `{"ok": false, "error": ...}` and
  closed. A controller that goes away stops nothing: the sessions stay open for the next.
* The audit socket (`--audit-socket`): every connected reader gets each audit record as a
  JSON line. Its stream begins with `{"event": "audit", "dropped": 0}` (it is counted from
  there). The proxy never waits for a reader: one that falls more than `buffer_max`
  bytes behind loses records, counted, and, as soon as it has caught up, gets
  `{"event": "audit", "dropped": N}` where they would have been.

Both are created mode 0600 (only the proxy's user, and so a feeder running as it, may
connect); a socket left at the path by an earlier process is removed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Any

from mcp_forge.egress import protocol

Handler = Callable[[dict[str, Any], list[int]], Awaitable[dict[str, Any]]]
READERS_MAX = 16  # audit readers connected at once: the feeder, and someone debugging


def listen_unix(path: str) -> socket.socket:
    """A listening socket at `path`, mode 0600 from its creation. A socket already there
    (a stale one: its process is gone) is removed; anything else there is an error."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the process's: nothing else makes files at start-up
    try:
        sock.bind(path)
        sock.listen(8)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    return sock


def line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


class ControlSocket:
    """The controller's socket: requests handed to `handle`, answers sent in order."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.server: asyncio.Server | None = None
        self.connected = False

    async def start(self, path: str) -> None:
        self.server = await asyncio.start_unix_server(
            self._serve, sock=listen_unix(path), limit=protocol.MESSAGE_MAX + 1
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connected:
            writer.write(line({"ok": False, "error": "another controller is connected"}))
            writer.close()
            return
        self.connected = True
        try:
            while True:
                try:
                    raw = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    return  # the controller went: the sessions stay
                except asyncio.LimitOverrunError:
                    error = f"control message over {protocol.MESSAGE_MAX} bytes"
                    writer.write(line({"ok": False, "error": error}))
                    return  # the rest of that message cannot be told from the next one
                try:
                    message = json.loads(raw)
                except ValueError:
                    message = None
                if not isinstance(message, dict):
                    answer = {"ok": False, "error": "a control message is a JSON object"}
                else:
                    answer = await self._answer(message)
                writer.write(protocol.encoded(answer))
                await writer.drain()
        except OSError:
            return
        finally:
            self.connected = False
            writer.close()

    async def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        # The outermost edge of cluster mode's control: a request that fails in a way
        # `handle` did not foresee is that request's error, not the controller's end (a
        # feeder would only send it again after connecting again).
        try:
            return await self.handle(message, [])
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


class AuditSocket:
    """The audit socket's readers, each sent every record without ever being waited for."""

    def __init__(self, buffer_max: int = protocol.AUDIT_BUFFER) -> None:
        self.buffer_max = buffer_max
        self.readers: set[_Reader] = set()
        self.server: asyncio.Server | None = None

    async def start(self, path: str) -> None:
        self.server = await asyncio.start_unix_server(self._serve, sock=listen_unix(path))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for reader in self.readers:
            reader.writer.close()

    def send(self, data: bytes) -> None:
        for reader in self.readers:
            reader.send(data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.readers) >= READERS_MAX:
            writer.close()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:  # what the kernel holds for it: about buffer_max too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_max)
        writer.transport.set_write_buffer_limits(high=self.buffer_max, low=self.buffer_max // 2)
        ours = _Reader(writer, self.buffer_max)
        writer.write(line({"event": "audit", "dropped": 0}))
        self.readers.add(ours)
        try:
            while await reader.read(4096):  # nothing is expected: read to see its end
                pass
        except OSError:
            pass
        finally:
            self.readers.discard(ours)
            if ours.catching_up is not None:
                ours.catching_up.cancel()
            writer.close()


class _Reader:
    def __init__(self, writer: asyncio.StreamWriter, buffer_max: int) -> None:
        self.writer = writer
        self.buffer_max = buffer_max
        self.dropped = 0  # records lost since it fell behind
        self.catching_up: asyncio.Task[None] | None = None

    def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        if self.dropped:
            self.dropped += 1
        elif self.writer.transport.get_write_buffer_size() > self.buffer_max:
            self.dropped = 1
            self.catching_up = asyncio.create_task(self._catch_up())
        else:
            self.writer.write(data)

    async def _catch_up(self) -> None:
        """Once the reader has read what was buffered: the count of what it lost."""
        try:
            await self.writer.drain()
        except OSError:
            return
        self.writer.write(line({"event": "audit", "dropped": self.dropped}))
        self.dropped = 0
