"""The HTTP wire's corrections (gateway/mcp/wire.py), as plain functions: which SSE
event is the SDK's answer to a cancelled request (dropped), and which is not."""

from __future__ import annotations

import json

import pytest

from mcp_forge.gateway.mcp.wire import cancelled_answer


def event(message: object) -> bytes:
    return f"event: message\r\ndata: {json.dumps(message)}\r\n\r\n".encode()


CANCELLED = {"jsonrpc": "2.0", "id": 7, "error": {"code": -32800, "message": "Request cancelled"}}


@pytest.mark.parametrize(
    ("chunk", "dropped"),
    [
        (event(CANCELLED), True),
        (event({**CANCELLED, "id": "7"}), True),
        (event({"jsonrpc": "2.0", "id": 7, "error": {"code": -32603, "message": "x"}}), False),
        # a result that merely says -32800 (the cell printed it) is an answer like any other
        (event({"jsonrpc": "2.0", "id": 7, "result": {"content": "-32800"}}), False),
        (event({"jsonrpc": "2.0", "method": "notifications/message", "params": "-32800"}), False),
        (b"data: not json -32800\r\n\r\n", False),
        (b": ping -32800\r\n\r\n", False),  # no data line
        (b"", False),
    ],
)
def test_only_the_sdk_s_answer_to_a_cancelled_request_is_dropped(
    chunk: bytes, dropped: bool
) -> None:
    assert cancelled_answer(chunk) is dropped
