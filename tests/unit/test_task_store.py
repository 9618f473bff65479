"""Where tasks are kept (gateway/mcp/tasks_store.py): a task and its result outlive the
process that ran it, a task cut off by its gateway's end says so, every bound holds, and
a file that does not parse is set aside. The tasks themselves, on the real gateway:
tests/e2e/test_tasks.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from mcp_forge.gateway.mcp import tasks_store
from mcp_forge.gateway.mcp.tasks_store import COMPLETED, FAILED, WORKING, TaskStore


def task_files(directory: Path) -> list[Path]:
    """The task files in `directory` (the store's layout: a directory per client)."""
    return list(directory.glob("*/*.json"))


async def test_a_task_and_its_result_outlive_the_store_and_a_cut_off_one_says_so(
    tmp_path: Path,
) -> None:
    first = TaskStore(tmp_path)
    done = await first.create("http:alice", 600_000)
    await first.finish(done, COMPLETED, result={"content": [{"type": "text", "text": "42"}]})
    cut = await first.create("http:alice", None)
    [path] = [p for p in task_files(tmp_path) if p.stem == done.task_id]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    again = TaskStore(tmp_path)
    kept = await again.get("http:alice", done.task_id)
    assert kept is not None and kept.status == COMPLETED and kept.result == done.result
    assert kept.done.is_set()
    lost = await again.get("http:alice", cut.task_id)
    assert lost is not None and lost.status == FAILED and "restarted" in lost.message
    assert lost.ttl_ms == tasks_store.TTL_DEFAULT_MS
    assert await again.get("http:bob", done.task_id) is None  # another client's: not found
    assert [r.task_id for r in await again.list("http:alice")] == [cut.task_id, done.task_id]


async def test_a_task_ends_once(tmp_path: Path) -> None:
    store = TaskStore(tmp_path)
    record = await store.create("http:alice", None)
    await store.finish(record, FAILED, message="the gateway stopped")
    await store.finish(record, COMPLETED, result={"content": []})  # late: changes nothing
    again = await TaskStore(tmp_path).get("http:alice", record.task_id)
    assert again is not None and again.status == FAILED


async def test_ttl_is_bounded_and_an_expired_task_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr(tasks_store.time, "time", lambda: now[0])
    store = TaskStore(tmp_path)
    short = await store.create("http:alice", 1)
    long = await store.create("http:alice", 10**12)
    assert (short.ttl_ms, long.ttl_ms) == (tasks_store.TTL_MIN_MS, tasks_store.TTL_MAX_MS)
    now[0] += tasks_store.TTL_MIN_MS / 1000
    assert await store.get("http:alice", short.task_id) is None
    assert not [p for p in task_files(tmp_path) if p.stem == short.task_id]
    assert await store.get("http:alice", long.task_id) is not None


async def test_a_client_keeps_a_bounded_number_of_finished_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks_store, "TASKS_KEPT", 3)
    store = TaskStore(tmp_path)
    ids = []
    for _ in range(5):
        record = await store.create("http:alice", None)
        await store.finish(record, COMPLETED, result={"content": []})
        ids.append(record.task_id)
    assert [r.task_id for r in await store.list("http:alice")] == ids[:-4:-1]  # the newest three
    assert await store.working("http:alice") == 0
    await store.create("http:alice", None)
    assert await store.working("http:alice") == 1 and len(await store.list("http:alice")) == 3


async def test_a_result_too_large_is_not_kept_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks_store, "RESULT_MAX", 1000)
    store = TaskStore(tmp_path)
    record = await store.create("http:alice", None)
    await store.finish(
        record, COMPLETED, result={"content": [{"type": "text", "text": "x" * 2000}]}
    )
    assert record.status == FAILED and record.result is None and "not kept" in record.message


async def test_a_task_file_that_does_not_parse_is_set_aside(tmp_path: Path) -> None:
    store = TaskStore(tmp_path)
    record = await store.create("http:alice", None)
    [path] = task_files(tmp_path)
    path.write_text("{not json")
    other = path.parent / "forged.json"
    other.write_text(json.dumps({**json.loads("{}"), "task_id": "someone-else", "owner": "x"}))
    again = TaskStore(tmp_path)
    assert await again.get("http:alice", record.task_id) is None
    assert path.with_suffix(".bad").exists() and other.with_suffix(".bad").exists()
    assert record.status == WORKING  # the first store's own record is untouched
