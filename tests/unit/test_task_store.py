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


def test_a_task_and_its_result_outlive_the_store_and_a_cut_off_one_says_so(tmp_path: Path) -> None:
    first = TaskStore(tmp_path)
    done = first.create("http:alice", 600_000)
    first.finish(done, COMPLETED, result={"content": [{"type": "text", "text": "42"}]})
    cut = first.create("http:alice", None)
    [path] = [p for p in tmp_path.glob("*/*.json") if p.stem == done.task_id]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    again = TaskStore(tmp_path)
    kept = again.get("http:alice", done.task_id)
    assert kept is not None and kept.status == COMPLETED and kept.result == done.result
    assert kept.done.is_set()
    lost = again.get("http:alice", cut.task_id)
    assert lost is not None and lost.status == FAILED and "restarted" in lost.message
    assert lost.ttl_ms == tasks_store.TTL_DEFAULT_MS
    assert again.get("http:bob", done.task_id) is None  # another client's: not found
    assert [r.task_id for r in again.list("http:alice")] == [cut.task_id, done.task_id]


def test_a_task_ends_once(tmp_path: Path) -> None:
    store = TaskStore(tmp_path)
    record = store.create("http:alice", None)
    store.finish(record, FAILED, message="the gateway stopped")
    store.finish(record, COMPLETED, result={"content": []})  # late: changes nothing
    assert TaskStore(tmp_path).get("http:alice", record.task_id).status == FAILED  # type: ignore[union-attr]


def test_ttl_is_bounded_and_an_expired_task_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr(tasks_store.time, "time", lambda: now[0])
    store = TaskStore(tmp_path)
    short = store.create("http:alice", 1)
    long = store.create("http:alice", 10**12)
    assert (short.ttl_ms, long.ttl_ms) == (tasks_store.TTL_MIN_MS, tasks_store.TTL_MAX_MS)
    now[0] += tasks_store.TTL_MIN_MS / 1000
    assert store.get("http:alice", short.task_id) is None
    assert not [p for p in tmp_path.glob("*/*.json") if p.stem == short.task_id]
    assert store.get("http:alice", long.task_id) is not None


def test_a_client_keeps_a_bounded_number_of_finished_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks_store, "TASKS_KEPT", 3)
    store = TaskStore(tmp_path)
    ids = []
    for _ in range(5):
        record = store.create("http:alice", None)
        store.finish(record, COMPLETED, result={"content": []})
        ids.append(record.task_id)
    assert [r.task_id for r in store.list("http:alice")] == ids[:-4:-1]  # the newest three
    assert store.working("http:alice") == 0
    store.create("http:alice", None)
    assert store.working("http:alice") == 1 and len(store.list("http:alice")) == 3


def test_a_result_too_large_is_not_kept_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks_store, "RESULT_MAX", 1000)
    store = TaskStore(tmp_path)
    record = store.create("http:alice", None)
    store.finish(record, COMPLETED, result={"content": [{"type": "text", "text": "x" * 2000}]})
    assert record.status == FAILED and record.result is None and "not kept" in record.message


def test_a_task_file_that_does_not_parse_is_set_aside(tmp_path: Path) -> None:
    store = TaskStore(tmp_path)
    record = store.create("http:alice", None)
    [path] = tmp_path.glob("*/*.json")
    path.write_text("{not json")
    other = path.parent / "forged.json"
    other.write_text(json.dumps({**json.loads("{}"), "task_id": "someone-else", "owner": "x"}))
    again = TaskStore(tmp_path)
    assert again.get("http:alice", record.task_id) is None
    assert path.with_suffix(".bad").exists() and other.with_suffix(".bad").exists()
    assert record.status == WORKING  # the first store's own record is untouched
