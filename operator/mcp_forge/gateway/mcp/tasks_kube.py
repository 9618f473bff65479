"""Tasks (tasks.py) kept in the Kubernetes API, for cluster gateways: a Secret per task in
the gateway's own namespace (never the sessions', whose Secrets hold kernels' keys), so
that any replica answers for any task, and a task and its result outlive the replica
that ran it.

A task's Secret: labels say whose it is (a hash of the owner), its status and which
gateway process runs it; an annotation holds the small fields (what `tasks/list` reads,
from a metadata-only list); the result, once there is one, is in its data, gzipped, at
most RESULT_MAX. Writes compare and swap on the resourceVersion, so a task ends once:
a cancel through another replica sets `cancelled` and the replica running the cell,
which looks at its running tasks every POLL seconds, interrupts the kernel; its own end
then finds the task ended and leaves it. The runner's heartbeat (every `heartbeat`
seconds on each running task) tells the others it is alive: a working task whose
heartbeat is older than STALE heartbeats ended with its gateway, and says so.

Bounded: ids are 32 hex characters (anything else is unknown), a client keeps at most
TASKS_KEPT (its oldest finished ones go first), each task is deleted `ttl` after its
creation (swept by any replica at most every SWEEP seconds, and on reading).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import gzip
import hashlib
import json
import logging
import re
import secrets
import time
import zlib
from collections.abc import Callable
from typing import Any

from mcp_forge.clients.kube import Kube
from mcp_forge.errors import ApiError
from mcp_forge.gateway.mcp.tasks_store import (
    CANCELLED,
    FAILED,
    TERMINAL,
    TTL_DEFAULT_MS,
    TTL_MAX_MS,
    TTL_MIN_MS,
    WORKING,
    Record,
    too_large,
)

log = logging.getLogger(__name__)

PREFIX = "mcpforge-task-"
OWNER = "tasks.mcpforge.dev/owner"  # label: a hash of the owner
STATUS = "tasks.mcpforge.dev/status"  # label
RUNNER = "tasks.mcpforge.dev/runner"  # label: the gateway process that runs it
FIELDS = "tasks.mcpforge.dev/task"  # annotation: the small fields, JSON
HEARTBEAT = "tasks.mcpforge.dev/heartbeat"  # annotation: the runner's last sign, epoch s
OUTCOME = "outcome.json.gz"  # data: {"result": ..., "error": ...}
TASKS_KEPT = 50  # per client: each may hold up to RESULT_MAX in etcd
RESULT_MAX = 512 * 1024  # bytes of a result, gzipped
STALE = 3  # heartbeats missed: the runner is gone
POLL = 1.0  # the runner looks for its tasks cancelled elsewhere this often
SWEEP = 60.0  # expired tasks are deleted at most this often
CAS_TRIES = 5
ID = re.compile(r"[0-9a-f]{32}")
MANAGED_BY = "mcp-forge-gateway"
GONE = "the gateway running this task stopped; the session kept its state, not this result"


def _hash(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


class KubeTaskStore:
    def __init__(self, kube: Kube, namespace: str, *, heartbeat: float = 10.0) -> None:
        self.kube, self.namespace, self.heartbeat = kube, namespace, heartbeat
        self.runner = secrets.token_hex(8)
        self.on_cancel: Callable[[str], None] | None = None
        self._mine: dict[str, Record] = {}  # running in this process
        self._told: set[str] = set()  # of those, the ones cancelled elsewhere, said once
        self._loops: list[asyncio.Task[None]] = []
        self._sweeping: asyncio.Task[None] | None = None
        self._swept = 0.0

    async def _api(self, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(call, *args, **kw)

    async def _read(self, task_id: str) -> tuple[Record | None, float]:
        """The task as stored (read and parsed off the event loop), and its last beat."""

        def read() -> tuple[Record | None, float]:
            secret = self.kube.get("Secret", self.namespace, PREFIX + task_id)
            if secret is None:
                return None, 0.0
            return _record(secret), _beat_of(secret)

        found: tuple[Record | None, float] = await self._api(read)
        return found

    def _stale(self, record: Record, beat: float) -> bool:
        """A working task whose runner has not beaten for STALE heartbeats: gone."""
        return record.status == WORKING and time.time() - beat > STALE * self.heartbeat

    # ---- the API of tasks.py ----------------------------------------------------------

    async def create(self, owner: str, ttl_ms: int | None) -> Record:
        await self._keep_bounded(owner)
        now = time.time()
        ttl = min(max(ttl_ms if ttl_ms is not None else TTL_DEFAULT_MS, TTL_MIN_MS), TTL_MAX_MS)
        record = Record(secrets.token_hex(16), owner, WORKING, now, now, ttl)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "mcpforge.dev/task",
            "metadata": {
                "name": PREFIX + record.task_id,
                "namespace": self.namespace,
                "labels": {
                    "app.kubernetes.io/managed-by": MANAGED_BY,
                    OWNER: _hash(owner),
                    STATUS: WORKING,
                    RUNNER: self.runner,
                },
                "annotations": {FIELDS: _fields(record), HEARTBEAT: f"{now:.3f}"},
            },
        }
        made = await self._api(self.kube.create, body)  # durable before it is answered
        record.version = made["metadata"]["resourceVersion"]
        self._mine[record.task_id] = record
        if not [loop for loop in self._loops if not loop.done()]:
            self._loops = [
                asyncio.create_task(self._watch_cancels(), name="mcp-tasks-cancels"),
                asyncio.create_task(self._beat(), name="mcp-tasks-heartbeat"),
            ]
        return record

    async def get(self, owner: str, task_id: str) -> Record | None:
        mine = self._mine.get(task_id)
        if mine is not None:
            return mine if mine.owner == owner else None
        if not ID.fullmatch(task_id):
            return None
        record, beat = await self._read(task_id)
        if record is None or record.owner != owner:
            return None
        if record.expires <= time.time():
            await self._delete(task_id)
            return None
        if self._stale(record, beat):
            await self._gone(record)
        return record

    async def list(self, owner: str) -> list[Record]:
        now = time.time()
        mine = []
        for record, beat in await self._listed({OWNER: _hash(owner)}):
            if record.owner != owner or record.expires <= now:
                continue
            if record.task_id not in self._mine and self._stale(record, beat):
                await self._gone(record)
            mine.append(self._mine.get(record.task_id, record))
        return sorted(mine, key=lambda r: r.created, reverse=True)

    async def working(self, owner: str) -> int:
        mine = await self.list(owner)  # a gone runner's tasks count no more
        return sum(1 for r in mine if r.status == WORKING)

    async def finish(
        self,
        record: Record,
        status: str,
        *,
        message: str = "",
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """The task's end, once: if another gateway ended it first, its end stands.
        The end of a task running here is kept in memory if the API cannot be reached
        (the others then see it go stale); any other end that cannot be written raises."""
        if record.status in TERMINAL:
            return
        outcome = await asyncio.to_thread(_deflate, {"result": result, "error": error})
        if len(outcome) > RESULT_MAX:
            status, result = FAILED, None
            message, error = too_large(RESULT_MAX, " gzipped (a task's most in the API)")
            outcome = _deflate({"result": None, "error": error})
        ended = Record(**{**vars(record), "status": status, "message": message[:2000]})
        ended.updated, ended.result, ended.error = time.time(), result, error
        patch = {
            "metadata": {"labels": {STATUS: status}, "annotations": {FIELDS: _fields(ended)}},
            "data": {OUTCOME: base64.b64encode(outcome).decode()},
        }
        try:
            stored = await self._swap(record, patch)
        except ApiError as exc:
            if record.task_id not in self._mine:
                raise
            log.warning("could not keep the end of task %s: %s", record.task_id, exc)
            stored = ended
        for name in ("status", "message", "updated", "result", "error", "version"):
            setattr(record, name, getattr(stored, name))
        self._mine.pop(record.task_id, None)
        self._told.discard(record.task_id)
        record.done.set()

    async def finished(self, record: Record) -> Record:
        """The task once it has ended: waited for here, or polled where another runs it."""
        wait = 0.2
        while record.status not in TERMINAL:
            if record.task_id in self._mine:
                await record.done.wait()
                break
            await asyncio.sleep(wait)  # another gateway runs it: the API is asked again
            wait = min(wait * 2, 2.0)
            fresh = await self.get(record.owner, record.task_id)
            if fresh is None:
                why = "the task expired while it ran"
                return Record(**{**vars(record), "status": FAILED, "message": why})
            record = fresh
        return record

    async def cancel(self, record: Record, message: str) -> Record:
        """Cancel a task another gateway runs: its status says so now; that gateway sees
        it within POLL seconds and interrupts the kernel."""
        await self.finish(record, CANCELLED, message=message)
        return record

    async def aclose(self) -> None:
        for task in [*self._loops, *([self._sweeping] if self._sweeping else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- keeping ---------------------------------------------------------------------

    async def _gone(self, record: Record) -> None:
        """A task whose runner stopped beating: failed, saying so (if no one ended it)."""
        with contextlib.suppress(ApiError):
            await self.finish(record, FAILED, message=GONE, error={"code": -32603, "message": GONE})

    async def _listed(self, labels: dict[str, str]) -> builtins.list[tuple[Record, float]]:
        """The tasks with these labels, metadata only (no results): with their beats."""

        def listing() -> builtins.list[tuple[Record, float]]:
            found = self.kube.list("Secret", self.namespace, labels=labels, metadata_only=True)
            items = found.get("items") or []
            return [(r, _beat_of(i)) for i in items if (r := _record(i)) is not None]

        listed: builtins.list[tuple[Record, float]] = await self._api(listing)
        return listed

    async def _swap(self, record: Record, patch: dict[str, Any]) -> Record:
        """Write `patch` if the task is unchanged since it was read; else read it again
        and, unless it has ended meanwhile, try again."""
        for _ in range(CAS_TRIES):
            guarded = {
                **patch,
                "metadata": {**patch["metadata"], "resourceVersion": record.version},
            }
            try:
                written = await self._api(
                    self.kube.patch, "Secret", self.namespace, PREFIX + record.task_id, guarded
                )
            except ApiError as exc:
                if not exc.conflict:
                    raise
                fresh, _ = await self._read(record.task_id)
                if fresh is None:
                    raise ApiError(404, "NotFound", f"task {record.task_id} is gone") from None
                if fresh.status in TERMINAL:
                    return fresh
                record.version = fresh.version
                continue
            stored = _record(written)
            if stored is None:
                raise ApiError(0, "Invalid", f"task {record.task_id} was written unreadable")
            return stored
        raise ApiError(409, "Conflict", f"task {record.task_id}: {CAS_TRIES} writes lost")

    async def _watch_cancels(self) -> None:
        """While tasks run here: notice those another gateway ended (cancelled, or took
        for gone), and say so once each."""
        while self._mine:
            await asyncio.sleep(POLL)
            try:
                for stored, _ in await self._listed({RUNNER: self.runner}):
                    if stored.status in TERMINAL:
                        self._tell(stored.task_id)
            except Exception as exc:  # the API, or a Secret broken by hand: said, not fatal
                log.warning("tasks: could not look for cancels: %s", exc)

    def _tell(self, task_id: str) -> None:
        if task_id in self._mine and task_id not in self._told and self.on_cancel is not None:
            self._told.add(task_id)
            self.on_cancel(task_id)

    async def _beat(self) -> None:
        """While tasks run here: each one's sign of life, every heartbeat, side by side,
        each bounded by a heartbeat; written only if the task is unchanged since."""
        while self._mine:
            await asyncio.sleep(self.heartbeat)
            await asyncio.gather(*(self._beat_one(r) for r in list(self._mine.values())))

    async def _beat_one(self, record: Record) -> None:
        now = {"resourceVersion": record.version, "annotations": {HEARTBEAT: f"{time.time():.3f}"}}
        try:
            written = await self._api(
                self.kube.patch,
                "Secret",
                self.namespace,
                PREFIX + record.task_id,
                {"metadata": now},
                timeout=self.heartbeat,
            )
            record.version = written["metadata"]["resourceVersion"]
        except ApiError as exc:
            if not exc.conflict:
                log.warning("tasks: no heartbeat for %s: %s", record.task_id, exc)
                return
            with contextlib.suppress(ApiError):
                fresh, _ = await self._read(record.task_id)
                if fresh is not None and fresh.status in TERMINAL:
                    self._tell(record.task_id)  # ended elsewhere: the cell is stopped
                elif fresh is not None and record.status not in TERMINAL:
                    record.version = fresh.version

    async def _keep_bounded(self, owner: str) -> None:
        """The owner's oldest finished tasks past TASKS_KEPT go now; every expired task
        goes in the background, at most every SWEEP seconds, as far as the API lets it."""
        mine = await self.list(owner)
        done = sorted((r for r in mine if r.status in TERMINAL), key=lambda r: r.created)
        for old in done[: max(0, len(mine) + 1 - TASKS_KEPT)]:
            await self._delete(old.task_id)
        if time.monotonic() - self._swept >= SWEEP:
            self._swept = time.monotonic()
            self._sweeping = asyncio.create_task(self._sweep(), name="mcp-tasks-sweep")

    async def _sweep(self) -> None:
        try:
            now = time.time()
            for record, _ in await self._listed({"app.kubernetes.io/managed-by": MANAGED_BY}):
                if record.expires <= now:
                    await self._delete(record.task_id)
        except Exception as exc:
            log.warning("tasks: the sweep of expired tasks stopped: %s", exc)

    async def _delete(self, task_id: str) -> None:
        with contextlib.suppress(ApiError):
            await self._api(self.kube.delete, "Secret", self.namespace, PREFIX + task_id)


def _fields(record: Record) -> str:
    return json.dumps(
        {
            "taskId": record.task_id,
            "owner": record.owner,
            "status": record.status,
            "created": record.created,
            "updated": record.updated,
            "ttlMs": record.ttl_ms,
            "message": record.message,
        }
    )


def _record(obj: dict[str, Any]) -> Record | None:
    """The task a Secret (or its metadata) holds; None if it is not one, or is broken."""
    meta = obj.get("metadata") or {}
    try:
        f = json.loads((meta.get("annotations") or {})[FIELDS])
        record = Record(
            str(f["taskId"]),
            str(f["owner"]),
            str((meta.get("labels") or {})[STATUS]),
            float(f["created"]),
            float(f["updated"]),
            int(f["ttlMs"]),
            str(f.get("message") or ""),
        )
        if meta.get("name") != PREFIX + record.task_id or not ID.fullmatch(record.task_id):
            return None
        blob = (obj.get("data") or {}).get(OUTCOME)
        if blob:
            outcome = json.loads(_inflate(base64.b64decode(blob), 64 * RESULT_MAX))
            record.result, record.error = outcome.get("result"), outcome.get("error")
    except (
        KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError, zlib.error
    ) as exc:  # fmt: skip
        log.warning("tasks: setting aside %s: %s", meta.get("name"), exc)
        return None
    record.version = str(meta.get("resourceVersion") or "")
    if record.status in TERMINAL:
        record.done.set()
    return record


def _inflate(blob: bytes, limit: int) -> bytes:
    """Gunzip at most `limit` bytes: a larger outcome is refused, never inflated whole."""
    inflater = zlib.decompressobj(wbits=31)
    raw = inflater.decompress(blob, limit)
    if inflater.unconsumed_tail or not inflater.eof:
        raise ValueError(f"an outcome larger than {limit} bytes, or cut short")
    return raw


def _beat_of(obj: dict[str, Any]) -> float:
    """When the task's runner last beat for it (0: never, or unreadable)."""
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(HEARTBEAT)
    try:
        return float(str(text)) if text is not None else 0.0
    except (ValueError, OverflowError):
        return 0.0


def _deflate(outcome: dict[str, Any]) -> bytes:
    return gzip.compress(json.dumps(outcome).encode())
