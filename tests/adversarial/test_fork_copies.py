"""Attacks on a fork's copies of a kernel's files (runtimes/local/forkfiles.py,
docs/security.md "Forks"): the host copies /workspace and /tmp of a kernel whose code is
hostile, as root would if nothing confined it.

The kernel plants, where it can write: links to a host file (by its host path, which it
may guess), a link to /, FIFOs (a copy that opened one would wait forever), a file it
made unreadable. The fork must be made, in bounded time; links stay links and are never
followed on the host; the host file keeps its owner, mode and contents, and appears in
none of the fork's files."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import forks
from mcp_forge.runtimes.local import forkfiles

pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

PLANT = """
import os
for root in ("/tmp", "/workspace"):
    os.symlink({canary!r}, f"{{root}}/canary-link")
    os.symlink("/", f"{{root}}/up")
    os.mkfifo(f"{{root}}/pipe")
    with open(f"{{root}}/locked", "w") as f:
        f.write("mine")
    os.chmod(f"{{root}}/locked", 0)
    os.makedirs(f"{{root}}/d/e", exist_ok=True)
    os.symlink("../../..", f"{{root}}/d/e/climb")
"""
LOOK = """
import os, stat
print(sorted(
    (root, os.readlink(f"{root}/canary-link"), stat.S_ISFIFO(os.lstat(f"{root}/pipe").st_mode),
     os.path.exists(f"{root}/canary-link"), os.readlink(f"{root}/d/e/climb"))
    for root in ("/tmp", "/workspace")
))
"""


def found_on_host(folder: Path, secret: bytes) -> list[str]:
    """Regular files below `folder` (never following a link) that hold `secret`."""
    hits = []
    for top, dirs, files, fd in os.fwalk(folder, follow_symlinks=False):
        for name in files:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd), "rb") as f:
                if secret in f.read(1_000_000):
                    hits.append(f"{top}/{name}")
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
    return hits


async def test_links_fifos_and_unreadable_files_planted_before_a_fork_are_copied_as_they_are(
    runtime: Any, gateway: Any, make_session: Any, canary: Path
) -> None:
    secret = canary.read_bytes()  # noqa: ASYNC240 (a small local file, once)
    before = canary.stat()  # noqa: ASYNC240
    name = await make_session()
    planted = await gateway.execute(name, PLANT.format(canary=str(canary)))
    assert planted.status == "ok", (planted.error, planted.stderr)
    parent = await runtime.get(name)
    body = forks.body(parent, forks.names(name, 1)[0], annotations={})
    async with asyncio.timeout(300):  # a copy that opened a FIFO would never end
        (child,) = await runtime.fork(name, "default", [body])
    try:
        assert child.status["lastRestore"]["outcome"] == "Restored", child.status
        seen = await gateway.execute(child.name, LOOK)
        assert seen.status == "ok", (seen.error, seen.stderr)
        expected = sorted(
            (root, str(canary), True, False, "../../..") for root in ("/tmp", "/workspace")
        )
        assert seen.stdout == f"{expected}\n", seen.stdout
        for where in (runtime.host_paths(child).tmp, runtime.host_paths(child).workspace):
            folder = Path(str(where))
            link = await asyncio.to_thread((folder / "canary-link").lstat)
            assert stat.S_ISLNK(link.st_mode), "a link copied as a link"
            assert not await asyncio.to_thread(found_on_host, folder, secret)
        after = canary.stat()  # noqa: ASYNC240
        assert (after.st_uid, after.st_gid, after.st_mode) == (
            before.st_uid,
            before.st_gid,
            before.st_mode,
        )
        assert canary.read_bytes() == secret  # noqa: ASYNC240
    finally:
        await runtime.delete(child.name)


SOURCE, TARGET = 3_000_000, 3_100_000  # two kernels' host ids, no account's


def folders(tmp_path: Path, canary: Path) -> tuple[Path, Path]:
    """A source kernel's /tmp holding data, a link to a root-only host file and a FIFO;
    an empty target kernel's /tmp."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    for folder, owner in ((src, SOURCE), (dst, TARGET)):
        folder.mkdir()
        os.chown(folder, owner, owner)
        folder.chmod(0o1770)
    tmp_path.chmod(0o755)
    canary.chmod(0o600)
    (src / "data").write_text("kernel data")
    os.chown(src / "data", SOURCE, SOURCE)
    (src / "canary-link").symlink_to(canary)
    os.mkfifo(src / "pipe")
    return src, dst


def copied_as_they_were(dst: Path, canary: Path) -> None:
    assert (dst / "data").stat().st_uid == TARGET and (dst / "data").read_text() == "kernel data"
    assert (dst / "canary-link").is_symlink() and os.readlink(dst / "canary-link") == str(canary)
    assert stat.S_ISFIFO((dst / "pipe").lstat().st_mode)
    assert not found_on_host(dst, canary.read_bytes())


async def test_the_tmp_copy_reads_as_one_kernel_and_writes_as_the_other(
    tmp_path: Path, canary: Path
) -> None:
    """copy_tmp itself, on host folders: a link to a root-only host file is copied as a
    link, a FIFO as a FIFO (never opened), and the copies belong to the target kernel."""
    src, dst = await asyncio.to_thread(folders, tmp_path, canary)
    async with asyncio.timeout(60):  # a FIFO opened would never end
        await forkfiles.copy_tmp(src, (SOURCE, SOURCE), dst, (TARGET, TARGET))
    await asyncio.to_thread(copied_as_they_were, dst, canary)
