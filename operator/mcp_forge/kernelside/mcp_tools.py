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
import functools
import inspect
import itertools
import json
import keyword
import operator
import os
import queue
import socket
import ssl
import stat
import threading
import time
import types
from collections.abc import Callable, Coroutine
from typing import Any

# Imported (unit tests, mypy) it finds framing beside it; in a kernel, which has no mcp_forge
# package, kernelside/bridge_boot.py runs framing's source and gives it to this namespace.
if __package__:
    from . import framing

VERSION = framing.VERSION
MAX_REQUEST = framing.KERNEL_FRAME_MAX
MAX_RESULT = framing.GATEWAY_FRAME_MAX
MAX_SERVERS = 256
MAX_TOOLS = 2048
MAX_PARAMS = 512
MAX_NAME = 256
MAX_DESCRIPTION = 16384
MAX_PARAM_DESCRIPTION = 2048
MAX_MESSAGE = 65536
SEND_TIMEOUT = 60.0  # a gateway that takes no bytes for this long has gone: close
HANDSHAKE_TIMEOUT = 10.0  # a TLS peer must prove itself within this
HANDSHAKES_MAX = 8  # TLS handshakes at once; a connection over that is closed at once
CONNECTION_FILE_MAX = 1 << 20
BRIDGE_CERT = framing.BRIDGE_CERT
BRIDGE_KEY = framing.BRIDGE_KEY
RECONNECT_WAIT = 5.0  # a call made just after the connection closed waits this for the next
WAIT_SLICE = 0.25  # the main thread wakes this often, so a KeyboardInterrupt is never missed
NOT_CONNECTED = "the MCP bridge is not connected"
REPLACED = "the MCP bridge connection was replaced"
CLOSED = "the MCP bridge connection was closed"
OWN_NAMES = ("ToolError", "servers", "describe", "aio", "wait_connected")
EMPTY = inspect.Parameter.empty
JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": None,
}
HINTS = (
    ("readOnlyHint", "read-only"),
    ("destructiveHint", "destructive"),
    ("idempotentHint", "idempotent"),
    ("openWorldHint", "open-world"),
)


class ToolError(Exception):
    """A call to an MCP tool failed; the message says why.

    .kind is "tool" when the tool itself reported the error, "unavailable" when it could
    not run or answer (server down, timeout, budget, rate limit, result too large, no
    bridge connection). .server and .tool name it as its server spells them.
    """

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        tool: str | None = None,
        kind: str = "tool",
    ) -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool
        self.kind = kind


class ProtocolError(Exception):
    """The gateway sent something the bridge refuses: the connection closes."""


def clip(text: object, limit: int) -> str:
    """text cut to limit characters; anything but a string is empty."""
    if not isinstance(text, str):
        return ""
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


# -- names and signatures ------------------------------------------------------------


def identifier(name: str) -> str:
    """name as a Python identifier, before collisions (the rule: the module docstring)."""
    ident = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    ident = ident or "_"
    if ident[0].isdigit():
        ident = "_" + ident
    if keyword.iskeyword(ident) or (ident.startswith("__") and ident.endswith("__")):
        ident += "_"
    return ident


def identifiers(names: list[str], reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """{name: identifier} for distinct names, none of them in reserved nor shared."""
    taken = set(reserved)
    idents = {}
    for name in sorted(names, key=lambda n: (identifier(n) != n, n)):
        ident = identifier(name)
        while ident in taken:
            ident += "_"
        taken.add(ident)
        idents[name] = ident
    return idents


# An annotation made from a schema is a type, a union of types, None, or EMPTY (none).


def annotation(schema: object, depth: int = 0) -> Any:
    """The Python annotation for a JSON schema's type, or EMPTY when there is none."""
    if not isinstance(schema, dict) or depth > 3:
        return EMPTY
    kind = schema.get("type")
    if isinstance(kind, str):
        if kind == "array":
            item = annotation(schema.get("items"), depth + 1)
            return list if item is EMPTY else list[item]  # type: ignore[valid-type]
        return JSON_TYPES.get(kind, EMPTY)
    if isinstance(kind, list):
        return union([JSON_TYPES.get(k, EMPTY) if isinstance(k, str) else EMPTY for k in kind[:8]])
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return union([annotation(option, depth + 1) for option in options[:8]])
    return EMPTY


def union(options: list[Any]) -> Any:
    """X | Y | None for known options; EMPTY if any is unknown."""
    if not options or any(option is EMPTY for option in options):
        return EMPTY
    distinct: list[Any] = []
    for option in options:
        if option not in distinct:
            distinct.append(option)
    real = [option for option in distinct if option is not None]
    if not real:
        return None
    result = functools.reduce(operator.or_, real)
    return result | None if None in distinct else result


def optional(ann: Any) -> Any:
    """ann for a parameter whose default is None."""
    if ann is EMPTY or ann is None:
        return ann
    if isinstance(ann, types.UnionType) and type(None) in ann.__args__:
        return ann
    return ann | None


class Tool:
    """One upstream tool: its names, its signature and docstring, its JSON argument names."""

    def __init__(self, server: str, server_ident: str, spec: dict[str, Any], ident: str) -> None:
        self.server = server
        self.name: str = spec["name"]
        self.ident = ident
        self.qualname = server_ident + "." + ident
        schema = spec.get("inputSchema")
        schema = schema if isinstance(schema, dict) else {}
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        listed = schema.get("required")
        listed = listed if isinstance(listed, list) else []
        required = [r for r in listed if isinstance(r, str)]
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        names = [n for n in names if len(n) <= MAX_NAME][:MAX_PARAMS]
        py = identifiers(names)
        self.json_names = {py[n]: n for n in names}
        params = []
        for name in sorted(names, key=lambda n: n not in required):  # required first
            prop = props.get(name)
            prop = prop if isinstance(prop, dict) else {}
            ann = annotation(prop)
            default: Any
            if name in required:
                default = EMPTY
            else:
                default = prop.get("default")
                if default is None:
                    ann = optional(ann)
            kind = inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(py[name], kind, default=default, annotation=ann))
        # Declared open (additionalProperties true or a schema): **kwargs pass through as they are.
        self.extra: str | None = None
        more = schema.get("additionalProperties")
        if more is True or isinstance(more, dict):
            extra = "kwargs"
            while extra in self.json_names:
                extra += "_"
            self.extra = extra
            params.append(inspect.Parameter(extra, inspect.Parameter.VAR_KEYWORD))
        self.signature = inspect.Signature(params)
        self.doc = self.docstring(spec, props)

    def docstring(self, spec: dict[str, Any], props: dict[str, Any]) -> str:
        lines = [
            clip(spec.get("description"), MAX_DESCRIPTION).strip()
            or f"The tool {self.name!r} of the MCP server {self.server!r}."
        ]
        if self.signature.parameters:
            lines += ["", "Parameters:"]
        for param in self.signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                lines.append(f"    **{param.name}: further arguments, sent as they are")
                continue
            json_name = self.json_names[param.name]
            prop = props.get(json_name)
            prop = prop if isinstance(prop, dict) else {}
            ann = annotation(prop)  # as the schema says: "optional" stands for the None
            facts = [] if ann is EMPTY else [inspect.formatannotation(ann)]
            if param.default is EMPTY:
                facts.append("required")
            elif "default" in prop:
                facts.append("default " + clip(repr(param.default), 200))
            else:
                facts.append("optional")
            if json_name != param.name:
                facts.append(f"sent as {json_name!r}")
            text = clip(prop.get("description"), MAX_PARAM_DESCRIPTION).strip()
            enum = prop.get("enum")
            if isinstance(enum, list) and enum:
                values = ", ".join(clip(repr(v), 100) for v in enum[:20])
                values += ", ..." if len(enum) > 20 else ""
                text = (text + " " if text else "") + "One of: " + values + "."
            line = f"    {param.name} ({', '.join(facts)})"
            lines.append(line + ": " + text.replace("\n", "\n        ") if text else line)
        notes = spec.get("annotations")
        hints = [
            label for key, label in HINTS if isinstance(notes, dict) and notes.get(key) is True
        ]
        lines += [""] + (["Hints: " + ", ".join(hints) + "."] if hints else [])
        lines.append(f"MCP tool {self.name!r} of server {self.server!r}.")
        return "\n".join(lines)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's JSON arguments, or TypeError as a Python function would raise it."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"mcp_tools.{self.qualname}(): {exc}") from None
        out = {}
        for name, value in bound.arguments.items():
            if name == self.extra:
                out.update(value)
            elif value is not None or self.signature.parameters[name].default is not None:
                out[self.json_names[name]] = value
        return out


def functions(
    bridge: "Bridge", tool: Tool
) -> tuple[Callable[..., Any], Callable[..., Coroutine[Any, Any, Any]]]:
    """The function that calls tool, and its asyncio twin."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return bridge.call(tool, tool.arguments(args, kwargs))

    async def call_aio(*args: Any, **kwargs: Any) -> Any:
        return await bridge.acall(tool, tool.arguments(args, kwargs))

    for function, qualname in ((call, tool.qualname), (call_aio, tool.qualname + ".aio")):
        function.__name__ = tool.ident
        function.__qualname__ = qualname
        function.__module__ = "mcp_tools"
        function.__doc__ = tool.doc
        # help() and inspect.signature read these; mypy knows no such attributes of a function.
        vars(function)["__signature__"] = tool.signature
    vars(call)["aio"] = call_aio
    return call, call_aio


class Namespace:
    """The tools of one MCP server as functions; under mcp_tools.aio, the servers."""

    def __init__(self, label: str, members: dict[str, Any], unavailable: str | None = None) -> None:
        self.__dict__["__mcp_label__"] = label
        self.__dict__["__mcp_unavailable__"] = unavailable
        self.__dict__.update(members)

    def __getattr__(self, name: str) -> Any:
        # Only for names it does not have: say why a server has no tools, if it is known.
        label, why = self.__dict__["__mcp_label__"], self.__dict__["__mcp_unavailable__"]
        raise AttributeError(f"{label} has no {name!r}" + (f": {why}" if why else ""))

    def __repr__(self) -> str:
        names = sorted(name for name in vars(self) if not name.startswith("__mcp_"))
        return f"<{self.__dict__['__mcp_label__']}: {', '.join(names)}>"


class Server:
    """One upstream server, as the hello lists it."""

    def __init__(
        self,
        bridge: "Bridge",
        name: str,
        ident: str,
        specs: dict[str, dict[str, Any]],
        unavailable: str | None = None,
    ) -> None:
        self.name = name
        self.ident = ident
        idents = identifiers(list(specs))
        self.tools = {idents[n]: Tool(name, ident, spec, idents[n]) for n, spec in specs.items()}
        made = {t_ident: functions(bridge, tool) for t_ident, tool in self.tools.items()}
        self.namespace = Namespace(
            "mcp_tools." + ident, {i: f[0] for i, f in made.items()}, unavailable
        )
        self.aio_namespace = Namespace(
            "mcp_tools.aio." + ident, {i: f[1] for i, f in made.items()}, unavailable
        )


def docstring(text: str, indent: int) -> str:
    """text as a docstring literal at indent, safe to paste into source."""
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    text = "".join(c if c in "\n\t" or " " <= c != "\x7f" else f"\\x{ord(c):02x}" for c in text)
    if text.endswith('"'):
        text = text[:-1] + '\\"'
    pad = " " * indent
    lines = text.split("\n")
    if len(lines) == 1:
        return f'{pad}"""{text}"""'
    rest = [pad + line if line.strip() else "" for line in lines[1:]]
    return "\n".join([f'{pad}"""{lines[0]}', *rest, f'{pad}"""'])


# -- results ---------------------------------------------------------------------------


def failure(kind: str, message: str, server: str, tool: str) -> Exception:
    """The exception for an error result of that kind."""
    exc: Exception
    if kind == "denied":
        exc = PermissionError(message)
    elif kind == "invalid":
        exc = ValueError(message)
    else:
        return ToolError(message, server=server, tool=tool, kind=kind)
    vars(exc).update(server=server, tool=tool, kind=kind)  # what a ToolError carries
    return exc


def outcome(frame: dict[str, Any], server: str, tool: str) -> tuple[Any, Exception | None]:
    """(value, None) or (None, exception) for a result frame."""
    ok = frame.get("ok")
    if ok is False:
        error = frame.get("error")
        error = error if isinstance(error, dict) else {}
        kind = clip(error.get("kind"), 40) or "tool"
        message = clip(error.get("message"), MAX_MESSAGE) or f"the call failed ({kind})"
        return None, failure(kind, message, server, tool)
    content = frame.get("content")
    content = [] if content is None else content
    if (
        ok is not True
        or not isinstance(content, list)
        or not all(isinstance(item, dict) for item in content)
    ):
        malformed = "the gateway sent a malformed result"
        return None, ToolError(malformed, server=server, tool=tool, kind="unavailable")
    texts = [
        item.get("text")
        for item in content
        if item.get("type") == "text" and isinstance(item.get("text"), str)
    ]
    if frame.get("isError") is True:
        message = clip("\n".join(texts), MAX_MESSAGE) or "the tool reported an error"
        return None, ToolError(message, server=server, tool=tool, kind="tool")
    structured = frame.get("structured")
    if structured is not None:
        return structured, None
    if content and len(texts) == len(content):
        return "\n".join(texts), None
    return (content or None), None


# -- waiting ---------------------------------------------------------------------------


class Waiter:
    """A thread waiting for one result."""

    def __init__(self, server: str, tool: str) -> None:
        self.server = server
        self.tool = tool
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def deliver(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self.event.set()

    def wait(self) -> Any:
        if threading.current_thread() is threading.main_thread():
            # Slices: SIGINT may reach another thread, or be simulated (interrupt_main).
            while not self.event.wait(WAIT_SLICE):
                pass
        else:
            self.event.wait()  # bounded by the gateway's deadlines and the connection's life
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.value


class AsyncWaiter:
    """An asyncio task waiting for one result: the reader hands it over to the task's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: str, tool: str) -> None:
        self.server = server
        self.tool = tool
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def deliver(self, value: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self.settle, value, error)

    def settle(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)


# -- the bridge ------------------------------------------------------------------------


class Tls:
    """Mutual TLS 1.3 with the session's certificate, read from the connection file: the
    listener presents it, and takes a connection only from a peer that presents that very
    certificate (the gateway). Nothing is read from a peer before that."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read(CONNECTION_FILE_MAX + 1)
        if len(data) > CONNECTION_FILE_MAX:
            raise ValueError(f"{path} is over {CONNECTION_FILE_MAX} bytes")
        info = json.loads(data)
        cert = info.get(BRIDGE_CERT) if isinstance(info, dict) else None
        key = info.get(BRIDGE_KEY) if isinstance(info, dict) else None
        if not isinstance(cert, str) or not isinstance(key, str):
            raise ValueError(f"{path} has no bridge certificate ({BRIDGE_CERT}, {BRIDGE_KEY})")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.num_tickets = 0  # nothing resumes a session
        context.load_verify_locations(cadata=cert)
        # ssl loads a key from a file only: an anonymous one in memory, gone when closed.
        fd = os.memfd_create("mcp-forge-bridge", os.MFD_CLOEXEC)
        try:
            os.write(fd, (cert + "\n" + key).encode("ascii"))
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        self.context = context
        self.der = ssl.PEM_cert_to_DER_cert(cert)
        self.slots = threading.BoundedSemaphore(HANDSHAKES_MAX)


class TlsStream:
    """TLS over a connected socket, through memory buffers, so that a reader thread and a
    writer thread may use it at once (an SSLSocket may not be used so). Records leave in
    order: whoever sends holds send_lock, then lock (the TLS state) to take them."""

    def __init__(self, sock: socket.socket, tls: Tls) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = tls.context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()

    def handshake(self, deadline: float) -> bytes | None:
        """The peer's certificate (DER) once the handshake is done; OSError if it fails."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            self.flush()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the TLS handshake took too long")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the peer closed during the TLS handshake")
            self.incoming.write(data)
        self.flush()
        return self.tls.getpeercert(binary_form=True)

    def flush(self) -> None:
        with self.send_lock:
            with self.lock:
                data = self.outgoing.read()
            if data:
                self.sock.sendall(data)

    def sendall(self, data: bytes) -> None:
        with self.send_lock:
            with self.lock:
                view = memoryview(data)
                while view:
                    view = view[self.tls.write(view) :]
                out = self.outgoing.read()
            self.sock.sendall(out)

    def recv(self, size: int) -> bytes:
        while True:
            with self.lock:
                data: bytes | None
                try:
                    data = self.tls.read(size)
                except ssl.SSLWantReadError:
                    data = None
                except ssl.SSLZeroReturnError:
                    data = b""
                pending = self.outgoing.pending
            if pending:
                self.flush()
            if data is not None:
                return data
            raw = self.sock.recv(1 << 16)
            if not raw:
                return b""
            with self.lock:
                self.incoming.write(raw)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def listen(address: Any) -> tuple[socket.socket, Tls | None]:
    """A listening socket, and the TLS it requires (None: none), at ("tcp", host, port),
    ("tls", host, port, connection_file) or ("unix", path)."""
    is_sequence = isinstance(address, (tuple, list))
    if is_sequence and len(address) in (3, 4) and address[0] in ("tcp", "tls"):
        host, port = address[1], address[2]
        if not isinstance(host, str) or type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"BRIDGE_ADDRESS: bad host or port in {address!r}")
        tls = None
        if address[0] == "tls":
            if len(address) != 4 or not isinstance(address[3], str):
                raise ValueError(
                    f"BRIDGE_ADDRESS: ('tls', host, port, connection_file), not {address!r}"
                )
            tls = Tls(address[3])
        elif len(address) != 3:
            raise ValueError(f"BRIDGE_ADDRESS: ('tcp', host, port), not {address!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((host, port))
            sock.listen(8)
        except BaseException:
            sock.close()
            raise
        return sock, tls
    if is_sequence and len(address) == 2 and address[0] == "unix":
        path = address[1]
        if not isinstance(path, str) or not path:
            raise ValueError(f"BRIDGE_ADDRESS: bad path in {address!r}")
        return listen_unix(path), None
    raise ValueError(
        "BRIDGE_ADDRESS is ('tcp', host, port), ('tls', host, port, file) or ('unix', path),"
        f" not {address!r}"
    )


def listen_unix(path: str) -> socket.socket:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    mode: int | None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    # A link left in its place (code in the kernel can write here) is replaced like a socket.
    if mode is not None and not (stat.S_ISSOCK(mode) or stat.S_ISLNK(mode)):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
    # Bound under a temporary name, made 0600, then renamed over the path: nobody can
    # connect before the mode is set, and a stale socket of an earlier kernel goes in one step.
    temp = os.path.join(parent, f".b{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(temp)
        os.chmod(temp, 0o600)
        os.replace(temp, path)
        sock.listen(8)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return sock


class Connection:
    """One gateway connection: its socket, its calls in flight, a reader and a writer."""

    def __init__(self, bridge: "Bridge", sock: socket.socket | TlsStream) -> None:
        self.sock = sock
        self.pending: dict[int, Waiter | AsyncWaiter] = {}  # under the bridge's lock
        self.closed: str | None = None  # why, once closed
        self.ready = False  # its hello is applied
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.writer = threading.Thread(
            target=self.write, args=(bridge,), name="mcp-forge-bridge-writer", daemon=True
        )
        self.reader = threading.Thread(
            target=bridge.read, args=(self,), name="mcp-forge-bridge-reader", daemon=True
        )

    def write(self, bridge: "Bridge") -> None:
        # Frames leave from this thread only: an interrupted caller never cuts one in half.
        while True:
            data = self.outbox.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError as exc:
                bridge.close(self, f"{CLOSED}: sending failed: {exc}")
                return


class Listener(threading.Thread):
    """The thread that accepts the gateway's connections."""

    def __init__(self, bridge: "Bridge", lsock: socket.socket, tls: Tls | None) -> None:
        super().__init__(
            target=bridge.accept, args=(lsock, tls), name="mcp-forge-bridge", daemon=True
        )
        self.mcp_forge_bridge = bridge  # how the bootstrap finds it if sys.modules lost it


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
            self.adopt(sock, stream)
        finally:
            tls.slots.release()

    def adopt(self, sock: socket.socket, stream: TlsStream | None = None) -> None:
        """sock (or the TLS stream over it) is the connection now; the one before it
        closes, failing its calls."""
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
