"""The gateway's connections to kernels: opened, kept and dropped per session
(`Connections`, a part of `Gateway`).

It holds one connection per session it has used, and nothing else: the connection info
comes from the runtime (store or Secret) whenever the kernel changes (a new connection
generation), so a new gateway process reattaches to running kernels with their variables
intact. A session read Ready is dialled while the runtime makes its status true, the idle
probe sent on the new connection; a dial the refresh makes unwanted is cancelled and
closed. Once the kernel answers, `KernelSetup` (attach.py) makes the connection ready:
busy check, output guard, packages, code mode's bridge. A new session is connected in the
background (`prepare`), ahead of its first call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from mcp_forge.api import forks
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time
from mcp_forge.errors import ApiError, ForgeError, SessionNotFound, SessionNotReady
from mcp_forge.gateway.attach import Handle, KernelSetup
from mcp_forge.gateway.codemode.upstream import UpstreamPool
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.logsafe import shown
from mcp_forge.runtimes.base import Kernels
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

HOLD_RECHECK = 0.5  # seconds: a session held by its fork (`_unheld`) is read again this often
# A call whose session was read longer ago than this when it starts looks at holds again
# (a fork's checkpoint waits forks.HOLD_SETTLE after its hold, for calls begun before it).
HOLD_STALE = 1.0


def kernel_of(session: KernelSession) -> tuple[Any, Any]:
    """(connection generation, kernel id): the kernel a connection is to (Handle.kernel)."""
    status = session.status
    return (status.get("connection") or {}).get("generation"), status.get("kernelId")


async def _let_go(dial: asyncio.Future[tuple[KernelConnection, str]] | None) -> None:
    """Cancel a connection being made that is not wanted any more, and close it if it
    was made meanwhile."""
    if dial is None:
        return
    dial.cancel()
    await asyncio.wait({dial})
    if not dial.cancelled() and dial.exception() is None:
        dial.result()[0].close()


def _backoff_left(session: KernelSession) -> float | None:
    """Seconds until a session in a crash-loop backoff starts its kernel again, if it is."""
    status = session.status
    if (status.get("phase"), status.get("reason")) != (st.RESTARTING, st.CRASH_LOOP_BACKOFF):
        return None
    at = parse_time((status.get("lastTermination") or {}).get("nextStartAt"))
    return None if at is None else max(0.0, at - time.time())


class Connections:
    """The kernel connections of the sessions this gateway has used: a `Handle` per
    incarnation of a session (namespace, name, uid), its connection made when a call
    needs it (or ahead, `prepare`), kept while its kernel stays, dropped when it does not."""

    def __init__(self, runtime: Kernels, settings: Settings, upstreams: UpstreamPool) -> None:
        self.runtime = runtime
        self.settings = settings
        self.upstreams = upstreams
        self._handles: dict[tuple[str, str, str], Handle] = {}
        self._setup = KernelSetup(self.runtime, self.settings, self.upstreams)
        self._preparing: set[asyncio.Task[None]] = set()
        releasers = getattr(runtime, "releasers", None)  # local mode: told before a checkpoint
        if isinstance(releasers, list):
            releasers.append(self.release)

    def _handle(self, session: KernelSession) -> Handle:
        key = (session.namespace, session.name, session.uid)
        return self._handles.setdefault(key, Handle())

    def _forget(self, namespace: str, name: str, *, keep: str | None = None) -> None:
        """Drop connections to incarnations of this session other than `keep`.

        Only an idle one: a handle whose lock is held is in use by a call in flight.
        """
        for key in [k for k in self._handles if k[:2] == (namespace, name) and k[2] != keep]:
            handle = self._handles[key]
            if not handle.lock.locked():
                self._drop(handle)
                del self._handles[key]

    def ended(self, namespace: str, name: str) -> None:
        """The session is gone (closed, deleted): drop what this gateway held for any
        incarnation of it, and free its isolated upstreams now (not after their linger)."""
        for key in [k for k in self._handles if k[:2] == (namespace, name)]:
            self._drop(self._handles.pop(key))
            self.upstreams.end("/".join(key))

    async def release(self, session: KernelSession) -> None:
        """The session's kernel is about to be checkpointed (local mode's suspend with
        memory): every connection to it closed, so that no socket outside its pod leads
        to it. The next call connects again, to the kernel as restored."""
        for key in [k for k in self._handles if k[:2] == (session.namespace, session.name)]:
            self._drop(self._handles[key])

    async def close(self) -> None:
        releasers = getattr(self.runtime, "releasers", None)
        if isinstance(releasers, list) and self.release in releasers:
            releasers.remove(self.release)
        for task in self._preparing:
            task.cancel()
        await asyncio.gather(*self._preparing, return_exceptions=True)
        for handle in self._handles.values():
            self._drop(handle)
        self._handles.clear()

    def prepare(self, session: KernelSession) -> None:
        """Connect to a new session's kernel in the background (its output guard, its
        code-mode bridge), so its first call does not wait for that. A call that comes
        meanwhile waits for the connection, as it would have made it itself."""
        task = asyncio.ensure_future(self._prepare(session))
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    async def _prepare(self, session: KernelSession) -> None:
        handle = self._handle(session)
        try:
            async with handle.lock:
                await self._connect(handle, session, fresh=True)
        except (ForgeError, OSError, TimeoutError) as exc:  # the first call says it again
            # Its text may be the kernel's (an exception of code it ran): debug only.
            log.info("could not connect to new session %s ahead of use", session.name)
            log.debug("session %s: %s", session.name, shown(exc, 500))

    async def _session(
        self, name: str, namespace: str, *, read: KernelSession | None = None, hold: bool = True
    ) -> KernelSession:
        """The session, ready to take work; `read` is one the caller has just read. With
        `hold`, once no fork of it holds it (`_unheld`)."""
        if read is not None:
            session = read
        else:
            try:
                session = await self.runtime.get(name, namespace)
            except SessionNotFound:
                self.ended(namespace, name)  # deleted elsewhere: close what we held
                raise
        self._forget(namespace, name, keep=session.uid)
        phase = session.status.get("phase")
        if phase in (st.FAILED, st.TERMINATING, st.PENDING, st.EXPIRED) or (
            phase == st.SUSPENDED and session.status.get("reason") != st.IDLE
        ):
            why = session.status.get("message") or session.status.get("reason") or ""
            raise SessionNotReady(f"session {name!r} is {phase}" + (f": {why}" if why else ""))
        if hold and forks.live_holds(session.status, time.time()):
            session = await self._unheld(session)
        return session

    async def _still_unheld(self, session: KernelSession, read_at: float) -> None:
        """Before a call starts: holds looked at again if the session was read more than
        HOLD_STALE ago (it waited its turn, or for its connection)."""
        if time.monotonic() - read_at > HOLD_STALE:
            await self._unheld(await self.runtime.get(session.name, session.namespace))

    async def _unheld(self, session: KernelSession) -> KernelSession:
        """The session once no fork holds it (api/forks.py HOLDS: a fork's copy of its
        workspace under way, on a cluster), waited for up to the settings' lock_wait, as
        a helper waits for a call before it; SessionNotReady naming the fork past that.
        A fork that cannot be read now is taken to hold it still."""
        deadline = time.monotonic() + self.settings.lock_wait
        while True:
            holding = forks.live_holds(session.status, time.time())
            for fork, entry in holding.items():
                try:
                    body = (await self.runtime.get(fork, session.namespace)).body
                except SessionNotFound:
                    body = None
                except ApiError as exc:  # the API, for now: looked at again
                    log.warning("could not read %s, which holds %s: %s", fork, session.name, exc)
                    break
                if forks.holding(body, str(entry.get("uid"))):
                    break
            else:
                return session  # none left, or only those of forks gone or done
            if time.monotonic() >= deadline:
                raise SessionNotReady(
                    f"session {session.name!r} is being forked: its workspace is being copied "
                    f"for {fork!r}; try again once that ends"
                )
            await asyncio.sleep(HOLD_RECHECK)
            session = await self.runtime.get(session.name, session.namespace)

    def _new_connection(self, info: Any) -> KernelConnection:
        s = self.settings
        return KernelConnection(
            info, max_frame=s.frame_max, max_message=s.message_max, monitor=True
        )

    async def _connect(
        self, handle: Handle, session: KernelSession, *, fresh: bool = False
    ) -> KernelConnection:
        """The handle's connection to the session's kernel, made ready if it is new.
        `fresh`: the session is as the runtime has just made it Ready (create_session),
        whose kernel it has just spoken to: its status is not made true again."""
        ready = session.status.get("phase") == st.READY
        if handle.conn is not None and handle.kernel == kernel_of(session) and ready:
            return handle.conn
        self._drop(handle)
        # A session read Ready is dialled while the runtime makes its status true (a
        # store read, a look at its container): the kernel answers meanwhile. If the
        # refresh finds another kernel, or none, that connection is let go.
        dialled = kernel_of(session)
        early = asyncio.ensure_future(self._dial(session)) if ready else None
        try:
            if not (fresh and ready):
                session = await self._ready(session)
            if early is not None and kernel_of(session) == dialled:
                (conn, probe), early = await early, None
            else:
                await _let_go(early)
                conn, probe = await self._dial(session)
        except BaseException:
            await _let_go(early)
            raise
        handle.conn, handle.kernel = conn, kernel_of(session)
        try:
            await self._setup.prepare(handle, session, conn, probe)
        except BaseException:
            self._drop(handle)  # the next call tries again (a failure is named)
            raise
        return conn

    async def _ready(self, session: KernelSession) -> KernelSession:
        """The session refreshed (runtimes restart a dead kernel), once Ready;
        SessionNotReady saying its phase if it is not."""
        session = await self.runtime.refresh(session)
        wait = _backoff_left(session)
        if wait is not None and wait <= self.settings.backoff_wait:
            # A kernel killed twice in a row starts again in a few seconds: the call waits
            # for it rather than fail (a real crash loop then dies again, and says so).
            await asyncio.sleep(wait)
            session = await self.runtime.refresh(session)
        if session.status.get("phase") != st.READY:
            raise SessionNotReady(
                f"session {session.name!r} is {session.status.get('phase')}: "
                f"{session.status.get('message', '')}"
            )
        return session

    async def _dial(self, session: KernelSession) -> tuple[KernelConnection, str]:
        """A new connection to the session's kernel, once it answers, and the idle probe
        sent on it (attach.py), whose answer comes meanwhile."""
        conn = self._new_connection(await self.runtime.connection(session))
        try:
            probe = self._setup.probe(conn)
            await conn.wait_ready(
                self.settings.kernel_ready_timeout, retry=self.settings.kernel_info_retry
            )
        except BaseException:
            conn.close()
            raise
        return conn, probe

    def _drop(self, handle: Handle) -> None:
        if handle.bridge is not None:
            handle.bridge.abort()
            handle.bridge = None
        if handle.conn is not None:
            handle.conn.close()
        handle.conn = None
        handle.kernel = (None, None)
