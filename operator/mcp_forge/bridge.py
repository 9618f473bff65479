"""The gateway's end of code mode's bridge (docs/bridge.md).

One `Bridge` per session: the gateway dials the kernel's bridge listener (a Unix socket
in the session's run directory locally, TCP 5560 of its pod on a cluster), says which
tools the session may call, and serves the kernel's calls through the upstream servers.
Which session calls is known from the connection the gateway opened, never from what
the kernel says. Every call is checked against the session's policy, budget and rate,
bounded in size, time and concurrency, and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from typing import Any

from .connection import Address
from .errors import KernelProtocolError
from .kernel_bridge import KERNEL_FRAME_MAX, FrameReader, encode
from .policy import Meter, ServerPolicy
from .upstream import Upstream, UpstreamError, result_frame

log = logging.getLogger("mcp_forge.bridge")

CONCURRENT_MAX = 16  # calls in flight per session
CALL_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0


class Bridge:
    def __init__(
        self,
        session: str,
        upstreams: dict[str, Upstream],
        policies: dict[str, ServerPolicy],
        *,
        call_timeout: float = CALL_TIMEOUT,
    ) -> None:
        self.session = session
        self.upstreams = {n: u for n, u in upstreams.items() if n in policies}
        self.policies = policies
        self.call_timeout = call_timeout
        self.meter = Meter()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(CONCURRENT_MAX)
        self._write_lock = asyncio.Lock()
        self.tools: dict[str, list[dict[str, Any]]] = {}  # server -> tools this session may call
        self.started = 0  # calls served so far (observability, and tests wait on it)
        self.call_started = asyncio.Event()  # set (and replaced) as each call starts

    @property
    def connected(self) -> bool:
        return self._reader_task is not None and not self._reader_task.done()

    async def hello(self) -> dict[str, Any]:
        """The tools the session may call, per server (a server that is down has none)."""
        servers: dict[str, Any] = {}
        for name, upstream in self.upstreams.items():
            try:
                await upstream.connect()
            except UpstreamError as exc:
                log.warning("session %s: %s", self.session, exc)
            policy = self.policies[name]
            tools = []
            for tool in upstream.tools:
                why = policy.refusal(tool)
                if why is not None:  # listed, so that calling it says why it is refused
                    tool = {
                        **tool,
                        "description": f"NOT ALLOWED here: {why}. "
                        + str(tool.get("description") or ""),
                    }
                tools.append(tool)
            self.tools[name] = tools
            servers[name] = {"tools": tools}
        return {"v": 1, "type": "hello", "servers": servers}

    async def open(self, address: Address) -> None:
        """Dial the kernel's listener, check who answers, send the hello, serve calls."""
        await self.close()
        if address.kind == "unix":
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(address.path), CONNECT_TIMEOUT
            )
            sock = writer.get_extra_info("socket")
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = int.from_bytes(creds[:4], "little")
            if address.peer_check is not None and not address.peer_check(pid):
                writer.close()
                raise ConnectionError(
                    f"the bridge socket of {self.session} is served by a process outside its "
                    "kernel's container"
                )
        else:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address.host, address.port), CONNECT_TIMEOUT
            )
        self._writer = writer
        await self._send(await self.hello())
        self._reader_task = asyncio.create_task(self._read(reader), name=f"bridge {self.session}")

    async def close(self) -> None:
        for task in list(self._calls.values()):
            task.cancel()
        self._calls.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        """Close now, from synchronous code (the kernel connection is being dropped)."""
        for task in list(self._calls.values()):
            task.cancel()
        self._calls.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def new_execution(self) -> None:
        """A new execute_code call: the per-execution budgets start again."""
        self.meter.new_execution()

    async def _send(self, frame: dict[str, Any]) -> None:
        await self._send_bytes(encode(frame))

    async def _send_bytes(self, data: bytes) -> None:
        async with self._write_lock:
            if self._writer is None:
                return
            self._writer.write(data)
            await self._writer.drain()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        frames = FrameReader(KERNEL_FRAME_MAX)
        try:
            while chunk := await reader.read(65536):
                for frame in frames.feed(chunk):
                    self._dispatch(frame)
        except (KernelProtocolError, ConnectionError) as exc:  # a broken or oversized frame
            log.warning("bridge of %s closed: %s", self.session, exc)
        finally:
            for task in list(self._calls.values()):
                task.cancel()

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind, call_id = frame.get("type"), frame.get("id")
        if not isinstance(call_id, int) or isinstance(call_id, bool) or call_id <= 0:
            return  # nothing to answer to
        if kind == "cancel":
            task = self._calls.pop(call_id, None)
            if task is not None:
                task.cancel()
        elif kind == "call" and call_id not in self._calls:
            self.started += 1
            self.call_started.set()
            self.call_started = asyncio.Event()
            task = asyncio.create_task(self._serve(call_id, frame))
            self._calls[call_id] = task

            def done(_: asyncio.Task[None], i: int = call_id) -> None:
                self._calls.pop(i, None)

            task.add_done_callback(done)

    async def _serve(self, call_id: int, frame: dict[str, Any]) -> None:
        started = time.monotonic()
        server, tool, args = frame.get("server"), frame.get("tool"), frame.get("arguments", {})
        size_in = len(json.dumps(args, separators=(",", ":"))) if isinstance(args, dict) else 0
        status, size_out = "error", 0
        try:
            answer = await self._answer(server, tool, args)
            status = "ok" if answer.get("ok") else answer["error"]["kind"]
            if answer.get("ok") and answer.get("isError"):
                status = "tool-error"
            try:
                data = encode({"v": 1, "type": "result", "id": call_id, **answer})
            except ValueError as exc:  # too large for the kernel, or not JSON
                status = "too-large"
                why = f"the result of {server}.{tool} cannot be passed to the kernel: {exc}"
                data = encode(
                    {"v": 1, "type": "result", "id": call_id, **_error("unavailable", why)}
                )
            size_out = len(data)
            await self._send_bytes(data)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            log.info(
                "bridge call session=%s server=%s tool=%s status=%s ms=%.0f in=%d out=%d",
                self.session,
                server,
                tool,
                status,
                (time.monotonic() - started) * 1000,
                size_in,
                size_out,
            )

    async def _answer(self, server: Any, tool: Any, args: Any) -> dict[str, Any]:
        if not isinstance(server, str) or not isinstance(tool, str) or not isinstance(args, dict):
            return _error("invalid", "a call names a server, a tool and an arguments object")
        policy = self.policies.get(server)
        upstream = self.upstreams.get(server)
        if policy is None or upstream is None:
            return _error("denied", f"this session may not use the MCP server {server!r}")
        known = next((t for t in upstream.tools if t.get("name") == tool), None)
        if known is None:
            return _error("invalid", f"{server} has no tool {tool!r}")
        why = policy.refusal(known) or self.meter.take(policy)
        if why is not None:
            kind = "denied" if policy.refusal(known) else "unavailable"
            return _error(kind, why)
        async with self._slots:
            try:
                result = await upstream.call(tool, args, timeout=self.call_timeout)
            except UpstreamError as exc:
                return _error("unavailable", str(exc))
        return result_frame(result)


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"kind": kind, "message": message}}
