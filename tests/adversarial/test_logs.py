"""The gateway's log under kernel code that writes into it (issue 23): the server and
tool names of its bridge calls, and the text of its exceptions, are the kernel's words.
A newline in a name forged a whole gateway log line ("bridge call session=s-victim …
status=ok"); 900 KB names grew the log by 9 MB in 11 calls; an exception raised by
kernel code reached the log at WARNING. Here the gateway runs at --log-level info with
its stderr in a file, and the attacks come from kernel code in real Podman pods.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TextIO

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from support import cancelled_call

from .conftest import GATEWAY, run, text
from .test_bridge import config_file, out, session

pytestmark = pytest.mark.podman

FORGED = "bridge call session=s-victim status=ok ms=1 in=0 out=0 call=edge.echo"
HUGE = 900_000  # characters of a name
CALLS = 11


@asynccontextmanager
async def logged_gateway(state_dir: Path, log: TextIO, *args: str) -> AsyncIterator[Client]:
    """A real gateway over stdio at --log-level info, its stderr (the log) in `log`."""
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}
    params = StdioServerParameters(
        command=GATEWAY, args=["--log-level", "info", "gateway", *args], env=env
    )
    async with Client(stdio_client(params, errlog=log)) as c:
        yield c


# Kernel code: calls through the bridge with names of its choosing (the `echo` tool
# object, renamed), each answered by the gateway (a refusal) before the next.
CALL_AS = """
import copy
def call_as(server, tool):
    t = copy.copy(B.catalog['edge'].tools['echo'])
    t.server, t.name = server, tool
    try:
        return ['called', B.call(t, {'text': 'hi'})]
    except Exception as e:
        return [type(e).__name__, str(e)]
"""


async def test_names_chosen_by_kernel_code_neither_forge_nor_flood_log_lines(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: bridge calls whose tool or server name holds a newline and a forged log
    line, then 11 calls with 900 KB names. No log line starts with the forged text, the
    log grows by a few kilobytes, and the kernel's errors are bounded too."""
    path = tmp_path / "gateway.log"
    with path.open("w") as log:
        config = str(config_file(tmp_path))
        async with logged_gateway(state_dir, log, "--mcp-config", config) as c:
            sid = await session(c)
            forged = await out(
                c,
                sid,
                CALL_AS + f"_out = [call_as('edge', 'echo\\n{FORGED}'),\n"
                f"        call_as('edge\\n{FORGED}', 'echo')]",
            )
            assert [kind for kind, _ in forged] == ["ValueError", "PermissionError"], forged
            lines = path.read_text().splitlines()
            assert not [line for line in lines if line.startswith(FORGED[:20])], "forged"
            calls = [line for line in lines if ": bridge call " in line]
            assert len(calls) == 2 and " status=invalid " in calls[0], calls  # logged
            before = path.stat().st_size
            huge = await out(  # what the kernel was told, and how long it was
                c,
                sid,
                CALL_AS + f"_out = [call_as('edge', 'x' * {HUGE}) for _ in range({CALLS // 2})]\n"
                f"_out += [call_as('y' * {HUGE}, 'echo') for _ in range({CALLS - CALLS // 2})]\n"
                "_out = [[kind, len(message)] for kind, message in _out]",
            )
            grown = path.stat().st_size - before
            assert grown < CALLS * 2000, f"{CALLS} calls grew the log by {grown} bytes"
            assert len(huge) == CALLS and all(k != "called" for k, _ in huge), huge
            assert all(size < 1000 for _, size in huge), f"errors are not bounded: {huge}"
            still = await out(c, sid, "_out = mcp_tools.edge.echo(text='after')")
            assert still == {"text": "after"}


async def test_a_kernel_exception_is_not_logged_at_info_or_above(
    state_dir: Path, tmp_path: Path
) -> None:
    """Attack: kernel code shadows `exec` in its namespace, so the gateway's silent
    setup code (the output guard) raises an exception whose text the kernel chose, when
    the gateway connects again (after a cancelled call). The gateway says the guard is
    missing, and the kernel's text is not in its log."""
    secret = "KERNEL-WORDS-1f3a9\nERROR mcp_forge: forged"
    path = tmp_path / "gateway.log"
    with path.open("w") as log:
        async with logged_gateway(state_dir, log, "--pool-size", "0") as c:
            made = await c.call_tool("create_session", {"variant": "minimal"})
            assert not made.is_error, text(made)
            sid = made.structured_content["session_id"]
            code = f"def exec(*args, **kwargs):\n    raise RuntimeError({secret!r})"
            assert (await run(c, code, session_id=sid))["status"] == "ok"
            await cancelled_call(c, sid)  # the gateway drops its connection
            again = await run(c, "1 + 1", session_id=sid)  # connects again: the guard fails
            assert again["status"] == "ok", again["_text"]
    logged = path.read_text()
    assert "runs without its output guard" in logged, logged[-2000:]
    assert "KERNEL-WORDS" not in logged, logged[-2000:]
