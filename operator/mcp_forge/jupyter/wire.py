"""The Jupyter wire protocol's frames, as KernelConnection (client.py) reads and writes
them: the delimiter, how a part is packed, a message read at once off a socket, a cheap
look at its parent before it is verified, and the bounds on what parsing one may build.
"""

from __future__ import annotations

import json
from typing import Any

import zmq
import zmq.asyncio

DEPTH_MAX = 100  # nesting of lists and mappings in a message's parts (JSON displays)
# Brackets (`{`, `[`) in one message's parts: each may be a Python object to build, on the
# gateway's loop. 16 MB of `{}` is 8 million dicts, seconds and hundreds of MB to parse;
# 500,000 is a large JSON display (a plot of 100,000 records) and costs ~0.1 s.
CONTAINERS_MAX = 500_000
DELIMITER = b"<IDS|MSG>"  # between a message's routing identities and its signature


def pack(value: Any) -> bytes:
    """A part of a message on the wire, as jupyter-client packs it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode(
        "utf8", errors="surrogateescape"
    )


def nested_deeper_than(value: Any, limit: int) -> bool:
    """True if lists/mappings in `value` nest more than `limit` levels (iterative: no
    recursion for the kernel to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def read_now(sock: zmq.asyncio.Socket) -> list[zmq.Frame]:
    """The message waiting on `sock`, read without blocking; zmq.Again if none is.

    The plain socket's recv, frame by frame (its recv_multipart would call the asyncio
    socket's recv): libzmq has every frame of a message once the first is readable."""
    parts = [zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False)]
    while parts[-1].more:
        parts.append(zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False))
    return parts


def may_answer(parts: list[zmq.Frame], wanted: list[bytes]) -> bool:
    """Whether a message's parent header holds one of the `wanted` msg_ids' text: False
    only for a message in reply to none of them (an exact check follows its parsing).
    A message whose frames are not where the wire protocol puts them is let through, to
    be refused by the parser and logged."""
    frames = [part.buffer for part in parts]
    try:
        at = next(i for i, f in enumerate(frames) if f == DELIMITER)
        parent = frames[at + 3]
    except (StopIteration, IndexError):
        return True
    raw = bytes(parent)
    return any(w in raw for w in wanted)
