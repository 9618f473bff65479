"""Locks within this process and across processes: a session's (LocalRuntime._locked),
and the host's one `podman kube play` at a time (`PodmanPlays`).

Within this process a lock is first an asyncio lock (`in_process`), so only one task at
a time opens and waits on the lock file: tasks queue on the loop, and the file lock
(`flock`) is contended only by other processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import stat
import threading
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from mcp_forge.errors import ForgeError

# Where root's plays meet: every store of this host shares Podman's one storage. A
# directory of root's own, not /run/lock, where any user may make the file and hold it.
HOST_LOCKS = Path("/run/mcp-forge")

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

    threading.Thread(target=wait, name="mcp-forge-lock-wait", daemon=True).start()
    await taken


@contextlib.asynccontextmanager
async def held(path: Path) -> AsyncIterator[None]:
    """Hold the lock file at `path` (made if missing), within this process and across
    processes. Closing the descriptor releases it, also when cancelled while waiting."""
    async with in_process(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            await flock(fd)
            yield
        finally:
            os.close(fd)


class PodmanPlays:
    """One `podman kube play` (or pod create, or keeper's run) at a time on this host.

    Podman 4.3.1's containers/storage takes its locks in different orders on the way
    through a play in a user namespace: plays at once now and then all stall until the
    podman timeout (120 s). /proc/locks showed one play holding storage.lock, layers.lock
    and userns.lock, sleeping between tries of another lock that a second play held while
    it waited for layers.lock. Ten plays of one gateway stalled so (tests/drills/
    neighbours.py), and so did two `mcp-forge apply` processes (CI, December 5): the lock
    is the storage's, not one runtime's, since every process of a user plays into one
    storage. A process killed mid-play releases it while its podman may still run.

    Restores (`podman container restore`) do not take it: a fork restores its copies side
    by side, and none has stalled so.
    """

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        """The lock file, its directory made at first use (not when a runtime is made)."""
        if self._path is None:
            self._path = self._where() / "podman-play.lock"
        return self._path

    def _where(self) -> Path:
        if os.geteuid() != 0:  # a user's own storage: their runtime directory, else the store's
            runtime = os.environ.get("XDG_RUNTIME_DIR")
            return Path(runtime) if runtime and os.path.isdir(runtime) else self._state_dir
        try:
            HOST_LOCKS.mkdir(mode=0o700, exist_ok=True)
            st = HOST_LOCKS.lstat()
        except OSError as exc:
            raise ForgeError(f"{HOST_LOCKS}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise ForgeError(
                f"{HOST_LOCKS} must be a directory of root's that no one else may write"
            )
        return HOST_LOCKS

    def __call__(self) -> contextlib.AbstractAsyncContextManager[None]:
        return held(self.path)
