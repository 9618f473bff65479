"""A fork's files: copies of its parent's /workspace and /tmp, given to the fork's user
namespace (issue 27; used by forks.py).

The workspace is a filesystem in an image file (volumes.py): it is copied whole, at the
block level, while the parent's filesystem is frozen (`fsfreeze`: its dirty pages
written out, its writers held until it thaws), so each copy is the filesystem as it was
at one instant, right after the kernel's memory was taken. Nothing of it is read as
files on the host: the copy's owner is changed to the fork's kernel when it is mounted
(volumes.give, by directory descriptors, never following a link), as for a workspace
kept from another session.

/tmp is a tmpfs (memory): it is copied as files, by two tar processes joined by a pipe,
each confined (confine.py) as the kernel whose files it touches: the reader as the
parent's kernel (it reads what that kernel could, nothing else of the host), the writer
as the fork's (it writes only into the fork's /tmp, a tmpfs of the same bound). Links
are copied as links, never followed; FIFOs and sockets are not opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from mcp_forge import confine
from mcp_forge.clients import podman
from mcp_forge.runtimes.local.volumes import TMP_SIZE, VolumeError, run_tool

log = logging.getLogger(__name__)

COPY_TIMEOUT = 300.0  # one workspace image, or one /tmp
MARK = "forking"  # in a session's folder while a fork of it has its kernel paused
TAR_LIMITS = confine.Limits(memory=512 * 2**20, cpu_seconds=120, file_size=TMP_SIZE)


@contextlib.asynccontextmanager
async def paused(container: str, folder: Path) -> AsyncIterator[None]:
    """The kernel `container` paused while the body runs (its files stay as its memory
    was taken), and running again after, whatever happens. A mark in the session's
    `folder` names this process, so that a pass of another (`release_left`) lets the
    kernel go, and thaws its workspace, if this one dies meanwhile."""
    mark = folder / MARK
    text = json.dumps({"pid": os.getpid(), "container": container})
    await asyncio.to_thread(mark.write_text, text)
    try:
        await podman.run("pause", container)
        try:
            yield
        finally:
            await asyncio.shield(podman.run("unpause", container, check=False))
    finally:
        await asyncio.to_thread(mark.unlink, True)


@contextlib.asynccontextmanager
async def frozen(mount: Path) -> AsyncIterator[None]:
    """The filesystem mounted at `mount` frozen (written out, its writers held) while
    the body runs; thawed after, whatever happens (a freeze cut short included)."""
    try:
        await run_tool("fsfreeze", "--freeze", str(mount))
        yield
    finally:
        await asyncio.shield(thaw(mount))


async def thaw(mount: Path) -> None:
    """Thaw the filesystem at `mount` if it is frozen (one that is not: nothing)."""
    try:
        await run_tool("fsfreeze", "--unfreeze", str(mount))
    except VolumeError as exc:
        if "Invalid argument" not in str(exc):  # not frozen
            log.warning("could not thaw %s: %s", mount, exc)


async def release_left(sessions: Path, stale: float) -> None:
    """Kernels a fork of a dead process left paused, and their workspaces frozen: let
    go (the marks of `paused` below `sessions` whose process is gone, or older than
    `stale` seconds)."""
    for mark in await asyncio.to_thread(lambda: list(sessions.glob(f"*/{MARK}"))):
        try:
            found = json.loads(await asyncio.to_thread(mark.read_text))
            age = time.time() - (await asyncio.to_thread(mark.stat)).st_mtime
        except (OSError, ValueError):
            continue
        if _alive(int(found.get("pid", 0))) and age < stale:
            continue  # a fork under way
        log.warning("a fork of a process that is gone left %s paused: letting it go", mark.parent)
        await thaw(mark.parent / "workspace")
        await podman.run("unpause", str(found.get("container", "")), check=False)
        await asyncio.to_thread(mark.unlink, True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_older(folder: Path, cutoff: float) -> None:
    """Remove the files in `folder` last changed before `cutoff` (a time)."""
    for path in folder.glob("*") if folder.is_dir() else []:
        with contextlib.suppress(OSError):
            if path.lstat().st_mtime < cutoff:
                path.unlink()


async def copy_image(image: Path, to: Path) -> None:
    """Copy the (frozen, or unmounted) workspace image `image` to `to`, its holes kept."""
    part = to.with_name(to.name + ".part")
    try:
        await run_tool(
            "cp", "--sparse=always", "--reflink=auto", str(image), str(part), timeout=COPY_TIMEOUT
        )
    except BaseException:
        await asyncio.to_thread(part.unlink, True)
        raise
    await asyncio.to_thread(os.replace, part, to)


async def copy_tmp(
    src: Path, src_ids: tuple[int, int], dst: Path, dst_ids: tuple[int, int]
) -> None:
    """Copy the files of the /tmp mounted at `src` (the kernel of host ids `src_ids`)
    into the one mounted at `dst` (the kernel of `dst_ids`), as the module's text says."""
    reader = confine.command(
        ["tar", "--one-file-system", "--sparse", "-C", str(src), "-cf", "-", "."],
        readable=[src], user=src_ids, limits=TAR_LIMITS, what="copying a kernel's /tmp",
    )  # fmt: skip
    writer = confine.command(
        ["tar", "-C", str(dst), "-xpf", "-", "--no-same-owner", "--no-overwrite-dir"],
        writable=[dst], user=dst_ids, limits=TAR_LIMITS, what="copying a kernel's /tmp",
    )  # fmt: skip
    read_end, write_end = os.pipe()
    try:
        made = await _start(reader, stdout=write_end), await _start(writer, stdin=read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    try:
        async with asyncio.timeout(COPY_TIMEOUT):
            said = await asyncio.gather(*(p.communicate() for p in made))
    finally:
        for proc in made:
            await confine.reap(proc, "copying a kernel's /tmp")
    (_, read_err), (_, write_err) = said
    if made[0].returncode not in (0, 1, 2):  # 1, 2: some file changed or could not be read
        raise VolumeError(f"reading /tmp failed ({made[0].returncode}): {_said(read_err)}")
    if made[0].returncode:
        log.warning("copying /tmp for a fork: %s", _said(read_err))
    if made[1].returncode:
        raise VolumeError(f"writing /tmp failed ({made[1].returncode}): {_said(write_err)}")


async def _start(
    argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=stdout if stdout is not None else asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


def _said(err: bytes | None) -> str:
    return (err or b"").decode(errors="replace").strip()[-500:]
