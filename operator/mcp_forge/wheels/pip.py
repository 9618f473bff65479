"""The host's pip, isolated: it only ever downloads wheels from the configured index.

Package names come from MCP clients and kernels, so everything around pip is ours, not
the host's: no inherited environment (`PIP_*`, `PYTHON*`, find-links, an index of the
host's), no configuration file (`PIP_CONFIG_FILE=/dev/null` skips the global, site and
user files alike; pip's `--isolated` would not: it skips the user's file and the
environment, ours included), an empty working directory of its own (so no name can
be taken for a file in it), a home and a TMPDIR of its own below the gateway's state
directory, a cache of ours, bounded (`prune_cache`), and only `--index-url` the
gateway was configured with. What is passed through is how to reach the index: the
standard proxy variables and the trust store (SSL_CERT_FILE, SSL_CERT_DIR).

pip runs with `--only-binary=:all:` (wheels/fetch.py builds the arguments): it never
builds or prepares a source distribution, which would run the package's code on the
host. Those are built in a sandbox container (wheels/sdist.py).

While pip runs, what it has written is watched (`_watch`): pip downloads each file into
its TMPDIR, then copies it to the destination, so a download past the policy's sizes is
stopped as it grows, not found once it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mcp_forge import confine
from mcp_forge.errors import PackageError, PackageTooLarge
from mcp_forge.image.processes import stop, tail

WATCH_INTERVAL = 0.1  # seconds between looks at what pip has written while it runs
OUTPUT_MAX = 200_000  # bytes of pip's output kept (the tail)
# How to reach the index, and nothing else, from the gateway's environment.
PASSED = (
    "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "LANG", "LC_ALL",
)  # fmt: skip
MEMORY_MAX = 4 * 2**30  # bytes of pip's address space (it resolves, hashes, unzips)
STALE_AFTER = 3600.0  # seconds: a work directory this old was left by a killed gateway


@dataclass(frozen=True)
class Limits:
    """What one pip run may write (bytes), and for how long it may run (seconds)."""

    file_max: int
    total_max: int
    timeout: float


def environment(home: Path, tmp: Path, cache: Path) -> dict[str, str]:
    """pip's whole environment: none of the host's pip settings, only its route out."""
    env = {k: os.environ[k] for k in PASSED if k in os.environ}
    env.update(
        PATH="/usr/local/bin:/usr/bin:/bin",
        HOME=str(home),
        TMPDIR=str(tmp),
        PIP_CONFIG_FILE=os.devnull,
        PIP_CACHE_DIR=str(cache),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PYTHONNOUSERSITE="1",
    )
    return env


@contextlib.asynccontextmanager
async def workdir(root: Path) -> AsyncIterator[Path]:
    """A fresh directory below `root` for one install (pip's home, TMPDIR and working
    directory, the sandbox's input): removed after, come what may. Directories left by a
    gateway killed mid-install are removed once they are STALE_AFTER old."""
    await asyncio.to_thread(_prepare, root)
    path = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="install-", dir=root))
    try:
        yield path
    finally:
        await asyncio.to_thread(shutil.rmtree, path, True)


def _prepare(root: Path) -> None:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = time.time()
    for old in root.glob("install-*"):
        with contextlib.suppress(OSError):
            if now - old.lstat().st_mtime > STALE_AFTER:
                shutil.rmtree(old, ignore_errors=True)


async def run(args: Sequence[str], work: Path, cache: Path, limits: Limits, dest: Path) -> str:
    """Run pip with `args` in `work` (see the module docstring); its output (stdout and
    stderr, the tail) if it exited 0. PackageError with that output's errors otherwise;
    PackageTooLarge once what it writes passes `limits`; PackageError past the timeout."""
    if importlib.util.find_spec("pip") is None:
        raise PackageError(f"pip is not available to the gateway's Python ({sys.executable})")
    home, tmp, cwd = (work / "home", work / "tmp", work / "cwd")
    await asyncio.to_thread(_give, work, home, tmp, cwd, dest, cache)
    argv = confine.command(
        [sys.executable, "-I", "-m", "pip", *args],
        writable=(work, dest, cache),
        cwd=cwd,
        network=True,
        limits=confine.Limits(
            memory=MEMORY_MAX,
            cpu_seconds=int(limits.timeout) + 1,
            file_size=2 * limits.file_max + 2**20,  # a backstop: _watch stops it first
        ),
        what="pip",
    )
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=environment(home, tmp, cache),
        cwd=cwd,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ran = asyncio.ensure_future(tail(proc.stdout, OUTPUT_MAX))
    watchdog = asyncio.ensure_future(_watch((tmp, dest), limits))
    try:
        async with asyncio.timeout(limits.timeout):
            await asyncio.wait((ran, watchdog), return_when=asyncio.FIRST_COMPLETED)
        if not ran.done():
            await stop(proc)
            raise PackageTooLarge(watchdog.result())
        await proc.wait()
    except TimeoutError:
        await stop(proc)
        raise PackageError(
            f"resolving and downloading took longer than {limits.timeout:.0f}s; "
            "nothing was installed"
        ) from None
    except BaseException:
        await stop(proc)
        raise
    finally:
        watchdog.cancel()
        if not ran.done():
            ran.cancel()
        await asyncio.gather(ran, watchdog, return_exceptions=True)
    output = ran.result()
    if proc.returncode:
        raise Failed(proc.returncode, output)
    return output


def _give(work: Path, home: Path, tmp: Path, cwd: Path, dest: Path, cache: Path) -> None:
    """pip's directories, made and given to the confined user (confine.py): its work
    directory's, the destination, and the cache (whole, the first time: an older
    gateway's pip wrote it as root)."""
    for d in (home, tmp, cwd):
        d.mkdir(mode=0o700, exist_ok=True)
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    for d in (work, home, tmp, cwd, dest):
        confine.give(d)
    if cache.stat().st_uid != confine.UID:
        confine.give(cache, recursive=True)


class Failed(PackageError):
    """pip exited with an error; `output` is what it said (wheels/fetch.py reads it)."""

    def __init__(self, code: int, output: str) -> None:
        super().__init__(f"pip exited {code}")
        self.output = output


async def _watch(dirs: Sequence[Path], limits: Limits) -> str:
    """Why pip must stop, once what it has written passes the sizes (a file, or all
    together); looked at every WATCH_INTERVAL while it runs."""
    largest = (0, "")  # the largest distribution file seen: what a temporary copy is of
    while True:
        await asyncio.sleep(WATCH_INTERVAL)  # a sample of a growing directory, not a wait
        sizes = await asyncio.to_thread(file_sizes, dirs)
        for name, size in sizes:
            if name.endswith(DISTRIBUTIONS) and size >= largest[0]:
                largest = (size, name)
        for name, size in sizes:
            if size > limits.file_max:
                # pip may be copying a download it finished between two looks into a
                # temporary file (tmpXXXX): name the distribution, as it was seen.
                shown = name if name.endswith(DISTRIBUTIONS) or not largest[1] else largest[1]
                return (
                    f"{shown} is over {limits.file_max} bytes (stopped while downloading); "
                    f"the limit for one file is {limits.file_max}"
                )
        total = sum(size for _, size in sizes)
        if total > limits.total_max:
            return (
                f"the packages and their dependencies are over {limits.total_max} bytes "
                f"together (stopped while downloading); the limit is {limits.total_max}"
            )


DISTRIBUTIONS = (".whl", ".tar.gz", ".zip")


def file_sizes(dirs: Sequence[Path]) -> list[tuple[str, int]]:
    """Sizes of every file below `dirs` (pip's TMPDIR: what it downloads and unpacks;
    the destination: what it has kept). Only wheels are fetched, never built, so nothing
    here is larger than a download."""
    out = []
    for top in dirs:
        for root, _, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):  # gone meanwhile: pip moved it
                    out.append((name, os.lstat(os.path.join(root, name)).st_size))
    return out


def prune_cache(cache: Path, most: int) -> int:
    """Delete the cache's least recently written files until it holds at most `most`
    bytes; the bytes it holds after."""
    entries = []
    for root, _, files in os.walk(cache):
        for name in files:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= most:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            total -= size
    return total
