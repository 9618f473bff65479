"""A session's lock (LocalRuntime.locked): a task waiting for it takes no thread of the
loop's default executor, which the lock's holder may need to get on.

Before: the wait was `asyncio.to_thread(flock)`. Ten sessions closed at once (each close
holding its lock, the supervisor then refreshing each under the same lock) filled the
executor's threads with waits, and every holder waited for a thread to unmount or
remove its directory: each close hung (tests/drills/neighbours.py)."""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mcp_forge.runtimes.local import locks
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def one_thread() -> AsyncIterator[None]:
    """The loop's default executor has one thread (a busy gateway's, all but one taken);
    then a new one as asyncio makes: the loop is the whole test session's, and later tests
    need a default executor that runs."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(executor)
    yield
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio"))
    executor.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def runtime_and_session(tmp_path: Path) -> tuple[LocalRuntime, Any]:
    state = tmp_path / "state"
    runtime = LocalRuntime(replace(Settings(), state_dir=state))
    session = SimpleNamespace(uid="0123456789abcdef", name="s-lock", namespace="default")
    runtime.lock_path(session).parent.mkdir(parents=True)  # type: ignore[arg-type]
    return runtime, session


async def test_a_task_waiting_in_this_process_leaves_the_holder_its_thread(
    one_thread: None, runtime_and_session: tuple[LocalRuntime, Any]
) -> None:
    runtime, session = runtime_and_session
    holding = asyncio.Event()
    order: list[str] = []

    async def holder() -> None:
        async with runtime.locked(session):
            holding.set()
            await asyncio.sleep(0.1)  # the waiter is waiting by now
            await asyncio.to_thread(order.append, "holder used a thread")

    async def waiter() -> None:
        await holding.wait()
        async with runtime.locked(session):
            order.append("waiter")

    async with asyncio.timeout(10):
        await asyncio.gather(holder(), waiter())
    assert order == ["holder used a thread", "waiter"]


async def test_a_wait_on_another_process_takes_no_executor_thread_and_may_be_cancelled(
    one_thread: None, runtime_and_session: tuple[LocalRuntime, Any]
) -> None:
    runtime, session = runtime_and_session
    path = runtime.lock_path(session)
    other = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # another process's, as flock sees it
    fcntl.flock(other, fcntl.LOCK_EX)
    got = asyncio.Event()

    async def waiter() -> None:
        async with runtime.locked(session):
            got.set()

    try:
        first = asyncio.create_task(waiter())
        await asyncio.sleep(0.1)
        assert not got.is_set()
        async with asyncio.timeout(5):  # the executor's one thread is free
            assert await asyncio.to_thread(lambda: 42) == 42
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.create_task(waiter())
        await asyncio.sleep(0.1)
        assert not got.is_set()
    finally:
        os.close(other)  # the other process lets go
    async with asyncio.timeout(5):
        await second
    assert got.is_set()
    # Nothing holds it now: the cancelled wait's late lock went with its descriptor.
    async with asyncio.timeout(5):
        while True:
            probe = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)
            finally:
                os.close(probe)


async def test_housekeeping_does_not_queue_behind_a_task_woken_for_the_lock(
    runtime_and_session: tuple[LocalRuntime, Any],
) -> None:
    """Just after a release, the task woken for the lock has not run yet: `locked()` says
    False, yet taking the lock would queue behind it. locked_if_free says busy at once."""
    runtime, session = runtime_and_session
    holding, order = asyncio.Event(), []
    lock = locks.in_process(runtime.lock_path(session))

    async def waiter() -> None:
        await holding.wait()
        async with runtime.locked(session):
            order.append("waiter")

    async def holder() -> bool:
        async with runtime.locked(session):
            holding.set()
            # asyncio has no event for "a task queued on this lock": each turn of the
            # loop looks, under the test's timeout.
            while not lock._waiters:  # noqa: ASYNC110
                await asyncio.sleep(0)
        assert not lock.locked()  # released, its next holder woken, not yet run
        async with runtime.locked_if_free(session) as mine:
            order.append(f"housekeeping: {mine}")
        return mine

    async with asyncio.timeout(10):
        mine, _ = await asyncio.gather(holder(), waiter())
    assert mine is False
    assert order == ["housekeeping: False", "waiter"]
