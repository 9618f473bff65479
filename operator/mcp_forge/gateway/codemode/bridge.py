"""The gateway's end of code mode's bridge (docs/bridge.md).

One `Bridge` per session: the gateway dials the kernel's bridge listener (a Unix socket
in the session's run directory locally, TCP 5560 of its pod on a cluster), says which
tools the session may call, and serves the kernel's calls through the upstream servers.
Which session calls is known from the connection the gateway opened, never from what
the kernel says. Every call is checked against the session's policy, budget and rate
and the tool's input schema, bounded in size, time and concurrency, and logged.

A connection that breaks the framing (a frame too large, not JSON, or not arriving
whole within FRAME_DEADLINE) is closed, and the gateway dials again (at most
REDIALS_PER_MINUTE times a minute, and again at the next execution): a kernel that
sends garbage loses the calls in flight on that connection, nothing more. Locally the
socket is opened without following links (the kernel owns the directory it is in). On a
cluster, when the session's Secret has a bridge certificate, the connection is mutual TLS
1.3 pinned to it: the kernel's listener takes no frame from a peer without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp_forge import metrics, tracing
from mcp_forge.api.connection import Address
from mcp_forge.api.keys import BridgeCert, bridge_client_context
from mcp_forge.api.quota import rate_refusal
from mcp_forge.errors import KernelProtocolError, UpstreamError
from mcp_forge.gateway.codemode.policy import Meter, ServerPolicy
from mcp_forge.gateway.codemode.upstream import Upstream, result_frame
from mcp_forge.kernelside.framing import KERNEL_FRAME_MAX, FrameError, FrameReader, encode
from mcp_forge.logsafe import quoted, shown

log = logging.getLogger(__name__)

CONCURRENT_MAX = 16  # upstream calls at once per session
CALLS_MAX = 64  # calls accepted at once per session (running or waiting): more are refused
CALL_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0
FRAME_DEADLINE = 10.0  # a frame's bytes, once it started, must all arrive within this
REDIALS_PER_MINUTE = 10
WRITE_BUFFER_MAX = 4 << 20  # answers the kernel does not read: past this, close
ID_MAX = 2**53  # call ids are JSON-safe integers
NAME_SHOWN = 100  # characters of a server or tool name the kernel sent, in logs and spans


class Bridge:
    def __init__(
        self,
        session: str,
        upstreams: dict[str, Upstream],
        policies: dict[str, ServerPolicy],
        *,
        call_timeout: float = CALL_TIMEOUT,
        meter: Meter | None = None,
        refused: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        rate: Callable[[str, int], Awaitable[bool]] | None = None,
    ) -> None:
        """`meter` counts the session's calls (give the same one to the session's next
        bridge, so a new bridge is no new budget); `refused` names servers the session
        may use but has no upstream for, and why; `on_close` runs once, when the bridge
        is closed for good; `rate(server, per_minute)` counts a call against the rate
        where every gateway replica counts (False: the limit is reached), in place of
        the meter's own count."""
        self.session = session
        self.upstreams = {n: u for n, u in upstreams.items() if n in policies}
        self.policies = policies
        self.call_timeout = call_timeout
        self.meter = meter if meter is not None else Meter()
        self.refused = {n: why for n, why in (refused or {}).items() if n in policies}
        self._on_close = on_close
        self.rate = rate
        self._address: Address | None = None
        self._closing = False
        self._redials: list[float] = []
        self._redial_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(CONCURRENT_MAX)
        self._write_lock = asyncio.Lock()
        self.tools: dict[str, list[dict[str, Any]]] = {}  # server -> tools this session may call
        self.started = 0  # calls served so far (observability, and tests wait on it)
        self.trace: tracing.Context | None = None  # the running execution's, for its calls
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
            if not upstream.tools:
                servers[name]["unavailable"] = f"the MCP server {name!r} lists no tools (down?)"
        for name, why in self.refused.items():
            servers[name] = {"tools": [], "unavailable": why}
        return {"v": 1, "type": "hello", "servers": servers}

    async def open(self, address: Address) -> None:
        """Dial the kernel's listener, check who answers, send the hello, serve calls."""
        await self._disconnect()
        self._closing = False
        self._address = address
        await self._dial(address)

    async def _dial(self, address: Address) -> None:
        if address.kind == "unix":
            async with asyncio.timeout(CONNECT_TIMEOUT):
                reader, writer = await _open_unix(address.path)
            sock = writer.get_extra_info("socket")
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = int.from_bytes(creds[:4], "little")
            if address.peer_check is not None and not address.peer_check(pid):
                writer.close()
                raise ConnectionError(
                    f"the bridge socket of {self.session} is served by a process outside its "
                    "kernel's container"
                )
        elif address.tls is not None:
            reader, writer = await _open_tls(address, address.tls)
        else:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                reader, writer = await asyncio.open_connection(address.host, address.port)
        self._writer = writer
        await self._send(await self.hello())
        self._reader_task = asyncio.create_task(
            self._read(reader, writer), name=f"bridge {self.session}"
        )

    async def _redial(self) -> None:
        """Dial again after a connection closed, unless it happened too often lately."""
        if self._closing or self._address is None or self.connected:
            return
        now = time.monotonic()
        self._redials = [t for t in self._redials if t > now - 60.0]
        if len(self._redials) >= REDIALS_PER_MINUTE:
            log.warning(
                "bridge of %s: %d reconnections in a minute; the next execution dials again",
                self.session,
                len(self._redials),
            )
            return
        self._redials.append(now)
        try:
            await self._dial(self._address)
        except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
            # The kernel is gone (or its socket is not one): so is this bridge. What the
            # session holds (isolated upstreams, its meter) lingers for its next kernel.
            log.warning("bridge of %s: dialing again failed, closed: %s", self.session, exc)
            self._closing = True
            self._released()

    def _start_redial(self) -> None:
        if self._closing or (self._redial_task is not None and not self._redial_task.done()):
            return
        self._redial_task = asyncio.get_running_loop().create_task(
            self._redial(), name=f"bridge {self.session} redial"
        )

    async def close(self) -> None:
        """Close for good: the connection, the calls in flight, the session's lease."""
        await self._disconnect()
        self._released()

    async def _disconnect(self) -> None:
        self._closing = True
        if self._redial_task is not None:
            self._redial_task.cancel()
            with contextlib.suppress(BaseException):
                await self._redial_task
            self._redial_task = None
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

    def _released(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def abort(self) -> None:
        """Close now, from synchronous code (the kernel connection is being dropped)."""
        self._closing = True
        if self._redial_task is not None:
            self._redial_task.cancel()
            self._redial_task = None
        for task in list(self._calls.values()):
            task.cancel()
        self._calls.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._released()

    def new_execution(self, trace: tracing.Context | None = None) -> None:
        """A new execute_code call: the per-execution budgets start again, its calls are
        spans of its trace, and a bridge that lost its connection dials again."""
        self.meter.new_execution()
        self.trace = trace
        if not self.connected and self._address is not None and not self._closing:
            self._redials.clear()
            self._start_redial()

    async def _send(self, frame: dict[str, Any]) -> None:
        await self._send_bytes(encode(frame))

    async def _send_bytes(self, data: bytes) -> None:
        async with self._write_lock:
            if self._writer is None:
                return
            self._writer.write(data)
            await self._writer.drain()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(KERNEL_FRAME_MAX)
        started: float | None = None  # when the frame now arriving began
        try:
            while True:
                if started is None:
                    chunk = await reader.read(65536)
                else:
                    left = started + FRAME_DEADLINE - time.monotonic()
                    try:
                        async with asyncio.timeout(max(left, 0.0)):
                            chunk = await reader.read(65536)
                    except TimeoutError:
                        raise KernelProtocolError(
                            f"a bridge frame did not arrive whole within {FRAME_DEADLINE:g}s"
                        ) from None
                if not chunk:
                    break
                done = 0
                for frame in frames.feed(chunk):
                    done += 1
                    self._dispatch(frame, writer)
                if frames.buffered == 0:
                    started = None
                elif done or started is None:  # what is left began in this chunk
                    started = time.monotonic()
        except (FrameError, KernelProtocolError, ConnectionError) as exc:
            # A broken, slow or huge frame (FrameError: framing refused it).
            log.warning("bridge of %s closed: %s", self.session, shown(exc, 300))
        finally:
            for task in list(self._calls.values()):
                task.cancel()
            writer.close()  # the kernel sees its connection closed, and fails what waits
            if self._writer is writer:
                self._writer = None
            self._start_redial()

    def _dispatch(self, frame: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        kind, call_id = frame.get("type"), frame.get("id")
        if type(call_id) is not int or not 0 < call_id < ID_MAX:
            return  # nothing to answer to
        if kind == "cancel":
            task = self._calls.pop(call_id, None)
            if task is not None:
                task.cancel()
        elif kind == "call" and call_id not in self._calls:
            if len(self._calls) >= CALLS_MAX:
                # No task for it: answered at once, on the spot.
                why = (
                    f"{len(self._calls)} calls of this session are in flight, the most the "
                    "MCP bridge takes; wait for some to finish"
                )
                writer.write(
                    encode({"v": 1, "type": "result", "id": call_id, **_error("unavailable", why)})
                )
                if writer.transport.get_write_buffer_size() > WRITE_BUFFER_MAX:
                    raise KernelProtocolError("the kernel does not read the bridge's answers")
                return
            self.started += 1
            self.call_started.set()
            self.call_started = asyncio.Event()
            task = asyncio.create_task(self._serve(call_id, frame))
            self._calls[call_id] = task

            def done(_: asyncio.Task[None], i: int = call_id) -> None:
                if self._calls.get(i) is _:
                    del self._calls[i]

            task.add_done_callback(done)

    async def _serve(self, call_id: int, frame: dict[str, Any]) -> None:
        started = time.monotonic()
        server, tool, args = frame.get("server"), frame.get("tool"), frame.get("arguments", {})
        size_in = len(json.dumps(args, separators=(",", ":"))) if isinstance(args, dict) else 0
        status, size_out = "error", 0
        # The kernel's words: escaped and bounded wherever they are shown.
        named = f"{shown(server, NAME_SHOWN)}.{shown(tool, NAME_SHOWN)}"
        try:
            with tracing.span(f"bridge {named}", session=self.session, parent=self.trace):
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
            known = server if isinstance(server, str) and server in self.policies else "unknown"
            metrics.BRIDGE_CALLS.labels(server=known, status=status).inc()
            # What the kernel chose comes last: nothing it writes can stand for our fields.
            log.info(
                "bridge call session=%s status=%s ms=%.0f in=%d out=%d call=%s",
                self.session,
                status,
                (time.monotonic() - started) * 1000,
                size_in,
                size_out,
                named,
            )

    async def _answer(self, server: Any, tool: Any, args: Any) -> dict[str, Any]:
        if not isinstance(server, str) or not isinstance(tool, str) or not isinstance(args, dict):
            return _error("invalid", "a call names a server, a tool and an arguments object")
        policy = self.policies.get(server)
        if policy is not None and server in self.refused:
            return _error("unavailable", self.refused[server])
        upstream = self.upstreams.get(server)
        if policy is None or upstream is None:
            return _error("denied", f"this session may not use the MCP server {quoted(server)}")
        known = next((t for t in upstream.tools if t.get("name") == tool), None)
        if known is None:
            return _error("invalid", f"{server} has no tool {quoted(tool)}")
        denied = policy.refusal(known)
        if denied is not None:
            return _error("denied", denied)
        if (problem := upstream.argument_problem(known, args)) is not None:
            return _error("invalid", problem)
        spent = (
            self.meter.over_budget(policy)
            or await self._over_rate(policy)
            or self.meter.take(policy, rate=self.rate is None)
        )
        if spent is not None:
            return _error("unavailable", spent)
        async with self._slots:
            try:
                result = await upstream.call(tool, args, timeout=self.call_timeout)
            except UpstreamError as exc:
                return _error("unavailable", str(exc))
        return result_frame(result)

    async def _over_rate(self, policy: ServerPolicy) -> str | None:
        """Why the shared rate refuses the call (None: it was counted, or is not shared)."""
        limit = policy.calls_per_minute
        if self.rate is None or limit is None or await self.rate(policy.name, limit):
            return None
        return rate_refusal(policy.name, limit)


async def _open_tls(
    address: Address, cert: BridgeCert
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect with mutual TLS 1.3: both ends present the session's certificate and accept
    only it. A peer without it fails the handshake (ssl.SSLError, an OSError)."""
    async with asyncio.timeout(CONNECT_TIMEOUT):
        reader, writer = await asyncio.open_connection(
            address.host,
            address.port,
            ssl=bridge_client_context(cert),
            server_hostname="kernel",
            ssl_handshake_timeout=CONNECT_TIMEOUT,
        )
    tls = writer.get_extra_info("ssl_object")
    if tls is None or tls.getpeercert(binary_form=True) != cert.der:
        writer.close()
        raise ConnectionError(
            f"the bridge at {address.host}:{address.port} did not present its session's certificate"
        )
    return reader, writer


async def _open_unix(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the Unix socket at `path`, never through a symbolic link.

    The kernel owns the directory the socket is in, and could put a link to any host
    socket in its place: the socket is opened as a path (O_PATH|O_NOFOLLOW, in its
    directory, itself opened without following a link), checked to be a socket, and
    connected to through /proc/self/fd, which names that very inode.
    """
    parent, name = os.path.split(path)
    nofollow = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    directory = os.open(parent, nofollow | os.O_DIRECTORY)
    try:
        fd = os.open(name, nofollow, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ConnectionError(
                f"the bridge socket {path} is not a socket (a symlink, or another file): "
                "not connecting"
            )
        return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"kind": kind, "message": message}}
