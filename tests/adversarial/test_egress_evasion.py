"""Egress by name (issue 28), the attacks that try to get past the rules: requests
smuggled inside allowed tunnels and past the check, the proxy's credential at the server,
another session's credential and socket, ports and names in odd forms, the relay killed.
The setup (sessions A and B, the stand-ins, the proxy) is egress_support.py's.
"""

from __future__ import annotations

import base64

import pytest

from mcp_forge.egress import protocol
from mcp_forge.egress.client import default_python
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

from .egress_support import (
    IDN,
    SOCKET,
    Hosts,
    allowed_still_works,
    connect,
    exchange,
    gw,
    hosts,
    kernel_json,
    marker,
    other,
    proxied,
    request,
    seen,
    session,
)

__all__ = ["gw", "hosts", "other", "proxied", "session"]  # fixtures, used by name

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]


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


# ---- 6. the relay is not a boundary ------------------------------------------------------


async def test_killing_the_relay_gains_the_kernel_nothing(
    gw: Gateway, other: str, hosts: Hosts
) -> None:
    """The relay in the pod is the kernel's own process, not a boundary: B's kernel kills
    it and has no way out more than before (only `lo`, no route to the host), and less
    (the proxy port is closed); the socket it dials by hand is the same proxy, the same
    rules and the same 403s."""
    code = f"""
import errno, json, os, select, signal, socket
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
ends = [os.pidfd_open(pid) for pid in killed]  # readable once the process has exited
for pid in killed:
    os.kill(pid, signal.SIGKILL)
for fd in ends:
    select.select([fd], [], [], 10)
    os.close(fd)
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
