"""A `podman system service` of our own, for when the system's socket does not answer.

This process starts `podman system service --time=0 unix://…/podman-<pid>.sock` once,
waits for its sd_notify READY (no polling), and stops it when the process exits (atexit,
and PR_SET_PDEATHSIG if the process dies without running atexit). One service per
process, so two processes (a gateway and `mcp-forge apply`) never stop each other's.
Its stderr is read for as long as it runs, each line into our log: Podman is a Go
program, and Go exits on SIGPIPE when a write to its stderr finds the pipe closed (seen:
the first warning it logged, a pod it could not remove, killed it). Should it die all the
same, the next call that cannot reach it starts another on the same socket
(clients/podman_api.py, which chooses between the system's socket and one of ours).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

from mcp_forge.clients import podman
from mcp_forge.errors import PodmanError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

SERVICE_LINE_MAX = 8 * 1024  # one line of our service's stderr; a longer one is split
SERVICE_LINES_KEPT = 20  # its last lines, for the message if it dies or cannot start


class Service:
    """A `podman system service` this process started and owns.

    A thread reads its stderr until it exits, each line into our log (Podman's warnings
    and errors at that level, the rest at debug), and keeps the last few for an error
    message: an unread pipe would fill and block it, a closed one kill it (SIGPIPE).
    """

    def __init__(self, proc: subprocess.Popen[bytes], socket_path: Path) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self._last: collections.deque[str] = collections.deque(maxlen=SERVICE_LINES_KEPT)
        self._reader = threading.Thread(
            target=self._read_stderr, name=f"podman-service-{proc.pid}", daemon=True
        )
        self._reader.start()

    def _read_stderr(self) -> None:
        stream = self.proc.stderr
        assert stream is not None
        with stream:
            while line := stream.readline(SERVICE_LINE_MAX):
                text = line.decode(errors="replace").rstrip()
                if not text:
                    continue
                self._last.append(text)
                level = (
                    logging.ERROR
                    if "level=error" in text or "level=fatal" in text
                    else logging.WARNING
                    if "level=warn" in text
                    else logging.DEBUG
                )
                log.log(level, "podman service: %s", text)

    def last_lines(self, *, wait: float = 0.0) -> list[str]:
        """Its last lines on stderr; `wait` for the reader to reach the end first (once
        the process has exited)."""
        if wait:
            self._reader.join(wait)
        return list(self._last)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


def runtime_dir(settings: Settings) -> Path:
    """Where an owned service's socket goes: /run/mcp-forge as root, else the user's
    runtime directory, else the state directory."""
    if os.geteuid() == 0:
        return Path("/run/mcp-forge")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "mcp-forge" if xdg else settings.state_dir


def _die_with_parent() -> None:
    # In the child, before exec: SIGTERM when the thread that started it ends. Called
    # from the event loop's thread, which lives as long as the process does.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(socket_path: Path, binary: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start the service and bind the socket it will say READY on.

    Synchronous on purpose: called from the event loop's thread (it takes a few ms), so
    that PR_SET_PDEATHSIG is tied to that long-lived thread, not to a worker of a pool.
    """
    socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    notify_path = socket_path.with_suffix(".notify")
    for stale in (socket_path, notify_path):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        notify.bind(str(notify_path))
        notify.setblocking(False)
        proc = subprocess.Popen(
            [binary, "system", "service", "--time=0", f"unix://{socket_path}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
            cwd=podman.workdir(),  # conmon's files go there, not to our caller's directory
            preexec_fn=_die_with_parent,  # only a prctl: nothing that a fork could deadlock
            # Its own session: a signal to our process group (an MCP client killing its
            # server's group) must not kill it halfway through a request, which can leave
            # one of Podman's locks held; it gets SIGTERM when we end (above).
            start_new_session=True,
        )
    except BaseException:
        notify.close()
        with contextlib.suppress(FileNotFoundError):
            notify_path.unlink()
        raise
    return proc, notify


async def start_service(socket_path: Path, *, binary: str, timeout: float) -> Service:
    """Start `podman system service` on `socket_path`; return once it listens (its
    sd_notify READY=1), or raise PodmanError with what it said.

    ~0.07 s on a quiet host; as long as any podman command while another holds Podman's
    locks (a first play in a new user namespace copies the image's layers: minutes).
    """
    loop = asyncio.get_running_loop()
    proc, notify = _spawn(socket_path, binary)
    service = Service(proc, socket_path)
    ready: asyncio.Future[str] = loop.create_future()

    def on_notify() -> None:
        with contextlib.suppress(BlockingIOError):
            text = notify.recv(4096).decode(errors="replace")
            if "READY=1" in text and not ready.done():
                ready.set_result("ready")

    def on_exit() -> None:
        if not ready.done():
            ready.set_result("exited")

    pidfd = os.pidfd_open(proc.pid)
    loop.add_reader(notify.fileno(), on_notify)
    loop.add_reader(pidfd, on_exit)
    try:
        async with asyncio.timeout(timeout):
            outcome = await ready
    except TimeoutError:
        outcome = f"no READY in {timeout:g}s"
    except BaseException:
        service.stop()
        raise
    finally:
        loop.remove_reader(notify.fileno())
        loop.remove_reader(pidfd)
        os.close(pidfd)
        notify.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path.with_suffix(".notify").unlink()
    if outcome != "ready":
        service.stop()
        said = " | ".join(await asyncio.to_thread(service.last_lines, wait=5.0))
        raise PodmanError(
            ["system", "service", f"unix://{socket_path}"],
            proc.returncode if proc.returncode is not None else -1,
            f"the Podman API service did not start ({outcome}): {said}",
        )
    return service
