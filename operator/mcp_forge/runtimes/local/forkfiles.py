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
import logging
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from mcp_forge import confine
from mcp_forge.runtimes.local.volumes import TMP_SIZE, VolumeError, run_tool

log = logging.getLogger(__name__)

COPY_TIMEOUT = 300.0  # one workspace image, or one /tmp
TAR_LIMITS = confine.Limits(memory=512 * 2**20, cpu_seconds=120, file_size=TMP_SIZE)


@contextlib.asynccontextmanager
async def frozen(mount: Path) -> AsyncIterator[None]:
    """The filesystem mounted at `mount` frozen (written out, its writers held) while
    the body runs; thawed after, whatever happens."""
    await run_tool("fsfreeze", "--freeze", str(mount))
    try:
        yield
    finally:
        await asyncio.shield(run_tool("fsfreeze", "--unfreeze", str(mount)))


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
        ["tar", "--one-file-system", "-C", str(src), "-cf", "-", "."],
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
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
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
