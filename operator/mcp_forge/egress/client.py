"""The gateway's side of the egress proxy: start it when a session first needs it, hand it
each session's socket and rules, and start it again (with every session) as soon as it dies,
waiting longer each time while it keeps dying.

The proxy (`server.py`) runs in its own venv, confined like the gateway's other host-side
work on untrusted input (confine.py: uid 65534, a bubblewrap sandbox, limits, no
capabilities), with the host's network since reaching hosts is its job. It holds no right
on the host's files: the gateway binds each session's socket where the session's pod sees
it and passes the descriptor. The control socket is a socket pair: when the gateway goes,
the proxy goes (bwrap's --die-with-parent, and the end of its control stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp_forge import confine
from mcp_forge.api.keys import BridgeCert
from mcp_forge.egress import audit, protocol
from mcp_forge.errors import ForgeError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)
MEMORY = 2 << 30  # address space: mitmproxy's threads and OpenSSL's arenas
OPEN_FILES = 8192  # a connection holds four: the session's, the relay's pair, the server's
AUDIT_LINE_MAX = 4096
RESTART_DELAY_MAX = 60.0  # the longest wait before starting a proxy that keeps dying again
STEADY = 60.0  # a proxy that ran this long and died is started again at once


class EgressUnavailable(ForgeError):
    """The egress proxy is not installed or did not start."""


@dataclass(frozen=True)
class Given:
    """What the proxy gets for a session besides its socket."""

    token: str
    rules: list[Any]
    ca: BridgeCert | None = None  # for destinations it reads (adds values to, checks paths)
    values: list[list[Any]] = field(default_factory=list, repr=False)  # [rule, index, value]


@dataclass
class Opened:
    given: Given
    listener: socket.socket
    # The socket file the listener was bound to when opened, (device, inode): the
    # listener's own fstat names the socket, never its file. The listener holds the file's
    # inode, so no other file takes its number while the session is open.
    file: tuple[int, int] | None = None

    def serves(self, path: Path) -> bool:
        """Is the socket file at `path` this listener's (not one bound there since)?"""
        try:
            here = path.stat()
        except OSError:
            return False
        return self.file == (here.st_dev, here.st_ino)


def _file_of(listener: socket.socket) -> tuple[int, int] | None:
    """(device, inode) of the file at the path `listener` is bound to; None if it has none."""
    path = listener.getsockname()
    if not isinstance(path, str) or not path:  # unbound, or abstract (bytes)
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def default_python() -> Path:
    """The egress venv's Python: .venv-egress beside the gateway's venv."""
    return Path(sys.prefix).parent / ".venv-egress" / "bin" / "python"


class EgressProxy:
    """One egress proxy process for this gateway's sessions."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.python = Path(settings.egress_python or default_python())
        self.confdir = settings.state_dir / "egress"
        self.sessions: dict[str, Opened] = {}
        self.port = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._control: socket.socket | None = None
        self._reader: protocol.Reader | None = None
        self._lock = asyncio.Lock()  # one request and its answer at a time
        self._call_lock = threading.Lock()
        self._watches: set[asyncio.Task[None]] = set()  # one per process, until it exits
        self._restart: asyncio.Task[None] | None = None
        self._restart_delay = 0.0  # before the next start again: 0, then 1 s doubling

    async def open(self, name: str, given: Given, listener: socket.socket) -> None:
        """Serve `listener` (bound where the session's pod sees it, just now) for session
        `name`."""
        opened = Opened(given, listener, _file_of(listener))
        async with self._lock:
            await self._running()
            await self._send_open(name, opened)
            old = self.sessions.pop(name, None)
            if old is not None and old.listener is not listener:
                old.listener.close()
            self.sessions[name] = opened

    async def close(self, name: str) -> None:
        async with self._lock:
            opened = self.sessions.pop(name, None)
            if opened is None:
                return
            opened.listener.close()
            if self._alive():
                await self._call({"op": "close", "session": name})

    async def stats(self) -> dict[str, dict[str, int]]:
        async with self._lock:
            if not self._alive():
                return {}
            answer = await self._call({"op": "stats"})
            return dict(answer.get("sessions", {}))

    async def stop(self) -> None:
        """End the proxy and every session's listener; nothing starts it again but an open."""
        async with self._lock:
            listeners = [opened.listener for opened in self.sessions.values()]
            self.sessions.clear()  # first: a proxy without sessions is not started again
            self._stop_process()
            for task in (self._restart, *self._watches):
                if task is not None:
                    task.cancel()
            for listener in listeners:
                listener.close()

    # ---- the process ---------------------------------------------------------------

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def _running(self) -> None:
        """The proxy, started (again) if it is not running, with every open session."""
        if self._alive():
            return
        self._stop_process()
        await self._start()
        for name, opened in list(self.sessions.items()):
            await self._send_open(name, opened)

    async def _start(self) -> None:
        if not self.python.exists():
            raise EgressUnavailable(
                f"the egress proxy's Python {self.python} is missing: .ci/setup makes "
                ".venv-egress (or set MCPFORGE_EGRESS_PYTHON)"
            )
        self.confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        confine.give(self.confdir, recursive=True)
        ours, theirs = socket.socketpair()
        argv = [
            str(self.python), "-I", "-m", "mcp_forge.egress.server",
            "--control-fd", str(theirs.fileno()), "--confdir", str(self.confdir),
            "--connections-max", str(self.settings.egress_connections_max),
            "--bandwidth-max", str(self.settings.egress_bandwidth_max),
        ]  # fmt: skip
        readable = [self.python.parent.parent]
        for flag, value in (
            ("--resolve", self.settings.egress_resolve),
            ("--upstream-ca", self.settings.egress_upstream_ca),
        ):
            if value:
                argv += [flag, value]
                readable.append(Path(value))
        wrapped = confine.command(
            argv,
            writable=[self.confdir],
            network=True,
            readable=readable,
            limits=confine.Limits(memory=MEMORY, open_files=OPEN_FILES),
            what="the egress proxy",
        )
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *wrapped,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control, self._reader = ours, protocol.Reader(ours)
        asyncio.create_task(_audit(self._proc))  # noqa: RUF006 (it ends with the process)
        watch = asyncio.create_task(self._watch(self._proc))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)
        try:
            async with asyncio.timeout(self.settings.egress_ready_timeout):
                ready = await asyncio.to_thread(self._read)
        except (TimeoutError, OSError, ValueError) as exc:
            self._stop_process()
            raise EgressUnavailable(f"the egress proxy did not start: {exc}") from None
        self.port = int(ready.get("port", 0))
        log.info("egress proxy started (pid %s, port %s)", self._proc.pid, self.port)

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """When `proc` exits while sessions are open, start the proxy again with them: at
        once if it had run STEADY seconds, else after a wait doubling from 1 s to 60 s."""
        started = time.monotonic()
        code = await proc.wait()
        if self._proc not in (proc, None) or not self.sessions:
            return  # replaced by a newer process, or stopped
        if time.monotonic() - started >= STEADY:
            self._restart_delay = 0.0
        log.warning(
            "egress proxy exited (%s) with %d sessions open: starting it again in %.0f s",
            code, len(self.sessions), self._restart_delay,
        )  # fmt: skip
        if self._restart is None or self._restart.done():
            self._restart = asyncio.create_task(self._start_again())

    async def _start_again(self) -> None:
        """Start the proxy again with every open session, until it runs or none is open."""
        while True:
            delay = self._restart_delay
            self._restart_delay = min(max(1.0, 2 * delay), RESTART_DELAY_MAX)
            await asyncio.sleep(delay)  # the backoff
            async with self._lock:
                if self._alive() or not self.sessions:
                    return
                try:
                    await self._running()
                except Exception as exc:
                    self._stop_process()  # all or nothing: every session, next time
                    log.warning("egress proxy not started again: %s", exc)
                    continue
                log.info("egress proxy started again with %d sessions", len(self.sessions))
                return

    def _stop_process(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = self._reader = None
        if self._alive():
            assert self._proc is not None
            self._proc.kill()
        self._proc = None

    # ---- the control socket --------------------------------------------------------

    async def _send_open(self, name: str, opened: Opened) -> None:
        given = opened.given
        message: dict[str, Any] = {
            "op": "open",
            "session": name,
            "token": given.token,
            "rules": given.rules,
            "values": given.values,
        }
        if given.ca is not None:
            message["ca"] = {"cert": given.ca.cert, "key": given.ca.key}
        answer = await self._call(message, [opened.listener.fileno()])
        if not answer.get("ok"):
            raise EgressUnavailable(f"the egress proxy refused session {name}: {answer}")

    async def _call(self, message: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        control = self._control
        if control is None:
            raise EgressUnavailable("the egress proxy is not running")
        try:
            protocol.encoded(message)  # too large is this message's fault, not the proxy's
        except ValueError as exc:
            raise EgressUnavailable(f"the egress proxy was not asked: {exc}") from None

        def call() -> dict[str, Any]:
            with self._call_lock:
                protocol.send(control, message, fds)
                return self._read()

        try:
            async with asyncio.timeout(self.settings.egress_ready_timeout):
                return await asyncio.to_thread(call)
        except (TimeoutError, OSError, ValueError) as exc:
            self._stop_process()  # _watch starts it again, with every session
            raise EgressUnavailable(f"the egress proxy did not answer: {exc!r}") from None

    def _read(self) -> dict[str, Any]:
        if self._reader is None:
            raise OSError("no control socket")
        got = self._reader.read()
        if got is None:
            raise OSError("the egress proxy closed its control socket")
        return got[0]


async def _audit(proc: asyncio.subprocess.Process) -> None:
    """The proxy's verdicts (JSON lines on its stderr) into the gateway's log."""
    assert proc.stderr is not None
    while True:
        try:
            line = await proc.stderr.readline()
        except (ValueError, asyncio.LimitOverrunError):  # a line past the stream's limit
            continue
        if not line:
            break
        text = line[:AUDIT_LINE_MAX].decode(errors="replace").rstrip()
        try:
            record = json.loads(text)
        except ValueError:
            log.warning("egress proxy: %s", text)
            continue
        if isinstance(record, dict):
            audit.record(record)
        log.info("egress %s", json.dumps(record, separators=(",", ":")))
    log.info("egress proxy exited (%s)", await proc.wait())
