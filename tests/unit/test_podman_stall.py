"""clients/podman_stall.py: a lock wait taken for Podman's inversion only when its holder
does nothing, read from the host's /proc with real POSIX locks held by real processes.

`service` plays our API service (the process watched); the others hold and wait as
Podman's processes would. Each says what it did on stdout before it blocks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcp_forge.clients import podman_locks, podman_stall

AFTER = 1.0  # s, for these tests
LOOK = 3 * AFTER  # how long a wait that must not be taken for a stall is looked at

ACT = """
import fcntl, os, subprocess, sys, time
what, args = sys.argv[1], sys.argv[2:]
def lock(path):
    fd = os.open(path, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    return fd
if what == "hold":  # hold args[0]; with "burn", a child burns CPU meanwhile
    lock(args[0])
    if args[1:] == ["burn"]:
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
    print("held", flush=True)
elif what == "hold-then-wait":  # hold args[0], then wait for args[1]
    lock(args[0])
    print("held", flush=True)
    lock(args[1])
elif what == "wait":  # wait for args[0]
    print("waiting", flush=True)
    lock(args[0])
elif what == "parent":  # a child waits for args[0], as a rootless podman's does
    waits = "import fcntl, os, sys; fcntl.lockf(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX)"
    subprocess.Popen([sys.executable, "-c", waits, args[0]])
print("done", flush=True)
sys.stdin.read()
"""


def act(procs: list[subprocess.Popen[str]], *args: str | Path, said: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ACT, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == f"{said}\n"
    return proc


def blocked(pid: int, deadline: float = 10.0) -> None:
    """Until the kernel lists `pid` as waiting for a lock."""
    end = time.monotonic() + deadline
    while not any(lock.pid == pid and lock.waiting for lock in podman_locks.locks()):
        assert time.monotonic() < end, f"{pid} never waited"
        time.sleep(0.01)  # polling /proc/locks: the kernel tells no one


def watch(stall: podman_stall.Stall, seconds: float) -> podman_stall.Stuck | None:
    """What `stall` says within `seconds`, checked every 0.2 s (None: nothing)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stuck = stall.check()
        if stuck is not None:
            return stuck
        time.sleep(0.2)  # the watch's period, as podman_api's (shorter)
    return None


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    x, y = tmp_path / "x.lock", tmp_path / "y.lock"
    x.touch()
    y.touch()
    return x, y


def test_a_wait_behind_a_holder_that_does_nothing_is_a_stall(files, procs) -> None:
    x, _ = files
    holder = act(procs, "hold", x, said="held")
    service = act(procs, "wait", x, said="waiting")
    blocked(service.pid)
    started = time.monotonic()
    stuck = watch(podman_stall.Stall(service.pid, after=AFTER), 10)
    assert stuck is not None
    assert AFTER <= time.monotonic() - started < AFTER + 5
    assert stuck.ours == service.pid
    assert f"{service.pid} waited 1s for " in stuck.why
    assert f"held by {holder.pid} ({sys.executable} -c " in stuck.why
    # Seen from the holder's side, the service is the one doing nothing, and it is ours.
    stuck = watch(podman_stall.Stall(holder.pid, after=AFTER), 10)
    assert stuck is not None and stuck.ours == holder.pid


def test_a_holder_whose_child_works_is_waited_for(files, procs) -> None:
    x, _ = files
    act(procs, "hold", x, "burn", said="held")
    service = act(procs, "wait", x, said="waiting")
    blocked(service.pid)
    assert watch(podman_stall.Stall(service.pid, after=AFTER), LOOK) is None


def test_a_holder_that_waits_itself_is_a_queue_not_a_stall(files, procs) -> None:
    """The service waits for x, held by A; A waits for y, held by B: an ordinary queue,
    whatever B does. The inversion's spinning side never shows as a waiter."""
    x, y = files
    act(procs, "hold", y, said="held")
    a = act(procs, "hold-then-wait", x, y, said="held")
    blocked(a.pid)
    service = act(procs, "wait", x, said="waiting")
    blocked(service.pid)
    assert watch(podman_stall.Stall(service.pid, after=AFTER), LOOK) is None


def test_the_service_s_child_is_watched_and_named_as_the_one_stuck(files, procs) -> None:
    """A rootless podman re-executes itself in a user namespace: the locks are its
    child's. The child is found, and named to be killed."""
    x, _ = files
    act(procs, "hold", x, said="held")
    service = act(procs, "parent", x, said="done")
    children = podman_stall.family(service.pid) - {service.pid}
    assert len(children) == 1, children
    (child,) = children
    blocked(child)
    stuck = watch(podman_stall.Stall(service.pid, after=AFTER), 10)
    assert stuck is not None and stuck.ours == child
