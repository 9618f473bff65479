"""Notebooks out: a session's journal (kernelside/guard.py writes one JSON line per executed
cell into its workspace) as a valid nbformat 4 notebook, within a size limit.

The journal is the kernel's, so untrusted: every line is parsed on its own, under
bounds, and whatever is not a well-formed record is skipped and counted, never raised.
Outputs are checked field by field against nbformat 4.5's schema here, in one linear
pass: nbformat's own constructors run its jsonschema validator on every output and
every cell (about 2 ms each), so that a 6 MB journal of small outputs took minutes.
The text is what `nbformat.writes` would write (sorted keys, indent 1, lines split),
made cell by cell, so that its size is known as it grows: past `limit`, a cell is kept
without its outputs (its metadata says so); if even that does not fit, the notebook
is refused (NotebookTooLarge). `update_display_data` updates the earlier displays of
its display_id, as JupyterLab does; a change of kernel process between cells (a
restart, an OOM) becomes a markdown cell saying the variables above were lost.

Pure: no I/O. The gateway runs it in a worker process (notebook_worker.py), under a
time and a memory cap, since its input is the kernel's.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

JOURNAL_VERSION = 1  # kernelside/guard.py's
LINE_MAX = 64_000_000  # bytes of one record (the guard bounds its own to file_max)
DEPTH_MAX = 64  # nesting of the JSON kept as is (output metadata, JSON mime data)
RESTARTED = "*The kernel restarted here: variables defined above were lost.*"
AT_LIMIT = "the notebook is at its size limit"
_OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")
_JSON_MIME = re.compile(r"application/(.*\+)?json")
_SPLIT_MIMES = ("application/javascript", "image/svg+xml")  # and text/*, as nbformat does
_UPDATE = b'"update_display_data"'


class NotebookTooLarge(ValueError):
    """Even without outputs, the cells do not fit in the size limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the notebook would be over {limit} bytes even without outputs")
        self.limit = limit


@dataclass(frozen=True)
class Notebook:
    text: str  # the .ipynb (nbformat 4, JSON)
    cells: int  # code cells in it
    skipped: int  # journal lines or outputs left out as malformed
    omitted: int = 0  # cells kept without their outputs, to stay within the size limit


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: not for JupyterLab's parser


def _record(line: bytes) -> dict[str, Any] | None:
    """One journal line as a record, or None if it is not one."""
    if len(line) > LINE_MAX:
        return None
    try:
        record = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("v") != JOURNAL_VERSION:
        return None
    if not isinstance(record.get("source"), str) or not isinstance(record.get("outputs"), list):
        return None
    return record


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _shallow(value: Any, depth: int = 0) -> bool:
    """Nested at most DEPTH_MAX deep (JSON from json.loads; deeper breaks the writer)."""
    if depth > DEPTH_MAX:
        return False
    if isinstance(value, dict):
        return all(_shallow(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return all(_shallow(v, depth + 1) for v in value)
    return True


def _text(value: Any) -> str | None:
    """A multiline string of the schema (a string, or a list of strings) as one string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "".join(value)
    return None


def _bundle(data: Any) -> dict[str, Any] | None:
    """A mime bundle the schema accepts: JSON for JSON mimes, text for the others."""
    if not isinstance(data, dict):
        return None
    bundle: dict[str, Any] = {}
    for mime, value in data.items():
        if _JSON_MIME.fullmatch(mime):
            if not _shallow(value):
                return None
            bundle[mime] = value
        elif (text := _text(value)) is not None:
            bundle[mime] = text
        else:
            return None
    return bundle


def _output(kind: Any, content: dict[str, Any]) -> dict[str, Any] | None:
    """The nbformat output of one message's content, or None if it makes none."""
    if kind == "stream":
        name, text = content.get("name"), _text(content.get("text"))
        if not isinstance(name, str) or text is None:
            return None
        return {"output_type": kind, "name": name, "text": text}
    if kind == "error":
        ename, evalue, tb = content.get("ename"), content.get("evalue"), content.get("traceback")
        if not (isinstance(ename, str) and isinstance(evalue, str) and isinstance(tb, list)):
            return None
        if not all(isinstance(line, str) for line in tb):
            return None
        return {"output_type": kind, "ename": ename, "evalue": evalue, "traceback": tb}
    data, metadata = _bundle(content.get("data")), content.get("metadata", {})
    if data is None or not isinstance(metadata, dict) or not _shallow(metadata):
        return None
    output = {"output_type": kind, "data": data, "metadata": metadata}
    if kind == "execute_result":
        count = content.get("execution_count")
        if count is not None and not (_count(count) or count == 0):
            return None
        output["execution_count"] = count
    return output


Position = tuple[int, int]  # (line, output) in the journal


def _lines(journal: bytes) -> Iterator[bytes]:
    """The journal's lines, one copy at a time (not all at once: it may be 60 MB)."""
    start = 0
    while start < len(journal):
        end = journal.find(b"\n", start)
        end = len(journal) if end < 0 else end
        yield journal[start:end]
        start = end + 1


def _updates(journal: bytes) -> dict[tuple[str, str], tuple[Position, Any]]:
    """The last `update_display_data` of each display_id, for its data and its metadata:
    (display_id, "data" or "metadata") -> (where it is, the value)."""
    last: dict[tuple[str, str], tuple[Position, Any]] = {}
    for i, line in enumerate(_lines(journal)):
        if _UPDATE not in line or (record := _record(line)) is None:
            continue  # most lines update nothing: not parsed twice
        for j, item in enumerate(record["outputs"]):
            if not isinstance(item, dict) or item.get("type") != "update_display_data":
                continue
            content = item.get("content")
            display_id = _display_id(content)
            if display_id is None:
                continue
            assert isinstance(content, dict)
            for key in ("data", "metadata"):
                if isinstance(content.get(key), dict):
                    last[display_id, key] = ((i, j), content[key])
    return last


def _display_id(content: Any) -> str | None:
    transient = content.get("transient") if isinstance(content, dict) else None
    display_id = transient.get("display_id") if isinstance(transient, dict) else None
    return display_id if isinstance(display_id, str) else None


class _Cells:
    """The cells of a journal, in order, as nbformat dicts; a cell's outputs stop where
    they would fill `room` (the bytes the writer has left), so none is built unbounded."""

    def __init__(self, journal: bytes, room: int) -> None:
        self.journal = journal
        self.room = room  # the writer lowers it as it writes
        self.skipped = 0
        self.updates = _updates(journal)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        kernel: str | None = None
        for i, line in enumerate(_lines(self.journal)):
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                self.skipped += 1
                continue
            new_kernel = record.get("kernel")
            if isinstance(new_kernel, str) and new_kernel:
                if kernel is not None and new_kernel != kernel:
                    yield {"cell_type": "markdown", "metadata": {}, "source": RESTARTED}
                kernel = new_kernel
            yield self._code(i, record)

    def _code(self, i: int, record: dict[str, Any]) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        started, ended = record.get("started"), record.get("ended")
        if isinstance(started, str) and isinstance(ended, str):
            metadata["execution"] = {"iopub.execute_input": started, "shell.execute_reply": ended}
        if isinstance(record.get("omitted"), str):
            metadata["mcp_forge"] = {"outputs_omitted": record["omitted"]}
        outputs: list[dict[str, Any]] = []
        used = len(record["source"])
        for j, item in enumerate(record["outputs"]):
            output = self._output(i, j, item)
            if output is None:
                continue
            used += len(json.dumps(output, ensure_ascii=False))
            if used > self.room:  # the writer would leave them out: build no more
                outputs = []
                metadata["mcp_forge"] = {"outputs_omitted": AT_LIMIT}
                break
            outputs.append(output)
        return {
            "cell_type": "code",
            "metadata": metadata,
            "source": record["source"],
            "execution_count": _count(record.get("execution_count")),
            "outputs": outputs,
        }

    def _output(self, i: int, j: int, item: Any) -> dict[str, Any] | None:
        """The output of the journal's item j of line i, as updated later; None if none."""
        if not isinstance(item, dict) or not isinstance(item.get("content"), dict):
            self.skipped += 1
            return None
        kind, content = item.get("type"), item["content"]
        if kind == "update_display_data":
            return None  # applied to the displays before it (see _updates)
        output = _output(kind, content) if kind in _OUTPUT_TYPES else None
        if output is None:
            self.skipped += 1
            return None
        display_id = _display_id(content)
        if kind == "display_data" and display_id is not None:
            for key in ("data", "metadata"):
                at, value = self.updates.get((display_id, key), ((-1, -1), None))
                checked = _bundle(value) if key == "data" else value
                if at > (i, j) and checked is not None and _shallow(checked):
                    output[key] = checked
        return output


def _split(cell: dict[str, Any]) -> dict[str, Any]:
    """Text as lists of lines, as nbformat writes it (for line-based diffs)."""
    cell["source"] = cell["source"].splitlines(True)
    for output in cell.get("outputs", ()):
        if output["output_type"] == "stream":
            output["text"] = output["text"].splitlines(True)
        elif output["output_type"] in ("display_data", "execute_result"):
            data = output["data"]
            for mime, value in data.items():
                if isinstance(value, str) and (mime.startswith("text/") or mime in _SPLIT_MIMES):
                    data[mime] = value.splitlines(True)
    return cell


def _dumps(value: Any, indent: str = "") -> bytes:
    """As nbformat.writes: sorted keys, indent 1, UTF-8; `indent` before every line."""
    try:
        text = json.dumps(value, sort_keys=True, indent=1, ensure_ascii=False)
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate, which json.loads lets through
        text = json.dumps(value, sort_keys=True, indent=1)
        data = text.encode()
    return data.replace(b"\n", b"\n" + indent.encode()) if indent else data


def build(journal: bytes, *, session: str, limit: int) -> Notebook:
    """The notebook of a session from its journal's bytes, at most `limit` bytes long."""
    now = datetime.datetime.now(datetime.UTC).isoformat()
    tail = {
        "metadata": {
            "kernelspec": {
                "name": "python3",
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
            },
            "language_info": {"name": "python"},
            "mcp_forge": {"session": session, "exported": now},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    end = b"\n ],\n" + _dumps(tail)[2:]  # `_dumps(tail)` starts with "{\n"
    cells = _Cells(journal, limit - len(b'{\n "cells": [\n') - len(end))
    parts: list[bytes] = []
    code = omitted = 0
    for n, cell in enumerate(cells):
        cell["id"] = f"cell-{n + 1}"
        text = _dumps(_split(cell), "  ")
        if len(text) + 2 > cells.room and cell.get("outputs"):
            cell["outputs"] = []
            cell["metadata"]["mcp_forge"] = {"outputs_omitted": AT_LIMIT}
            text = _dumps(cell, "  ")
        if len(text) + 2 > cells.room:
            raise NotebookTooLarge(limit)
        omitted += cell["metadata"].get("mcp_forge") == {"outputs_omitted": AT_LIMIT}
        cells.room -= len(text) + 2
        parts.append(b"  " + text)
        code += cell["cell_type"] == "code"
    if not parts:
        data = b'{\n "cells": [],\n' + end[len(b"\n ],\n") :]
    else:
        data = b'{\n "cells": [\n' + b",\n".join(parts) + end
    return Notebook(text=data.decode(), cells=code, skipped=cells.skipped, omitted=omitted)
