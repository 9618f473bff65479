"""Podman 4.3.1's lock inversion, met for real (clients/podman_locks.py says what it is).

Our API service, asked whether an image exists just after another process changed the
store, holds storage.lock and waits for layers.lock. The other process holds layers.lock
and asks for storage.lock: the kernel answers it EDEADLK, and it asks again every 10 ms,
as containers/storage's lockfile does, for ever. In CI that was a `kube play`, stuck for
its whole timeout (120 s) behind a gateway checking its image.

Here the other process is a small program keeping containers/storage's protocol on the
lock files (it changes the store as a writer does, then spins on EDEADLK); the service is
a real `podman system service`. Both work on a store of the test's own (--root, --runroot,
vfs), so no other test's podman waits behind them.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mcp_forge.clients import podman, podman_locks, podman_service, podman_stall
from mcp_forge.clients.podman_api import PodmanApi

pytestmark = pytest.mark.podman

IMAGE = "localhost/stall-test:1"
STALL_AFTER = 2.0  # s, for these tests (the service's default is podman_stall.STALL_AFTER)
DEADLINE = 60.0  # s for anything here; the stalled play in CI waited 120 s

# Changes the store as a writer does (a new last-writer id in storage.lock, so a reader
# reloads it under that lock), holds layers.lock, and on "go" asks for storage.lock as
# containers/storage does: again every 10 ms while the kernel says EDEADLK (or anything).
# `busy` works (burns CPU) while it holds layers.lock instead, then lets go.
INVERTED = """
import errno, fcntl, os, sys, time
root, mode = sys.argv[1], sys.argv[2]
store = os.open(root + "/storage.lock", os.O_RDWR)
fcntl.lockf(store, fcntl.LOCK_EX)
os.pwrite(store, os.urandom(32).hex().encode(), 0)
fcntl.lockf(store, fcntl.LOCK_UN)
layers = os.open(root + "/vfs-layers/layers.lock", os.O_RDWR)
fcntl.lockf(layers, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.readline()
if mode == "busy":
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        pass
    print("done", flush=True)
    sys.exit(0)
said, tries, end = set(), 0, time.monotonic() + 60
while time.monotonic() < end:
    try:
        fcntl.lockf(store, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in said:
            said.add(e.errno)
            print("EDEADLK" if e.errno == errno.EDEADLK else errno.errorcode[e.errno], flush=True)
        tries += 1
        time.sleep(0.01)
        continue
    print("got storage.lock after", tries, flush=True)
    sys.exit(0)
print("gave up", flush=True)
"""


@dataclass
class Store:
    root: Path
    binary: Path  # podman on this store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    base = tmp_path_factory.mktemp("stall")
    real = podman.podman_binary()
    assert real is not None
    root, run = base / "root", base / "run"
    binary = base / "podman"
    binary.write_text(
        f"#!/bin/sh\nexec {real} --root {root} --runroot {run} --tmpdir {run}/libpod "
        f'--storage-driver vfs "$@"\n'
    )
    binary.chmod(0o755)
    (base / "image").mkdir()
    (base / "image/hello").write_text("hello\n")
    subprocess.run(["tar", "-C", base / "image", "-cf", base / "image.tar", "."], check=True)
    subprocess.run([binary, "import", "-q", base / "image.tar", IMAGE], check=True, timeout=120)
    return Store(root, binary)


@pytest.fixture
async def api(store: Store) -> AsyncIterator[PodmanApi]:
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    service = await podman_service.start_service(path, binary=str(store.binary), timeout=120)
    api = PodmanApi(path, timeout=DEADLINE, owned=service, binary=str(store.binary))
    try:
        assert await api.image_exists(IMAGE)
        yield api
    finally:
        api.close()


async def other(store: Store, *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        INVERTED,
        str(store.root),
        *args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(DEADLINE):
        assert await proc.stdout.readline() == b"holding\n"
    return proc


async def waits_for_layers(store: Store, pid: int) -> None:
    """Until `pid` is listed as waiting for the store's layers.lock."""
    layers = "vfs-layers/layers.lock"
    async with asyncio.timeout(DEADLINE):
        while not any(  # noqa: ASYNC110
            h.pid == pid and h.waiting for h in podman_locks.holders(store.root, [layers])
        ):
            await asyncio.sleep(0.02)  # polling /proc/locks: the kernel tells no one


def stuck(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is stuck in Podman's store" in r.message]


async def test_a_service_stuck_in_the_inversion_is_killed_and_the_other_side_goes_on(
    store: Store, api: PodmanApi, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podman_stall, "STALL_AFTER", STALL_AFTER)
    caplog.set_level(logging.WARNING, logger="mcp_forge.clients.podman_api")
    first = api.service
    assert first is not None
    inverted = await other(store, "spin")
    try:
        asking = asyncio.ensure_future(api.image_exists(IMAGE))
        await waits_for_layers(store, first.proc.pid)
        assert not asking.done()
        assert inverted.stdin is not None and inverted.stdout is not None
        inverted.stdin.write(b"go\n")
        async with asyncio.timeout(DEADLINE):
            # The kernel saw the cycle: this is a deadlock, not a slow holder.
            assert await inverted.stdout.readline() == b"EDEADLK\n"
            got = await inverted.stdout.readline()
            assert got.startswith(b"got storage.lock after"), got
            assert await asking is True  # answered by a service started again
        tries = int(got.split()[-1])
        # ~100 tries a second: freed once the service had waited STALL_AFTER, not 60 s.
        assert tries < 100 * (STALL_AFTER + 10), tries
        assert first.proc.poll() is not None
        assert api.service is not None and api.service is not first
        assert api.service.proc.poll() is None
        words = stuck(caplog)
        assert len(words) == 1, words
        assert f"(pid {first.proc.pid})" in words[0] and "answering image exists" in words[0]
        assert f"{first.proc.pid} waited 2s for " in words[0]
        assert f"held by {inverted.pid} (" in words[0] and "did nothing meanwhile" in words[0]
    finally:
        if inverted.returncode is None:
            inverted.kill()
        await inverted.wait()


async def test_a_service_waiting_behind_a_holder_at_work_is_left_to_wait(
    store: Store, api: PodmanApi, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that works while it holds the lock (as a play copying an image's layers
    for a new user namespace does, for minutes) is waited for, however long."""
    monkeypatch.setattr(podman_stall, "STALL_AFTER", STALL_AFTER)
    caplog.set_level(logging.WARNING, logger="mcp_forge.clients.podman_api")
    first = api.service
    assert first is not None
    working = await other(store, "busy", str(2.5 * STALL_AFTER))
    try:
        asking = asyncio.ensure_future(api.image_exists(IMAGE))
        await waits_for_layers(store, first.proc.pid)
        assert working.stdin is not None and working.stdout is not None
        working.stdin.write(b"go\n")
        async with asyncio.timeout(DEADLINE):
            assert await working.stdout.readline() == b"done\n"
            assert await asking is True
        assert api.service is first and first.proc.poll() is None
        assert not stuck(caplog)
    finally:
        if working.returncode is None:
            working.kill()
        await working.wait()
