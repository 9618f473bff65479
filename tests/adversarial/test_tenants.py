"""Multi-tenant isolation between kernels: what one session leaves, another cannot find.

Two sessions of one gateway (the same client: the weakest separation there is; clients
are kept apart on top of it, tests/e2e/test_http.py). Session A plants secrets in every
place a kernel can write or publish; session B searches everything it can see."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from .conftest import gateway, run, value

pytestmark = pytest.mark.podman

# Every regular file B can read, outside /proc and /sys, scanned for the secret (bounded).
SEARCH = """
import os
def _search(secret, roots=('/',), skip=('/proc', '/sys', '/dev'), limit=200_000):
    hits, seen = [], 0
    for root in roots:
        for top, dirs, files in os.walk(root, onerror=lambda e: None):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skip]
            for name in files:
                seen += 1
                if seen > limit:
                    return hits, seen
                path = os.path.join(top, name)
                try:
                    with open(path, 'rb', buffering=0) as f:
                        if secret.encode() in f.read(1_000_000):
                            hits.append(path)
                except OSError:
                    pass
    return hits, seen
"""


@asynccontextmanager
async def two(state_dir: Path) -> AsyncIterator[tuple[Client, str, str]]:
    """A gateway and two sessions of its client (an async fixture would close the client in
    another task than the one that opened it)."""
    async with gateway(state_dir) as c:
        ids = []
        for _ in range(2):
            r = await c.call_tool("create_session", {"variant": "minimal"})
            assert not r.is_error
            ids.append(r.structured_content["session_id"])
        yield c, ids[0], ids[1]


async def test_files_planted_by_one_session_are_not_found_by_another(state_dir: Path) -> None:
    """A writes a secret to /workspace, /tmp and /dev/shm; B walks every readable file of its
    filesystem and finds it nowhere (and its walk did read files: the search works)."""
    async with two(state_dir) as (c, a, b):
        await _test_files_planted_by_one_session_are_not_found_by_another(c, a, b)


async def _test_files_planted_by_one_session_are_not_found_by_another(
    c: Client, a: str, b: str
) -> None:
    secret = f"tenant-secret-{uuid.uuid4().hex}"
    planted = await run(
        c,
        f"for p in ('/workspace/s.txt', '/tmp/s.txt', '/dev/shm/s.txt'):\n"
        f"    open(p, 'w').write({secret!r})\n",
        session_id=a,
    )
    assert planted["status"] == "ok", planted["_text"]
    await run(c, SEARCH, session_id=b)
    # Named in two halves: B's own input history must not hold the whole secret.
    half = len(secret) // 2
    query = f"_search({secret[:half]!r} + {secret[half:]!r})"
    hits, seen = await value(c, query, session_id=b)
    assert hits == []
    assert seen > 100  # it searched a real filesystem
    await run(c, SEARCH, session_id=a)
    own = await value(c, query.replace(")", ", roots=('/workspace', '/tmp'))", 1), session_id=a)
    assert "/workspace/s.txt" in own[0] and "/tmp/s.txt" in own[0]  # the search finds what is there


async def test_processes_of_one_session_are_invisible_to_another(state_dir: Path) -> None:
    """A starts a process with a marker in its argv; B's /proc holds no process with it, and
    B sees only a handful of processes (its own pod's)."""
    async with two(state_dir) as (c, a, b):
        await _test_processes_of_one_session_are_invisible_to_another(c, a, b)


async def _test_processes_of_one_session_are_invisible_to_another(
    c: Client, a: str, b: str
) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    started = await run(
        c,
        f"import subprocess, sys\n_p = subprocess.Popen([sys.executable, '-c', "
        f"'import time; time.sleep(600)', {marker!r}])",
        session_id=a,
    )
    assert started["status"] == "ok", started["_text"]
    listing: dict[str, Any] = await value(
        c,
        "{p: open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace') "
        "for p in __import__('os').listdir('/proc') if p.isdigit()}",
        session_id=b,
    )
    assert not any(marker in cmd for cmd in listing.values())
    assert len(listing) < 10, listing
    mine = await value(
        c,
        "[p for p in __import__('os').listdir('/proc') if p.isdigit() and "
        f"{marker!r} in open(f'/proc/{{p}}/cmdline', 'rb').read().decode(errors='replace')]",
        session_id=a,
    )
    assert len(mine) == 1  # A sees its own: the probe can find one


async def test_ipc_objects_and_abstract_sockets_do_not_cross_sessions(state_dir: Path) -> None:
    """A creates a POSIX message queue file, binds an abstract Unix socket and reserves SysV
    shared memory; B cannot connect to the socket and its /proc/sysvipc shows nothing of A."""
    async with two(state_dir) as (c, a, b):
        await _test_ipc_objects_and_abstract_sockets_do_not_cross_sessions(c, a, b)


async def _test_ipc_objects_and_abstract_sockets_do_not_cross_sessions(
    c: Client, a: str, b: str
) -> None:
    name = f"mf-{uuid.uuid4().hex[:12]}"
    made = await run(
        c,
        "import socket, ctypes, os\n"
        "_srv = socket.socket(socket.AF_UNIX)\n"
        f"_srv.bind('\\0{name}')\n_srv.listen()\n"
        "_libc = ctypes.CDLL(None, use_errno=True)\n"
        "_shm = _libc.shmget(0x4d46, 4096, 0o1600)  # IPC_CREAT|0600\n"
        "print(_shm >= 0, open('/proc/sysvipc/shm').read().count('\\n'))",
        session_id=a,
    )
    assert made["stdout"].split()[0] == "True", made["_text"]
    seen = await value(
        c,
        "[__import__('socket').socket(__import__('socket').AF_UNIX).connect_ex("
        f"'\\0{name}'), open('/proc/sysvipc/shm').read().count('\\n')]",
        session_id=b,
    )
    refused, shm_lines = seen
    assert refused != 0  # ECONNREFUSED: nothing listens under that name in B's namespace
    assert shm_lines == 1  # the header only: A's segment is not in B's IPC namespace
    own = await value(
        c,
        f"__import__('socket').socket(__import__('socket').AF_UNIX).connect_ex('\\0{name}')",
        session_id=a,
    )
    assert own == 0  # in A it is there: the probe can connect


async def test_each_session_sees_only_its_own_key_and_sockets(state_dir: Path) -> None:
    """The connection file and the Jupyter sockets a kernel sees are its own: the keys of A
    and B differ, and each one's run directory holds one kernel's sockets."""
    async with two(state_dir) as (c, a, b):
        await _test_each_session_sees_only_its_own_key_and_sockets(c, a, b)


async def _test_each_session_sees_only_its_own_key_and_sockets(c: Client, a: str, b: str) -> None:
    read = (
        "[__import__('json').load(open('/etc/mcp-forge/connection.json'))['key'], "
        "sorted(__import__('os').listdir('/run/mcp-forge'))]"
    )
    key_a, run_a = await value(c, read, session_id=a)
    key_b, run_b = await value(c, read, session_id=b)
    assert len(key_a) >= 32 and len(key_b) >= 32
    assert key_a != key_b
    for listing in (run_a, run_b):
        assert len([n for n in listing if n.startswith("kernel-")]) == 5, listing
