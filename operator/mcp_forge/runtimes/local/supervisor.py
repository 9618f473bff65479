"""The local gateway's housekeeping: status kept true, dead kernels restarted, idle culled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import ForgeError
from mcp_forge.runtimes.local.runtime import LocalRuntime

log = logging.getLogger(__name__)

CONCURRENCY = 4  # sessions checked at once: a slow restart must not hold up the others


async def supervise_once(runtime: LocalRuntime) -> list[str]:
    """One pass: refresh every session that needs it, then cull the idle ones.

    Returns the names culled. An error about one session is logged and the pass goes on.
    """
    try:
        running: set[str] | None = await runtime.running_containers()
    except ForgeError as exc:  # no refresh this pass; culling needs no container list
        log.warning("cannot list kernel containers: %s", exc)
        running = None
    slots = asyncio.Semaphore(CONCURRENCY)

    async def check(session: KernelSession) -> None:
        async with slots:
            try:
                await runtime.refresh(session)
            except ForgeError as exc:
                log.warning("could not refresh %s: %s", session.name, exc)

    # Suspended and Expired sessions have no kernel on purpose: nothing to make true
    # (a refresh would resume an idle-suspended one).
    stale = [
        s
        for s in (await runtime.list() if running is not None else [])
        if s.status.get("phase") not in (st.SUSPENDED, st.EXPIRED)
        and (s.status.get("phase") != st.READY or runtime.container_name(s) not in (running or ()))
    ]
    async with asyncio.TaskGroup() as group:
        for session in stale:
            group.create_task(check(session))
    return await runtime.cull_idle()


async def supervise(
    runtime: LocalRuntime, stop: asyncio.Event, *, interval: float, say: Callable[[str], None]
) -> None:
    say(f"mcp-forge gateway (local mode): state in {runtime.settings.state_dir}; Ctrl-C to stop")
    while not stop.is_set():
        for name in await supervise_once(runtime):
            say(f"culled idle session {name}")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval):
                await stop.wait()
