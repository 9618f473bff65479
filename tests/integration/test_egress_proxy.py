"""The egress proxy is supervised (issue 28): when its process dies, the gateway starts it
again at once with every open session, waiting longer each time while it keeps dying, and
not at all once stopped; a start that fails in a way nobody foresaw is tried again too. A
session the proxy cannot be told about (its message too large) fails alone, a proxy that
does not answer fails no delete, and a gateway keeps the session's socket it serves and
serves it again where another gateway bound one over it. A real kernel in a real Podman
pod, the real proxy (mitmproxy, confined), a stand-in for api.test on this machine's own
address (tests/egress_standins.py); sessions the tests serve from the host have their
socket in a directory of the test's.

The proxy is killed (or stopped) as a crash (or a hang) would: its Python process (found
in /proc by its command line), not the bwrap or prlimit wrappers the gateway started.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_standins import StandIn, TestCA, own_address
from mcp_forge.api import egress, keys
from mcp_forge.egress import protocol
from mcp_forge.egress.client import EgressProxy, EgressUnavailable, Given, default_python
from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

DEADLINE = 20.0  # for the proxy to be back, and for a request through it
# A proxy's wait for an answer where a test makes it wait in vain: longer than a start
# (1.5 s here, idle), short for a test.
IMPATIENT = 4.0
# The proxy's Python for a start that fails unexpectedly: the real one (a copy of
# .venv-egress beside this script), but while a file `fail` is in its venv, one that
# answers its start with a port that is no number, and exits.
SHIM = """#!/bin/bash
venv=${0%/bin/python}
if [[ -e $venv/fail ]]; then
    while [[ $# -gt 0 && $1 != --control-fd ]]; do shift; done
    printf '{"ready":true,"port":"none"}\\n' >&"$2"
    exit 1
fi
exec "$venv/bin/python3" "$@"
"""


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


def allow(https: StandIn) -> list[dict[str, Any]]:
    """A session's rules: api.test, on the stand-in's port and address."""
    return [{"host": "api.test", "ports": [https.port], "addresses": [f"{https.address}/32"]}]


def session_body(name: str, https: StandIn, images: dict[str, str]) -> dict[str, Any]:
    assert https.ca is not None
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": images["minimal"],
            "resources": {"memory": "512Mi"},
            "network": {"allow": allow(https)},
            "files": [{"path": "ca.pem", "content": https.ca.ca_path.read_text()}],
        },
    }


@pytest.fixture(scope="module")
async def session(
    runtime: LocalRuntime, proxy: EgressProxy, https: StandIn, images: dict[str, str]
) -> AsyncIterator[str]:
    name = f"egress-sup-{uuid.uuid4().hex[:8]}"
    await runtime.apply(session_body(name, https, images))
    yield name
    with contextlib.suppress(SessionNotFound):
        await runtime.delete(name)


def proxy_like(proxy: EgressProxy, directory: Path, **changes: Any) -> EgressProxy:
    """A proxy of `proxy`'s settings but `changes`, its resolver table a copy in
    `directory` (so that proxy_pid tells its process from the module's)."""
    table = directory / "resolve.json"
    shutil.copy(proxy.settings.egress_resolve, table)
    table.chmod(0o644)
    directory.chmod(0o755)
    return EgressProxy(dataclasses.replace(proxy.settings, egress_resolve=str(table), **changes))


@dataclasses.dataclass
class Shimmed:
    proxy: EgressProxy
    fail: Path  # while it exists, the proxy's Python fails its start (SHIM)


@pytest.fixture
async def shimmed(
    proxy: EgressProxy, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Shimmed]:
    """A proxy whose Python is SHIM, in a copy of .venv-egress (hard links: 0.2 s), which
    the sandbox binds as it would the real one."""
    directory = tmp_path_factory.mktemp("shim")
    venv = directory / "venv"
    shutil.copytree(default_python().parent.parent, venv, symlinks=True, copy_function=os.link)
    python = venv / "bin" / "python"
    python.unlink()
    python.write_text(SHIM)
    python.chmod(0o755)
    shim = proxy_like(proxy, directory, egress_python=str(python))
    yield Shimmed(shim, venv / "fail")
    await shim.stop()


@pytest.fixture
async def impatient(
    runtime: LocalRuntime, proxy: EgressProxy, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EgressProxy]:
    """The runtime's egress proxy for one test: one that waits IMPATIENT s for an answer."""
    directory = tmp_path_factory.mktemp("impatient")
    runtime.egress = proxy_like(proxy, directory, egress_ready_timeout=IMPATIENT)
    yield runtime.egress
    await runtime.egress.stop()
    runtime.egress = proxy


class Logged(logging.Handler):
    """The egress client's and the runtime's log lines, each a set event for whoever waits
    on one."""

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
    loggers = [
        logging.getLogger(name)
        for name in ("mcp_forge.egress.client", "mcp_forge.runtimes.local.runtime")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield handler
    for logger, level in zip(loggers, levels, strict=True):
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


async def socket_path(runtime: LocalRuntime, session: str) -> Path:
    """The session's egress socket, where its pod sees it."""
    found = await runtime.get(session)
    return Path(runtime.host_paths(found).run) / protocol.SOCKET_NAME


def token_of(proxy: EgressProxy, session: str) -> str:
    """The kernel's credential, as the proxy was given it."""
    return next(o.given.token for k, o in proxy.sessions.items() if k.endswith(f"/{session}"))


@dataclasses.dataclass
class Served:
    """A session's socket and its kernel's credential."""

    path: Path
    token: str


def new_token() -> str:
    return protocol.token_for(os.urandom(32))


async def serve_here(proxy: EgressProxy, name: str, directory: Path, given: Given) -> Served:
    """Open session `name` on `proxy`, its socket bound in `directory`."""
    path = directory / f"{name.rpartition('/')[2]}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    try:
        await proxy.open(name, given, listener)
    except BaseException:
        listener.close()
        raise
    return Served(path, given.token)


def tunnel(served: Served, https: StandIn) -> ssl.SSLSocket:
    """TLS to api.test through a session's socket, as a kernel's relay would carry it (a
    CONNECT answered 200, or AssertionError with the answer)."""
    assert https.ca is not None
    auth = base64.b64encode(f"{protocol.PROXY_USER}:{served.token}".encode()).decode()
    where = f"api.test:{https.port}"
    raw = socket.socket(socket.AF_UNIX)
    try:
        raw.settimeout(DEADLINE)
        raw.connect(str(served.path))
        raw.sendall(
            f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head and (byte := raw.recv(1)):
            head += byte
        assert head.startswith(b"HTTP/1.1 200"), head
        return https.ca.client_context().wrap_socket(raw, server_hostname="api.test")
    except BaseException:
        raw.close()
        raise


def get_on(tls: ssl.SSLSocket, target: str) -> bytes:
    """GET `target` on a connection and read until it closes: what came, if anything."""
    answer = b""
    try:
        tls.sendall(
            f"GET {target} HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n".encode()
        )
        while chunk := tls.recv(1 << 16):
            answer += chunk
    except OSError:  # ended on the way (ssl.SSLError is one)
        pass
    return answer


async def reached_through(served: Served, https: StandIn) -> None:
    """A request through the session's socket reaches api.test."""
    path = f"/bytes/{uuid.uuid4().int % 1000 + 1}"

    def get() -> bytes:
        with tunnel(served, https) as tls:
            return get_on(tls, path)

    answer = await asyncio.to_thread(get)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    await asyncio.to_thread(https.wait_for, lambda r: r.path == path, DEADLINE)


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


def largest_session() -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """The rules and values of the largest session the schema allows (but for its ports
    and methods lists, which it does not bound), each string one JSON doubles: 64 rules
    of 16 paths of 1 KiB and 4 values of 8 KiB, and the longest of all the rest."""
    host = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
    ref = {"name": "s" * 253, "key": "k" * 253}
    rules = [
        {
            "host": host,
            "ports": [443],
            "methods": list(egress.METHODS),
            "paths": [f"/{i:02}" + '"' * (egress.PATH_MAX - 3) for i in range(egress.PATHS_MAX)],
            "addresses": [f"10.{i}.0.0/16" for i in range(egress.ADDRESSES_MAX)],
            "inject": [
                {"header": f"X-{j}" + "h" * 61, "prefix": '"' * 64, "secretKeyRef": ref}
                for j in range(egress.INJECT_MAX)
            ],
        }
        for _ in range(egress.RULES_MAX)
    ]
    values = [
        [n, j, '"' * egress.VALUE_MAX]
        for n in range(1, egress.RULES_MAX + 1)
        for j in range(egress.INJECT_MAX)
    ]
    return rules, values


async def test_a_message_too_large_for_the_control_socket_fails_its_session_not_the_proxy(
    gw: Gateway,
    session: str,
    proxy: EgressProxy,
    https: StandIn,
    logged: Logged,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The largest session the schema bounds is sent; one past the bound is not, and fails
    with its size named while the proxy, the same process, serves the others."""
    directory = tmp_path_factory.mktemp("large")
    pid = proxy_pid(proxy)
    assert pid is not None
    rules, values = largest_session()
    assert len(egress.parse_rules(rules)) == egress.RULES_MAX  # legal, all of it
    size = len(json.dumps({"rules": rules, "values": values}, separators=(",", ":")))
    assert 6 << 20 < size < protocol.MESSAGE_MAX
    ca = keys.new_egress_ca("default/largest")
    await serve_here(proxy, "default/largest", directory, Given(new_token(), rules, ca, values))
    assert "default/largest" in await proxy.stats()
    await proxy.close("default/largest")

    # A ports list the schema does not bound: a session it accepts can be this large.
    ports = [https.port] * (protocol.MESSAGE_MAX // len(f"{https.port},") + 1)
    too_large = Given(new_token(), [{**allow(https)[0], "ports": ports}])
    with pytest.raises(EgressUnavailable) as caught:
        await serve_here(proxy, "default/too-large", directory, too_large)
    said = re.search(
        r"was not asked: control message of (\d+) bytes, over (\d+)", str(caught.value)
    )
    assert said is not None, caught.value
    assert int(said[1]) > int(said[2]) == protocol.MESSAGE_MAX
    assert "default/too-large" not in proxy.sessions

    assert proxy_pid(proxy) == pid
    assert held(proxy, session)
    await reached(gw, session, https)
    assert not [line for line in logged.lines if "exited" in line], logged.lines


async def test_a_gateway_connecting_to_a_kernel_whose_socket_it_serves_keeps_it(
    gw: Gateway, session: str, proxy: EgressProxy, https: StandIn, runtime: LocalRuntime
) -> None:
    """A gateway of this process connects to the kernel, as one does to a kernel it has
    just started or after its connection dropped: the session's socket stays, and the
    connections through it (serving it again would end them)."""
    await reached(gw, session, https)
    path = await socket_path(runtime, session)
    before = path.stat().st_ino
    tls = await asyncio.to_thread(tunnel, Served(path, token_of(proxy, session)), https)
    with tls:
        another = Gateway(runtime, runtime.settings)
        try:
            r = await another.execute(session, "1")
            assert r.status == "ok", r.error
        finally:
            await another.close()
        answer = await asyncio.to_thread(get_on, tls, "/bytes/7")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert path.stat().st_ino == before


async def test_a_gateway_serves_again_a_socket_another_gateway_bound_over_its_own(
    gw: Gateway, session: str, proxy: EgressProxy, https: StandIn, runtime: LocalRuntime
) -> None:
    """Another gateway on the same store restarts the kernel (binding a socket of its own
    where the session's was) and exits; this one, connecting to the new kernel, serves the
    session's socket again."""
    await reached(gw, session, https)
    path = await socket_path(runtime, session)
    ours = path.stat().st_ino

    other = LocalRuntime(runtime.settings)
    other_gw = Gateway(other, other.settings)
    try:
        await other_gw.restart(session)
        assert held(other.egress, session)
    finally:
        await other_gw.close()
        await other.egress.stop()  # its listener closed: nobody serves the socket there
    assert path.stat().st_ino != ours

    await reached(gw, session, https)  # only this gateway's proxy can have served it


async def test_a_start_that_fails_unexpectedly_is_tried_again_with_every_session(
    shimmed: Shimmed,
    https: StandIn,
    logged: Logged,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Its Python answers the start with a port that is no number (a ValueError, not
    EgressUnavailable) once: the next start serves both sessions."""
    directory = tmp_path_factory.mktemp("again")
    proxy = shimmed.proxy
    served = [
        await serve_here(proxy, f"default/again-{i}", directory, Given(new_token(), allow(https)))
        for i in range(2)
    ]
    pid = proxy_pid(proxy)
    assert pid is not None
    shimmed.fail.touch()
    os.kill(pid, signal.SIGKILL)
    failed = await logged.wait_for("egress proxy not started again")
    assert "invalid literal for int()" in failed[0], failed
    shimmed.fail.unlink()  # before the next start, a second from now
    await logged.wait_for("egress proxy started again with 2 sessions")
    assert proxy_pid(proxy) not in (None, pid)
    for each in served:
        await reached_through(each, https)


async def test_deleting_a_session_survives_a_proxy_that_does_not_answer(
    runtime: LocalRuntime,
    impatient: EgressProxy,
    https: StandIn,
    images: dict[str, str],
    names: list[str],
    logged: Logged,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The proxy stopped (SIGSTOP) as a hang would: the delete waits IMPATIENT s for it,
    says so in the log, and goes on; the proxy is started again for the session left."""
    kept = await serve_here(
        impatient, "default/kept", tmp_path_factory.mktemp("kept"), Given(new_token(), allow(https))
    )
    name = f"egress-del-{uuid.uuid4().hex[:8]}"
    names.append(name)
    await runtime.apply(session_body(name, https, images))
    path = await socket_path(runtime, name)
    assert path.is_socket() and held(impatient, name)
    pid = proxy_pid(impatient)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(DEADLINE):
            await runtime.delete(name)
    finally:  # never left stopped, whatever happened (killed, it is gone by now)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    with pytest.raises(SessionNotFound):
        await runtime.get(name)
    assert not path.exists() and not held(impatient, name)
    warned = await logged.wait_for(f"session {name}: closing its egress")
    assert "did not answer" in warned[0], warned

    await wait_gone(pid)
    await logged.wait_for("egress proxy started again with 1 sessions")
    await reached_through(kept, https)


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
