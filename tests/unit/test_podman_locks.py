"""clients/podman_locks.py: who holds and who waits for a store's lock files, read from
the host's /proc/locks with real POSIX locks on a store of the test's own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mcp_forge.clients import podman_locks

LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
print("trying", flush=True)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def lock(path: Path, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCK, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "trying\n"
    return proc


def test_the_holder_and_the_waiter_of_a_store_lock_are_named(tmp_path: Path, procs) -> None:
    for name in podman_locks.STORE_LOCKS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "other.lock").touch()
    holder = lock(tmp_path / "overlay-layers/layers.lock", procs)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    other = lock(tmp_path / "other.lock", procs)  # not one of the store's: not named
    assert other.stdout is not None and other.stdout.readline() == "held\n"
    waiter = lock(tmp_path / "overlay-layers/layers.lock", procs)
    # The waiter said it calls lockf; the kernel lists it as waiting a moment later.
    deadline = time.monotonic() + 10
    found = podman_locks.holders(tmp_path)
    while not any(h.waiting for h in found):
        assert time.monotonic() < deadline, found
        time.sleep(0.01)
        found = podman_locks.holders(tmp_path)
    assert sorted((h.lock, h.pid, h.waiting) for h in found) == [
        ("overlay-layers/layers.lock", holder.pid, False),
        ("overlay-layers/layers.lock", waiter.pid, True),
    ]
    assert all(h.command.startswith(f"{sys.executable} -c") for h in found), found
    said = podman_locks.describe(found)
    assert f"overlay-layers/layers.lock held by {holder.pid} (" in said
    assert f"overlay-layers/layers.lock awaited by {waiter.pid} (" in said


def test_a_store_no_one_holds_says_so(tmp_path: Path) -> None:
    (tmp_path / "storage.lock").touch()
    assert podman_locks.holders(tmp_path) == []
    assert podman_locks.holders(tmp_path / "missing") == []
    assert podman_locks.describe([]) == "no process holds the store's locks"
