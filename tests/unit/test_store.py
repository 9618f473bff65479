"""The local store: status patches are atomic across processes."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from mcp_forge.runtimes.local.store import Store


def _count(path: str, times: int) -> None:
    store = Store(Path(path))
    for _ in range(times):
        with store._db() as db:
            row = db.execute("SELECT body FROM sessions").fetchone()
            body = json.loads(row[0])
            body["status"]["n"] = body["status"].get("n", 0) + 1
            db.execute("UPDATE sessions SET body=?", (json.dumps(body),))


def test_concurrent_status_patches_from_processes_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = Store(path)
    body = {"metadata": {"namespace": "default", "name": "s"}, "spec": {}, "status": {}}
    store.create(body, "key")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_count, args=(str(path), 50)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert store.get("default", "s")["status"]["n"] == 200


def test_patch_status_merges_and_deletes_keys(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.create({"metadata": {"namespace": "d", "name": "s"}, "status": {"a": 1, "b": 2}}, "k")
    body = store.patch_status("d", "s", {"a": None, "c": 3})
    assert body["status"] == {"b": 2, "c": 3}
    assert store.get("d", "s")["status"] == {"b": 2, "c": 3}
    assert store.key("d", "s") == "k"
    assert oct((tmp_path / "store.db").stat().st_mode & 0o777) == "0o600"
