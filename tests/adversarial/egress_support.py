"""Egress by name (issue 28): a hostile kernel against the egress proxy that is its one way
out. Real kernels in real Podman pods, the real proxy (mitmproxy, confined), stand-ins for
internet hosts on this machine's own address (tests/egress_standins.py) that the proxy's
resolver maps test names to, as in tests/integration/test_egress.py.

The kernel speaks to the proxy byte by byte (`exchange`): through its relay on the pod's
loopback, or straight to the socket in its run directory. Each attack asserts the safe
outcome and its evidence: what the proxy answered, what each stand-in received (or did
not), and that the proxy still serves the session afterwards.

Session A is allowed api.test (and an IDN name by its A-label) on the HTTPS stand-in's port
and the plain one's; session B is allowed api.test and other.test. A decoy stand-in on a
port no rule names stands for "somewhere else": nothing may ever reach it. Session R is
allowed api.test with a path rule, so the proxy reads its HTTPS too (with R's own CA,
which its kernel trusts), and also on the port of a host that never answers (`Mute`).

This module holds the fixtures and helpers of the egress attack class; the attacks are in
test_egress_evasion.py (getting past the rules: smuggling, credentials, names, the relay)
and test_egress_exhaustion.py (wearing the proxy down: the connection bound, garbage, a
head that never ends, a 16 MB ClientHello). Each test module imports the fixtures, so each
has a proxy and sessions of its own.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_standins import Mute, StandIn, TestCA, own_address
from mcp_forge.api.connection import RUN_DIR_IN_POD
from mcp_forge.egress import protocol
from mcp_forge.egress.client import EgressProxy
from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

CONNECTIONS_MAX = 8  # the session's bound through the proxy, lowered for these tests
SOCKET = f"{RUN_DIR_IN_POD}/{protocol.SOCKET_NAME}"  # as the pod sees it
IDN = "xn--bcher-kva.test"  # bücher.test's A-label
AUTH = b"@AUTH@"  # replaced in the kernel by its own credential (from HTTPS_PROXY)

# Defined once in each kernel: send each step on one connection to the proxy, reading one
# HTTP answer after each (its head, and a body of Content-Length); what came back.
EXCHANGE = r"""
def _egress_exchange(steps, via="relay", timeout=10.0):
    import base64, os, socket, urllib.parse
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode())
    if via == "relay":
        s = socket.create_connection((proxy.hostname, proxy.port), timeout=timeout)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        s.connect(via)
    answers, buf = [], b""
    try:
        for step in steps:
            try:
                if step:
                    s.sendall(base64.b64decode(step).replace(b"@AUTH@", auth))
                else:  # an empty step: the end of what is sent
                    s.shutdown(socket.SHUT_WR)
            except OSError as e:
                answers.append({"error": type(e).__name__})
                break
            answer, buf = _egress_answer(s, buf)
            answers.append(answer)
            if "status" not in answer:
                break
    finally:
        s.close()
    return answers

def _egress_answer(s, buf):
    import socket
    try:
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            if not data:
                return {"closed": buf[:300].decode("latin-1")}, b""
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        version, status, reason = (lines[0].split(" ", 2) + [""])[:3]
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        length = int(headers.get("content-length", "0"))
        while len(buf) < length:
            data = s.recv(65536)
            if not data:
                break
            buf += data
        body, buf = buf[:length], buf[length:]
        return {"status": int(status), "reason": reason, "headers": headers,
                "body": body[:4000].decode("utf-8", "replace")}, buf
    except socket.timeout:
        return {"timeout": buf[:300].decode("latin-1")}, b""
    except OSError as e:
        return {"error": type(e).__name__}, b""
"""


@dataclasses.dataclass
class Hosts:
    address: str
    ca: TestCA
    https: StandIn  # api.test over TLS
    plain: StandIn  # api.test over plain HTTP
    decoy: StandIn  # a port no rule names: nothing may reach it


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    address = own_address()
    ca = TestCA(tmp_path_factory.mktemp("egress-ca"), addresses=(address,))
    with StandIn(address, ca) as https, StandIn(address) as plain, StandIn(address) as decoy:
        yield Hosts(address, ca, https, plain, decoy)


@pytest.fixture(scope="module")
async def proxied(
    runtime: LocalRuntime, hosts: Hosts, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRuntime]:
    """The session-wide runtime, its egress proxy (for this module only) resolving the test
    names to the stand-ins and bounding a session to CONNECTIONS_MAX connections."""
    table = tmp_path_factory.mktemp("egress-resolve") / "resolve.json"
    names = ("api.test", "other.test", IDN)
    table.write_text(json.dumps({n: [hosts.address] for n in names}))
    table.chmod(0o644)
    table.parent.chmod(0o755)
    settings = dataclasses.replace(
        runtime.settings,
        egress_resolve=str(table),
        egress_upstream_ca=str(hosts.ca.ca_path),
        egress_connections_max=CONNECTIONS_MAX,
    )
    before = runtime.egress
    runtime.egress = EgressProxy(settings)
    yield runtime
    await runtime.egress.stop()
    runtime.egress = before


def rules(hosts: Hosts, *names: str, **more: Any) -> list[dict[str, Any]]:
    """Each name on the HTTPS and plain stand-ins' ports; `more`: fields every rule also
    has, `ports` joining those two."""
    own = [f"{hosts.address}/32"]
    ports = [hosts.https.port, hosts.plain.port, *more.pop("ports", ())]
    return [{"host": name, "ports": ports, "addresses": own, **more} for name in names]


async def _apply(runtime: LocalRuntime, hosts: Hosts, image: str, *names: str, **more: Any) -> str:
    name = f"egress-adv-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "resources": {"memory": "512Mi"},
            "network": {"allow": rules(hosts, *names, **more)},
            "files": [{"path": "ca.pem", "content": hosts.ca.ca_path.read_text()}],
        },
    }
    await runtime.apply(body)
    return name


@pytest.fixture(scope="module")
async def gw(proxied: LocalRuntime) -> AsyncIterator[Gateway]:
    gateway = Gateway(proxied, proxied.settings)
    yield gateway
    await gateway.close()


@pytest.fixture(scope="module")
async def session(
    proxied: LocalRuntime, gw: Gateway, hosts: Hosts, images: dict[str, str]
) -> AsyncIterator[str]:
    """Session A: api.test, and a name of IDNA's (bücher.test) by its A-label."""
    name = await _apply(proxied, hosts, images["minimal"], "api.test", IDN)
    r = await gw.execute(name, EXCHANGE)
    assert r.status == "ok", (r.error, r.stderr)
    yield name
    with contextlib.suppress(SessionNotFound):
        await proxied.delete(name)


@pytest.fixture(scope="module")
async def other(
    proxied: LocalRuntime, gw: Gateway, hosts: Hosts, images: dict[str, str]
) -> AsyncIterator[str]:
    """Session B: api.test and other.test."""
    name = await _apply(proxied, hosts, images["minimal"], "api.test", "other.test")
    r = await gw.execute(name, EXCHANGE)
    assert r.status == "ok", (r.error, r.stderr)
    yield name
    with contextlib.suppress(SessionNotFound):
        await proxied.delete(name)


@pytest.fixture(scope="module")
def mute(hosts: Hosts) -> Iterator[Mute]:
    """A host on the stand-ins' address that accepts connections and never answers."""
    with Mute(hosts.address) as listener:
        yield listener


@pytest.fixture(scope="module")
async def reading(
    proxied: LocalRuntime, gw: Gateway, hosts: Hosts, mute: Mute, images: dict[str, str]
) -> AsyncIterator[str]:
    """Session R: api.test under paths "/" (so the proxy reads its HTTPS), on the mute
    host's port as well."""
    name = await _apply(
        proxied, hosts, images["minimal"], "api.test", ports=[mute.port], paths=["/"]
    )
    r = await gw.execute(name, EXCHANGE)
    assert r.status == "ok", (r.error, r.stderr)
    yield name
    with contextlib.suppress(SessionNotFound):
        await proxied.delete(name)


# ---- helpers ---------------------------------------------------------------------------


async def kernel_json(gw: Gateway, session: str, code: str, timeout: float = 60) -> Any:
    """Run `code` in the kernel; its last line of output, read as JSON."""
    r = await gw.execute(session, code, timeout=timeout)
    assert r.status == "ok", (r.error, r.stderr, r.stdout[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


async def exchange(
    gw: Gateway, session: str, *steps: bytes, via: str = "relay"
) -> list[dict[str, Any]]:
    """Each step's bytes sent by the kernel on one connection to the proxy (`via` its relay,
    or a socket path), one answer read after each: {status, reason, headers, body}, or
    {closed}, {timeout} or {error} (and no more steps)."""
    encoded = [base64.b64encode(step).decode() for step in steps]
    code = f"import json; print(json.dumps(_egress_exchange({encoded!r}, via={via!r})))"
    return list(await kernel_json(gw, session, code))


def connect(authority: str) -> bytes:
    return (
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
        "Proxy-Authorization: Basic @AUTH@\r\n\r\n"
    ).encode()


def request(target: str, *headers: str, proxy_auth: bool = False) -> bytes:
    lines = [f"GET {target} HTTP/1.1", *headers]
    if proxy_auth:
        lines.append("Proxy-Authorization: Basic @AUTH@")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def marker() -> str:
    return f"/echo/{uuid.uuid4().hex[:12]}"


def seen(standin: StandIn, path_part: str) -> list[Any]:
    return [r for r in standin.requests if path_part in r.path]


async def allowed_still_works(gw: Gateway, session: str, hosts: Hosts) -> None:
    """An allowed request, through the kernel's relay and the proxy, reaches api.test."""
    path = marker()
    port = hosts.plain.port
    plain = request(f"http://api.test:{port}{path}", f"Host: api.test:{port}", proxy_auth=True)
    got = await exchange(gw, session, plain)
    assert got[0].get("status") == 200, got
    hosts.plain.wait_for(lambda r: r.path == path, timeout=10)


def proxy_pid(runtime: LocalRuntime) -> int:
    """The pid of this module's egress proxy (its Python, inside bwrap): the process whose
    command line names this module's resolver table."""
    table = runtime.egress.settings.egress_resolve.encode()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            cmdline = (status.parent / "cmdline").read_bytes().split(b"\0")
            name = status.read_text().split("\n", 1)[0]
        except OSError:
            continue
        if b"mcp_forge.egress.server" in cmdline and table in cmdline and "python" in name:
            return int(status.parent.name)
    raise AssertionError("no egress proxy process for this module")


def resident(pid: int) -> int:
    """VmRSS of `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
