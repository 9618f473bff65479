"""What the gateway reads of a kernel's message: before it verifies and parses it, and the
limits it parses it within."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import zmq
from jupyter_client.session import Session

from mcp_forge.api.connection import ConnectionInfo
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.wire import CONTAINERS_MAX, DELIMITER, DEPTH_MAX, parse
from mcp_forge.jupyter.wire import may_answer as _may_answer

MINE = "0b6b7c0e-3f1a-4e39-9b43-2f0d7c1a5e11_4242_7"


def message(parent: dict[str, object], *, identities: int = 1) -> list[zmq.Frame]:
    frames = [b"kernel.1234.status"] * identities + [DELIMITER, b"signature"]
    frames += [b'{"msg_type": "status"}', json.dumps(parent).encode(), b"{}", b"{}"]
    return [zmq.Frame(f) for f in frames]


def test_a_message_in_reply_to_another_request_is_passed_over_unread() -> None:
    assert _may_answer(message({"msg_id": MINE}), [MINE.encode()])
    assert _may_answer(message({"msg_id": MINE}, identities=0), [MINE.encode()])
    assert _may_answer(message({"msg_id": MINE}), [b"other", MINE.encode()])
    assert not _may_answer(message({"msg_id": "someone-else_1_7"}), [MINE.encode()])
    assert not _may_answer(message({}), [MINE.encode()])  # no parent: a kernel's own
    # Its id in the header or content, not the parent, does not make it ours.
    frames = message({"msg_id": "x"})
    frames[3] = zmq.Frame(json.dumps({"msg_id": MINE}).encode())
    assert not _may_answer(frames, [MINE.encode()])


def test_a_message_not_framed_as_the_protocol_says_is_left_to_the_parser() -> None:
    # The parser refuses it and logs why: passing it over would hide a broken kernel.
    no_delimiter = [zmq.Frame(f) for f in (b"a", b"b", b"c")]
    assert _may_answer(no_delimiter, [MINE.encode()])
    short = [zmq.Frame(f) for f in (DELIMITER, b"signature", b"{}")]
    assert _may_answer(short, [MINE.encode()])


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_a_message_nested_past_the_limit_is_dropped_and_brackets_in_text_are_not(
    tmp_path: Path,
) -> None:
    key = secrets.token_hex(32)
    conn = KernelConnection(
        ConnectionInfo("ipc", str(tmp_path / "kernel"), key), max_frame=1 << 20, max_message=1 << 20
    )
    kernel = Session(key=key.encode(), signature_scheme="hmac-sha256")

    def signed(content: dict[str, object]) -> list[bytes]:
        msg = kernel.msg("display_data", content, parent={"msg_id": MINE})
        return [DELIMITER, *kernel.serialize(msg)[1:]]

    try:
        deep = parse(conn.session, signed({"data": {"application/json": nested(DEPTH_MAX + 5)}}))
        assert deep is None
        near = parse(conn.session, signed({"data": {"application/json": nested(DEPTH_MAX - 5)}}))
        assert near is not None
        text = "[" * 5000 + "{" * 5000  # many brackets, no nesting: parsed as it is
        kept = parse(conn.session, signed({"data": {"text/plain": text}}))
        assert kept is not None and kept["content"]["data"]["text/plain"] == text
        # Many small values, flat: each is an object to build; past the bound, dropped
        # before it is parsed (5M of them held a gateway's loop for seconds and 780 MB).
        many = parse(
            conn.session, signed({"data": {"application/json": [{}] * (CONTAINERS_MAX + 1)}})
        )
        assert many is None
        fine = parse(conn.session, signed({"data": {"application/json": [{}] * 100_000}}))
        assert fine is not None and len(fine["content"]["data"]["application/json"]) == 100_000
    finally:
        conn.close()
