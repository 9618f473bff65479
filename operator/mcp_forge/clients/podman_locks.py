"""Who holds Podman's storage locks: what a `podman` that hangs is waiting for.

Podman 4.3.1 (Debian 12's) now and then stalls in containers/storage, and until its
timeout every later command of the store waits behind it. The locks are POSIX record
locks on files of the store, so /proc/locks names their holders and waiters; a command
that times out logs them (podman.run), and a play that timed out releases the holder
that is ours (the API service of this process) before it plays again
(runtimes/local/kernelpods.py).

The stall seen here is a lock inversion: our API service, asked whether an image exists
just after another process changed the store, holds storage.lock and waits for
layers.lock; a `kube play` holds layers.lock and asks for storage.lock. The kernel finds
the cycle and answers the play EDEADLK, and containers/storage (its lockfile_unix.go)
asks again every 10 ms, for ever: the play never shows as a waiter, and both stay stuck
until the play's timeout. podman_stall.py sees it from our side within seconds.

A lock file is told by its device and inode, as /proc/locks gives them. On a btrfs
subvolume the device stat() gives is not the one /proc/locks prints, and nothing is
found there: the log then says no one holds the store's locks (Debian's ext4 is fine).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The store's lock files, relative to its graph root (containers/storage's layout).
STORE_LOCKS = (
    "storage.lock",
    "userns.lock",
    "overlay-layers/layers.lock",
    "overlay-images/images.lock",
    "overlay-containers/containers.lock",
)
PROC_LOCKS_MAX = 1 << 20  # bytes of /proc/locks read: a host's locks, not ours to bound
COMMAND_MAX = 160  # characters of a holder's command line in a log line
Key = tuple[int, int, int]  # a locked file: device major, minor, inode (as /proc/locks)


@dataclass(frozen=True)
class Holder:
    lock: str  # one of STORE_LOCKS
    pid: int
    waiting: bool  # waits for the lock (`->` in /proc/locks) rather than holds it
    command: str


def graph_root() -> Path:
    """Podman's default store for this user (storage.conf overrides are not read)."""
    if os.geteuid() == 0:
        return Path("/var/lib/containers/storage")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(base) / "containers/storage"


@dataclass(frozen=True)
class Lock:
    key: Key
    pid: int
    waiting: bool


def locks() -> list[Lock]:
    """Every lock of the host now, held or awaited, as /proc/locks lists them."""
    try:
        with open("/proc/locks", "rb") as f:
            text = f.read(PROC_LOCKS_MAX).decode(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        # "1: POSIX  ADVISORY  WRITE 1643 fe:00:9979361 0 EOF", a waiter with "->" after "1:"
        fields = line.split()
        waiting = len(fields) > 1 and fields[1] == "->"
        if waiting:
            del fields[1]
        if len(fields) < 6:
            continue
        try:
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        found.append(Lock(key, pid, waiting))
    return found


def store_files(root: Path | None = None, names: Iterable[str] = STORE_LOCKS) -> dict[Key, str]:
    """The store's lock files (`names` under `root`, by default its graph root), by key."""
    files: dict[Key, str] = {}
    for name in names:
        try:
            st = os.stat((root or graph_root()) / name)
        except OSError:
            continue
        files[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = name
    return files


def holders(root: Path | None = None, names: Iterable[str] = STORE_LOCKS) -> list[Holder]:
    """The processes holding or waiting for the store's lock files now (`names` under
    `root`: by default the store's, under its graph root)."""
    files = store_files(root, names)
    return [
        Holder(files[lock.key], lock.pid, lock.waiting, command(lock.pid))
        for lock in locks()
        if lock.key in files
    ]


def describe(found: list[Holder]) -> str:
    """One line for a log: who holds and who waits for which lock."""
    if not found:
        return "no process holds the store's locks"
    return "; ".join(
        f"{h.lock} {'awaited' if h.waiting else 'held'} by {h.pid} ({h.command})" for h in found
    )


def command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[: COMMAND_MAX * 4]
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace")
    return " ".join(text.split())[:COMMAND_MAX] or "?"  # on one line
