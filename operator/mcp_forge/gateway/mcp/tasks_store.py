"""Where tasks (tasks.py) are kept: in memory, and, given a directory (local mode: the
state directory's tasks/), a JSON file per task, written whole (temporary file, then
rename), 0600, under a directory per client (the owner's hash), so that a task and its
result outlive a client's connection and the gateway's process.

Bounded: a task is forgotten `ttl` after its creation (the client's ask, between
TTL_MIN and TTL_MAX, TTL_DEFAULT if none); a client has at most TASKS_PER_CLIENT working
and TASKS_KEPT in all (its oldest finished ones go first); a result larger than
RESULT_MAX is not kept (the task fails, saying so; the cell's full output is in the
session's /workspace/.mcp-forge/outputs as ever). A file that does not parse is set
aside, never trusted.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

WORKING, COMPLETED, FAILED, CANCELLED = "working", "completed", "failed", "cancelled"
TERMINAL = (COMPLETED, FAILED, CANCELLED)
TTL_DEFAULT_MS = 3_600_000
TTL_MIN_MS = 60_000
TTL_MAX_MS = 86_400_000
TASKS_PER_CLIENT = 16  # working at once
TASKS_KEPT = 200  # per client, finished ones included
RESULT_MAX = 16 * 1024 * 1024  # bytes of a result's JSON
TASK_TOOLS = ("execute_code",)  # the tools a client may call as a task
POLL_INTERVAL_MS = 1000  # what a client is told to poll at
RESTARTED = (
    "the gateway restarted while the cell ran; the session kept its state (its variables, "
    "unless the kernel died), but this result was lost with the gateway"
)


@dataclass
class Record:
    task_id: str
    owner: str
    status: str
    created: float
    updated: float
    ttl_ms: int
    message: str = ""
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    version: str = field(default="", repr=False, compare=False)  # as stored (the API's)

    @property
    def expires(self) -> float:
        return self.created + self.ttl_ms / 1000


_KEPT = tuple(f.name for f in fields(Record) if f.name not in ("done", "version"))


class Store(Protocol):
    """What tasks.py asks of where tasks are kept: here, or the API (tasks_kube.py)."""

    on_cancel: Callable[[str], None] | None  # a task of ours cancelled by another gateway

    async def create(self, owner: str, ttl_ms: int | None) -> Record: ...
    async def get(self, owner: str, task_id: str) -> Record | None: ...
    async def list(self, owner: str) -> list[Record]: ...
    async def working(self, owner: str) -> int: ...
    async def finish(
        self,
        record: Record,
        status: str,
        *,
        message: str = "",
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None: ...
    async def finished(self, record: Record) -> Record: ...
    async def cancel(self, record: Record, message: str) -> Record: ...
    async def aclose(self) -> None: ...


def iso(t: float) -> str:
    """Epoch seconds as the protocol's timestamps: ISO 8601, UTC, milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def too_large(limit: int, where: str) -> tuple[str, dict[str, Any]]:
    message = f"the result is larger than {limit // 1024} KiB{where} and was not kept"
    return message, {"code": -32603, "message": message}


class TaskStore:
    """Tasks in memory, and on disk given a directory."""

    on_cancel: Callable[[str], None] | None = None  # one gateway per directory: never

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._tasks: dict[str, Record] = {}
        if directory is not None:
            self._load(directory)

    # ---- the API of tasks.py ----------------------------------------------------------

    async def create(self, owner: str, ttl_ms: int | None) -> Record:
        return self._create(owner, ttl_ms)

    def _create(self, owner: str, ttl_ms: int | None) -> Record:
        self._expire()
        now = time.time()
        ttl = min(max(ttl_ms if ttl_ms is not None else TTL_DEFAULT_MS, TTL_MIN_MS), TTL_MAX_MS)
        record = Record(secrets.token_urlsafe(18), owner, WORKING, now, now, ttl)
        self._tasks[record.task_id] = record
        mine = [r for r in self._tasks.values() if r.owner == owner and r.status in TERMINAL]
        for old in sorted(mine, key=lambda r: r.created)[
            : max(0, len(self._list(owner)) - TASKS_KEPT)
        ]:
            self._drop(old)
        self._write(record)
        return record

    async def get(self, owner: str, task_id: str) -> Record | None:
        self._expire()
        record = self._tasks.get(task_id)
        return record if record is not None and record.owner == owner else None

    async def list(self, owner: str) -> list[Record]:
        return self._list(owner)

    def _list(self, owner: str) -> builtins.list[Record]:
        """The owner's tasks, newest first."""
        self._expire()
        mine = [r for r in self._tasks.values() if r.owner == owner]
        return sorted(mine, key=lambda r: r.created, reverse=True)

    async def working(self, owner: str) -> int:
        return sum(1 for r in self._tasks.values() if r.owner == owner and r.status == WORKING)

    async def finish(
        self,
        record: Record,
        status: str,
        *,
        message: str = "",
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        self._finish(record, status, message=message, result=result, error=error)

    def _finish(
        self,
        record: Record,
        status: str,
        *,
        message: str = "",
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """The task's end (once: a later end of the same task changes nothing)."""
        if record.status in TERMINAL:
            return
        if result is not None and len(json.dumps(result)) > RESULT_MAX:
            status, result = FAILED, None
            message, error = too_large(RESULT_MAX, "")
        record.status, record.message, record.result, record.error = status, message, result, error
        record.updated = time.time()
        record.done.set()
        if record.task_id in self._tasks:
            self._write(record)

    async def finished(self, record: Record) -> Record:
        if record.status not in TERMINAL:
            await record.done.wait()
        return record

    async def cancel(self, record: Record, message: str) -> Record:
        """A task running nowhere (none here is: each runs in this process)."""
        self._finish(record, CANCELLED, message=message)
        return record

    async def aclose(self) -> None:
        return None

    # ---- keeping ---------------------------------------------------------------------

    def _expire(self) -> None:
        now = time.time()
        for record in [r for r in self._tasks.values() if r.expires <= now]:
            self._drop(record)

    def _drop(self, record: Record) -> None:
        self._tasks.pop(record.task_id, None)
        path = self._path(record)
        if path is not None:
            path.unlink(missing_ok=True)

    def _path(self, record: Record) -> Path | None:
        if self.directory is None:
            return None
        client = hashlib.sha256(record.owner.encode()).hexdigest()[:16]
        return self.directory / client / f"{record.task_id}.json"

    def _write(self, record: Record) -> None:
        path = self._path(record)
        if path is None:
            return
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Not asdict: it deep-copies `done`, whose waiters cannot be copied.
            data = {k: getattr(record, k) for k in _KEPT}
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as exc:  # kept in memory still: said
            log.warning("could not keep task %s on disk: %s", record.task_id, exc)

    def _load(self, directory: Path) -> None:
        """The tasks kept by an earlier gateway: a working one was cut off by its end."""
        now = time.time()
        for path in sorted(directory.glob("*/*.json")):
            try:
                if path.stat().st_size > RESULT_MAX + 65536:
                    raise ValueError("too large")
                data = json.loads(path.read_text())
                record = Record(**{k: data[k] for k in _KEPT})
                if record.task_id != path.stem or not isinstance(record.status, str):
                    raise ValueError("not the task its name says")
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("setting aside task file %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".bad"))
                continue
            if record.expires <= now:
                path.unlink(missing_ok=True)
                continue
            self._tasks[record.task_id] = record
            if record.status not in TERMINAL:
                self._finish(
                    record, FAILED, message=RESTARTED, error={"code": -32603, "message": RESTARTED}
                )
            else:
                record.done.set()
