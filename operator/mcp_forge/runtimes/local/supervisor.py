"""The local gateway's housekeeping: status kept true, dead kernels restarted, idle culled.

A kernel's death is heard from Podman's event stream (`watch_deaths`) and its session
refreshed at once, about 0.2 s after it died; the periodic pass (`supervise_once`, every
`interval`) is the safety net for anything the stream missed, and culls idle sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients.podman_stream import Event
from mcp_forge.control.render import LABEL_NAMESPACE, LABEL_SESSION
from mcp_forge.errors import ForgeError, SessionNotFound
from mcp_forge.runtimes.local.orphans import remove_orphans, remove_storage_only
from mcp_forge.runtimes.local.runtime import LocalRuntime

log = logging.getLogger(__name__)

CONCURRENCY = 4  # sessions checked at once: a slow restart must not hold up the others

Refreshed = Callable[[KernelSession], None]


async def supervise_once(runtime: LocalRuntime) -> list[str]:
    """One pass: refresh every session that needs it, drop snapshots kept too long,
    clean what a dead process's fork left, then cull the idle ones.

    Pods no session owns, and storage-only kernel containers of sessions' pods, are
    removed (orphans.py). Returns the names culled. An error about one session is
    logged and the pass goes on.
    """
    await refresh_stale(runtime)
    await remove_orphans(runtime)
    await remove_storage_only(runtime)
    await runtime.drop_old_snapshots()
    try:
        await runtime.clean_forks()
    except ForgeError as exc:
        log.warning("cleaning what forks left: %s", exc)
    return await runtime.cull_idle()


async def refresh_stale(runtime: LocalRuntime) -> None:
    """Refresh every session whose kernel is not Ready and running."""
    try:
        running: set[str] | None = await runtime.running_containers()
    except ForgeError as exc:  # no refresh this pass; culling needs no container list
        log.warning("cannot list kernel containers: %s", exc)
        running = None
    slots = asyncio.Semaphore(CONCURRENCY)

    async def check(session: KernelSession) -> None:
        async with slots:
            await _refresh(runtime, session)

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


async def _refresh(runtime: LocalRuntime, session: KernelSession) -> KernelSession | None:
    try:
        return await runtime.refresh(session)
    except SessionNotFound:  # deleted meanwhile: its pod's removal is what we heard
        return None
    except ForgeError as exc:
        log.warning("could not refresh %s: %s", session.name, exc)
        return None


async def watch_deaths(
    runtime: LocalRuntime,
    *,
    subscribed: Callable[[], None] | None = None,
    refreshed: Refreshed | None = None,
) -> None:
    """Refresh a session as soon as Podman reports its kernel died or its pod went.

    One refresh per session at a time; deaths heard during it are folded into one more.
    After a break in the stream, every session is looked at (`refresh_stale`).
    `subscribed` is called whenever the stream is live; `refreshed` with each session
    refreshed because of an event (tests wait on it). Runs until cancelled.
    """
    busy: set[tuple[str, str]] = set()
    again: set[tuple[str, str]] = set()

    async def refresh(key: tuple[str, str]) -> None:
        try:
            while True:
                again.discard(key)
                session = await _session(runtime, key)
                if session is None or session.status.get("phase") in (st.SUSPENDED, st.EXPIRED):
                    return
                done = await _refresh(runtime, session)
                if done is not None and refreshed is not None:
                    refreshed(done)
                if key not in again:
                    return
        finally:
            busy.discard(key)

    async with asyncio.TaskGroup() as group:
        async for event in runtime.containers.deaths(subscribed=subscribed):
            if event.resync:
                group.create_task(refresh_stale(runtime))
                continue
            key = await _key(runtime, event)
            if key is None:
                continue
            log.info("kernel container %s: %s (exit %s)", event.name, event.status, event.exit_code)
            if key in busy:
                again.add(key)
            else:
                busy.add(key)
                group.create_task(refresh(key))


async def _key(runtime: LocalRuntime, event: Event) -> tuple[str, str] | None:
    """The (namespace, name) of the session whose kernel container the event is about.

    By the container's name first: a kernel claimed from a pool keeps its pod, and the
    labels of the pool's name for it. By its labels if no session has that container
    (any more): a refresh then finds out what became of it.
    """
    for session in await runtime.list():
        if runtime.container_name(session) == event.name:
            return session.namespace, session.name
    name, namespace = event.labels.get(LABEL_SESSION), event.labels.get(LABEL_NAMESPACE)
    return (namespace, name) if name and namespace else None


async def _session(runtime: LocalRuntime, key: tuple[str, str]) -> KernelSession | None:
    try:
        return await runtime.get(key[1], key[0])
    except SessionNotFound:
        return None


async def _watch(
    runtime: LocalRuntime, subscribed: Callable[[], None] | None, refreshed: Refreshed | None
) -> None:
    try:
        await watch_deaths(runtime, subscribed=subscribed, refreshed=refreshed)
    except ForgeError as exc:  # the stream reconnects by itself: this is no Podman API at all
        log.warning("kernel deaths are seen by the periodic pass only: %s", exc)


async def supervise(
    runtime: LocalRuntime,
    stop: asyncio.Event,
    *,
    interval: float,
    say: Callable[[str], None],
    subscribed: Callable[[], None] | None = None,
    refreshed: Refreshed | None = None,
) -> None:
    """Keep the local sessions true until `stop` is set: deaths as Podman reports them,
    and a pass every `interval` seconds (the safety net, and idle culling)."""
    say(f"mcp-forge gateway (local mode): state in {runtime.settings.state_dir}; Ctrl-C to stop")
    watcher = asyncio.ensure_future(_watch(runtime, subscribed, refreshed))
    try:
        while not stop.is_set():
            for name in await supervise_once(runtime):
                say(f"culled idle session {name}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
