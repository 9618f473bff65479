"""Source distributions built into wheels in a sandbox container, never on the host.

A package's build backend is the package's code. It runs in a container of the kernel
image (kernelside/build.py), started with `podman run`: as the image's unprivileged user
in a user namespace of its own (`--userns=auto`), no network, no capabilities, no new
privileges, the kernels' seccomp profile, a read-only root, a bounded /tmp, memory,
pids and CPU limits (one core, a low weight), no environment of the gateway's (not its
proxy variables or hosts file), nothing of the host but its input, mounted
read-only: the sdist and the wheels of its build requirements. The wheel comes back on
its stdout, bounded; nothing of the host is writable from inside.

A build is two runs: the first reads the build requirements from the sdist (in the
sandbox: the archive is untrusted), the host checks them against the policy and fetches
them as wheels (wheels/fetch.py), the second builds offline from those only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_forge.errors import PackageError, PackageTooLarge, redact
from mcp_forge.image.processes import tail
from mcp_forge.kernelside import source
from mcp_forge.logsafe import shown
from mcp_forge.sandbox import KERNEL_UID, kernel_image

log = logging.getLogger(__name__)

HEADER_MAX = 64_000  # bytes of the sandbox's JSON line
STDERR_KEPT = 4_000  # bytes of its error output kept for the message
MEMORY = "2g"
TMP_SIZE = "1g"
PIDS = 512
CPUS = "1"  # of the host's cores, at a low weight (--cpu-shares): sessions come first
KERNEL_PYTHON = "/opt/kernel/bin/python"  # image/kernel.py's KERNEL_VENV
# The kernel pods' own seccomp profile (docs/seccomp.md): no new namespaces, keyrings,
# mounts or ptrace for a build either.
SECCOMP = Path(__file__).parents[1] / "profiles" / "kernel-seccomp.json"


@dataclass(frozen=True)
class Built:
    filename: str
    data: bytes


def command(name: str, inputs: Path, mode: str, sdist: str, seconds: float) -> list[str]:
    """The `podman run` of one sandboxed step (see the module docstring)."""
    return [
        "podman", "run", "--rm", "--name", name,
        "--network=none", "--no-hosts", "--http-proxy=false",
        "--userns=auto", f"--user={KERNEL_UID}:{KERNEL_UID}",
        "--read-only", "--read-only-tmpfs=false",
        f"--tmpfs=/tmp:rw,nosuid,nodev,size={TMP_SIZE},mode=1777",
        "--cap-drop=all", "--security-opt=no-new-privileges",
        f"--security-opt=seccomp={SECCOMP}",
        f"--memory={MEMORY}", f"--memory-swap={MEMORY}", f"--pids-limit={PIDS}",
        f"--cpus={CPUS}", "--cpu-shares=128",
        "--env", f"BUILD_SECONDS={seconds:.0f}", "--workdir=/tmp",
        "--pull=never", "--log-driver=none",
        "--volume", f"{inputs}:/in:ro",
        kernel_image(), KERNEL_PYTHON, "-I", "-c", source("build"), mode, f"/in/{sdist}",
    ]  # fmt: skip


async def build_requires(inputs: Path, sdist: str, seconds: float) -> list[str]:
    """The build requirements the sdist `inputs/sdist` names, read in the sandbox."""
    header, _ = await _run(inputs, "requires", sdist, seconds, 0)
    found = header.get("requires")
    if not isinstance(found, list) or not all(isinstance(r, str) for r in found):
        raise PackageError(f"the sandbox's answer for {sdist!r} is malformed")
    return [str(r) for r in found]


async def build_wheel(inputs: Path, sdist: str, seconds: float, file_max: int) -> Built:
    """The wheel the sandbox built from `inputs/sdist`, with `inputs/deps` as its only
    source of build requirements; PackageTooLarge past `file_max`."""
    header, data = await _run(inputs, "build", sdist, seconds, file_max)
    name = header.get("wheel")
    if not isinstance(name, str) or "/" in name or not name.endswith(".whl"):
        raise PackageError(f"the sandbox's answer for {sdist!r} is malformed")
    return Built(name, data)


async def _run(
    inputs: Path, mode: str, sdist: str, seconds: float, file_max: int
) -> tuple[dict[str, Any], bytes]:
    if shutil.which("podman") is None:
        raise PackageError(
            "source distributions are built in a Podman sandbox, and this gateway's host "
            "has no podman; ask for a package that has a wheel"
        )
    name = f"mcp-forge-build-{secrets.token_hex(6)}"
    proc = await asyncio.create_subprocess_exec(
        *command(name, inputs, mode, sdist, seconds),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    errors = asyncio.ensure_future(tail(proc.stderr, STDERR_KEPT))
    header: dict[str, Any] = {}
    try:
        async with asyncio.timeout(seconds + 30):
            header, data = await _answer(proc.stdout, sdist, file_max)
            await proc.wait()
    except TimeoutError:
        raise PackageError(f"building {sdist!r} took longer than {seconds:.0f}s") from None
    finally:
        if proc.returncode is None:
            await _remove(name, proc)
        stderr = await errors
        if not header or proc.returncode:  # Podman's own words, host paths and all: the log's
            log.warning("build sandbox for %s: %s", shown(sdist), shown(stderr, 2000))
    if "error" in header:
        detail = redact(" | ".join(stderr.strip().splitlines()[-3:]))[-800:]
        raise PackageError(
            f"{sdist!r} could not be built: {str(header['error'])[:500]}"
            + (f" ({detail})" if detail else "")
        )
    if proc.returncode:
        raise PackageError(f"the build sandbox for {sdist!r} exited {proc.returncode}")
    return header, data


async def _answer(
    stdout: asyncio.StreamReader, sdist: str, file_max: int
) -> tuple[dict[str, Any], bytes]:
    try:
        line = await stdout.readuntil(b"\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        raise PackageError(
            f"the build sandbox for {sdist!r} gave no answer (the gateway's log has why)"
        ) from None
    try:
        header = json.loads(line[:HEADER_MAX])
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise PackageError(f"the sandbox's answer for {sdist!r} is malformed")
    size = header.get("size", 0)
    if not isinstance(size, int) or size < 0:
        raise PackageError(f"the sandbox's answer for {sdist!r} is malformed")
    if size > file_max:
        raise PackageTooLarge(
            f"the wheel built from {sdist!r} is {size} bytes; the limit for one file is {file_max}"
        )
    try:
        data = await stdout.readexactly(size)
    except asyncio.IncompleteReadError:
        raise PackageError(f"the build sandbox for {sdist!r} sent a cut wheel") from None
    return header, data


async def _remove(name: str, proc: asyncio.subprocess.Process) -> None:
    """Remove the container whatever state it is in, then reap `podman run`."""
    rm = await asyncio.create_subprocess_exec(
        "podman", "rm", "--force", "--time=0", name,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            await asyncio.shield(rm.wait())
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            await asyncio.shield(proc.wait())
