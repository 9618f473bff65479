"""`mcp-forge operator` as its own process never loads the MCP SDK, the gateway or a runtime.

The operator runs on every cluster; the MCP stack (+27 MiB, c076366) belongs to the gateway.
import-linter keeps the static imports apart; this test watches the process itself, lazy
imports included: Python's `-X importtime` logs every module as it is imported, whenever
that is, while the operator takes a real session to Ready and then stops.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import Iterable

from mcp_forge.clients.kube import Kube
from support import scrape

from .conftest import KubeAPI
from .harness import START, ready, session_body

FORBIDDEN = ("mcp", "mcp_types", "mcp_forge.gateway", "mcp_forge.runtimes")
EXPECTED = ("kopf", "mcp_forge.control.handlers")  # the log is the operator's own
HEARD = re.compile(r"Handler 'session_event' succeeded")  # kopf's INFO line: the session seen
METRICS = re.compile(r"Prometheus metrics at (http://\S+)")
STOP_DEADLINE = 30.0  # SIGTERM to exit: kopf runs the cleanup handlers, closes its watches


async def read_until(
    stream: asyncio.StreamReader, lines: list[str], pattern: re.Pattern[str] | None
) -> bool:
    """Append the stream's lines to `lines` until one matches `pattern` (True) or it ends."""
    while line := await stream.readline():
        lines.append(line.decode(errors="replace"))
        if pattern is not None and pattern.search(lines[-1]):
            return True
    return False


def imported(lines: Iterable[str]) -> set[str]:
    """The modules named in `-X importtime` lines ("import time: self | cumulative | name")."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in lines
        if line.startswith("import time:") and "imported package" not in line
    }


def within(modules: set[str], packages: Iterable[str]) -> list[str]:
    """The modules that are one of `packages` or inside one."""
    return sorted(m for m in modules for p in packages if m == p or m.startswith(p + "."))


async def test_the_operator_process_never_imports_the_mcp_sdk_the_gateway_or_a_runtime(
    kube_api: KubeAPI, kube: Kube
) -> None:
    ns = kube_api.namespace
    command = [sys.executable, "-X", "importtime", "-m", "mcp_forge", "operator", "-n", ns]
    command += ["--metrics", "127.0.0.1:0"]
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,  # kopf logs and the import log, in one order
        env=kube_api.env(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    rest: asyncio.Task[bool] | None = None
    try:
        await asyncio.to_thread(kube.create, session_body("plain", ns))
        try:
            async with asyncio.timeout(START):
                heard = await read_until(proc.stdout, lines, HEARD)
        except TimeoutError:
            heard = False
        assert heard, "the operator did not see the session:\n" + "".join(lines[-40:])
        # Drained meanwhile, so a full pipe never blocks the operator.
        rest = asyncio.create_task(read_until(proc.stdout, lines, None))
        await ready(kube, ns, "plain")  # its pod events handled too: the whole loop ran
        where = next(m.group(1) for line in lines if (m := METRICS.search(line)))
        samples = await asyncio.to_thread(scrape, where)
        kind = frozenset({("kind", "KernelSession")})
        assert samples[("mcpforge_reconcile_seconds_count", kind)] >= 1, samples
        assert samples.get(("mcpforge_reconcile_errors_total", kind), 0) == 0
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(STOP_DEADLINE):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if rest is not None:
            await rest  # the process is gone: its output ends
    tail = "".join(lines[-40:])
    assert proc.returncode == 0, f"the operator exited with {proc.returncode}:\n{tail}"

    modules = imported(lines)
    assert [m for m in EXPECTED if m not in modules] == [], tail
    loaded = within(modules, FORBIDDEN)
    assert loaded == [], f"the operator imported {len(loaded)} of them: {', '.join(loaded[:5])}…"
