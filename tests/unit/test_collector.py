"""Folding Jupyter messages into a result, and the host-side checks on kernel replies."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.errors import InvalidRequest, KernelProtocolError
from mcp_forge.gateway import introspection
from mcp_forge.jupyter.execution import REPLY_LOST, REPLY_REFUSED, Collector, strip_ansi
from mcp_forge.jupyter.wire import parse


def msg(kind: str, **content: Any) -> dict[str, Any]:
    return {"msg_type": kind, "parent_header": {"msg_id": "m1"}, "content": content}


def run(collector: Collector, *msgs: dict[str, Any]) -> None:
    for m in msgs:
        collector.feed(m)


def test_streams_results_and_displays_are_kept_apart() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    run(
        c,
        msg("status", execution_state="busy"),
        msg("stream", name="stdout", text="out\n"),
        msg("stream", name="stderr", text="err\n"),
        msg("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure>"}, metadata={}),
        msg("execute_result", data={"text/plain": "2"}, metadata={}, execution_count=3),
        msg("status", execution_state="idle"),
    )
    assert not c.done
    c.feed(msg("execute_reply", status="ok", execution_count=3))
    assert c.done
    r = c.finish(duration=0.1)
    assert (r.status, r.stdout, r.stderr) == ("ok", "out\n", "err\n")
    assert r.result == {"data": {"text/plain": "2"}, "metadata": {}}
    assert r.displays[0]["data"]["image/png"] == "iVBOR"
    assert r.execution_count == 3


def test_an_error_is_data_with_its_traceback_stripped_of_ansi() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    tb = ["\x1b[0;31mZeroDivisionError\x1b[0m", "\x1b[1;32m----> 1\x1b[0m 1/0"]
    run(
        c,
        msg("error", ename="ZeroDivisionError", evalue="division by zero", traceback=tb),
        msg("status", execution_state="idle"),
        msg("execute_reply", status="error", ename="ZeroDivisionError", evalue="division by zero"),
    )
    r = c.finish(duration=0)
    assert r.status == "error"
    assert r.error is not None
    assert r.error.traceback == ("ZeroDivisionError", "----> 1 1/0")


def test_a_keyboard_interrupt_is_reported_as_interrupted() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    run(
        c,
        msg("error", ename="KeyboardInterrupt", evalue="", traceback=[]),
        msg("status", execution_state="idle"),
        msg("execute_reply", status="error"),
    )
    assert c.finish(duration=0).status == "interrupted"


def test_a_request_that_gets_no_reply_ends_as_interrupted_and_says_so() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    run(c, msg("status", execution_state="busy"), msg("execute_input", execution_count=4))
    run(c, msg("stream", name="stdout", text="begun\n"), msg("status", execution_state="idle"))
    assert c.idle and c.idle_at > 0 and not c.done
    c.reply_lost = True  # what the connection's probe found
    assert c.done
    r = c.finish(duration=0.1)
    assert (r.status, r.stdout, r.message) == ("interrupted", "begun\n", REPLY_LOST)
    assert r.execution_count == 4  # the kernel counted it: the next call's is 5
    timed_out = c.finish("timeout", duration=0.1, message="ran past its timeout")
    assert (timed_out.status, timed_out.message) == ("timeout", "ran past its timeout")
    c.reply_refused = True  # the gateway dropped a shell message meanwhile: not an interrupt
    refused = c.finish(duration=0.1)
    assert (refused.status, refused.message) == ("error", REPLY_REFUSED)


def test_output_over_the_budget_is_cut_with_a_marker_and_spooled_whole() -> None:
    c = Collector("m1", budget=10, spool_max=10_000)
    run(
        c,
        msg("stream", name="stdout", text="0123456789abcdef"),
        msg("stream", name="stdout", text="XYZ"),
    )
    r = c.finish("ok", duration=0)
    assert r.truncated
    assert r.stdout.startswith("0123456789\n[... output truncated: 9 more characters")
    assert c.full_text() == "0123456789abcdefXYZ"


def test_the_spool_itself_is_bounded() -> None:
    c = Collector("m1", budget=5, spool_max=8)
    run(c, msg("stream", name="stdout", text="x" * 100))
    assert c.full_text() == "x" * 8


def test_ansi_is_stripped() -> None:
    assert strip_ansi("\x1b[31mred\x1b[0m \x1b]0;title\x07ok") == "red ok"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("a.txt", "a.txt"),
        ("/workspace/a/b", "a/b"),
        ("a/../b", "b"),
        ("", "."),
        ("/workspace", "."),
    ],
)
def test_workspace_paths_are_normalized(given: str, expected: str) -> None:
    assert introspection.workspace_path(given) == expected


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "a/../../x", "/etc/passwd", "/workspace/../etc", "a\x00b"]
)
def test_paths_that_leave_the_workspace_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        introspection.workspace_path(bad)


def test_a_helper_reply_is_parsed_as_json_after_its_marker_only() -> None:
    _, marker = introspection.program("variables", max=1, repr_max=1)
    out = f"noise {marker}{{fake}}\nuser print\n{marker}" + '{"variables": []}\n'
    assert introspection.parse_reply(out, marker, limit=1000) == {"variables": []}
    with pytest.raises(KernelProtocolError, match="no reply line"):
        introspection.parse_reply("__import__('os').system('x')", marker, limit=1000)
    with pytest.raises(KernelProtocolError, match="not JSON"):
        introspection.parse_reply(marker + "[1, 2", marker, limit=1000)
    with pytest.raises(KernelProtocolError, match="limit"):
        introspection.parse_reply(marker + "{}" + " " * 2000, marker, limit=1000)


def test_a_large_helper_reply_of_many_small_values_is_refused_before_parsing() -> None:
    _, marker = introspection.program("read", path="f", max=1)
    big = 16_000_000
    flood = marker + '{"base64": [' + "{}," * 5_000_000 + "{}]}"
    with pytest.raises(KernelProtocolError, match="values"):
        introspection.parse_reply(flood, marker, limit=big)
    file = marker + '{"base64": "' + "QUJD" * 3_000_000 + '"}'  # 12 MB: one string
    assert len(introspection.parse_reply(file, marker, limit=big)["base64"]) == 12_000_000
    listing = marker + '{"entries": [' + ",".join(['{"name": "a"}'] * 100_000) + "]}"
    assert len(introspection.parse_reply(listing, marker, limit=big)["entries"]) == 100_000


def test_non_text_data_over_the_data_budget_is_replaced_by_a_note() -> None:
    c = Collector("m1", budget=1000, spool_max=1000, data_budget=100)
    run(
        c,
        msg("display_data", data={"image/png": "A" * 60}, metadata={}),
        msg("display_data", data={"image/png": "B" * 60, "text/plain": "<img>"}, metadata={}),
        msg("execute_result", data={"application/json": {"k": "v" * 500}}, metadata={}),
    )
    r = c.finish("ok", duration=0)
    assert r.truncated
    assert r.displays[0]["data"]["image/png"] == "A" * 60
    assert "image/png" not in r.displays[1]["data"]
    assert "image/png output of 60 bytes omitted" in r.displays[1]["data"]["text/plain"]
    assert r.displays[1]["data"]["text/plain"].startswith("<img>")
    assert r.result is not None and "application/json" not in r.result["data"]


def test_huge_metadata_and_odd_mime_keys_are_dropped() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    big = {"m": "x" * 20_000}
    run(c, msg("display_data", data={"x" * 500: "v", "text/plain": "t"}, metadata=big))
    (d,) = c.finish("ok", duration=0).displays
    assert d == {"data": {"text/plain": "t"}, "metadata": {}}


def test_a_huge_traceback_keeps_its_start_and_its_end() -> None:
    c = Collector("m1", budget=1000, spool_max=1000)
    tb = [f"frame {i} " + "x" * 1000 for i in range(1000)]
    run(c, msg("error", ename="RecursionError", evalue="e" * 100_000, traceback=tb))
    err = c.finish("error", duration=0).error
    assert err is not None
    assert len(err.evalue) == 10_000
    assert sum(len(line) for line in err.traceback) < 60_000
    assert err.traceback[0].startswith("frame 0 ")
    assert err.traceback[-1].startswith("frame 999 ")
    assert "traceback lines omitted" in "".join(err.traceback)


def test_the_marker_names_the_saved_file_once_it_is_known() -> None:
    c = Collector("m1", budget=3, spool_max=100)
    run(c, msg("stream", name="stdout", text="abcdef"))
    assert "saved" not in c.finish("ok", duration=0).stdout
    r = c.finish("ok", duration=0, saved_to="/workspace/out.txt")
    assert "full output saved to /workspace/out.txt" in r.stdout
    assert r.full_output_path == "/workspace/out.txt"


def test_a_hundred_thousand_small_displays_cost_no_more_than_the_budget() -> None:
    """Memory per call follows the output budgets, not the number of messages."""
    c = Collector("m1", budget=1000, spool_max=1000, data_budget=10_000)
    for i in range(100_000):
        c.feed(msg("display_data", data={"text/plain": f"{i}"}, metadata={"k": "v" * 100}))
    r = c.finish("ok", duration=0)
    assert r.truncated
    assert len(r.displays) < 200
    assert r.displays[0]["data"]["text/plain"] == "0"
    assert "displays omitted" in r.stdout


def test_the_kernel_guard_s_spill_is_named_only_at_the_expected_path() -> None:
    """The kernel says in the reply's metadata that it kept the rest in the call's file."""
    c = Collector("m1", budget=1000, spool_max=1000)
    path = "/workspace/.mcp-forge/outputs/m1.txt"
    c.feed(msg("stream", name="stdout", text="head"))
    c.feed(msg("status", execution_state="idle"))
    reply = msg("execute_reply", status="ok")
    reply["metadata"] = {"mcp-forge": {"spilled": 5_000_000, "path": path}}
    c.feed(reply)
    r = c.finish(duration=0)
    assert r.truncated and r.full_output_path == path
    assert r.stdout.startswith("head\n[... output truncated: 5000000 more characters")
    assert path in r.stdout
    # A path the gateway did not expect is never repeated.
    c = Collector("m1", budget=1000, spool_max=1000)
    reply["metadata"] = {"mcp-forge": {"spilled": 5, "path": "/etc/passwd"}}
    c.feed(reply)
    assert c.finish(duration=0).full_output_path is None


def _frames(session: Any, content: bytes) -> list[bytes]:
    m = session.msg("display_data", {}, parent={"msg_id": "m1"})
    parts = [session.pack(m["header"]), session.pack(m["parent_header"]), b"{}", content]
    return [b"<IDS|MSG>", session.sign(parts), *parts]


@pytest.mark.parametrize("depth", [200, 100_000])
async def test_a_deeply_nested_signed_message_is_dropped_not_raised(depth: int) -> None:
    from mcp_forge.api.connection import ConnectionInfo, new_key
    from mcp_forge.jupyter.client import KernelConnection

    conn = KernelConnection(
        ConnectionInfo("ipc", "/tmp/mf-none/kernel", new_key()), max_frame=10**6, max_message=10**7
    )
    try:
        nested = b'{"data": {"application/json": ' + b"[" * depth + b"]" * depth + b"}}"
        assert parse(conn.session, _frames(conn.session, nested)) is None
        ok = parse(conn.session, _frames(conn.session, b'{"data": {"text/plain": "x"}}'))
        assert ok is not None and ok["content"]["data"] == {"text/plain": "x"}
    finally:
        conn.close()


@pytest.mark.parametrize("key", ["", "short", "k" * 31])
async def test_a_kernel_connection_with_an_empty_or_short_key_is_refused(key: str) -> None:
    from mcp_forge.api.connection import ConnectionInfo
    from mcp_forge.jupyter.client import KernelConnection

    with pytest.raises(KernelProtocolError, match="key"):
        KernelConnection(
            ConnectionInfo("ipc", "/tmp/mf-none/kernel", key), max_frame=1, max_message=1
        )
