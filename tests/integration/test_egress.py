"""Egress by name in local mode (issue 28): real kernels in real Podman pods, the real egress
proxy (mitmproxy, confined), and stand-ins for internet hosts on this machine's own
address (tests/egress_standins.py) that the proxy's resolver maps test names to.

One session holds the allow-list; its kernel reaches the names allowed, through
HTTPS_PROXY alone, and every other way out is refused: with a 403 naming the rule or the
check when it asked the proxy, and with no route at all when it did not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import secrets
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from egress_index import Hosts, hosts_standing
from egress_kernel import holding_search
from mcp_forge.api import status as st
from mcp_forge.egress import audit, protocol
from mcp_forge.egress.client import EgressProxy, default_python
from mcp_forge.errors import InvalidSession, SecretError, SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.sessions import Client, SessionRequest, SessionService
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

PACKAGE = "forge-egress-probe"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with hosts_standing(tmp_path_factory.mktemp("egress-ca"), PACKAGE) as standing:
        yield standing


@pytest.fixture(scope="module")
async def proxied(
    runtime: LocalRuntime, hosts: Hosts, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRuntime]:
    """The session-wide runtime, its egress proxy resolving the test names (for this
    module only)."""
    table = tmp_path_factory.mktemp("egress-resolve") / "resolve.json"
    names = {
        name: [hosts.address]
        for name in ("api.test", "other.test", "private.test", "pypi.test", "files.test")
    }
    names["a.wild.test"] = [hosts.address]
    table.write_text(
        json.dumps({**names, "loop.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"]})
    )
    table.chmod(0o644)
    table.parent.chmod(0o755)
    settings = dataclasses.replace(
        runtime.settings, egress_resolve=str(table), egress_upstream_ca=str(hosts.ca.ca_path)
    )
    before = runtime.egress
    runtime.egress = EgressProxy(settings)
    yield runtime
    await runtime.egress.stop()
    runtime.egress = before


SECRET = "egress-api"
VALUE = f"inj-{secrets.token_hex(16)}"  # in the store's Secret; never sent to a kernel


def allow(hosts: Hosts) -> list[dict[str, Any]]:
    own = [f"{hosts.address}/32"]
    port, index = hosts.https.port, hosts.index.port
    ref = {"secretKeyRef": {"name": SECRET, "key": "token"}}
    inject = [{"header": "Authorization", "prefix": "Bearer ", **ref}, {"query": "key", **ref}]
    return [
        {"host": "files.test", "ports": [port], "addresses": own, "inject": inject},
        {"host": "*.wild.test", "ports": [port], "addresses": own, "paths": ["/echo"]},
        {"host": "api.test", "ports": [port], "addresses": own},
        {"host": "pypi.test", "ports": [index], "addresses": own},
        {"host": "private.test", "ports": [port]},  # its address is not public
        {"host": "loop.test", "ports": [port]},
        {"host": "meta.test", "ports": [port]},
    ]


@pytest.fixture(scope="module")
async def session(
    proxied: LocalRuntime, hosts: Hosts, images: dict[str, str]
) -> AsyncIterator[str]:
    name = f"egress-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": images["minimal"],
            "resources": {"memory": "512Mi"},
            "network": {"allow": allow(hosts)},
            "files": [{"path": "ca.pem", "content": hosts.ca.ca_path.read_text()}],
        },
    }
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}}
    proxied.secrets.apply({**secret, "stringData": {"token": VALUE}})
    await proxied.apply(body)
    yield name
    with contextlib.suppress(SessionNotFound):
        await proxied.delete(name)
    proxied.secrets.delete(SECRET)


@pytest.fixture(scope="module")
async def gw(proxied: LocalRuntime) -> AsyncIterator[Gateway]:
    gateway = Gateway(proxied, proxied.settings)
    yield gateway
    await gateway.close()


async def fetch(gw: Gateway, session: str, url: str) -> dict[str, Any]:
    """GET `url` in the kernel with urllib (proxies from its environment, the test CA)."""
    code = f"""
import json, ssl, urllib.request, urllib.error
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
try:
    with urllib.request.urlopen({url!r}, context=ctx, timeout=20) as r:
        out = {{"status": r.status, "length": len(r.read())}}
except urllib.error.HTTPError as e:
    out = {{"status": e.code, "reason": e.reason, "body": e.read().decode()[:500]}}
except (urllib.error.URLError, OSError) as e:
    out = {{"error": str(getattr(e, "reason", e))[:500]}}
print(json.dumps(out))
"""
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    return dict(json.loads(r.stdout))


async def test_an_allowed_name_is_reached_through_the_proxy(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    got = await fetch(gw, session, hosts.https.url("api.test", "/bytes/1000"))
    assert got == {"status": 200, "length": 1000}
    seen = hosts.https.wait_for(lambda r: r.path == "/bytes/1000", timeout=10)
    assert seen.server_name == "api.test"
    assert not any(k.lower().startswith("proxy-") for k, _ in seen.headers)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("other.test", "no rule allows other.test"),
        ("private.test", "not a public address"),
        ("loop.test", "127.0.0.1"),
        ("meta.test", "169.254.169.254"),
    ],
)
async def test_a_refusal_is_a_403_naming_why(
    gw: Gateway, session: str, hosts: Hosts, name: str, why: str
) -> None:
    got = await fetch(gw, session, hosts.https.url(name, "/echo"))
    assert "403" in got.get("error", ""), got
    assert why in got["error"], got


async def test_an_ip_literal_is_refused(gw: Gateway, session: str, hosts: Hosts) -> None:
    got = await fetch(gw, session, f"https://{hosts.address}:{hosts.https.port}/echo")
    assert "403" in got.get("error", "") and "IP address" in got["error"], got
    got = await fetch(gw, session, f"http://{hosts.address}:{hosts.https.port}/echo")
    assert got.get("status") == 403 and "IP address" in got["body"], got


async def test_a_tls_server_name_other_than_the_connect_host_is_refused(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    port = hosts.https.port
    code = f"""
import base64, os, socket, ssl, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()).decode()
s = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
s.sendall(f"CONNECT api.test:{port} HTTP/1.1\\r\\nHost: api.test:{port}\\r\\n"
          f"Proxy-Authorization: Basic {{auth}}\\r\\n\\r\\n".encode())
print(s.recv(4096).split(b"\\r\\n")[0].decode())
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
try:
    ctx.wrap_socket(s, server_hostname="other.test")
    print("handshake done")
except (ssl.SSLError, OSError) as e:
    print("refused", type(e).__name__)
"""
    before = len(hosts.https.requests)
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    first, outcome = r.stdout.strip().splitlines()
    assert first.endswith("200 Connection established")
    assert outcome.startswith("refused"), r.stdout
    assert len(hosts.https.requests) == before


async def test_no_way_out_but_the_proxy(gw: Gateway, session: str, hosts: Hosts) -> None:
    """The pod has only lo; a direct connection to the stand-in has no route."""
    code = f"""
import socket
print(sorted(n for _, n in socket.if_nameindex()))
try:
    socket.create_connection(({hosts.address!r}, {hosts.https.port}), timeout=5)
    print("connected")
except OSError as e:
    print("no route", e.errno)
"""
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    interfaces, outcome = r.stdout.strip().splitlines()
    assert interfaces == "['lo']"
    assert outcome.startswith("no route"), outcome


async def test_pip_installs_from_an_allowed_index(gw: Gateway, session: str, hosts: Hosts) -> None:
    url = f"https://pypi.test:{hosts.index.port}/simple/"
    code = f"""
import os, subprocess, sys
# The stand-in's certificate is the test CA's, which the image does not trust: pip is told
# so (the session's own bundle, for the hosts the proxy reads, would win over --cert).
env = {{k: v for k, v in os.environ.items() if not k.endswith(("_CA_BUNDLE", "PIP_CERT"))}}
done = subprocess.run(
    [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
     "--index-url", {url!r}, "--cert", "/workspace/ca.pem", "--target", "/workspace/lib",
     {PACKAGE!r}],
    capture_output=True, text=True, timeout=120, env=env)
print(done.returncode)
print(done.stdout[-1500:], done.stderr[-1500:])
"""
    r = await gw.execute(session, code, timeout=180)
    assert r.status == "ok", (r.error, r.stderr)
    assert r.stdout.startswith("0\n"), r.stdout
    wheel = hosts.index.wheels[PACKAGE]
    r = await gw.execute(
        session,
        f"import sys; sys.path.insert(0, '/workspace/lib'); import {wheel.module} as m; "
        "print(m.VALUE)",
    )
    assert r.stdout.strip() == wheel.value, (r.stdout, r.error)


async def _socket_of(runtime: LocalRuntime, name: str) -> Path:
    session = await runtime.get(name)
    return Path(runtime.host_paths(session).run) / protocol.SOCKET_NAME


def _connect_through(path: Path, token: str, host: str, port: int) -> bytes:
    auth = base64.b64encode(f"{protocol.PROXY_USER}:{token}".encode()).decode()
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(
            f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
        )
        return s.recv(4096).split(b"\r\n")[0]


async def test_a_credential_speaks_only_through_its_own_sessions_socket(
    proxied: LocalRuntime, session: str, hosts: Hosts, images: dict[str, str]
) -> None:
    """Session B's credential, sent through A's socket, is no one's: a 407."""
    other = f"egress-{uuid.uuid4().hex[:8]}"
    rules = [
        {"host": "other.test", "ports": [hosts.https.port], "addresses": [f"{hosts.address}/32"]}
    ]
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": other},
        "spec": {"image": images["minimal"], "resources": {"memory": "512Mi"},
                 "network": {"allow": rules}},
    }  # fmt: skip
    await proxied.apply(body)
    try:
        token_a = protocol.token_for(proxied.store.key("default", session))
        token_b = protocol.token_for(proxied.store.key("default", other))
        port = hosts.https.port
        a, b = await _socket_of(proxied, session), await _socket_of(proxied, other)
        assert b"200" in _connect_through(b, token_b, "other.test", port)
        assert b"407" in _connect_through(a, token_b, "other.test", port)
        # And A's own rules never serve B: other.test is B's, not A's.
        assert b"403" in _connect_through(a, token_a, "other.test", port)
    finally:
        await proxied.delete(other)
    assert f"default/{other}" not in proxied.egress.sessions
    assert not b.exists()


def test_the_proxy_runs_unprivileged(gw: Gateway, session: str) -> None:
    """The proxy (root's gateway's child) runs as nobody, with no capabilities."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            cmdline = (status.parent / "cmdline").read_bytes()
            text = status.read_text()
        except OSError:
            continue
        if b"mcp_forge.egress.server" in cmdline and b"bwrap" not in cmdline:
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if "python" in fields["Name"]:
                found.append((fields["Uid"].split(), fields["CapEff"].strip()))
    assert found, "no egress proxy process"
    for uids, caps in found:
        assert set(uids) == {"65534"}, uids
        assert int(caps, 16) == 0, caps


async def test_a_secret_is_added_on_the_way_out_and_the_kernel_never_holds_it(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    """files.test gets Authorization and ?key= from the Secret, replacing the kernel's
    forgery; the kernel trusts the session's CA through SSL_CERT_FILE alone, and its
    environment, files and memory hold no value."""
    url = hosts.https.url("files.test", "/bytes/16?key=forged&x=1")
    code = f"""
import json, os, ssl, urllib.request
request = urllib.request.Request({url!r}, headers={{"Authorization": "Bearer forged"}})
with urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=20) as r:
    print(json.dumps([r.status, len(r.read()), os.environ.get("SSL_CERT_FILE")]))
"""
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    status, length, bundle = json.loads(r.stdout)
    assert (status, length) == (200, 16) and bundle
    seen = hosts.https.wait_for(lambda q: q.path.startswith("/bytes/16"), timeout=10)
    assert dict(seen.headers)["Authorization"] == f"Bearer {VALUE}"
    assert f"key={VALUE}" in seen.path and "forged" not in seen.path and "x=1" in seen.path
    assert seen.server_name == "files.test"  # re-encrypted to the host, by its name
    # The kernel knows the value's first half and its digest, never the value.
    search = holding_search(VALUE)
    r = await gw.execute(session, search, timeout=120)
    assert r.status == "ok", (r.error, r.stderr)
    assert r.stdout.strip() == "[]", r.stdout


async def test_paths_hold_over_https_where_the_proxy_reads(
    gw: Gateway, session: str, hosts: Hosts
) -> None:
    """*.wild.test allows /echo only: HTTPS to it is read (the session's CA), /bytes refused
    with a 403 the kernel reads inside TLS, naming the rule."""
    context = "ssl.create_default_context()"
    code = f"""
import json, ssl, urllib.request, urllib.error
out = []
for path in ("/echo", "/bytes/8"):
    try:
        with urllib.request.urlopen({hosts.https.url("a.wild.test", "")!r} + path,
                                    context={context}, timeout=20) as r:
            out.append([r.status, ""])
    except urllib.error.HTTPError as e:
        out.append([e.code, e.read().decode()[:300]])
print(json.dumps(out))
"""
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    (ok, _), (refused, body) = json.loads(r.stdout)
    assert ok == 200 and refused == 403, r.stdout
    assert "rule 2 (*.wild.test)" in body and "/echo" in body, body


async def test_a_value_from_a_missing_secret_fails_the_session_before_its_pod(
    proxied: LocalRuntime, hosts: Hosts, images: dict[str, str]
) -> None:
    name = f"egress-{uuid.uuid4().hex[:8]}"
    ref = {"secretKeyRef": {"name": "egress-absent", "key": "token"}}
    rule = {"host": "files.test", "ports": [hosts.https.port], "inject": [{"header": "X-K", **ref}]}
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {"image": images["minimal"], "resources": {"memory": "512Mi"},
                 "network": {"allow": [rule]}},
    }  # fmt: skip
    try:
        with pytest.raises(SecretError) as err:
            await proxied.apply(body)
        failed = await proxied.get(name)
        assert failed.status["reason"] == st.SECRET_NOT_FOUND
        for text in (str(err.value), str(failed.status["message"])):
            assert "spec.network.allow[0].inject[0]" in text and "'egress-absent'" in text
        assert failed.status["phase"] == st.FAILED
        argv = ["podman", "pod", "exists", proxied.pod_name(failed)]
        exists = await asyncio.to_thread(subprocess.run, argv, check=False)
        assert exists.returncode == 1  # no pod was played
    finally:
        with contextlib.suppress(SessionNotFound):
            await proxied.delete(name)


async def test_verdicts_reach_the_gateways_metrics(gw: Gateway, session: str, hosts: Hosts) -> None:
    def refused() -> float:
        labels = {"event": "connect", "verdict": "refused"}
        return REGISTRY.get_sample_value("mcpforge_egress_total", labels) or 0.0

    before = refused()
    got = await fetch(gw, session, hosts.https.url("other.test", "/echo"))
    assert "403" in got.get("error", ""), got
    async with asyncio.timeout(10):  # the proxy's record comes over its stderr
        while refused() < before + 1:
            waiter = audit.next_record()
            if refused() < before + 1:
                await waiter


async def test_a_client_chooses_hosts_within_what_the_gateway_offers(
    proxied: LocalRuntime, hosts: Hosts, gw: Gateway
) -> None:
    """create_session's `allow` (SessionService): within MCPFORGE_EGRESS_CLIENT_ALLOW, and
    the offered rule's address ranges go with it; more than offered is refused, naming it."""
    port = hosts.https.port
    offered = [{"host": "api.test", "ports": [port], "addresses": [f"{hosts.address}/32"]}]
    settings = dataclasses.replace(proxied.settings, egress_client_allow=json.dumps(offered))
    service = SessionService(proxied, settings)
    client = Client("egress-test")
    with pytest.raises(InvalidSession, match="not among") as refused:
        await service.create(
            client,
            SessionRequest(variant="minimal", allow=[{"host": "other.test", "ports": [port]}]),
        )
    assert refused.value.field == "allow[0].host"
    asked = [{"host": "api.test", "ports": [port]}]
    made = await service.create(client, SessionRequest(variant="minimal", allow=asked))
    try:
        code = f"""
import ssl, urllib.request
with urllib.request.urlopen({hosts.https.url("api.test", "/bytes/5")!r},
                            context=ssl._create_unverified_context(), timeout=20) as r:
    print(r.status, len(r.read()))
"""
        r = await gw.execute(made.name, code)
        assert r.status == "ok", (r.error, r.stderr)
        assert r.stdout.split() == ["200", "5"]
    finally:
        await proxied.delete(made.name)
