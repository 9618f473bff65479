"""Local sessions suspended with their memory and resumed with it (runtimes/local/naps.py):
real kernels, real pods, the CRIU that images/criu/build makes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.clients import podman
from mcp_forge.control.render import CRIU_CONFIG
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.supervisor import supervise_once

pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

CLI = [str(Path(sys.executable).parent / "mcp-forge")]
STATE = """
import numpy as np, pandas as pd, threading, time
big = np.arange(25_000_000, dtype=np.float64)          # 200 MB
frame = pd.DataFrame({"a": range(1000), "b": [str(i) for i in range(1000)]})
def make_adder(k):
    return lambda v: v + k
add5 = make_adder(5)
note = open("/tmp/note.txt", "w+")
note.write("kept open")
note.flush()
ticks = []
def tick():
    while True:
        ticks.append(1)
        time.sleep(0.01)
worker = threading.Thread(target=tick, daemon=True)
worker.start()
"""
SEEN = """
import json
note.seek(0)
n = len(ticks)
time.sleep(0.05)
print(json.dumps({
    "sum": float(big.sum()), "rows": len(frame), "b999": frame.b[999], "add": add5(1),
    "note": note.read(), "alive": worker.is_alive(), "ticking": len(ticks) > n,
}))
"""
EXPECTED = {
    "sum": float(sum(range(25_000_000))),
    "rows": 1000,
    "b999": "999",
    "add": 6,
    "note": "kept open",
    "alive": True,
    "ticking": True,
}


def spec(images: dict[str, str], mode: str) -> dict[str, Any]:
    return {
        "image": images["default"],
        "resources": {"memory": "1Gi", "cpu": "1"},
        "operatingMode": mode,
    }


async def seen(gateway: Any, name: str) -> dict[str, Any]:
    result = await gateway.execute(name, SEEN)
    assert result.status == "ok", (result.error, result.stderr)
    return dict(json.loads(result.stdout))


async def suspend(runtime: Any, images: dict[str, str], name: str) -> dict[str, Any]:
    body = {"apiVersion": "mcpforge.dev/v1alpha1", "kind": "KernelSession"}
    await runtime.apply({**body, "metadata": {"name": name}, "spec": spec(images, "Suspended")})
    status = dict((await runtime.get(name)).status)
    assert (status["phase"], status["reason"]) == ("Suspended", "UserRequested"), status
    return status


async def resume(runtime: Any, images: dict[str, str], name: str) -> dict[str, Any]:
    body = {"apiVersion": "mcpforge.dev/v1alpha1", "kind": "KernelSession"}
    await runtime.apply({**body, "metadata": {"name": name}, "spec": spec(images, "Running")})
    return dict((await runtime.get(name)).status)


def damage(archive: Path) -> None:
    """Overwrite CRIU's record of the kernel's main task (core-<pid>.img) in the archive."""
    with tarfile.open(archive) as tar:
        core = next(m for m in tar.getmembers() if Path(m.name).name.startswith("core-"))
    with open(archive, "r+b") as f:
        f.seek(core.offset_data)
        f.write(b"\xff" * core.size)


def damage_images(folder: Path) -> None:
    """The same, in the images CRIU left in the kernel's container (kept in its pod)."""
    core = next(folder.glob("core-*.img"))
    core.write_bytes(b"\xff" * core.stat().st_size)


async def pod_exists(runtime: Any, name: str) -> bool:
    session = await runtime.get(name)
    done = await podman.run("pod", "exists", runtime.pod_name(session), check=False)
    return done.returncode == 0


async def container_id(name: str) -> str:
    found = await podman.run("container", "inspect", "--format", "{{.Id}}", name)
    return found.stdout.decode().strip()


async def kernel_state(runtime: Any, name: str) -> str:
    """The kernel container's state ("exited" while suspended in its pod), or "gone"."""
    session = await runtime.get(name)
    found = await podman.run(
        "container", "inspect", "--format", "{{.State.Status}}", runtime.container_name(session),
        check=False,
    )  # fmt: skip
    return found.stdout.decode().strip() if found.returncode == 0 else "gone"


@pytest.fixture(params=[True, False], ids=["in-pod", "archive"])
async def mode(request: pytest.FixtureRequest, runtime: Any, settings: Any) -> AsyncIterator[Any]:
    """(runtime, gateway) of either way to keep a snapshot (snapshot_in_pod), one store."""
    if request.param:
        yield runtime
        return
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    yield LocalRuntime(dataclasses.replace(settings, snapshot_in_pod=False))


async def test_variables_of_every_kind_survive_ten_suspends_and_resumes(
    runtime: Any, gateway: Any, make_session: Any, images: dict[str, str]
) -> None:
    name = await make_session("default", resources={"memory": "1Gi", "cpu": "1"})
    assert (await gateway.execute(name, STATE)).status == "ok"
    session = await runtime.get(name)
    kernel, keepers = session.status["kernelId"], set()
    userdata = (await runtime.kept_images(session)).parent  # Podman's, with CRIU's logs
    for cycle in range(10):
        status = await suspend(runtime, images, name)
        assert "its memory is kept" in status["message"], status
        assert status["snapshot"]["size"] > 200_000_000, status["snapshot"]
        assert status["snapshot"]["inPod"] is True, status["snapshot"]
        assert await kernel_state(runtime, name) == "exited", "its memory is free"
        keepers.add(await container_id(f"{runtime.pod_name(session)}-keeper"))
        status = await resume(runtime, images, name)
        assert status["phase"] == "Ready", status
        assert status["lastRestore"]["outcome"] == "Restored", status
        assert status["kernelId"] == kernel, "the same kernel, not a new one"
        assert await seen(gateway, name) == EXPECTED, f"cycle {cycle + 1}"
    # CRIU took our options (no network lock) at the checkpoint and at the restore.
    for log in ("dump.log", "restore.log"):
        assert f"Parsing config file {CRIU_CONFIG}\n" in (userdata / log).read_text(), log
    assert len(keepers) == 1, "the keeper stays in the pod, and the next suspend finds it"


async def test_a_damaged_snapshot_gives_a_fresh_kernel_that_says_its_variables_were_lost(
    mode: Any, make_session: Any, images: dict[str, str]
) -> None:
    runtime, gateway = mode, Gateway(mode, mode.settings)
    try:
        await damaged_snapshot_case(runtime, gateway, make_session, images)
    finally:
        await gateway.close()


async def damaged_snapshot_case(
    runtime: Any, gateway: Any, make_session: Any, images: dict[str, str]
) -> None:
    name = await make_session("default", resources={"memory": "1Gi", "cpu": "1"})
    assert (await gateway.execute(name, "x = 42")).status == "ok"
    status = await suspend(runtime, images, name)
    session = await runtime.get(name)
    archive = runtime._snapshot(session)
    if status["snapshot"]["inPod"]:
        damage_images(await runtime.kept_images(session))
    else:
        assert not await pod_exists(runtime, name), "no pod: its snapshot is an archive"
        held = archive.lstat()
        assert (held.st_uid, oct(held.st_mode)) == (0, "0o100600"), held
        damage(archive)

    status = await resume(runtime, images, name)
    assert status["phase"] == "Ready", status
    assert status["lastRestore"]["outcome"] == "Failed", status
    assert "its variables were lost" in status["message"], status["message"]
    assert "could not restore the kernel" in status["lastRestore"]["message"], status
    result = await gateway.execute(name, "print('x' in dir())")
    assert (result.status, result.stdout) == ("ok", "False\n")
    assert not archive.exists(), "a snapshot that failed is not tried again"


async def test_a_snapshot_is_roots_outside_every_mount_of_the_pod_and_goes_with_its_session(
    runtime: Any, gateway: Any, make_session: Any, images: dict[str, str]
) -> None:
    """The kernel cannot reach its own snapshot (docs/security.md): CRIU's images are
    root's, in a folder of root's (0600) that no pod mounts, gone with the session."""
    name = await make_session("default", resources={"memory": "1Gi", "cpu": "1"})
    session = await runtime.get(name)
    found = await podman.run_json("container", "inspect", runtime.container_name(session))
    sources = [Path(m["Source"]) for m in found[0]["Mounts"]]
    # What the kernel can do to what it can reach: links named as the archive, everywhere.
    plant = (
        "import os\n"
        "for d in ('/workspace', '/tmp', '/workspace/..'):\n"
        "    try: os.symlink('/etc/passwd', os.path.join(d, 'snapshot.tar'))\n"
        "    except OSError: pass\n"
    )
    assert (await gateway.execute(name, plant)).status == "ok"
    await suspend(runtime, images, name)
    images_at = await runtime.kept_images(session)
    held = images_at.lstat()  # CRIU's, in the kernel container's Podman directory
    assert (held.st_uid, oct(held.st_mode & 0o777)) == (0, "0o600"), held  # as Podman makes it
    assert all(p.lstat().st_uid == 0 for p in images_at.iterdir())
    assert not any(images_at.is_relative_to(s) for s in sources), (images_at, sources)
    await runtime.delete(name)
    assert not images_at.exists() and not runtime._snapshot(session).parent.exists()


async def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [*CLI, *args], env=env, capture_output=True, text=True
    )


async def test_mcp_forge_suspend_keeps_the_memory_and_the_next_use_or_resume_brings_it_back(
    runtime: Any, make_session: Any, cli_env: dict[str, str]
) -> None:
    """The CLI, a process of its own (no gateway holds the kernel): `suspend` now, used
    again by `exec` it resumes; `suspend` and `resume` again."""
    name = await make_session()
    assert (await cli("exec", name, "-c", "x = 6 * 7", env=cli_env)).returncode == 0
    done = await cli("suspend", name, env=cli_env)
    assert done.returncode == 0 and "MB kept" in done.stdout, (done.stdout, done.stderr)
    status = (await runtime.get(name)).status
    assert (status["phase"], status["reason"]) == ("Suspended", "Idle"), status
    again = await cli("exec", name, "-c", "print(x)", env=cli_env)
    assert (again.returncode, again.stdout) == (0, "42\n"), again.stderr
    assert (await cli("suspend", name, env=cli_env)).returncode == 0
    woke = await cli("resume", name, env=cli_env)
    assert woke.returncode == 0 and "restored with its memory" in woke.stdout, woke.stdout
    refused = await cli("resume", name, env=cli_env)  # Ready: nothing to resume
    assert refused.returncode == 1 and "only an idle" in refused.stderr, refused.stderr


async def test_a_snapshot_kept_past_its_age_is_dropped_and_the_session_says_so(
    runtime: Any, gateway: Any, make_session: Any, images: dict[str, str]
) -> None:
    name = await make_session()
    assert (await gateway.execute(name, "x = 1")).status == "ok"
    await runtime.nap(name)
    session = await runtime.get(name)
    assert await pod_exists(runtime, name) and await kernel_state(runtime, name) == "exited"
    old = {**session.status["snapshot"], "takenAt": "2000-01-01T00:00:00Z"}
    runtime.store.patch_status("default", name, {"snapshot": old})
    assert await supervise_once(runtime) == []  # nothing culled; the snapshot dropped
    status = (await runtime.get(name)).status
    assert not await pod_exists(runtime, name) and status.get("snapshot") is None, status
    assert status["lastRestore"]["outcome"] == "Discarded", status
    assert "its memory was dropped: kept longer than 604800s" in str(status["message"])
    assert (status["phase"], status["reason"]) == ("Suspended", "Idle")
    result = await gateway.execute(name, "print('x' in dir())")  # used again: a new kernel
    assert (result.status, result.stdout) == ("ok", "False\n")
