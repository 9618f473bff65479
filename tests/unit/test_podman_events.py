"""Reading Podman's event stream and log frames (clients/podman_stream.py): pure parsing."""

from __future__ import annotations

import asyncio
import json
import struct

from mcp_forge.clients.podman_stream import EVENT_LINE_MAX, demux, parse_event, read_lines

# A `died` event as Podman 4.3.1 sends it (trimmed ids).
DIED = {
    "status": "died",
    "id": "c0ffee",
    "from": "localhost/mcp-forge-kernel:0.1.0-minimal",
    "Type": "container",
    "Action": "died",
    "Actor": {
        "ID": "c0ffee",
        "Attributes": {
            "containerExitCode": "137",
            "image": "localhost/mcp-forge-kernel:0.1.0-minimal",
            "name": "mcpforge-default-s1-kernel",
            "podId": "",
            "mcpforge.dev/session": "s1",
        },
    },
    "scope": "local",
    "time": 1764596164,
    "timeNano": 1764596164123456789,
}


def test_a_died_event_gives_its_container_exit_code_and_labels() -> None:
    event = parse_event(json.dumps(DIED).encode())
    assert event is not None
    assert (event.status, event.name, event.id, event.exit_code) == (
        "died",
        "mcpforge-default-s1-kernel",
        "c0ffee",
        137,
    )
    assert event.labels == {"mcpforge.dev/session": "s1"}
    assert event.time_ns == 1764596164123456789
    assert not event.resync


def test_lines_that_are_not_container_events_are_ignored() -> None:
    assert parse_event(b"not json") is None
    assert parse_event(b"[1, 2]") is None
    assert parse_event(json.dumps({**DIED, "Type": "image"}).encode()) is None
    odd = parse_event(json.dumps({**DIED, "Actor": "x"}).encode())
    assert odd is not None and odd.name == "" and odd.exit_code is None


async def _read(body: bytes, *, chunked: bool) -> list[bytes]:
    reader = asyncio.StreamReader(limit=EVENT_LINE_MAX)
    reader.feed_data(body)
    reader.feed_eof()
    return [line async for line in read_lines(reader, chunked=chunked)]


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def test_chunked_lines_are_joined_across_chunks_and_split_within_them() -> None:
    body = _chunk(b'{"a":') + _chunk(b'1}\n{"b":2}\n{"c"') + _chunk(b":3}\n") + b"0\r\n\r\n"
    assert await _read(body, chunked=True) == [b'{"a":1}', b'{"b":2}', b'{"c":3}']


async def test_an_over_long_line_is_skipped_whole_and_the_next_one_read() -> None:
    huge = b"x" * (EVENT_LINE_MAX + 10)
    body = b"".join(_chunk(huge[i : i + 4096]) for i in range(0, len(huge), 4096))
    body += _chunk(b'x\n{"ok":1}\n') + b"0\r\n\r\n"
    assert await _read(body, chunked=True) == [b'{"ok":1}']


def test_log_frames_are_demultiplexed_and_a_plain_stream_kept() -> None:
    frames = b"".join(
        struct.pack(">B3xI", kind, len(text)) + text
        for kind, text in ((1, b"out\n"), (2, b"err\n"))
    )
    assert demux(frames) == b"out\nerr\n"
    assert demux(b"plain text from a terminal\n") == b"plain text from a terminal\n"
