"""Jupyter protocol: kernel code speaks to the gateway through the kernel's own session
object (it holds the key), sending messages a kernel never should. Each is dropped (and
logged) by the gateway; the call that carried it answers with its own output, and the
session keeps working."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import gateway, gateway_peak_rss, run, value
from .test_output import FLOOD_MEMORY, MB

pytestmark = pytest.mark.podman

# Kernel-side: send signed parts on a channel, with the current request as parent.
SEND_RAW = """
k = get_ipython().kernel
s = k.session
parent = k.get_parent()
def send_raw(socket, content, *, msg_type='display_data', header=None, parent_header=None):
    m = s.msg(msg_type, {}, parent=parent)
    parts = [header if header is not None else s.pack(m['header']),
             parent_header if parent_header is not None else s.pack(m['parent_header']),
             b'{}', content]
    socket.send_multipart([msg_type.encode(), b'<IDS|MSG>', s.sign(parts), *parts])
"""


async def test_a_deeply_nested_signed_message_is_dropped(state_dir: Path) -> None:
    """A display nested 100,000 levels deep (past any recursion limit), signed with the
    kernel's key: the call returns its own output and the session answers the next call."""
    async with gateway(state_dir) as c:
        code = SEND_RAW + (
            "deep = b'{\"data\": {\"application/json\": ' + b'[' * 100000 + b']' * 100000 + b'}}'\n"
            "send_raw(k.iopub_socket, deep)\n"
            "print('still here')"
        )
        r = await run(c, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"] == "still here\n"
        assert r["displays"] == []
        assert await value(c, "6 * 7") == 42


async def test_moderately_nested_json_past_the_depth_bound_is_dropped(state_dir: Path) -> None:
    """Nesting of 500 (under Python's recursion limit, over the gateway's bound)."""
    async with gateway(state_dir) as c:
        code = SEND_RAW + (
            "deep = b'{\"data\": {\"application/json\": ' + b'[' * 500 + b']' * 500 + b'}}'\n"
            "send_raw(k.iopub_socket, deep)\n"
            "print('ok')"
        )
        r = await run(c, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["displays"] == [] and r["stdout"] == "ok\n"


async def test_malformed_and_badly_signed_messages_are_dropped(state_dir: Path) -> None:
    """Content that is not JSON, a header that is a list, and a wrong signature: none of them
    reaches the result, and the real output does."""
    async with gateway(state_dir) as c:
        code = SEND_RAW + (
            "send_raw(k.iopub_socket, b'{not json')\n"
            "send_raw(k.iopub_socket, b'{\"data\": {}}', header=b'[1, 2]')\n"
            "m = s.msg('stream', {'name': 'stdout', 'text': 'FORGED'}, parent=parent)\n"
            "parts = [s.pack(m['header']), s.pack(m['parent_header']), b'{}',\n"
            "         s.pack(m['content'])]\n"
            "k.iopub_socket.send_multipart([b'stream', b'<IDS|MSG>', b'0' * 64, *parts])\n"
            "print('real')"
        )
        r = await run(c, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"] == "real\n"
        assert "FORGED" not in r["_text"]


async def test_a_replayed_message_is_dropped(state_dir: Path) -> None:
    """A signed output message sent twice, byte for byte: the gateway keeps the first and
    drops the copy (its signature was seen), as jupyter-client does."""
    async with gateway(state_dir) as c:
        code = SEND_RAW + (
            "m = s.msg('stream', {'name': 'stdout', 'text': 'ONCE\\n'}, parent=parent)\n"
            "wire = [b'stream', *s.serialize(m)]\n"
            "k.iopub_socket.send_multipart(wire)\n"
            "k.iopub_socket.send_multipart(wire)\n"
            "print('real')"
        )
        r = await run(c, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"] == "ONCE\nreal\n"


async def test_a_forged_reply_for_another_msg_id_is_ignored(state_dir: Path) -> None:
    """The kernel sends an execute_reply and an idle status for a made-up request: the call
    waits for its own and returns its own output."""
    async with gateway(state_dir) as c:
        code = (
            "import time\n"
            "k = get_ipython().kernel\n"
            "fake = {'msg_id': 'not-a-request', 'msg_type': 'execute_request', 'session': 'x',"
            " 'username': 'x', 'date': '2026-01-01T00:00:00Z', 'version': '5.3'}\n"
            "k.session.send(k.iopub_socket, 'status', {'execution_state': 'idle'}, parent=fake)\n"
            "k.session.send(k.shell_stream, 'execute_reply', {'status': 'ok'}, parent=fake)\n"
            "time.sleep(0.5)\n"
            "print('own output')"
        )
        r = await run(c, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"] == "own output\n"


async def test_a_reply_forged_for_the_running_call_does_not_leak_into_the_next(
    state_dir: Path,
) -> None:
    """Code forges idle and execute_reply for its own request, then prints: whatever the
    first call returns, the next call carries only its own output."""
    async with gateway(state_dir) as c:
        code = (
            "import time\n"
            "k = get_ipython().kernel\n"
            "p = k.get_parent()\n"
            "k.session.send(k.iopub_socket, 'status', {'execution_state': 'idle'}, parent=p)\n"
            "k.session.send(k.shell_stream, 'execute_reply', {'status': 'ok'}, parent=p)\n"
            "time.sleep(1)\n"
            "print('AFTER-FORGERY')"
        )
        first = await run(c, code)
        assert first["status"] == "ok", first["_text"][:2000]
        r = await run(c, "print('second')")
        assert r["stdout"] == "second\n"
        assert "AFTER-FORGERY" not in r["_text"]


async def test_the_live_key_is_long_and_unique_per_session(state_dir: Path) -> None:
    """Every kernel's connection key is 64 characters and differs between sessions (the
    gateway refuses short or empty keys: tests/unit/test_collector.py)."""
    async with gateway(state_dir) as c:
        expr = "__import__('json').load(open('/etc/mcp-forge/connection.json'))['key']"
        first = await value(c, expr)
        made = await c.call_tool("create_session", {"variant": "minimal"})
        assert made.structured_content is not None
        other = await value(c, expr, session_id=made.structured_content["session_id"])
        assert len(first) == 64 and len(other) == 64 and first != other


@pytest.mark.parametrize("channel", ["iopub", "shell"])
async def test_a_multipart_message_too_big_in_all_is_cut_while_it_arrives(
    state_dir: Path, channel: str
) -> None:
    """Forty frames of 10 MB in one message, each under the frame bound: libzmq would hold
    all 400 MB before the gateway saw a frame. The relay stops reading once the gateway
    has a message's bound unread and closes the connection: the call answers with a note,
    the gateway's peak memory grows by less than a flood's allowance, and the session's
    next calls get their output."""
    send = {
        "iopub": "k.iopub_socket.send_multipart(frames, copy=False)",
        "shell": "k.shell_stream.socket.send_multipart("
        "[*k._parent_ident['shell'], *frames], copy=False)",
    }[channel]
    async with gateway(state_dir) as c:
        await run(c, "1")
        before = gateway_peak_rss(state_dir)
        code = (
            "k = get_ipython().kernel\n"
            "print('before', flush=True)\n"
            "frames = [b'x' * 10_000_000] * 40 + [b'end']\n" + send + "\n"
        )
        r = await run(c, code, timeout=60)
        grew = gateway_peak_rss(state_dir) - before
        assert grew < FLOOD_MEMORY, f"the gateway's peak memory grew by {grew / MB:.0f} MB"
        assert "channel was dropped" in r["message"], r["_text"][:2000]
        assert await value(c, "3 + 3") == 6
        shown = await run(c, "print('out again'); 7 * 6")
        assert shown["stdout"] == "out again\n", shown["_text"][:2000]
        assert shown["result"]["data"]["text/plain"] == "42"


async def test_displays_of_millions_of_small_values_are_dropped_before_they_are_parsed(
    state_dir: Path,
) -> None:
    """Three signed displays of 15 MB, each five million `{}` (under the frame and message
    bounds): parsed, they held the gateway's loop for seconds and grew it by 780 MB. They
    are dropped, counted before parsing; the gateway's peak grows by less than a flood's
    allowance and the session answers the next call."""
    async with gateway(state_dir) as c:
        await run(c, "1")
        before = gateway_peak_rss(state_dir)
        code = SEND_RAW + (
            "many = b'{\"data\": {\"application/json\": [' + b'{},' * 4_999_999 + b'{}]}}'\n"
            "for _ in range(3):\n"
            "    send_raw(k.iopub_socket, many)\n"
            "print('still here')"
        )
        r = await run(c, code, timeout=120)
        grew = gateway_peak_rss(state_dir) - before
        assert r["status"] == "ok" and r["stdout"] == "still here\n", r["_text"][:2000]
        assert r["displays"] == []
        assert grew < FLOOD_MEMORY, f"the gateway's peak memory grew by {grew / MB:.0f} MB"
        assert await value(c, "6 * 7") == 42
