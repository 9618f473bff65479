"""The noisy-neighbour drill's noise: its kinds, its clients, and the child that runs them
(tests/drills/neighbours.py starts this as `neighbours.py --noise`, its orders on stdin)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

KINDS = ("flood", "export", "install", "codemode")
# Diagnostic only (--kind spin): kernels that burn their CPU limit and say nothing, to tell
# the cost of their CPU from that of what passes through the gateway.
SPIN = "spin"
CALL_DEADLINE = 180.0  # one MCP request under noise, a kernel start included
PACKAGE = "drill-neighbour-tab"  # the wheel installs fetch, from the drill's index
VERSIONS = ("1.0.0", "1.0.1", "1.0.2")

FLOOD = (
    "import sys\n"
    "from IPython.display import display, HTML\n"
    "line = 'x' * 999 + '\\n'\n"
    "for _ in range(20_000):\n"
    "    sys.stdout.write(line)\n"
    "for i in range(300):\n"
    "    display(HTML(f'<b>{i}</b>' + 'y' * 1000))\n"
)
EXPORT_CELL = (
    "from IPython.display import display\n"
    "print('z' * 99_000)\n"
    "display({'text/plain': 'w' * 300_000}, raw=True)\n"
)
EXPORT_CELLS_FIRST = 6  # cells run before the noise starts: the journal is a few MB
SPIN_CELL = "import time\nend = time.monotonic() + 5\nwhile time.monotonic() < end:\n    pass\n"
CODEMODE = (
    "import mcp_tools\n"
    "got = [mcp_tools.edge.echo(text=str(i))['text'] for i in range(20)]\n"
    "len(got)"
)


@asynccontextmanager
async def connect(url: str, token: str) -> AsyncIterator[Client]:
    """The official SDK client over streamable HTTP, with this bearer token."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE),
    )
    async with (
        http,
        Client(
            streamable_http_client(url, http_client=http), read_timeout_seconds=CALL_DEADLINE
        ) as c,
    ):
        yield c


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def create_session(c: Client, **extra: Any) -> str:
    made = await c.call_tool("create_session", {"variant": "minimal", "memory": "512Mi", **extra})
    if made.is_error:
        raise RuntimeError(f"create_session: {text(made)}")
    return str(made.structured_content["session_id"])


# ---- the noise (in a child process: `--noise`, its orders on stdin) ----------------------


class Noise:
    """One noisy client: its session, its kind, what its calls came to."""

    def __init__(self, c: Client, kind: str, cpu: str) -> None:
        self.c, self.kind, self.cpu = c, kind, cpu
        self.sid = ""
        self.calls = 0
        self.errors: dict[str, int] = {}
        self.round = 0

    async def prepare(self) -> None:
        extra: dict[str, Any] = {"cpu": self.cpu}
        if self.kind == "codemode":
            extra["mcp_servers"] = ["edge"]
        self.sid = await create_session(self.c, **extra)
        if self.kind == "export":
            for _ in range(EXPORT_CELLS_FIRST):
                await self.call("execute_code", {"code": EXPORT_CELL})

    async def call(self, tool: str, args: dict[str, Any]) -> None:
        self.calls += 1
        try:
            r = await self.c.call_tool(tool, {"session_id": self.sid, **args})
        except Exception as exc:  # counted: the noise is not what is measured
            self.count(type(exc).__name__)
            return
        if r.is_error:
            said = text(r).removeprefix(f"Error executing tool {tool}: ")
            self.count(said[:60] or "error")
        elif tool == "execute_code" and r.structured_content.get("status") != "ok":
            self.count(f"execute_code {r.structured_content.get('status')}")

    def count(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def once(self) -> None:
        self.round += 1
        if self.kind == "flood":
            await self.call("execute_code", {"code": FLOOD})
        elif self.kind == "export":
            await self.call("execute_code", {"code": EXPORT_CELL})
            await self.call("export_notebook", {"path": "drill.ipynb"})
        elif self.kind == "install":
            version = VERSIONS[self.round % len(VERSIONS)]
            await self.call("install_packages", {"packages": [f"{PACKAGE}=={version}"]})
        elif self.kind == SPIN:
            await self.call("execute_code", {"code": SPIN_CELL})
        else:
            await self.call("execute_code", {"code": CODEMODE})

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.once()

    async def close(self) -> None:
        if self.sid:
            await self.c.call_tool("close_session", {"session_id": self.sid})


async def noise_main() -> int:
    """The child: its orders are one JSON line on stdin (url, tokens, cpu, kinds); it says
    "ready" once every session is prepared, starts at "go", stops at "stop" (or when
    stdin closes), closes its sessions and prints its counts as one JSON line."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    orders = json.loads(await reader.readline())
    names = sorted(orders["tokens"])
    kinds = orders["kinds"]
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        noises = []
        for i, name in enumerate(names):
            c = await stack.enter_async_context(connect(orders["url"], orders["tokens"][name]))
            noises.append(Noise(c, kinds[i % len(kinds)], orders["cpu"]))
        try:
            try:
                await asyncio.gather(*(n.prepare() for n in noises))
            except Exception as exc:  # said plainly: nested clients bury it in groups
                print(f"not ready: {exc!r}", flush=True)
                raise
            print("ready", flush=True)
            if (await reader.readline()).strip() == b"go":
                async with asyncio.TaskGroup() as tg:
                    for n in noises:
                        tg.create_task(n.loop(stop))
                    await reader.readline()  # "stop", or EOF
                    stop.set()
        finally:
            closed = await asyncio.gather(*(n.close() for n in noises), return_exceptions=True)
        counts = {
            "calls": {k: sum(n.calls for n in noises if n.kind == k) for k in kinds},
            "errors": {k: _merge([n.errors for n in noises if n.kind == k]) for k in kinds},
            "close_failures": [repr(x) for x in closed if isinstance(x, BaseException)],
        }
        print(json.dumps(counts), flush=True)
    return 0


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
