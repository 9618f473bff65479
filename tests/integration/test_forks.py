"""Forks of a local session (runtimes/local/forks.py): new sessions made from a live
kernel's snapshot, each with its parent's variables and files, its own key, user
namespace and environment. Real kernels, real pods, the CRIU images/criu/build makes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import forks
from mcp_forge.api.connection import ConnectionInfo
from mcp_forge.clients import podman
from mcp_forge.errors import ForgeError, SessionNotFound, SessionNotReady
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.local import forkfiles

CLI = [str(Path(sys.executable).parent / "mcp-forge")]
pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

STATE = """
import numpy as np, os, threading, time
big = np.arange(5_000_000, dtype=np.float64)          # 40 MB
def make_adder(k):
    return lambda v: v + k
add5 = make_adder(5)
os.makedirs("/workspace/data", exist_ok=True)
with open("/workspace/data/rows.csv", "w") as f:
    f.write("a,b\\n1,2\\n")
log = open("/workspace/log.txt", "a+")
log.write("parent\\n"); log.flush()
scratch = open("/tmp/scratch.txt", "w+")
scratch.write("in tmp"); scratch.flush()
ticks = []
def tick():
    while True:
        ticks.append(1)
        time.sleep(0.01)
worker = threading.Thread(target=tick, daemon=True)
worker.start()
"""
SEEN = """
import json, os
scratch.seek(0)
n = len(ticks)
time.sleep(0.05)
print(json.dumps({
    "sum": float(big.sum()), "add": add5(1), "rows": open("/workspace/data/rows.csv").read(),
    "scratch": scratch.read(), "ticking": len(ticks) > n, "who": who,
    "token": os.environ.get("TOKEN"), "mode": os.environ.get("MODE"),
    "session": os.environ.get("MCPFORGE_SESSION"),
}))
"""


def fork_bodies(parent: Any, count: int, env: dict[str, str] | None = None) -> list[Any]:
    return [
        forks.body(parent, name, annotations={}, env=env)
        for name in forks.names(parent.name, count)
    ]


async def seen(gateway: Any, name: str) -> dict[str, Any]:
    result = await gateway.execute(name, SEEN)
    assert result.status == "ok", (result.error, result.stderr)
    return dict(json.loads(result.stdout))


async def kernel_process(runtime: Any, session: Any) -> tuple[int, int]:
    """(inode of the kernel's user namespace, its host uid)."""
    found = await podman.run_json("container", "inspect", runtime.container_name(session))
    pid = found[0]["State"]["Pid"]
    return os.stat(f"/proc/{pid}/ns/user").st_ino, os.stat(f"/proc/{pid}").st_uid


async def test_a_fork_of_three_answers_with_the_parents_values_then_each_goes_its_own_way(
    runtime: Any, gateway: Any, make_session: Any
) -> None:
    env = [{"name": "TOKEN", "value": "parents"}, {"name": "MODE", "value": "a"}]
    parent = await make_session("default", resources={"memory": "1Gi", "cpu": "1"}, env=env)
    assert (await gateway.execute(parent, STATE + "who = 'parent'")).status == "ok"
    before = await seen(gateway, parent)

    session = await runtime.get(parent)
    made = await runtime.fork(parent, "default", fork_bodies(session, 3, env={"MODE": "b"}))
    try:
        assert len(made) == 3
        for child in made:
            status = child.status
            assert status["phase"] == "Ready", status
            assert status["lastRestore"]["outcome"] == "Restored", status
            assert child.body["metadata"]["annotations"][forks.FORKED_FROM] == parent
            got = await seen(gateway, child.name)
            # The parent's memory and files; the fork's own environment.
            assert got == {**before, "token": None, "mode": "b", "session": child.name}, got
            assert not (await gateway.execute(child.name, "1")).stderr, "history works on"
        # Each goes its own way: a variable set in one is in no other, nor in the parent.
        for i, child in enumerate(made):
            assert (await gateway.execute(child.name, f"who = 'fork {i}'")).status == "ok"
            log = "log.write('fork'); log.flush(); print(open('/workspace/log.txt').read(), end='')"
            done = await gateway.execute(child.name, log)
            assert done.stdout == "parent\nfork", done.stdout
        for i, child in enumerate(made):
            assert (await seen(gateway, child.name))["who"] == f"fork {i}"
        assert (await seen(gateway, parent)) == before
        done = await gateway.execute(parent, "print(open('/workspace/log.txt').read(), end='')")
        assert done.stdout == "parent\n", "a fork's files are its own"

        # Its own user namespace and key: the parent's key gets no answer from a fork.
        spaces = {await kernel_process(runtime, await runtime.get(n)) for n in [parent]}
        for child in made:
            spaces.add(await kernel_process(runtime, child))
            keys = {runtime.store.key("default", n) for n in (parent, child.name)}
            assert len(keys) == 2
            info = ConnectionInfo(
                "ipc",
                runtime.host_paths(child).run + "/kernel",
                runtime.store.key("default", parent),
            )
            conn = KernelConnection(info, max_frame=100_000, max_message=100_000)
            try:
                with pytest.raises(SessionNotReady):
                    await conn.wait_ready(3)
            finally:
                conn.close()
        assert len({ino for ino, _ in spaces}) == 4, spaces
        assert len({uid for _, uid in spaces}) == 4, spaces
    finally:
        for child in made:
            await runtime.delete(child.name)
    for child in made:
        with pytest.raises(SessionNotFound):
            await runtime.get(child.name)
        assert not await asyncio.to_thread(Path(runtime._dir(child)).exists)


async def test_mcp_forge_fork_copies_a_session_and_refuses_what_it_cannot(
    runtime: Any, make_session: Any, cli_env: dict[str, str]
) -> None:
    """The CLI, a process of its own: `fork --name` makes the copies named, each with the
    variables; a name taken, or a session that is not Ready, is refused with nothing made."""
    name = await make_session()
    assert (await cli("exec", name, "-c", "x = 6 * 7", env=cli_env)).returncode == 0
    copies = [f"{name}-a", f"{name}-b"]
    try:
        done = await cli("fork", name, "--name", copies[0], "--name", copies[1], env=cli_env)
        assert done.returncode == 0, done.stderr
        assert all(f"kernelsession/{c} forked from {name}" in done.stdout for c in copies)
        for copy in copies:
            seen = await cli("exec", copy, "-c", "print(x)", env=cli_env)
            assert (seen.returncode, seen.stdout) == (0, "42\n"), seen.stderr
        before = {s.name for s in await runtime.list()}
        taken = await cli("fork", name, "--name", copies[0], env=cli_env)
        assert taken.returncode != 0 and "exists already" in taken.stderr, taken.stderr
        assert (await cli("suspend", name, env=cli_env)).returncode == 0
        asleep = await cli("fork", name, env=cli_env)
        assert asleep.returncode != 0 and "only a Ready one forks" in asleep.stderr, asleep.stderr
        assert {s.name for s in await runtime.list()} == before, "nothing made"
    finally:
        for copy in copies:
            with contextlib.suppress(SessionNotFound):
                await runtime.delete(copy)


async def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [*CLI, *args], env=env, capture_output=True, text=True
    )


async def test_a_fork_that_fails_leaves_no_session_archive_or_paused_kernel(
    runtime: Any, gateway: Any, make_session: Any, settings: Any
) -> None:
    """The checkpoint is over MCPFORGE_SNAPSHOT_MAX: the fork fails saying so, and the
    sessions it had made, its archive and its hold on the parent are gone."""
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    small = LocalRuntime(dataclasses.replace(settings, snapshot_max=1))
    small.releasers = runtime.releasers  # the gateway's, told to let go of the kernel
    name = await make_session()
    assert (await gateway.execute(name, "x = 1")).status == "ok"
    before = {s.name for s in await runtime.list()}
    parent = await runtime.get(name)
    with pytest.raises(ForgeError, match="over the 1 a snapshot may take"):
        await small.fork(name, "default", fork_bodies(parent, 2))
    assert {s.name for s in await runtime.list()} == before
    assert not await asyncio.to_thread(lambda: list((settings.state_dir / "forks").glob("*")))
    done = await gateway.execute(name, "open('/workspace/after', 'w').write('x'); print(x)")
    assert (done.status, done.stdout) == ("ok", "1\n"), "the parent runs on, its files writable"


async def test_what_a_dead_process_left_mid_fork_is_let_go_by_the_next_pass(
    runtime: Any, gateway: Any, make_session: Any
) -> None:
    """A process died with the parent's kernel paused and its workspace frozen, and a
    copy still Pending: the supervisor's pass lets the kernel go, thaws the workspace and
    removes the copy."""
    name = await make_session()
    parent = await runtime.get(name)
    folder = runtime._dir(parent)
    workspace = Path(runtime.host_paths(parent).workspace)
    await podman.run("pause", runtime.container_name(parent))
    await forkfiles.run_tool("fsfreeze", "--freeze", str(workspace))
    gone = json.dumps({"pid": 2**22 + 1, "container": runtime.container_name(parent)})
    await asyncio.to_thread((folder / forkfiles.MARK).write_text, gone)
    (body,) = fork_bodies(parent, 1)
    child = runtime._new_row(body)
    old = {**child.body["metadata"], "creationTimestamp": "2000-01-01T00:00:00Z"}
    runtime.store.replace({**runtime.store.get("default", child.name), "metadata": old})

    assert await runtime.clean_forks() == [child.name]
    with pytest.raises(SessionNotFound):
        await runtime.get(child.name)
    assert not await asyncio.to_thread((folder / forkfiles.MARK).exists)
    done = await gateway.execute(name, "open('/workspace/thawed', 'w').write('x'); print('ok')")
    assert (done.status, done.stdout) == ("ok", "ok\n")
