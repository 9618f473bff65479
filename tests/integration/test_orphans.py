"""Storage-only containers (runtimes/local/orphans.py): real ones, made the way Podman
4.3.1 makes them, removed by housekeeping and by a play only when a session of the
store owns their name, and never a buildah working container's or another store's."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients import podman
from mcp_forge.control.render import podman_pod_name
from mcp_forge.runtimes.local.orphans import kernel_container, remove_storage_only, storage_only
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings
from support import scratch_state_dir

pytestmark = pytest.mark.podman

TOOL_DEADLINE = 60.0  # seconds `podman rm` under strace, or buildah, may take (0.5 s here)


@pytest.fixture(scope="module")
def state_dir() -> Iterator[Path]:
    with scratch_state_dir("mfs-") as path:
        yield path


@pytest.fixture(scope="module")
def runtime(state_dir: Path, images: dict[str, str]) -> LocalRuntime:
    return LocalRuntime(Settings(state_dir=state_dir, kernel_ready_timeout=60))


@pytest.fixture
async def leftovers() -> AsyncIterator[list[str]]:
    """Ids of storage containers a test made, removed after it whatever became of them."""
    made: list[str] = []
    yield made
    for container_id in made:
        await podman.run("rm", "--storage", container_id, check=False)


async def run_tool(*argv: str) -> tuple[int, str]:
    """Run a program (in podman's working directory) to its end: its status and stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=podman.workdir(),
    )
    try:
        async with asyncio.timeout(TOOL_DEADLINE):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return int(proc.returncode or 0), err.decode(errors="replace")


async def held() -> dict[str, str]:
    """Name to id of every storage-only container Podman made."""
    return storage_only(await podman.run_json("ps", "-a", "--external", "--format", "json"))


async def make_storage_only(name: str, image: str, made: list[str]) -> str:
    """A storage-only container called `name`, made as Podman 4.3.1 leaves one when a
    removal cannot tear the storage down: `podman rm` under strace, which fails the
    removal of the container's artifacts directory (EPERM), so the record goes and the
    storage stays. Returns its id."""
    strace = shutil.which("strace")
    binary = podman.podman_binary()
    if strace is None or binary is None:
        pytest.fail("strace and podman are needed: sudo bash .ci/setup-tests")
    created = await podman.run("create", "--name", name, image)
    container_id = created.stdout.decode().strip()
    made.append(container_id)
    [info] = await podman.run_json("container", "inspect", container_id)
    userdata = str(info["StaticDir"])
    calls = "unlinkat,unlink,rmdir"
    # The artifacts directory by path, and by the descriptor of its parent.
    filters = ["-P", f"{userdata}/artifacts", "-P", userdata]
    traced = [strace, "-f", "-qq", "-o", "/dev/null", *filters, "-e", f"trace={calls}"]
    traced += ["-e", f"inject={calls}:error=EPERM", binary, "rm", container_id]
    _, err = await run_tool(*traced)
    assert "artifacts" in err, err  # the removal failed where it was made to
    assert (await held()).get(name) == container_id, "no storage-only container was made"
    return container_id


def session_body(image: str) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"so-{uuid.uuid4().hex[:8]}"},
        "spec": {"image": image, "operatingMode": "Suspended", "resources": {"memory": "512Mi"}},
    }


async def suspended(runtime: LocalRuntime, image: str) -> KernelSession:
    """A session of the store with no pod: its kernel container's name is the store's."""
    return (await runtime.apply(session_body(image))).session


@contextlib.asynccontextmanager
async def buildah_container(name: str, image: str) -> AsyncIterator[None]:
    """A buildah working container called `name` (Podman lists it as storage-only too)."""
    buildah = shutil.which("buildah")
    if buildah is None:
        pytest.fail("buildah is needed: sudo bash .ci/setup-tests")

    made, err = await run_tool(buildah, "from", "--name", name, image)
    assert made == 0, err
    try:
        yield
    finally:
        await run_tool(buildah, "rm", name)


async def test_housekeeping_removes_a_storage_only_kernel_container_of_its_own_sessions_only(
    runtime: LocalRuntime, images: dict[str, str], leftovers: list[str]
) -> None:
    image = images["minimal"]
    ours = kernel_container(await suspended(runtime, image))
    ours_id = await make_storage_only(ours, image, leftovers)
    # Named as another store's kernel container would be: no session of this store owns it.
    others = podman_pod_name("default", f"so-{uuid.uuid4().hex[:8]}") + "-kernel"
    others_id = await make_storage_only(others, image, leftovers)
    # A buildah working container named as the kernel container of a session of the store.
    tools = kernel_container(await suspended(runtime, image))
    async with buildah_container(tools, image):
        assert await remove_storage_only(runtime) == [ours]
        left = await held()
        assert ours not in left, "the session's storage-only container is still there"
        assert left.get(others) == others_id, "another store's container was removed"
        listed = await podman.run_json("ps", "-a", "--external", "--format", "json")
        assert any(c["Names"] == [tools] for c in listed), "buildah's container was removed"
    assert ours_id not in (await held()).values()


async def test_a_storage_only_container_waits_while_its_session_is_locked(
    runtime: LocalRuntime, images: dict[str, str], leftovers: list[str]
) -> None:
    session = await suspended(runtime, images["minimal"])
    name = kernel_container(session)
    container_id = await make_storage_only(name, images["minimal"], leftovers)
    # Held, as a play of the session's pod holds it: the container may be that play's.
    async with runtime.locked(session):
        assert await remove_storage_only(runtime) == []
        assert (await held()).get(name) == container_id
    assert await remove_storage_only(runtime) == [name]


async def test_a_play_that_finds_its_kernel_container_name_taken_frees_it_and_starts(
    runtime: LocalRuntime, images: dict[str, str], leftovers: list[str]
) -> None:
    body = session_body(images["minimal"])
    session = (await runtime.apply(body)).session
    container_id = await make_storage_only(kernel_container(session), images["minimal"], leftovers)
    body["spec"]["operatingMode"] = "Running"  # resumed: its pod is played
    try:
        resumed = (await runtime.apply(body)).session
        assert resumed.status.get("phase") == st.READY, resumed.status
        assert container_id not in (await held()).values()
    finally:
        await runtime.delete(session.name)
