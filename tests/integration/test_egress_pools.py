"""Egress by name for sessions claimed from a local KernelSessionPool (issue 28): the
claimed session's way out is its own, as a cold session's is (its socket in its run
directory, its credential, its CA, its values read from Secrets when it is claimed),
and a pool's kernel before its claim has no way out at all.

Fixtures and helpers are test_egress.py's: the real egress proxy resolving test names
to stand-ins on this machine's own address.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from test_egress import Hosts, _connect_through, fetch, gw, hosts, proxied

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.egress import protocol
from mcp_forge.egress.client import default_python
from mcp_forge.errors import SecretError, SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.egress import proxy_name
from mcp_forge.runtimes.local.runtime import LocalRuntime

__all__ = ["gw", "hosts", "proxied"]  # fixtures, used by name

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
    pytest.mark.usefixtures("proxied"),
]

SECRET = "egress-pool-api"
FILLED = f"fill-{secrets.token_hex(16)}"  # the Secret's value while the pool fills
CLAIMED = f"claim-{secrets.token_hex(16)}"  # its value when the session is claimed


def allow(hosts: Hosts) -> list[dict[str, Any]]:
    own, port = [f"{hosts.address}/32"], hosts.https.port
    ref = {"secretKeyRef": {"name": SECRET, "key": "token"}}
    return [
        {"host": "api.test", "ports": [port], "addresses": own},
        {"host": "files.test", "ports": [port], "addresses": own,
         "inject": [{"header": "Authorization", "prefix": "Bearer ", **ref}]},
    ]  # fmt: skip


def _socket(runtime: LocalRuntime, session: KernelSession) -> Path:
    return Path(runtime.host_paths(session).run) / protocol.SOCKET_NAME


@pytest.fixture(scope="module")
async def pool(
    proxied: LocalRuntime, hosts: Hosts, images: dict[str, str]
) -> AsyncIterator[tuple[str, KernelSession]]:
    """A pool of one kernel whose template allows api.test and files.test (a value added
    from the Secret); its name and its kernel."""
    name = f"p{uuid.uuid4().hex[:8]}"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}}
    proxied.secrets.apply({**secret, "stringData": {"token": FILLED}})
    template = {
        "image": images["minimal"],
        "resources": {"memory": "512Mi"},
        "network": {"allow": allow(hosts)},
    }
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {"size": 1, "template": template},
    }
    await proxied.pools.apply(body)
    [member] = proxied.pools.members(proxied.pools.get(name))
    yield name, member
    with contextlib.suppress(SessionNotFound):
        await proxied.pools.delete(name)
    proxied.secrets.delete(SECRET)


@pytest.fixture(scope="module")
async def claimed(
    proxied: LocalRuntime,
    pool: tuple[str, KernelSession],
    hosts: Hosts,
    images: dict[str, str],
) -> AsyncIterator[KernelSession]:
    """A session claimed from the pool with its allow-list, after the Secret changed."""
    name = f"c-{uuid.uuid4().hex[:10]}"
    proxied.secrets.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET},
            "stringData": {"token": CLAIMED},
        }
    )
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": images["minimal"],
            "resources": {"memory": "512Mi"},
            "poolRef": {"name": pool[0]},
            "network": {"allow": allow(hosts)},
            "files": [{"path": "ca.pem", "content": hosts.ca.ca_path.read_text()}],
        },
    }
    session = (await proxied.apply(body)).session
    yield session
    with contextlib.suppress(SessionNotFound):
        await proxied.delete(name)


def test_a_pool_kernel_has_no_way_out_before_its_claim(
    proxied: LocalRuntime, pool: tuple[str, KernelSession]
) -> None:
    """No socket in its run directory, nothing in the proxy: its values are not read
    until a session claims it, and code never runs in it before then."""
    _, member = pool
    assert not _socket(proxied, member).exists()
    assert proxy_name(member) not in proxied.egress.sessions


async def test_a_claimed_session_reaches_an_allowed_name_through_its_own_socket(
    proxied: LocalRuntime,
    pool: tuple[str, KernelSession],
    claimed: KernelSession,
    gw: Gateway,
    hosts: Hosts,
) -> None:
    _, member = pool
    served = set(proxied.egress.sessions)  # by the claim itself, before any gateway came
    warm = [c for c in claimed.status["conditions"] if c["type"] == ksp.WARM_START]
    assert warm[0]["status"] == "True", warm  # the pool's kernel, not a cold start
    assert claimed.uid == member.uid
    got = await fetch(gw, claimed.name, hosts.https.url("api.test", "/bytes/700"))
    assert got == {"status": 200, "length": 700}
    got = await fetch(gw, claimed.name, hosts.https.url("other.test", "/echo"))
    assert "403" in got.get("error", "") and "no rule allows other.test" in got["error"], got
    # Served under the session's name, through the socket in its run directory.
    assert served == set(proxied.egress.sessions) == {proxy_name(claimed)}
    assert _socket(proxied, claimed).is_socket()


async def test_a_claimed_sessions_credential_and_values_are_its_own(
    proxied: LocalRuntime, claimed: KernelSession, gw: Gateway, hosts: Hosts
) -> None:
    """Its credential (from its key) speaks through its socket, another's does not; the
    value added is the Secret's when the session was claimed, through the session's CA."""
    token = protocol.token_for(proxied.store.key(claimed.namespace, claimed.name))
    path, port = _socket(proxied, claimed), hosts.https.port
    assert b"200" in _connect_through(path, token, "api.test", port)
    assert b"407" in _connect_through(path, protocol.token_for("another key"), "api.test", port)
    url = hosts.https.url("files.test", f"/bytes/9?c={claimed.name}")
    code = f"""
import json, os, ssl, urllib.request
with urllib.request.urlopen({url!r}, context=ssl.create_default_context(), timeout=20) as r:
    print(json.dumps([r.status, len(r.read()), os.environ.get("SSL_CERT_FILE")]))
"""
    r = await gw.execute(claimed.name, code)
    assert r.status == "ok", (r.error, r.stderr)
    status, length, bundle = json.loads(r.stdout)
    assert (status, length) == (200, 9) and bundle
    seen = hosts.https.wait_for(lambda q: q.path.endswith(f"c={claimed.name}"), timeout=10)
    assert dict(seen.headers)["Authorization"] == f"Bearer {CLAIMED}"


async def test_deleting_a_claimed_session_closes_its_egress(
    proxied: LocalRuntime, claimed: KernelSession
) -> None:
    path = _socket(proxied, claimed)
    await proxied.delete(claimed.name)
    assert proxy_name(claimed) not in proxied.egress.sessions
    assert not path.exists()
    assert not proxied.egress.sessions  # nothing of the pool's kernel left either


async def test_a_claim_whose_value_is_missing_fails_as_a_cold_start_and_leaves_the_pool(
    proxied: LocalRuntime, pool: tuple[str, KernelSession], hosts: Hosts, images: dict[str, str]
) -> None:
    """With its Secret gone the claim is not taken: the cold start fails before its pod,
    naming the field, and the pool's kernel stays unclaimed, with no way out."""
    name = pool[0]
    await proxied.pools.fill(proxied.pools.get(name))  # its kernel was claimed: a new one
    [member] = proxied.pools.members(proxied.pools.get(name))
    session = f"c-{uuid.uuid4().hex[:10]}"
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": session},
        "spec": {"image": images["minimal"], "resources": {"memory": "512Mi"},
                 "poolRef": {"name": name}, "network": {"allow": allow(hosts)}},
    }  # fmt: skip
    proxied.secrets.delete(SECRET)
    try:
        with pytest.raises(SecretError, match=r"spec\.network\.allow\[1\]\.inject\[0\]"):
            await proxied.apply(body)
        failed = await proxied.get(session)
        assert failed.status["phase"] == st.FAILED and failed.uid != member.uid
        assert [m.name for m in proxied.pools.members(proxied.pools.get(name))] == [member.name]
        assert not _socket(proxied, member).exists() and not proxied.egress.sessions
    finally:
        with contextlib.suppress(SessionNotFound):
            await proxied.delete(session)
        proxied.secrets.apply(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET},
             "stringData": {"token": CLAIMED}}
        )  # fmt: skip
