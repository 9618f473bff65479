"""The Jupyter wire protocol's frames, as KernelConnection (client.py) reads and writes
them: the delimiter, how a part is packed, a message read at once off a socket, a cheap
look at its parent before it is verified, the bounds on what parsing one may build, and
the parsing: signature, replay and those bounds checked before a message is believed.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, cast

import zmq
import zmq.asyncio
from jupyter_client.session import Session

from mcp_forge.logsafe import shown

log = logging.getLogger(__name__)

Message = dict[str, Any]

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


def deserialize(session: Session, parts: list[bytes]) -> Message:
    """jupyter-client's Session.deserialize, less what we never use. Its checks are
    kept, with its own signing and replay memory: a signed message (HMAC over header,
    parent, metadata and content, compared in constant time) whose signature was not
    seen before. Dates stay ISO text: its extract_dates parses every header's and
    parent's with dateutil, a third of what reading a message costs. ValueError for
    a message that fails a check."""
    if len(parts) < 5:
        raise ValueError(f"malformed message: {len(parts)} parts, at least 5 needed")
    signature, header, parent, metadata, content = parts[:5]
    if not signature:
        raise ValueError("unsigned message")
    if signature in session.digest_history:
        raise ValueError("duplicate signature (a replayed message)")
    if not hmac.compare_digest(signature, session.sign(parts[1:5])):
        raise ValueError("invalid signature")
    session._add_digest(signature)  # bounded by the session's digest_history_size
    unpack = session.unpack
    return {
        "header": unpack(header),
        "parent_header": unpack(parent),
        "metadata": unpack(metadata),
        "content": unpack(content),
    }


def parse(session: Session, frames: list[bytes]) -> Message | None:
    """A kernel's message from its frames, verified and within the bounds above; None
    (and a warning logged) for one that is not."""
    try:
        _, parts = session.feed_identities(frames, copy=True)
        # Counted before parsing (a count is fast; brackets in strings count too).
        raw_parts = cast(list[bytes], parts[1:5])  # copy=True: bytes
        containers = sum(p.count(b"{") + p.count(b"[") for p in raw_parts)
        if containers > CONTAINERS_MAX:
            log.warning(
                "dropped a message of %d brackets from the kernel; the limit is %d",
                containers,
                CONTAINERS_MAX,
            )
            return None
        msg = deserialize(session, parts)  # type: ignore[arg-type]  # bytes in, bytes out
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
        # Bad signature, replay, not JSON, nested past the recursion limit: the
        # kernel's problem, never ours.
        log.warning("dropped a malformed message from the kernel: %s", shown(exc, 200))
        return None
    names = ("header", "parent_header", "metadata", "content")
    raw = dict(zip(names, cast(list[bytes], parts[1:5]), strict=True))
    for part in ("header", "parent_header", "content", "metadata"):
        if not isinstance(msg.get(part), dict):
            log.warning("dropped a message whose %s is not a mapping", part)
            return None
        # JSON nests no deeper than it has brackets: most parts are not walked.
        brackets = raw[part].count(b"{") + raw[part].count(b"[")
        if brackets > DEPTH_MAX and nested_deeper_than(msg[part], DEPTH_MAX):
            log.warning("dropped a message whose %s nests over %d levels", part, DEPTH_MAX)
            return None
    msg["msg_type"] = msg["header"].get("msg_type")
    return msg
