"""Strings from kernels and clients, made safe to show: in a log line, a span's name, an
error message.

Kernel code chooses the server and tool names of its bridge calls, the text of its
exceptions, the bytes of its messages; a client chooses session names and arguments.
Shown raw, a newline forges a log line of the gateway ("bridge call session=s-victim …
status=ok"), an escape sequence rewrites a terminal, and a 900 KB name grows the log by
as much per call. `shown` is the one place such a string is made fit to show: control
and other non-printable characters escaped as `repr` escapes them, and the whole cut to
a length, with a marker saying how much was cut. `SafeLines` is a second layer on the
process's log handlers: a final message with a line break or over LINE_MAX characters
is shown the same way, so a call site that forgot still writes one bounded line.
"""

from __future__ import annotations

import logging

LIMIT = 120  # characters of a name or a short message
LINE_MAX = 4000  # characters of a whole log message (SafeLines)


def shown(value: object, limit: int = LIMIT) -> str:
    """`value` as text fit for one line: non-printable characters (line breaks, escape
    sequences, separators) and backslashes written as `repr` writes them, and cut after
    `limit` characters of output, with "…[N more]" saying how many characters of the
    input were left out."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit and text.isprintable() and "\\" not in text:
        return text  # the common case: nothing to do
    out: list[str] = []
    size = 0
    for at, char in enumerate(text):
        piece = char if char.isprintable() and char != "\\" else repr(char)[1:-1]
        if size + len(piece) > limit:
            return "".join(out) + f"…[{len(text) - at} more]"
        out.append(piece)
        size += len(piece)
    return "".join(out)


def quoted(value: object, limit: int = LIMIT) -> str:
    """`value` in quotes, as `repr` writes a string, cut after `limit` characters of it
    (with "…[N more]"): a name inside an error message."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit
    return repr(text[:limit]) + (f"…[{cut} more]" if cut > 0 else "")


class SafeLines(logging.Filter):
    """A handler's filter: every record it writes is one line of at most LINE_MAX
    characters (its message escaped and cut by `shown` if it was not). Tracebacks
    (exc_info) are the formatter's, added after, and left alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LINE_MAX or not message.isprintable():
            record.msg, record.args = shown(message, LINE_MAX), None
        return True


def guard_handlers(logger: logging.Logger | None = None) -> None:
    """Put SafeLines on every handler of `logger` (the root logger by default) that does
    not have it yet: call again after a library replaced the handlers (kopf does)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, SafeLines) for f in handler.filters):
            handler.addFilter(SafeLines())
