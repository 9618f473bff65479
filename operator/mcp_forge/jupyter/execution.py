"""Folding Jupyter messages into an execution result. Pure: no I/O.

A Collector is fed the IOPub and shell messages whose parent is one request
(the caller matches ``parent_header.msg_id``) and builds the result: streams,
the execute_result and every display_data as mime bundles, the error with its
traceback stripped of ANSI codes. Everything it keeps is bounded: text beyond the
text budget is cut with a marker (and kept whole, up to a cap, for a file), other
mime data (images, JSON) beyond the data budget is replaced by a note, metadata and
tracebacks have caps of their own. Every display costs its metadata and a fixed
overhead against an allowance as large as the larger budget, so memory follows the
budgets, not the number of messages: displays past it are counted and dropped.

The kernel-side guard (kernelside/guard.py) bounds output at the source; it says in the
execute_reply's metadata how much it kept back and in which file. That file is only
believed at the one path the gateway expects for the request (`spill_path`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mcp_forge.sandbox import WORKSPACE

Status = Literal["ok", "error", "timeout", "interrupted", "died"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
TEXT_MIMES = ("text/plain", "text/markdown", "text/html", "text/latex")
METADATA_MAX = 16_384
MIME_MAX = 100  # length of a mime type name
EVALUE_MAX = 10_000
TRACEBACK_MAX = 50_000
DISPLAY_OVERHEAD = 200  # bytes charged per display against the data budget
DISPLAYS_MAX = 1_000  # displays kept per call
RESULT_TEXT_MIN = 2_000  # text of the execute_result kept even when streams used the budget
OUTPUT_DIR = ".mcp-forge/outputs"  # in the workspace: one full-output file per call
NOTEBOOK_JOURNAL = ".mcp-forge/notebook.jsonl"  # in the workspace: one line per user cell
# ipykernel publishes idle and sends no execute_reply when an exception escapes its
# handler: a KeyboardInterrupt that lands after the cell was announced (execute_input) and
# before its code runs (as IPython's input transformers run), or once it has run, as the
# reply is made.
REPLY_LOST = (
    "the kernel ended this request with no reply, as it does when an interrupt lands as "
    "the code begins or as its reply is made: whether the code ran is not known; "
    "variables are kept"
)
REPLY_REFUSED = (
    "the kernel's reply to this request was refused (over the size limit, or malformed): "
    "whether the code ran without error is not known; variables are kept"
)
GUARD_KEY = "mcp-forge"  # the guard's report in an execute_reply's metadata


def spill_path(msg_id: str) -> str:
    """Where the full output of request `msg_id` is kept, in the kernel's file system."""
    return f"{WORKSPACE}/{OUTPUT_DIR}/{msg_id}.txt"


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class ErrorInfo:
    ename: str
    evalue: str
    traceback: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"ename": self.ename, "evalue": self.evalue, "traceback": list(self.traceback)}


@dataclass(frozen=True)
class ExecutionResult:
    """What one execute call did. User-code errors are data here, not exceptions."""

    status: Status
    stdout: str = ""
    stderr: str = ""
    result: dict[str, Any] | None = None  # the execute_result mime bundle
    displays: tuple[dict[str, Any], ...] = ()  # every display_data mime bundle, in order
    error: ErrorInfo | None = None
    execution_count: int | None = None
    duration: float = 0.0
    truncated: bool = False
    full_output_path: str | None = None  # in the workspace, when truncated
    state_lost: bool = False  # the kernel was restarted: variables are gone
    message: str = ""  # a plain explanation for timeout / interrupted / died

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "result": self.result,
            "displays": list(self.displays),
            "error": self.error.to_dict() if self.error else None,
            "execution_count": self.execution_count,
            "duration": round(self.duration, 6),
            "truncated": self.truncated,
            "full_output_path": self.full_output_path,
            "state_lost": self.state_lost,
            "message": self.message,
        }


def _truncation_marker(dropped: int, saved_to: str | None) -> str:
    where = f"; full output saved to {saved_to}" if saved_to else ""
    return f"\n[... output truncated: {dropped} more characters{where} ...]\n"


def _displays_marker(omitted: int) -> str:
    return f"\n[... {omitted} displays omitted: over the per-call output limit ...]\n"


def _json_size(value: Any) -> int:
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError):
        return -1


@dataclass
class Collector:
    """Builds an ExecutionResult from the messages of one request."""

    msg_id: str
    budget: int  # characters of text kept
    spool_max: int  # characters of text kept for the full-output file
    data_budget: int = 10_000_000  # bytes of non-text mime data kept
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None
    displays: list[dict[str, Any]] = field(default_factory=list)
    error: ErrorInfo | None = None
    execution_count: int | None = None
    reply_status: str | None = None
    idle: bool = False
    idle_at: float = 0.0  # when its idle status arrived (time.monotonic)
    started: bool = False  # the kernel has begun the request (its execute_input)
    probe: str = ""  # a shell request sent to learn whether a reply is still to come
    reply_lost: bool = False  # idle, and no reply will come (see REPLY_LOST)
    reply_refused: bool = False  # ... as the gateway dropped a shell message (REPLY_REFUSED)
    refused_before: int = -1  # the connection's count of those as the request began
    used: int = 0  # text characters kept so far
    dropped: int = 0  # text characters cut
    spool: list[str] = field(default_factory=list)  # the whole text, in arrival order
    spooled: int = 0
    data_used: int = 0
    data_dropped: int = 0
    displays_omitted: int = 0
    overhead_used: int = 0  # what displays cost besides their data: metadata, envelope
    kernel_spilled: int = 0  # characters the kernel's guard kept back (in its file)
    kernel_spill_path: str | None = None
    on_stream: Callable[[str, str], None] | None = None  # (name, text) as output arrives

    @property
    def done(self) -> bool:
        """The kernel is idle for this request and has replied on shell (or never will)."""
        return self.idle and (self.reply_status is not None or self.reply_lost)

    def _keep(self, text: str, floor: int = 0) -> str:
        """Account `text` against the budget (at least `floor` is kept); return the part
        that may be kept."""
        if self.spooled < self.spool_max:
            piece = text[: self.spool_max - self.spooled]
            self.spool.append(piece)
            self.spooled += len(piece)
        room = max(self.budget - self.used, floor)
        kept = text[:room]
        self.used += len(kept)
        self.dropped += len(text) - len(kept)
        return kept

    def _display(self, content: dict[str, Any], label: str) -> None:
        """Keep a display if its overhead fits in the data budget and something of it is
        kept; count it as omitted otherwise."""
        metadata = content.get("metadata")
        cost = DISPLAY_OVERHEAD + (_json_size(metadata) if isinstance(metadata, dict) else 0)
        if len(self.displays) >= DISPLAYS_MAX or self.overhead_used + cost > max(
            self.budget, self.data_budget
        ):
            self.displays_omitted += 1
            return
        self.overhead_used += cost
        bundle = self._bundle(content, label)
        if not any(bundle["data"].values()):
            self.displays_omitted += 1
            return
        self.displays.append(bundle)

    def _bundle(self, content: dict[str, Any], label: str) -> dict[str, Any]:
        raw = content.get("data")
        data: dict[str, Any] = {}
        notes: list[str] = []
        for mime, value in raw.items() if isinstance(raw, dict) else ():
            if not isinstance(mime, str) or len(mime) > MIME_MAX:
                continue
            if mime in TEXT_MIMES and isinstance(value, str):
                self.spool_note(f"[{label} {mime}]\n")
                data[mime] = self._keep(value, RESULT_TEXT_MIN if label == "result" else 0)
                continue
            size = len(value) if isinstance(value, str) else _json_size(value)
            if size >= 0 and self.data_used + size <= self.data_budget:
                data[mime] = value
                self.data_used += size
            else:
                self.data_dropped += max(size, 0)
                notes.append(f"[{mime} output of {size} bytes omitted: over the per-call limit]")
        if notes:
            data["text/plain"] = "\n".join([data.get("text/plain", ""), *notes]).lstrip("\n")
        metadata = content.get("metadata")
        if not isinstance(metadata, dict) or not 0 <= _json_size(metadata) <= METADATA_MAX:
            metadata = {}
        return {"data": data, "metadata": metadata}

    def spool_note(self, text: str) -> None:
        piece = text[: max(self.spool_max - self.spooled, 0)]
        self.spool.append(piece)
        self.spooled += len(piece)

    def feed(self, msg: dict[str, Any]) -> None:
        """Take one message whose parent is this request (IOPub or the shell reply)."""
        kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
        content = msg.get("content") or {}
        if kind == "stream":
            text = content.get("text")
            if isinstance(text, str):
                if self.on_stream is not None:
                    self.on_stream(str(content.get("name")), text)
                (self.stderr if content.get("name") == "stderr" else self.stdout).append(
                    self._keep(text)
                )
        elif kind == "execute_result":
            self.result = self._bundle(content, "result")
            count = content.get("execution_count")
            if isinstance(count, int):
                self.execution_count = count
        elif kind == "display_data":
            self._display(content, "display")
        elif kind == "update_display_data":
            self._display(content, "display update")
        elif kind == "execute_input":
            self.started = True
            count = content.get("execution_count")
            if isinstance(count, int):  # the reply's, should none come
                self.execution_count = count
        elif kind == "clear_output":
            pass  # outputs already returned stay in the record
        elif kind == "error":
            self.error = _error(content)
            self.spool_note("\n".join(self.error.traceback) + "\n")
        elif kind == "status":
            if content.get("execution_state") == "idle" and not self.idle:
                self.idle, self.idle_at = True, time.monotonic()
        elif kind == "execute_reply":
            status = content.get("status")
            self.reply_status = status if isinstance(status, str) else "error"
            count = content.get("execution_count")
            if isinstance(count, int):
                self.execution_count = count
            if self.reply_status == "error" and self.error is None:
                self.error = _error(content)
            self._guard_report(msg.get("metadata"))

    def _guard_report(self, metadata: Any) -> None:
        report = metadata.get(GUARD_KEY) if isinstance(metadata, dict) else None
        if not isinstance(report, dict):
            return
        spilled, omitted, data = report.get("spilled"), report.get("displays"), report.get("data")
        if isinstance(data, int) and 0 < data < 2**53:
            self.data_dropped += data
        if isinstance(spilled, int) and 0 < spilled < 2**53:
            self.kernel_spilled = spilled
            if report.get("path") == spill_path(self.msg_id):
                self.kernel_spill_path = spill_path(self.msg_id)
        if isinstance(omitted, int) and 0 < omitted < 2**53:
            self.displays_omitted += omitted

    def finish(
        self,
        status: Status | None = None,
        *,
        duration: float,
        message: str = "",
        state_lost: bool = False,
        saved_to: str | None = None,
    ) -> ExecutionResult:
        """The result; pure over what was fed, so it may be called again (e.g. once the
        full output is saved, to name the file in the marker)."""
        if self.reply_lost and self.reply_status is None:
            status = status or ("error" if self.reply_refused else "interrupted")
            message = message or (REPLY_REFUSED if self.reply_refused else REPLY_LOST)
        if status is None:
            if self.reply_status == "ok":
                status = "ok"
            elif self.error is not None and self.error.ename == "KeyboardInterrupt":
                status = "interrupted"
            else:
                status = "error"
        stdout = "".join(self.stdout)
        stderr = "".join(self.stderr)
        saved_to = saved_to or self.kernel_spill_path
        dropped = self.dropped + self.kernel_spilled
        truncated = dropped > 0 or self.data_dropped > 0 or self.displays_omitted > 0
        if dropped > 0:
            marker = _truncation_marker(dropped, saved_to)
            if stderr and not stdout:
                stderr += marker
            else:
                stdout += marker
        if self.displays_omitted:
            stdout += _displays_marker(self.displays_omitted)
        return ExecutionResult(
            status=status,
            stdout=stdout,
            stderr=stderr,
            result=self.result,
            displays=tuple(self.displays),
            error=self.error,
            execution_count=self.execution_count,
            duration=duration,
            truncated=truncated,
            full_output_path=saved_to,
            state_lost=state_lost,
            message=message,
        )

    def full_text(self) -> str:
        return "".join(self.spool)


def _error(content: dict[str, Any]) -> ErrorInfo:
    tb = content.get("traceback")
    lines = [strip_ansi(str(line)) for line in tb] if isinstance(tb, list) else []
    if sum(len(line) for line in lines) > TRACEBACK_MAX:
        # Keep the start and, above all, the end, where the error is.
        head, used = lines[:3], sum(len(line) for line in lines[:3])
        tail: list[str] = []
        for line in reversed(lines[3:]):
            if used + len(line) > TRACEBACK_MAX:
                break
            tail.insert(0, line)
            used += len(line)
        lines = [
            *head,
            f"[... {len(lines) - len(head) - len(tail)} traceback lines omitted ...]",
            *tail,
        ]
        lines = [line[:TRACEBACK_MAX] for line in lines]
    return ErrorInfo(
        ename=str(content.get("ename", "Error"))[:200],
        evalue=strip_ansi(str(content.get("evalue", "")))[:EVALUE_MAX],
        traceback=tuple(lines),
    )
