"""kernelside/treecopy.py, the copier of a cluster fork's workspace, run as its pod runs it
(`python -I -S -c <source> FROM TO`) on directories of this test's."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mcp_forge.control import forkfiles
from mcp_forge.kernelside import source, treecopy

TIMES = (1_600_000_000, 1_600_000_123)


def copy(src: Path, dst: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-I", "-S", "-c", source("treecopy"), str(src), str(dst)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path, Path]:
    src, dst, outside = tmp_path / "from", tmp_path / "to", tmp_path / "outside"
    for d in (src, dst, outside):
        d.mkdir()
    return src, dst, outside


def test_the_pod_runs_this_copier_with_the_images_python() -> None:
    command = forkfiles.COMMAND
    assert command[:4] == ["python", "-I", "-S", "-c"] and command[4] == source("treecopy")
    assert command[5:] == ["/from", "/to"]


def test_a_tree_is_copied_with_modes_times_links_and_special_files_made_anew(
    trees: tuple[Path, Path, Path],
) -> None:
    src, dst, outside = trees
    (src / "notes.txt").write_text("parent notes")
    os.chmod(src / "notes.txt", 0o640)
    os.utime(src / "notes.txt", TIMES)
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "sub" / "deeper" / "data.bin").write_bytes(b"\x00\x01" * 5000)
    os.link(src / "notes.txt", src / "sub" / "hard.txt")
    os.symlink("/etc/hostname", src / "link")
    os.symlink("../notes.txt", src / "sub" / "relative")
    os.symlink(outside / "nothing", src / "dangling")
    os.mkfifo(src / "pipe", 0o600)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(src / "sock"))
    with open(src / "sparse", "wb") as f:  # 64 MiB apparent, 4 KiB of data at its end
        f.seek(64 << 20)
        f.write(b"x" * 4096)
    (src / "lost+found").mkdir()
    (src / "sub" / "lost+found").mkdir()  # skipped at the root only
    os.chmod(src / "sub", 0o750)
    os.utime(src / "sub", TIMES)

    done = copy(src, dst)
    listener.close()
    assert done.returncode == 0, done.stderr
    assert (dst / "notes.txt").read_text() == "parent notes"
    notes = os.stat(dst / "notes.txt")
    assert stat.S_IMODE(notes.st_mode) == 0o640 and int(notes.st_mtime) == TIMES[1]
    assert os.stat(dst / "sub" / "hard.txt").st_ino == notes.st_ino, "a hard link copied apart"
    assert (dst / "sub" / "deeper" / "data.bin").read_bytes() == b"\x00\x01" * 5000
    assert os.readlink(dst / "link") == "/etc/hostname"
    assert os.readlink(dst / "sub" / "relative") == "../notes.txt"
    assert os.readlink(dst / "dangling") == str(outside / "nothing")
    assert stat.S_ISFIFO(os.lstat(dst / "pipe").st_mode)
    assert stat.S_ISSOCK(os.lstat(dst / "sock").st_mode)
    sparse = os.stat(dst / "sparse")
    assert sparse.st_size == (64 << 20) + 4096
    assert sparse.st_blocks * 512 < 1 << 20, "the holes were filled"
    assert (dst / "sparse").read_bytes()[-4096:] == b"x" * 4096
    assert not (dst / "lost+found").exists() and (dst / "sub" / "lost+found").is_dir()
    sub = os.stat(dst / "sub")
    assert stat.S_IMODE(sub.st_mode) == 0o750 and int(sub.st_mtime) == TIMES[1]
    assert list(outside.iterdir()) == []


def test_what_the_target_holds_is_replaced_and_never_written_through(
    trees: tuple[Path, Path, Path],
) -> None:
    """An earlier copy's leftovers, or links planted at the names the copy writes: each is
    replaced, and what a link points at is untouched."""
    src, dst, outside = trees
    victim = outside / "victim"
    victim.write_text("untouched")
    (src / "file").write_text("new")
    (src / "dir").mkdir()
    (src / "dir" / "inner").write_text("inner")
    (src / "was_a_dir").write_text("now a file")
    os.symlink(victim, dst / "file")  # a link where a file goes
    os.symlink(outside, dst / "dir")  # a link where a directory goes
    (dst / "was_a_dir" / "deep").mkdir(parents=True)
    (dst / "was_a_dir" / "deep" / "x").write_text("old")

    done = copy(src, dst)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "untouched" and sorted(p.name for p in outside.iterdir()) == [
        "victim"
    ]
    assert not (dst / "file").is_symlink() and (dst / "file").read_text() == "new"
    assert not (dst / "dir").is_symlink() and (dst / "dir" / "inner").read_text() == "inner"
    assert (dst / "was_a_dir").read_text() == "now a file"


def test_what_cannot_be_copied_is_named_and_the_rest_is_copied(
    trees: tuple[Path, Path, Path],
) -> None:
    src, dst, _ = trees
    deep = src
    for _ in range(treecopy.DEPTH_MAX + 5):
        deep = deep / "d"
    deep.mkdir(parents=True)
    if os.geteuid() == 0:  # a device (only root makes one): never made by the copier
        os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (src / "fine").write_text("fine")

    done = copy(src, dst)
    assert done.returncode == 1, done.stderr
    assert f"over {treecopy.DEPTH_MAX} directories deep" in done.stderr, done.stderr
    if os.geteuid() == 0:
        assert "null: [Errno 1] a device file is not copied" in done.stderr, done.stderr
        assert not (dst / "null").exists()
    assert (dst / "fine").read_text() == "fine"


def test_modes_survive_any_umask_and_a_copy_made_again_replaces_a_read_only_one() -> None:
    """As the copier's user (not root, who ignores modes): a 0666 FIFO stays 0666 under a
    umask of 022, a 0500 directory's files are copied into it before its mode is set, and
    a second copy over the first (its 0500 directory) replaces it."""
    with tempfile.TemporaryDirectory() as scratch:  # pytest's own is root's, 0700
        os.chmod(scratch, 0o711)
        _modes_survive(Path(scratch))


def _modes_survive(tmp_path: Path) -> None:
    src, dst = tmp_path / "from", tmp_path / "to"
    src.mkdir()
    dst.mkdir()
    os.mkfifo(src / "pipe", 0o666)
    os.chmod(src / "pipe", 0o666)
    (src / "ro").mkdir()
    (src / "ro" / "f").write_text("inside")
    os.chmod(src / "ro", 0o500)
    argv = [sys.executable, "-I", "-S", "-c", source("treecopy"), str(src), str(dst)]
    if os.geteuid() == 0:  # as nobody, owning both trees
        for path in (src, dst, src / "pipe", src / "ro", src / "ro" / "f"):
            os.chown(path, 65534, 65534)
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    for attempt in ("first", "again"):
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, check=False,
            preexec_fn=lambda: os.umask(0o022),
        )  # fmt: skip
        assert done.returncode == 0, (attempt, done.stderr)
        assert stat.S_IMODE(os.lstat(dst / "pipe").st_mode) == 0o666, attempt
        assert stat.S_IMODE(os.stat(dst / "ro").st_mode) == 0o500, attempt
        assert (dst / "ro" / "f").read_text() == "inside", attempt


def test_a_file_that_shrinks_while_it_is_copied_ends_where_it_ends(tmp_path: Path) -> None:
    source_file, target = tmp_path / "shrinking", tmp_path / "copy"
    source_file.write_bytes(b"y" * 10_000)
    with open(source_file, "rb") as f, open(target, "wb") as out:
        os.truncate(source_file, 100)  # after its size was read (10,000), before the copy
        treecopy.contents(f.fileno(), out.fileno(), 10_000)
    assert target.read_bytes() == b"y" * 100
