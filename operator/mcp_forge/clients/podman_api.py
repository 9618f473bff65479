"""Podman through its REST API: podman-py for calls, the event stream read directly.

Which service: the socket Debian's podman package ships for systemd
(/run/podman/podman.sock, `systemctl enable --now podman.socket`) when it answers; else
this process starts `podman system service --time=0 unix://…/podman-<pid>.sock` once,
waits for its sd_notify READY (no polling), and stops it when the process exits (atexit,
and PR_SET_PDEATHSIG if the process dies without running atexit). One service per
process, so two processes (a gateway and `mcp-forge apply`) never stop each other's.
Its stderr is read for as long as it runs, each line into our log: Podman is a Go
program, and Go exits on SIGPIPE when a write to its stderr finds the pipe closed (seen:
the first warning it logged, a pod it could not remove, killed it). Should it die all the
same, the next call that cannot reach it starts another on the same socket.

podman-py is synchronous (requests): its calls run in a small thread pool of ours, one
client per thread, never on the event loop. Its errors become PodmanError here.

The event stream is read with asyncio from the same socket (GET /libpod/events, chunked
JSON lines): podman-py's `events()` is a blocking generator that nothing can cancel. What
Podman 4.3.1 emits, seen on this host (cgroup v1 "hybrid", runc, events_logger = "file"):

- a kernel that exits or is killed (`kill -9` of its process, or `podman kill`): `died`,
  with `containerExitCode` (137 for SIGKILL) and the container's labels, about 0.2 s
  later, then `cleanup`; its pod's infra container then dies too (`died`, no labels).
  (`podman kill` also emits `kill` first.) There is no `exited` status.
- a kernel killed by the OOM killer: the same `died`, exit code 137. No `oom` event, not
  even when the container's init is the one killed, and inspect's OOMKilled stays false
  (cgroup v1): containers.py tells an OOM kill from the kernel log.
- `podman pod rm`: `remove` for each container (a running one `died` first).
The file event logger is read by polling (every 250 ms), hence the delay; journald's
would be sooner. Events carry no sequence number: after a reconnect the iterator says
so (`Event.resync`), and the consumer must look at everything again.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import podman
import podman.errors
import requests

from mcp_forge.errors import PodmanError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

SYSTEM_SOCKET = Path("/run/podman/podman.sock")
# The libpod API prefix for the event stream: any version up to the server's is accepted.
EVENTS_PATH = "/v4.0.0/libpod/events"
EVENT_LINE_MAX = 64 * 1024  # one event's JSON; a longer line is skipped, not buffered
STATUS_LINE_MAX = 8 * 1024  # an HTTP status or header line of the event stream
HEADERS_MAX = 100
PING_TIMEOUT = 2.0  # a systemd socket that does not answer this fast is not used
RECONNECT_FIRST = 0.1  # event stream: the first reconnect waits this long, doubling up to
RECONNECT_MAX = 5.0
DEATH_GRACE = 0.5  # seconds a service whose socket refused us has to be seen exited
SERVICE_LINE_MAX = 8 * 1024  # one line of our service's stderr; a longer one is split
SERVICE_LINES_KEPT = 20  # its last lines, for the message if it dies or cannot start

T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    """One container event (or, with `resync`, the news that events may have been missed)."""

    status: str  # "died", "remove", "oom", ... ("" for a resync)
    name: str = ""
    id: str = ""
    exit_code: int | None = None
    time_ns: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    resync: bool = False


def parse_event(line: bytes) -> Event | None:
    """An event from one line of the stream; None if it is not a container event we read."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or raw.get("Type") != "container":
        return None
    actor: dict[str, Any] = raw["Actor"] if isinstance(raw.get("Actor"), dict) else {}
    attrs: dict[str, Any] = actor["Attributes"] if isinstance(actor.get("Attributes"), dict) else {}
    code = attrs.get("containerExitCode")
    try:
        exit_code = int(code) if code is not None else None
    except (TypeError, ValueError):
        exit_code = None
    labels = {
        str(k): str(v)
        for k, v in attrs.items()
        if k not in ("name", "image", "containerExitCode", "podId")
    }
    return Event(
        status=str(raw.get("status") or raw.get("Action") or ""),
        name=str(attrs.get("name") or ""),
        id=str(actor.get("ID") or raw.get("id") or ""),
        exit_code=exit_code,
        time_ns=int(raw.get("timeNano") or 0),
        labels=labels,
    )


class PodmanApi:
    """A Podman API service and the calls the local runtime makes through it.

    Get the process's one instance with `await connect()`.
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        timeout: float,
        owned: Service | None,
        binary: str | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.service = owned
        self.binary = binary  # to start the owned service again should it die
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="podman-api")
        self._reviving: asyncio.Lock | None = None
        self._closed = False

    # ---- plumbing --------------------------------------------------------------------------

    def _client(self) -> podman.PodmanClient:
        client: podman.PodmanClient | None = getattr(self._local, "client", None)
        if client is None:
            client = podman.PodmanClient(
                base_url=f"unix://{self.socket_path}", timeout=self.timeout
            )
            self._local.client = client
        return client

    async def _call(self, what: str, fn: Callable[[podman.PodmanClient], T]) -> T:
        def run() -> T:
            try:
                return fn(self._client())
            except podman.errors.APIError as exc:
                if exc.response is None:  # not an answer: the service could not be reached
                    cause = exc.__cause__ or exc
                    raise PodmanError(
                        ["API", what], -1, f"cannot reach {self.socket_path}: {cause}"
                    ) from None
                status = exc.response.status_code
                raise PodmanError(["API", what], status, str(exc.explanation or exc)) from None
            except requests.RequestException as exc:
                if exc.response is not None:  # an answer (raise_for_status): its status
                    status = exc.response.status_code
                    raise PodmanError(["API", what], status, str(exc)) from None
                raise PodmanError(["API", what], -1, f"{self.socket_path}: {exc}") from None

        loop = asyncio.get_running_loop()
        used = self.service
        try:
            return await loop.run_in_executor(self._pool, run)
        except PodmanError as exc:
            if exc.returncode != -1 or not await self.revive(used):
                raise
        return await loop.run_in_executor(self._pool, run)  # once, on the new service

    async def revive(self, used: Service | None) -> bool:
        """Start our service again if `used`, the one a call could not reach, has died;
        True if a call should be tried again (on a new service, or one another caller
        started meanwhile). Never for a service someone else runs. Runs on the event
        loop's thread, as the first start did (PR_SET_PDEATHSIG).
        """
        if used is None or self.binary is None or self._closed:
            return False
        if self._reviving is None:
            self._reviving = asyncio.Lock()
        async with self._reviving:
            if self.service is not used:
                return True  # revived by another caller meanwhile
            dead = used
            # Its socket closes a moment before the process is gone: give it that moment.
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(dead.proc.wait, DEATH_GRACE)
            if dead.proc.poll() is None or self._closed:
                return False  # alive: the call failed for another reason
            log.warning(
                "podman API service (pid %d) exited with %s; starting another. Its last lines: %s",
                dead.proc.pid,
                dead.proc.returncode,
                " | ".join(dead.last_lines()) or "(none)",
            )
            try:
                revived = await start_service(
                    self.socket_path, binary=self.binary, timeout=self.timeout
                )
            except OSError as exc:
                raise PodmanError(["system", "service"], -1, f"cannot start: {exc}") from None
            if self.closed():  # closed while it started: nobody else would stop it
                revived.stop()
                return False
            self.service = revived
            return True

    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.service is not None:
            self.service.stop()

    # ---- calls -------------------------------------------------------------------------------

    async def image_exists(self, ref: str) -> bool:
        return await self._call("image exists", lambda c: bool(c.images.exists(ref)))

    async def inspect_container(self, name: str) -> dict[str, Any] | None:
        """The container's inspect data (as `podman container inspect`); None if none."""

        def inspect(c: podman.PodmanClient) -> dict[str, Any] | None:
            r = c.api.get(f"/containers/{_quote(name)}/json")
            if r.status_code == 404:
                return None
            r.raise_for_status()
            data = r.json()
            return data if isinstance(data, dict) else None

        return await self._call(f"container inspect {name}", inspect)

    async def containers(self, label: str, *, all: bool = False) -> list[dict[str, Any]]:
        """The containers with this label (`key=value`), as `podman ps --format json` rows."""

        def ps(c: podman.PodmanClient) -> list[dict[str, Any]]:
            params = {"all": all, "filters": json.dumps({"label": [label]})}
            r = c.api.get("/containers/json", params=params)
            r.raise_for_status()
            rows = r.json()
            return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []

        return await self._call("ps", ps)

    async def remove_pod(self, name: str) -> bool:
        """Kill the pod's containers at once and remove it; False if there was no such pod.

        The CLI's `pod rm -f -t 0` in two calls: 4.3.1's DELETE /pods has no stop timeout,
        so a forced delete alone would give the kernel its grace period first. Measured no
        faster than the CLI, with multi-second outliers: local mode keeps the CLI's.
        """

        def remove(c: podman.PodmanClient) -> bool:
            quoted = _quote(name)
            r = c.api.post(f"/pods/{quoted}/kill", params={"signal": "SIGKILL"})
            if r.status_code == 404:
                return False
            # 409: nothing runs in it any more; it is removed all the same.
            if r.status_code not in (200, 409):
                r.raise_for_status()
            # As the CLI (runtime.py's _remove_pod): the container's /dev/shm may still
            # be busy while its processes die, and the pod is left half removed; a second
            # delete finishes it.
            for attempt in (1, 2, 3):
                r = c.api.delete(f"/pods/{quoted}", params={"force": True})
                if r.status_code == 404:
                    return attempt > 1  # gone by the first delete, half done
                if r.status_code < 400 or "resource busy" not in r.text or attempt == 3:
                    break
                log.warning("podman failed removing pod %s (%s); again", name, r.text[-200:])
            r.raise_for_status()
            return True

        return await self._call(f"pod rm {name}", remove)

    async def play_kube(self, yaml: str, *, network: str | None = None) -> dict[str, Any]:
        """POST /play/kube. Podman 4.3.1's API has no --replace, --userns or
        --seccomp-profile-root (its handler reads network, logDriver, start, staticIPs,
        staticMACs, noHosts, tlsVerify and publishPorts only), so local kernel pods are
        still played by the CLI (clients/podman.py says why)."""

        def play(c: podman.PodmanClient) -> dict[str, Any]:
            params = {"network": network} if network else None
            r = c.api.post(
                "/play/kube",
                params=params,
                data=yaml.encode(),
                headers={"Content-Type": "application/x-yaml"},
            )
            r.raise_for_status()
            report = r.json()
            return report if isinstance(report, dict) else {}

        return await self._call("kube play", play)

    async def logs(self, name: str, *, tail: int, limit: int = 64_000) -> str | None:
        """The container's last `tail` lines (stdout and stderr), at most `limit` bytes of
        them; None if there is no such container."""

        def logs(c: podman.PodmanClient) -> str | None:
            params = {"stdout": True, "stderr": True, "tail": str(tail)}
            r = c.api.get(f"/containers/{_quote(name)}/logs", params=params, stream=True)
            try:
                if r.status_code == 404:
                    return None
                r.raise_for_status()
                chunks: list[bytes] = []
                size = 0
                for chunk in r.iter_content(16384):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > 4 * limit:  # the frames' headers count too
                        break
            finally:
                r.close()
            return demux(b"".join(chunks))[-limit:].decode(errors="replace")

        return await self._call(f"logs {name}", logs)

    # ---- events ------------------------------------------------------------------------------

    async def events(
        self,
        *,
        label: str | None = None,
        statuses: Iterable[str] = ("died", "remove", "oom"),
        on_connect: Callable[[], None] | None = None,
    ) -> AsyncIterator[Event]:
        """Container events as they happen, for ever: reconnects when the stream breaks.

        After each reconnect it yields Event(resync=True) first: events of the gap are
        lost. `on_connect` is called each time the stream is subscribed (headers read),
        so a caller knows from when on it hears of everything.
        """
        filters: dict[str, list[str]] = {"type": ["container"], "event": list(statuses)}
        if label:
            filters["label"] = [label]
        query = urllib.parse.urlencode({"stream": "true", "filters": json.dumps(filters)})
        request = f"GET {EVENTS_PATH}?{query} HTTP/1.1\r\nHost: podman\r\n\r\n".encode()
        delay = RECONNECT_FIRST
        first = True
        while True:
            used = self.service
            try:
                reader, writer = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=EVENT_LINE_MAX
                )
            except OSError as exc:
                with contextlib.suppress(PodmanError):
                    if await self.revive(used):
                        continue
                log.warning("podman events: cannot connect (%s); again in %.1fs", exc, delay)
                await asyncio.sleep(delay)  # a backoff, not a wait for something
                delay = min(delay * 2, RECONNECT_MAX)
                continue
            try:
                writer.write(request)
                chunked = await _read_headers(reader)
                if on_connect is not None:
                    on_connect()
                if not first:
                    yield Event("", resync=True)
                first = False
                delay = RECONNECT_FIRST
                async for line in _lines(reader, chunked=chunked):
                    event = parse_event(line)
                    if event is not None:
                        yield event
                log.warning("podman events: the stream ended; reconnecting")
            except (OSError, EOFError, PodmanError) as exc:
                log.warning("podman events: %s; reconnecting in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()


async def _read_headers(reader: asyncio.StreamReader) -> bool:
    """Read the response's status and headers; True if its body is chunked."""
    status = await _line(reader, STATUS_LINE_MAX)
    parts = status.split(b" ", 2)
    if len(parts) < 2 or parts[1] != b"200":
        raise PodmanError(["API", "events"], -1, status.decode(errors="replace")[:200])
    chunked = False
    for _ in range(HEADERS_MAX):
        line = (await _line(reader, STATUS_LINE_MAX)).strip()
        if not line:
            return chunked
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    raise PodmanError(["API", "events"], -1, "too many response headers")


async def _line(reader: asyncio.StreamReader, limit: int) -> bytes:
    line = await reader.readline()
    if not line:
        raise EOFError("the event stream closed")
    if len(line) > limit or not line.endswith(b"\n"):
        raise PodmanError(["API", "events"], -1, "a line of the response is too long")
    return line


async def _lines(reader: asyncio.StreamReader, *, chunked: bool) -> AsyncIterator[bytes]:
    """The body's lines, de-chunked; a line over EVENT_LINE_MAX is skipped whole."""
    pending = b""
    skipping = False
    while True:
        if chunked:
            size_line = await _line(reader, STATUS_LINE_MAX)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            data = data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return
        pending += data
        *whole, pending = pending.split(b"\n")
        for line in whole:
            if skipping:  # the tail of an over-long line
                skipping = False
                continue
            if line.strip():
                yield line
        if len(pending) > EVENT_LINE_MAX:
            pending = b""
            skipping = True


def demux(data: bytes) -> bytes:
    """The payload of a multiplexed log stream (8-byte frame headers), or `data` as is
    if it is not one (a container with a terminal)."""
    out = bytearray()
    at = 0
    while at + 8 <= len(data):
        kind, size = data[at], struct.unpack(">I", data[at + 4 : at + 8])[0]
        if kind not in (0, 1, 2) or data[at + 1 : at + 4] != b"\0\0\0":
            return data
        out += data[at + 8 : at + 8 + size]
        at += 8 + size
    return bytes(out)


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


# ---- the service ---------------------------------------------------------------------------


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


def _answers(path: Path) -> bool:
    """Does a Podman API service answer on this socket?"""
    if not path.is_socket():
        return False
    try:
        client = podman.PodmanClient(base_url=f"unix://{path}", timeout=PING_TIMEOUT)
        with contextlib.closing(client):
            return bool(client.ping())
    except (podman.errors.APIError, requests.RequestException, OSError):
        return False


_shared: PodmanApi | None = None
_starting: asyncio.Lock | None = None


async def connect(settings: Settings | None = None) -> PodmanApi:
    """The process's Podman API: the system socket if it answers, else a service of ours
    (started on first use, stopped at exit). Raises PodmanError if neither is possible."""
    global _starting
    if _shared is not None:
        return _shared
    if _starting is None:
        _starting = asyncio.Lock()
    async with _starting:
        return _shared or await _connect(settings)


async def _connect(settings: Settings | None) -> PodmanApi:
    global _shared
    settings = settings or Settings.from_env()
    override = os.environ.get("MCPFORGE_PODMAN_SOCKET")  # a service someone else runs
    if override:
        api = PodmanApi(Path(override), timeout=settings.podman_timeout, owned=None)
    elif await asyncio.to_thread(_answers, SYSTEM_SOCKET):
        api = PodmanApi(SYSTEM_SOCKET, timeout=settings.podman_timeout, owned=None)
    else:
        binary = os.environ.get("MCPFORGE_PODMAN") or shutil.which("podman")
        if binary is None:
            raise PodmanError(["system", "service"], 127, "podman is not installed")
        path = runtime_dir(settings) / f"podman-{os.getpid()}.sock"
        service = await start_service(path, binary=binary, timeout=settings.podman_timeout)
        api = PodmanApi(path, timeout=settings.podman_timeout, owned=service, binary=binary)
        atexit.register(api.close)
    _shared = api
    return api
