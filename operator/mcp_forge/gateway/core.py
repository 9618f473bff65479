"""The gateway's execution core: runs code in a session's kernel and says what happened.

It holds one connection per session it has used, and nothing else: the connection info
comes from the runtime (store or Secret) whenever the kernel changes (a new connection
generation), so a new gateway process reattaches to running kernels with their variables
intact. Calls on one session are queued (one lock per session); sessions run in parallel.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from mcp_forge import metrics, tracing
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time
from mcp_forge.errors import (
    ForgeError,
    InvalidRequest,
    KernelProtocolError,
    PackageError,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.gateway import busy, introspection
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.gateway.codemode.policy import policies_of
from mcp_forge.gateway.codemode.upstream import Upstream, UpstreamPool
from mcp_forge.gateway.notebook import Notebook
from mcp_forge.gateway.notebook_worker import ExportSlots, WorkerLimits, build_in_worker
from mcp_forge.gateway.sessions import owner_of
from mcp_forge.image import packages
from mcp_forge.jupyter.client import ChannelDropped, KernelConnection, KernelReplaced
from mcp_forge.jupyter.execution import (
    EVALUE_MAX,
    GUARD_KEY,
    NOTEBOOK_JOURNAL,
    OUTPUT_DIR,
    TRACEBACK_MAX,
    Collector,
    ExecutionResult,
    Status,
)
from mcp_forge.kernelside import compiled, run_silently
from mcp_forge.logsafe import shown
from mcp_forge.runtimes.base import Runtime
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

REPLACED = "it was restarted while the call ran (a new kernel process answers)"
OUTPUT_FILES_KEPT = 20
BUSY_FROM_START = 10.0  # seconds: the margin past activity_interval (see execute)
_WRITE_CHUNK = 1_000_000
_JOURNAL_WINDOW = 1_000_000  # bytes of the notebook journal read at once (see there)

StreamCallback = Callable[[str, str], None]


@dataclass
class _Handle:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conn: KernelConnection | None = None
    kernel: tuple[Any, Any] = (None, None)  # (connection generation, kernel id) of conn
    activity_recorded: float = float("-inf")  # monotonic time of the last record_activity
    busy: bool = False  # as last recorded
    bridge: Bridge | None = None  # code mode: this kernel's bridge, if the session has one
    execution_count: int | None = None  # the kernel's, after this gateway's last call


def _kernel_of(session: KernelSession) -> tuple[Any, Any]:
    status = session.status
    return (status.get("connection") or {}).get("generation"), status.get("kernelId")


def _backoff_left(session: KernelSession) -> float | None:
    """Seconds until a session in a crash-loop backoff starts its kernel again, if it is."""
    status = session.status
    if (status.get("phase"), status.get("reason")) != (st.RESTARTING, st.CRASH_LOOP_BACKOFF):
        return None
    at = parse_time((status.get("lastTermination") or {}).get("nextStartAt"))
    return None if at is None else max(0.0, at - time.time())


class Gateway:
    """Execution, interruption, restart, introspection and files, per session."""

    def __init__(
        self,
        runtime: Runtime,
        settings: Settings | None = None,
        *,
        upstreams: UpstreamPool | dict[str, Upstream] | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = settings or Settings.from_env()
        # Code mode: the servers of --mcp-config (a plain dict: every session shares them).
        self.upstreams = (
            upstreams if isinstance(upstreams, UpstreamPool) else UpstreamPool.of(upstreams or {})
        )
        self._handles: dict[tuple[str, str, str], _Handle] = {}
        self._guard_code = guard_program(self.settings)
        self._preparing: set[asyncio.Task[None]] = set()
        self._exports = ExportSlots(
            total=self.settings.notebook_exports_max,
            per_client=self.settings.notebook_exports_per_client_max,
        )

    def _handle(self, session: KernelSession) -> _Handle:
        key = (session.namespace, session.name, session.uid)
        return self._handles.setdefault(key, _Handle())

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

    async def close(self) -> None:
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
                await self._connect(handle, session)
        except (ForgeError, OSError, TimeoutError) as exc:  # the first call says it again
            # Its text may be the kernel's (an exception of code it ran): debug only.
            log.info("could not connect to new session %s ahead of use", session.name)
            log.debug("session %s: %s", session.name, shown(exc, 500))

    async def _session(
        self, name: str, namespace: str, *, read: KernelSession | None = None
    ) -> KernelSession:
        """The session, ready to take work; `read` is one the caller has just read."""
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
        return session

    def _new_connection(self, info: Any) -> KernelConnection:
        s = self.settings
        return KernelConnection(
            info, max_frame=s.frame_max, max_message=s.message_max, monitor=True
        )

    async def _connect(self, handle: _Handle, session: KernelSession) -> KernelConnection:
        current = handle.kernel == _kernel_of(session) and session.status.get("phase") == st.READY
        if handle.conn is not None and current:
            return handle.conn
        self._drop(handle)
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
        conn = self._new_connection(await self.runtime.connection(session))
        try:
            await conn.wait_ready(
                self.settings.kernel_ready_timeout, retry=self.settings.kernel_info_retry
            )
        except BaseException:
            conn.close()
            raise
        handle.conn, handle.kernel = conn, _kernel_of(session)
        try:  # still running a call of a gateway gone since: say so now, not at a timeout
            await busy.check_idle(conn, session, self.settings.busy_probe)
        except BaseException:
            self._drop(handle)
            raise
        setup = await self.runtime.kernel_setup(session)
        if setup:
            try:
                await self._silently(
                    conn, setup, "the kernel did not take its environment and working files"
                )
            except BaseException:
                self._drop(handle)
                raise
        try:
            await self._silently(conn, self._guard_code, "the kernel's output guard failed")
        except SessionNotReady as exc:
            # Code may have broken what the guard wraps; the gateway's own bounds still hold.
            # Why is the kernel's exception, its words: at debug only.
            log.warning("session %s runs without its output guard", session.name)
            log.debug("session %s: %s", session.name, shown(exc, 500))
        if session.spec.packages:
            try:
                await self.runtime.kernel_packages(session, conn)
            except BaseException:
                self._drop(handle)  # the next call tries again (a failure is named)
                raise
        if session.spec.mcp_servers:
            try:
                await self._attach_bridge(handle, session, conn)
            except BaseException:
                self._drop(handle)
                raise
        return conn

    async def _attach_bridge(
        self, handle: _Handle, session: KernelSession, conn: KernelConnection
    ) -> None:
        """Start `mcp_tools` in the kernel (silently) and dial its bridge (docs/bridge.md)."""
        policies = policies_of(session.spec.mcp_servers)
        missing = sorted(n for n in policies if n not in self.upstreams)
        if missing:
            log.warning(
                "session %s names MCP servers this gateway does not have: %s",
                session.name,
                ", ".join(missing),
            )
        inside, address = await self.runtime.bridge_address(session)
        await self._silently(
            conn, introspection.bridge_program(inside), "the kernel could not start its MCP bridge"
        )
        # Per-session state outlives this bridge (a restart, a dropped connection): the
        # upstreams of isolated servers, and the meter of budgets and rates.
        lease = self.upstreams.lease(
            [n for n in policies if n in self.upstreams],
            session=f"{session.namespace}/{session.name}/{session.uid}",
            client=owner_of(session),
        )
        bridge = Bridge(
            session.name,
            lease.upstreams,
            policies,
            call_timeout=self.settings.bridge_call_timeout,
            meter=lease.meter,
            refused=lease.refused,
            on_close=lease.release,
            rate=functools.partial(self.runtime.count_call, session),  # shared by replicas
        )
        handle.bridge = bridge  # dropped with the handle, which releases the lease
        try:
            await bridge.open(address)
        except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
            raise SessionNotReady(f"the kernel's MCP bridge cannot be reached: {exc}") from exc
        # The user's next cell must find the tools: wait until the kernel applied the hello.
        await self._silently(
            conn,
            "assert __import__('sys').modules['mcp_tools'].wait_connected(10), "
            "'the MCP bridge did not connect'",
            "the kernel's MCP bridge did not take the gateway's connection",
        )

    async def _silently(self, conn: KernelConnection, code: str, failure: str) -> None:
        collector = Collector("", budget=10_000, spool_max=0, data_budget=0)
        await conn.before_request()
        collector.msg_id = conn.send_execute(code, silent=True, store_history=False)
        if not await conn.pump(collector, self.settings.helper_timeout):
            raise SessionNotReady(f"{failure} (no answer in {self.settings.helper_timeout:.0f}s)")
        result = collector.finish(duration=0)
        if result.status != "ok":
            err = result.error
            why = result.message or (f"{err.ename}: {err.evalue}" if err else result.status)
            raise SessionNotReady(f"{failure}: {why}")

    def _drop(self, handle: _Handle) -> None:
        if handle.bridge is not None:
            handle.bridge.abort()
            handle.bridge = None
        if handle.conn is not None:
            handle.conn.close()
        handle.conn = None
        handle.kernel = (None, None)

    async def _record_activity(
        self, handle: _Handle, session: KernelSession, *, busy: bool = False
    ) -> None:
        # lastActivity has a resolution of seconds and drives culling after minutes:
        # writing it once a second per session is enough, and keeps the store off the
        # hot path of a burst of small calls.
        now = time.monotonic()
        if busy == handle.busy and now - handle.activity_recorded < self.settings.activity_interval:
            return
        handle.activity_recorded, handle.busy = now, busy
        try:
            await self.runtime.record_activity(session, busy=busy)
        except ForgeError as exc:
            log.warning("could not record activity of %s: %s", session.name, exc)

    # ---- execute -------------------------------------------------------------------------

    def check_code(self, code: Any, timeout: Any) -> float:
        """Refuse bad code or timeout (InvalidRequest); the timeout to use, in seconds."""
        if not isinstance(code, str):
            raise InvalidRequest("code must be a string")
        if not code.strip():
            raise InvalidRequest("code is empty")
        if len(code.encode()) > self.settings.code_max:
            raise InvalidRequest(
                f"code is {len(code.encode())} bytes; the limit is {self.settings.code_max}"
            )
        if timeout is None:
            return self.settings.execute_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidRequest("timeout must be a number of seconds")
        if not 0 < timeout <= self.settings.execute_timeout_max:
            raise InvalidRequest(
                f"timeout must be more than 0 and at most {self.settings.execute_timeout_max:.0f} "
                f"seconds, got {timeout}"
            )
        return float(timeout)

    async def execute(
        self,
        name: str,
        code: str,
        *,
        timeout: float | None = None,
        namespace: str = "default",
        on_stream: StreamCallback | None = None,
        read: KernelSession | None = None,
    ) -> ExecutionResult:
        """Run `code` in the session's kernel. Errors of the code are in the result.

        `read` is the session as the caller has just read it (the MCP tool has, to check
        who may use it): it is not read again.

        `on_stream(name, text)` is called with stdout/stderr text as it arrives. If the
        caller is cancelled, the kernel is interrupted (and restarted if it does not
        stop) before the cancellation goes on.
        """
        seconds = self.check_code(code, timeout)
        session = await self._session(name, namespace, read=read)
        handle = self._handle(session)
        async with handle.lock:
            conn = await self._connect(handle, session)
            s = self.settings
            collector = Collector(
                "",
                budget=s.output_budget,
                spool_max=s.output_spool_max,
                data_budget=s.data_budget,
                on_stream=on_stream,
            )
            # A call is activity. It is marked busy (a lease the culler honours) once it has
            # run a heartbeat interval (in _run); from its start only when the session could
            # be culled before then: its lastActivity may be up to activity_interval old, so
            # an idle timeout within that plus a margin is marked at once. A burst of short
            # calls then writes the store once per activity_interval, not twice per call.
            idle = session.spec.idle_timeout
            soon = self.settings.activity_interval + BUSY_FROM_START
            await self._record_activity(handle, session, busy=0 < idle < soon)
            with tracing.span("kernel execute", session=session.name) as span:
                if handle.bridge is not None:
                    handle.bridge.new_execution(tracing.current())
                try:
                    result = await self._run(handle, conn, session, code, seconds, collector)
                except asyncio.CancelledError:
                    await self._settle_after_cancel(handle, conn, session, collector)
                    raise
                except BaseException:
                    await self._record_activity(handle, session)
                    raise
                span.set_attribute("mcpforge.status", result.status)
            if result.truncated and collector.dropped and collector.kernel_spill_path is None:
                result = await self._save_full_output(handle, session, result, collector)
            if result.execution_count is not None:
                handle.execution_count = result.execution_count
            metrics.EXECUTIONS.labels(status=result.status).inc()
            metrics.EXECUTION_SECONDS.observe(result.duration)
            await self._record_activity(handle, session)
            return result

    def execution_count(self, session: KernelSession) -> int | None:
        """The kernel's execution count as of this gateway's last call on it, if any."""
        handle = self._handles.get((session.namespace, session.name, session.uid))
        return handle.execution_count if handle else None

    async def _run(
        self,
        handle: _Handle,
        conn: KernelConnection,
        session: KernelSession,
        code: str,
        timeout: float,
        collector: Collector,
    ) -> ExecutionResult:
        s = self.settings
        started = time.monotonic()
        await conn.before_request()
        collector.msg_id = conn.send_execute(code, silent=False, store_history=True)
        deadline = started + timeout
        dropped: ChannelDropped | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                return await self._on_timeout(handle, conn, session, collector, started, timeout)
            step = min(s.heartbeat_interval, deadline - now)
            try:
                if dropped is None and await conn.pump(collector, step):
                    return collector.finish(duration=time.monotonic() - started)
                if dropped is not None and await conn.wait_shell_caught_up(collector, step):
                    return self._after_drop(collector, started, dropped)
            except ChannelDropped as exc:
                # A dying kernel closes its sockets too: the death checks below run now, and
                # from now on the kernel is asked whether the request is done.
                dropped = exc
            except KernelReplaced:
                return await self._on_death(handle, session, collector, started, REPLACED)
            await self._record_activity(handle, session, busy=True)  # a long call is activity
            if not await conn.heartbeat(s.heartbeat_timeout):
                term = await self.runtime.termination(session)
                if term is not None:
                    return await self._on_death(handle, session, collector, started, term.message)
            elif await self._replaced(handle, session):
                # The heartbeat of a kernel restarted since (by the supervisor) answers on
                # the same sockets: that is a death, never a call that runs on.
                return await self._on_death(handle, session, collector, started, REPLACED)

    async def _replaced(self, handle: _Handle, session: KernelSession) -> bool:
        """Has the session's kernel been replaced since this call's connection was made?"""
        try:
            now = await self.runtime.get(session.name, session.namespace)
        except ForgeError:
            return False  # deleted or unreadable: the next checks say so
        return _kernel_of(now) != handle.kernel

    async def _death_while_running(self, session: KernelSession, started: float) -> str | None:
        """Why a kernel replaced during a call died, as recorded by whoever restarted it
        (the supervisor or the operator), if it was recorded since the call began."""
        try:
            fresh = await self.runtime.get(session.name, session.namespace)
        except ForgeError:
            return None
        last = fresh.status.get("lastTermination") or {}
        at = parse_time(last.get("at"))
        began = time.time() - (time.monotonic() - started)
        if at is None or at < began - 1 or not last.get("message"):  # "at" is in seconds
            return None
        return f"{last['message']}; {REPLACED}"

    def _after_drop(
        self, collector: Collector, started: float, dropped: ChannelDropped
    ) -> ExecutionResult:
        """The answer to a request during which a channel was dropped: what arrived, and
        why the rest did not."""
        s = self.settings
        message = (
            f"the kernel sent a message the gateway refused (a frame over {s.frame_max} "
            f"bytes, or a message over {s.message_max}), or its {dropped.channel} connection "
            f"was closed: the {dropped.channel} channel was dropped and reconnected, and what "
            "was in flight on it is lost. The output below is what arrived; the code itself "
            "has finished"
        )
        # The code's own status when its reply arrived; an error when it was lost.
        status: Status | None = None
        if collector.reply_status is None:
            status = "error"
            message += (
                ". Its reply was lost too, so whether the code raised is not known: the "
                "status says error"
            )
        return collector.finish(status, duration=time.monotonic() - started, message=message)

    async def _settle_after_cancel(
        self, handle: _Handle, conn: KernelConnection, session: KernelSession, collector: Collector
    ) -> None:
        """Stop the code of a cancelled call before its lock is released.

        Bounded by the interrupt grace (and a restart if the kernel does not stop), and
        shielded: a cancellation that keeps arriving (an anyio cancel scope re-delivers it
        at every step) waits for it, so no one else reads these sockets meanwhile.
        """

        async def settle() -> None:
            grace = self.settings.interrupt_grace
            if await conn.interrupt(grace) and await conn.pump(collector, grace):
                return
            self._drop(handle)
            await self.runtime.restart_kernel(session, reason="Unresponsive", crashed=True)

        with anyio.CancelScope(shield=True):
            try:
                await settle()
            except ForgeError as exc:
                log.warning(
                    "could not stop the code of a cancelled call on %s: %s", session.name, exc
                )
        self._drop(handle)  # a clean slate for the next call

    async def _restart_after(self, session: KernelSession, reason: str, why: str) -> str:
        """Restart the kernel; say what happened in words, failures included."""
        try:
            await self.runtime.restart_kernel(session, reason=reason, crashed=True, message=why)
        except ForgeError as exc:
            return f" Restarting the kernel failed: {exc}"
        return " The kernel was restarted: all variables are lost (workspace files are kept)."

    async def _on_timeout(
        self,
        handle: _Handle,
        conn: KernelConnection,
        session: KernelSession,
        collector: Collector,
        started: float,
        timeout: float,
    ) -> ExecutionResult:
        grace = self.settings.interrupt_grace
        if await conn.interrupt(grace) and await conn.pump(collector, grace):
            return collector.finish(
                "timeout",
                duration=time.monotonic() - started,
                message=f"the code ran past its {timeout:g}s timeout and was interrupted; "
                "variables are kept",
            )
        self._drop(handle)
        why = (
            f"the code ran past its {timeout:g}s timeout and did not stop within {grace:g}s "
            "of an interrupt"
        )
        outcome = await self._restart_after(session, "Unresponsive", why)
        return collector.finish(
            "timeout",
            duration=time.monotonic() - started,
            state_lost=True,
            message=why + "." + outcome,
        )

    async def _on_death(
        self,
        handle: _Handle,
        session: KernelSession,
        collector: Collector,
        started: float,
        why: str,
    ) -> ExecutionResult:
        self._drop(handle)
        if why == REPLACED:
            why = await self._death_while_running(session, started) or why
        message = f"the kernel died: {why}."
        try:
            after = await self.runtime.refresh(session)  # restarts it per restartPolicy
        except ForgeError as exc:
            message += f" Restarting the kernel failed: {exc}"
        else:
            if after.status.get("phase") == st.READY:
                message += " It was restarted: all variables are lost (workspace files are kept)."
            else:
                phase, policy = after.status.get("phase"), session.spec.restart_policy
                message += f" The session is now {phase} (restartPolicy {policy})."
        return collector.finish(
            "died", duration=time.monotonic() - started, state_lost=True, message=message
        )

    async def _save_full_output(
        self,
        handle: _Handle,
        session: KernelSession,
        result: ExecutionResult,
        collector: Collector,
    ) -> ExecutionResult:
        text = collector.full_text().encode()
        name = f"{OUTPUT_DIR}/{collector.msg_id}.txt"  # where the kernel's guard spills too
        try:
            await self._write_locked(handle, session, name, text)
            await self._helper_locked(
                handle, session, "prune", path=OUTPUT_DIR, keep=OUTPUT_FILES_KEPT
            )
        except ForgeError as exc:  # the result stands even if the copy cannot be saved
            log.warning("could not save the full output of %s", session.name)
            log.debug("session %s: %s", session.name, shown(exc, 500))  # the kernel's words
            return result
        return collector.finish(
            result.status,
            duration=result.duration,
            message=result.message,
            state_lost=result.state_lost,
            saved_to=f"/workspace/{name}",
        )

    # ---- interrupt / restart ---------------------------------------------------------------

    async def interrupt(self, name: str, *, namespace: str = "default") -> bool:
        """Interrupt whatever the kernel runs now (outside the queue)."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        if handle.conn is not None:
            return await handle.conn.interrupt(self.settings.interrupt_grace)
        conn = self._new_connection(await self.runtime.connection(session))
        try:
            return await conn.interrupt(self.settings.interrupt_grace)
        finally:
            conn.close()

    @contextlib.asynccontextmanager
    async def _turn(self, handle: _Handle, session: KernelSession) -> AsyncIterator[None]:
        """The session's queue, for calls that should not wait behind running code."""
        try:
            async with asyncio.timeout(self.settings.lock_wait):
                await handle.lock.acquire()
        except TimeoutError:
            raise SessionNotReady(
                f"session {session.name!r} is running code; wait for it, or interrupt it "
                "(interrupt_kernel) first"
            ) from None
        try:
            yield
        finally:
            handle.lock.release()

    async def restart(self, name: str, *, namespace: str = "default") -> None:
        """A fresh interpreter: variables are cleared, workspace files kept."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            self._drop(handle)
            await self.runtime.restart_kernel(session, reason="Requested", crashed=False)

    # ---- helpers run in the kernel ---------------------------------------------------------

    async def _helper(self, name: str, namespace: str, op: str, **args: Any) -> dict[str, Any]:
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            reply = await self._helper_locked(handle, session, op, **args)
            await self._record_activity(handle, session)
            return reply

    async def _helper_locked(
        self,
        handle: _Handle,
        session: KernelSession,
        op: str,
        *,
        wait: float | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """The helper's reply; InvalidRequest naming what it refused. `wait`: seconds for
        its reply (helper_timeout)."""
        reply = await self._ask_locked(handle, session, op, wait=wait, **args)
        if "error" in reply:
            raise InvalidRequest(f"{reply['error']}: {reply.get('message', '')}")
        return reply

    async def _ask_locked(
        self,
        handle: _Handle,
        session: KernelSession,
        op: str,
        *,
        wait: float | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """The helper's reply as it is, a refusal ({"error": kind, "message"}) included."""
        s = self.settings
        wait = s.helper_timeout if wait is None else wait
        conn = await self._connect(handle, session)
        code, marker = introspection.program(op, **args)
        collector = Collector("", budget=s.helper_reply_max, spool_max=0, data_budget=0)
        await conn.before_request()
        collector.msg_id = conn.send_execute(code, silent=True, store_history=False)
        try:
            done = await conn.pump(collector, wait)
        except asyncio.CancelledError:
            await self._settle_after_cancel(handle, conn, session, collector)
            raise
        if not done:
            await self._settle_after_cancel(handle, conn, session, collector)
            raise SessionNotReady(f"the kernel did not answer within {wait:.0f}s")
        result = collector.finish(duration=0)
        if result.truncated:
            raise KernelProtocolError(
                f"the kernel's reply is over the {s.helper_reply_max} character limit"
            )
        return introspection.parse_reply(result.stdout, marker, limit=s.helper_reply_max)

    async def kernel_tools(self, name: str, *, namespace: str = "default") -> dict[str, Any]:
        """The `mcp_tools` stubs (signatures, docstrings) code in this session may call."""
        reply = await self._helper(name, namespace, "tools", max=self.settings.helper_reply_max)
        servers = reply.get("servers")
        stubs = reply.get("stubs")
        if not isinstance(servers, list) or not isinstance(stubs, str):
            raise KernelProtocolError("the kernel's tool listing is malformed")
        return {"servers": [str(s) for s in servers], "stubs": stubs}

    async def variables(self, name: str, *, namespace: str = "default") -> list[dict[str, Any]]:
        """The user's variables: name, type, shape, dtype, length, size, bounded repr."""
        s = self.settings
        reply = await self._helper(
            name, namespace, "variables", max=s.variables_max, repr_max=s.repr_list_max
        )
        items = reply.get("variables")
        if not isinstance(items, list):
            raise KernelProtocolError("the kernel's variable list is malformed")
        return [_variable(v) for v in items[: s.variables_max]]

    async def inspect_variable(
        self, name: str, var: str, *, namespace: str = "default"
    ) -> dict[str, Any]:
        if not isinstance(var, str) or not var.isidentifier():
            raise InvalidRequest(f"{var!r} is not a Python identifier")
        reply = await self._helper(
            name, namespace, "inspect", var=var, repr_max=self.settings.repr_max
        )
        return _variable(reply.get("variable"))

    async def list_files(
        self, name: str, path: str = ".", *, namespace: str = "default"
    ) -> dict[str, Any]:
        rel = introspection.workspace_path(path)
        reply = await self._helper(
            name, namespace, "list", path=rel, max=self.settings.list_files_max
        )
        entries = reply.get("entries")
        if not isinstance(entries, list):
            raise KernelProtocolError("the kernel's file list is malformed")
        return {
            "path": rel,
            "entries": [_entry(e) for e in entries[: self.settings.list_files_max]],
            "truncated": reply.get("truncated") is True,
        }

    async def read_file(self, name: str, path: str, *, namespace: str = "default") -> bytes:
        rel = introspection.workspace_path(path)
        reply = await self._helper(name, namespace, "read", path=rel, max=self.settings.file_max)
        return _decoded(reply.get("base64"), self.settings.file_max)

    async def export_notebook(
        self,
        name: str,
        *,
        namespace: str = "default",
        save_to: str | None = None,
        client: str | None = None,
    ) -> Notebook:
        """The session's notebook: every cell run in it, as its journal has them; also
        written to `save_to` in its workspace if given (replacing a file there). It is
        built in a worker process (the journal is the kernel's), at most file_max long;
        each client (`client`, who asks; else the session's owner) runs a bounded number
        of exports at once."""
        rel = None
        if save_to is not None:
            rel = introspection.workspace_path(save_to)
            if rel == ".":
                raise InvalidRequest("path names the workspace itself, not a file")
        session = await self._session(name, namespace)
        handle = self._handle(session)
        s = self.settings
        limits = WorkerLimits(
            size=s.file_max, seconds=s.notebook_timeout, memory=s.notebook_memory_max
        )
        with self._exports.hold(client or owner_of(session) or ""):
            async with self._turn(handle, session):  # no cell is half-written meanwhile
                journal = self._journal_locked(handle, session)
                nb = await build_in_worker(journal, session=name, limits=limits)
                if rel is not None:
                    await self._write_locked(handle, session, rel, nb.text.encode())
                await self._record_activity(handle, session)
        return nb

    async def _journal_locked(
        self, handle: _Handle, session: KernelSession
    ) -> AsyncIterator[bytes]:
        """The session's notebook journal, read in windows of at most _JOURNAL_WINDOW, as
        they come.

        Each window is a helper reply parsed and base64-decoded on the loop, in one step:
        windows of file_max (10 MB) held the loop ~100 ms each (tests/drills/neighbours.py,
        10 noisy clients: every client's call waited behind them); 1 MB is ~10 ms.
        """
        read = 0
        window = min(self.settings.file_max, _JOURNAL_WINDOW)
        most = self.settings.notebook_max + self.settings.data_budget  # its last record
        while True:
            reply = await self._ask_locked(
                handle, session, "read", path=NOTEBOOK_JOURNAL, max=window, offset=read
            )
            if reply.get("error") == "FileNotFound" and not read:
                return  # no cell has run yet
            if "error" in reply:
                raise InvalidRequest(f"{reply['error']}: {reply.get('message', '')}")
            part = _decoded(reply.get("base64"), window)
            read += len(part)
            if read > most:
                raise InvalidRequest(
                    f"the notebook journal of {session.name!r} is over {most} bytes: "
                    f"read it with read_file ({NOTEBOOK_JOURNAL}) in parts"
                )
            yield part
            if len(part) < window:
                return

    async def write_file(
        self, name: str, path: str, data: bytes, *, namespace: str = "default"
    ) -> int:
        rel = introspection.workspace_path(path)
        if rel == ".":
            raise InvalidRequest("path names the workspace itself, not a file")
        if len(data) > self.settings.file_max:
            raise InvalidRequest(
                f"content is {len(data)} bytes; the limit is {self.settings.file_max}"
            )
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            size = await self._write_locked(handle, session, rel, data)
            await self._record_activity(handle, session)
            return size

    async def _write_locked(
        self, handle: _Handle, session: KernelSession, rel: str, data: bytes
    ) -> int:
        size: Any = None
        chunks = [data[i : i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            reply = await self._helper_locked(
                handle,
                session,
                "write",
                path=rel,
                base64=base64.b64encode(chunk).decode(),
                append=i > 0,
            )
            size = reply.get("size")
        if not isinstance(size, int):
            raise KernelProtocolError("the kernel's write reply is malformed")
        return size

    # ---- packages --------------------------------------------------------------------------

    async def install_packages(
        self,
        name: str,
        requirements: Any,
        *,
        namespace: str = "default",
        read: KernelSession | None = None,
        client: str | None = None,
    ) -> dict[str, Any]:
        """Resolve and download `requirements` on the host under the package policy
        (image/packages.py), send the wheels over the kernel's channels and have it
        install them offline into its workspace's package directory, which is on its
        sys.path at once (and in every later kernel of the session: guard_program).
        `client` (who asks) is held to its share of installs in flight.
        What was installed (name, version, size) and the bytes in all."""
        reqs = packages.parse_requirements(requirements)
        policy = packages.PackagePolicy.of(self.settings)
        session = await self._session(name, namespace, read=read)  # refused before fetching
        with tempfile.TemporaryDirectory(prefix="mcp-forge-packages-") as tmp:
            wheels = await packages.download(reqs, policy, Path(tmp), client=client)
            session = await self._session(name, namespace)
            handle = self._handle(session)
            async with self._turn(handle, session):
                await self._install_locked(handle, session, wheels, policy.timeout)
                await self._record_activity(handle, session)
        return {
            "installed": [{"name": w.name, "version": w.version, "size": w.size} for w in wheels],
            "total_bytes": sum(w.size for w in wheels),
            "path": f"{WORKSPACE}/{packages.PACKAGES_DIR}",
        }

    async def _install_locked(
        self,
        handle: _Handle,
        session: KernelSession,
        wheels: list[packages.Wheel],
        seconds: float,
    ) -> None:
        batch = f"{OUTPUT_DIR.rsplit('/', 1)[0]}/wheels"  # emptied by the install, come what may
        for wheel in wheels:
            data = await asyncio.to_thread(wheel.path.read_bytes)
            await self._write_locked(handle, session, f"{batch}/{wheel.path.name}", data)
        try:
            await self._helper_locked(
                handle,
                session,
                "install",
                wait=seconds + self.settings.helper_timeout,
                wheels=batch,
                target=packages.PACKAGES_DIR,
                files=[w.path.name for w in wheels],
                seconds=seconds,
            )
        except InvalidRequest as exc:
            raise PackageError(f"the kernel could not install them: {exc}") from None
        conn = await self._connect(handle, session)
        await self._silently(
            conn, packages.path_program(), "the kernel could not put its packages on sys.path"
        )


def _decoded(data: Any, limit: int) -> bytes:
    """A file's bytes as the kernel's helper sent them (base64), at most `limit`."""
    if not isinstance(data, str):
        raise KernelProtocolError("the kernel's file reply is malformed")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as exc:
        raise KernelProtocolError("the kernel's file reply is not base64") from exc
    if len(raw) > limit:
        raise KernelProtocolError("the kernel sent more than the file limit")
    return raw


def guard_program(settings: Settings) -> str:
    """The silent code that installs the kernel-side output guard (kernelside/guard.py)
    with this gateway's limits, and puts the session's installed packages on sys.path;
    like the helpers, it leaves no name in the user's namespace."""
    limits = {
        "text": settings.output_budget,
        "data": settings.data_budget,
        "spool": min(settings.output_spool_max, settings.file_max),  # read_file can open it
        "evalue": EVALUE_MAX,
        "traceback": TRACEBACK_MAX,
        "spill_dir": f"{WORKSPACE}/{OUTPUT_DIR}",
        "report_key": GUARD_KEY,
        "journal": f"{WORKSPACE}/{NOTEBOOK_JOURNAL}",
        "journal_max": settings.notebook_max,
        "journal_record_max": settings.file_max,  # a larger cell fits no notebook
    }
    # First, the packages install_packages gave earlier kernels of the session.
    guard = run_silently(compiled("guard"), {"get_ipython": "get_ipython", "LIMITS": repr(limits)})
    return packages.path_program() + "\n" + guard


_VAR_FIELDS: dict[str, type] = {
    "name": str,
    "type": str,
    "shape": list,
    "dtype": str,
    "length": int,
    "size": int,
    "repr": str,
}
_ENTRY_FIELDS: dict[str, type] = {"name": str, "type": str, "size": int, "mtime": float}


def _fields(
    raw: Any, spec: dict[str, type], what: str, required: tuple[str, ...]
) -> dict[str, Any]:
    """Keep only known fields of the expected types from a kernel-made object."""
    if not isinstance(raw, dict):
        raise KernelProtocolError(f"the kernel's {what} is malformed")
    out: dict[str, Any] = {}
    for key, kind in spec.items():
        value = raw.get(key)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, list) and not all(
                isinstance(x, int) and not isinstance(x, bool) for x in value
            ):
                continue
            out[key] = value[:10_000] if isinstance(value, str | list) else value
    if any(key not in out for key in required):
        raise KernelProtocolError(f"the kernel's {what} lacks {', '.join(required)}")
    return out


def _variable(raw: Any) -> dict[str, Any]:
    return _fields(raw, _VAR_FIELDS, "variable description", ("name", "type"))


def _entry(raw: Any) -> dict[str, Any]:
    return _fields(raw, _ENTRY_FIELDS, "file entry", ("name", "type"))
