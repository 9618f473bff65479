"""The local gateway's housekeeping: status kept true, dead kernels restarted, idle culled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from .errors import ForgeError
from .local import LocalRuntime

log = logging.getLogger(__name__)


async def supervise_once(runtime: LocalRuntime) -> list[str]:
    """One pass: refresh every session, then cull the idle ones. Returns culled names."""
    running = await runtime.running_containers()
    for session in await runtime.list():
        if session.status.get("phase") == "Ready" and runtime.container_name(session) in running:
            continue  # nothing to check: one `podman ps` covered every healthy session
        try:
            await runtime.refresh(session)
        except ForgeError as exc:
            log.warning("could not refresh %s: %s", session.name, exc)
    return await runtime.cull_idle()


async def supervise(
    runtime: LocalRuntime, stop: asyncio.Event, *, interval: float, say: Callable[[str], None]
) -> None:
    say(f"mcp-forge gateway (local mode): state in {runtime.settings.state_dir}; Ctrl-C to stop")
    while not stop.is_set():
        for name in await supervise_once(runtime):
            say(f"culled idle session {name}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
