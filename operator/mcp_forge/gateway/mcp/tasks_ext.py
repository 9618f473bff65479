"""Tasks as protocol 2026-07-28 has them: the `io.modelcontextprotocol/tasks` extension
(SEP-2663). There the server decides: a client that declares the extension in a call's
capabilities (`_meta`) is answered as ever when the call ends within `after` seconds,
and otherwise gets a task (`resultType: "task"`) while the cell runs on. `tasks/get`
gives its status with the result or error inlined once it has ended, `tasks/cancel`
interrupts the kernel (acknowledged at once; the status follows), `tasks/update` is
acknowledged (no execute_code task ever asks its client for input). A client that does
not declare the extension is never given a task. The tasks themselves are tasks.py's:
the same store, the same owner rules, the same bounds.

The SDK (mcp 2.3) knows these methods only as 2025-11-25's core ones, which it answers
-32601 at 2026-07-28 before any handler: they are served here by a server middleware,
ahead of that check, as the SDK lets a middleware answer for itself (its own envelope:
`resultType` and the serverInfo stamp). (Upstream: an extension cannot bind a method
name that some version's core has, `MethodBinding` refuses it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import anyio
from mcp import MCPError
from mcp_types import CLIENT_CAPABILITIES_META_KEY, SERVER_INFO_META_KEY
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp_forge.gateway.mcp.tasks_store import (
    COMPLETED,
    FAILED,
    POLL_INTERVAL_MS,
    TASK_TOOLS,
    TASKS_PER_CLIENT,
    WORKING,
    Record,
    iso,
)

if TYPE_CHECKING:
    from mcp.server.lowlevel import Server

    from mcp_forge.gateway.mcp.tasks import Tasks

log = logging.getLogger(__name__)

EXTENSION = "io.modelcontextprotocol/tasks"
METHODS = ("tasks/get", "tasks/update", "tasks/cancel")
ID_MAX = 200  # characters of a task id looked up
INVALID_PARAMS = -32602
MISSING_CAPABILITY = -32021  # the client did not declare what the method needs
INTERNAL_ERROR = -32603


def detailed(record: Record) -> dict[str, Any]:
    """The task as 2026-07-28's `tasks/get` has it: its result or error inlined."""
    task: dict[str, Any] = {
        "taskId": record.task_id,
        "status": record.status,
        "createdAt": iso(record.created),
        "lastUpdatedAt": iso(record.updated),
        "ttlMs": record.ttl_ms,
        "pollIntervalMs": POLL_INTERVAL_MS,
    }
    if record.message:
        task["statusMessage"] = record.message
    if record.status == COMPLETED and record.result is not None:
        task["result"] = record.result
    elif record.status == FAILED:
        task["error"] = record.error or {"code": INTERNAL_ERROR, "message": record.message}
    return task


def declared(ctx: Any) -> bool:
    """Did the client declare the extension on this request?"""
    params = ctx.params if isinstance(ctx.params, dict) else {}
    meta = params.get("_meta")
    capabilities = meta.get(CLIENT_CAPABILITIES_META_KEY) if isinstance(meta, dict) else None
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and EXTENSION in extensions


class TasksExtension:
    def __init__(self, tasks: Tasks, after: float) -> None:
        self.tasks, self.after = tasks, after
        self._stamp: dict[str, Any] = {}

    def register(self, lowlevel: Server[Any]) -> None:
        declared_capabilities = lowlevel.get_capabilities
        self._stamp = lowlevel.server_info_stamp

        def get_capabilities(*args: Any, protocol_version: str | None = None, **kw: Any) -> Any:
            capabilities = declared_capabilities(*args, protocol_version=protocol_version, **kw)
            if protocol_version in MODERN_PROTOCOL_VERSIONS:
                capabilities.extensions = {**(capabilities.extensions or {}), EXTENSION: {}}
            return capabilities

        lowlevel.get_capabilities = get_capabilities  # type: ignore[method-assign]

        async def serve(ctx: Any, call_next: Any) -> Any:
            if ctx.method in METHODS and ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
                answer = await self._answer(ctx)
                return {
                    "resultType": "complete",
                    **answer,
                    "_meta": {SERVER_INFO_META_KEY: self._stamp},
                }
            return await call_next(ctx)

        lowlevel.middleware.append(serve)

    def asked(self, ctx: Any, params: Any) -> bool:
        """A call the server may answer with a task: execute_code, on 2026-07-28, from a
        client that declared the extension on it."""
        modern = getattr(ctx, "protocol_version", None) in MODERN_PROTOCOL_VERSIONS
        return modern and params.name in TASK_TOOLS and declared(ctx)

    async def call(self, ctx: Any, params: Any, handler: Any) -> Any:
        """The call's result if it ends within `after` seconds; else a task for it."""
        call = asyncio.ensure_future(handler(ctx, params))
        try:
            await asyncio.wait({call}, timeout=self.after)
            if call.done():
                return call.result()
            record = await self._task_for(ctx)
            if record is None:
                return await call  # no task to be had: answered when it ends, as ever
        except asyncio.CancelledError:  # the request is gone (its stream closed)
            call.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await call  # the kernel interrupted before the cancellation goes on
            raise
        self.tasks.start(record, call)
        return {"resultType": "task", **detailed(record)}

    async def _task_for(self, ctx: Any) -> Record | None:
        """A new task for the call, or None: the client has TASKS_PER_CLIENT running, or
        the store failed (said in the log; the call is then answered when it ends)."""
        owner = self.tasks._owner(ctx)
        try:
            if await self.tasks.store.working(owner) >= TASKS_PER_CLIENT:
                return None
            return await self.tasks.store.create(owner, None)
        except Exception as exc:
            log.warning("no task for a long call (answered when it ends): %s", exc)
            return None

    async def _answer(self, ctx: Any) -> dict[str, Any]:
        if not declared(ctx):
            required: dict[str, Any] = {"requiredCapabilities": {"extensions": {EXTENSION: {}}}}
            raise MCPError(MISSING_CAPABILITY, "Missing required client capability", required)
        params = ctx.params if isinstance(ctx.params, dict) else {}
        task_id = params.get("taskId")
        if not isinstance(task_id, str) or not task_id or len(task_id) > ID_MAX:
            raise MCPError(INVALID_PARAMS, f"{ctx.method}: taskId must be a task's id")
        record = await self.tasks._find(ctx, task_id)
        if ctx.method == "tasks/get":
            return detailed(record)
        if ctx.method == "tasks/update":
            if not isinstance(params.get("inputResponses"), dict):
                raise MCPError(INVALID_PARAMS, "tasks/update: inputResponses must be an object")
            return {}  # nothing outstanding: a task of execute_code never asks for input
        if record.status == WORKING:
            try:
                await self.tasks.cancel(record)
            except MCPError as exc:  # ended first: acknowledged all the same
                if exc.error.code != INVALID_PARAMS:
                    raise
        return {}
