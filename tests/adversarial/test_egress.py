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
port no rule names stands for "somewhere else": nothing may ever reach it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_standins import StandIn, TestCA, own_address
from mcp_forge.api.connection import RUN_DIR_IN_POD
from mcp_forge.egress import protocol
from mcp_forge.egress.client import EgressProxy, default_python
from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

CONNECTIONS_MAX = 8  # the session's bound through the proxy, lowered for this module
SOCKET = f"{RUN_DIR_IN_POD}/{protocol.SOCKET_NAME}"  # as the pod sees it
NOISE = random.Random(28)  # garbage, the same in every run
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


def rules(hosts: Hosts, *names: str) -> list[dict[str, Any]]:
    own = [f"{hosts.address}/32"]
    ports = [hosts.https.port, hosts.plain.port]
    return [{"host": name, "ports": ports, "addresses": own} for name in names]


async def _apply(runtime: LocalRuntime, hosts: Hosts, image: str, *names: str) -> str:
    name = f"egress-adv-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "resources": {"memory": "512Mi"},
            "network": {"allow": rules(hosts, *names)},
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


# ---- 1. smuggling inside an allowed tunnel, and in plain requests ------------------------


@pytest.mark.parametrize(
    ("inner", "why"),
    [
        ("GET {m} HTTP/1.1\r\nHost: other.test\r\n", "'other.test' inside a tunnel to api.test"),
        ("GET {m} HTTP/1.1\r\nHost: api.test:{D}\r\n", "':{D}' inside a tunnel"),
        ("GET http://other.test:{P}{m} HTTP/1.1\r\nHost: api.test:{P}\r\n", "other.test:{P}"),
        ("GET http://api.test:{D}{m} HTTP/1.1\r\nHost: api.test:{P}\r\n", "api.test:{D}"),
        ("GET {m} HTTP/1.1\r\nHost: api.test:{P}\r\nHost: other.test\r\n", "2 Host headers"),
    ],
    ids=["other-host", "other-port", "absolute-other-host", "absolute-other-port", "two-hosts"],
)
async def test_a_request_inside_a_tunnel_naming_elsewhere_is_refused_undialled(
    gw: Gateway, session: str, hosts: Hosts, inner: str, why: str
) -> None:
    """CONNECT api.test:P, then plain HTTP inside the tunnel naming another host or port (in
    its Host header, in an absolute-form target a server reads first, or in a second Host
    header a server may read instead): a 403 naming it; nothing reaches any stand-in."""
    m, P, D = marker(), hosts.plain.port, hosts.decoy.port
    names = {"m": m, "P": P, "D": D}
    got = await exchange(
        gw, session, connect(f"api.test:{P}"), (inner.format(**names) + "\r\n").encode()
    )
    assert got[0].get("status") == 200, got
    assert got[1].get("status") == 403, got
    assert why.format(**names).replace("'", "") in got[1]["reason"].replace("'", ""), got
    assert not seen(hosts.plain, m) and not hosts.decoy.requests
    await allowed_still_works(gw, session, hosts)


async def test_a_request_inside_a_tunnel_naming_its_own_host_goes_through(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    """The control: the same tunnel, a request naming api.test (any case, a trailing dot)
    reaches the stand-in, in origin form."""
    m, P = marker(), hosts.plain.port
    got = await exchange(
        gw, session, connect(f"api.test:{P}"), request(f"http://API.test.:{P}{m}", "Host: api.test")
    )
    assert [a.get("status") for a in got] == [200, 200], got
    assert hosts.plain.wait_for(lambda r: r.path == m, timeout=10).host == "api.test"


@pytest.mark.parametrize(
    "headers",
    [["Host: other.test"], ["Host: api.test:{P}", "Host: other.test"], ["Host: api.test:{D}"]],
    ids=["other-host", "two-hosts", "other-port"],
)
async def test_a_plain_request_reaches_only_the_name_it_was_judged_by(
    gw: Gateway, session: str, hosts: Hosts, headers: list[str]
) -> None:
    """`GET http://api.test:P/...` (absolute form, through the proxy) with a Host header
    naming another host or port, or two of them: the proxy judged api.test:P, dials only
    its pinned address, and the server reads api.test:P as the one Host header (a shared
    address serving other.test would otherwise answer for it: domain fronting)."""
    m, P, D = marker(), hosts.plain.port, hosts.decoy.port
    lines = [h.format(P=P, D=D) for h in headers]
    got = await exchange(gw, session, request(f"http://api.test:{P}{m}", *lines, proxy_auth=True))
    assert got[0].get("status") == 200, got
    recorded = hosts.plain.wait_for(lambda r: r.path == m, timeout=10)
    assert [v for k, v in recorded.headers if k.lower() == "host"] == [f"api.test:{P}"]
    assert not hosts.decoy.requests


async def test_each_request_of_a_kept_alive_connection_is_judged_again(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    """One connection: api.test:P allowed, then other.test and api.test on the decoy's port,
    each refused with its reason, then api.test:P again."""
    m, P, D = marker(), hosts.plain.port, hosts.decoy.port
    got = await exchange(
        gw,
        session,
        request(f"http://api.test:{P}{m}1", f"Host: api.test:{P}", proxy_auth=True),
        request(f"http://other.test:{P}{m}2", f"Host: other.test:{P}", proxy_auth=True),
        request(f"http://api.test:{D}{m}3", f"Host: api.test:{D}", proxy_auth=True),
        request(f"http://api.test:{P}{m}4", f"Host: api.test:{P}", proxy_auth=True),
    )
    assert [a.get("status") for a in got] == [200, 403, 403, 200], got
    assert "no rule allows other.test" in got[1]["reason"], got
    assert f"no rule allows api.test on port {D}" in got[2]["reason"], got
    assert sorted(r.path for r in hosts.plain.requests if m in r.path) == [m + "1", m + "4"]
    assert not hosts.decoy.requests


# ---- 2. the proxy's credential never reaches a server ------------------------------------


async def test_proxy_authorization_never_reaches_the_server(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    """Plain HTTP through the proxy (urllib, as any program would; and by hand with the
    header in lower case, or twice), and inside a tunnel: the stand-in sees no Proxy-*
    header and no trace of the credential."""
    m, P = marker(), hosts.plain.port
    token = (await kernel_json(
        gw, session,
        "import json, os, urllib.parse; "
        "print(json.dumps(urllib.parse.urlsplit(os.environ['HTTP_PROXY']).password))",
    ))  # fmt: skip
    code = f"""
import json, urllib.request
with urllib.request.urlopen("http://api.test:{P}{m}1", timeout=20) as r:
    print(json.dumps(r.status))
"""
    assert await kernel_json(gw, session, code) == 200
    lower = "proxy-authorization: Basic @AUTH@"
    got = await exchange(
        gw, session, request(f"http://api.test:{P}{m}2", f"Host: api.test:{P}", lower)
    )
    assert got[0].get("status") == 200, got
    # Twice: which one speaks? Neither (a 407), and nothing is sent on.
    twice = request(f"http://api.test:{P}{m}x", f"Host: api.test:{P}", lower, proxy_auth=True)
    got = await exchange(gw, session, twice)
    assert got[0].get("status") == 407, got
    got = await exchange(
        gw,
        session,
        connect(f"api.test:{P}"),
        request(f"{m}3", f"Host: api.test:{P}", proxy_auth=True),
    )
    assert [a.get("status") for a in got] == [200, 200], got
    for n in "123":
        recorded = hosts.plain.wait_for(lambda r, n=n: r.path == m + n, timeout=10)  # type: ignore[misc]
        assert not [k for k, _ in recorded.headers if k.lower().startswith("proxy-")], recorded
        assert token not in repr(recorded.headers)
    assert not seen(hosts.plain, m + "x")


# ---- 3. another session's credential -----------------------------------------------------


async def test_a_kernel_holds_its_own_credential_and_finds_no_other_sessions_socket(
    proxied: LocalRuntime, gw: Gateway, session: str, other: str
) -> None:
    """A's kernel: the credential in its environment is its own (never B's); its run
    directory holds its own socket only, B's (by its host path, or anywhere in A's
    filesystem) is not there to dial; and B's credential, were A to learn it, is refused
    through A's way out."""
    own = protocol.token_for(proxied.store.key("default", session))
    theirs = protocol.token_for(proxied.store.key("default", other))
    b_run = proxied.host_paths(await proxied.get(other)).run
    code = f"""
import json, os, stat, urllib.parse
token = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"]).password
sockets = []
for top, dirs, files in os.walk("/", onerror=lambda e: None):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev")]
    for name in files + dirs:
        path = os.path.join(top, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                sockets.append(path)
        except OSError:
            pass
there = []
for path in ({b_run!r}, {b_run + "/" + protocol.SOCKET_NAME!r}):
    try:
        os.stat(path)
        there.append(path)
    except OSError:
        pass
print(json.dumps({{"token": token, "sockets": sorted(sockets), "there": there}}))
"""
    found = await kernel_json(gw, session, code)
    assert found["token"] == own and found["token"] != theirs
    assert found["there"] == []
    egress_sockets = [p for p in found["sockets"] if p.endswith(protocol.SOCKET_NAME)]
    assert egress_sockets == [SOCKET], found["sockets"]
    stolen = base64.b64encode(f"{protocol.PROXY_USER}:{theirs}".encode()).decode()
    for via in ("relay", SOCKET):
        got = await exchange(
            gw, session, connect("other.test:443").replace(b"@AUTH@", stolen.encode()), via=via
        )
        assert got[0].get("status") == 407, (via, got)


# ---- 4, 5. ports and names ---------------------------------------------------------------


async def test_a_port_no_rule_names_is_refused(gw: Gateway, session: str, hosts: Hosts) -> None:
    D = hosts.decoy.port
    got = await exchange(gw, session, connect(f"api.test:{D}"), request("/", "Host: api.test"))
    assert got[0].get("status") == 403, got
    assert f"no rule allows api.test on port {D}" in got[0]["reason"], got
    assert not hosts.decoy.requests


# Names over 253 characters, every label valid: mitmproxy's parser takes up to 255 (so
# the policy refuses 254), and refuses more itself.
LONG = ("a" * 62 + ".") * 3 + "b" * 56 + ".api.test"
LONGER = ("a" * 60 + ".") * 5 + "api.test"
assert (len(LONG), len(LONGER)) == (254, 313)


@pytest.mark.parametrize(
    ("authority", "status", "why"),
    [
        ("api.test.:{P}", 200, ""),
        ("API.TEST:{P}", 200, ""),
        ("Api.Test.:{P}", 200, ""),
        ("api.test@evil.test:{P}", 400, "Bad HTTP request line"),
        ("user:pw@api.test:{P}", 400, "Bad HTTP request line"),
        ("api%2etest:{P}", 400, "Bad HTTP request line"),
        ("api.test%00.evil.test:{P}", 400, "Bad HTTP request line"),
        (LONG + ":{P}", 403, "a host name is 1 to 253 characters"),
        (LONGER + ":{P}", 400, "Bad HTTP request line"),
        ("[::1]:{P}", 403, "an IP address, not a host name"),
        ("[::ffff:127.0.0.1]:{P}", 403, "an IP address, not a host name"),
        ("2130706433:{P}", 403, "ends in a number"),
        ("0x7f000001:{P}", 403, "ends in a number"),
        ("127.1:{P}", 403, "ends in a number"),
        ("api.test.1:{P}", 403, "ends in a number"),
        ("api..test:{P}", 400, "Bad HTTP request line"),
        ("-api.test:{P}", 403, "is not 1 to 63 letters"),
        ("api_test.test:{P}", 403, "is not 1 to 63 letters"),
        ("xn--pi-test.test:{P}", 400, "Bad HTTP request line"),  # not valid punycode
        ("XN--BCHER-KVA.test:{P}", 200, ""),  # allowed by its A-label
        ("bücher.test:{P}", 400, "Bad HTTP request line"),  # its U-label, in UTF-8
        ("xn--bcher-kva.test.evil.test:{P}", 403, "no rule allows"),
    ],
)
@pytest.mark.parametrize("form", ["connect", "absolute"])
async def test_a_name_in_an_odd_form_is_normalized_or_refused_with_a_reason(
    gw: Gateway, session: str, hosts: Hosts, authority: str, status: int, why: str, form: str
) -> None:
    """Each odd spelling of a destination, as a CONNECT and as an absolute-form request:
    the same host (case, a trailing dot) goes through to api.test; anything else is a 403
    from the policy naming why, or a 400 from mitmproxy's parser for what is not a request
    line at all; never a 5xx, never dialled, and the proxy goes on serving."""
    m, P = marker(), hosts.plain.port
    target = authority.format(P=P)
    if form == "connect":
        steps = [connect(target), request(m, f"Host: {target}")]
    else:
        steps = [request(f"http://{target}{m}", f"Host: {target}", proxy_auth=True)]
    got = await exchange(gw, session, *steps)
    answers = [a.get("status") for a in got]
    assert answers[0] == status, got
    if status == 200:
        assert answers == [200] * len(steps), got
        recorded = hosts.plain.wait_for(lambda r: r.path == m, timeout=10)
        assert recorded.host is not None
        assert recorded.host.lower().split(":")[0].rstrip(".") in ("api.test", IDN)
    else:
        assert why in got[0]["reason"] + got[0]["body"], got
        assert not seen(hosts.plain, m)
    assert not hosts.decoy.requests
    await allowed_still_works(gw, session, hosts)


# ---- 6. the session's connections are bounded --------------------------------------------

HOLD = r'''
def _egress_hold(n, authority, timeout=10.0):
    """Open n connections through the relay, a CONNECT on each, one after the other; keep
    them (in _egress_held); what each first answered (a status line, or "closed")."""
    import base64, os, socket, urllib.parse
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
    firsts = []
    for _ in range(n):
        s = socket.create_connection((proxy.hostname, proxy.port), timeout=timeout)
        _egress_held.append(s)
        try:
            s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                      f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
            data = s.recv(4096)
        except OSError as e:
            data = b""
        firsts.append(data.split(b"\r\n")[0].decode() or "closed")
    return firsts

def _egress_release():
    while _egress_held:
        _egress_held.pop().close()

_egress_held = []
'''


async def test_connections_past_the_bound_are_closed_and_the_session_recovers(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts
) -> None:
    """The kernel opens CONNECTIONS_MAX + 4 tunnels and holds them: the first
    CONNECTIONS_MAX are established, the rest closed at once (and counted); once it lets
    them go, it has its CONNECTIONS_MAX again."""
    authority = f"api.test:{hosts.https.port}"
    before = (await proxied.egress.stats()).get(f"default/{session}", {}).get("over_limit", 0)
    r = await gw.execute(session, HOLD)
    assert r.status == "ok", (r.error, r.stderr)
    code = f"import json; print(json.dumps(_egress_hold({CONNECTIONS_MAX + 4}, {authority!r})))"
    firsts = await kernel_json(gw, session, code)
    ok = "HTTP/1.1 200 Connection established"
    assert firsts == [ok] * CONNECTIONS_MAX + ["closed"] * 4, firsts
    stats = (await proxied.egress.stats())[f"default/{session}"]
    assert stats["over_limit"] - before == 4 and stats["open"] == CONNECTIONS_MAX, stats
    # Let go: the proxy sees each end (through the relay) and counts it down.
    code = f"""
import json, time
_egress_release()
end, firsts = time.monotonic() + 10, []
while time.monotonic() < end:
    firsts = _egress_hold({CONNECTIONS_MAX}, {authority!r})
    _egress_release()
    if firsts == [{ok!r}] * {CONNECTIONS_MAX}:
        break
    time.sleep(0.05)  # ends still on their way through the relay: ask again
print(json.dumps(firsts))
"""
    assert await kernel_json(gw, session, code) == [ok] * CONNECTIONS_MAX
    await allowed_still_works(gw, session, hosts)


# ---- 7. the relay is not a boundary ------------------------------------------------------


async def test_killing_the_relay_gains_the_kernel_nothing(
    gw: Gateway, other: str, hosts: Hosts
) -> None:
    """The relay in the pod is the kernel's own process, not a boundary: B's kernel kills
    it and has no way out more than before (only `lo`, no route to the host), and less
    (the proxy port is closed); the socket it dials by hand is the same proxy, the same
    rules and the same 403s."""
    code = f"""
import errno, json, os, signal, socket, time
def relays():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                argv = f.read().split(b"\\0")
        except OSError:
            continue
        if {SOCKET.encode()!r} in argv and int(pid) != os.getpid():
            found.append(int(pid))
    return found
killed = relays()
for pid in killed:
    os.kill(pid, signal.SIGKILL)
end = time.monotonic() + 10
while relays() and time.monotonic() < end:
    time.sleep(0.05)  # the pod's init reaps it
out = {{"killed": len(killed), "left": relays(),
        "interfaces": sorted(n for _, n in socket.if_nameindex())}}
for name, where in (("relay", ("127.0.0.1", {protocol.RELAY_PORT})),
                    ("host", ({hosts.address!r}, {hosts.plain.port}))):
    try:
        socket.create_connection(where, timeout=5).close()
        out[name] = "connected"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e))
print(json.dumps(out))
"""
    found = await kernel_json(gw, other, code)
    assert found["killed"] >= 1 and found["left"] == [], found
    assert found["interfaces"] == ["lo"], found
    assert found["relay"] == "ECONNREFUSED", found
    assert found["host"] in ("ENETUNREACH", "EHOSTUNREACH"), found
    m, P, D = marker(), hosts.plain.port, hosts.decoy.port
    got = await exchange(
        gw,
        other,
        request(f"http://other.test:{P}{m}", f"Host: other.test:{P}", proxy_auth=True),
        request(f"http://api.test:{D}{m}", f"Host: api.test:{D}", proxy_auth=True),
        via=SOCKET,
    )
    assert [a.get("status") for a in got] == [200, 403], got
    assert hosts.plain.wait_for(lambda r: r.path == m, timeout=10).host == f"other.test:{P}"
    assert not hosts.decoy.requests


# ---- 8. garbage --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        NOISE.randbytes(8192) + b"\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + NOISE.randbytes(512),
        b"\x16\x03\x01\x01\xf8\x01\x00\x01\xf4\x03\x03" + NOISE.randbytes(500),  # a TLS hello
        connect("api.test:{P}").replace(b"\r\n\r\n", b"\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"),
        request("http://api.test:{P}/echo", *[f"X-{i}: {i}" for i in range(5000)], proxy_auth=True),
        request("http://api.test:{P}/echo", "X-Nul: a\0b", proxy_auth=True),
        b"GET http://api.test:{P}/" + b"a" * 600_000 + b" HTTP/1.1\r\n\r\n",
        b"CONNECT api.test:{P} HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET http://api.test:{P}/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\nProxy-Authorization: Basic @AUTH@\r\n\r\nzz\r\n",
    ],
    ids=["random", "h2-preface", "tls-hello", "huge-header", "5000-headers", "nul", "600kb-target",
         "negative-length", "chunked-and-length"],
)  # fmt: skip
async def test_the_proxy_survives_garbage_on_the_socket(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts, garbage: bytes
) -> None:
    """Bytes no client sends, straight to the session's socket: whatever the proxy
    answers, it is not a 5xx of its own, the proxy process is the same one, and an
    allowed request right after works."""
    pid = proxy_pid(proxied)
    got = await exchange(
        gw, session, garbage.replace(b"{P}", str(hosts.plain.port).encode()), via=SOCKET
    )
    status = got[0].get("status", 0)
    server = got[0].get("headers", {}).get("server", "")
    assert not (status >= 500 and "mitmproxy" in server), got
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, session, hosts)
    assert not hosts.decoy.requests


@pytest.mark.parametrize(
    ("before", "start"),
    [
        ("", "GET http://api.test/ HTTP/1.1"),
        ("", "CONNECT api.test:{P} HTTP/1.1"),
        ("api.test:{P}", "GET / HTTP/1.1\r\nHost: api.test:{P}"),
    ],
    ids=["plain", "connect", "inside-a-tunnel"],
)
async def test_a_request_head_that_never_ends_is_bounded(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts, before: str, start: str
) -> None:
    """96 MB of header lines and never the blank line, straight to the session's socket (a
    plain request's head, a CONNECT's, or a head inside an allowed tunnel): the proxy
    answers 431 and closes after 64 KiB, its resident memory grows by less than 8 MB, and
    it serves the session afterwards."""
    names = {"P": hosts.plain.port}
    tunnel = connect(before.format(**names)).decode() if before else ""
    head = start.format(**names) + (
        "\r\n" if before else "\r\nProxy-Authorization: Basic @AUTH@\r\n"
    )
    pid = proxy_pid(proxied)
    rss = resident(pid)
    code = f"""
import base64, json, os, select, socket, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()).decode()
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect({SOCKET!r})
if {tunnel!r}:
    s.sendall({tunnel!r}.replace("@AUTH@", auth).encode())
    assert s.recv(65536).startswith(b"HTTP/1.1 200"), "no tunnel"
s.sendall({head!r}.replace("@AUTH@", auth).encode())
chunk = (b"X-Filler: " + b"a" * 1000 + b"\\r\\n") * 64
sent, out, answer = 0, "sent", b""
try:  # as curl does: stop sending once an answer is there
    while sent < 96 << 20 and not select.select([s], [], [], 0)[0]:
        s.sendall(chunk)
        sent += len(chunk)
except OSError as e:
    out = type(e).__name__
try:
    while data := s.recv(65536):
        answer += data
except OSError:
    pass
s.close()
print(json.dumps([out, sent, answer[:200].decode("latin-1")]))
"""
    outcome, sent, answer = await kernel_json(gw, session, code)
    grown = resident(pid) - rss
    assert grown < 8 << 20, f"{outcome} after {sent >> 20} MB: the proxy grew {grown >> 20} MB"
    assert sent < 16 << 20, (outcome, sent, answer)
    assert answer.startswith("HTTP/1.1 431 "), (outcome, sent, answer)
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, session, hosts)


async def test_a_client_hello_that_claims_16_mb_is_refused_unbuffered(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts
) -> None:
    """CONNECT api.test, then a TLS handshake record saying its ClientHello is 16 MB, and
    the 16 MB in records: the proxy stops reading long before the end (it would buffer it
    all and parse it again on each read, 40 s of its one thread and 62 MB), grows by less
    than 8 MB, and serves the session afterwards."""
    pid = proxy_pid(proxied)
    rss = resident(pid)
    code = f"""
import base64, json, os, socket, struct, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()).decode()
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect({SOCKET!r})
s.sendall({connect(f"api.test:{hosts.https.port}").decode()!r}.replace("@AUTH@", auth).encode())
assert s.recv(65536).startswith(b"HTTP/1.1 200"), "no tunnel"
size = (16 << 20) - 8
hello = b"\\x01" + size.to_bytes(3, "big") + b"\\x03\\x03" + bytes(size - 2)
sent, out = 0, "sent"
try:
    for i in range(0, len(hello), 16000):
        part = hello[i : i + 16000]
        s.sendall(b"\\x16\\x03\\x01" + struct.pack("!H", len(part)) + part)
        sent += len(part)
except OSError as e:
    out = type(e).__name__
s.close()
print(json.dumps([out, sent]))
"""
    outcome, sent = await kernel_json(gw, session, code)
    grown = resident(pid) - rss
    assert sent < 4 << 20, (outcome, sent)
    assert grown < 8 << 20, f"{outcome} after {sent >> 20} MB: the proxy grew {grown >> 20} MB"
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, session, hosts)
