"""The Podman CLI, called asynchronously.

We drive Podman through its CLI rather than podman-py: podman-py is synchronous
(requests) and needs the Podman API service running, while `podman kube play`,
`podman wait` and `podman events` are first-class CLI features that asyncio
subprocesses make cancellable with nothing else running on the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from mcp_forge.errors import PodmanError


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: bytes
    stderr: str


def podman_binary() -> str | None:
    return os.environ.get("MCPFORGE_PODMAN") or shutil.which("podman")


async def run(
    *args: str, input: bytes | None = None, check: bool = True, timeout: float = 120.0
) -> Completed:
    """Run `podman ARGS...`; raise PodmanError on a non-zero exit when `check`."""
    binary = podman_binary()
    if binary is None:
        raise PodmanError(list(args), 127, "podman is not installed (apt-get install podman runc)")
    proc = await asyncio.create_subprocess_exec(
        binary,
        *args,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # Its own session: a Ctrl-C or SIGTERM aimed at our process group must not kill
        # podman halfway through removing a pod; we stop it ourselves if we must.
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(input)
    except TimeoutError:
        await _reap(proc)
        raise PodmanError(list(args), -1, f"timed out after {timeout:g}s") from None
    except BaseException:
        await _reap(proc)
        raise
    assert proc.returncode is not None
    done = Completed(proc.returncode, out, err.decode(errors="replace"))
    if check and done.returncode != 0:
        raise PodmanError(list(args), done.returncode, done.stderr)
    return done


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await asyncio.shield(proc.wait())


async def run_json(*args: str, timeout: float = 60.0) -> Any:
    done = await run(*args, timeout=timeout)
    text = done.stdout.decode().strip()
    return json.loads(text) if text else None
