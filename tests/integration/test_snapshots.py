"""Live snapshots of a kernel's container (runtimes/local/snapshots.py), with the CRIU that
images/criu/build makes: restored in its own pod's user namespace, and in another pod's.

The process keeps in memory a token it drew at start and a counter it prints with it
every 50 ms: a restored process prints the same token and counts on from where it was; a
process started again would draw a new token and count from 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from mcp_forge.clients import podman
from mcp_forge.runtimes.local import snapshots, userns
from mcp_forge.runtimes.local.kernelpods import userns_flag

pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

COUNTER = (
    "import os, time\n"
    "token = os.urandom(8).hex()\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    "    print(token, n, flush=True)\n"
    "    time.sleep(0.05)\n"
)
SHOWN = 30.0  # seconds for a line to show


def idmap() -> dict[str, int]:
    """A range of host ids far above any session's (they take the lowest free ones)."""
    first = 2147483647 + userns.SIZE * random.randint(20_000, 30_000)
    return {"uid": first, "gid": first, "size": userns.SIZE}


@contextlib.asynccontextmanager
async def pod(image: str, ids: dict[str, int], *, kernel: bool) -> AsyncIterator[str]:
    """A kube-played pod in its own user namespace, as a session's is: a keeper that
    holds it up, and (with `kernel`) the counter as container "<pod>-kernel"."""
    name = f"snap-{uuid.uuid4().hex[:8]}"
    user = {"runAsUser": 1000, "runAsGroup": 1000}
    keeper = {"name": "keeper", "image": image, "command": ["sleep", "infinity"]}
    containers = [{**keeper, "securityContext": user}]
    if kernel:
        counter = {"name": "kernel", "image": image, "command": ["python3", "-c", COUNTER]}
        containers.append({**counter, "securityContext": user})
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": containers},
    }
    await podman.run(
        "kube", "play", "--network=none", userns_flag(ids), "-",
        input=yaml.safe_dump(body).encode(),
    )  # fmt: skip
    try:
        yield name
    finally:
        await podman.remove_pod(name)


async def counted(container: str, after: int = 0) -> tuple[str, int]:
    """(token, count) of the first line `container` prints with a count above `after`."""
    proc = await asyncio.create_subprocess_exec(
        "podman", "logs", "-f", container, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(SHOWN):
            while line := await proc.stdout.readline():
                token, n = line.decode().split()
                if int(n) > after:
                    return token, int(n)
    finally:
        proc.kill()
        await proc.wait()
    raise AssertionError(f"{container} ended without counting past {after}")


async def namespace_of(container: str) -> tuple[int, int]:
    """(inode of its user namespace, host uid of its process)."""
    found = await podman.run_json("container", "inspect", container)
    pid = found[0]["State"]["Pid"]
    return os.stat(f"/proc/{pid}/ns/user").st_ino, os.stat(f"/proc/{pid}").st_uid


async def infra_namespace(pod_name: str) -> int:
    target = await snapshots.target_of(pod_name, {"uid": 0, "gid": 0, "size": 0})
    return os.stat(f"/proc/{target.infra_pid}/ns/user").st_ino


async def test_a_kernel_restored_in_its_pod_counts_on_in_the_pods_user_namespace(
    images: dict[str, str], tmp_path: Path
) -> None:
    ids = idmap()
    async with pod(images["minimal"], ids, kernel=True) as name:
        kernel = f"{name}-kernel"
        token, _ = await counted(kernel, after=3)
        taken = await snapshots.take(kernel, tmp_path / "kernel.tar")
        assert taken.size > 0 and oct(taken.archive.stat().st_mode)[-3:] == "600"
        gone = await podman.run_json("container", "inspect", kernel)
        assert gone[0]["State"]["Status"] == "exited", gone[0]["State"]  # its memory freed
        last = int((await podman.run("logs", "--tail", "1", kernel)).stdout.split()[1])
        await podman.run("rm", kernel)

        to = await snapshots.target_of(name, ids)
        await snapshots.restore(taken.archive, to, kernel, limit=1 << 30)
        assert await counted(kernel, after=last) == (token, last + 1)
        userns_ino, uid = await namespace_of(kernel)
        assert userns_ino == await infra_namespace(name)
        assert uid == ids["uid"] + 1000


async def test_a_snapshot_retargeted_runs_in_another_pod_and_user_namespace(
    images: dict[str, str], tmp_path: Path
) -> None:
    """A fork: the archive of one pod's kernel, restored into a second pod with a user
    namespace of its own; the first goes on by itself."""
    first, second = idmap(), idmap()
    async with (
        pod(images["minimal"], first, kernel=True) as parent,
        pod(images["minimal"], second, kernel=False) as child,
    ):
        kernel = f"{parent}-kernel"
        token, before = await counted(kernel, after=3)
        taken = await snapshots.take(kernel, tmp_path / "parent.tar", leave_running=True)
        at = int((await podman.run("logs", "--tail", "1", kernel)).stdout.split()[1])

        to = await snapshots.target_of(child, second)
        forked = tmp_path / "child.tar"
        await snapshots.retarget(taken.archive, forked, to, limit=1 << 30)
        await snapshots.bring_back(forked, to, f"{child}-kernel")
        # It counts on from the snapshot's count (at most `at`), not from 1, and runs.
        got, n = await counted(f"{child}-kernel", after=before)
        assert got == token and n <= at + 1, (got, n, at)
        assert (await counted(f"{child}-kernel", after=at + 5))[0] == token
        userns_ino, uid = await namespace_of(f"{child}-kernel")
        assert userns_ino == await infra_namespace(child)
        assert uid == second["uid"] + 1000
        assert (await counted(kernel, after=at))[0] == token  # the parent goes on
