"""Our own Podman API service stuck in Podman 4.3.1's lock inversion, seen from outside.

podman_locks.py says what the inversion is: one side holds a lock of the store and
blocks on another; the other side holds that one and, answered EDEADLK by the kernel
for the one it wants, asks again every 10 ms for ever. The spinning side never shows
in /proc/locks as a waiter, and does nothing else. So a stall here is a lock wait
between our service and a process outside it that lasts `STALL_AFTER` seconds while
the holder:

- waits for no lock itself (a queue of waiters behind a busy process is no stall),
- and neither ran (IDLE_CPU), read or wrote (IDLE_IO), nor sat in a disk wait (state
  D), counting its children too (containers/storage hands a layer's chown to a child
  of its own).

A holder at work, as a play copying an image's layers for a new user namespace for
minutes, is waited for. Either side may be ours; "ours" is the service and its
descendants (a rootless podman re-executes itself in a user namespace, and the locks
are its child's).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mcp_forge.clients.podman_locks import Key, command, locks, store_files

log = logging.getLogger(__name__)

STALL_AFTER = 5.0  # s a lock wait behind a holder doing nothing is taken for a stall
# What a holder may do, per second of the wait, and still be taken for doing nothing: a
# spin of fcntl and a 10 ms sleep uses ~1% of a core and no read or write; copying an
# image's layers for a new user namespace, the one long hold seen, far more of both.
IDLE_CPU = 0.2  # of a core
IDLE_IO = 256 * 1024  # bytes read and written
FAMILY_MAX = 64  # processes of a family looked at

Work = tuple[float, int]  # CPU seconds, bytes read and written, so far
_unreadable_said = False


@dataclass(frozen=True)
class Stuck:
    ours: int  # the process of our service's family in the inversion: to be killed
    why: str  # for a log line


class Stall:
    """Whether the service `pid` is stuck; call `check` every second or so (a read of
    /proc/locks, and a few small /proc files of each holder in a lock wait with it)."""

    def __init__(self, pid: int, *, after: float | None = None) -> None:
        self.pid = pid
        self.after = STALL_AFTER if after is None else after
        self._since: dict[tuple[Key, int, int], tuple[float, Work]] = {}

    def check(self) -> Stuck | None:
        now = time.monotonic()
        found = locks()
        ours = family(self.pid)
        waiting = {lock.pid for lock in found if lock.waiting}
        since: dict[tuple[Key, int, int], tuple[float, Work]] = {}
        for wait in found:
            if not wait.waiting:
                continue
            for hold in found:
                if hold.key != wait.key or hold.waiting or hold.pid in waiting:
                    continue
                if (wait.pid in ours) == (hold.pid in ours):
                    continue  # ours on both sides, or on neither
                edge = (wait.key, hold.pid, wait.pid)
                activity = _activity(hold.pid)
                if activity is None:  # gone meanwhile
                    continue
                in_disk_wait, done = activity
                first = self._since.get(edge)
                if first is None or in_disk_wait or _busy(first[1], done, now - first[0]):
                    first = (now, done)
                since[edge] = first
                if now - first[0] >= self.after:
                    name = store_files().get(wait.key) or "{}:{}:{}".format(*wait.key)
                    return Stuck(
                        wait.pid if wait.pid in ours else hold.pid,
                        f"{wait.pid} waited {now - first[0]:.0f}s for {name}, held by "
                        f"{hold.pid} ({command(hold.pid)}), which did nothing meanwhile",
                    )
        self._since = since
        return None


def family(pid: int) -> set[int]:
    """`pid` and its descendants (at most FAMILY_MAX), from /proc/*/task/*/children."""
    seen = {pid}
    todo = [pid]
    while todo and len(seen) < FAMILY_MAX:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in seen and len(seen) < FAMILY_MAX:
                    seen.add(child)
                    todo.append(child)
    return seen


def _activity(pid: int) -> tuple[bool, Work] | None:
    """Whether a thread of `pid` or of its descendants is in a disk wait now, and what
    they have done so far; None if `pid` is gone."""
    global _unreadable_said
    in_disk_wait, cpu, moved = False, 0.0, 0
    tick = os.sysconf("SC_CLK_TCK")
    for member in family(pid):
        try:
            stat = Path(f"/proc/{member}/stat").read_text()
            io = Path(f"/proc/{member}/io").read_text()
            states = [
                _state(f"/proc/{member}/task/{t}") for t in os.listdir(f"/proc/{member}/task")
            ]
        except PermissionError:
            if not _unreadable_said:
                _unreadable_said = True
                log.warning("cannot read /proc/%d/io: a stalled Podman is not told", member)
            return None
        except OSError:
            if member == pid:
                return None
            continue  # a child gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        moved += sum(
            int(line.split()[1]) for line in io.splitlines() if line.startswith(("rchar", "wchar"))
        )
        in_disk_wait = in_disk_wait or "D" in states
    return in_disk_wait, (cpu, moved)


def _state(task_dir: str) -> str:
    """One of the process's threads' state letter ("" if it is gone); `task_dir` is
    /proc/PID/task/TID."""
    try:
        stat = Path(task_dir, "stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :][:1]


def _busy(before: Work, after: Work, seconds: float) -> bool:
    seconds = max(seconds, 1.0)
    return after[0] - before[0] > IDLE_CPU * seconds or after[1] - before[1] > IDLE_IO * seconds
