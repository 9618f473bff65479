"""Notebook export off the gateway's event loop: notebook.build runs in a worker process
(`python -m mcp_forge.gateway.notebook_worker`), confined (confine.py: an unprivileged
user in a sandbox with no network and none of the gateway's files, at a low priority)
under a wall-time cap, an address-space cap and a CPU-time cap, fed the journal on
stdin; what it writes back is read up to the size limit and no further. A journal is
the kernel's: whatever it holds, the gateway's loop only copies bytes, and other
clients' calls are served meanwhile.

Exports are also counted (ExportSlots): a client past its share gets a clear error at
once, instead of queueing workers that hold memory; other clients are unaffected.

The worker's stdout: one JSON line (the counts, or the error), then the notebook.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from mcp_forge import confine
from mcp_forge.errors import InvalidRequest, KernelProtocolError, redact
from mcp_forge.gateway.notebook import Notebook, NotebookTooLarge, build

log = logging.getLogger(__name__)

HEAD_MAX = 4_096  # the worker's JSON line
STDERR_MAX = 4_096  # kept for the log
OPEN_FILES = 64  # it reads stdin and writes stdout; Python opens its modules
EXIT_MEMORY = 3  # the worker ran out of its memory cap
# The worker parses the kernel's bytes: it gets none of the gateway's environment (its
# tokens, its kubeconfig), only what finds our package.
_ENV = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH")}


@dataclass(frozen=True)
class WorkerLimits:
    size: int  # bytes of the notebook (the file limit)
    seconds: float  # wall time of the worker
    memory: int  # bytes of the worker's address space


async def build_in_worker(
    journal: bytes | AsyncIterator[bytes], *, session: str, limits: WorkerLimits
) -> Notebook:
    """The notebook of `journal` (its bytes, or its parts as they are read: the gateway
    then holds one part at a time), built by a worker process within `limits`."""
    argv = confine.command(
        [sys.executable, "-P", "-m", __name__, session, str(limits.size)],
        limits=confine.Limits(
            memory=limits.memory,
            cpu_seconds=max(1, int(limits.seconds) + 1),  # SIGXCPU: a backstop to the wall cap
            open_files=OPEN_FILES,
            file_size=0,
        ),
        what="the notebook worker",
    )
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_ENV,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out = asyncio.create_task(_read(proc.stdout, limits.size + HEAD_MAX))
    err = asyncio.create_task(_read(proc.stderr, STDERR_MAX))
    fed = 0
    try:
        async with asyncio.timeout(limits.seconds):
            fed = await _feed(proc.stdin, journal)
            code = await proc.wait()
            answer = _answer(await out, await err, code, session=session, limits=limits)
    except TimeoutError:
        raise KernelProtocolError(
            f"building the notebook of {session!r} took over {limits.seconds:g} s "
            f"(MCPFORGE_NOTEBOOK_TIMEOUT) and was stopped, {fed} bytes of its journal "
            "in: read the journal (.mcp-forge/notebook.jsonl) with read_file in parts"
        ) from None
    finally:
        await confine.reap(proc, f"the notebook worker of {session!r}")
        for task in (out, err):
            task.cancel()
        await asyncio.gather(out, err, return_exceptions=True)
    return answer


def _answer(out: bytes, err: bytes, code: int, *, session: str, limits: WorkerLimits) -> Notebook:
    head, _, text = out.partition(b"\n")
    try:
        counts = json.loads(head) if code in (0, EXIT_MEMORY) else None
    except ValueError:
        counts = None
    if isinstance(counts, dict) and counts.get("error") == "too large":
        raise InvalidRequest(
            f"the notebook of {session!r} would be over the file limit ({limits.size} bytes) "
            "even with every cell's outputs left out: its code alone is too long. Its "
            "journal is .mcp-forge/notebook.jsonl in the workspace (one JSON line per "
            "cell): read it with read_file in parts, or trim it with code"
        )
    if code == EXIT_MEMORY:
        raise KernelProtocolError(
            f"building the notebook of {session!r} needed over {limits.memory} bytes of "
            "memory (MCPFORGE_NOTEBOOK_MEMORY_MAX) and was stopped: its journal holds "
            "too many outputs; read it with read_file in parts"
        )
    if code != 0 or not isinstance(counts, dict) or len(text) > limits.size:
        raise KernelProtocolError(
            f"the notebook of {session!r} could not be built (worker exit {code}: "
            f"{redact(err.decode(errors='replace').strip())[-500:]})"
        )
    return Notebook(
        text=text.decode(),
        cells=int(counts["cells"]),
        skipped=int(counts["skipped"]),
        omitted=int(counts["omitted"]),
    )


async def _feed(stdin: asyncio.StreamWriter, journal: bytes | AsyncIterator[bytes]) -> int:
    """Write the journal to the worker; the bytes written (fewer if it ended early)."""
    fed = 0
    parts = _once(journal) if isinstance(journal, bytes) else journal
    try:
        async with contextlib.aclosing(parts):  # type: ignore[type-var]
            async for part in parts:
                stdin.write(part)
                await stdin.drain()
                fed += len(part)
        stdin.close()
        await stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        pass  # it ended: its exit code says why
    return fed


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _read(stream: asyncio.StreamReader, most: int) -> bytes:
    """At most `most` bytes, then the stream is drained and dropped (never buffered)."""
    kept = bytearray()
    while chunk := await stream.read(65_536):
        if len(kept) < most:
            kept += chunk[: most - len(kept)]
    return bytes(kept)


class ExportSlots:
    """How many exports run at once: at most `total`, and `per_client` for one client."""

    def __init__(self, *, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        mine = self._held.get(client, 0)
        if mine >= self.per_client:
            raise InvalidRequest(
                f"{mine} notebook export(s) of yours are running, the most one client may "
                "run at once: wait for them to end, then export again"
            )
        if sum(self._held.values()) >= self.total:
            raise InvalidRequest(
                f"the gateway is running {self.total} notebook exports, its most at once: "
                "export again in a moment"
            )
        self._held[client] = mine + 1
        try:
            yield
        finally:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]


def main(argv: list[str]) -> int:
    """The worker: the journal on stdin, the counts line and the notebook on stdout.
    Its limits (memory, CPU time, files) were set before it started (confine.py)."""
    session, size = argv[0], int(argv[1])
    out = sys.stdout.buffer
    try:
        nb = build(sys.stdin.buffer.read(), session=session, limit=size)
    except NotebookTooLarge:
        out.write(b'{"error": "too large"}\n')
        return 0
    except MemoryError:
        return EXIT_MEMORY
    counts = {"cells": nb.cells, "skipped": nb.skipped, "omitted": nb.omitted}
    out.write(json.dumps(counts).encode() + b"\n")
    out.write(nb.text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
