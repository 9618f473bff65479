"""Framing version 1 of code mode's bridge (kernelside/framing.py), which the gateway and
the kernel's bridge both use: encode, FrameReader and its refusals."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from mcp_forge.kernelside import framing, mcp_channel, rebind
from mcp_forge.kernelside.framing import (
    GATEWAY_FRAME_MAX,
    KERNEL_FRAME_MAX,
    VERSION,
    FrameError,
    FrameReader,
    encode,
)

FRAMES: list[dict[str, Any]] = [
    {"v": 1, "type": "hello", "servers": {}},
    {"v": 1, "type": "call", "id": 1, "arguments": {"text": "é ✓ 😀", "n": [1, 2.5, None]}},
    {"v": 1, "type": "result", "id": 2**53 - 1, "ok": True, "structured": {"a": {"b": []}}},
    {"v": 1, "type": "cancel", "id": 7},
]


def raw(payload: bytes) -> bytes:
    """A frame of these bytes, whatever they are."""
    return struct.pack(">I", len(payload)) + payload


def test_a_frame_is_its_length_then_compact_utf8_json() -> None:
    assert encode({"v": 1, "s": "é"}) == raw('{"v":1,"s":"é"}'.encode())
    assert VERSION == 1
    assert GATEWAY_FRAME_MAX == 16 * KERNEL_FRAME_MAX == 16 << 20


def test_what_is_encoded_is_read_back_the_same() -> None:
    reader = FrameReader(GATEWAY_FRAME_MAX)
    assert list(reader.feed(b"".join(encode(frame) for frame in FRAMES))) == FRAMES
    assert reader.buffered == 0


def test_frames_come_through_a_reader_fed_one_byte_at_a_time() -> None:
    sent = [{"v": 1, "type": "call", "id": n, "arguments": {"text": "é" * n}} for n in range(5)]
    stream = b"".join(encode(frame) for frame in sent)
    reader = FrameReader()
    got = [frame for i in range(len(stream)) for frame in reader.feed(stream[i : i + 1])]
    assert got == sent
    assert reader.buffered == 0


def test_frames_split_anywhere_come_through_whole_and_in_order() -> None:
    stream = b"".join(encode(frame) for frame in FRAMES * 20)
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), 30))
        reader = FrameReader()
        got = [
            frame
            for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True)
            for frame in reader.feed(stream[start:end])
        ]
        assert got == FRAMES * 20
        assert reader.buffered == 0


def test_an_incomplete_frame_is_held_back_and_counted() -> None:
    data = encode(FRAMES[1])
    reader = FrameReader()
    assert list(reader.feed(data + data[:10])) == [FRAMES[1]]
    assert reader.buffered == 10  # at EOF: the peer cut a frame
    assert list(reader.feed(data[10:])) == [FRAMES[1]]
    assert reader.buffered == 0


def test_a_frame_at_the_limit_is_read() -> None:
    frame = {"v": 1, "s": ""}
    frame["s"] = "x" * (100 - len(encode(frame)) + 4)
    assert len(encode(frame)) == 4 + 100
    assert list(FrameReader(limit=100).feed(encode(frame))) == [frame]


def test_the_reader_refuses_an_oversized_frame_as_soon_as_its_length_arrives() -> None:
    reader = FrameReader(limit=100)
    with pytest.raises(FrameError, match=r"^a frame of 101 bytes, over the limit of 100$"):
        list(reader.feed(struct.pack(">I", 101)))
    with pytest.raises(FrameError, match="101 bytes"):  # and stays broken
        list(reader.feed(encode({"v": 1})))
    assert reader.buffered == 0  # what it held is dropped


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "^a frame that is not JSON: Expecting property name"),
        (b"\xff\xfe", "^a frame that is not JSON: 'utf-8' codec can't decode"),
        (b'{"v": "\xed\xa0\x80"}', "^a frame that is not JSON: 'utf-8' codec can't decode"),
        (b'{"v": 1, "x": NaN}', "^a frame that is not JSON: NaN is not JSON$"),
        (b'{"v": 1, "x": -Infinity}', "^a frame that is not JSON: -Infinity is not JSON$"),
        (b"[" * 100_000 + b"]" * 100_000, "^a frame that is not JSON: maximum recursion"),
        (b"", "^a frame that is not JSON"),
        (b"[1, 2]", "^a frame that is not a JSON object$"),
        (b'"v"', "^a frame that is not a JSON object$"),
        (b"{}", "^a frame of version None, not 1$"),
        (b'{"v": 2}', "^a frame of version 2, not 1$"),
        (b'{"v": true}', "^a frame of version True, not 1$"),
        (b'{"v": 1.0}', "^a frame of version 1.0, not 1$"),
        (b'{"v": "' + b"9" * 50 + b'"}', r"^a frame of version '9{19}\.\.\.\[truncated\], not 1$"),
    ],
)
def test_the_reader_refuses_what_is_not_a_version_1_json_object(
    payload: bytes, message: str
) -> None:
    good = encode({"v": 1, "type": "cancel", "id": 1})
    reader = FrameReader()
    frames = reader.feed(good + raw(payload) + good)
    assert next(frames) == {"v": 1, "type": "cancel", "id": 1}  # what came before is delivered
    with pytest.raises(FrameError, match=message) as caught:
        next(frames)
    assert isinstance(caught.value, ValueError)  # bad data, for callers that catch that
    with pytest.raises(FrameError, match=message):  # nothing after it is read, ever
        list(reader.feed(good))


def test_encode_refuses_frames_over_its_limit_and_values_that_are_not_json() -> None:
    assert len(encode({"v": 1, "s": "x" * 100})) > 100  # no limit unless given
    assert len(encode({"v": 1, "s": "x" * 100}, limit=200)) > 100
    with pytest.raises(ValueError, match="over the limit of 50"):
        encode({"v": 1, "s": "x" * 100}, limit=50)
    with pytest.raises(ValueError, match="cannot be sent as JSON") as nan:
        encode({"v": 1, "x": float("nan")})
    assert isinstance(nan.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="cannot be sent") as a_set:
        encode({"v": 1, "x": {1, 2}})
    assert isinstance(a_set.value.__cause__, TypeError)  # what the kernel reports as such
    with pytest.raises(ValueError, match="cannot be sent"):
        encode({"v": 1, "x": "\ud800"})  # a lone surrogate is not UTF-8
    with pytest.raises(ValueError, match="holds a JSON object, not list"):
        encode([1, 2])  # type: ignore[arg-type]


def test_the_bridge_takes_its_certificate_with_its_address_and_no_error_shows_the_key() -> None:
    """A cluster kernel's bridge gets its certificate and key from the gateway, with its
    address (a kernel woken in a new pod has no connection file); a malformed address is
    refused by name, never echoing what could be a key."""
    with pytest.raises(ValueError, match=r"\('tls', host, port, certificate, key\)"):
        mcp_channel.listen(("tls", "127.0.0.1", 0, "/tmp/.mcp-forge/connection.json"))
    with pytest.raises(ValueError, match="BRIDGE_ADDRESS is") as refused:
        mcp_channel.listen(("tls", "127.0.0.1", 0, "CERT", "SECRET-KEY-TEXT", "more"))
    assert "SECRET-KEY-TEXT" not in str(refused.value)
    with pytest.raises(ValueError, match="over"):
        mcp_channel.listen(("tls", "127.0.0.1", 0, "x" * mcp_channel.CERT_MAX, "k"))


def test_rebind_reads_the_bridge_fields_framing_names() -> None:
    assert (rebind.BRIDGE_CERT, rebind.BRIDGE_KEY) == (framing.BRIDGE_CERT, framing.BRIDGE_KEY)
