"""The gateway's execution core: runs code in a session's kernel and says what happened.

It holds execution, its timeouts, a kernel's death while code runs, interrupt and restart.
`Gateway` runs them on the connections of `Connections` (gateway/connections.py: opened,
kept and dropped per session), next to the helpers of `WorkspaceCalls` (workspace.py).
Calls on one session are queued (one lock per session); sessions run in parallel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from mcp_forge import metrics, tracing
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time
from mcp_forge.egress import audit as egress_audit
from mcp_forge.errors import ForgeError, InvalidRequest, SessionNotReady
from mcp_forge.gateway.attach import Handle
from mcp_forge.gateway.codemode.upstream import Upstream, UpstreamPool
from mcp_forge.gateway.connections import Connections, kernel_of
from mcp_forge.gateway.notebook_worker import ExportSlots
from mcp_forge.gateway.workspace import WorkspaceCalls
from mcp_forge.jupyter.client import ChannelDropped, KernelConnection, KernelReplaced
from mcp_forge.jupyter.execution import (
    OUTPUT_DIR,
    Collector,
    ExecutionResult,
    Status,
)
from mcp_forge.logsafe import shown
from mcp_forge.runtimes.base import Kernels
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

REPLACED = "it was restarted while the call ran (a new kernel process answers)"
OUTPUT_FILES_KEPT = 20
BUSY_FROM_START = 10.0  # seconds: the margin past activity_interval (see execute)

StreamCallback = Callable[[str, str], None]


class Gateway(Connections, WorkspaceCalls):
    """Execution, interruption, restart, introspection and files, per session."""

    def __init__(
        self,
        runtime: Kernels,
        settings: Settings | None = None,
        *,
        upstreams: UpstreamPool | dict[str, Upstream] | None = None,
    ) -> None:
        # Code mode: the servers of --mcp-config (a plain dict: every session shares them).
        pool = (
            upstreams if isinstance(upstreams, UpstreamPool) else UpstreamPool.of(upstreams or {})
        )
        super().__init__(runtime, settings or Settings.from_env(), pool)
        self._exports = ExportSlots(
            total=self.settings.notebook_exports_max,
            per_client=self.settings.notebook_exports_per_client_max,
        )

    async def _record_activity(
        self, handle: Handle, session: KernelSession, *, busy: bool = False
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
        read_at = time.monotonic()
        handle = self._handle(session)
        async with handle.lock:
            conn = await self._connect(handle, session)
            await self._still_unheld(session, read_at)  # a fork may hold it since
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
            with (
                tracing.span("kernel execute", session=session.name) as span,
                egress_audit.executing(f"{session.namespace}/{session.name}"),
            ):
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
        handle: Handle,
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
                    # Whoever replaces it (the supervisor, the operator) may have removed its
                    # pod, or made the next one, by now: its record of this kernel's death
                    # says why, where the pod no longer can.
                    why = await self._recorded_death(handle, session, started) or term.message
                    return await self._on_death(handle, session, collector, started, why)
            elif await self._replaced(handle, session):
                # The heartbeat of a kernel restarted since (by the supervisor) answers on
                # the same sockets: that is a death, never a call that runs on.
                return await self._on_death(handle, session, collector, started, REPLACED)

    async def _replaced(self, handle: Handle, session: KernelSession) -> bool:
        """Has the session's kernel been replaced since this call's connection was made?"""
        try:
            now = await self.runtime.get(session.name, session.namespace)
        except ForgeError:
            return False  # deleted or unreadable: the next checks say so
        return kernel_of(now) != handle.kernel

    async def _recorded_death(
        self, handle: Handle, session: KernelSession, started: float
    ) -> str | None:
        """Why the call's kernel died, as recorded by whoever restarted it (the supervisor
        or the operator), if it was: a record names its kernel (one without a name, of an
        older writer, counts if it was written since the call began)."""
        try:
            fresh = await self.runtime.get(session.name, session.namespace)
        except ForgeError:
            return None
        last = fresh.status.get("lastTermination") or {}
        if not last.get("message"):
            return None
        named = {last.get("kernelId"), last.get("podUID")} - {None, ""}
        if named:
            return str(last["message"]) if handle.kernel[1] in named else None
        at = parse_time(last.get("at"))
        began = time.time() - (time.monotonic() - started)
        if at is None or at < began - 1:  # "at" is in seconds
            return None
        return str(last["message"])

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
        self, handle: Handle, conn: KernelConnection, session: KernelSession, collector: Collector
    ) -> None:
        """Stop the code of a cancelled call before its lock is released.

        Bounded by the interrupt grace (and a restart if the kernel does not stop), and
        shielded: a cancellation that keeps arriving (an anyio cancel scope re-delivers it
        at every step) waits for it, so no one else reads these sockets meanwhile.
        """

        async def settle() -> None:
            if not collector.msg_id:
                return  # cancelled before its code was sent: nothing runs
            if await self._stop_cell(conn, collector):
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

    async def _stop_cell(self, conn: KernelConnection, collector: Collector) -> bool:
        """Interrupt the collector's cell; True once it ended, False if it did not stop
        within twice the interrupt grace (or a channel dropped meanwhile).

        ipykernel ignores SIGINT between cells, so an interrupt that arrives after the
        request was sent but before the kernel began it would be lost and the cell run
        on: the interrupt waits for the cell's start (its execute_input), at most one
        grace, and is sent then even if the start was not seen; a start seen only after
        it gets another, unless the cell ends within a third of the grace (on a busy host
        a cell began after the first was ignored, ran on, and the kernel was restarted:
        its variables lost).
        """
        grace = self.settings.interrupt_grace
        deadline = time.monotonic() + 2 * grace
        try:
            await conn.pump(collector, grace, started=True)
            if collector.done:
                return True
            seen = collector.started
            if not await conn.interrupt(max(0.1, deadline - time.monotonic())):
                return False
            if not seen:
                await conn.pump(collector, max(0.0, deadline - time.monotonic()), started=True)
                if collector.started and not collector.done:
                    # Its start seen only now: the interrupt may have stopped it all the
                    # same, its end on the way. That end is waited for a moment first: a
                    # second interrupt arriving after it hit ipykernel between cells, or the
                    # next call's cell (seen in CI: that cell failed with KeyboardInterrupt).
                    settle = min(grace / 3, max(0.0, deadline - time.monotonic()))
                    await conn.pump(collector, settle)
                # Once idle, the cell is over (its reply may be on its way, or lost): a
                # second interrupt could only land on the next request, the probe's too.
                again = collector.started and not collector.idle
                if again and not await conn.interrupt(max(0.1, deadline - time.monotonic())):
                    return False
            return await conn.pump(collector, max(0.0, deadline - time.monotonic()))
        except (ChannelDropped, KernelReplaced):  # no knowing the cell stopped: restarted
            return False

    async def _on_timeout(
        self,
        handle: Handle,
        conn: KernelConnection,
        session: KernelSession,
        collector: Collector,
        started: float,
        timeout: float,
    ) -> ExecutionResult:
        grace = self.settings.interrupt_grace
        if await self._stop_cell(conn, collector):
            return collector.finish(
                "timeout",
                duration=time.monotonic() - started,
                message=f"the code ran past its {timeout:g}s timeout and was interrupted; "
                "variables are kept",
            )
        self._drop(handle)
        why = (
            f"the code ran past its {timeout:g}s timeout and did not stop within "
            f"{2 * grace:g}s of an interrupt"
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
        handle: Handle,
        session: KernelSession,
        collector: Collector,
        started: float,
        why: str,
    ) -> ExecutionResult:
        if why == REPLACED:
            recorded = await self._recorded_death(handle, session, started)
            why = f"{recorded}; {REPLACED}" if recorded else why
        self._drop(handle)
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
        handle: Handle,
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
        """Interrupt whatever the kernel runs now (outside the queue), a fork's hold on it
        notwithstanding: it stops code, and a fork waits for its parent's code to stop."""
        session = await self._session(name, namespace, hold=False)
        handle = self._handle(session)
        if handle.conn is not None:
            return await handle.conn.interrupt(self.settings.interrupt_grace)
        conn = self._new_connection(await self.runtime.connection(session))
        try:
            return await conn.interrupt(self.settings.interrupt_grace)
        finally:
            conn.close()

    @contextlib.asynccontextmanager
    async def _turn(self, handle: Handle, session: KernelSession) -> AsyncIterator[None]:
        """The session's queue, for calls that should not wait behind running code."""
        read_at = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.lock_wait):
                await handle.lock.acquire()
        except TimeoutError:
            raise SessionNotReady(
                f"session {session.name!r} is running code; wait for it, or interrupt it "
                "(interrupt_kernel) first"
            ) from None
        try:
            await self._still_unheld(session, read_at)  # a fork may hold it since
            yield
        finally:
            handle.lock.release()

    @contextlib.asynccontextmanager
    async def held(self, name: str, *, namespace: str = "default") -> AsyncIterator[KernelSession]:
        """The session Ready (resumed if it slept), its queue held (code it runs is
        waited for, as by restart) and this gateway's connection to it closed, for a
        call that checkpoints its kernel (a fork); the next call connects again."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            if session.status.get("phase") != st.READY:
                session = await self.runtime.refresh(session)
            self._drop(handle)
            yield session

    async def restart(self, name: str, *, namespace: str = "default") -> None:
        """A fresh interpreter: variables are cleared, workspace files kept."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            self._drop(handle)
            await self.runtime.restart_kernel(session, reason="Requested", crashed=False)
