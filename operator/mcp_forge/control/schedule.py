"""When the operator reconciles what: one task keeps every session's and pool's next
time (a deadline, a poke from an event, a retry), and runs each as it falls due, a
bounded number at once, retrying a failed one with exponential backoff.

As client-go's workqueue: a key is worked on by one task at a time, and the pokes that
come while it is (the kubelet's writes of a starting pod, one after another) make one
more run after it, not one each: that run reads everything afresh anyway (only a
session's first run may start from its ADDED event, which any later event drops).

No timers or daemons of kopf's (they would add a finalizer to every session): the
deadlines are kept here. The work itself is the reconciler's (control/reconciler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

BACKOFF_MAX = 60.0  # seconds: the longest wait before a failed reconcile is tried again
WORKERS = 16  # reconciles running at once

Key = tuple[str, str, str]  # kind, namespace, name


class Scheduler:
    """Runs `work(kind, namespace, name)` for each key as it falls due."""

    def __init__(self, work: Callable[[str, str, str], Awaitable[object]], resync: float) -> None:
        self._work = work
        self._resync = resync  # every key is looked at at least this often, if it is known
        self._due: dict[Key, float] = {}
        self._failures: dict[Key, int] = {}
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(WORKERS)
        self._running: set[asyncio.Task[None]] = set()
        self._active: set[Key] = set()  # keys whose task has started and not ended
        self._again: set[Key] = set()  # of those, the keys due again meanwhile

    def poke(self, key: Key, at: float | None = None) -> None:
        """Run `key` at `at` (now if None), or earlier if it is due earlier."""
        when = time.time() if at is None else at
        if key not in self._due or when < self._due[key]:
            self._due[key] = when
            self._wake.set()

    def forget(self, key: Key) -> None:
        self._due.pop(key, None)
        self._failures.pop(key, None)
        self._again.discard(key)

    async def run(self) -> None:
        """Run the keys as they fall due; wake at the earliest, or after the resync."""
        while True:
            now = time.time()
            for key in [k for k, t in self._due.items() if t <= now]:
                del self._due[key]
                if key in self._active:  # run once more when it ends
                    self._again.add(key)
                    continue
                self._active.add(key)
                task = asyncio.create_task(self._background(key))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            self._wake.clear()
            wait = min(self._due.values(), default=now + self._resync) - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait)):
                    await self._wake.wait()

    async def _background(self, key: Key) -> None:
        try:
            async with self._slots:
                try:
                    await self._work(*key)
                except Exception as exc:  # kept going: retried with backoff
                    n = self._failures.get(key, 0) + 1
                    self._failures[key] = n
                    delay = min(BACKOFF_MAX, 2.0**n)
                    log.warning(
                        "reconcile of %s %s/%s failed (retry in %.0fs): %s", *key, delay, exc
                    )
                    self.poke(key, time.time() + delay)
                else:
                    self._failures.pop(key, None)
        finally:
            self._active.discard(key)
            if key in self._again:
                self._again.discard(key)
                self.poke(key)
