"""CRIU on this host: whether Podman's runc can checkpoint and restore a kernel with it.

Live snapshots (issue 27) checkpoint a kernel's container with `podman container
checkpoint`, which runs runc, which runs the `criu` found on its PATH. Debian 12's criu
(3.17) fails on our kernels, and 4.1 cannot dump a kernel on Linux 6.18; images/criu/build
installs 4.2.1 as /usr/local/sbin/criu, ahead of Debian's on root's PATH, with our patch
that restores a kernel into its pod's user namespace (images/criu/restore-into-userns.patch;
its `criu --version` says so in its GitID). `probe` runs the one runc would find.
"""

from __future__ import annotations

import asyncio
import re
import shutil

PATCHED = "mcp-forge.restore-into-userns"  # in `criu --version`'s GitID
MINIMUM = (4, 2)  # 3.17 fails `criu check` on 6.x; 4.1 asks INET sockets for SO_PASSCRED
FIX = "bash images/criu/build --check  (CRIU 4.2.1 from Debian's source archive, cached)"
CHECK_DEADLINE = 60.0


async def _run(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        async with asyncio.timeout(CHECK_DEADLINE):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, f"no answer in {CHECK_DEADLINE:.0f}s"
    return proc.returncode or 0, out.decode(errors="replace")


def version_of(text: str) -> tuple[int, ...] | None:
    """(4, 1, 1) from `criu --version`'s "Version: 4.1.1"."""
    found = re.search(r"Version:\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in found.group(1).split(".")) if found else None


async def probe() -> tuple[bool, str]:
    """(whether the criu on PATH is new enough and `criu check` says it works here, what
    was found or what is wrong)."""
    path = shutil.which("criu")
    if path is None:
        return False, "criu is not installed"
    code, out = await _run(path, "--version")
    version = version_of(out) if code == 0 else None
    if version is None:
        return False, f"{path} --version: {out.strip()[-200:] or f'exit {code}'}"
    shown = ".".join(map(str, version))
    if version < MINIMUM:
        return False, f"{path} is CRIU {shown}; live snapshots need 4.2 or later"
    if PATCHED not in out:
        return False, (
            f"{path} is CRIU {shown} without our patch: it cannot restore a kernel into its "
            "pod's user namespace"
        )
    code, out = await _run(path, "check")
    if code != 0 or "Looks good" not in out:
        return False, f"{path} (CRIU {shown}): criu check: {out.strip()[-300:] or f'exit {code}'}"
    return True, f"{path} (CRIU {shown}): criu check looks good"
