"""Framing version 1 of code mode's bridge (docs/bridge.md), for both of its ends.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON: an object
with ``"v": 1``. A frame from the kernel (a call, a cancel) is at most KERNEL_FRAME_MAX
bytes, one from the gateway (a hello, a result) at most GATEWAY_FRAME_MAX. `encode`
makes a frame; a `FrameReader` splits a connection's bytes into frames and raises
FrameError for one it refuses.

The gateway imports this module (mcp_forge.gateway.codemode.bridge); in the kernel,
which has no mcp_forge package, kernelside/bridge_boot.py runs its source as a module of
its own and hands it to the bridge's modules made after it (mcp_channel.py, mcp_tools.py).
Standard library only.

BRIDGE_CERT and BRIDGE_KEY name the fields of the connection file that hold the
bridge's TLS certificate and key (mcp_forge.api.keys writes them; the gateway hands
them to the kernel's listener with its address).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

VERSION = 1
KERNEL_FRAME_MAX = 1 << 20  # a frame from the kernel (a call, a cancel): 1 MiB
GATEWAY_FRAME_MAX = 16 << 20  # a frame from the gateway (a hello, a result): 16 MiB
BRIDGE_CERT = "mcp_forge_bridge_cert"  # PEM; ipykernel ignores fields it does not know
BRIDGE_KEY = "mcp_forge_bridge_key"

_HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that FrameReader refuses; the message names the frame ("a frame of ...")."""


def encode(obj: Mapping[str, Any], *, limit: int | None = None) -> bytes:
    """One frame holding `obj`: its length, then compact UTF-8 JSON.

    Raises ValueError when `obj` is not a JSON object of strict JSON values (no NaN, no
    lone surrogates), or when `limit` is given and the JSON is over it; the error that
    made the JSON fail is its __cause__. Without a limit the caller checks the size.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"a frame holds a JSON object, not {type(obj).__name__}")
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        payload = text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"the frame cannot be sent as JSON: {exc}") from exc
    if limit is not None and len(payload) > limit:
        raise ValueError(f"the frame is {len(payload)} bytes, over the limit of {limit}")
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Splits the bytes of one connection into frames.

    Feed it whatever the socket returns; iterate what `feed` returns for the frames
    completed so far. A frame over `limit` bytes (refused as soon as its length is
    known), bad UTF-8 or JSON, anything but an object, or a version other than 1
    raises FrameError, then and on every later feed: close the connection.
    """

    def __init__(self, limit: int = KERNEL_FRAME_MAX) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._broken: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back (non-zero at EOF: the peer cut a frame)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """Take `data` now; yield each frame it completes, in order."""
        if self._broken is None:
            self._buffer += data
        return self._frames()

    def _frames(self) -> Iterator[dict[str, Any]]:
        while True:
            if self._broken is not None:
                raise FrameError(self._broken)
            if len(self._buffer) < _HEADER.size:
                return
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self.limit:
                self._fail(f"a frame of {size} bytes, over the limit of {self.limit}")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            yield self._decode(payload)

    def _decode(self, payload: bytes) -> dict[str, Any]:
        try:
            frame = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            self._fail("a frame that is not JSON: " + _clip(str(exc), 200))
        if not isinstance(frame, dict):
            self._fail("a frame that is not a JSON object")
        version = frame.get("v")
        if type(version) is not int or version != VERSION:
            self._fail(f"a frame of version {_clip(repr(version), 20)}, not {VERSION}")
        return frame

    def _fail(self, message: str) -> NoReturn:
        self._broken = message
        self._buffer.clear()
        raise FrameError(message)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"
