"""The egress proxy is supervised (issue 28): when its process dies, the gateway starts it
again at once with every open session, waiting longer each time while it keeps dying, and
not at all once stopped. A real kernel in a real Podman pod, the real proxy (mitmproxy,
confined), a stand-in for api.test on this machine's own address (tests/egress_standins.py).

The proxy is killed as a crash would kill it: its Python process (found in /proc by its
command line), not the bwrap or prlimit wrappers the gateway started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_standins import StandIn, TestCA, own_address
from mcp_forge.egress.client import EgressProxy, default_python
from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

DEADLINE = 20.0  # for the proxy to be back, and for a request through it


@pytest.fixture(scope="module")
def https(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    address = own_address()
    ca = TestCA(tmp_path_factory.mktemp("egress-ca"), addresses=(address,))
    with StandIn(address, ca) as standin:
        yield standin


@pytest.fixture(scope="module")
async def proxy(
    runtime: LocalRuntime, https: StandIn, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EgressProxy]:
    """This module's own egress proxy (its resolver table names it in /proc)."""
    table = tmp_path_factory.mktemp("egress-resolve") / "resolve.json"
    table.write_text(json.dumps({"api.test": [https.address]}))
    table.chmod(0o644)
    table.parent.chmod(0o755)
    assert https.ca is not None
    settings = dataclasses.replace(
        runtime.settings, egress_resolve=str(table), egress_upstream_ca=str(https.ca.ca_path)
    )
    before = runtime.egress
    runtime.egress = EgressProxy(settings)
    yield runtime.egress
    await runtime.egress.stop()
    runtime.egress = before


@pytest.fixture(scope="module")
async def gw(runtime: LocalRuntime, proxy: EgressProxy) -> AsyncIterator[Gateway]:
    gateway = Gateway(runtime, runtime.settings)
    yield gateway
    await gateway.close()


@pytest.fixture(scope="module")
async def session(
    runtime: LocalRuntime, proxy: EgressProxy, https: StandIn, images: dict[str, str]
) -> AsyncIterator[str]:
    name = f"egress-sup-{uuid.uuid4().hex[:8]}"
    assert https.ca is not None
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": images["minimal"],
            "resources": {"memory": "512Mi"},
            "network": {
                "allow": [
                    {
                        "host": "api.test",
                        "ports": [https.port],
                        "addresses": [f"{https.address}/32"],
                    }
                ]
            },
            "files": [{"path": "ca.pem", "content": https.ca.ca_path.read_text()}],
        },
    }
    await runtime.apply(body)
    yield name
    with contextlib.suppress(SessionNotFound):
        await runtime.delete(name)


class Logged(logging.Handler):
    """The egress client's log lines, each a set event for whoever waits on one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.changed.set()

    async def wait_for(self, part: str, count: int = 1) -> list[str]:
        """The lines holding `part`, once there are `count` of them (within DEADLINE)."""
        async with asyncio.timeout(DEADLINE):
            while len(found := [line for line in self.lines if part in line]) < count:
                self.changed.clear()
                await self.changed.wait()
        return found


@pytest.fixture
def logged() -> Iterator[Logged]:
    handler = Logged()
    logger = logging.getLogger("mcp_forge.egress.client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def proxy_pid(proxy: EgressProxy) -> int | None:
    """The pid of this module's proxy's Python (inside bwrap), or None."""
    table = proxy.settings.egress_resolve.encode()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            cmdline = (status.parent / "cmdline").read_bytes().split(b"\0")
            name = status.read_text().split("\n", 1)[0]
        except OSError:
            continue
        if b"mcp_forge.egress.server" in cmdline and table in cmdline and "python" in name:
            return int(status.parent.name)
    return None


def held(proxy: EgressProxy, session: str) -> bool:
    """Whether the proxy holds the session's listener (its key is namespace/name)."""
    return any(key.rpartition("/")[2] == session for key in proxy.sessions)


async def wait_gone(pid: int) -> None:
    """Until process `pid` has exited (its pidfd readable), within DEADLINE."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(pidfd, gone.set)
    try:
        async with asyncio.timeout(DEADLINE):
            await gone.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def fetch(gw: Gateway, session: str, url: str) -> dict[str, Any]:
    """GET `url` in the kernel through its HTTPS_PROXY: {status, length} or {error}."""
    code = f"""
import json, ssl, urllib.request, urllib.error
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
try:
    with urllib.request.urlopen({url!r}, context=ctx, timeout={DEADLINE}) as r:
        out = {{"status": r.status, "length": len(r.read())}}
except (urllib.error.URLError, OSError) as e:
    out = {{"error": str(getattr(e, "reason", e))[:500]}}
print(json.dumps(out))
"""
    r = await gw.execute(session, code)
    assert r.status == "ok", (r.error, r.stderr)
    return dict(json.loads(r.stdout))


async def reached(gw: Gateway, session: str, https: StandIn) -> None:
    """A request from the kernel reaches api.test through the proxy."""
    path = f"/bytes/{uuid.uuid4().int % 1000 + 1}"
    got = await fetch(gw, session, https.url("api.test", path))
    assert got.get("status") == 200, got
    await asyncio.to_thread(https.wait_for, lambda r: r.path == path, DEADLINE)


async def test_a_proxy_that_dies_is_started_again_at_once_with_its_sessions(
    gw: Gateway, session: str, proxy: EgressProxy, https: StandIn, logged: Logged
) -> None:
    await reached(gw, session, https)
    first = proxy_pid(proxy)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    exited = await logged.wait_for("sessions open: starting it again")
    assert "with 1 sessions open: starting it again in 0 s" in exited[0], exited
    await logged.wait_for("egress proxy started again with 1 sessions")
    assert held(proxy, session), proxy.sessions
    second = proxy_pid(proxy)
    assert second not in (None, first)
    await reached(gw, session, https)


async def test_a_proxy_that_keeps_dying_waits_longer_each_time(
    gw: Gateway, session: str, proxy: EgressProxy, https: StandIn, logged: Logged
) -> None:
    """Dead again within a minute of its start: started again after 1 s, then 2 s."""
    for delay in (1, 2):
        pid = proxy_pid(proxy)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        exited = await logged.wait_for("sessions open: starting it again", count=delay)
        assert f"starting it again in {delay} s" in exited[-1], exited
        await logged.wait_for("egress proxy started again", count=delay)
    assert held(proxy, session), proxy.sessions
    await reached(gw, session, https)


async def test_a_stopped_proxy_is_not_started_again(
    proxy: EgressProxy, session: str, logged: Logged
) -> None:
    pid = proxy_pid(proxy)
    assert pid is not None
    await proxy.stop()
    assert not proxy.sessions
    await wait_gone(pid)
    async with asyncio.timeout(DEADLINE):  # its watcher ended
        while proxy._watches:
            await asyncio.wait(set(proxy._watches))
    assert proxy_pid(proxy) is None
    assert proxy._restart is None or proxy._restart.done()
    assert not [line for line in logged.lines if "starting it again" in line], logged.lines
