"""The notebook builder (gateway/notebook.py) on journals as the kernel's guard writes
them, and as a hostile kernel might: the result always passes nbformat's validator."""

from __future__ import annotations

import json
from typing import Any

import nbformat

from mcp_forge.gateway.notebook import RESTARTED, build

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
    nb = build(journal, session="s")
    assert (nb.cells, nb.skipped) == (4, 0)
    cells = parsed(nb.text).cells
    assert [c.execution_count for c in cells] == [1, 2, 3, 4]
    assert cells[0].outputs[0].text == "hi\n"
    assert cells[1].outputs[0].data["text/plain"] == "42"
    assert cells[2].outputs[0].data["image/png"] == PNG
    assert cells[3].outputs[0].ename == "ZeroDivisionError"
    assert cells[0].metadata["execution"]["shell.execute_reply"] == "2026-12-01T10:00:01+00:00"


def test_a_new_kernel_process_is_marked_as_a_restart() -> None:
    nb = build(record("a = 1", []) + record("a", [], kernel="k2"), session="s")
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
    nb = build(journal, session="s")
    cells = parsed(nb.text).cells
    assert nb.cells == 1
    assert [o.output_type for o in cells[0].outputs] == ["stream"]
    assert cells[0].execution_count is None  # not a positive count: none
    assert nb.skipped == 4 + 3


def test_an_empty_journal_is_an_empty_valid_notebook() -> None:
    nb = build(b"", session="s")
    assert (nb.cells, nb.skipped) == (0, 0)
    assert parsed(nb.text).metadata["kernelspec"]["name"] == "python3"


def test_an_output_the_schema_rejects_is_left_out_and_its_cell_kept() -> None:
    bad = {"type": "display_data", "content": {"data": {"image/png": 5}, "metadata": {}}}
    nb = build(record("bad", [bad]) + record("good", []), session="s")
    cells = parsed(nb.text).cells
    assert [(c.source, c.outputs) for c in cells] == [("bad", []), ("good", [])]
    assert (nb.cells, nb.skipped) == (2, 1)
