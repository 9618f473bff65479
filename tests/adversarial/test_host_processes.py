"""Host processes that parse a kernel's bytes are confined: the notebook export worker.

A journal is written by kernel code; the worker that turns it into a notebook runs on the
host. Caught while it waits for the rest of its journal, it must be an unprivileged user
with no capabilities, no network, at a low priority, in namespaces of its own whose root
shows none of the gateway's files. (The host's pip: test_supply_chain.py.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from mcp_forge.gateway.notebook import JOURNAL_VERSION
from mcp_forge.gateway.notebook_worker import WorkerLimits, build_in_worker

from .confinement import confinement, processes

FIRST = 20_000  # cells in the journal's first part, about 1.5 MB


def cell(n: int) -> bytes:
    record = {"v": JOURNAL_VERSION, "execution_count": n, "source": f"x = {n}", "outputs": []}
    return json.dumps(record).encode() + b"\n"


async def test_the_notebook_worker_is_unprivileged_offline_and_sees_no_host_files(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "gateway-state" / "token"
    secret.parent.mkdir()
    secret.write_text("secret")
    session = f"confined-{tmp_path.name}"
    fed, rest = asyncio.Event(), asyncio.Event()
    first = b"".join(cell(n) for n in range(1, FIRST + 1))

    async def journal() -> AsyncIterator[bytes]:
        yield first  # past the pipe's buffer: written only as the worker reads it
        fed.set()
        await rest.wait()
        yield cell(FIRST + 1)

    limits = WorkerLimits(size=20_000_000, seconds=60, memory=400_000_000)
    building = asyncio.ensure_future(build_in_worker(journal(), session=session, limits=limits))
    try:
        async with asyncio.timeout(30):
            await asyncio.wait(
                [asyncio.ensure_future(fed.wait()), building], return_when=asyncio.FIRST_COMPLETED
            )
        assert not building.done(), building.result()
        [pid] = processes(argv_has=session.encode())
        # The checkout's other files: its Python package is there, read-only, nothing else.
        seen = confinement(pid, [secret, Path("/etc/shadow"), Path.cwd() / "pyproject.toml"])
    finally:
        rest.set()
    notebook = await building
    assert notebook.cells == FIRST + 1, notebook
    assert seen.unprivileged(), seen
    assert seen.own_mounts and seen.own_pids and seen.own_network, seen
    assert seen.interfaces == ["lo"], seen
    assert seen.visible == [], seen
    assert seen.nice > 0, seen
    assert seen.limits["Max address space"] != "unlimited", seen
    assert seen.limits["Max open files"] not in ("unlimited", "1048576"), seen
