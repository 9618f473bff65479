"""Packages for a kernel that has no network: resolved and downloaded on the host.

The host's pip (the gateway's Python) resolves the requirements and downloads wheels
for the kernel's interpreter, not its own: CPython 3.11 on manylinux x86_64, as the
kernel image is (image/kernel.py), with `--only-binary=:all:` so nothing is built. With
source distributions allowed, `pip wheel` builds them into wheels on the host, and each
wheel's tags are checked against the kernel's. Everything happens in a directory of the
caller's, in a subprocess with a deadline, off the event loop.

The policy applies to every distribution resolved (dependencies too), by PEP 503 name:
allowed names (none listed: any), denied names, a size limit per file and for all of
them. Requirement strings are checked before pip sees them: a name and specifiers,
extras and markers, never a URL, a path or an option.

The kernel then installs the wheels offline, without resolving again (`pip install
--no-index --no-deps --target`), into PACKAGES_DIR on its workspace, which
`path_program` puts on its sys.path (see gateway/core.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from mcp_forge.api.kernelsession import requirement
from mcp_forge.errors import (
    InvalidRequest,
    PackageDenied,
    PackageError,
    PackageNotFound,
    PackageTooLarge,
)
from mcp_forge.image.kernel import PYTHON_VERSION, WHEEL_PLATFORMS, _stop
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings

PACKAGES_DIR = ".packages"  # below the workspace: where the kernel installs packages
REQUIREMENTS_MAX = 50  # requirement strings in one request
REQUIREMENT_CHARS = 200  # characters of one requirement string
_PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
WATCH_INTERVAL = 0.1  # seconds between looks at what pip has written while it runs
KERNEL_KIND = f"CPython {PYTHON_VERSION}, manylinux x86_64"  # what the wheels must fit
_NOT_FOUND = re.compile(r"No matching distribution found for (\S+)")


@dataclass(frozen=True)
class PackagePolicy:
    """What install_packages may fetch, from the gateway's settings."""

    allow: frozenset[str]  # normalized names; empty: any not denied
    deny: frozenset[str]
    total_max: int  # bytes of all files of one install
    file_max: int  # bytes of one file
    allow_sdist: bool
    timeout: float  # seconds for pip on the host

    @classmethod
    def of(cls, settings: Settings) -> PackagePolicy:
        return cls(
            allow=_names(settings.packages_allow),
            deny=_names(settings.packages_deny),
            total_max=settings.packages_max,
            file_max=settings.packages_file_max,
            allow_sdist=settings.packages_allow_sdist,
            timeout=settings.packages_timeout,
        )

    def check_name(self, name: str, *, asked: str | None = None) -> None:
        """PackageDenied unless the policy lets the distribution `name` in; `asked` is
        the requirement it was resolved for, when it is a dependency."""
        key = canonicalize_name(name)
        why = ""
        if key in self.deny:
            why = "it is on the gateway's deny list"
        elif self.allow and key not in self.allow:
            why = "it is not on the gateway's allow list"
        if why:
            via = f" (needed by {asked})" if asked else ""
            raise PackageDenied(f"{name!r}{via} is refused: {why}")


def _names(text: str) -> frozenset[str]:
    return frozenset(canonicalize_name(n.strip()) for n in text.split(",") if n.strip())


@dataclass(frozen=True)
class Wheel:
    """One downloaded wheel: its file, distribution name (normalized), version, size."""

    path: Path
    name: str
    version: str
    size: int


def parse_requirements(items: Any) -> list[Requirement]:
    """The requirement strings of a request, parsed; InvalidRequest names a bad one.

    Only a name with optional extras, version specifiers and a marker: never a URL
    (`name @ https://...`), a path or a pip option, so nothing reaches pip's command
    line but requirements."""
    if not isinstance(items, list) or not items:
        raise InvalidRequest('packages must be a non-empty list of requirements ("tabulate")')
    if len(items) > REQUIREMENTS_MAX:
        raise InvalidRequest(f"packages has {len(items)} items; the limit is {REQUIREMENTS_MAX}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item.strip():
            raise InvalidRequest(f"packages[{i}] must be a requirement string, got {item!r}")
        text = item.strip()
        if len(text) > REQUIREMENT_CHARS:
            raise InvalidRequest(f"packages[{i}] is over {REQUIREMENT_CHARS} characters")
        try:
            req = requirement(text)
        except ValueError as exc:
            raise InvalidRequest(f"packages[{i}] {exc}") from None
        out.append(req)
    return out


def kernel_tags() -> frozenset[tags.Tag]:
    """The wheel tags the kernel's Python accepts (CPython 3.11, manylinux x86_64)."""
    version = tuple(int(p) for p in PYTHON_VERSION.split("."))
    abi = "cp" + PYTHON_VERSION.replace(".", "")
    return frozenset(
        [
            *tags.cpython_tags(version, [abi], WHEEL_PLATFORMS),
            *tags.compatible_tags(version, abi, WHEEL_PLATFORMS),
        ]
    )


def _pip_args(reqs: Sequence[Requirement], policy: PackagePolicy, dest: Path) -> list[str]:
    common = ["--no-input", "--disable-pip-version-check", "--progress-bar", "off"]
    names = [str(r) for r in reqs]
    if policy.allow_sdist:
        # Built on the host, with its own interpreter: it must be the kernel's kind.
        here = f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}"
        if here != f"cpython {PYTHON_VERSION}" or platform.machine() != "x86_64":
            raise PackageError(
                f"source distributions can only be built by a CPython {PYTHON_VERSION} "
                f"x86_64 gateway; this one is {here} on {platform.machine()}"
            )
        return ["wheel", *common, "--prefer-binary", "--wheel-dir", str(dest), "--", *names]
    abi = "cp" + PYTHON_VERSION.replace(".", "")
    target = ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", abi]
    for name in WHEEL_PLATFORMS:
        target += ["--platform", name]
    return ["download", *common, "--only-binary=:all:", *target, "--dest", str(dest), "--", *names]


async def _pip(args: list[str], policy: PackagePolicy, dest: Path) -> tuple[int, str]:
    """Run the host's pip, watched (`_watch`); its exit code and stderr (stdout merged).

    pip downloads each file into its temporary directory, then copies it to `dest`:
    with TMPDIR a directory of ours, both are watched while it runs, so a download past
    the policy's sizes is stopped as it grows, not found once it is complete."""
    if importlib.util.find_spec("pip") is None:
        raise PackageError(f"pip is not available to the gateway's Python ({sys.executable})")
    with tempfile.TemporaryDirectory(prefix="mcp-forge-pip-") as scratch:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pip",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **_PIP_ENV, "TMPDIR": scratch},
            start_new_session=True,
        )
        ran = asyncio.ensure_future(proc.communicate())
        watchdog = asyncio.ensure_future(_watch((Path(scratch), dest), policy))
        try:
            async with asyncio.timeout(policy.timeout):
                await asyncio.wait((ran, watchdog), return_when=asyncio.FIRST_COMPLETED)
            if not ran.done():
                await _stop(proc)
                raise PackageTooLarge(watchdog.result())
        except TimeoutError:
            await _stop(proc)
            raise PackageError(
                f"resolving and downloading took longer than {policy.timeout:.0f}s; "
                "nothing was installed"
            ) from None
        except BaseException:
            await _stop(proc)
            raise
        finally:
            watchdog.cancel()
            if not ran.done():
                ran.cancel()
            await asyncio.gather(ran, watchdog, return_exceptions=True)
        out, _ = ran.result()
    return proc.returncode or 0, out.decode(errors="replace")


async def _watch(dirs: Sequence[Path], policy: PackagePolicy) -> str:
    """Why pip must stop, once what it has written passes the policy's sizes (a file,
    or all together); looked at every WATCH_INTERVAL while it runs."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL)  # a sample of a growing directory, not a wait
        sizes = await asyncio.to_thread(_file_sizes, dirs)
        for name, size in sizes:
            if size > policy.file_max:
                return (
                    f"{name} is over {policy.file_max} bytes (stopped while downloading); "
                    f"the limit for one file is {policy.file_max}"
                )
        total = sum(size for _, size in sizes)
        if total > policy.total_max:
            return (
                f"the packages and their dependencies are over {policy.total_max} bytes "
                f"together (stopped while downloading); the limit is {policy.total_max}"
            )


def _file_sizes(dirs: Sequence[Path]) -> list[tuple[str, int]]:
    """Sizes of the files being downloaded: in `dest`, and in pip's download directories
    in its TMPDIR (pip-unpack-*; not its build directories, where a source tree being
    built into a wheel may be larger than the download)."""
    scratch, dest = dirs
    tops = [dest, *scratch.glob("pip-unpack-*")]
    out = []
    for top in tops:
        for root, _, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):  # gone meanwhile: pip moved it
                    st = os.lstat(os.path.join(root, name))
                    out.append((name, st.st_size))
    return out


def _failure(output: str, policy: PackagePolicy) -> PackageError:
    found = _NOT_FOUND.search(output)
    if found:
        what = found.group(1)
        how = (
            "or in a form this gateway can build"
            if policy.allow_sdist
            else f"as a wheel for the kernel ({KERNEL_KIND}); "
            "source distributions are not allowed by this gateway's policy"
        )
        return PackageNotFound(f"no distribution of {what!r} on the package index {how}")
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-5:]
    return PackageError("pip could not resolve the packages: " + " | ".join(errors)[-1500:])


def _wheels(dest: Path, policy: PackagePolicy) -> list[Wheel]:
    """The files pip left in `dest`, checked against the policy and the kernel's tags."""
    accepted = kernel_tags()
    out = []
    for path in sorted(dest.iterdir()):
        try:
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            raise PackageDenied(
                f"{path.name!r} is not a wheel; source distributions are not installed"
            ) from None
        policy.check_name(name)
        if not wheel_tags & accepted:
            raise PackageNotFound(f"{path.name!r} does not fit the kernel ({KERNEL_KIND})")
        size = path.stat().st_size
        if size > policy.file_max:
            raise PackageTooLarge(
                f"{path.name} is {size} bytes; the limit for one file is {policy.file_max}"
            )
        out.append(Wheel(path, str(name), str(version), size))
    total = sum(w.size for w in out)
    if total > policy.total_max:
        raise PackageTooLarge(
            f"the packages and their dependencies are {total} bytes together; the limit is "
            f"{policy.total_max}"
        )
    return out


async def download(reqs: Sequence[Requirement], policy: PackagePolicy, dest: Path) -> list[Wheel]:
    """Resolve `reqs` and download their wheels (dependencies included) into `dest`, an
    empty directory; each is checked against the policy. Names asked for are checked
    before anything is fetched."""
    for req in reqs:
        policy.check_name(req.name)
    try:
        code, output = await _pip(_pip_args(reqs, policy, dest), policy, dest)
        if code != 0:
            raise _failure(output, policy)
        wheels = _wheels(dest, policy)
    except BaseException:
        # pip may be stopped while it copies a file into `dest`: nothing of it stays.
        await asyncio.to_thread(_empty, dest)
        raise
    if not wheels:
        raise PackageNotFound("pip resolved nothing to install")
    return wheels


def _empty(dest: Path) -> None:
    for path in dest.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def path_program(root: str = WORKSPACE) -> str:
    """Silent code that puts the kernel's package directory on its sys.path, after the
    standard library and before the image's own site-packages (so a package asked for
    wins, and nothing shadows the standard library), and drops stale import caches, so
    what was just installed imports at once. Run again, it changes nothing."""
    target = f"{root}/{PACKAGES_DIR}"
    return (
        "(lambda s, il, p: (p in s.path or s.path.insert(next((i for i, e in "
        "enumerate(s.path) if e.endswith('site-packages')), len(s.path)), p), "
        "s.path_importer_cache.pop(p, None), il.invalidate_caches()))"
        f"(__import__('sys'), __import__('importlib'), {target!r})"
    )
