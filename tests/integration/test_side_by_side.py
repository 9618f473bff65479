"""Local sessions side by side: a sharedGroup's volume and user namespace, and the host's
one `podman kube play` at a time (locks.PodmanPlays), which every process of root takes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from mcp_forge.clients import podman, podman_locks
from mcp_forge.control.render import podman_pod_name
from mcp_forge.errors import SessionNotFound
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = pytest.mark.podman

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


async def test_sessions_of_one_shared_group_share_a_volume(gateway, make_session) -> None:
    a = await make_session(sharedGroup="team")
    b = await make_session(sharedGroup="team")
    c = await make_session()
    await gateway.execute(a, "open('/shared/hello.txt', 'w').write('from a')")
    assert (
        await gateway.execute(b, "print(open('/shared/hello.txt').read())")
    ).stdout == "from a\n"
    r = await gateway.execute(c, "import os; print(os.path.exists('/shared'))")
    assert r.stdout == "False\n"


async def test_sessions_of_a_new_group_started_at_once_share_one_user_namespace(
    gateway, runtime, settings, images
) -> None:
    """Two processes apply a session of a new group at the same moment: neither may miss
    the other's namespace (the group's lookup and the claim of a new range are one
    transaction of the store), so both end in one user namespace and each can write what
    the other made in /shared."""
    names = [f"t-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(settings.state_dir)}
    cli = str(Path(sys.executable).parent / "mcp-forge")
    try:
        procs = [
            await asyncio.create_subprocess_exec(
                cli, "apply", "-f", "-", stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            for _ in names
        ]
        docs = [
            yaml.safe_dump(
                {
                    "apiVersion": "mcpforge.dev/v1alpha1",
                    "kind": "KernelSession",
                    "metadata": {"name": name},
                    "spec": {"image": images["minimal"], "sharedGroup": "crew"},
                }
            ).encode()
            for name in names
        ]
        results = await asyncio.gather(
            *(p.communicate(d) for p, d in zip(procs, docs, strict=True))
        )
        assert [p.returncode for p in procs] == [0, 0], results
        a, b = names
        ids = [runtime.kernel_ids(await runtime.get(n)) for n in names]
        assert ids[0] == ids[1], ids
        await gateway.execute(a, "open('/shared/from-a.txt', 'w').write('a')")
        r = await gateway.execute(b, "open('/shared/from-a.txt', 'a').write('b'); print('ok')")
        assert r.stdout == "ok\n", r
        assert (
            await gateway.execute(a, "print(open('/shared/from-a.txt').read())")
        ).stdout == "ab\n"
    finally:
        for name in names:
            with contextlib.suppress(SessionNotFound):
                await runtime.delete(name)


HOLD_RECORD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


async def hold(script: str, path: Path) -> asyncio.subprocess.Process:
    """A process holding the lock at `path` until its stdin closes."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None
    async with asyncio.timeout(10):
        assert await holder.stdout.readline() == b"held\n"
    return holder


def session_body(name: str, image: str) -> dict[str, object]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {"image": image},
    }


async def test_a_play_waits_for_another_process_s_play_of_any_store(
    runtime, settings, images, tmp_path
) -> None:
    """Two podman plays at once can stall each other for good (locks.PodmanPlays): a play
    waits while any other process of this host plays, whatever its store."""
    other = LocalRuntime(dataclasses.replace(settings, state_dir=tmp_path / "state"))
    assert other._playing.path == runtime._playing.path
    holder = await hold(HOLD, runtime._playing.path)
    name = f"t-{uuid.uuid4().hex[:10]}"
    body = session_body(name, images["minimal"])
    try:
        assert holder.stdin is not None
        applying = asyncio.create_task(runtime.apply(body))
        done, _ = await asyncio.wait({applying}, timeout=2)
        assert not done, "the play did not wait for the other process"
        assert (await runtime.get(name)).status.get("phase") in ("Pending", "Starting")
        pod = podman_pod_name("default", name)
        assert (await podman.run("pod", "exists", pod, check=False)).returncode == 1
        holder.stdin.close()
        async with asyncio.timeout(90):
            await applying
        assert (await runtime.get(name)).status.get("phase") == "Ready"
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)


async def test_a_play_that_stalls_in_podman_s_store_names_the_holder_and_plays_again(
    runtime, settings, images, tmp_path
) -> None:
    """Podman 4.3.1 now and then stalls in its store with the store's locks held (its
    issue 16062); a play then waited its whole timeout and the session failed (CI,
    December 6). Here a process of the test holds the store's storage.lock while the
    play runs: the play's timeout names that process, and once it lets go the play is
    made again and the session is Ready."""
    other = LocalRuntime(dataclasses.replace(settings, state_dir=tmp_path / "s", podman_timeout=8))
    name = f"t-{uuid.uuid4().hex[:10]}"
    body = session_body(name, images["minimal"])
    said: list[str] = []
    stalled, playing, store_held = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if "no answer in" in said[-1]:
                stalled.set()

    plays = other._playing

    @contextlib.asynccontextmanager
    async def play_when_the_store_is_held() -> AsyncIterator[None]:
        # Past the image check and mounts, the calls that would stall before the play.
        playing.set()
        await store_held.wait()
        async with plays():
            yield

    other._playing = play_when_the_store_is_held  # type: ignore[assignment]
    heard = Heard(logging.WARNING)
    logging.getLogger("mcp_forge").addHandler(heard)
    store: asyncio.subprocess.Process | None = None
    try:
        applying = asyncio.create_task(other.apply(body))
        async with asyncio.timeout(30):
            await playing.wait()
        store = await hold(HOLD_RECORD, podman_locks.graph_root() / "storage.lock")
        store_held.set()
        async with asyncio.timeout(30):
            await stalled.wait()
        assert store.stdin is not None
        store.stdin.close()
        async with asyncio.timeout(90):
            await applying
        assert (await other.get(name)).status.get("phase") == "Ready"
        stall = next(line for line in said if "no answer in" in line)
        assert f"storage.lock held by {store.pid} " in stall, said
        assert f"{name}: podman kube play stalled; playing once more" in said, said
    finally:
        logging.getLogger("mcp_forge").removeHandler(heard)
        if store is not None:
            if store.returncode is None:
                store.kill()
            await store.wait()
        with contextlib.suppress(SessionNotFound):
            await other.delete(name)
