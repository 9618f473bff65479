"""The image builder's and the package installer's child processes: stopped, and their
output kept to a bounded tail while it is read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

TERMINATE_GRACE = 10.0  # seconds between SIGTERM and SIGKILL


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process's group (it was started in a session of its own), then
    SIGKILL it if it is still there after TERMINATE_GRACE."""
    if proc.returncode is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TERMINATE_GRACE):
                await asyncio.shield(proc.wait())
            return


async def tail(stream: asyncio.StreamReader, most: int) -> str:
    """What `stream` says until it ends: its last `most` bytes, decoded."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk
        del kept[:-most]
    return kept.decode(errors="replace")
