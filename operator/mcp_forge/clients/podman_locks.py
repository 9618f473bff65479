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
until the play's timeout. `Stall` sees it from our side within seconds (podman_api
watches each call with it and kills our service: the play then goes on at once).

A lock file is told by its device and inode, as /proc/locks gives them. On a btrfs
subvolume the device stat() gives is not the one /proc/locks prints, and nothing is
found there: the log then says no one holds the store's locks (Debian's ext4 is fine).
"""

from __future__ import annotations

import os
import time
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
STALL_AFTER = 5.0  # s a lock wait behind a holder doing nothing is taken for a stall
# What a holder may do, per second of the wait, and still be taken for doing nothing: a
# spin of fcntl and a 10 ms sleep uses ~1% of a core and no read or write; copying an
# image's layers for a new user namespace, the one long hold seen, far more of both.
IDLE_CPU = 0.2  # of a core
IDLE_IO = 256 * 1024  # bytes read and written

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
        Holder(files[lock.key], lock.pid, lock.waiting, _command(lock.pid))
        for lock in locks()
        if lock.key in files
    ]


class Stall:
    """Whether process `pid` is stuck in a lock wait: it has waited `after` seconds for a
    lock held by a process that, all that time, neither ran nor read or wrote (IDLE_CPU,
    IDLE_IO) - the other half of the inversion above, spinning on EDEADLK. A holder at
    work (copying layers) is waited for as long as it takes. Any lock file counts, so a
    service on a store of its own is watched too.

    Call `check` every second or so; it is cheap (a read of /proc/locks, and two small
    /proc files of each holder waited for).
    """

    def __init__(self, pid: int, *, after: float | None = None) -> None:
        self.pid = pid
        self.after = STALL_AFTER if after is None else after
        self._since: dict[tuple[Key, int], tuple[float, tuple[float, int]]] = {}

    def check(self) -> str | None:
        """None, or what `pid` is stuck behind, for a log line."""
        now = time.monotonic()
        found = locks()
        awaited = {lock.key for lock in found if lock.pid == self.pid and lock.waiting}
        edges = {
            (lock.key, lock.pid)
            for lock in found
            if lock.key in awaited and not lock.waiting and lock.pid != self.pid
        }
        since: dict[tuple[Key, int], tuple[float, tuple[float, int]]] = {}
        for key, holder in edges:
            done = _work(holder)
            if done is None:  # gone meanwhile
                continue
            first = self._since.get((key, holder))
            if first is None or _busy(first[1], done, now - first[0]):
                first = (now, done)
            since[(key, holder)] = first
            if now - first[0] >= self.after:
                name = store_files().get(key) or "{}:{}:{}".format(*key)
                return (
                    f"it waited {now - first[0]:.0f}s for {name}, held by {holder} "
                    f"({_command(holder)}), which did nothing meanwhile"
                )
        self._since = since
        return None


def _work(pid: int) -> tuple[float, int] | None:
    """What `pid` has done so far: CPU seconds (user and system), bytes read and written."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        io = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    moved = sum(
        int(line.split()[1]) for line in io.splitlines() if line.startswith(("rchar", "wchar"))
    )
    return cpu, moved


def _busy(before: tuple[float, int], after: tuple[float, int], seconds: float) -> bool:
    seconds = max(seconds, 1.0)
    return after[0] - before[0] > IDLE_CPU * seconds or after[1] - before[1] > IDLE_IO * seconds


def describe(found: list[Holder]) -> str:
    """One line for a log: who holds and who waits for which lock."""
    if not found:
        return "no process holds the store's locks"
    return "; ".join(
        f"{h.lock} {'awaited' if h.waiting else 'held'} by {h.pid} ({h.command})" for h in found
    )


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[: COMMAND_MAX * 4]
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace")
    return " ".join(text.split())[:COMMAND_MAX] or "?"  # on one line
