"""Podman through its REST API: podman-py for calls, the event stream read directly.

Which service: the socket Debian's podman package ships for systemd
(/run/podman/podman.sock, `systemctl enable --now podman.socket`) when it answers; else
one this process starts, owns and stops when it exits (clients/podman_service.py).
Should that one die, the next call that cannot reach it starts another on the same
socket (`PodmanApi.revive`).

podman-py is synchronous (requests): its calls run in a small thread pool of ours, one
client per thread, never on the event loop. Its errors become PodmanError here. This is
the only module that imports podman-py (.importlinter).

The event stream is read with asyncio from the same socket, its bytes parsed by
clients/podman_stream.py, which says what Podman emits and why podman-py's `events()`
is not used.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import podman
import podman.errors
import requests

from mcp_forge.clients import podman_stall
from mcp_forge.clients.podman_service import Service, runtime_dir, start_service
from mcp_forge.clients.podman_stream import (
    EVENT_LINE_MAX,
    EVENTS_PATH,
    Event,
    demux,
    parse_event,
    read_headers,
    read_lines,
)
from mcp_forge.errors import PodmanError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

SYSTEM_SOCKET = Path("/run/podman/podman.sock")
PING_TIMEOUT = 2.0  # a systemd socket that does not answer this fast is not used
RECONNECT_FIRST = 0.1  # event stream: the first reconnect waits this long, doubling up to
RECONNECT_MAX = 5.0
DEATH_GRACE = 0.5  # seconds a service whose socket refused us has to be seen exited
WATCH_EVERY = 1.0  # s: a call running this long has our service watched, this often

T = TypeVar("T")


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
        self._watches: set[asyncio.Future[None]] = set()  # podman_stall's, of calls running
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

        used = self.service
        try:
            return await self._watched(self._pool.submit(run), what, used)
        except PodmanError as exc:
            if exc.returncode != -1 or not await self.revive(used):
                raise
        used = self.service  # once, on the new service
        return await self._watched(self._pool.submit(run), what, used)

    async def _watched(
        self, call: concurrent.futures.Future[T], what: str, used: Service | None
    ) -> T:
        """`call`'s result. While it runs (past a second), our own service is watched for
        Podman 4.3.1's lock inversion (podman_stall.py) and killed if stuck in it: the
        process it blocked goes on at once, and the call, cut off, is tried again on a new
        service (_call). The watch outlives a caller that gave up: the request is still
        stuck in the service. A service someone else runs is only waited for."""
        if used is not None:
            watch = asyncio.ensure_future(self._watch(call, what, used))
            self._watches.add(watch)
            watch.add_done_callback(self._watches.discard)
        return await asyncio.wrap_future(call)

    async def _watch(self, call: concurrent.futures.Future[Any], what: str, used: Service) -> None:
        stall: podman_stall.Stall | None = None
        ended = asyncio.wrap_future(call)
        ended.add_done_callback(lambda f: f.cancelled() or f.exception())  # the caller's
        while not (await asyncio.wait({ended}, timeout=WATCH_EVERY))[0]:
            if self._closed or used.proc.poll() is not None:
                return
            stall = stall or podman_stall.Stall(used.proc.pid)
            stuck = await asyncio.to_thread(stall.check)
            if stuck is None or call.done() or used.proc.poll() is not None:
                continue
            log.warning(
                "podman API service (pid %d) is stuck in Podman's store answering %s: %s; "
                "killing it",
                used.proc.pid,
                what,
                stuck.why,
            )
            if stuck.ours != used.proc.pid:  # its child (rootless): the one holding the locks
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stuck.ours, signal.SIGKILL)
            used.proc.kill()
            return

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
            # As the CLI (local/kernelpods.py's _remove_pod): the container's /dev/shm may still
            # be busy while its processes die, and the pod is left half removed; a second
            # delete finishes it.
            for attempt in (1, 2, 3):
                r = c.api.delete(f"/pods/{quoted}", params={"force": True})
                if r.status_code == 404:
                    return attempt > 1  # gone by the first delete, half done
                if r.status_code < 400 or "resource busy" not in r.text or attempt == 3:
                    break
                said = " ".join(r.text.split())[-200:]
                log.info("podman left pod %s half removed (%s); removing it again", name, said)
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
                chunked = await read_headers(reader)
                if on_connect is not None:
                    on_connect()
                if not first:
                    yield Event("", resync=True)
                first = False
                delay = RECONNECT_FIRST
                async for line in read_lines(reader, chunked=chunked):
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


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


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


def release(holding: frozenset[int]) -> bool:
    """Kill this process's own API service if it is among `holding`, the processes that
    held a lock of Podman's store while a command stalled (PodmanTimeout): Podman 4.3.1's
    service can stall in its store with the locks held (podman_locks), and every later
    command waits behind it. The next call starts another (`revive`). True if it was ours
    and killed; a service someone else runs is never touched."""
    api = _shared
    service = api.service if api is not None else None
    if service is None or service.proc.poll() is not None:
        return False
    held = podman_stall.family(service.proc.pid) & holding  # rootless: its child's locks
    if not held:
        return False
    log.warning(
        "podman API service (pid %d) held Podman's store while a command stalled; killing it",
        service.proc.pid,
    )
    for pid in held - {service.proc.pid}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    service.proc.kill()
    return True
