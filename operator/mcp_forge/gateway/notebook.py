"""Notebooks out: a session's journal (kernelside/guard.py writes one JSON line per executed
cell into its workspace) as a valid nbformat 4 notebook.

The journal is the kernel's, so untrusted: every line is parsed on its own, under
bounds, and whatever is not a well-formed record is skipped and counted, never raised.
Outputs are built by nbformat's own `output_from_msg` from the messages as the kernel
sent them; `update_display_data` updates the earlier displays of its display_id, as
JupyterLab does; a change of kernel process between cells (a restart, an OOM) becomes
a markdown cell saying the variables above were lost. The notebook is checked with
nbformat's validator; a cell it rejects is dropped and counted.
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass
from typing import Any

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, output_from_msg

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1  # kernelside/guard.py's
LINE_MAX = 64_000_000  # bytes of one record (its outputs are bounded by the guard)
RESTARTED = "*The kernel restarted here: variables defined above were lost.*"
_OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")


@dataclass(frozen=True)
class Notebook:
    text: str  # the .ipynb (nbformat 4, JSON)
    cells: int  # code cells in it
    skipped: int  # journal lines or cells left out as malformed


def _record(line: bytes) -> dict[str, Any] | None:
    """One journal line as a record, or None if it is not one."""
    if len(line) > LINE_MAX:
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("v") != JOURNAL_VERSION:
        return None
    if not isinstance(record.get("source"), str) or not isinstance(record.get("outputs"), list):
        return None
    return record


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _Builder:
    def __init__(self) -> None:
        self.cells: list[Any] = []
        self.displays: dict[str, list[Any]] = {}  # display_id -> its outputs so far
        self.kernel: str | None = None
        self.skipped = 0

    def add(self, record: dict[str, Any]) -> None:
        kernel = record.get("kernel")
        if isinstance(kernel, str) and kernel:
            if self.kernel is not None and kernel != self.kernel:
                self.cells.append(new_markdown_cell(RESTARTED))
            self.kernel = kernel
        outputs: list[Any] = []
        for item in record["outputs"]:
            self._output(item, outputs)
        metadata: dict[str, Any] = {}
        started, ended = record.get("started"), record.get("ended")
        if isinstance(started, str) and isinstance(ended, str):
            metadata["execution"] = {"iopub.execute_input": started, "shell.execute_reply": ended}
        if isinstance(record.get("omitted"), str):
            metadata["mcp_forge"] = {"outputs_omitted": record["omitted"]}
        try:
            cell = new_code_cell(
                source=record["source"],
                execution_count=_count(record.get("execution_count")),
                outputs=outputs,
                metadata=metadata,
            )
        except nbformat.ValidationError:
            self.skipped += 1
            return
        self.cells.append(cell)

    def _output(self, item: Any, outputs: list[Any]) -> None:
        if not isinstance(item, dict) or not isinstance(item.get("content"), dict):
            self.skipped += 1
            return
        kind, content = item.get("type"), item["content"]
        transient = content.get("transient")
        display_id = transient.get("display_id") if isinstance(transient, dict) else None
        if kind == "update_display_data":
            for shown in self.displays.get(display_id, []) if isinstance(display_id, str) else []:
                if isinstance(content.get("data"), dict):
                    shown["data"] = content["data"]
                if isinstance(content.get("metadata"), dict):
                    shown["metadata"] = content["metadata"]
            return
        if kind not in _OUTPUT_TYPES:
            self.skipped += 1
            return
        try:
            output = output_from_msg({"header": {"msg_type": kind}, "content": content})
        except (KeyError, TypeError, ValueError, AttributeError, nbformat.ValidationError):
            self.skipped += 1  # nbformat's builders validate what they build
            return
        outputs.append(output)
        if kind == "display_data" and isinstance(display_id, str):
            self.displays.setdefault(display_id, []).append(output)


def build(journal: bytes, *, session: str) -> Notebook:
    """The notebook of a session from its journal's bytes."""
    builder = _Builder()
    for line in journal.splitlines():
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            builder.skipped += 1
            continue
        builder.add(record)
    now = datetime.datetime.now(datetime.UTC).isoformat()
    nb = new_notebook(
        cells=builder.cells,
        metadata={
            "kernelspec": {
                "name": "python3",
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
            },
            "language_info": {"name": "python"},
            "mcp_forge": {"session": session, "exported": now},
        },
    )
    skipped = builder.skipped + _drop_invalid(nb)
    return Notebook(
        text=nbformat.writes(nb),
        cells=sum(1 for c in nb.cells if c.cell_type == "code"),
        skipped=skipped,
    )


def _drop_invalid(nb: Any) -> int:
    """Cells nbformat's validator rejects are dropped; how many."""
    try:
        nbformat.validate(nb)
        return 0
    except nbformat.ValidationError:
        pass
    cells, nb.cells = nb.cells, []
    kept = []
    for cell in cells:
        nb.cells = [cell]
        try:
            nbformat.validate(nb)
        except nbformat.ValidationError as exc:
            log.warning("a notebook cell is left out: %.200s", exc)
            continue
        kept.append(cell)
    nb.cells = kept
    return len(cells) - len(kept)
