"""Helpers shared by test modules (tests/ is on sys.path: `from support import ...`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import threading
from pathlib import Path

from mcp_forge.errors import ForgeError

log = logging.getLogger(__name__)


def release_state_dir(state_dir: Path) -> None:
    """Delete every session a test run left in `state_dir` — pods, workspace filesystems,
    loop devices, /tmp mounts —, then the directory. Removing the directory alone would
    leave the mounts behind (and empty the workspaces through them)."""
    if (state_dir / "store.db").exists():
        errors: list[BaseException] = []

        def delete_all() -> None:
            from mcp_forge.local import LocalRuntime
            from mcp_forge.settings import Settings

            async def main() -> None:
                runtime = LocalRuntime(Settings(state_dir=state_dir))
                for session in await runtime.list():
                    try:
                        await runtime.delete(session.name, session.namespace)
                    except ForgeError as exc:
                        log.warning("could not delete %s: %s", session.name, exc)

            try:
                asyncio.run(main())
            except BaseException as exc:  # reported below, after the mounts are released
                errors.append(exc)

        # A thread of its own: the caller may be inside a running event loop.
        worker = threading.Thread(target=delete_all)
        worker.start()
        worker.join()
        if errors:
            log.warning("releasing %s: %s", state_dir, errors[0])
    prefix = str(state_dir) + "/"
    targets = [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(prefix)
    ]
    for target in sorted(targets, key=len, reverse=True):
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", target], check=False, capture_output=True)
    shutil.rmtree(state_dir, ignore_errors=True)
