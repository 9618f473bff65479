"""Copies a parent's workspace into its fork's, in the fork's copy pod on a cluster
(control/forkfiles.py), with the image's Python: no tool of the image is needed but the
interpreter the kernel needs anyway.

Run as `python -I -S -c <source> FROM TO`: every entry of FROM but its root (the fork's
is its own) and ext4's lost+found (root's) is copied into TO, as cp -dR
--preserve=mode,timestamps,links --remove-destination would: contents, permission bits
and times, hard links within the tree as links; a symbolic link as a link (never
followed); a FIFO or a socket made anew (never opened); the owner the copier's, the
kernel's user. Every name is reached through its directory's descriptor, and nothing is
followed: a link planted anywhere in either tree is copied or replaced, never written
through. A regular file is opened without blocking and copied only if it is still one;
its holes stay holes (SEEK_DATA), so a sparse file takes no more room than it did. What
TO already holds where a copy goes (an earlier copy's) is replaced.

Errors are named on stderr, the copy goes on, and the exit status is 1 if there was one.
Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Any

SKIP_AT_ROOT = ("lost+found",)
ERRORS_SHOWN = 20
CHUNK = 1 << 30  # bytes per sendfile call
DEPTH_MAX = 200  # directories deep; deeper ones are not copied (an error names them)
LINKED_DIRS_MAX = 512  # directories held open to link copies in; past that, copies apart
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Copier:
    def __init__(self) -> None:
        self.errors = 0
        # (dev, ino) -> its copy, and how many of its other names are still to be seen
        self.linked: dict[tuple[int, int], tuple[int, str, int]] = {}
        self.kept: dict[tuple[int, int], int] = {}  # copies' directories held open, by id

    def failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= ERRORS_SHOWN:
            print(f"treecopy: {where}: {exc}", file=sys.stderr)

    def tree(self, src: int, dst: int, where: str, depth: int = 0) -> None:
        """Each entry of the directory `src` copied into the directory `dst`."""
        if depth > DEPTH_MAX:
            self.failed(where, OSError(errno.ELOOP, f"over {DEPTH_MAX} directories deep"))
            return
        try:
            names = sorted(os.listdir(src))
        except (OSError, MemoryError) as exc:
            self.failed(where, exc)
            return
        for name in names:
            if depth == 0 and name in SKIP_AT_ROOT:
                continue
            try:
                self.entry(src, dst, name, f"{where}/{name}", depth)
            except (OSError, RecursionError, MemoryError) as exc:
                self.failed(f"{where}/{name}", exc)

    def entry(self, src: int, dst: int, name: str, where: str, depth: int) -> None:
        info = os.stat(name, dir_fd=src, follow_symlinks=False)
        mode = info.st_mode
        if stat.S_ISDIR(mode):
            self.directory(src, dst, name, info, (where, depth + 1))
            return
        clear(dst, name)
        if stat.S_ISREG(mode) and info.st_nlink > 1 and self.link(info, dst, name):
            return  # hard links of other kinds (a FIFO's, a link's) are made apart
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        elif stat.S_ISREG(mode):
            self.file(src, dst, name, info)
            if info.st_nlink > 1:
                self.remember(info, dst, name)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(name, stat.S_IMODE(mode), dir_fd=dst)
        elif stat.S_ISSOCK(mode):
            os.mknod(name, stat.S_IFSOCK | stat.S_IMODE(mode), dir_fd=dst)
        else:  # a device: the copier may not make one
            raise OSError(errno.EPERM, "a device file is not copied")
        if not stat.S_ISREG(mode):
            times(dst, name, info)

    def link(self, info: os.stat_result, dst: int, name: str) -> bool:
        """A hard link to the copy of a file the tree holds under another name already
        (False: none, or it cannot be linked to, EMLINK say: then it is copied apart)."""
        key = (info.st_dev, info.st_ino)
        first = self.linked.get(key)
        if first is None:
            return False
        kept, copied, left = first
        if left <= 1:
            del self.linked[key]  # its last name: nothing is to be linked to it again
        else:
            self.linked[key] = (kept, copied, left - 1)
        try:
            os.link(copied, name, src_dir_fd=kept, dst_dir_fd=dst, follow_symlinks=False)
        except OSError:
            return False
        return True

    def remember(self, info: os.stat_result, dst: int, name: str) -> None:
        """The copy of a file with other names, for them to be linked to (`link`)."""
        here = os.fstat(dst)
        kept = self.kept.get((here.st_dev, here.st_ino))
        if kept is None:
            if len(self.kept) >= LINKED_DIRS_MAX:
                return
            kept = self.kept[(here.st_dev, here.st_ino)] = os.dup(dst)
        self.linked[(info.st_dev, info.st_ino)] = (kept, name, info.st_nlink - 1)

    def directory(
        self, src: int, dst: int, name: str, info: os.stat_result, at: tuple[str, int]
    ) -> None:
        try:
            have = os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            have = None
        if have is not None and not stat.S_ISDIR(have.st_mode):
            os.unlink(name, dir_fd=dst)
            have = None
        if have is None:
            os.mkdir(name, 0o700, dir_fd=dst)
        inner = os.open(name, OPEN_DIR, dir_fd=src)
        try:
            into = os.open(name, OPEN_DIR, dir_fd=dst)
            try:
                os.chmod(into, 0o700)  # an earlier copy's may be 0500: its mode comes last
                self.tree(inner, into, *at)
                os.chmod(into, stat.S_IMODE(info.st_mode))
                os.utime(into, ns=(info.st_atime_ns, info.st_mtime_ns))
            finally:
                os.close(into)
        finally:
            os.close(inner)

    def file(self, src: int, dst: int, name: str, info: os.stat_result) -> None:
        """A regular file's contents, holes kept, then its mode and times."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=src)
        try:
            now = os.fstat(fd)
            if not stat.S_ISREG(now.st_mode):  # replaced since it was looked at
                raise OSError(errno.EAGAIN, "it changed while it was copied")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(name, flags, 0o600, dir_fd=dst)
            try:
                contents(fd, out, now.st_size)
                os.fchmod(out, stat.S_IMODE(now.st_mode))
                os.utime(out, ns=(now.st_atime_ns, now.st_mtime_ns))
            finally:
                os.close(out)
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in self.kept.values():
            os.close(fd)
        self.kept.clear()


def contents(fd: int, out: int, size: int) -> None:
    """fd's data copied into out at the same offsets; its holes left holes. A file that
    shrank meanwhile ends where it ends now."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to its end
                break
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            start, end = offset, size  # a filesystem that cannot say: all of it
        os.lseek(out, start, os.SEEK_SET)
        at = start
        while at < end:
            sent = os.sendfile(out, fd, at, min(CHUNK, end - at))
            if sent == 0:  # it shrank while it was copied
                break
            at += sent
        offset = max(end, offset + 1)
    os.ftruncate(out, min(size, os.fstat(fd).st_size))


def clear(dst: int, name: str, depth: int = 0) -> None:
    """What dst holds at name, gone (a directory with what it holds); nothing followed."""
    try:
        have = os.stat(name, dir_fd=dst, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(have.st_mode):
        os.unlink(name, dir_fd=dst)
        return
    if depth > DEPTH_MAX:
        raise OSError(errno.ELOOP, f"what is there is over {DEPTH_MAX} directories deep")
    inner = os.open(name, OPEN_DIR, dir_fd=dst)
    try:
        os.chmod(inner, 0o700)  # an earlier copy's may be 0500
        for entry in os.listdir(inner):
            clear(inner, entry, depth + 1)
    finally:
        os.close(inner)
    os.rmdir(name, dir_fd=dst)


def times(dst: int, name: str, info: os.stat_result) -> None:
    os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("treecopy: FROM TO", file=sys.stderr)
        return 2
    os.umask(0)  # every file is made with its own mode
    copier = Copier()
    try:
        src = os.open(argv[0], OPEN_DIR)
        dst = os.open(argv[1], OPEN_DIR)
    except OSError as exc:
        print(f"treecopy: {exc}", file=sys.stderr)
        return 2
    try:
        copier.tree(src, dst, argv[0])
    finally:
        copier.close()
        os.close(src)
        os.close(dst)
    if copier.errors > ERRORS_SHOWN:
        print(f"treecopy: {copier.errors - ERRORS_SHOWN} more errors", file=sys.stderr)
    return 1 if copier.errors else 0


_given: dict[str, Any] = globals()
if _given.get("__name__") == "__main__":
    sys.exit(main(sys.argv[1:]))
