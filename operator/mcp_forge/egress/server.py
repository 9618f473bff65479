"""The egress proxy's process: mitmproxy with our addon, fed by the gateway.

    python -m mcp_forge.egress.server --control-fd N --confdir DIR [--resolve FILE]

Run by the gateway (`client.py`) in the egress venv, confined (an unprivileged user in a
sandbox with the host's network). mitmproxy listens on the host's loopback, on a port
the kernel never sees; each session's socket (handed over by the gateway, already bound
where its pod sees it) is relayed to that port here, and the relayed connection's port
names its session to the addon, so a credential read in one session's pod does not speak
for it through another session's socket.

The control socket carries one JSON object a line each way, requests answered in order:
`{"op": "open", "session", "token", "rules"}` with the listening socket beside it;
`{"op": "close", "session"}`; `{"op": "stats"}`. Its end is the gateway's end: the
proxy exits. Each verdict is a JSON line on stderr (the gateway logs them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from mitmproxy import certs, options
from mitmproxy.addons import default_addons
from mitmproxy.master import Master

from mcp_forge.api import egress
from mcp_forge.egress import protocol
from mcp_forge.egress.addon import Policy, Session

BUFFER = 65536


@dataclass
class Relays:
    """The sessions' listening sockets, and their open connections."""

    servers: dict[str, asyncio.Server] = field(default_factory=dict)
    open: dict[str, set[asyncio.StreamWriter]] = field(default_factory=dict)
    counts: dict[str, Counter[str]] = field(default_factory=dict)


class Running:
    """The last addon: mitmproxy's servers are up when its `running` hook runs."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        table = json.loads(args.resolve.read()) if args.resolve else None
        self.policy = Policy(self.audit, table)
        self.relays = Relays()
        self.port = 0
        self.connections_max = args.connections_max
        self.master: Any = None

    def audit(self, record: dict[str, Any]) -> None:
        name = record.get("session")
        if isinstance(name, str) and name in self.relays.counts:
            verdict = "allowed" if record.get("allowed") else "refused"
            self.relays.counts[name][verdict] += 1
        print(json.dumps(record, separators=(",", ":")), file=sys.stderr, flush=True)

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
        )
        if self.args.upstream_ca:
            opts.update(ssl_verify_upstream_trusted_ca=self.args.upstream_ca)
        self.master = master
        task = asyncio.create_task(master.run())
        waiter = asyncio.create_task(running.event.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not running.event.is_set():
            waiter.cancel()
            raise RuntimeError("mitmproxy did not start")
        proxyserver = master.addons.get("proxyserver")
        self.port = int(proxyserver.listen_addrs()[0][1])
        return master

    # ---- control -------------------------------------------------------------------

    async def handle(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = message.get("op")
        try:
            if op == "open":
                return await self._open(message, fds)
            if op == "close":
                await self._close(str(message.get("session")))
                return {"ok": True}
            if op == "stats":
                return {"ok": True, "sessions": self._stats()}
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
        try:
            rules = egress.parse_rules(message.get("rules", []))
        except ValueError as exc:  # InvalidSession is a ValueError
            listener.close()
            return {"ok": False, "error": str(exc)}
        try:
            certstore = self._certstore(message.get("ca"))
            values = {(int(n), int(i)): str(v) for n, i, v in message.get("values", [])}
        except (ValueError, TypeError, KeyError) as exc:
            listener.close()
            return {"ok": False, "error": f"the session's CA or values: {type(exc).__name__}"}
        await self._close(name)
        session = Session(name, str(message.get("token", "")), rules, certstore, values)
        self.policy.sessions[name] = session
        self.relays.counts[name] = Counter()
        self.relays.open[name] = set()
        self.relays.servers[name] = await asyncio.start_unix_server(
            lambda r, w: self._relay(name, r, w), sock=listener
        )
        return {"ok": True, "port": self.port}

    def _certstore(self, ca: Any) -> Any:
        """The session's CA as a mitmproxy CertStore (its leaves are signed by it), or None."""
        if ca is None:
            return None
        key = serialization.load_pem_private_key(str(ca["key"]).encode(), None)
        cert = certs.Cert.from_pem(str(ca["cert"]).encode())
        dhparams = self.master.addons.get("tlsconfig").certstore.dhparams
        return certs.CertStore(key, cert, None, dhparams)

    async def _close(self, name: str) -> None:
        self.policy.sessions.pop(name, None)
        server = self.relays.servers.pop(name, None)
        if server is not None:
            server.close()
        for writer in self.relays.open.pop(name, set()):
            writer.close()
        self.relays.counts.pop(name, None)

    def _stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {**counts, "open": len(self.relays.open.get(name, ()))}
            for name, counts in self.relays.counts.items()
        }

    # ---- a session's connection ----------------------------------------------------

    async def _relay(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        open_now = self.relays.open.get(name)
        counts = self.relays.counts.get(name)
        if open_now is None or counts is None:
            writer.close()
            return
        if len(open_now) >= self.connections_max:
            counts["over_limit"] += 1
            self.audit(
                {"event": "limit", "session": name, "allowed": False,
                 "reason": f"{self.connections_max} connections open already"}
            )  # fmt: skip
            writer.close()
            return
        open_now.add(writer)
        counts["connections"] += 1
        up_writer = None
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
            port = up_writer.get_extra_info("sockname")[1]
            self.policy.relayed[port] = name
            try:
                await asyncio.gather(
                    _pipe(reader, up_writer, counts, "bytes_out"),
                    _pipe(up_reader, writer, counts, "bytes_in"),
                )
            finally:
                self.policy.relayed.pop(port, None)
        except OSError:
            pass
        finally:
            open_now.discard(writer)
            writer.close()
            if up_writer is not None:
                up_writer.close()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: Counter[str], key: str
) -> None:
    """One direction, until its end; the other side then hears the end too."""
    try:
        while data := await reader.read(BUFFER):
            counts[key] += len(data)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


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
    control = socket.socket(fileno=args.control_fd)
    proxy = Proxy(args)
    await proxy.start()
    protocol.send(control, {"ready": True, "port": proxy.port})
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    thread = threading.Thread(
        target=_control_loop, args=(proxy, control, loop), name="control", daemon=True
    )
    thread.start()
    await done  # the control loop stops the event loop


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mcp_forge.egress.server")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--confdir", required=True, help="mitmproxy's own, private")
    parser.add_argument(
        "--resolve",
        type=argparse.FileType("r"),
        help="tests only: a JSON object of names to addresses, asked before DNS",
    )
    parser.add_argument("--upstream-ca", help="the CA file servers are checked against")
    parser.add_argument("--connections-max", type=int, default=protocol.CONNECTIONS_MAX)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with contextlib.suppress(RuntimeError):  # the loop stopped: the gateway went away
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
