"""The channel of code mode's bridge, kernel side: where it listens, how it reads and
writes, and how a caller waits for its result.

`listen` opens the socket the gateway dials (TCP, mutual TLS over TCP with `Tls` and
`TlsStream`, or a Unix socket); a `Listener` thread accepts on it, and each connection
is a `Connection` with a reader thread and a writer thread. A caller waits on a
`Waiter` (a thread) or an `AsyncWaiter` (an asyncio task) until the reader delivers its
result. What a frame means is the bridge's business (mcp_tools.Bridge, the `Owner`
these threads run for); this module only moves bytes and wakes callers.

The gateway sends this module's source with mcp_tools'; in the kernel, which has no
mcp_forge package, kernelside/bridge_boot.py runs it as a module of its own and hands
it to mcp_tools. Standard library only.
"""

import asyncio
import contextlib
import errno
import os
import queue
import socket
import ssl
import stat
import threading
import time
from typing import Any, Protocol

HANDSHAKES_MAX = 8  # TLS handshakes at once; a connection over that is closed at once
CERT_MAX = 64 << 10  # bytes of a bridge certificate and its key (ours are under 2 KiB)
WAIT_SLICE = 0.25  # the main thread wakes this often, so a KeyboardInterrupt is never missed
CLOSED = "the MCP bridge connection was closed"

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


# -- listening and connections ---------------------------------------------------------


class Tls:
    """Mutual TLS 1.3 with the session's certificate (PEM, as its connection file holds
    it): the listener presents it, and takes a connection only from a peer that presents
    that very certificate (the gateway). Nothing is read from a peer before that. The
    gateway hands it over with the address, not through the file: a kernel woken from a
    snapshot in a new pod has no file (its launcher wrote it in the old pod's /tmp).
    `load` takes a new certificate (kernelside/rebind.py) for the connections accepted
    after it."""

    def __init__(self, cert: str, key: str) -> None:
        self.slots = threading.BoundedSemaphore(HANDSHAKES_MAX)
        self.load(cert, key)

    def load(self, cert: str, key: str) -> None:
        if not isinstance(cert, str) or not isinstance(key, str):
            raise ValueError("BRIDGE_ADDRESS: the certificate and key are PEM text")
        if len(cert) + len(key) > CERT_MAX:
            raise ValueError(f"BRIDGE_ADDRESS: a certificate and key over {CERT_MAX} bytes")
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
        self.context, self.der = context, ssl.PEM_cert_to_DER_cert(cert)


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
    ("tls", host, port, certificate, key) or ("unix", path)."""
    is_sequence = isinstance(address, (tuple, list))
    if is_sequence and len(address) in (3, 5) and address[0] in ("tcp", "tls"):
        host, port = address[1], address[2]
        if not isinstance(host, str) or type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"BRIDGE_ADDRESS: bad host or port in {address[:3]!r}")
        tls = None
        if address[0] == "tls":
            if len(address) != 5:
                raise ValueError("BRIDGE_ADDRESS: ('tls', host, port, certificate, key)")
            tls = Tls(address[3], address[4])
        elif len(address) != 3:
            raise ValueError(f"BRIDGE_ADDRESS: ('tcp', host, port), not {address[:3]!r}...")
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
    shown = address[:3] if is_sequence else address  # never a key in an error
    raise ValueError(
        "BRIDGE_ADDRESS is ('tcp', host, port), ('tls', host, port, certificate, key) or"
        f" ('unix', path), not {shown!r}"
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


class Owner(Protocol):
    """The bridge, as its channel's threads see it (mcp_tools.Bridge): the listener's
    thread runs accept, a connection's reader runs read, its writer calls close."""

    def accept(self, lsock: socket.socket, tls: Tls | None) -> None: ...

    def read(self, conn: "Connection") -> None: ...

    def close(self, conn: "Connection", reason: str) -> None: ...


class Connection:
    """One gateway connection: its socket, its calls in flight, a reader and a writer."""

    def __init__(self, bridge: Owner, sock: socket.socket | TlsStream) -> None:
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

    def write(self, bridge: Owner) -> None:
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

    def __init__(self, bridge: Owner, lsock: socket.socket, tls: Tls | None) -> None:
        super().__init__(
            target=bridge.accept, args=(lsock, tls), name="mcp-forge-bridge", daemon=True
        )
        self.mcp_forge_bridge = bridge  # how the bootstrap finds it if sys.modules lost it
        self.tls = tls  # what a new certificate is given to (kernelside/rebind.py)
