"""Egress by name (issue 28), the attacks that try to wear the proxy down: more
connections than a session's bound, garbage on the socket, a request head that never ends,
a ClientHello that claims 16 MB; an allowed host whose answer's head never ends; what a
kernel sends while its answer waits, or while its host's handshake hangs. The setup
(sessions A and R, the stand-ins, the proxy with its bound lowered to CONNECTIONS_MAX) is
egress_support.py's. The proxy's memory is its resident set, read from /proc.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import pytest

from egress_standins import Mute
from mcp_forge.egress import audit
from mcp_forge.egress.client import default_python
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

from .egress_support import (
    CONNECTIONS_MAX,
    SOCKET,
    Hosts,
    allowed_still_works,
    connect,
    exchange,
    gw,
    hosts,
    kernel_json,
    marker,
    mute,
    proxied,
    proxy_pid,
    reading,
    request,
    resident,
    seen,
    session,
)

__all__ = ["gw", "hosts", "mute", "proxied", "reading", "session"]  # fixtures, used by name

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

NOISE = random.Random(28)  # garbage, the same in every run


# ---- 1. the session's connections are bounded --------------------------------------------

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
    # Let go: the proxy sees each end (through the relay) and counts it down; each end is
    # a record of the proxy's, waited for here.
    r = await gw.execute(session, "_egress_release()")
    assert r.status == "ok", (r.error, r.stderr)

    async def still_open() -> int:
        return int((await proxied.egress.stats())[f"default/{session}"]["open"])

    async with asyncio.timeout(10):
        while await still_open():
            waiter = audit.next_record()
            if await still_open():
                await waiter
    code = f"import json; print(json.dumps(_egress_hold({CONNECTIONS_MAX}, {authority!r})))"
    assert await kernel_json(gw, session, code) == [ok] * CONNECTIONS_MAX
    await gw.execute(session, "_egress_release()")
    await allowed_still_works(gw, session, hosts)


# ---- 2. garbage --------------------------------------------------------------------------


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


# ---- 3. what a server never ends, what a kernel sends while its answer waits -------------

WAITING = r'''
def _egress_open(authority=None, timeout=10.0):
    """A connection to the proxy through the relay; given an authority, a tunnel to it and
    TLS inside (the session's CA is the kernel's: SSL_CERT_FILE)."""
    import os, socket, ssl, urllib.parse
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    s = socket.create_connection((proxy.hostname, proxy.port), timeout=timeout)
    if authority is None:
        return s
    s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
              f"Proxy-Authorization: Basic {_egress_auth()}\r\n\r\n".encode())
    answer, _ = _egress_answer(s, b"")
    assert answer.get("status") == 200, answer
    host = authority.rsplit(":", 1)[0]
    return ssl.create_default_context().wrap_socket(s, server_hostname=host)

def _egress_auth():
    import base64, os, urllib.parse
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    return base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()

def _egress_send(s, total, fill=b"\0", stall=0.5):
    """`total` bytes of `fill`, sent in 64 KiB parts, until one waits `stall` seconds (the
    proxy has stopped reading) or fails: [how it ended, bytes sent]."""
    import socket
    s.settimeout(stall)
    part, sent = fill * 65536, 0
    try:
        while sent < total:
            sent += s.send(part[: total - sent])
    except socket.timeout:
        return ["stalled", sent]
    except OSError as e:
        return [type(e).__name__, sent]
    return ["sent", sent]

def _egress_first_line(s, limit=1 << 20):
    """The answer's first line, how many bytes came (at most limit), and how they ended:
    "closed", or what the reading raised."""
    data, ended = b"", "closed"
    try:
        while len(data) < limit and (chunk := s.recv(65536)):
            data += chunk
    except OSError as e:
        ended = type(e).__name__
    return [data.split(b"\r\n", 1)[0].decode("latin-1"), len(data), ended]
'''


@pytest.mark.parametrize(
    ("who", "tls", "path"),
    [
        ("session", False, "/endless-head"),
        ("reading", True, "/endless-head"),
        ("session", False, "/endless-chunk"),
    ],
    ids=["plain", "https-read", "chunk-size-line"],
)
async def test_a_server_whose_head_never_ends_is_cut_off_at_64_kib(
    proxied: LocalRuntime,
    gw: Gateway,
    session: str,
    reading: str,
    hosts: Hosts,
    who: str,
    tls: bool,
    path: str,
) -> None:
    """An allowed host answers with header lines that never end (96 MB of them), or with a
    chunk's size line that never ends, over plain HTTP or over TLS the proxy reads: the
    proxy closes that connection after 64 KiB (the host's writes fail a few MB later, the
    socket buffers), the kernel gets a 502 whose reason names the bound, and the proxy
    grows by less than 8 MB (it kept all 96 MB, and more, before) and serves on."""
    session = {"session": session, "reading": reading}[who]
    standin = hosts.https if tls else hosts.plain
    path = f"{path}/{uuid.uuid4().hex[:12]}"
    authority = f"api.test:{standin.port}"
    target, auth = (path, "") if tls else (f"http://{authority}{path}", "Proxy-Authorization")
    pid = proxy_pid(proxied)
    rss = resident(pid)
    r = await gw.execute(session, WAITING)
    assert r.status == "ok", (r.error, r.stderr)
    code = f"""
import json
s = _egress_open({authority!r} if {tls} else None)
auth = f"{auth}: Basic {{_egress_auth()}}\\r\\n" if {auth!r} else ""
s.sendall(f"GET {target} HTTP/1.1\\r\\nHost: {authority}\\r\\n{{auth}}\\r\\n".encode())
print(json.dumps(_egress_first_line(s)))
s.close()
"""
    line, length, _ = await kernel_json(gw, session, code)
    sent = await asyncio.to_thread(standin.wait_cut, path, 20)
    grown = resident(pid) - rss
    said = f"the host sent {sent >> 20} MB before the proxy closed, the proxy grew {grown >> 20} MB"
    assert sent < 16 << 20 and grown < 8 << 20, said
    assert line.startswith("HTTP/1.1 502 Bad Gateway: ") and "65536 bytes" in line, line
    assert length < 4096, length
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, session, hosts)


async def test_what_a_kernel_pipelines_while_its_answer_waits_is_held_then_sent(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts
) -> None:
    """The kernel sends a GET the host answers only later, and on the same connection a
    POST of 48 MB: the proxy stops reading the kernel (its sending stalls) instead of
    keeping what it cannot send yet (before, it kept all it was sent), growing by less
    than 8 MB; once the first answer comes it reads on, and the host gets the whole POST.
    The kernel asks for that answer (the host's cue) once its sending has stalled: no
    event says that but the stall itself, half a second without progress."""
    key, size, port = uuid.uuid4().hex[:12], 48 << 20, hosts.plain.port
    authority = f"api.test:{port}"
    pid = proxy_pid(proxied)
    rss = resident(pid)
    r = await gw.execute(session, WAITING)
    assert r.status == "ok", (r.error, r.stderr)
    code = f"""
import json
auth = f"Proxy-Authorization: Basic {{_egress_auth()}}\\r\\n"
s = _egress_open()
s.sendall((f"GET http://{authority}/after/{key} HTTP/1.1\\r\\nHost: {authority}\\r\\n{{auth}}\\r\\n"
           f"POST http://{authority}/echo/piped HTTP/1.1\\r\\nHost: {authority}\\r\\n{{auth}}"
           f"Content-Length: {size}\\r\\n\\r\\n").encode())
held = _egress_send(s, {size})
release = _egress_open()
release.sendall(f"GET http://{authority}/echo/release/{key} HTTP/1.1\\r\\nHost: {authority}\\r\\n"
                f"{{auth}}Connection: close\\r\\n\\r\\n".encode())
released = _egress_answer(release, b"")[0].get("status")
release.close()
s.settimeout(30)
s.sendall(bytes({size} - held[1]))
first, rest = _egress_answer(s, b"")
second, _ = _egress_answer(s, rest)
s.close()
print(json.dumps([held, released, first.get("status"), second.get("body", "")]))
"""
    running = asyncio.create_task(kernel_json(gw, session, code))
    await asyncio.to_thread(
        hosts.plain.wait_for, lambda r: r.path == f"/echo/release/{key}", 20
    )  # the kernel stalled (or sent it all) and asks for the answer: what is held now
    grown = resident(pid) - rss
    held, released, first, second = await running
    assert held[0] == "stalled" and held[1] < size, held
    assert grown < 8 << 20, f"{held}: the proxy grew {grown >> 20} MB"
    assert released == 200 and first == 200, (released, first)
    assert json.loads(second)["body_length"] == size, second[:300]
    assert proxy_pid(proxied) == pid


async def test_a_body_sent_while_the_hosts_handshake_hangs_is_held_unread(
    proxied: LocalRuntime, gw: Gateway, reading: str, hosts: Hosts, mute: Mute
) -> None:
    """Session R (its HTTPS read by the proxy) POSTs 96 MB to a host that accepts the
    connection and never answers TLS: while the proxy waits for that handshake it stops
    reading the kernel, whose sending stalls (it kept the body, all of it, before), and
    grows by less than 8 MB."""
    size, authority = 96 << 20, f"api.test:{mute.port}"
    pid = proxy_pid(proxied)
    rss = resident(pid)
    r = await gw.execute(reading, WAITING)
    assert r.status == "ok", (r.error, r.stderr)
    accepted = len(mute.accepted)
    code = f"""
import json
s = _egress_open({authority!r})
s.sendall(b"POST /upload HTTP/1.1\\r\\nHost: {authority}\\r\\nContent-Length: {size}\\r\\n\\r\\n")
print(json.dumps(_egress_send(s, {size})))
s.close()
"""
    outcome, sent = await kernel_json(gw, reading, code)
    grown = resident(pid) - rss
    assert outcome == "stalled" and sent < size, (outcome, sent)
    assert grown < 8 << 20, f"{outcome} after {sent >> 20} MB: the proxy grew {grown >> 20} MB"
    assert len(mute.accepted) > accepted  # the proxy did dial it, and waited
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, reading, hosts)


async def test_a_chunk_size_line_that_never_ends_closes_the_kernels_connection(
    proxied: LocalRuntime, gw: Gateway, session: str, hosts: Hosts
) -> None:
    """A POST whose chunked body starts with a size line of 96 MB of hex digits: the
    proxy closes the connection, unanswered, after 64 KiB (as h11 does with a malformed
    chunk; the pod's relay reads and drops the rest), grows by less than 8 MB (it kept the
    line, all of it, before), and serves on; the host never hears of it."""
    authority = f"api.test:{hosts.plain.port}"
    path = marker()
    pid = proxy_pid(proxied)
    rss = resident(pid)
    r = await gw.execute(session, WAITING)
    assert r.status == "ok", (r.error, r.stderr)
    code = f"""
import json
s = _egress_open()
s.sendall(f"POST http://{authority}{path} HTTP/1.1\\r\\nHost: {authority}\\r\\n"
          f"Proxy-Authorization: Basic {{_egress_auth()}}\\r\\n"
          "Transfer-Encoding: chunked\\r\\n\\r\\n".encode())
print(json.dumps(_egress_send(s, 96 << 20, fill=b"f") + _egress_first_line(s)))
s.close()
"""
    outcome, sent, line, length, ended = await kernel_json(gw, session, code)
    grown = resident(pid) - rss
    assert grown < 8 << 20, f"{outcome} after {sent >> 20} MB: the proxy grew {grown >> 20} MB"
    assert (line, length, ended) == ("", 0, "closed"), (outcome, sent, line, ended)
    assert proxy_pid(proxied) == pid
    await allowed_still_works(gw, session, hosts)
    assert not seen(hosts.plain, path)
