"""The kernel image, built from Debian packages and wheels, with no container registry.

Where `FROM debian:…` cannot be pulled, the image is assembled by hand:

    1. mmdebstrap makes a Debian rootfs with python3, python3-venv, ca-certificates
       and tini (cached as a tarball, keyed by its inputs);
    2. the host's pip downloads wheels for CPython 3.11 on x86_64 (cached too): pip
       inside the rootfs cannot reach PyPI, because the network's TLS proxy uses a CA
       that only the host trusts;
    3. in a chroot, `python3 -m venv /opt/kernel` and an offline `pip install` of
       those wheels; then the user `sandbox` (uid 1000) and /workspace are added;
    4. `podman import` turns the rootfs into an image, untagged;
    5. the image runs a smoke test (read-only root, uid 1000) and only then gets its
       tag, so a failed build never leaves a broken image under the tag.

The image carries a label with a hash of the recipe's inputs; a build whose hash
matches the tagged image's label is skipped. images/Containerfile makes the same
image for hosts that can pull base images.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mcp_forge import __version__
from mcp_forge.clients import podman
from mcp_forge.errors import ImageError, InvalidRequest, PodmanError
from mcp_forge.image.processes import stop
from mcp_forge.sandbox import KERNEL_CMD, KERNEL_UID, WORKSPACE, kernel_image

VARIANTS = ("minimal", "default")

# Exact pins; the Containerfile repeats them (a test keeps the two equal).
# Transitive dependencies float; each image records what it got in
# /opt/kernel/requirements.lock.
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "minimal": ("ipykernel==7.4.0",),
    "default": (
        "ipykernel==7.4.0",
        "numpy==2.4.6",
        "pandas==3.1.1",
        "matplotlib==3.11.2",
        "pillow==13.0.0",
    ),
}

# Installed as dependencies, then removed. debugpy is ipykernel's debugger (debug_request
# on the control channel, which MCP-Forge never sends; a pod has no network for a DAP
# client either), and ipykernel imports it, pydevd and all, whenever it is installed:
# without it a kernel goes from bound sockets to its first kernel_info reply in 0.08 s
# instead of 0.21 s (tests/bench/profile_cold.py, medians). ipykernel checks for it
# (debugger._is_debugpy_available) and runs without a debugger when it is missing.
UNINSTALLED = ("debugpy",)
# Bump when the recipe changes in a way the hashed constants below do not show.
RECIPE_VERSION = "1"
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "tini")
# Docs, man pages and translations are never unpacked (copyright files are kept).
DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
)
# bookworm's python3 is 3.11; the wheels must match it.
PYTHON_VERSION = "3.11"
WHEEL_PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
    "linux_x86_64",
    "any",
)

KERNEL_VENV = "/opt/kernel"
KERNEL_ENTRYPOINT = ("/usr/bin/tini", "--")
KERNEL_ENV: dict[str, str] = {
    "PATH": f"{KERNEL_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
    # The root filesystem is read-only in a pod: everything that caches goes to /tmp, but
    # IPython's directory is one the kernel cannot write (see render.IPYTHON_DIR).
    "IPYTHONDIR": "/etc/mcp-forge/ipython",
    "MPLCONFIGDIR": "/tmp/matplotlib",
    "PYTHONDONTWRITEBYTECODE": "1",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
INPUTS_LABEL = "dev.mcpforge.inputs"
VARIANT_LABEL = "dev.mcpforge.variant"

# Deadlines of the build's steps, in seconds. Measured here (2 cores): mmdebstrap
# 40-60 s, pip download ~5 s, chroot install 15 s (minimal) to 45 s (default),
# tar + import 15-25 s, smoke test 2-8 s; the deadlines allow for slow mirrors and disks.
MMDEBSTRAP_TIMEOUT = 900.0
PIP_DOWNLOAD_TIMEOUT = 900.0
CHROOT_TIMEOUT = 600.0
TAR_TIMEOUT = 600.0
IMPORT_TIMEOUT = 600.0
SMOKE_TEST_TIMEOUT = 120.0

# Commands run inside the chroot see only this environment: the host's PIP_*
# settings (PIP_FIND_LINKS, PIP_CERT) name paths that do not exist in the rootfs.
_CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_INPUT": "1",
}
_STEPS = 5


@dataclass(frozen=True)
class BuildResult:
    """What `build_image` did: `built` is False when the image was already up to date."""

    ref: str
    built: bool
    seconds: float


def image_ref(variant: str = "default") -> str:
    """The tag of a variant's image: `localhost/mcp-forge-kernel:0.1.0[-minimal]`."""
    _check_variant(variant)
    return kernel_image(variant)


def inputs_hash(variant: str) -> str:
    """A hash of everything the variant's image is built from (its `dev.mcpforge.inputs`)."""
    _check_variant(variant)
    return _hash(
        {
            "base": _base_inputs(),
            "python": PYTHON_VERSION,
            "platforms": WHEEL_PLATFORMS,
            "requirements": REQUIREMENTS[variant],
            "uninstalled": UNINSTALLED,
            "variant": variant,
            "uid": KERNEL_UID,
            "changes": _import_changes(variant, ""),
        }
    )


def cache_dir() -> Path:
    """Where base rootfs tarballs, wheels and build directories live.

    `$MCPFORGE_CACHE_DIR` if set; else /var/cache/mcp-forge/images for root and
    ~/.cache/mcp-forge/images for everyone else. Delete it to fetch fresh Debian
    packages and wheels on the next build.
    """
    if configured := os.environ.get("MCPFORGE_CACHE_DIR"):
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/cache/mcp-forge/images")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mcp-forge" / "images"


async def image_status(ref: str) -> str | None:
    """The image's inputs label ("" if it has none), or None if there is no such image."""
    exists = await podman.run("image", "exists", ref, check=False)
    if exists.returncode == 1:
        return None
    if exists.returncode != 0:
        raise PodmanError(["image", "exists", ref], exists.returncode, exists.stderr)
    inspected = await podman.run_json("image", "inspect", ref)
    labels = (inspected[0].get("Labels") if inspected else None) or {}
    return str(labels.get(INPUTS_LABEL, ""))


def missing_image_message(ref: str) -> str:
    """A sentence for a person: the image `ref` is missing, and how to make it."""
    for variant in VARIANTS:
        if ref == image_ref(variant):
            return (
                f"The kernel image {ref} is not in Podman's local storage: build it with "
                f"`mcp-forge image build --variant {variant}` (as root; about 2 minutes "
                "the first time)."
            )
    return (
        f"The kernel image {ref} is not in Podman's local storage: pull it "
        f"(`podman pull {ref}`) or build it, e.g. from images/Containerfile; MCP-Forge's "
        "own images are built with `mcp-forge image build --variant default`."
    )


async def build_image(
    variant: str = "default",
    *,
    force: bool = False,
    progress: Callable[[str], None] = print,
) -> BuildResult:
    """Build and tag the variant's kernel image, unless it is up to date.

    Up to date means the tagged image's inputs label equals `inputs_hash(variant)`;
    `force` rebuilds anyway (from the cached base rootfs and wheels). Needs root,
    mmdebstrap and podman; raises ImageError saying what to install or fix.
    `progress` gets one line per step.
    """
    ref = image_ref(variant)
    wanted = inputs_hash(variant)
    started = time.monotonic()
    if not force and await image_status(ref) == wanted:
        progress(f"{ref} is up to date (inputs {wanted[:12]})")
        return BuildResult(ref, built=False, seconds=time.monotonic() - started)
    pip_python = _check_host()

    step = 0

    def announce(text: str) -> None:
        nonlocal step
        step += 1
        progress(f"[{step}/{_STEPS}] {time.monotonic() - started:5.1f}s {text}")

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
    try:
        base = await _base_rootfs(cache, build, announce)
        wheels = await _wheels(variant, pip_python, cache, build, announce)
        rootfs = build / "rootfs"
        announce("kernel venv: offline pip install in a chroot")
        await _make_rootfs(variant, base, wheels, rootfs)
        announce("podman import")
        image_id = await _import(variant, wanted, rootfs, build)
        announce(f"smoke test, then tag {ref}")
        await _smoke_test_and_tag(variant, image_id, ref)
    finally:
        # Nothing is ever mounted inside the build directory, so removing it
        # cannot reach beyond it.
        await asyncio.to_thread(shutil.rmtree, build, ignore_errors=True)
    seconds = time.monotonic() - started
    progress(f"built {ref} in {seconds:.1f}s")
    return BuildResult(ref, built=True, seconds=seconds)


# --- the steps ---------------------------------------------------------------------------


async def _base_rootfs(cache: Path, build: Path, announce: Callable[[str], None]) -> Path:
    """The cached Debian base tarball, made with mmdebstrap if it is not there yet."""
    key = _hash(_base_inputs())[:16]
    cached = cache / f"base-{DEBIAN_SUITE}-{key}.tar"
    if cached.exists():
        announce("debian base rootfs (cached)")
        return cached
    announce(f"debian base rootfs: mmdebstrap {DEBIAN_SUITE} (about 40 s)")
    partial = build / "base.tar"
    await _exec(
        "mmdebstrap",
        "--quiet",
        "--variant=apt",
        f"--include={','.join(DEBIAN_PACKAGES)}",
        *(f"--dpkgopt={option}" for option in DPKG_OPTIONS),
        DEBIAN_SUITE,
        str(partial),
        limit=MMDEBSTRAP_TIMEOUT,
        what="mmdebstrap (making the Debian base rootfs)",
    )
    os.replace(partial, cached)
    await asyncio.to_thread(_remove_stale_bases, cache, keep=cached)
    return cached


async def _wheels(
    variant: str, pip_python: str, cache: Path, build: Path, announce: Callable[[str], None]
) -> Path:
    """A cached directory with every wheel the variant's pins need."""
    requirements = REQUIREMENTS[variant]
    key = _hash({"python": PYTHON_VERSION, "platforms": WHEEL_PLATFORMS, "reqs": requirements})
    cached = cache / f"wheels-{key[:16]}"
    if cached.is_dir():
        announce("wheels (cached)")
        return cached
    announce(f"wheels: host pip downloads {' '.join(requirements)} and dependencies")
    partial = build / "wheels"
    await _exec(
        pip_python,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--abi",
        "cp" + PYTHON_VERSION.replace(".", ""),
        *(arg for name in WHEEL_PLATFORMS for arg in ("--platform", name)),
        "--dest",
        str(partial),
        *requirements,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"},
        limit=PIP_DOWNLOAD_TIMEOUT,
        what="pip download (fetching the kernel's wheels on the host)",
    )
    # Another build may have finished the same download meanwhile; either copy will do.
    with contextlib.suppress(OSError):
        os.rename(partial, cached)
    return cached


async def _make_rootfs(variant: str, base: Path, wheels: Path, rootfs: Path) -> None:
    """Unpack the base, install the kernel's venv in a chroot, add the sandbox user."""
    await asyncio.to_thread(rootfs.mkdir)
    await _exec(
        "tar",
        "--numeric-owner",
        "-xpf",
        str(base),
        "-C",
        str(rootfs),
        limit=TAR_TIMEOUT,
        what="tar (unpacking the base rootfs)",
    )
    inside = rootfs / "tmp" / "wheels"
    await asyncio.to_thread(_link_tree, wheels, inside)
    await _chroot(rootfs, "python3", "-m", "venv", KERNEL_VENV)
    await _chroot(
        rootfs,
        f"{KERNEL_VENV}/bin/pip",
        "install",
        "--no-index",
        "--only-binary=:all:",
        "--find-links",
        "/tmp/wheels",
        *REQUIREMENTS[variant],
    )
    await _chroot(rootfs, f"{KERNEL_VENV}/bin/pip", "uninstall", "--yes", *UNINSTALLED)
    lock = await _chroot(rootfs, f"{KERNEL_VENV}/bin/pip", "freeze", "--all")
    (rootfs / KERNEL_VENV.lstrip("/") / "requirements.lock").write_bytes(lock)
    await asyncio.to_thread(shutil.rmtree, inside)
    await asyncio.to_thread(_finish_rootfs, rootfs)


async def _import(variant: str, inputs: str, rootfs: Path, build: Path) -> str:
    """`podman import` the rootfs, untagged; return the new image's id."""
    archive = build / "image.tar"
    await _exec(
        "tar",
        "--numeric-owner",
        "-C",
        str(rootfs),
        "-cf",
        str(archive),
        ".",
        limit=TAR_TIMEOUT,
        what="tar (packing the rootfs)",
    )
    changes = [arg for change in _import_changes(variant, inputs) for arg in ("--change", change)]
    try:
        done = await podman.run("import", "--quiet", *changes, str(archive), timeout=IMPORT_TIMEOUT)
    except PodmanError as e:
        raise ImageError(f"podman import of the kernel rootfs failed: {e}") from e
    image_id = done.stdout.decode().strip().removeprefix("sha256:")
    if not image_id:
        raise ImageError("podman import printed no image id")
    return image_id


async def _smoke_test_and_tag(variant: str, image_id: str, ref: str) -> None:
    """Run the kernel's imports the way a pod runs them; tag the image only if they work."""
    modules = [_import_name(requirement) for requirement in REQUIREMENTS[variant]]
    code = (
        "import os, sys\n"
        f"import {', '.join(modules)}\n"
        f"assert os.getuid() == {KERNEL_UID}, os.getuid()\n"
        f"assert sys.prefix == {KERNEL_VENV!r}, sys.prefix\n"
    )
    tagged = False
    try:
        await podman.run(
            "run",
            "--rm",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "--network",
            "none",
            image_id,
            "python",
            "-c",
            code,
            timeout=SMOKE_TEST_TIMEOUT,
        )
        previous = await podman.run("image", "inspect", "--format", "{{.Id}}", ref, check=False)
        await podman.run("tag", image_id, ref)
        tagged = True
    except PodmanError as e:
        raise ImageError(f"the new kernel image failed its smoke test or tagging: {e}") from e
    finally:
        if not tagged:  # failed or cancelled: no untagged leftovers either
            await podman.run("rmi", image_id, check=False)
    old_id = previous.stdout.decode().strip() if previous.returncode == 0 else ""
    if old_id and old_id != image_id:
        # The image this tag used to name; still in use or tagged elsewhere, it stays.
        await podman.run("rmi", old_id, check=False)


# --- helpers -----------------------------------------------------------------------------


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise InvalidRequest(f"unknown image variant {variant!r}; choose one of {VARIANTS}")


def _check_host() -> str:
    """Fail early, saying what to install or fix; return the Python whose pip downloads."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ImageError(
            f"`mcp-forge image build` makes x86_64 images only (this host is "
            f"{platform.machine()}); build images/Containerfile with podman build instead"
        )
    if os.geteuid() != 0:
        raise ImageError(
            "building the kernel image needs root: it installs the kernel into the "
            "Debian rootfs with chroot and writes files owned by other users; run "
            "`sudo mcp-forge image build`, or build images/Containerfile with podman build"
        )
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("tar", "tar"), ("chroot", "coreutils")):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed: apt-get install {package}")
    if podman.podman_binary() is None:
        raise ImageError("podman is not installed: apt-get install podman runc")
    if importlib.util.find_spec("pip") is None:
        raise ImageError(
            f"pip is not available to {sys.executable}, which downloads the kernel's "
            "wheels: install it (`python -m ensurepip` or apt-get install python3-pip)"
        )
    return sys.executable


def _base_inputs() -> dict[str, object]:
    return {
        "recipe": RECIPE_VERSION,
        "suite": DEBIAN_SUITE,
        "packages": DEBIAN_PACKAGES,
        "dpkg": DPKG_OPTIONS,
        "arch": "amd64",
    }


def _import_changes(variant: str, inputs: str) -> list[str]:
    """The Dockerfile-style instructions `podman import --change` applies (Podman 4.3 syntax)."""
    return [
        f"ENTRYPOINT {json.dumps(list(KERNEL_ENTRYPOINT))}",
        f"CMD {json.dumps(list(KERNEL_CMD))}",
        *(f"ENV {key}={value}" for key, value in KERNEL_ENV.items()),
        f"USER {KERNEL_UID}",
        f"WORKDIR {WORKSPACE}",
        f"LABEL {VARIANT_LABEL}={variant}",
        f"LABEL org.opencontainers.image.version={__version__}",
        f"LABEL {INPUTS_LABEL}={inputs}",
    ]


def _hash(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _import_name(requirement: str) -> str:
    name = requirement.split("==")[0]
    return {"pillow": "PIL"}.get(name, name)


def _remove_stale_bases(cache: Path, keep: Path) -> None:
    for stale in cache.glob(f"base-{DEBIAN_SUITE}-*.tar"):
        if stale != keep:
            stale.unlink(missing_ok=True)


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link (or copy, across filesystems) every file of `source` into `target`."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        try:
            os.link(item, target / item.name)
        except OSError:
            shutil.copy2(item, target / item.name)


def _finish_rootfs(rootfs: Path) -> None:
    """Add the sandbox user and its directories; drop apt's caches and logs."""
    etc = rootfs / "etc"
    uid = KERNEL_UID
    entries = {
        "passwd": f"sandbox:x:{uid}:{uid}:MCP-Forge sandbox:/home/sandbox:/bin/sh",
        "group": f"sandbox:x:{uid}:",
        "shadow": "sandbox:*:19000:0:99999:7:::",
        "gshadow": "sandbox:!::",
    }
    for name, line in entries.items():
        path = etc / name
        if not path.exists() and name in ("shadow", "gshadow"):
            continue
        text = path.read_text()
        if any(existing.startswith("sandbox:") for existing in text.splitlines()):
            continue
        if text and not text.endswith("\n"):
            text += "\n"
        path.write_text(text + line + "\n")
    for directory, owner in (
        (rootfs / "home" / "sandbox", uid),
        (rootfs / WORKSPACE.lstrip("/"), uid),
        (rootfs / "run" / "mcp-forge", 0),
        (rootfs / "etc" / "mcp-forge", 0),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, owner, owner)
        directory.chmod(0o755)
    for pattern in (
        "var/lib/apt/lists/*",
        "var/cache/apt/*.bin",
        "var/cache/apt/archives/*.deb",
        "var/cache/debconf/*-old",
        "var/log/apt/*",
        "var/log/dpkg.log",
        "var/log/alternatives.log",
    ):
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


async def _chroot(rootfs: Path, *argv: str) -> bytes:
    return await _exec(
        "chroot",
        str(rootfs),
        *argv,
        env=_CHROOT_ENV,
        limit=CHROOT_TIMEOUT,
        what=f"`{' '.join(argv[:3])} …` in the rootfs",
    )


async def _exec(
    program: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    limit: float,
    what: str,
) -> bytes:
    """Run a build tool; return its stdout, or raise ImageError with its stderr's tail.

    On timeout or cancellation the tool's process group gets SIGTERM, time to clean
    up (mmdebstrap unmounts what it mounted), then SIGKILL.
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            program,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        raise ImageError(f"{program} is not installed ({what})") from e
    try:
        async with asyncio.timeout(limit):
            out, err = await proc.communicate()
    except TimeoutError as e:
        await stop(proc)
        raise ImageError(f"{what} took longer than {limit:.0f}s") from e
    except BaseException:
        await stop(proc)
        raise
    if proc.returncode != 0:
        raise ImageError(f"{what} failed (exit {proc.returncode}): {_tail(err)}")
    return out


def _tail(stderr: bytes, limit: int = 2000) -> str:
    return stderr.decode(errors="replace").strip()[-limit:]
