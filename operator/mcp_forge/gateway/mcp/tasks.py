"""Long cells as tasks (MCP 2025-11-25): a client that sends `execute_code` with
`params.task` gets a task at once (CreateTaskResult) while the cell runs on in the
gateway, not in the request; `tasks/get` says how it goes, `tasks/result` waits for it
and gives the result execute_code would have given, `tasks/cancel` interrupts the
kernel, `tasks/list` shows a client its own tasks only. A client that does not ask for
a task is served as before.

The SDK (mcp 2.3) has the types and nothing else: this module wraps its `tools/call`
handler, adds the `tasks/*` handlers, declares the `tasks` capability and marks
execute_code `execution.taskSupport: optional`. Tasks are the client's (the owner its
credential names): another client's task id is as unknown as a made-up one, and ids are
random. 2026-07-28 moved tasks to an extension (SEP-2663): tasks_ext.py serves it;
there `params.task` is refused.

Kept where the gateway keeps a session's state in local mode (tasks_store.py: a file per
task in the state directory), so a client picks up a result after it reconnected, and
after the gateway restarted; a task that was running when its gateway stopped is
`failed` (the kernel kept its state; the result was lost with the gateway). On a cluster
in the API (tasks_kube.py), where every replica finds them. Bounded: TASKS_PER_CLIENT
live at once, each kept for its ttl (at most TTL_MAX) from its creation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import anyio
from mcp import MCPError
from mcp.server.mcpserver import MCPServer
from mcp_types import (
    CallToolResult,
    CancelTaskRequestParams,
    CancelTaskResult,
    CreateTaskResult,
    GetTaskPayloadRequestParams,
    GetTaskRequestParams,
    GetTaskResult,
    ListTasksResult,
    ListToolsResult,
    PaginatedRequestParams,
    ServerTasksCapability,
    ServerTasksRequestsCapability,
    Task,
    TasksCallCapability,
    TasksCancelCapability,
    TasksListCapability,
    TasksToolsCapability,
    ToolExecution,
)
from mcp_types import methods as _methods
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp_forge.errors import ForgeError
from mcp_forge.gateway.mcp.tasks_ext import TasksExtension
from mcp_forge.gateway.mcp.tasks_store import (
    CANCELLED,
    COMPLETED,
    FAILED,
    POLL_INTERVAL_MS,
    TASK_TOOLS,
    TASKS_PER_CLIENT,
    WORKING,
    Record,
    Store,
    iso,
)

if TYPE_CHECKING:
    from mcp_forge.gateway.mcp.tools import Tools

log = logging.getLogger(__name__)

RELATED_TASK = "io.modelcontextprotocol/related-task"
TASKS_VERSION = "2025-11-25"  # the one protocol version with tasks in its core
PAGE = 50  # tasks per tasks/list page
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
METHOD_NOT_FOUND = -32601


def _task(record: Record) -> dict[str, Any]:
    return {
        "taskId": record.task_id,
        "status": record.status,
        "statusMessage": record.message or None,
        "createdAt": iso(record.created),
        "lastUpdatedAt": iso(record.updated),
        "ttl": record.ttl_ms,
        "pollInterval": POLL_INTERVAL_MS,
    }


class Tasks:
    """The task support of the module docstring, on one MCPServer."""

    def __init__(self, tools: Tools, store: Store) -> None:
        self.tools = tools
        self.store = store
        self._running: dict[str, tuple[asyncio.Task[None], Record]] = {}  # here
        store.on_cancel = self._cancelled_elsewhere
        self.extension = TasksExtension(self, tools.gateway.settings.task_after)

    def register(self, server: MCPServer) -> None:
        _accept_task_results()
        lowlevel = server._lowlevel_server
        call = lowlevel._request_handlers["tools/call"]
        listing = lowlevel._request_handlers["tools/list"]

        async def call_tool(ctx: Any, params: Any) -> Any:
            if params.task is not None:
                return await self._create(ctx, params, call.handler)
            if self.extension.asked(ctx, params):
                return await self.extension.call(ctx, params, call.handler)
            return await call.handler(ctx, params)

        async def list_tools(ctx: Any, params: Any) -> Any:
            listed = await listing.handler(ctx, params)
            if _tasks_served(ctx) and isinstance(listed, ListToolsResult):
                for tool in listed.tools:
                    if tool.name in TASK_TOOLS:
                        tool.execution = ToolExecution(task_support="optional")
            return listed

        lowlevel.add_request_handler("tools/call", call.params_type, call_tool)
        lowlevel.add_request_handler("tools/list", listing.params_type, list_tools)
        lowlevel.add_request_handler("tasks/get", GetTaskRequestParams, self._get)
        lowlevel.add_request_handler("tasks/result", GetTaskPayloadRequestParams, self._result)
        lowlevel.add_request_handler("tasks/cancel", CancelTaskRequestParams, self._cancel)
        lowlevel.add_request_handler("tasks/list", PaginatedRequestParams, self._list)
        declared = lowlevel.get_capabilities

        def get_capabilities(*args: Any, protocol_version: str | None = None, **kw: Any) -> Any:
            capabilities = declared(*args, protocol_version=protocol_version, **kw)
            if protocol_version not in MODERN_PROTOCOL_VERSIONS:
                capabilities.tasks = ServerTasksCapability(
                    list=TasksListCapability(),
                    cancel=TasksCancelCapability(),
                    requests=ServerTasksRequestsCapability(
                        tools=TasksToolsCapability(call=TasksCallCapability())
                    ),
                )
            return capabilities

        lowlevel.get_capabilities = get_capabilities  # type: ignore[method-assign]
        self.extension.register(lowlevel)

        async def initialize(ctx: Any, call_next: Any) -> Any:
            """initialize's capabilities are computed without the version (docs/mcp-sdk.md):
            `tasks` is taken out for the versions without them."""
            result = await call_next(ctx)
            told = result if ctx.method == "initialize" and isinstance(result, dict) else {}
            if told and told.get("protocolVersion") != TASKS_VERSION:  # the wire's form
                (told.get("capabilities") or {}).pop("tasks", None)
            return result

        lowlevel.middleware.append(initialize)

    def _owner(self, ctx: Any) -> str:
        return self.tools._client_from(getattr(ctx.request, "headers", None)).owner

    async def _create(self, ctx: Any, params: Any, handler: Any) -> CreateTaskResult:
        if not _tasks_served(ctx):
            why = f"tasks are served on protocol {TASKS_VERSION} only (not 2026-07-28's yet)"
            raise MCPError(INVALID_PARAMS, why)
        if params.name not in TASK_TOOLS:
            raise MCPError(
                METHOD_NOT_FOUND, f"{params.name} cannot run as a task (only execute_code)"
            )
        owner = self._owner(ctx)
        if await self.store.working(owner) >= TASKS_PER_CLIENT:
            raise MCPError(
                INVALID_PARAMS,
                f"{TASKS_PER_CLIENT} tasks of yours are running: wait for one or cancel it",
            )
        record = await self.store.create(owner, params.task.ttl)
        plain = params.model_copy(update={"task": None})
        self.start(record, handler(ctx, plain))
        return CreateTaskResult(task=Task.model_validate(_task(record)))

    def start(self, record: Record, call: Awaitable[Any]) -> None:
        """Run the tool call `call` as the task `record`, outside any request."""
        running = asyncio.create_task(
            self._run(record, call), name=f"mcp-task-{record.task_id[:8]}"
        )
        self._running[record.task_id] = (running, record)

    async def _run(self, record: Record, call: Awaitable[Any]) -> None:
        """The tool call, outside its request: its result, or error, goes to the store."""
        try:
            result = await call
            await self.store.finish(
                record,
                COMPLETED,
                result=result.model_dump(by_alias=True, mode="json", exclude_none=True),
            )
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await self.store.finish(record, CANCELLED, message=CANCELLED_MESSAGE)
            raise
        except MCPError as exc:
            await self.store.finish(
                record,
                FAILED,
                message=exc.error.message,
                error=exc.error.model_dump(exclude_none=True),
            )
        except Exception as exc:  # a bug: said, not hidden, and the task ends
            log.exception("task %s failed", record.task_id)
            why = f"the gateway failed running it: {type(exc).__name__}"
            await self.store.finish(
                record, FAILED, message=why, error={"code": INTERNAL_ERROR, "message": why}
            )
        finally:
            self._running.pop(record.task_id, None)

    async def _find(self, ctx: Any, task_id: str) -> Record:
        record = await self.store.get(self._owner(ctx), task_id)
        if record is None:
            raise MCPError(
                INVALID_PARAMS, f"no task {task_id[:100]!r} (unknown, expired, or not yours)"
            )
        return record

    async def _get(self, ctx: Any, params: GetTaskRequestParams) -> GetTaskResult:
        return GetTaskResult.model_validate(_task(await self._find(ctx, params.task_id)))

    async def _result(self, ctx: Any, params: GetTaskPayloadRequestParams) -> CallToolResult:
        record = await self.store.finished(await self._find(ctx, params.task_id))
        related = {RELATED_TASK: {"taskId": record.task_id}}
        if record.status == COMPLETED and record.result is not None:
            result = CallToolResult.model_validate(record.result)
            result.meta = {**(result.meta or {}), **related}
            return result
        error = record.error or {"code": INTERNAL_ERROR, "message": record.message}
        raise MCPError(
            int(error.get("code", INTERNAL_ERROR)), str(error.get("message")), data=related
        )

    async def _cancel(self, ctx: Any, params: CancelTaskRequestParams) -> CancelTaskResult:
        record = await self._find(ctx, params.task_id)
        if record.status != WORKING:
            raise MCPError(
                INVALID_PARAMS, f"task {record.task_id} is {record.status}: it cannot be cancelled"
            )
        return CancelTaskResult.model_validate(_task(await self.cancel(record)))

    async def cancel(self, record: Record) -> Record:
        """Cancel a working task: here, its kernel interrupted; elsewhere, its gateway
        told through the store."""
        running, _ = self._running.get(record.task_id, (None, None))
        if running is None:  # running on another gateway: it interrupts the kernel
            try:
                record = await self.store.cancel(record, CANCELLED_MESSAGE)
            except ForgeError as exc:  # not written: not cancelled, and said so
                raise MCPError(INTERNAL_ERROR, f"could not cancel the task: {exc}") from exc
            if record.status != CANCELLED:
                raise MCPError(
                    INVALID_PARAMS,
                    f"task {record.task_id} is {record.status}: it cannot be cancelled",
                )
        else:
            self._stop(running)
            # Waited for, never awaited: a cancellation of this request must not reach
            # the task while it stops its cell (a second cancel cuts the interrupt short).
            await asyncio.wait({running})
        return record

    def _cancelled_elsewhere(self, task_id: str) -> None:
        """Another gateway cancelled a task running here (its status already says so)."""
        running, _ = self._running.get(task_id, (None, None))
        if running is not None:
            self._stop(running)

    @staticmethod
    def _stop(running: asyncio.Task[None]) -> None:
        """Cancel the task once: a second cancellation would cut short the interrupt the
        first one set going (gateway/core.py settles a cancelled call, shielded)."""
        if not running.cancelling() and not running.done():
            running.cancel()

    async def _list(self, ctx: Any, params: PaginatedRequestParams) -> ListTasksResult:
        mine = await self.store.list(self._owner(ctx))
        start = 0
        if params.cursor:
            ids = [r.task_id for r in mine]
            if params.cursor not in ids:
                raise MCPError(INVALID_PARAMS, "unknown cursor")
            start = ids.index(params.cursor)
        page = mine[start : start + PAGE]
        more = mine[start + PAGE : start + PAGE + 1]
        return ListTasksResult(
            tasks=[Task.model_validate(_task(r)) for r in page],
            next_cursor=more[0].task_id if more else None,
        )

    async def aclose(self) -> None:
        """The gateway stops: its running tasks end as failed (their kernels keep state)."""
        for running, record in list(self._running.values()):
            await self.store.finish(record, FAILED, message=STOPPED)
            running.cancel()
        await self.store.aclose()


CANCELLED_MESSAGE = "cancelled: the kernel was interrupted"
STOPPED = "the gateway stopped while the cell ran; the session kept its state, not this result"


def _tasks_served(ctx: Any) -> bool:
    return getattr(ctx, "protocol_version", None) == TASKS_VERSION


def _accept_task_results() -> None:
    """Let a tools/call be answered with a CreateTaskResult, as 2025-11-25 has it.

    The SDK's runner checks each result of a specification method against that method's
    result type for the version (`mcp_types.methods.serialize_server_result`), and for
    tools/call that is CallToolResult alone: a task's answer is refused as "Handler
    returned an invalid result". Wrapped here, once, for that one shape. (Upstream: the
    2025-11-25 surface of tools/call could be CallToolResult | CreateTaskResult.)"""
    original = _methods.serialize_server_result
    if getattr(original, "_accepts_tasks", False):
        return

    def serialize(method: str, version: str, data: Any, **kw: Any) -> dict[str, Any]:
        shaped = method == "tools/call" and "task" in data and "content" not in data
        if shaped and version == TASKS_VERSION:
            task = CreateTaskResult.model_validate(data)
            return task.model_dump(by_alias=True, mode="json", exclude_none=True)
        return original(method, version, data, **kw)

    serialize._accepts_tasks = True  # type: ignore[attr-defined]
    _methods.serialize_server_result = serialize
