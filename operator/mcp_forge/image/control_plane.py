"""The operator, gateway and egress images, built from this checkout with no container
registry.

images/Containerfile.control-plane defines them for hosts that can pull a base image. Here
they are made as the kernel image is (kernel.py): the cached Debian base rootfs; wheels the
host's pip fetches (the project's own, built from this source tree, and its dependencies
for CPython 3.11 on x86_64); an offline `pip install` into /opt/mcp-forge in a chroot
(the dependencies' venvs cached by their wheels, our package installed into them). The
egress proxy's mitmproxy caps cryptography, pyOpenSSL, h11 and tornado below the
package's own dependencies, so it has a second venv, /opt/mcp-forge-egress, holding
mitmproxy and our package without its dependencies (as `.venv-egress` does locally).
One rootfs holds both venvs; one `podman import` per image, the three differing only in
entrypoint and arguments, as the Containerfile's targets do. They are tagged with the
names manifests/ uses (`ghcr.io/mcp-forge/operator:VERSION`, `…/gateway:VERSION`,
`…/egress:VERSION`), so a node that has them (`podman save` into its runtime) runs
`kubectl apply -k manifests/base` unchanged.

An image whose inputs label (a hash of the source tree, the base and the recipe) matches is
not built again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mcp_forge import __version__
from mcp_forge.clients import podman
from mcp_forge.errors import ImageError, PodmanError
from mcp_forge.image.kernel import (
    DEBIAN_SUITE,
    INPUTS_LABEL,
    PYTHON_VERSION,
    SMOKE_TEST_TIMEOUT,
    TAR_TIMEOUT,
    WHEEL_PLATFORMS,
    BuildResult,
    _base_inputs,
    _base_rootfs,
    _check_host,
    _chroot,
    _exec,
    _hash,
    _link_tree,
    cache_dir,
    image_status,
)

SOURCE = Path(__file__).resolve().parents[3]  # the checkout: pyproject.toml, operator/, crds/
VENV = "/opt/mcp-forge"
EGRESS_VENV = "/opt/mcp-forge-egress"
# The egress proxy's one pin: the last mitmproxy for Python 3.11 (docs/design.md §15),
# whose functions egress/server.py checks before it wraps them. .ci/setup reads it here
# for .venv-egress; images/Containerfile.control-plane repeats it (a test keeps them equal).
MITMPROXY = "mitmproxy==11.0.2"
EGRESS_RUN = "/run/mcp-forge-egress"  # the proxy's and the feeder's sockets, in their pod
UID = 10001
RECIPE_VERSION = "1"
# name -> (entrypoint, default arguments): images/Containerfile.control-plane's targets.
TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "operator": (
        [f"{VENV}/bin/mcp-forge", "operator"],
        ["--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"],
    ),
    "gateway": (
        [f"{VENV}/bin/mcp-forge", "gateway", "--kubernetes"],
        ["--http", "0.0.0.0:8765", "--tokens-file", "/etc/mcp-forge/tokens/tokens"],
    ),
    # The proxy. The feeder beside it in its pod runs `mcp-forge egress-feeder` from
    # VENV in the same image (manifests/base/common/egress.yaml).
    "egress": (
        [f"{EGRESS_VENV}/bin/python", "-I", "-m", "mcp_forge.egress.server"],
        [
            "--listen", "0.0.0.0:3128",
            "--control-socket", f"{EGRESS_RUN}/control.sock",
            "--audit-socket", f"{EGRESS_RUN}/audit.sock",
            "--confdir", "/tmp/mitmproxy",
        ],
    ),
}  # fmt: skip
# What each image runs before it is tagged (read-only root, no network): its entrypoint
# with --help; for the proxy, which has no --help of its own to show, its imports.
SMOKE_TESTS: dict[str, list[str]] = {
    "operator": [*TARGETS["operator"][0], "--help"],
    "gateway": [*TARGETS["gateway"][0], "--help"],
    "egress": [
        f"{EGRESS_VENV}/bin/python", "-I", "-c", "import mitmproxy, mcp_forge.egress.protocol"
    ],
}  # fmt: skip
ENV = {
    "PATH": f"{VENV}/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
WHEEL_TIMEOUT = 600.0


def image_ref(name: str) -> str:
    """`ghcr.io/mcp-forge/<name>:<version>`, as manifests/base names it."""
    return f"ghcr.io/mcp-forge/{name}:{__version__}"


def source_files() -> list[Path]:
    """What the package is built from (the same files the wheel takes)."""
    files = [
        SOURCE / "pyproject.toml",
        SOURCE / "README.md",
        SOURCE / "crds" / "kernelsession.yaml",
        SOURCE / "crds" / "kernelsessionpool.yaml",
    ]
    files += sorted(
        p for p in (SOURCE / "operator" / "mcp_forge").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )  # fmt: skip
    return files


def inputs_hash() -> str:
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return _hash(
        {
            "recipe": RECIPE_VERSION,
            "base": _base_inputs(),
            "python": PYTHON_VERSION,
            "platforms": WHEEL_PLATFORMS,
            "mitmproxy": MITMPROXY,
            "source": digest.hexdigest(),
            "targets": TARGETS,
            "env": ENV,
        }
    )


async def build_control_plane(
    *, force: bool = False, progress: Callable[[str], None] = print
) -> list[BuildResult]:
    """Build and tag the three images unless they are up to date; needs root, like kernel.py."""
    if not (SOURCE / "pyproject.toml").exists():
        raise ImageError(
            "the control-plane images are built from a checkout of MCP-Forge (pyproject.toml, "
            f"operator/, crds/), and {SOURCE} is not one"
        )
    wanted = inputs_hash()
    started = time.monotonic()
    refs = [image_ref(name) for name in TARGETS]
    if not force and all([await image_status(ref) == wanted for ref in refs]):
        progress(f"{', '.join(refs)} are up to date (inputs {wanted[:12]})")
        return [BuildResult(ref, built=False, seconds=time.monotonic() - started) for ref in refs]
    pip_python = _check_host()

    def announce(text: str) -> None:
        progress(f"{time.monotonic() - started:5.1f}s {text}")

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-control-plane-", dir=cache))
    try:
        base = await _base_rootfs(cache, build, announce)
        own = await _wheels(pip_python, build, announce)
        egress_wheels = await _egress_wheels(pip_python, cache, build, announce)
        announce(f"venvs {VENV} and {EGRESS_VENV}: offline pip installs in a chroot")
        rootfs = build / "rootfs"
        await _make_rootfs(base, own, egress_wheels, rootfs, cache)
        archive = build / "image.tar"
        await _exec(
            "tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), ".",
            limit=TAR_TIMEOUT, what="tar (packing the rootfs)",
        )  # fmt: skip
        results = []
        for name, (entrypoint, cmd) in TARGETS.items():
            announce(f"podman import, smoke test, tag {image_ref(name)}")
            await _import_and_tag(archive, name, entrypoint, cmd, wanted)
            results.append(
                BuildResult(image_ref(name), built=True, seconds=time.monotonic() - started)
            )
    finally:
        await asyncio.to_thread(shutil.rmtree, build, ignore_errors=True)
    progress(f"built {', '.join(refs)} in {time.monotonic() - started:.1f}s")
    return results


async def _wheels(pip_python: str, build: Path, announce: Callable[[str], None]) -> Path:
    """The package's wheel, built from this checkout, in a directory with its dependencies."""
    announce("wheels: mcp-forge from this checkout, its dependencies from the index")
    wheels = build / "wheels"
    await _exec(
        pip_python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
        str(wheels), str(SOURCE), limit=WHEEL_TIMEOUT, what="pip wheel (mcp-forge)",
    )  # fmt: skip
    (own,) = wheels.glob("mcp_forge-*.whl")
    await _download(pip_python, wheels, str(own), what="the control plane's dependencies")
    return own


async def _egress_wheels(
    pip_python: str, cache: Path, build: Path, announce: Callable[[str], None]
) -> Path:
    """A cached directory of wheels for MITMPROXY and its dependencies.

    Some are sources only on PyPI (pyperclip 1.9.0, pure Python), and a download for
    another platform takes wheels only: so the host's pip first makes wheels of them all
    (building those, fetching the rest for this host, the same x86_64), and the download
    for the image's platform takes the ones built here from there.
    """
    key = _hash({"python": PYTHON_VERSION, "platforms": WHEEL_PLATFORMS, "reqs": MITMPROXY})
    cached = cache / f"wheels-egress-{key[:16]}"
    if cached.is_dir():
        announce("wheels for the egress venv (cached)")
        return cached
    announce(f"wheels for the egress venv: {MITMPROXY} and its dependencies")
    built = build / "egress-built"
    await _exec(
        pip_python, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(built), MITMPROXY,
        limit=WHEEL_TIMEOUT, what=f"pip wheel ({MITMPROXY} and its dependencies, on the host)",
    )  # fmt: skip
    partial = build / "egress-wheels"
    await _download(
        pip_python, partial, "--find-links", str(built), MITMPROXY, what="the egress venv's wheels"
    )
    # Another build may have finished the same download meanwhile; either copy will do.
    with contextlib.suppress(OSError):
        os.rename(partial, cached)
    return cached


async def _download(pip_python: str, dest: Path, *args: str, what: str) -> None:
    """`pip download` of wheels for the image's Python and platform into `dest`."""
    await _exec(
        pip_python, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", "cp",
        "--abi", "cp" + PYTHON_VERSION.replace(".", ""),
        *(arg for name in WHEEL_PLATFORMS for arg in ("--platform", name)),
        "--dest", str(dest), *args,
        limit=WHEEL_TIMEOUT, what=f"pip download ({what})",
    )  # fmt: skip


async def _make_rootfs(
    base: Path, own: Path, egress_wheels: Path, rootfs: Path, cache: Path
) -> None:
    """Unpack the base; both venvs with their dependencies (cached: `_dependencies`), our
    package installed into each offline in a chroot; add the images' user."""
    await asyncio.to_thread(rootfs.mkdir)
    await _exec(
        "tar", "--numeric-owner", "-xpf", str(base), "-C", str(rootfs),
        limit=TAR_TIMEOUT, what="tar (unpacking the base rootfs)",
    )  # fmt: skip
    inside = rootfs / "tmp"
    await asyncio.to_thread(_link_tree, own.parent, inside / "wheels")
    await asyncio.to_thread(_link_tree, egress_wheels, inside / "egress-wheels")
    venvs = await _dependencies(rootfs, own, egress_wheels, cache)
    await _exec(
        "tar", "--numeric-owner", "-xpf", str(venvs), "-C", str(rootfs),
        limit=TAR_TIMEOUT, what="tar (unpacking the venvs' dependencies)",
    )  # fmt: skip
    for venv in (VENV, EGRESS_VENV):
        await _pip(rootfs, venv, "--no-deps", f"/tmp/wheels/{own.name}")
        lock = await _chroot(rootfs, f"{venv}/bin/pip", "freeze", "--all")
        (rootfs / venv.lstrip("/") / "requirements.lock").write_bytes(lock)
    for name in ("wheels", "egress-wheels"):
        await asyncio.to_thread(shutil.rmtree, inside / name)
    await asyncio.to_thread(_add_user, rootfs)


async def _dependencies(rootfs: Path, own: Path, egress_wheels: Path, cache: Path) -> Path:
    """An archive of both venvs holding every dependency and not our package, cached by
    the base and the wheels' names (names and versions): most builds change our source
    only, and its install is then seconds, where the venvs' are half a minute. Made in
    `rootfs` (the base unpacked, the wheels in its /tmp), then removed from it."""
    key = await asyncio.to_thread(_dependencies_key, own, egress_wheels)
    cached = cache / f"venvs-control-plane-{key[:16]}.tar"
    if await asyncio.to_thread(cached.is_file):
        return cached
    package = f"/tmp/wheels/{own.name}"
    for venv, installs in (
        (VENV, ["--find-links", "/tmp/wheels", package]),
        (EGRESS_VENV, ["--find-links", "/tmp/egress-wheels", MITMPROXY]),
    ):
        await _chroot(rootfs, "python3", "-m", "venv", venv)
        await _pip(rootfs, venv, *installs)
    await _chroot(rootfs, f"{VENV}/bin/pip", "uninstall", "--yes", "mcp-forge")
    partial = cache / f"{cached.name}.{os.getpid()}.partial"
    await _exec(
        "tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial),
        VENV.lstrip("/"), EGRESS_VENV.lstrip("/"),
        limit=TAR_TIMEOUT, what="tar (packing the venvs' dependencies)",
    )  # fmt: skip
    for venv in (VENV, EGRESS_VENV):
        await asyncio.to_thread(shutil.rmtree, rootfs / venv.lstrip("/"))
    await asyncio.to_thread(_keep_only, partial, cached)
    return cached


def _dependencies_key(own: Path, egress_wheels: Path) -> str:
    return _hash(
        {
            "recipe": RECIPE_VERSION,
            "base": _base_inputs(),
            "python": PYTHON_VERSION,
            "wheels": sorted(p.name for p in own.parent.glob("*.whl") if p != own),
            "egress": sorted(p.name for p in egress_wheels.glob("*.whl")),
            "venvs": [VENV, EGRESS_VENV],
        }
    )


def _keep_only(partial: Path, cached: Path) -> None:
    """`partial` becomes `cached`, the one archive of venvs kept (older ones were built
    from wheels no longer asked for)."""
    for stale in cached.parent.glob("venvs-control-plane-*.tar"):
        stale.unlink(missing_ok=True)
    os.rename(partial, cached)


async def _pip(rootfs: Path, venv: str, *args: str) -> None:
    """`pip install` into the rootfs's venv: offline, wheels only."""
    await _chroot(rootfs, f"{venv}/bin/pip", "install", "--no-index", "--only-binary=:all:", *args)


async def _import_and_tag(
    archive: Path, name: str, entrypoint: list[str], cmd: list[str], inputs: str
) -> None:
    """Import the rootfs as the image `name`, smoke-test it, tag it; drop the one it replaces."""
    ref = image_ref(name)
    changes = [
        f"ENTRYPOINT {json.dumps(entrypoint)}",
        f"CMD {json.dumps(cmd)}",
        *(f"ENV {key}={value}" for key, value in ENV.items()),
        f"USER {UID}:{UID}",
        "WORKDIR /tmp",
        "LABEL org.opencontainers.image.title=mcp-forge",
        f"LABEL org.opencontainers.image.version={__version__}",
        f"LABEL dev.mcpforge.debian={DEBIAN_SUITE}",
        f"LABEL {INPUTS_LABEL}={inputs}",
    ]
    args = [arg for change in changes for arg in ("--change", change)]
    image_id, tagged = "", False
    try:
        done = await podman.run("import", "--quiet", *args, str(archive), timeout=TAR_TIMEOUT)
        image_id = done.stdout.decode().strip().removeprefix("sha256:")
        # As a pod runs it: a read-only root, no network.
        program, *argv = SMOKE_TESTS[name]
        await podman.run(
            "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--network", "none",
            "--entrypoint", program, image_id, *argv, timeout=SMOKE_TEST_TIMEOUT,
        )  # fmt: skip
        previous = await podman.run("image", "inspect", "--format", "{{.Id}}", ref, check=False)
        await podman.run("tag", image_id, ref)
        tagged = True
    except PodmanError as e:
        raise ImageError(f"the {name} image failed its import, smoke test or tagging: {e}") from e
    finally:
        if image_id and not tagged:  # failed or cancelled: no untagged leftovers either
            await podman.run("rmi", image_id, check=False)
    old_id = previous.stdout.decode().strip() if previous.returncode == 0 else ""
    if old_id and old_id != image_id:
        # The image the tag named before (each is the whole rootfs); kept if still in use.
        await podman.run("rmi", old_id, check=False)


def _add_user(rootfs: Path) -> None:
    """The images' user (uid and gid 10001, home /tmp), as the Containerfile adds it."""
    for name, line in (
        ("passwd", f"mcp-forge:x:{UID}:{UID}:MCP-Forge:/tmp:/usr/sbin/nologin"),
        ("group", f"mcp-forge:x:{UID}:"),
    ):
        path = rootfs / "etc" / name
        text = path.read_text()
        if f"mcp-forge:x:{UID}" not in text:
            path.write_text(text.rstrip("\n") + "\n" + line + "\n")
