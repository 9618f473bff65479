"""Network: a local kernel has no network but its own loopback. The kernel looks for
interfaces, routes and host services (a listener this test starts on the host's own
addresses, an abstract Unix socket), reads its connection file and environment; the host
checks what reached it. No probe goes to an outside address.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from support import scratch_state_dir

from .conftest import run, value
from .test_privileges import held_gateway

pytestmark = pytest.mark.podman

SECRET_ENV = "MCPFORGE_ADVERSARIAL_GATEWAY_SECRET"
SECRET = f"gateway-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def module_state() -> Iterator[Path]:
    with scratch_state_dir() as path:
        yield path


@pytest.fixture(scope="module")
async def kernel(module_state: Path) -> AsyncIterator[Client]:
    """One gateway (holding a secret in its environment) and its default session."""
    async with held_gateway(module_state, env={SECRET_ENV: SECRET}) as c:
        yield c


async def probe(c: Client, code: str) -> Any:
    """Run `code` in the kernel; it ends by printing one JSON line, read as JSON."""
    r = await run(c, "import json as _j, os as _o, socket as _s, errno as _e\n" + code)
    assert r["status"] == "ok", r["_text"]
    return json.loads(r["stdout"].strip().splitlines()[-1])


def host_addresses() -> list[tuple[int, str]]:
    """The host's own addresses, loopback included (from its interfaces, no lookup)."""
    found: list[tuple[int, str]] = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    with open("/proc/net/fib_trie") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "/32 host LOCAL" in line and i > 0:
            addr = lines[i - 1].split()[-1]
            if (socket.AF_INET, addr) not in found:
                found.append((socket.AF_INET, addr))
    with open("/proc/net/if_inet6") as f:
        for row in f:
            raw = row.split()[0]
            addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(raw))
            if not addr.startswith("fe80") and (socket.AF_INET6, addr) not in found:
                found.append((socket.AF_INET6, addr))
    return found


async def test_the_kernel_sees_only_its_loopback(kernel: Client) -> None:
    """Interfaces in /sys/class/net and /proc/net/dev, IPv4 routes, IPv6 addresses and
    routes: loopback only, and no route at all."""
    got = await probe(
        kernel,
        """
dev = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
routes = open("/proc/net/route").read().splitlines()[1:]
def _last(p):
    return [l.split()[-1] for l in open(p)] if _o.path.exists(p) else []
v6, v6routes = _last("/proc/net/if_inet6"), _last("/proc/net/ipv6_route")
print(_j.dumps([sorted(_o.listdir("/sys/class/net")), sorted(dev), routes, v6, v6routes]))
""",
    )
    sys_net, dev, routes, v6, v6routes = got
    assert sys_net == ["lo"] and dev == ["lo"]
    assert routes == []  # not even a default route
    assert set(v6) <= {"lo"} and set(v6routes) <= {"lo"}


async def test_host_listeners_are_unreachable(kernel: Client) -> None:
    """A TCP listener this test opens on every host address (loopback and the host's own
    interfaces): from the kernel each connect fails, and the listener accepted nothing."""
    listeners: list[tuple[socket.socket, int, str]] = []
    for family, addr in host_addresses():
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((addr, 0))
        except OSError:
            s.close()
            continue
        s.listen(8)
        s.setblocking(False)
        listeners.append((s, family, addr))
    targets = [[fam == socket.AF_INET6, addr, s.getsockname()[1]] for s, fam, addr in listeners]
    assert len(targets) >= 3, targets  # loopback (both) and at least one host address
    try:
        got = await probe(
            kernel,
            f"""
res = []
for v6, addr, port in {targets!r}:
    c = _s.socket(_s.AF_INET6 if v6 else _s.AF_INET, _s.SOCK_STREAM)
    c.settimeout(5)
    try:
        c.connect((addr, port)); res.append(0)
    except OSError as e:
        res.append(e.errno or -1)
    finally:
        c.close()
print(_j.dumps(res))
""",
        )
        accepted = []
        for s, _, addr in listeners:
            try:
                conn, _peer = s.accept()
                conn.close()
                accepted.append(addr)
            except BlockingIOError:
                pass
    finally:
        for s, _, _ in listeners:
            s.close()
    assert 0 not in got, dict(zip([t[1] for t in targets], got, strict=True))
    assert accepted == []


async def test_host_abstract_unix_sockets_are_unreachable(kernel: Client) -> None:
    """An abstract Unix socket on the host (D-Bus and X11 use them; they belong to the
    network namespace): the kernel cannot connect, and the host socket accepted nothing."""
    name = f"\0mcpforge-canary-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(1)
    server.setblocking(False)
    try:
        got = await probe(
            kernel,
            f"""
c = _s.socket(_s.AF_UNIX, _s.SOCK_STREAM)
try:
    c.connect({name!r}); r = 0
except OSError as e:
    r = e.errno
print(_j.dumps(r))
""",
        )
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert got == 111  # ECONNREFUSED: no such socket in the kernel's namespace


def _host_connection_file(state: Path) -> dict[str, Any]:
    (path,) = state.glob("k/*/conf/connection.json")
    return dict(json.loads(path.read_text()))


async def test_the_connection_file_is_readable_only_as_intended(
    kernel: Client, module_state: Path
) -> None:
    """The kernel reads its own connection file (it must, to serve), and that is its
    session's key; it cannot write, replace, chmod or add files beside it."""
    host = _host_connection_file(module_state)
    got = await probe(
        kernel,
        """
p = "/etc/mcp-forge/connection.json"
key = _j.load(open(p))["key"]
tries = {}
for name, act in [("write", lambda: open(p, "a")), ("chmod", lambda: _o.chmod(p, 0o666)),
                  ("rename", lambda: _o.rename(p, p + ".x")),
                  ("create", lambda: open("/etc/mcp-forge/other.json", "w"))]:
    try:
        act(); tries[name] = 0
    except OSError as e:
        tries[name] = e.errno
st = _o.stat(p)
print(_j.dumps([key, tries, oct(st.st_mode & 0o777), st.st_uid == _o.getuid()]))
""",
    )
    key, tries, mode, owned = got
    assert key == host["key"] and len(key) >= 32
    assert 0 not in tries.values(), tries
    assert mode == "0o440" and owned is False


async def test_the_environment_holds_no_gateway_secrets(kernel: Client) -> None:
    """The gateway's own environment (here holding a secret) never reaches the kernel:
    not in os.environ, not in any process the kernel can read; the kernel's key is not
    in its environment either."""
    got = await probe(
        kernel,
        """
seen = {}
for pid in [d for d in _o.listdir("/proc") if d.isdigit()]:
    try:
        seen[pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        pass
key = _j.load(open("/etc/mcp-forge/connection.json"))["key"]
print(_j.dumps([dict(_o.environ), seen, key]))
""",
    )
    env, environs, key = got
    assert SECRET_ENV not in env and SECRET not in json.dumps(env)
    assert all(SECRET not in e for e in environs.values())
    assert all(key not in v for v in env.values())
    assert {k for k in env if k.startswith("MCPFORGE")} == {"MCPFORGE_SESSION"}
    assert await value(kernel, "__import__('os').environ.get('HOME')") == "/workspace"
