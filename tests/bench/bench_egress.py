"""Benchmark: an HTTPS GET through the egress proxy next to the same GET made directly from
the host, in one run; and the proxy's memory per open connection.

    .venv/bin/python tests/bench/bench_egress.py [--runs 30] [--big-runs 10] [--tunnels 100]

Host only, no kernels: the proxy (egress/client.py's EgressProxy, mitmproxy in
.venv-egress; as root confined as nobody, as the gateway runs it) serves one session
whose Unix socket this script binds in a temporary directory, where a local session's
socket would be in its run directory. The kernel's side of the way out (the relay on the
pod's loopback, kernelside/egress_relay.py) is not measured here. A TLS stand-in
(tests/egress_standins.py) on this machine's own address answers for api.test, the
proxy's resolve table maps the name to it, and the session's one rule allows it there.

Round by round, interleaved (the machine is shared and noisy), a new connection each time:
  * direct (baseline): TCP to the stand-in's address, TLS for api.test (the test CA),
    GET /bytes/<n>, the body read to its end;
  * through the proxy: the session's socket, CONNECT api.test:<port> with the session's
    credential, then the same TLS and GET inside the tunnel (mitmproxy passes it through);
  * the same through the proxy in cluster mode, as a cluster kernel reaches it (its TCP
    listener, the session known by its credential, admitted from its pod's addresses,
    here loopback's; a process of its own, not confined). mitmproxy's own port is no
    longer a way in (a connection that did not come through the proxy's relay speaks
    for no session).
Each for 1 KB (`--runs`) and 10 MB (`--big-runs`); medians and p90, the ratio and the
milliseconds added. Then the proxy process's resident memory (the Python running
mcp_forge.egress.server, not its prlimit/bwrap wrappers): at its start, idle after the
GETs, and with `--tunnels` tunnels open at once (each CONNECT, TLS and one 1 KB GET, held
open); the difference per tunnel. The session's connection bound (64 by default) is
raised for this one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import json
import os
import select
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_local import stats  # tests/bench, beside this script

from egress_proxy import Process
from egress_standins import StandIn, TestCA, own_address
from mcp_forge.egress import protocol
from mcp_forge.egress.client import EgressProxy, Given, default_python
from mcp_forge.settings import Settings

NAME = "api.test"
SESSION = "bench/egress"
SMALL, BIG = 1024, 10 * 1024 * 1024
TIMEOUT = 30.0  # seconds for any one connection's step
EXIT_DEADLINE = 10.0  # seconds for the proxy's process to end once stopped
PATHS = [  # the first is the baseline
    ("direct (baseline)", "direct"),
    ("through the proxy", "tunnel"),
    ("cluster mode (TCP, credential)", "tunnel_cluster"),
]


class Target:
    """The stand-in, reached directly, through the session's socket, or through
    mitmproxy's own port."""

    def __init__(
        self,
        standin: StandIn,
        ca: TestCA,
        socket_path: Path,
        proxy_port: int,
        token: str,
        cluster: tuple[str, int],
    ) -> None:
        self.standin = standin
        self.cluster = cluster
        self.port = standin.port
        self.context = ca.client_context()
        self.socket_path = socket_path
        self.proxy_port = proxy_port
        auth = base64.b64encode(f"{protocol.PROXY_USER}:{token}".encode()).decode()
        self.connect_request = (
            f"CONNECT {NAME}:{self.port} HTTP/1.1\r\nHost: {NAME}:{self.port}\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n"
        ).encode()

    def direct(self) -> socket.socket:
        return socket.create_connection((self.standin.address, self.port), timeout=TIMEOUT)

    def tunnel(self) -> socket.socket:
        """The session's socket, as a kernel's relay reaches it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(TIMEOUT)
            sock.connect(str(self.socket_path))
        except BaseException:
            sock.close()
            raise
        return self._connect(sock)

    def tunnel_cluster(self) -> socket.socket:
        """The same proxy in cluster mode (its pod's TCP listener, the session known by its
        credential alone), as a cluster kernel reaches it."""
        return self._connect(socket.create_connection(self.cluster, TIMEOUT))

    def _connect(self, sock: socket.socket) -> socket.socket:
        """CONNECT api.test:<port> over `sock`, its 200 read."""
        try:
            sock.sendall(self.connect_request)
            answer = b""
            while b"\r\n\r\n" not in answer:  # nothing follows it before our ClientHello
                data = sock.recv(4096)
                if not data:
                    raise ConnectionError(f"the proxy closed the tunnel: {answer!r}")
                answer += data
            status = answer.split(b"\r\n", 1)[0]
            if b" 200 " not in status + b" ":
                raise ConnectionError(f"CONNECT refused: {answer.decode(errors='replace')}")
        except BaseException:
            sock.close()
            raise
        return sock

    def get(self, opened: Callable[[], socket.socket], size: int) -> http.client.HTTPConnection:
        """TLS for api.test over a new connection, GET /bytes/<size> read to its end; the
        connection, still open."""
        sock = opened()
        try:
            tls = self.context.wrap_socket(sock, server_hostname=NAME)
        except BaseException:
            sock.close()
            raise
        connection = http.client.HTTPConnection(NAME, self.port, timeout=TIMEOUT)
        connection.sock = tls
        try:
            connection.request("GET", f"/bytes/{size}")
            response = connection.getresponse()
            got = len(response.read())
            if response.status != 200 or got != size:
                raise ConnectionError(f"GET /bytes/{size}: {response.status}, {got} bytes")
        except BaseException:
            connection.close()
            raise
        return connection

    def timed(self, opened: Callable[[], socket.socket], size: int) -> float:
        began = time.perf_counter()
        self.get(opened, size).close()
        return (time.perf_counter() - began) * 1000


def rounds(target: Target, size: int, runs: int) -> list[list[float]]:
    """`runs` GETs of `size` each way (PATHS), in an order that turns round by round; one
    of each untimed first."""
    ways = [getattr(target, method) for _, method in PATHS]
    for opened in ways:
        target.timed(opened, size)
    times: list[list[float]] = [[] for _ in ways]
    for i in range(runs):
        for k in range(len(ways)):
            j = (i + k) % len(ways)
            times[j].append(target.timed(ways[j], size))
    return times


# ---- the proxy's process ---------------------------------------------------------------


def tell(control: Path, message: dict[str, object]) -> None:
    """One request on a cluster-mode proxy's control socket, as its feeder sends it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(str(control))
        protocol.send(sock, dict(message))
        got = protocol.Reader(sock).read()
    if got is None or not got[0].get("ok"):
        raise RuntimeError(f"the cluster-mode proxy refused {message['op']}: {got}")


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ')'


def _ours(pid: int) -> bool:
    """Whether `pid` descends from this process (another run's proxy does not)."""
    me = os.getpid()
    with contextlib.suppress(OSError, ValueError, IndexError):
        while pid > 1:
            pid = _parent(pid)
            if pid == me:
                return True
    return False


def proxy_pid(other: int) -> int:
    """The Python running mcp_forge.egress.server under this process (inside its wrappers),
    not `other` (the cluster-mode one)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        program = Path(argv[0].decode(errors="replace")).name
        server = b"mcp_forge.egress.server" in argv and program.startswith("python")
        if server and int(entry.name) != other and _ours(int(entry.name)):
            found.append(int(entry.name))
    if len(found) != 1:
        raise RuntimeError(f"expected one egress proxy process of ours, found {found}")
    return found[0]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def wait_gone(pid: int, timeout: float) -> None:
    """Wait for `pid` to end (its pidfd turns readable); raises TimeoutError."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"the egress proxy ({pid}) did not end in {timeout} s")
    finally:
        os.close(fd)


def hold(target: Target, count: int) -> list[http.client.HTTPConnection]:
    """`count` tunnels, each with one 1 KB GET answered, left open."""
    connections: list[http.client.HTTPConnection] = []
    try:
        for _ in range(count):
            connections.append(target.get(target.tunnel, SMALL))
    except BaseException:
        close_all(connections)
        raise
    return connections


def close_all(connections: list[http.client.HTTPConnection]) -> None:
    for connection in connections:
        connection.close()


# ---- the run ---------------------------------------------------------------------------


async def main(runs: int, big_runs: int, tunnels: int) -> None:
    if not default_python().exists():
        raise SystemExit(f"{default_python()} is missing: .ci/setup makes .venv-egress")
    address = own_address()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-egress-")))
        ca = TestCA(tmp / "ca", addresses=(address,))
        standin = stack.enter_context(StandIn(address, ca))
        table = tmp / "resolve" / "resolve.json"  # read by the proxy, as nobody when root
        table.parent.mkdir(mode=0o755)
        table.write_text(json.dumps({NAME: [address]}))
        table.chmod(0o644)
        settings = Settings(
            state_dir=tmp / "state",
            egress_resolve=str(table),
            egress_connections_max=tunnels + 8,
            egress_bandwidth_max=0,  # the proxy's own speed, not the session's bound
        )
        socket_path = tmp / "egress.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stack.callback(listener.close)
        listener.bind(str(socket_path))
        listener.listen(128)
        token = protocol.token_for(os.urandom(32))
        rule = {"host": NAME, "ports": [standin.port], "addresses": [f"{address}/32"]}
        cluster = Process(tmp / "cluster", "--resolve", str(table), "--bandwidth-max", "0",
                          "--connections-max", str(tunnels + 8))  # fmt: skip
        stack.callback(cluster.stop)
        # Bound to where this script dials from, as a grant binds a pod's address.
        tell(cluster.control_path, {"op": "open", "session": SESSION, "token": token,
                                    "rules": [rule], "values": [], "ca": None,
                                    "sources": ["127.0.0.1", "::1"]})  # fmt: skip
        proxy = EgressProxy(settings)
        pid = None
        try:
            await proxy.open(SESSION, Given(token, [rule]), listener)
            pid = proxy_pid(cluster.proc.pid)
            target = Target(standin, ca, socket_path, proxy.port, token, cluster.address)
            at_start = rss_kb(pid)
            # In threads: the loop meanwhile reads the proxy's audit lines (its stderr).
            small = await asyncio.to_thread(rounds, target, SMALL, runs)
            big = await asyncio.to_thread(rounds, target, BIG, big_runs)
            idle = rss_kb(pid)
            connections = await asyncio.to_thread(hold, target, tunnels)
            try:
                opened = (await proxy.stats())[SESSION]["open"]
                loaded = rss_kb(pid)
            finally:
                close_all(connections)
            if opened != tunnels:
                raise RuntimeError(f"{tunnels} tunnels held, the proxy counts {opened}")
        finally:
            await proxy.stop()
            if pid is not None:
                wait_gone(pid, EXIT_DEADLINE)

    print(f"HTTPS GET, new connection each, n={runs} (1 KB), n={big_runs} (10 MB)")
    print(f"{'':<40}{'median':>10}{'p90':>11}{'ratio':>8}{'added':>12}")
    for label, times in (("1 KB", small), ("10 MB", big)):
        base, _ = stats(times[0])
        for (name, _), xs in zip(PATHS, times, strict=True):
            p50, p90 = stats(xs)
            added = f"{p50 - base:+8.2f} ms" if xs is not times[0] else ""
            row = f"{label + ' ' + name:<40}{p50:7.2f} ms{p90:8.2f} ms{p50 / base:7.2f}x"
            print(f"{row}{added:>12}".rstrip())
    grown = loaded - idle
    print(
        f"proxy RSS: {at_start / 1024:.1f} MiB at start, {idle / 1024:.1f} MiB idle after the "
        f"GETs, {loaded / 1024:.1f} MiB with {tunnels} tunnels open: +{grown / 1024:.1f} MiB, "
        f"{grown / tunnels:.1f} KiB each"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="1 KB GETs each way")
    parser.add_argument("--big-runs", type=int, default=10, help="10 MB GETs each way")
    parser.add_argument("--tunnels", type=int, default=100, help="held open for the memory")
    a = parser.parse_args()
    asyncio.run(main(a.runs, a.big_runs, a.tunnels))
