"""A session's lock, within this process and across processes (LocalRuntime._locked).

Within this process the lock is first an asyncio lock (`in_process`), so only one task at
a time opens and waits on the lock file: tasks queue on the loop, and the file lock
(`flock`) is contended only by other processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
import weakref
from pathlib import Path

# Per lock file, the asyncio lock its holder or waiter of this process holds. Weak: an
# entry lives as long as a task holds or awaits it.
_IN_PROCESS: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


def in_process(path: Path) -> asyncio.Lock:
    """The in-process lock of the lock file at `path`."""
    key = str(path)
    lock = _IN_PROCESS.get(key)
    if lock is None:
        lock = _IN_PROCESS[key] = asyncio.Lock()
    return lock


def contended(lock: asyncio.Lock) -> bool:
    """Whether taking `lock` now would wait: held, or a task is queued for it. Just after
    a release `locked()` is False while the task woken for it has not run yet, and a new
    `acquire` queues behind that task: `locked()` alone would have it wait."""
    waiters = getattr(lock, "_waiters", None) or ()  # asyncio's own, since 3.10
    return lock.locked() or any(not w.cancelled() for w in waiters)


def try_flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` if no other process holds it: True if taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


async def flock(fd: int) -> None:
    """Take an exclusive flock on `fd`, waiting as long as another process holds it.

    Free, it is taken at once on the loop. Otherwise a thread of its own waits (flock has
    no timeout and cannot be called back): not one of the loop's default executor, which
    the lock's holder may need to get on. The thread waits on a duplicate of `fd`, and
    closes it once flock returns: if our caller was cancelled and closed `fd` meanwhile,
    the lock, taken late, goes with that duplicate, and `fd`'s number, perhaps reused by
    then, is never touched.
    """
    if try_flock(fd):
        return
    loop = asyncio.get_running_loop()
    taken: asyncio.Future[None] = loop.create_future()
    dup = os.dup(fd)

    def settle(error: BaseException | None) -> None:
        if taken.done():
            return
        if error is None:
            taken.set_result(None)
        else:
            taken.set_exception(error)

    def wait() -> None:
        error: BaseException | None = None
        try:
            fcntl.flock(dup, fcntl.LOCK_EX)
        except OSError as exc:
            error = exc
        finally:
            os.close(dup)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=wait, name="mcp-forge-session-lock", daemon=True).start()
    await taken
