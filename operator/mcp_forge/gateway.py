"""The gateway's execution core: runs code in a session's kernel and says what happened.

It holds one jupyter-client connection per session it has used, and nothing else: the
connection info comes from the runtime (store or Secret) each time the connection
generation changes, so a new gateway process reattaches to running kernels with their
variables intact. Calls on one session are queued (one lock per session); sessions run
in parallel.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import introspection
from .errors import ForgeError, InvalidRequest, KernelProtocolError, SessionNotReady
from .execution import Collector, ExecutionResult
from .kernel import KernelConnection
from .resource import KernelSession
from .runtime import Runtime
from .settings import Settings

log = logging.getLogger(__name__)

OUTPUT_DIR = ".mcp-forge/outputs"
_WRITE_CHUNK = 1_000_000


@dataclass
class _Handle:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conn: KernelConnection | None = None
    generation: Any = None
    activity_recorded: float = 0.0  # monotonic time of the last record_activity


class Gateway:
    """Execution, interruption, restart, introspection and files, per session."""

    def __init__(self, runtime: Runtime, settings: Settings | None = None) -> None:
        self.runtime = runtime
        self.settings = settings or Settings.from_env()
        self._handles: dict[tuple[str, str], _Handle] = {}

    def _handle(self, session: KernelSession) -> _Handle:
        return self._handles.setdefault((session.namespace, session.name), _Handle())

    async def close(self) -> None:
        for handle in self._handles.values():
            if handle.conn is not None:
                handle.conn.close()
        self._handles.clear()

    async def _session(self, name: str, namespace: str) -> KernelSession:
        session = await self.runtime.get(name, namespace)
        phase = session.status.get("phase")
        if phase == "Failed":
            raise SessionNotReady(
                f"session {name!r} has failed ({session.status.get('reason', 'unknown')}): "
                f"{session.status.get('message', '')}".rstrip(": ")
            )
        if phase in ("Terminating", "Pending"):
            raise SessionNotReady(f"session {name!r} is {phase}")
        return session

    async def _connect(self, handle: _Handle, session: KernelSession) -> KernelConnection:
        generation = (session.status.get("connection") or {}).get("generation")
        if handle.conn is not None and handle.generation == generation:
            return handle.conn
        if handle.conn is not None:
            handle.conn.close()
            handle.conn = None
        session = await self.runtime.refresh(session)
        if session.status.get("phase") != "Ready":
            raise SessionNotReady(
                f"session {session.name!r} is {session.status.get('phase')}: "
                f"{session.status.get('message', '')}"
            )
        generation = (session.status.get("connection") or {}).get("generation")
        conn = KernelConnection(
            await self.runtime.connection(session), max_message_size=self.settings.message_max
        )
        try:
            await conn.wait_ready(self.settings.kernel_ready_timeout)
        except BaseException:
            conn.close()
            raise
        handle.conn, handle.generation = conn, generation
        return conn

    def _drop(self, handle: _Handle) -> None:
        if handle.conn is not None:
            handle.conn.close()
        handle.conn = None
        handle.generation = None

    # ---- execute -------------------------------------------------------------------------

    def _check_code(self, code: Any, timeout: Any) -> float:
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
        on_stream: Callable[[str, str], None] | None = None,
    ) -> ExecutionResult:
        """Run `code` in the session's kernel. Errors of the code are in the result.

        `on_stream(name, text)` is called with stdout/stderr text as it arrives.
        """
        seconds = self._check_code(code, timeout)
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with handle.lock:
            conn = await self._connect(handle, session)
            collector = Collector(
                "",
                budget=self.settings.output_budget,
                spool_max=self.settings.output_spool_max,
                on_stream=on_stream,
            )
            result = await self._execute_locked(handle, conn, session, code, seconds, collector)
            if result.truncated:
                result = await self._save_full_output(handle, session, result, collector)
            await self._record_activity(handle, session)
            return result

    async def _execute_locked(
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
        collector.msg_id = conn.send_execute(code, silent=False, store_history=True)
        deadline = started + timeout
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return await self._on_timeout(
                        handle, conn, session, collector, started, timeout
                    )
                if await conn.pump(collector, min(s.heartbeat_interval, deadline - now)):
                    return collector.finish(duration=time.monotonic() - started)
                if not await conn.heartbeat(s.heartbeat_timeout):
                    term = await self.runtime.termination(session)
                    if term is not None:
                        return await self._on_death(
                            handle, session, collector, started, term.message
                        )
        except asyncio.CancelledError:
            # The caller went away: stop the code rather than leave the kernel busy.
            await asyncio.shield(self._stop_after_cancel(conn, collector))
            raise

    async def _stop_after_cancel(self, conn: KernelConnection, collector: Collector) -> None:
        with contextlib.suppress(Exception):
            await conn.interrupt(self.settings.interrupt_grace)
            await conn.pump(collector, self.settings.interrupt_grace)

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
        await conn.interrupt(grace)
        if await conn.pump(collector, grace):
            return collector.finish(
                "timeout",
                duration=time.monotonic() - started,
                message=f"the code ran past its {timeout:g}s timeout and was interrupted; "
                "variables are kept",
            )
        self._drop(handle)
        await self.runtime.restart_kernel(session, reason="Unresponsive", crashed=False)
        return collector.finish(
            "timeout",
            duration=time.monotonic() - started,
            state_lost=True,
            message=f"the code ran past its {timeout:g}s timeout and did not stop when "
            f"interrupted within {grace:g}s, so the kernel was restarted: all variables are "
            "lost (workspace files are kept)",
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
        term = await self.runtime.termination(session)
        reason = term.reason if term else "Died"
        message = f"the kernel died: {why}."
        if session.spec.restart_policy == "Always":
            await self.runtime.restart_kernel(session, reason=reason, crashed=True, message=why)
            message += " It was restarted: all variables are lost (workspace files are kept)."
        else:
            message += " The session's restartPolicy is Never, so it is now Failed."
        return collector.finish(
            "died", duration=time.monotonic() - started, state_lost=True, message=message
        )

    async def _record_activity(self, handle: _Handle, session: KernelSession) -> None:
        # lastActivity has a resolution of seconds and drives culling after minutes:
        # writing it once a second per session is enough, and keeps the store off the
        # hot path of a burst of small calls.
        now = time.monotonic()
        if now - handle.activity_recorded < 1.0:
            return
        handle.activity_recorded = now
        try:
            await self.runtime.record_activity(session)
        except ForgeError as exc:
            log.warning("could not record activity of %s: %s", session.name, exc)

    async def _save_full_output(
        self,
        handle: _Handle,
        session: KernelSession,
        result: ExecutionResult,
        collector: Collector,
    ) -> ExecutionResult:
        text = collector.full_text().encode()
        name = f"{OUTPUT_DIR}/{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.txt"
        try:
            await self._write_locked(handle, session, name, text)
        except ForgeError as exc:  # the result stands even if the copy cannot be saved
            log.warning("could not save the full output of %s: %s", session.name, exc)
            return result
        marker = f"full output saved to /workspace/{name}"
        stdout = result.stdout.replace("more characters ...]", f"more characters; {marker}]")
        stderr = result.stderr.replace("more characters ...]", f"more characters; {marker}]")
        return dataclasses.replace(
            result, stdout=stdout, stderr=stderr, full_output_path=f"/workspace/{name}"
        )

    # ---- interrupt / restart ---------------------------------------------------------------

    async def interrupt(self, name: str, *, namespace: str = "default") -> bool:
        """Interrupt whatever the kernel runs now (outside the queue)."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        conn = handle.conn
        if conn is None:
            conn = KernelConnection(
                await self.runtime.connection(session), max_message_size=self.settings.message_max
            )
            try:
                return await conn.interrupt(self.settings.interrupt_grace)
            finally:
                conn.close()
        return await conn.interrupt(self.settings.interrupt_grace)

    async def restart(self, name: str, *, namespace: str = "default") -> None:
        """A fresh interpreter: variables are cleared, workspace files kept."""
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with handle.lock:
            self._drop(handle)
            await self.runtime.restart_kernel(session, reason="Requested", crashed=False)

    # ---- helpers run in the kernel ---------------------------------------------------------

    async def _helper(self, name: str, namespace: str, op: str, **args: Any) -> dict[str, Any]:
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with handle.lock:
            return await self._helper_locked(handle, session, op, **args)

    async def _helper_locked(
        self, handle: _Handle, session: KernelSession, op: str, **args: Any
    ) -> dict[str, Any]:
        s = self.settings
        conn = await self._connect(handle, session)
        code, marker = introspection.program(op, **args)
        msg_id = conn.send_execute(code, silent=True, store_history=False)
        collector = Collector(msg_id, budget=s.helper_reply_max, spool_max=0)
        if not await conn.pump(collector, s.helper_timeout):
            await self._stop_after_cancel(conn, collector)
            raise SessionNotReady(f"the kernel did not answer within {s.helper_timeout:.0f}s")
        result = collector.finish(duration=0)
        if result.truncated:
            raise KernelProtocolError(
                f"the kernel's reply is over the {s.helper_reply_max} byte limit"
            )
        reply = introspection.parse_reply(result.stdout, marker, limit=s.helper_reply_max)
        if "error" in reply:
            raise InvalidRequest(f"{reply['error']}: {reply.get('message', '')}")
        return reply

    async def variables(self, name: str, *, namespace: str = "default") -> list[dict[str, Any]]:
        """The user's variables: name, type, shape, dtype, length, size, bounded repr."""
        reply = await self._helper(
            name, namespace, "variables", max=self.settings.variables_max, repr_max=200
        )
        items = reply.get("variables")
        if not isinstance(items, list):
            raise KernelProtocolError("the kernel's variable list is malformed")
        return [_variable(v) for v in items]

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
        return await self._helper(
            name, namespace, "list", path=rel, max=self.settings.list_files_max
        )

    async def read_file(self, name: str, path: str, *, namespace: str = "default") -> bytes:
        rel = introspection.workspace_path(path)
        reply = await self._helper(name, namespace, "read", path=rel, max=self.settings.file_max)
        data = reply.get("base64")
        if not isinstance(data, str):
            raise KernelProtocolError("the kernel's file reply is malformed")
        raw = base64.b64decode(data, validate=True)
        if len(raw) > self.settings.file_max:
            raise KernelProtocolError("the kernel sent more than the file limit")
        return raw

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
        async with handle.lock:
            return await self._write_locked(handle, session, rel, data)

    async def _write_locked(
        self, handle: _Handle, session: KernelSession, rel: str, data: bytes
    ) -> int:
        size = 0
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
            size = int(reply.get("size", 0))
        return size


_VAR_FIELDS: dict[str, type] = {
    "name": str,
    "type": str,
    "shape": list,
    "dtype": str,
    "length": int,
    "size": int,
    "repr": str,
}


def _variable(raw: Any) -> dict[str, Any]:
    """Keep only known fields of the expected types from a kernel-made description."""
    if not isinstance(raw, dict):
        raise KernelProtocolError("the kernel's variable description is malformed")
    out: dict[str, Any] = {}
    for key, kind in _VAR_FIELDS.items():
        value = raw.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, list) and not all(isinstance(x, int) for x in value):
                continue
            out[key] = value[:10_000] if isinstance(value, str) else value
    if "name" not in out or "type" not in out:
        raise KernelProtocolError("the kernel's variable description lacks name or type")
    return out
