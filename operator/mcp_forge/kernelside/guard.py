"""The output guard: bounds what a kernel sends, at the source, for honest code.

Run by the gateway (silently) at every connection to a kernel, before the user's next
cell. It wraps the kernel's one `Session.send`, through which every IOPub message and
every shell reply passes, and for each user cell (counted from IPython's `pre_run_cell`,
so the gateway's own silent helpers are never cut):

* stream text past the text budget is not sent: it goes to the call's spill file
  (`SPILL_DIR/<msg_id>.txt`, which then holds the whole output, up to `SPOOL_MAX`);
* mime data of displays and results past the data budget is replaced by a short note
  (text mimes go to the spill file); once even a display's envelope is over the
  budget, displays are counted and not sent at all;
* exception values and tracebacks are cut, in the `error` message and the reply;
* the execute_reply says in its metadata (`REPORT_KEY`) what was kept back and where.

It also makes a thread remember the cell that started it: output a thread prints after
its cell ended carries that cell's parent (the gateway then drops it as late output),
never the parent of whatever call runs at the time (ipykernel's default for threads).

And it keeps the session's notebook: each user cell, once replied to, is one JSON line
appended to the journal (`JOURNAL`, in the workspace, so it outlives the gateway and the
kernel): its source, execution count, outputs as sent (so as bounded), start and end
times, status, and the kernel process it ran in. The gateway builds the .ipynb from it
(gateway/notebook.py). The journal stays within `journal_max` bytes as it is written: a
cell whose record would pass it, or is over `journal_record_max` bytes on its own, is
recorded without its outputs (and says why); once not even that fits, cells go unrecorded.

The gateway does not trust any of this: code may remove the guard, and the gateway
bounds what it receives on its own. The guard is for honest code to finish fast.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
from collections import OrderedDict
from typing import Any

TEXT_MIMES = ("text/plain", "text/markdown", "text/html", "text/latex")
DISPLAYS = ("display_data", "update_display_data", "execute_result")
ENVELOPE = 200  # what a display costs besides its data (the gateway counts the same)
DISPLAYS_MAX = 1_000  # displays sent per cell (the gateway keeps as many)
RESULT_TEXT_MIN = 2_000  # text of a result shown even when streams used the budget
CELLS_KEPT = 16  # cells whose budgets are remembered (for late output of threads)
# The messages of a cell that are its outputs in a notebook.
RECORDED = ("stream", "display_data", "update_display_data", "execute_result", "error")
JOURNAL_VERSION = 1


class Limits:
    """The gateway's limits, from the `LIMITS` global this module is run with."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.text = int(raw.get("text", 100_000))
        self.data = int(raw.get("data", 10_000_000))
        self.spool = int(raw.get("spool", 10_000_000))  # bytes of the spill file
        self.evalue = int(raw.get("evalue", 10_000))
        self.traceback = int(raw.get("traceback", 50_000))
        self.spill_dir = str(raw.get("spill_dir", "/workspace/.mcp-forge/outputs"))
        self.report_key = str(raw.get("report_key", "mcp-forge"))
        self.journal = str(raw.get("journal", "/workspace/.mcp-forge/notebook.jsonl"))
        self.journal_max = int(raw.get("journal_max", 100_000_000))  # bytes
        self.journal_record_max = int(raw.get("journal_record_max", 10_000_000))  # one line


class Cell:
    """What one user cell has sent so far."""

    def __init__(self, msg_id: str, source: str = "") -> None:
        self.msg_id = msg_id
        self.source = source
        self.started = _now()
        # Its outputs as sent, {"type": msg_type, "content": ...}; None once journaled.
        self.outputs: list[dict[str, Any]] | None = []
        self.text = 0  # characters of text sent
        self.data = 0  # bytes of non-text mime data sent
        self.envelope = 0
        self.head: list[str] = []  # the text sent, for the spill file's start
        self.spilled = 0  # characters kept back
        self.spooled = 0  # characters written to the spill file
        self.displays = 0  # displays not sent at all
        self.shown = 0  # displays sent
        self.omitted = 0  # bytes of mime data replaced by a note
        self.file: Any = None

    def report(self, limits: Limits) -> dict[str, Any] | None:
        if not (self.spilled or self.displays or self.omitted):
            return None
        report: dict[str, Any] = {
            "spilled": self.spilled,
            "displays": self.displays,
            "data": self.omitted,
        }
        if self.file is not None:
            report["path"] = self.path(limits)
        return report

    def path(self, limits: Limits) -> str:
        return f"{limits.spill_dir}/{self.msg_id}.txt"


class Guard:
    def __init__(self, limits: Limits, kernel_id: str = "") -> None:
        self.limits = limits
        self.kernel_id = kernel_id
        self.cells: OrderedDict[str, Cell] = OrderedDict()
        self.lock = threading.Lock()

    # ---- cells -----------------------------------------------------------------------

    def begin(self, msg_id: str, source: str = "") -> None:
        with self.lock:
            self.cells[msg_id] = Cell(msg_id, source)
            while len(self.cells) > CELLS_KEPT:
                _, old = self.cells.popitem(last=False)
                _close(old)

    # ---- the spill file --------------------------------------------------------------

    def spill(self, cell: Cell, label: str, text: str) -> None:
        """Keep `text` back from the gateway: count it, and write what fits to the file."""
        cell.spilled += len(text)
        if cell.spooled >= self.limits.spool:
            return
        try:
            if cell.file is None:
                os.makedirs(self.limits.spill_dir, exist_ok=True)
                cell.file = open(cell.path(self.limits), "wb")  # noqa: SIM115
                head, cell.head = "".join(cell.head), []
                self.write(cell, head)
            self.write(cell, label + text if label else text)
        except OSError:
            cell.spooled = self.limits.spool  # a full disk: count, write no more

    def write(self, cell: Cell, text: str) -> None:
        room = self.limits.spool - cell.spooled
        if room <= 0 or not text:
            return
        data = text[:room].encode("utf-8", "replace")[:room]
        cell.file.write(data)
        cell.spooled += len(data)

    def keep_text(self, cell: Cell, label: str, text: str, floor: int = 0) -> str:
        room = max(self.limits.text - cell.text, floor)
        sent = text[:room]
        cell.text += len(sent)
        if cell.file is None:
            cell.head.append(label + sent if label else sent)
        elif sent:
            try:
                self.write(cell, label + sent if label else sent)
            except OSError:
                cell.spooled = self.limits.spool
        if len(sent) < len(text):
            self.spill(cell, "", text[room:])
        return sent

    # ---- messages --------------------------------------------------------------------

    def bound(self, kind: str, content: dict[str, Any], parent_id: Any) -> bool:
        """Bound `content` in place; False if the message should not be sent at all."""
        if kind == "error" or (kind == "execute_reply" and content.get("status") == "error"):
            self.cut_error(content)
        with self.lock:
            cell = self.cells.get(parent_id) if isinstance(parent_id, str) else None
            if cell is None:
                return True
            if kind == "stream":
                text = content.get("text")
                if isinstance(text, str):
                    content["text"] = self.keep_text(cell, "", text)
                    return bool(content["text"])
            elif kind in DISPLAYS:
                return self.bound_display(cell, kind, content)
        return True

    def bound_display(self, cell: Cell, kind: str, content: dict[str, Any]) -> bool:
        limits = self.limits
        metadata = content.get("metadata")
        cost = ENVELOPE + (_size(metadata) if metadata else 0)
        if kind != "execute_result" and (
            cell.shown >= DISPLAYS_MAX or cell.envelope + cost > max(limits.text, limits.data)
        ):
            cell.displays += 1
            return False
        cell.envelope += cost
        cell.shown += 1
        floor = RESULT_TEXT_MIN if kind == "execute_result" else 0
        data = content.get("data")
        if not isinstance(data, dict):
            return True
        kept: dict[str, Any] = {}
        notes: list[str] = []
        for mime, value in data.items():
            if mime in TEXT_MIMES and isinstance(value, str):
                kept[mime] = self.keep_text(cell, f"\n[{kind} {mime}]\n", value, floor)
                continue
            size = len(value) if isinstance(value, str) else _size(value)
            if size >= 0 and cell.data + size <= limits.data:
                kept[mime] = value
                cell.data += size
            else:
                notes.append(f"[{mime} output of {size} bytes omitted: over the per-call limit]")
                cell.omitted += max(size, 1)
                self.spill(cell, f"\n[{kind} {mime}: {size} bytes omitted]\n", "")
        if notes:
            kept["text/plain"] = "\n".join([kept.get("text/plain", ""), *notes]).lstrip("\n")
        content["data"] = kept
        return True

    def cut_error(self, content: dict[str, Any]) -> None:
        limits = self.limits
        evalue = content.get("evalue")
        if isinstance(evalue, str) and len(evalue) > limits.evalue:
            content["evalue"] = evalue[: limits.evalue] + f"[... {len(evalue)} characters]"
        tb = content.get("traceback")
        if isinstance(tb, list):
            lines: list[str] = []
            used = 0
            for line in tb:
                text = line if isinstance(line, str) else str(line)
                if used + len(text) > limits.traceback:
                    cut = max(limits.traceback - used, 0)
                    lines.append(text[:cut] + f"[... traceback cut at {limits.traceback}]")
                    break
                lines.append(text)
                used += len(text)
            content["traceback"] = lines

    # ---- the notebook ----------------------------------------------------------------

    def record(self, kind: str, content: dict[str, Any], parent_id: Any) -> None:
        """Note an output of a cell as it is sent (consecutive stream text is joined)."""
        with self.lock:
            cell = self.cells.get(parent_id) if isinstance(parent_id, str) else None
            if cell is None or cell.outputs is None:
                return
            last = cell.outputs[-1] if cell.outputs else None
            if (
                kind == "stream"
                and last is not None
                and last["type"] == "stream"
                and last["content"].get("name") == content.get("name")
                and isinstance(last["content"].get("text"), str)
                and isinstance(content.get("text"), str)
            ):
                last["content"]["text"] += content["text"]
                return
            cell.outputs.append({"type": kind, "content": dict(content)})

    def journal(self, parent_id: Any, reply: Any) -> None:
        """Append the cell `parent_id`, just replied to, to the journal (at most once)."""
        with self.lock:
            cell = self.cells.get(parent_id) if isinstance(parent_id, str) else None
            if cell is None or cell.outputs is None:
                return
            outputs, cell.outputs = cell.outputs, None
        reply = reply if isinstance(reply, dict) else {}
        entry: dict[str, Any] = {
            "v": JOURNAL_VERSION,
            "kernel": self.kernel_id,
            "source": cell.source,
            "execution_count": reply.get("execution_count"),
            "status": reply.get("status"),
            "started": cell.started,
            "ended": _now(),
            "outputs": outputs,
        }
        try:
            os.makedirs(os.path.dirname(self.limits.journal), exist_ok=True)
            fd = os.open(self.limits.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            return  # no workspace to write to: the cell goes unrecorded, the code runs on
        try:
            room = self.limits.journal_max - os.fstat(fd).st_size
            line = _line(entry)
            if len(line) > min(room, self.limits.journal_record_max):
                entry["outputs"] = []
                entry["omitted"] = (
                    "the journal is full"
                    if len(line) > room
                    else "the cell's outputs are over the notebook's size limit"
                )
                line = _line(entry)
            if len(line) <= room:
                os.write(fd, line)
        except (OSError, ValueError, TypeError, RecursionError):
            pass
        finally:
            os.close(fd)

    def finish(self, parent_id: Any) -> dict[str, Any] | None:
        """The report for a cell's execute_reply; its spill file is flushed."""
        with self.lock:
            cell = self.cells.get(parent_id) if isinstance(parent_id, str) else None
            if cell is None:
                return None
            if cell.file is not None:
                with contextlib.suppress(OSError):
                    cell.file.flush()
            cell.head = []
            return cell.report(self.limits)


def _line(entry: dict[str, Any]) -> bytes:
    return (json.dumps(entry, default=str) + "\n").encode("utf-8", "replace")


def _size(value: Any) -> int:
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return -1


def _close(cell: Cell) -> None:
    if cell.file is not None:
        with contextlib.suppress(OSError):
            cell.file.close()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _parent_id(parent: Any) -> Any:
    if not isinstance(parent, dict):
        return None
    header = parent.get("header", parent)
    return header.get("msg_id") if isinstance(header, dict) else None


def _wrap_send(session: Any, guard: Guard) -> None:
    """Route the session's sends through `guard` (once; later installs swap the guard)."""
    if getattr(session.send, "mcp_forge_guard", None) is not None:
        session.send.mcp_forge_guard[0] = guard
        return
    original = session.send
    holder = [guard]

    def send(
        stream: Any,
        msg_or_type: Any,
        content: Any = None,
        parent: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        g = holder[0]
        if isinstance(msg_or_type, dict):
            kind = msg_or_type.get("header", {}).get("msg_type")
            body, parent_id = (
                msg_or_type.get("content"),
                _parent_id(msg_or_type.get("parent_header")),
            )
        else:
            kind, parent_id = msg_or_type, _parent_id(parent)
            if isinstance(content, dict):
                content = dict(content)
            body = content
        if isinstance(body, dict) and not g.bound(kind, body, parent_id):
            return None
        if kind in RECORDED and isinstance(body, dict):
            g.record(kind, body, parent_id)
        if kind == "execute_reply":
            report = g.finish(parent_id)
            if report is not None:
                if isinstance(msg_or_type, dict):
                    msg_or_type.setdefault("metadata", {})[g.limits.report_key] = report
                else:
                    metadata = dict(kwargs.get("metadata") or {})
                    metadata[g.limits.report_key] = report
                    kwargs["metadata"] = metadata
            sent = original(stream, msg_or_type, content, parent, *args, **kwargs)
            g.journal(parent_id, body)  # after the reply: it waits for no file
            return sent
        return original(stream, msg_or_type, content, parent, *args, **kwargs)

    send.mcp_forge_guard = holder  # type: ignore[attr-defined]
    session.send = send


def _carriers(shell: Any) -> list[Any]:
    """The objects whose parent header ipykernel keeps per thread (a ContextVar)."""
    found = [
        sys.stdout,
        sys.stderr,
        getattr(shell, "display_pub", None),
        getattr(shell, "displayhook", None),
        shell,
    ]
    return [c for c in found if c is not None and hasattr(c, "_parent_header")]


def _wrap_threads(shell: Any) -> None:
    """A thread starts with the parent of the cell that started it (once per kernel)."""
    if getattr(threading.Thread.start, "mcp_forge_guard", False):
        return
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        parents = []
        for carrier in _carriers(shell):
            try:
                parents.append((carrier, carrier.parent_header))
            except LookupError:
                continue
        run = thread.run

        def run_with_parent() -> None:
            for carrier, parent in parents:
                carrier._parent_header.set(parent)
            run()

        thread.run = run_with_parent  # type: ignore[method-assign]
        original(thread)

    start.mcp_forge_guard = True  # type: ignore[attr-defined]
    threading.Thread.start = start  # type: ignore[method-assign,assignment]


def install(shell: Any, raw: dict[str, Any]) -> None:
    """Install (or re-install with new limits) the guard in this kernel."""
    kernel = shell.kernel
    guard = Guard(Limits(raw), str(getattr(kernel.session, "session", "")))
    _wrap_send(kernel.session, guard)
    previous = getattr(kernel, "_mcp_forge_begin", None)
    if previous is not None:
        with contextlib.suppress(ValueError):
            shell.events.unregister("pre_run_cell", previous)

    def begin(info: Any = None) -> None:
        parent_id = _parent_id(shell.parent_header)
        if isinstance(parent_id, str):
            source = getattr(info, "raw_cell", "")
            guard.begin(parent_id, source if isinstance(source, str) else "")

    kernel._mcp_forge_begin = begin
    shell.events.register("pre_run_cell", begin)
    _wrap_threads(shell)


_limits = globals().get("LIMITS")
if isinstance(_limits, dict):
    install(globals()["get_ipython"](), _limits)
