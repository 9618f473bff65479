"""Call the tools of the MCP servers the MCP-Forge gateway is connected to.

    mcp_tools.<server>.<tool>(**arguments)             call a tool, wait for its result
    await mcp_tools.<server>.<tool>.aio(**arguments)   the same for asyncio; many at once
    mcp_tools.aio.<server>.<tool>                      the asyncio form, by another path
    mcp_tools.servers()                                {server: [tool, ...]} (Python names)
    mcp_tools.describe()                               every tool's stub, as Python source
    mcp_tools.wait_connected(timeout)                  wait for the gateway's list of tools

A call returns the tool's structured content when it gives one, else its text (text
items joined by newlines), else its content items as dicts (an image: base64 "data" and
"mimeType"), or None when it returns nothing. Arguments are keyword-only. An optional
argument left out, or passed as None when its default is None, is not sent: the server
applies its own default.

Errors:
    ToolError         the tool reported an error (.kind "tool"); its server is down, the
                      call timed out, a budget or rate limit ran out, the result was too
                      large (.kind "unavailable"); the bridge is not connected, or its
                      connection closed or was replaced while the call waited.
                      .server and .tool are the names as the server spells them.
    PermissionError   the session's policy does not allow the call.
    ValueError        the gateway refused the request as invalid, or it is over 1 MiB.
    TypeError         a missing, unknown or positional argument, or one not JSON-able.
A KeyboardInterrupt while a call waits cancels it upstream, then propagates.

Names: a server's, tool's or parameter's name becomes a Python identifier. ASCII
letters, digits and _ are kept and any other character becomes _; a leading digit gets
a leading _; a keyword, or a name that starts and ends with __, gets a trailing _.
Names that need no change claim theirs first; then, in sorted order, a name already
taken (by another one, or by one of mcp_tools' own: ToolError, servers, describe, aio,
wait_connected) gets more trailing _ until it is free. So "my-server" is my_server,
unless a server is named my_server: then it is my_server_.

Limits: a request is at most 1 MiB of JSON, a result 16 MiB; the bridge takes up to 256
servers of 2048 tools of 512 parameters each, and clips long descriptions.
"""

import asyncio
import contextlib
import errno
import itertools
import socket
import threading
import time
import types
from collections.abc import Callable
from typing import Any

# The bridge's other modules: framing (shared with the gateway), mcp_stubs (the tools as
# Python) and mcp_channel (listening, the connection's threads, waiting). Imported (unit
# tests, mypy) it finds them beside it; in a kernel, which has no mcp_forge package,
# kernelside/bridge_boot.py runs their sources and gives them to this namespace by name.
if __package__:
    from . import framing, mcp_channel, mcp_stubs

# The bridge's limits and messages: those the docstring states, wherever they apply.
VERSION = framing.VERSION
MAX_REQUEST = framing.KERNEL_FRAME_MAX
MAX_RESULT = framing.GATEWAY_FRAME_MAX
MAX_SERVERS = 256
MAX_TOOLS = 2048
MAX_PARAMS = mcp_stubs.MAX_PARAMS
MAX_NAME = mcp_stubs.MAX_NAME
MAX_DESCRIPTION = mcp_stubs.MAX_DESCRIPTION
MAX_PARAM_DESCRIPTION = mcp_stubs.MAX_PARAM_DESCRIPTION
MAX_MESSAGE = mcp_stubs.MAX_MESSAGE
SEND_TIMEOUT = 60.0  # a gateway that takes no bytes for this long has gone: close
HANDSHAKE_TIMEOUT = 10.0  # a TLS peer must prove itself within this
HANDSHAKES_MAX = mcp_channel.HANDSHAKES_MAX
RECONNECT_WAIT = 5.0  # a call made just after the connection closed waits this for the next
WAIT_SLICE = mcp_channel.WAIT_SLICE
NOT_CONNECTED = "the MCP bridge is not connected"
REPLACED = "the MCP bridge connection was replaced"
CLOSED = mcp_channel.CLOSED
OWN_NAMES = ("ToolError", "servers", "describe", "aio", "wait_connected")

# What the bridge uses of the other two. mcp_tools.ToolError is the class user code
# catches; the unit tests reach Tool, outcome and identifiers here too.
ToolError = mcp_stubs.ToolError
ProtocolError = mcp_stubs.ProtocolError
Tool = mcp_stubs.Tool
Namespace = mcp_stubs.Namespace
Server = mcp_stubs.Server
clip = mcp_stubs.clip
identifiers = mcp_stubs.identifiers
docstring = mcp_stubs.docstring
outcome = mcp_stubs.outcome
Waiter = mcp_channel.Waiter
AsyncWaiter = mcp_channel.AsyncWaiter
Tls = mcp_channel.Tls
TlsStream = mcp_channel.TlsStream
Connection = mcp_channel.Connection
Listener = mcp_channel.Listener
listen = mcp_channel.listen

# User code meets these two (in a traceback, help(), pickle) by the module it imports:
# they are mcp_tools' own.
ToolError.__module__ = __name__
Namespace.__module__ = __name__


class Bridge:
    """The listener, the current connection, the tools of its hello, the calls in flight."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.aio = Namespace("mcp_tools.aio", {})
        self.lock = threading.Lock()  # guards everything below, and each connection's pending
        self.changed = threading.Condition(self.lock)
        self.ids = itertools.count(1)
        self.listener: Listener | None = None
        self.conn: Connection | None = None
        self.last_reason: str | None = None
        self.catalog: dict[str, Server] = {}  # server identifier -> Server

    # -- the connection ---------------------------------------------------------------

    def start(self, address: Any) -> None:
        """Listen at address, unless already listening (then address is not looked at)."""
        with self.lock:
            if self.listener is not None and self.listener.is_alive():
                return
            lsock, tls = listen(address)
            self.listener = Listener(self, lsock, tls)
            self.listener.start()

    def accept(self, lsock: socket.socket, tls: Tls | None) -> None:
        while True:
            try:
                sock, _ = lsock.accept()
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listening socket is gone
                if exc.errno != errno.ECONNABORTED:
                    time.sleep(0.1)  # out of descriptors or memory: do not spin
                continue
            if tls is None:
                self.adopt(sock)
            elif tls.slots.acquire(blocking=False):
                threading.Thread(
                    target=self.authenticate,
                    args=(sock, tls),
                    name="mcp-forge-bridge-tls",
                    daemon=True,
                ).start()
            else:
                sock.close()  # handshakes pile up: a flood, not the gateway

    def authenticate(self, sock: socket.socket, tls: Tls) -> None:
        """Adopt sock once its peer proved it is the gateway (mutual TLS, the session's own
        certificate); else close it, having read nothing from it."""
        try:
            stream = TlsStream(sock, tls)
            try:
                peer = stream.handshake(time.monotonic() + HANDSHAKE_TIMEOUT)
            except OSError:  # ssl.SSLError (a wrong or no certificate), a timeout, a reset
                sock.settimeout(1.0)
                with contextlib.suppress(OSError):
                    stream.flush()  # the alert that says why, if there is one
                sock.close()
                return
            if peer != tls.der:
                sock.close()
                return
            self.adopt(sock, stream, lambda: peer == tls.der)
        finally:
            tls.slots.release()

    def adopt(
        self,
        sock: socket.socket,
        stream: TlsStream | None = None,
        still: Callable[[], bool] | None = None,
    ) -> None:
        """sock (or the TLS stream over it) is the connection now; the one before it
        closes, failing its calls. With `still`, only if it still holds under the lock
        (the peer's certificate is still the session's: kernelside/rebind.py gives the
        TLS a new one under this lock, then closes the connection it finds)."""
        sock.settimeout(SEND_TIMEOUT)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Keep-alive: a gateway that vanished is noticed.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        conn = Connection(self, sock if stream is None else stream)
        with self.lock:
            if still is not None and not still():
                sock.close()
                return
            old, self.conn = self.conn, conn
            self.last_reason = None
            self.changed.notify_all()
        if old is not None:
            self.close(old, REPLACED)
        conn.writer.start()
        conn.reader.start()

    def close(self, conn: Connection, reason: str) -> None:
        """Close conn (once; the first reason stays) and fail its calls with reason."""
        with self.lock:
            if conn.closed is not None:
                return
            conn.closed = reason
            pending, conn.pending = conn.pending, {}
            if self.conn is conn:
                self.conn = None
                self.last_reason = reason
            self.changed.notify_all()
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the reader closes the socket
        conn.outbox.put(None)
        for waiter in pending.values():
            error = ToolError(reason, server=waiter.server, tool=waiter.tool, kind="unavailable")
            waiter.deliver(None, error)

    def read(self, conn: Connection) -> None:
        reason = CLOSED
        frames = framing.FrameReader(MAX_RESULT)
        try:
            while conn.closed is None:
                try:
                    chunk = conn.sock.recv(1 << 16)
                except TimeoutError:
                    continue  # the socket's timeout is for sending; reading waits on
                except OSError as exc:
                    reason = f"{CLOSED}: {exc}"
                    break
                if not chunk:
                    break
                for frame in frames.feed(chunk):
                    self.dispatch(conn, frame)
        except (framing.FrameError, ProtocolError) as exc:
            reason = f"{CLOSED}: the gateway sent {exc}"
        finally:
            self.close(conn, reason)
            conn.writer.join(SEND_TIMEOUT)
            conn.sock.close()

    def dispatch(self, conn: Connection, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if not conn.ready and kind != "hello":
            raise ProtocolError("a first frame that is not a hello")
        if kind == "hello":
            self.hello(conn, frame)
        elif kind == "result":
            self.result(conn, frame)
        # Other types are for later versions of the gateway: ignored.

    def hello(self, conn: Connection, frame: dict[str, Any]) -> None:
        listed = frame.get("servers")
        if not isinstance(listed, dict):
            raise ProtocolError("a hello without a servers object")
        if len(listed) > MAX_SERVERS:
            raise ProtocolError(
                f"a hello of {len(listed)} servers, over the limit of {MAX_SERVERS}"
            )
        specs: dict[str, dict[str, Any]] = {}
        unavailable: dict[str, str | None] = {}
        for name, server in listed.items():
            tools = server.get("tools") if isinstance(server, dict) else None
            if not isinstance(tools, list):
                raise ProtocolError(
                    f"a hello whose server {clip(name, 100)!r} has no list of tools"
                )
            if len(tools) > MAX_TOOLS:
                raise ProtocolError(
                    f"a hello whose server {clip(name, 100)!r} has {len(tools)} tools,"
                    f" over the limit of {MAX_TOOLS}"
                )
            if len(name) > MAX_NAME:
                continue
            by_name = {}
            for tool in tools:
                tool_name = tool.get("name") if isinstance(tool, dict) else None
                if (
                    isinstance(tool_name, str)
                    and 0 < len(tool_name) <= MAX_NAME
                    and tool_name not in by_name
                ):
                    by_name[tool_name] = tool
            specs[name] = by_name
            unavailable[name] = clip(server.get("unavailable"), MAX_MESSAGE) or None
        idents = identifiers(list(specs), OWN_NAMES)
        catalog = {
            idents[name]: Server(self, name, idents[name], specs[name], unavailable[name])
            for name in specs
        }
        with self.lock:
            conn.ready = True
            if self.conn is conn:
                self.publish(catalog)
            self.changed.notify_all()

    def publish(self, catalog: dict[str, Server]) -> None:
        """Put catalog's servers on mcp_tools and mcp_tools.aio, in place of the last ones."""
        module, aio = self.module.__dict__, self.aio.__dict__
        for ident in self.catalog:
            module.pop(ident, None)
            aio.pop(ident, None)
        for ident, server in catalog.items():
            module[ident] = server.namespace
            aio[ident] = server.aio_namespace
        self.catalog = catalog

    def result(self, conn: Connection, frame: dict[str, Any]) -> None:
        call_id = frame.get("id")
        if type(call_id) is not int or call_id <= 0:
            raise ProtocolError("a result without a positive integer id")
        with self.lock:
            waiter = conn.pending.pop(call_id, None)
        if waiter is not None:  # else cancelled: the gateway may answer what it could not stop
            waiter.deliver(*outcome(frame, waiter.server, waiter.tool))

    # -- calls ------------------------------------------------------------------------

    def request(self, tool: Tool, arguments: dict[str, Any]) -> tuple[int, bytes]:
        """A new call id and the call's frame, or TypeError/ValueError if it cannot go."""
        call_id = next(self.ids)
        label = f"mcp_tools.{tool.qualname}()"
        frame = {
            "v": VERSION,
            "type": "call",
            "id": call_id,
            "server": tool.server,
            "tool": tool.name,
            "arguments": arguments,
        }
        try:
            data = framing.encode(frame)
        except ValueError as exc:  # its __cause__ is what json raised
            cause = exc.__cause__ or exc
            if isinstance(cause, TypeError):
                raise TypeError(f"{label}: an argument is not JSON: {cause}") from None
            raise ValueError(f"{label}: the arguments cannot be sent as JSON: {cause}") from None
        if len(data) - 4 > MAX_REQUEST:
            raise ValueError(
                f"{label}: the request is {len(data) - 4} bytes of JSON, over the MCP bridge's"
                f" limit of {MAX_REQUEST} (1 MiB)"
            )
        return call_id, data

    def register(self, call_id: int, waiter: Waiter | AsyncWaiter) -> Connection:
        with self.changed:
            if self.conn is None and self.last_reason is not None:
                # The gateway closed the connection (it refused a frame): it dials again.
                self.changed.wait_for(lambda: self.conn is not None, RECONNECT_WAIT)
            conn = self.conn
            if conn is None:
                message = NOT_CONNECTED
                if self.last_reason not in (None, CLOSED, REPLACED):
                    message += f" ({self.last_reason})"
                raise ToolError(message, server=waiter.server, tool=waiter.tool, kind="unavailable")
            conn.pending[call_id] = waiter
            return conn

    def abandon(self, conn: Connection, call_id: int) -> None:
        """The caller stopped waiting: if the call is still open, cancel it upstream."""
        with self.lock:
            if conn.pending.pop(call_id, None) is None:
                return
        conn.outbox.put(framing.encode({"v": VERSION, "type": "cancel", "id": call_id}))

    def call(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        call_id, data = self.request(tool, arguments)
        waiter = Waiter(tool.server, tool.name)
        conn = None
        try:
            conn = self.register(call_id, waiter)
            conn.outbox.put(data)
            return waiter.wait()
        except BaseException:  # KeyboardInterrupt above all; always re-raised
            if conn is not None:
                self.abandon(conn, call_id)
            raise

    async def acall(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        call_id, data = self.request(tool, arguments)
        waiter = AsyncWaiter(asyncio.get_running_loop(), tool.server, tool.name)
        conn = None
        try:
            conn = self.register(call_id, waiter)
            conn.outbox.put(data)
            return await waiter.future
        except BaseException:  # CancelledError, KeyboardInterrupt; always re-raised
            if conn is not None:
                self.abandon(conn, call_id)
            raise

    # -- looking ----------------------------------------------------------------------

    def servers(self) -> dict[str, list[str]]:
        with self.lock:
            return {ident: sorted(server.tools) for ident, server in sorted(self.catalog.items())}

    def describe(self, name: str | None) -> str:
        with self.lock:
            catalog = dict(self.catalog)
            connected = self.conn is not None
        chosen = [s for s in catalog.values() if name is None or name in (s.ident, s.name)]
        if name is not None and not chosen:
            known = ", ".join(sorted(catalog)) or "none"
            raise ValueError(f"no MCP server {name!r}; there are: {known}")
        if not chosen:
            why = "the gateway lists no servers" if connected else NOT_CONNECTED
            return "# No MCP tools: " + why + ".\n"
        out = [
            '"""MCP tools: mcp_tools.<server>.<tool>(...),'
            ' or await mcp_tools.<server>.<tool>.aio(...)."""'
        ]
        for server in chosen:
            out += ["", "", f"class {server.ident}:", docstring(f"MCP server {server.name!r}.", 4)]
            for tool in server.tools.values():
                out += ["", f"    def {tool.ident}{tool.signature}:", docstring(tool.doc, 8)]
        return "\n".join(out) + "\n"

    def wait_connected(self, timeout: float) -> bool:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout is a number of seconds, not {timeout!r}")
        with self.changed:
            return self.changed.wait_for(lambda: self.conn is not None and self.conn.ready, timeout)


BRIDGE = Bridge(types.ModuleType("mcp_tools", __doc__))


def servers() -> dict[str, list[str]]:
    """The MCP servers and their tools, by the Python names mcp_tools gives them.

    Returns {server: [tool, ...]}, sorted. describe() shows the names the servers use.
    """
    return BRIDGE.servers()


def describe(server: str | None = None) -> str:
    """Every tool's stub as Python source: def lines and docstrings, a class per server.

    server: only that one, by its Python name or its own. Without a connection the text
    says so; a server that does not exist raises ValueError.
    """
    return BRIDGE.describe(server)


def wait_connected(timeout: float = 10.0) -> bool:
    """Wait up to timeout seconds for the gateway's connection and its list of tools.

    True once a connection is open and its tools are on mcp_tools, else False.
    """
    return BRIDGE.wait_connected(timeout)


BRIDGE.module.__dict__.update(
    ToolError=ToolError,
    servers=servers,
    describe=describe,
    wait_connected=wait_connected,
    aio=BRIDGE.aio,
    __mcp_forge_bridge__=BRIDGE,
)
