"""A local session's own filesystems: a bounded /workspace and an in-memory /tmp.

On a cluster the kubelet bounds both (an emptyDir with a sizeLimit, a Memory emptyDir).
Locally a directory on the host's disk would let a kernel fill that disk, so each
session gets:

- /workspace: an ext4 filesystem in a sparse image file (k/<id>/workspace.img), loop
  mounted at k/<id>/workspace. Its size is spec.workspace.size, its inodes are bounded
  in proportion, and it is kept across kernel and gateway restarts; after a host reboot
  it is mounted again before the kernel starts. The image costs the host's disk only
  what the kernel wrote, and never more than the size.
- /tmp: a tmpfs of TMP_SIZE at k/<id>/tmp. Its pages are charged to the memory cgroup
  of the process that writes them, the kernel's: /tmp counts against spec.resources.memory.

A workspace made before volumes existed (a plain directory) is moved into its volume
when it fits; when it does not, the directory is kept, with a warning, and nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from mcp_forge import confine
from mcp_forge.errors import ForgeError, redact

log = logging.getLogger(__name__)

TMP_SIZE = 256 * 2**20  # as the cluster's Memory emptyDir for /tmp (render.py)
TMP_INODES = 16384
BYTES_PER_INODE = 32768  # 32768 inodes per GiB of workspace
MIN_INODES = 1024
MOUNT_TIMEOUT = 60.0
MOUNT_OPTIONS = "nosuid,nodev"
UNMOUNT_LAYERS = 8  # mounts stacked on one mount point that unmount() takes off
TOOLS = ("mkfs.ext4", "mount", "umount", "losetup", "e2fsck", "resize2fs")


class VolumeError(ForgeError):
    """A session's filesystem could not be made, mounted or removed. str() reaches
    clients, without host paths; the whole message goes to the log."""

    def __init__(self, message: str) -> None:
        log.warning("%s", message[:2000])
        super().__init__(redact(message))


def workspace_inodes(size: int) -> int:
    """The inode bound of a workspace of `size` bytes."""
    return max(MIN_INODES, size // BYTES_PER_INODE)


def mounted(path: Path) -> str | None:
    """The filesystem type mounted exactly at `path` (the last mount wins), or None."""
    target = os.path.realpath(path)
    found = None
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        # id parent major:minor root mountpoint options [optional...] - fstype source super
        if len(fields) < 10 or _unescape(fields[4]) != target:
            continue
        try:
            found = fields[fields.index("-", 6) + 1]
        except (ValueError, IndexError):
            continue
    return found


def _unescape(field: str) -> str:
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


async def run_tool(*args: str, ok: tuple[int, ...] = (0,), timeout: float = MOUNT_TIMEOUT) -> str:
    """Run a host tool of ours (mount, mkfs, cp...) within `timeout`; its stdout.
    VolumeError naming it if it fails."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise VolumeError(f"{args[0]} could not run: {exc}") from None
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException:
        await confine.reap(proc, args[0])
        raise
    if proc.returncode not in ok:
        said = (err or out).decode(errors="replace").strip()[-500:]
        raise VolumeError(f"{' '.join(args[:2])} failed ({proc.returncode}): {said}")
    return out.decode(errors="replace")


async def ensure_workspace(image: Path, target: Path, size: int, uid: int, gid: int) -> None:
    """Make `target` the mount point of the session's workspace filesystem.

    Idempotent: a mounted workspace is left as it is, unless `size` grew (it is then
    unmounted, grown and mounted again, between two kernels); an image that exists (the
    host rebooted, the gateway restarted) is mounted again; otherwise a new one is made,
    and a plain workspace directory from before is moved into it.
    """
    plan = _workspace_plan(image, target)
    if plan == "mounted":
        if not _to_grow(image, size):
            return
        await unmount(target)  # grown offline: no kernel runs now (its pod is not made yet)
        plan = "mount"
    if plan in ("new", "migrate"):
        await asyncio.to_thread(_sparse_file, image.with_name(image.name + ".new"), size)
        await _make_image(image, size, uid, gid)
        if plan == "migrate" and not await _migrate(image, target, uid, gid):
            _give_up_volume(image, target, uid, gid)
            return
    elif plan == "stray":
        # Files written under the mount point while the volume was not mounted (it cannot
        # happen through a pod: one only starts once the volume is mounted). Keep them.
        log.warning("%s has files but its volume is not mounted: leaving it as it is", target)
        return
    if plan == "mount" and _to_grow(image, size):
        held = (await run_tool("losetup", "-j", str(image))).partition(":")[0].strip()
        if held:
            # Still mounted in another mount namespace (a process that outlived its pod):
            # never checked or resized in use, and mounted from the same device (one
            # filesystem, not a second copy of it); grown at a later start.
            log.warning("the workspace %s is still in use: it grows at its next start", image)
            _growing(image).touch()
            await run_tool("mount", "-o", MOUNT_OPTIONS, held, str(target))
            return
        await _grow(image, size)
    await run_tool("mount", "-o", f"loop,{MOUNT_OPTIONS}", str(image), str(target))
    _drop_lost_found(target)


def workspace_size(image: Path) -> int | None:
    """The size of the workspace's filesystem image (None: there is none)."""
    try:
        return image.stat().st_size
    except FileNotFoundError:
        return None


def _growing(image: Path) -> Path:
    return image.with_name(image.name + ".growing")


def _to_grow(image: Path, size: int) -> bool:
    """Whether the workspace's filesystem must grow to `size` (or finish growing)."""
    current = workspace_size(image)
    return current is not None and (size > current or _growing(image).exists())


async def _grow(image: Path, size: int) -> None:
    """Grow the (unmounted) workspace image and its filesystem to `size`; a smaller
    `size` changes nothing (the gateway refuses it before it gets here).

    Offline, as an online resize needs CAP_SYS_RESOURCE, which not every host's root has.
    A marker beside the image says a grow is under way until it is done, so one cut short
    (a crash, a failed resize2fs) is finished at the next mount."""
    growing = _growing(image)
    current = workspace_size(image) or 0
    growing.touch()
    if size > current:
        log.info("growing the workspace %s from %d to %d bytes", image, current, size)
        await asyncio.to_thread(os.truncate, image, size)  # sparse: costs nothing until written
    # resize2fs wants a checked filesystem; e2fsck's 1 is "errors corrected".
    await run_tool("e2fsck", "-f", "-p", str(image), ok=(0, 1))
    await run_tool("resize2fs", str(image))
    growing.unlink()


def _workspace_plan(image: Path, target: Path) -> str:
    target.mkdir(exist_ok=True)
    if mounted(target):
        return "mounted"
    empty = not any(target.iterdir())
    if not image.exists():
        return "new" if empty else "migrate"
    return "mount" if empty else "stray"


def _sparse_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:  # sparse: it costs the disk what is written into it
        f.truncate(size)


def _give_up_volume(image: Path, target: Path, uid: int, gid: int) -> None:
    image.unlink()
    os.chown(target, uid, gid)


def _drop_lost_found(target: Path) -> None:
    lost = target / "lost+found"  # mkfs's, root's: nothing the kernel may use or see
    if lost.is_dir() and not lost.is_symlink() and not any(lost.iterdir()):
        lost.rmdir()


async def _make_image(image: Path, size: int, uid: int, gid: int) -> None:
    partial = image.with_name(image.name + ".new")
    try:
        await run_tool(
            "mkfs.ext4",
            "-q",
            "-F",
            "-m",
            "0",
            "-N",
            str(workspace_inodes(size)),
            "-E",
            f"lazy_itable_init=1,lazy_journal_init=1,root_owner={uid}:{gid}",
            str(partial),
        )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, image)


async def _migrate(image: Path, target: Path, uid: int, gid: int) -> bool:
    """Move a plain workspace's files into the new volume; False if they do not fit."""
    staging = target.with_name(target.name + ".migrating")
    os.makedirs(staging, exist_ok=True)
    await run_tool("mount", "-o", f"loop,{MOUNT_OPTIONS}", str(image), str(staging))
    try:
        await asyncio.to_thread(_copy_tree, target, staging, uid, gid)
    except OSError as exc:
        log.warning(
            "the workspace %s does not fit its volume (%s): it stays a plain directory, "
            "without a size bound, until it is smaller",
            target,
            exc,
        )
        await run_tool("umount", str(staging))
        os.rmdir(staging)
        return False
    await run_tool("umount", str(staging))
    os.rmdir(staging)
    # Copied and on disk (umount wrote it all back): the plain directory can go.
    await asyncio.to_thread(_empty, target)
    return True


def _empty(target: Path) -> None:
    for child in list(target.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _copy_tree(source: Path, dest: Path, uid: int, gid: int) -> None:
    for root, dirs, files in os.walk(source):
        rel = Path(root).relative_to(source)
        for name in dirs:
            d = dest / rel / name
            if (Path(root) / name).is_symlink():
                os.symlink(os.readlink(Path(root) / name), d)
                os.lchown(d, uid, gid)
                continue
            d.mkdir()
            shutil.copystat(Path(root) / name, d)
            os.chown(d, uid, gid)
        for name in files:
            src, d = Path(root) / name, dest / rel / name
            if src.is_symlink():
                os.symlink(os.readlink(src), d)
            else:
                shutil.copy2(src, d, follow_symlinks=False)
            os.lchown(d, uid, gid)
        dirs[:] = [n for n in dirs if not (Path(root) / n).is_symlink()]


async def ensure_tmp(target: Path, uid: int, gid: int) -> None:
    """Mount the session's /tmp (a bounded tmpfs) at `target`, unless it is mounted."""
    os.makedirs(target, exist_ok=True)
    if mounted(target) == "tmpfs":
        return
    options = (
        f"size={TMP_SIZE},nr_inodes={TMP_INODES},mode=1770,uid={uid},gid={gid},{MOUNT_OPTIONS}"
    )
    await run_tool("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target))


def give(target: Path, uid: int, gid: int) -> None:
    """Make `target` the kernel's (uid, gid), and what in it its previous owner had (a
    workspace kept from a session with another user namespace): nothing else changes."""
    st = os.lstat(target)
    old = (st.st_uid, st.st_gid)
    os.chown(target, uid, gid)
    if old == (uid, gid) or old == (0, 0):
        return
    # By directory descriptors, never following a link: no path is looked up twice.
    for _root, dirs, files, fd in os.fwalk(target, follow_symlinks=False):
        for name in dirs + files:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            new_uid = uid if st.st_uid == old[0] else -1
            new_gid = gid if st.st_gid == old[1] else -1
            if (new_uid, new_gid) != (-1, -1):
                os.chown(name, new_uid, new_gid, dir_fd=fd, follow_symlinks=False)


async def unmount(target: Path) -> None:
    """Unmount whatever is mounted at `target` (all layers); the loop device goes with it."""
    for _ in range(UNMOUNT_LAYERS):
        if not mounted(target):
            return
        try:
            await run_tool("umount", str(target))
        except VolumeError:
            # Busy (a process that outlived its pod): detach now, freed when it lets go.
            await run_tool("umount", "-l", str(target))
    if mounted(target):
        raise VolumeError(f"{target} is still mounted after {UNMOUNT_LAYERS} unmounts")
