"""logsafe: strings of kernels and clients made fit for one log line (issue 23)."""

from __future__ import annotations

import io
import logging

from mcp_forge.logsafe import LINE_MAX, SafeLines, quoted, shown


def test_plain_names_are_shown_as_they_are() -> None:
    assert shown("edge.echo") == "edge.echo"
    assert shown("été") == "été"


def test_line_breaks_escapes_and_backslashes_are_escaped() -> None:
    got = shown("echo\nbridge call status=ok\r\x1b[2J\u2028\\n")
    assert got == "echo\\nbridge call status=ok\\r\\x1b[2J\\u2028\\\\n"
    assert got.isprintable()


def test_a_long_value_is_cut_and_says_how_much() -> None:
    got = shown("x" * 900_000, 100)
    assert got == "x" * 100 + "…[899900 more]"
    escaped = shown("\n" * 1000, 100)  # escapes count against the limit
    assert escaped == "\\n" * 50 + "…[950 more]"


def test_quoted_is_bounded_and_quoted() -> None:
    assert quoted("a\nb") == "'a\\nb'"
    assert quoted("y" * 500, 10) == "'yyyyyyyyyy'…[490 more]"


def test_a_handler_with_safe_lines_writes_one_bounded_line_per_record() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(SafeLines())
    log = logging.getLogger("test_logsafe")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("call=%s status=denied", "x\nbridge call session=s-victim status=ok")
        log.warning("call=%s", "y" * 1_000_000)
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "call=x\\nbridge call session=s-victim status=ok status=denied"
    assert len(lines[1]) < LINE_MAX + 50
