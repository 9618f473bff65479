"""Packages for a kernel that has no network: resolved and downloaded on the host.

The host's pip, isolated from the host's own configuration (wheels/pip.py), resolves the
requirements and downloads wheels for the kernel's interpreter, not its own: CPython
3.11 on manylinux x86_64, as the kernel image is (image/kernel.py), with
`--only-binary=:all:`, from the index the gateway was configured with. Nothing a client
names runs on the host: a requirement is a name with extras, specifiers and a marker,
never a URL, a path, an archive's file name or an option. With source distributions
allowed, a requirement that has no wheel is fetched from the index as an sdist without
pip (wheels/index.py) and built in a sandbox container (wheels/sdist.py), its build
requirements checked against the policy and given to it as wheels; pip then resolves
again, the wheel it built among its sources.

The policy applies to every distribution resolved (dependencies and build requirements
too), by PEP 503 name: allowed names (none listed: any), denied names, a size limit per
file and for all of them. Installs in flight are bounded per gateway and per client
(`Installs`), and pip's cache is the gateway's own, pruned to a size after each.

The kernel then installs the wheels offline, without resolving again (`pip install
--no-index --no-deps --target`), into PACKAGES_DIR on its workspace, which
`path_program` puts on its sys.path (see gateway/attach.py, guard_program).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from mcp_forge.api.kernelsession import requirement
from mcp_forge.errors import (
    InvalidRequest,
    PackageBusy,
    PackageDenied,
    PackageError,
    PackageNotFound,
    PackageTooLarge,
    redact,
)
from mcp_forge.image.kernel import PYTHON_VERSION, WHEEL_PLATFORMS
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings
from mcp_forge.wheels import index, pip, sdist

PACKAGES_DIR = ".packages"  # below the workspace: where the kernel installs packages
REQUIREMENTS_MAX = 50  # requirement strings in one request
REQUIREMENT_CHARS = 200  # characters of one requirement string
BUILDS_MAX = 8  # source distributions built for one install
KERNEL_KIND = f"CPython {PYTHON_VERSION}, manylinux x86_64"  # what the wheels must fit
BUILT_PLATFORM = "linux_x86_64"  # the tag of a wheel built in the kernel's image
_NOT_FOUND = re.compile(r"No matching distribution found for (\S+)")


@dataclass(frozen=True)
class PackagePolicy:
    """What install_packages may fetch, from where, from the gateway's settings."""

    allow: frozenset[str]  # normalized names; empty: any not denied
    deny: frozenset[str]
    total_max: int  # bytes of all files of one install
    file_max: int  # bytes of one file
    allow_sdist: bool  # built in a sandbox container (wheels/sdist.py)
    timeout: float  # seconds for pip on the host, and for one build
    index_url: str  # the only index pip and the sdist fetcher use
    work_dir: Path  # where each install's scratch directory is made
    cache_dir: Path  # pip's cache: the gateway's own, not the host user's
    cache_max: int  # bytes the cache keeps after an install
    installs_max: int  # installs in flight in this process
    client_installs_max: int  # installs in flight for one client

    @classmethod
    def of(cls, settings: Settings) -> PackagePolicy:
        url = urllib.parse.urlsplit(settings.packages_index_url)
        if url.scheme not in ("https", "http") or not url.netloc:
            raise InvalidRequest(
                f"the package index {settings.packages_index_url!r} is not an http(s) URL "
                "(MCPFORGE_PACKAGES_INDEX_URL, --packages-index-url)"
            )
        return cls(
            allow=_names(settings.packages_allow),
            deny=_names(settings.packages_deny),
            total_max=settings.packages_max,
            file_max=settings.packages_file_max,
            allow_sdist=settings.packages_allow_sdist,
            timeout=settings.packages_timeout,
            index_url=settings.packages_index_url,
            work_dir=settings.state_dir / "packages",
            cache_dir=settings.state_dir / "cache" / "pip",
            cache_max=settings.packages_cache_max,
            installs_max=settings.packages_installs_max,
            client_installs_max=settings.packages_client_installs_max,
        )

    @property
    def limits(self) -> pip.Limits:
        return pip.Limits(self.file_max, self.total_max, self.timeout)

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


class Installs:
    """Installs in flight in this process, in all and per client: past either bound a
    new one is refused at once (PackageBusy), so no client holds pip processes, downloads
    and scratch space beyond its share, and the gateway's stay bounded."""

    def __init__(self) -> None:
        self.running = 0
        self.by_client: Counter[str] = Counter()

    @contextlib.contextmanager
    def slot(self, policy: PackagePolicy, client: str | None) -> Iterator[None]:
        if self.running >= policy.installs_max:
            raise PackageBusy(
                f"the gateway is running {self.running} installs, its limit; "
                "try again when one has finished"
            )
        if client is not None and self.by_client[client] >= policy.client_installs_max:
            raise PackageBusy(
                f"you have {self.by_client[client]} installs running, the limit for one "
                "client; wait for one to finish"
            )
        self.running += 1
        if client is not None:
            self.by_client[client] += 1
        try:
            yield
        finally:
            self.running -= 1
            if client is not None:
                self.by_client[client] -= 1
                if not self.by_client[client]:
                    del self.by_client[client]


INSTALLS = Installs()  # this process's


def kernel_tags(*, built: bool = False) -> frozenset[tags.Tag]:
    """The wheel tags the kernel's Python accepts (CPython 3.11, manylinux x86_64; also
    plain linux_x86_64, the tag of a wheel built in its image, when `built`)."""
    version = tuple(int(p) for p in PYTHON_VERSION.split("."))
    abi = "cp" + PYTHON_VERSION.replace(".", "")
    platforms = [*WHEEL_PLATFORMS, *([BUILT_PLATFORM] if built else [])]
    return frozenset(
        [
            *tags.cpython_tags(version, [abi], platforms),
            *tags.compatible_tags(version, abi, platforms),
        ]
    )


def _pip_args(
    reqs: Sequence[Requirement], policy: PackagePolicy, dest: Path, built: Path | None = None
) -> list[str]:
    """`pip download` of wheels only, for the kernel's Python, from the policy's index
    (and the wheels built for this install, `built`)."""
    abi = "cp" + PYTHON_VERSION.replace(".", "")
    args = [
        "download", "--no-input", "--disable-pip-version-check",
        "--progress-bar", "off", "--only-binary=:all:", "--index-url", policy.index_url,
        "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", abi,
    ]  # fmt: skip
    for name in WHEEL_PLATFORMS:
        args += ["--platform", name]
    if built is not None:
        args += ["--platform", BUILT_PLATFORM, "--find-links", str(built)]
    return [*args, "--dest", str(dest), "--", *(str(r) for r in reqs)]


def _missing(output: str) -> Requirement | None:
    """The requirement pip found no wheel for, if that is why it failed."""
    found = _NOT_FOUND.search(output)
    if not found:
        return None
    try:
        return requirement(found.group(1))
    except ValueError:
        return None


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
    said = redact(" | ".join(errors))[-1500:]  # pip names its scratch paths: not the client's
    return PackageError("pip could not resolve the packages: " + said)


def _wheels(dest: Path, policy: PackagePolicy, *, asked: str | None = None) -> list[Wheel]:
    """The files pip left in `dest`, checked against the policy and the kernel's tags."""
    accepted = kernel_tags(built=policy.allow_sdist)
    out = []
    for path in sorted(dest.iterdir()):
        try:
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            raise PackageDenied(
                f"{path.name!r} is not a wheel; source distributions are not installed"
            ) from None
        policy.check_name(name, asked=asked)
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


async def download(
    reqs: Sequence[Requirement], policy: PackagePolicy, dest: Path, *, client: str | None = None
) -> list[Wheel]:
    """Resolve `reqs` and download their wheels (dependencies included) into `dest`, an
    empty directory; each is checked against the policy. Names asked for are checked
    before anything is fetched. `client` (who asked; None for the gateway's own installs,
    spec.packages) is held to its share of installs in flight."""
    for req in reqs:
        policy.check_name(req.name)
    with INSTALLS.slot(policy, client):
        try:
            async with pip.workdir(policy.work_dir) as work:
                try:
                    # Each pip run and build has its deadline; the whole install, one too.
                    async with asyncio.timeout(policy.timeout * 2):
                        await _resolve(reqs, policy, dest, work)
                except TimeoutError:
                    raise PackageError(
                        f"the install took longer than {policy.timeout * 2:.0f}s in all; "
                        "nothing was installed"
                    ) from None
            wheels = _wheels(dest, policy)
        except BaseException:
            # pip may be stopped while it copies a file into `dest`: nothing of it stays.
            await asyncio.to_thread(_empty, dest)
            raise
        finally:
            await asyncio.to_thread(pip.prune_cache, policy.cache_dir, policy.cache_max)
    if not wheels:
        raise PackageNotFound("pip resolved nothing to install")
    return wheels


async def _resolve(
    reqs: Sequence[Requirement], policy: PackagePolicy, dest: Path, work: Path
) -> None:
    """pip download into `dest`; with sdists allowed, each requirement pip finds no wheel
    for is built in the sandbox (`_build`) and pip asked again, at most BUILDS_MAX times."""
    built_dir = work / "built"
    built: set[str] = set()
    while True:
        args = _pip_args(reqs, policy, dest, built_dir if built else None)
        try:
            await pip.run(args, work, policy.cache_dir, policy.limits, dest)
            return
        except pip.Failed as failed:
            missing = _missing(failed.output) if policy.allow_sdist else None
            if missing is None or canonicalize_name(missing.name) in built:
                raise _failure(failed.output, policy) from None
            if len(built) >= BUILDS_MAX:
                raise PackageError(
                    f"{missing} would be the {BUILDS_MAX + 1}th source distribution built for "
                    f"this install; the limit is {BUILDS_MAX}"
                ) from None
        await asyncio.to_thread(_empty, dest)
        built_dir.mkdir(exist_ok=True)
        await _build(missing, policy, work, built_dir, len(built))
        built.add(canonicalize_name(missing.name))


async def _build(req: Requirement, policy: PackagePolicy, work: Path, out: Path, n: int) -> None:
    """Build `req`'s sdist into a wheel in `out`, in the sandbox (wheels/sdist.py): the
    sdist fetched from the index, its build requirements checked against the policy and
    given to the sandbox as wheels, the wheel checked when it comes back."""
    policy.check_name(req.name)
    found = await index.find(req, policy.index_url)
    inputs = work / f"build-{n}"
    deps = inputs / "deps"
    deps.mkdir(mode=0o755, parents=True)
    inputs.chmod(0o755)  # read by the sandbox's unprivileged user
    path = await index.fetch(found, inputs, policy.file_max)
    path.chmod(0o644)
    building = f"{found.name} {found.version} (to build it)"
    wanted = []
    for text in await sdist.build_requires(inputs, found.filename, policy.timeout):
        try:
            wanted.append(requirement(text))
        except ValueError as exc:
            raise PackageDenied(f"a build requirement of {found.filename!r}: {exc}") from None
    for dep in wanted:
        policy.check_name(dep.name, asked=building)
    if wanted:
        args = _pip_args(wanted, policy, deps, out)
        try:
            await pip.run(args, work, policy.cache_dir, policy.limits, deps)
        except pip.Failed as failed:
            raise _failure(failed.output, policy) from None
        for wheel in _wheels(deps, policy, asked=building):
            wheel.path.chmod(0o644)
    made = await sdist.build_wheel(inputs, found.filename, policy.timeout, policy.file_max)
    _check_built(made.filename, found, policy)
    await asyncio.to_thread((out / made.filename).write_bytes, made.data)


def _check_built(filename: str, found: index.Sdist, policy: PackagePolicy) -> None:
    try:
        name, version, _, wheel_tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        raise PackageError(
            f"the build of {found.filename!r} made {filename!r}, not a wheel"
        ) from None
    if name != found.name or version != found.version:
        raise PackageDenied(
            f"the build of {found.filename!r} made {filename!r}, another distribution"
        )
    policy.check_name(name)
    if not wheel_tags & kernel_tags(built=True):
        raise PackageNotFound(f"{filename!r}, built from source, does not fit the kernel")


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
