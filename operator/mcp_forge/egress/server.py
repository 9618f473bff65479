"""The egress proxy's process: mitmproxy with our addon, told its sessions by a controller.

    python -m mcp_forge.egress.server --control-fd N --confdir DIR [--resolve FILE]
    python -m mcp_forge.egress.server --listen HOST:PORT --control-socket PATH
        [--audit-socket PATH] --confdir DIR

mitmproxy listens on the loopback, on a port no client sees; clients reach it through the
proxy's own relay (`relay.py`), which bounds and paces each session's connections.

Local mode (`--control-fd`): run by the gateway (`client.py`) in the egress venv,
confined (an unprivileged user in a sandbox with the host's network). Each session's
socket (handed over by the gateway, already bound where its pod sees it) is relayed, and
the relayed connection's port names its session to the addon, so a credential read in
one session's pod does not speak for it through another session's socket. The control
socket carries one JSON object a line each way, requests answered in order:
`{"op": "open", "session", "token", "rules", "values", "ca"}` with the listening socket
beside it; `{"op": "close", "session"}`; `{"op": "stats"}`; `{"op": "sync", "sessions"}`.
Its end is the gateway's end: the proxy exits.

Cluster mode (`--listen`): the proxy's pod. One TCP listener for every session's kernels;
a connection is the session's its credential names at its first request (`relay.py`).
The feeder, beside it, sends the same requests over a Unix socket (`sockets.py`), an
`open` without a descriptor; its going away stops nothing. Sessions are "namespace/name".
An `open` identical to the session's last leaves it and its connections as they are;
any other (new rules, values, CA or token) replaces the session, ending its connections,
as a local `open` always does. `sync` closes every session it does not name. The proxy
writes `{"event": "listening", "address": "HOST:PORT"}` on stderr once it serves (the
port chosen when asked for 0), and on SIGTERM stops accepting and exits 0.

Each verdict is a JSON line on stderr, and in cluster mode on the audit socket too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
from typing import Any

from cryptography.hazmat.primitives import serialization
from mitmproxy import certs, options
from mitmproxy.addons import default_addons
from mitmproxy.master import Master

from mcp_forge import heap
from mcp_forge.api import egress
from mcp_forge.egress import protocol, sockets
from mcp_forge.egress.addon import Policy, Session
from mcp_forge.egress.bounds import install as install_bounds
from mcp_forge.egress.relay import BUFFER, Bounds, Relays

STOP_TIMEOUT = 5.0  # seconds mitmproxy may take to stop on SIGTERM
# A session's name in cluster mode: a namespace and a KernelSession's name.
SESSION_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?"
)
TOKEN = re.compile(r"[!-~]{16,1024}")  # cluster mode: printable ASCII, no spaces
SOURCES_MAX = 8  # a pod's addresses (one per family, and room to spare)


class Running:
    """The last addon: mitmproxy's servers are up when its `running` hook runs."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster = args.listen is not None
        table = json.loads(args.resolve.read()) if args.resolve else None
        self.policy = Policy(self.audit, table, relayed_only=not self.cluster)
        bounds = Bounds(
            args.connections_max, args.bandwidth_max, args.unidentified_max,
            args.unidentified_timeout,
        )  # fmt: skip
        self.relays = Relays(self.audit, self.policy.relayed, bounds)
        if self.cluster:
            self.policy.admit = self.relays.admit
        self.audit_socket = sockets.AuditSocket(args.audit_buffer) if self.cluster else None
        self.grants: dict[str, str] = {}  # cluster mode: each session's last open, digested
        self.master: Any = None
        self.task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self.relays.port

    def audit(self, record: dict[str, Any]) -> None:
        name = record.get("session")
        if isinstance(name, str) and name in self.relays.counts and "allowed" in record:
            verdict = "allowed" if record.get("allowed") else "refused"
            self.relays.counts[name][verdict] += 1
        line = sockets.line(record)
        sys.stderr.write(line.decode())
        sys.stderr.flush()
        if self.audit_socket is not None:
            self.audit_socket.send(line)

    async def start(self) -> Master:
        opts = options.Options(listen_host="127.0.0.1", listen_port=0)
        master = Master(opts)
        running = Running()
        master.addons.add(self.policy, *default_addons(), running)
        opts.update(
            confdir=self.args.confdir,
            connection_strategy="lazy",
            stream_large_bodies="256k",
            onboarding=False,
            http2=False,
            # Never relay bytes unread because they look like neither TLS nor HTTP: a
            # ClientHello in a record version mitmproxy does not know, or HTTP after a
            # blank line, would pass every check unseen. Such bytes get HTTP's 400.
            rawtcp=False,
        )
        if self.args.upstream_ca:
            opts.update(ssl_verify_upstream_trusted_ca=self.args.upstream_ca)
        self.master = master
        self.task = task = asyncio.create_task(master.run())
        waiter = asyncio.create_task(running.event.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not running.event.is_set():
            waiter.cancel()
            raise RuntimeError("mitmproxy did not start")
        proxyserver = master.addons.get("proxyserver")
        self.relays.port = int(proxyserver.listen_addrs()[0][1])
        return master

    async def stop(self) -> None:
        """Every connection ended, and mitmproxy stopped (within STOP_TIMEOUT)."""
        self.relays.close_all()
        if self.master is not None and self.task is not None:
            self.master.shutdown()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self.task

    # ---- control -------------------------------------------------------------------

    async def handle(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = message.get("op")
        try:
            if op == "open" and self.cluster:
                return await self._open_cluster(message)
            if op == "open":
                return await self._open(message, fds)
            if op == "close":
                await self._close(str(message.get("session")))
                return {"ok": True}
            if op == "stats":
                extra = {"unidentified": len(self.relays.waiting)} if self.cluster else {}
                return {"ok": True, "sessions": self.relays.stats(), **extra}
            if op == "sync":
                return await self._sync(message)
            return {"ok": False, "error": f"unknown op {str(op)[:32]!r}"}
        finally:
            for fd in fds:  # a descriptor nobody took
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def _open(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        name = str(message.get("session", ""))
        if len(fds) != 1 or not name:
            return {"ok": False, "error": "open needs a session name and one socket"}
        listener = socket.socket(fileno=fds.pop())
        session = self._session(name, str(message.get("token", "")), message)
        if isinstance(session, str):
            listener.close()
            return {"ok": False, "error": session}
        await self._close(name)
        self._add(session)
        try:
            await self.relays.serve(name, listener)
        except OSError as exc:
            listener.close()
            await self._close(name)
            return {"ok": False, "error": f"serving the session's socket: {exc}"}
        return {"ok": True, "port": self.port}

    async def _open_cluster(self, message: dict[str, Any]) -> dict[str, Any]:
        """An open without a socket: the session's connections come to the listener."""
        name, token = message.get("session"), message.get("token")
        if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
            return {"ok": False, "error": "open needs a session named namespace/name"}
        if not isinstance(token, str) or not TOKEN.fullmatch(token):
            return {"ok": False, "error": "open needs a token of 16 to 1024 printable characters"}
        if self.policy.holder(token) not in (None, name):
            return {"ok": False, "error": "the token is another session's"}
        sources = message.get("sources")
        if sources is not None and not (
            isinstance(sources, list)
            and len(sources) <= SOURCES_MAX
            and all(isinstance(a, str) and len(a) <= 64 for a in sources)
        ):
            return {"ok": False, "error": f"sources: a list of at most {SOURCES_MAX} addresses"}
        fields = {k: message.get(k) for k in ("token", "rules", "values", "ca")}
        grant = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        if self.grants.get(name) != grant or name not in self.policy.sessions:
            session = self._session(name, token, message)
            if isinstance(session, str):
                return {"ok": False, "error": session}
            await self._close(name)
            self._add(session)
            self.grants[name] = grant
        # else the same again (a feeder that reconnected, or its pod's address changed):
        # kept as is, its connections too
        self.relays.bind(name, sources)
        return {"ok": True}

    def _session(self, name: str, token: str, message: dict[str, Any]) -> Session | str:
        """The session an open describes, or why it is not one."""
        try:
            rules = egress.parse_rules(message.get("rules", []))
        except ValueError as exc:  # InvalidSession is a ValueError
            return str(exc)
        try:
            certstore = self._certstore(message.get("ca"))
            values = {(int(n), int(i)): str(v) for n, i, v in message.get("values", [])}
        except (ValueError, TypeError, KeyError) as exc:
            return f"the session's CA or values: {type(exc).__name__}"
        return Session(name, token, rules, certstore, values)

    def _certstore(self, ca: Any) -> Any:
        """The session's CA as a mitmproxy CertStore (its leaves are signed by it), or None."""
        if ca is None:
            return None
        key = serialization.load_pem_private_key(str(ca["key"]).encode(), None)
        cert = certs.Cert.from_pem(str(ca["cert"]).encode())
        dhparams = self.master.addons.get("tlsconfig").certstore.dhparams
        return certs.CertStore(key, cert, None, dhparams)

    def _add(self, session: Session) -> None:
        self.policy.add(session)
        self.relays.add(session.name)

    async def _close(self, name: str) -> None:
        self.policy.remove(name)
        self.relays.remove(name)
        self.grants.pop(name, None)

    async def _sync(self, message: dict[str, Any]) -> dict[str, Any]:
        """Every session not named closed (the feeder's list after it reconnects)."""
        named = message.get("sessions")
        if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
            return {"ok": False, "error": "sync needs a list of session names"}
        closed = sorted(set(self.policy.sessions) - set(named))
        for name in closed:
            await self._close(name)
        return {"ok": True, "closed": closed}


def _control_loop(proxy: Proxy, control: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """The gateway's requests, one at a time, answered in order; at the end, exit."""
    reader = protocol.Reader(control)
    try:
        while (got := reader.read()) is not None:
            message, fds = got
            future = asyncio.run_coroutine_threadsafe(proxy.handle(message, fds), loop)
            protocol.send(control, future.result())
    except (OSError, ValueError) as exc:
        print(json.dumps({"event": "control", "error": str(exc)[:200]}), file=sys.stderr)
    finally:
        loop.call_soon_threadsafe(loop.stop)


async def serve(args: argparse.Namespace) -> None:
    if args.listen is not None:
        return await serve_cluster(args)
    control = socket.socket(fileno=args.control_fd)
    proxy = Proxy(args)
    await proxy.start()
    heap.settle(collect=False)  # a session's first start waits for it
    protocol.send(control, {"ready": True, "port": proxy.port})
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    thread = threading.Thread(
        target=_control_loop, args=(proxy, control, loop), name="control", daemon=True
    )
    thread.start()
    await done  # the control loop stops the event loop


async def serve_cluster(args: argparse.Namespace) -> None:
    """Cluster mode, until SIGTERM (or SIGINT): then stop accepting, end, return."""
    proxy = Proxy(args)
    await proxy.start()
    heap.settle()  # mitmproxy and the addon loaded: out of the collector's way
    control = sockets.ControlSocket(proxy.handle)
    await control.start(args.control_socket)
    paths = [args.control_socket]
    if proxy.audit_socket is not None and args.audit_socket:
        await proxy.audit_socket.start(args.audit_socket)
        paths.append(args.audit_socket)
    host, port = args.listen
    listener = await asyncio.start_server(
        proxy.relays.unknown_link, host, port, limit=BUFFER, backlog=1024
    )
    bound = listener.sockets[0].getsockname()
    shown = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopping.set)
    sys.stderr.write(sockets.line({"event": "listening", "address": shown}).decode())
    sys.stderr.flush()
    await stopping.wait()
    listener.close()
    control.close()
    if proxy.audit_socket is not None:
        proxy.audit_socket.close()
    await proxy.stop()
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mcp_forge.egress.server")
    control = parser.add_mutually_exclusive_group(required=True)
    control.add_argument("--control-fd", type=int, help="local mode: the gateway's socket")
    control.add_argument("--control-socket", help="cluster mode: a Unix socket to listen on")
    parser.add_argument(
        "--listen", type=_address, help="cluster mode: HOST:PORT for every session's kernels"
    )
    parser.add_argument("--audit-socket", help="cluster mode: a Unix socket for audit readers")
    parser.add_argument("--confdir", required=True, help="mitmproxy's own, private")
    parser.add_argument(
        "--resolve",
        type=argparse.FileType("r"),
        help="tests only: a JSON object of names to addresses, asked before DNS",
    )
    parser.add_argument("--upstream-ca", help="the CA file servers are checked against")
    parser.add_argument("--connections-max", type=int, default=protocol.CONNECTIONS_MAX)
    parser.add_argument(
        "--bandwidth-max", type=int, default=0, help="bytes a second per session and direction"
    )
    parser.add_argument(
        "--unidentified-max", type=int, default=protocol.UNIDENTIFIED_MAX,
        help="cluster mode: connections open without a known credential, at once",
    )  # fmt: skip
    parser.add_argument(
        "--unidentified-timeout", type=float, default=protocol.UNIDENTIFIED_TIMEOUT,
        help="cluster mode: seconds a connection may take to show its credential",
    )  # fmt: skip
    parser.add_argument(
        "--audit-buffer", type=int, default=protocol.AUDIT_BUFFER,
        help="cluster mode: bytes an audit reader may fall behind before it loses records",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if (args.listen is None) != (args.control_socket is None):
        parser.error("--listen and --control-socket go together (cluster mode)")
    if args.audit_socket and args.listen is None:
        parser.error("--audit-socket is for cluster mode (--listen)")
    return args


def _address(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets); port 0 is one the system chooses."""
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    install_bounds()
    try:
        if args.listen is not None:
            asyncio.run(serve(args))
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped: the gateway went away
            asyncio.run(serve(args))
    finally:
        heap.thaw()  # what only the collector closes, closed as the process ends


if __name__ == "__main__":
    main()
