"""Gives a running kernel transport keys of its own: the Curve pair of its channels and the
certificate of code mode's bridge (a cluster fork's woken kernel holds its parent's).

Run silently by the operator (control/forking.py), after kernelside/fork.py made the
kernel sign with the fork's key, in globals of its own holding INFO (the fork's
connection file, as its Secret will hold it) and CHECK (True: only say whether this
kernel can, changing nothing).

libzmq gives a listener the socket's options when the socket is bound, so each of
ipykernel's server sockets is unbound, given the new pair and bound again at its own
endpoint, on the thread that owns it (a ZMQ socket is used by one thread): shell on the
shell channel's thread, control (and the debugger's client of shell) on the control
thread, iopub on its thread, stdin here on the main thread. Unbinding closes what was
accepted through the endpoint, so every connection made in the old keys is gone, this
request's own included: its reply is lost, and the operator looks for the kernel's
answer in the new keys instead. The heartbeat, which has a context of its own, is ended
(its context terminated) and started again. The bridge's listener takes the new
certificate for its next connection, and its current one (made in the old) is closed.

ipykernel 7.4's attributes are used (the image pins it); a kernel that lacks any of them
is refused by CHECK, before anything changes.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

BIND_WAIT = 2.0  # seconds an endpoint is tried again while the old listener closes
STEP_WAIT = 5.0  # seconds a channel's thread is waited for
SOCKETS = ("shell_socket", "control_socket", "stdin_socket")
BRIDGE_CERT = "mcp_forge_bridge_cert"  # framing.py's names: this module runs alone
BRIDGE_KEY = "mcp_forge_bridge_key"


def app() -> Any:
    """ipykernel's application, with every part this module changes; RuntimeError
    naming what is missing."""
    from ipykernel.kernelapp import IPKernelApp

    if not IPKernelApp.initialized():
        raise RuntimeError("no ipykernel application in this process")
    kernel_app = IPKernelApp.instance()
    if kernel_app.curve_secretkey is None:
        raise RuntimeError("this kernel's channels have no Curve keys")
    parts = (
        *SOCKETS,
        "debug_shell_socket",
        "shell_channel_thread",
        "control_thread",
        "iopub_thread",
        "heartbeat",
    )
    for part in parts:
        if getattr(kernel_app, part, None) is None:
            raise RuntimeError(f"this kernel has no {part}")
    if getattr(kernel_app.iopub_thread, "io_loop", None) is None:
        raise RuntimeError("this kernel's iopub thread has no loop")
    return kernel_app


def bridge_tls() -> tuple[Any, Any]:
    """Code mode's bridge in this kernel and its listener's TLS, by the listener's thread
    (None, None: no bridge listens; a bridge without TLS gives its TLS as None)."""
    for thread in threading.enumerate():  # the living ones
        bridge = getattr(thread, "mcp_forge_bridge", None)
        if bridge is None:
            continue
        # A listener from before `tls` was kept on it may well have TLS: refused, not
        # taken for one without.
        tls = getattr(thread, "tls", "unknown")
        if tls is not None and not hasattr(tls, "load"):
            raise RuntimeError("this kernel's bridge cannot take a new certificate")
        return bridge, tls
    return None, None


def rebind(sock: Any, public: bytes, secret: bytes) -> None:
    """`sock` unbound from its endpoint and bound again there as a Curve server with the
    new pair."""
    import zmq

    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    sock.unbind(endpoint)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    deadline = time.monotonic() + BIND_WAIT
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:  # the old listener closes in libzmq's I/O thread
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def reconnect(sock: Any, endpoint: str, public: bytes, secret: bytes) -> None:
    """The debugger's client of the shell channel, connected again in the new keys."""
    sock.disconnect(endpoint)
    sock.curve_serverkey = public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.connect(endpoint)


def on(loop: Any, work: Any, *args: Any) -> Any:
    """Run work(*args) on the thread of tornado `loop`; wait for it; raise what it raised."""
    done = threading.Event()
    outcome: list[BaseException | None] = [None]

    def run() -> None:
        try:
            work(*args)
        except BaseException as exc:  # handed to the waiting thread
            outcome[0] = exc
        finally:
            done.set()

    loop.add_callback(run)
    if not done.wait(STEP_WAIT):
        raise TimeoutError(f"{getattr(work, '__name__', work)} did not run in {STEP_WAIT:.0f}s")
    if outcome[0] is not None:
        raise outcome[0]


def new_heartbeat(kernel_app: Any, public: bytes, secret: bytes) -> None:
    """The heartbeat ended (its context terminated: its loop closes its socket and
    returns) and started again on its port with the new pair; RuntimeError unless it
    answers a ping in that pair."""
    import zmq
    from ipykernel import heartbeat

    beating: Any = heartbeat.Heartbeat  # untyped
    old = kernel_app.heartbeat
    if not old.is_alive():  # its socket may be open still: term would wait for it
        socket = getattr(old, "socket", None)
        if socket is not None:
            socket.close(linger=0)
    old.context.term()
    old.join(STEP_WAIT)
    beat = beating(
        zmq.Context(),
        (kernel_app.transport, kernel_app.ip, kernel_app.hb_port),
        curve_publickey=public,
        curve_secretkey=secret,
    )
    beat.start()
    kernel_app.heartbeat = beat
    here = "127.0.0.1" if kernel_app.ip in ("0.0.0.0", "*", "") else kernel_app.ip
    if not pinged(here, kernel_app.hb_port, public, secret):
        raise RuntimeError("the heartbeat did not answer in the new keys")


def pinged(host: str, port: int, public: bytes, secret: bytes) -> bool:
    """Whether the heartbeat at host:port echoes a ping in the pair."""
    import zmq

    with zmq.Context() as context, context.socket(zmq.REQ) as sock:
        sock.linger = 0
        sock.curve_serverkey = public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.connect(f"tcp://{host}:{port}")
        sock.send(b"mcp-forge")
        return bool(sock.poll(int(STEP_WAIT * 1000))) and sock.recv() == b"mcp-forge"


def rotate(info: dict[str, Any]) -> None:
    """Every channel and the bridge in the keys of `info`."""
    import zmq

    kernel_app = app()
    bridge, tls = bridge_tls()
    public = str(info["curve_publickey"]).encode("ascii")
    secret = str(info["curve_secretkey"]).encode("ascii")
    if zmq.curve_public(secret) != public:
        raise ValueError("curve_publickey is not the public key of curve_secretkey")
    if tls is not None:
        with bridge.lock:  # a handshake that ends now is adopted before, or refused (adopt)
            tls.load(info[BRIDGE_CERT], info[BRIDGE_KEY])
            conn = bridge.conn
        if conn is not None:
            bridge.close(conn, "the MCP bridge connection was closed: the kernel has a new key")
    kernel_app.curve_publickey, kernel_app.curve_secretkey = public, secret
    shell = kernel_app.shell_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    on(kernel_app.iopub_thread.io_loop, rebind, kernel_app.iopub_thread.socket, public, secret)
    on(kernel_app.control_thread.io_loop, rebind, kernel_app.control_socket, public, secret)
    rebind(kernel_app.stdin_socket, public, secret)
    new_heartbeat(kernel_app, public, secret)
    on(
        kernel_app.control_thread.io_loop,
        reconnect,
        kernel_app.debug_shell_socket,
        shell,
        public,
        secret,
    )
    # Last: this request came on shell, and its reply would leave there.
    on(kernel_app.shell_channel_thread.io_loop, rebind, kernel_app.shell_socket, public, secret)


_given: dict[str, Any] = globals()
if "INFO" in _given:
    if _given.get("CHECK"):
        app()
        bridge_tls()
    else:
        rotate(_given["INFO"])
