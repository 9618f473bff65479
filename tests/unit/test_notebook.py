"""The notebook builder (gateway/notebook.py) on journals as the kernel's guard writes
them, and as a hostile kernel might: the result always passes nbformat's validator,
stays within its size limit, and is built in a worker (gateway/notebook_worker.py) in
time linear in the journal, under time and memory caps, off the event loop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from mcp_forge.errors import InvalidRequest, KernelProtocolError
from mcp_forge.gateway.notebook import AT_LIMIT, RESTARTED, NotebookTooLarge, build
from mcp_forge.gateway.notebook_worker import ExportSlots, WorkerLimits, build_in_worker
from mcp_forge.kernelside.guard import Guard, Limits

LIMIT = 10_000_000
WORKER = WorkerLimits(size=LIMIT, seconds=60.0, memory=1_000_000_000)

PNG = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def record(source: str, outputs: list[Any], **extra: Any) -> bytes:
    entry = {
        "v": 1,
        "kernel": "k1",
        "source": source,
        "execution_count": 1,
        "status": "ok",
        "started": "2026-12-01T10:00:00+00:00",
        "ended": "2026-12-01T10:00:01+00:00",
        "outputs": outputs,
        **extra,
    }
    return json.dumps(entry).encode() + b"\n"


def parsed(text: str) -> Any:
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    return nb


def test_cells_outputs_counts_and_timings() -> None:
    journal = (
        record("print('hi')", [{"type": "stream", "content": {"name": "stdout", "text": "hi\n"}}])
        + record(
            "x",
            [
                {
                    "type": "execute_result",
                    "content": {"execution_count": 2, "data": {"text/plain": "42"}, "metadata": {}},
                }
            ],
            execution_count=2,
        )
        + record(
            "show()",
            [{"type": "display_data", "content": {"data": {"image/png": PNG}, "metadata": {}}}],
            execution_count=3,
        )
        + record(
            "1/0",
            [
                {
                    "type": "error",
                    "content": {"ename": "ZeroDivisionError", "evalue": "x", "traceback": ["tb"]},
                }
            ],
            execution_count=4,
            status="error",
        )
    )
    nb = build(journal, session="s", limit=LIMIT)
    assert (nb.cells, nb.skipped) == (4, 0)
    cells = parsed(nb.text).cells
    assert [c.execution_count for c in cells] == [1, 2, 3, 4]
    assert cells[0].outputs[0].text == "hi\n"
    assert cells[1].outputs[0].data["text/plain"] == "42"
    assert cells[2].outputs[0].data["image/png"] == PNG
    assert cells[3].outputs[0].ename == "ZeroDivisionError"
    assert cells[0].metadata["execution"]["shell.execute_reply"] == "2026-12-01T10:00:01+00:00"


def test_a_new_kernel_process_is_marked_as_a_restart() -> None:
    nb = build(record("a = 1", []) + record("a", [], kernel="k2"), session="s", limit=LIMIT)
    cells = parsed(nb.text).cells
    assert [c.cell_type for c in cells] == ["code", "markdown", "code"]
    assert cells[1].source == RESTARTED


def test_an_updated_display_shows_its_last_data() -> None:
    shown = {"data": {"text/plain": "first"}, "metadata": {}, "transient": {"display_id": "d"}}
    update = {"data": {"text/plain": "second"}, "metadata": {}, "transient": {"display_id": "d"}}
    nb = build(
        record(
            "h = display('first', display_id=True); h.update('second')",
            [
                {"type": "display_data", "content": shown},
                {"type": "update_display_data", "content": update},
            ],
        ),
        session="s",
        limit=LIMIT,
    )
    outputs = parsed(nb.text).cells[0].outputs
    assert [o.data["text/plain"] for o in outputs] == ["second"]


def test_malformed_records_and_outputs_are_skipped_and_counted() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    journal = (
        b"{not json\n"
        + deep
        + b"\n"
        + json.dumps({"v": 99, "source": "x", "outputs": []}).encode()
        + b"\n"
        + json.dumps({"v": 1, "source": 5, "outputs": []}).encode()
        + b"\n"
        + record(
            "ok",
            [
                "not a dict",
                {"type": "execute_result", "content": {"data": "not a bundle"}},
                {"type": "clear_output", "content": {}},
                {"type": "stream", "content": {"name": "stdout", "text": "kept"}},
            ],
            execution_count=-3,
        )
    )
    nb = build(journal, session="s", limit=LIMIT)
    cells = parsed(nb.text).cells
    assert nb.cells == 1
    assert [o.output_type for o in cells[0].outputs] == ["stream"]
    assert cells[0].execution_count is None  # not a positive count: none
    assert nb.skipped == 4 + 3


def test_an_empty_journal_is_an_empty_valid_notebook() -> None:
    nb = build(b"", session="s", limit=LIMIT)
    assert (nb.cells, nb.skipped) == (0, 0)
    assert parsed(nb.text).metadata["kernelspec"]["name"] == "python3"


def test_an_output_the_schema_rejects_is_left_out_and_its_cell_kept() -> None:
    bad = {"type": "display_data", "content": {"data": {"image/png": 5}, "metadata": {}}}
    nb = build(record("bad", [bad]) + record("good", []), session="s", limit=LIMIT)
    cells = parsed(nb.text).cells
    assert [(c.source, c.outputs) for c in cells] == [("bad", []), ("good", [])]
    assert (nb.cells, nb.skipped) == (2, 1)


def small_outputs(size: int) -> bytes:
    """A journal of about `size` bytes: cells of 200 small displays each (the shape of
    the issue's 6 MB journal, which took nbformat's constructors 35 s)."""
    outputs = [{"type": "display_data", "content": {"data": {"text/plain": "y"}, "metadata": {}}}]
    line = record("show()", outputs * 200)
    return line * max(1, size // len(line))


def best_of(runs: int, journal: bytes) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        build(journal, session="s", limit=10 * len(journal) + LIMIT)
        times.append(time.perf_counter() - started)
    return min(times)


def test_the_build_time_grows_linearly_with_the_journal() -> None:
    small, large = small_outputs(600_000), small_outputs(6_000_000)
    ratio = best_of(2, large) / best_of(3, small)  # best of several: a shared, noisy host
    assert ratio < 25, ratio  # 10 if linear; nbformat's per-output validation was not the issue


def test_the_text_is_what_nbformat_writes() -> None:
    journal = record(
        "print('a')\nprint('b')",
        [
            {"type": "stream", "content": {"name": "stdout", "text": "a\nb\n"}},
            {
                "type": "display_data",
                "content": {
                    "data": {"text/html": "<b>x</b>\n<i>y</i>", "application/json": {"k": [1]}},
                    "metadata": {"isolated": True},
                },
            },
        ],
    ) + record("'é ✓'", [])
    nb = build(journal, session="s", limit=LIMIT)
    assert nb.text == nbformat.writes(nbformat.reads(nb.text, as_version=4))


def test_past_the_size_limit_cells_are_kept_without_their_outputs() -> None:
    big = [{"type": "stream", "content": {"name": "stdout", "text": "x" * 40_000}}]
    journal = b"".join(record(f"cell_{i}()", big) for i in range(10))
    nb = build(journal, session="s", limit=100_000)
    assert len(nb.text.encode()) <= 100_000
    cells = parsed(nb.text).cells
    assert [c.source for c in cells] == [f"cell_{i}()" for i in range(10)]
    kept = [c for c in cells if c.outputs]
    assert len(kept) == 2 and nb.omitted == 8
    assert all(c.metadata["mcp_forge"]["outputs_omitted"] == AT_LIMIT for c in cells[2:])


def test_code_alone_over_the_size_limit_is_refused() -> None:
    with pytest.raises(NotebookTooLarge, match="over 10000 bytes"):
        build(record("x" * 20_000, []), session="s", limit=10_000)


def test_many_displays_updated_by_one_huge_update_cost_no_more_than_the_limit() -> None:
    shown = {"data": {"text/plain": "0"}, "metadata": {}, "transient": {"display_id": "d"}}
    update = {"data": {"text/plain": "u" * 1_000_000}, "transient": {"display_id": "d"}}
    outputs = [{"type": "display_data", "content": shown}] * 300_000
    journal = record("flood()", [*outputs, {"type": "update_display_data", "content": update}])
    started = time.perf_counter()
    nb = build(journal, session="s", limit=3_000_000)
    assert time.perf_counter() - started < 10
    assert nb.omitted == 1 and len(nb.text) <= 3_000_000


def test_nan_lone_surrogates_and_deep_metadata_never_break_the_notebook() -> None:
    deep: Any = {}
    for _ in range(500):
        deep = {"d": deep}
    journal = (
        b'{"v": 1, "source": "nan", "outputs": [], "x": NaN}\n'
        + record("s", [{"type": "stream", "content": {"name": "stdout", "text": "\ud800!"}}])
        + record("d", [{"type": "display_data", "content": {"data": {}, "metadata": deep}}])
    )
    nb = build(journal, session="s", limit=LIMIT)
    cells = parsed(nb.text.encode().decode()).cells
    assert [c.source for c in cells] == ["s", "d"]
    assert cells[1].outputs == [] and nb.skipped == 2


async def test_a_6_mb_export_in_the_worker_leaves_the_event_loop_responsive() -> None:
    journal = small_outputs(6_000_000)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        nb = await build_in_worker(journal, session="s", limits=WORKER)
    finally:
        tick.cancel()
    assert nb.cells == journal.count(b"\n") and nb.omitted == 0
    # Before: one gap of 35 s. A second allows for a busy 2-core CI host's scheduling.
    assert len(gaps) > 10 and max(gaps) < 1.0, max(gaps)


async def test_a_worker_over_its_time_cap_is_stopped_with_a_clear_error() -> None:
    limits = WorkerLimits(size=LIMIT, seconds=0.3, memory=1_000_000_000)
    with pytest.raises(KernelProtocolError, match=r"took over 0\.3 s"):
        await build_in_worker(small_outputs(30_000_000), session="s", limits=limits)


async def test_a_worker_over_its_memory_cap_is_stopped_with_a_clear_error() -> None:
    flood = b'{"v": 1, "source": "", "outputs": [' + b"{}," * 5_000_000 + b"{}]}\n"
    limits = WorkerLimits(size=LIMIT, seconds=60.0, memory=200_000_000)
    with pytest.raises(KernelProtocolError, match="NOTEBOOK_MEMORY_MAX"):
        await build_in_worker(flood, session="s", limits=limits)


async def test_the_worker_refuses_a_notebook_over_the_file_limit_saying_what_to_do() -> None:
    limits = WorkerLimits(size=10_000, seconds=60.0, memory=1_000_000_000)
    with pytest.raises(InvalidRequest, match=r"file limit \(10000 bytes\).*read_file"):
        await build_in_worker(record("x" * 20_000, []), session="s", limits=limits)


def test_a_client_past_its_exports_is_refused_and_others_are_not() -> None:
    slots = ExportSlots(total=3, per_client=2)
    with slots.hold("alice"), slots.hold("alice"):
        with pytest.raises(InvalidRequest, match="2 notebook export"), slots.hold("alice"):
            pass
        with (
            slots.hold("bob"),
            pytest.raises(InvalidRequest, match="3 notebook exports"),
            slots.hold("carol"),
        ):
            pass
    with slots.hold("alice"):  # released
        pass


def test_the_guard_keeps_the_journal_and_each_record_within_bounds(tmp_path: Path) -> None:
    path = tmp_path / "notebook.jsonl"
    limits = Limits({"journal": str(path), "journal_max": 30_000, "journal_record_max": 5_000})
    guard = Guard(limits, "k1")
    for i, size in enumerate([100, 8_000, 100] + [1_000] * 40):
        guard.begin(f"m{i}", f"cell {i}")
        guard.record("stream", {"name": "stdout", "text": "x" * size}, f"m{i}")
        guard.journal(f"m{i}", {"status": "ok", "execution_count": i + 1})
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert path.stat().st_size <= 30_000
    assert lines[1]["outputs"] == [] and "size limit" in lines[1]["omitted"]
    assert lines[2]["outputs"][0]["content"]["text"] == "x" * 100
    assert lines[-1]["omitted"] == "the journal is full"


async def test_a_journal_read_in_parts_is_fed_as_it_comes_and_its_error_stops_the_worker() -> None:
    journal = small_outputs(200_000)
    half = len(journal) // 2

    async def parts(fail: bool) -> AsyncIterator[bytes]:
        yield journal[:half]
        if fail:
            raise InvalidRequest("the journal is over its limit")
        yield journal[half:]

    nb = await build_in_worker(parts(False), session="s", limits=WORKER)
    assert nb.cells == build(journal, session="s", limit=LIMIT).cells > 0
    with pytest.raises(InvalidRequest, match="over its limit"):
        await build_in_worker(parts(True), session="s", limits=WORKER)
