"""Podman's HTTP streams, read with asyncio: the event stream's headers, chunks and lines
(GET /libpod/events, chunked JSON lines), its events, and a log stream's frames.

The event stream is read directly, not through podman-py (clients/podman_api.py):
podman-py's `events()` is a blocking generator that nothing can cancel. What Podman
4.3.1 emits, seen on this host (cgroup v1 "hybrid", runc, events_logger = "file"):

- a kernel that exits or is killed (`kill -9` of its process, or `podman kill`): `died`,
  with `containerExitCode` (137 for SIGKILL) and the container's labels, about 0.2 s
  later, then `cleanup`; its pod's infra container then dies too (`died`, no labels).
  (`podman kill` also emits `kill` first.) There is no `exited` status.
- a kernel killed by the OOM killer: the same `died`, exit code 137. No `oom` event, not
  even when the container's init is the one killed, and inspect's OOMKilled stays false
  (cgroup v1): containers.py tells an OOM kill from the kernel log.
- `podman pod rm`: `remove` for each container (a running one `died` first).
The file event logger is read by polling (every 250 ms), hence the delay; journald's
would be sooner. Events carry no sequence number: after a reconnect the iterator says
so (`Event.resync`), and the consumer must look at everything again.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mcp_forge.errors import PodmanError

# The libpod API prefix for the event stream: any version up to the server's is accepted.
EVENTS_PATH = "/v4.0.0/libpod/events"
EVENT_LINE_MAX = 64 * 1024  # one event's JSON; a longer line is skipped, not buffered
STATUS_LINE_MAX = 8 * 1024  # an HTTP status or header line of the event stream
HEADERS_MAX = 100


@dataclass(frozen=True)
class Event:
    """One container event (or, with `resync`, the news that events may have been missed)."""

    status: str  # "died", "remove", "oom", ... ("" for a resync)
    name: str = ""
    id: str = ""
    exit_code: int | None = None
    time_ns: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    resync: bool = False


def parse_event(line: bytes) -> Event | None:
    """An event from one line of the stream; None if it is not a container event we read."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or raw.get("Type") != "container":
        return None
    actor: dict[str, Any] = raw["Actor"] if isinstance(raw.get("Actor"), dict) else {}
    attrs: dict[str, Any] = actor["Attributes"] if isinstance(actor.get("Attributes"), dict) else {}
    code = attrs.get("containerExitCode")
    try:
        exit_code = int(code) if code is not None else None
    except (TypeError, ValueError):
        exit_code = None
    labels = {
        str(k): str(v)
        for k, v in attrs.items()
        if k not in ("name", "image", "containerExitCode", "podId")
    }
    return Event(
        status=str(raw.get("status") or raw.get("Action") or ""),
        name=str(attrs.get("name") or ""),
        id=str(actor.get("ID") or raw.get("id") or ""),
        exit_code=exit_code,
        time_ns=int(raw.get("timeNano") or 0),
        labels=labels,
    )


async def read_headers(reader: asyncio.StreamReader) -> bool:
    """Read the response's status and headers; True if its body is chunked."""
    status = await _line(reader, STATUS_LINE_MAX)
    parts = status.split(b" ", 2)
    if len(parts) < 2 or parts[1] != b"200":
        raise PodmanError(["API", "events"], -1, status.decode(errors="replace")[:200])
    chunked = False
    for _ in range(HEADERS_MAX):
        line = (await _line(reader, STATUS_LINE_MAX)).strip()
        if not line:
            return chunked
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    raise PodmanError(["API", "events"], -1, "too many response headers")


async def _line(reader: asyncio.StreamReader, limit: int) -> bytes:
    line = await reader.readline()
    if not line:
        raise EOFError("the event stream closed")
    if len(line) > limit or not line.endswith(b"\n"):
        raise PodmanError(["API", "events"], -1, "a line of the response is too long")
    return line


async def read_lines(reader: asyncio.StreamReader, *, chunked: bool) -> AsyncIterator[bytes]:
    """The body's lines, de-chunked; a line over EVENT_LINE_MAX is skipped whole."""
    pending = b""
    skipping = False
    while True:
        if chunked:
            size_line = await _line(reader, STATUS_LINE_MAX)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            data = data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return
        pending += data
        *whole, pending = pending.split(b"\n")
        for line in whole:
            if skipping:  # the tail of an over-long line
                skipping = False
                continue
            if line.strip():
                yield line
        if len(pending) > EVENT_LINE_MAX:
            pending = b""
            skipping = True


def demux(data: bytes) -> bytes:
    """The payload of a multiplexed log stream (8-byte frame headers), or `data` as is
    if it is not one (a container with a terminal)."""
    out = bytearray()
    at = 0
    while at + 8 <= len(data):
        kind, size = data[at], struct.unpack(">I", data[at + 4 : at + 8])[0]
        if kind not in (0, 1, 2) or data[at + 1 : at + 4] != b"\0\0\0":
            return data
        out += data[at + 8 : at + 8 + size]
        at += 8 + size
    return bytes(out)
