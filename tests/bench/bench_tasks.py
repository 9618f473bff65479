"""Benchmark: what running execute_code as a task costs, next to a plain call.

    sudo .venv/bin/python tests/bench/bench_tasks.py [--runs 100]

One local gateway over streamable HTTP, one MCP session (2025-11-25), its client's
default session warm; `1+1` run alternately (a change in the machine's load falls on
both) as:
  * a plain execute_code (the baseline): one request;
  * a task: tools/call with params.task answered with the task, then tasks/result (two
    requests; the kernel's run happens between or during them);
  * the task's first answer alone: how soon a client has control back;
  * on 2026-07-28 (no session; the request's envelope in `_meta`), a plain call and the
    same call declaring the tasks extension, which a short cell is answered as ever:
    what declaring it costs a call that does not become a task.
Medians and p90 in ms, and each against the plain call. The machines are shared and
noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

sys.path.insert(0, str(Path(__file__).parent))
from bench_mcp import GATEWAY, stats

from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings

TOKEN = "bench-token-0123456789abcdef"


async def delete_all(state: Path) -> None:
    runtime = LocalRuntime(Settings(state_dir=state))
    for session in await runtime.list():
        await runtime.delete(session.name, session.namespace)


class Session:
    """One MCP session over plain JSON-RPC (the SDK clients make no tasks)."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.http, self.url, self.next_id = http, url, 0
        self.headers: dict[str, str] = {}

    async def open(self) -> None:
        self.headers = {
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "Authorization": f"Bearer {TOKEN}",
        }
        init = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "b", "version": "0"},
        }
        r = await self.http.post(
            self.url,
            headers=self.headers,
            json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init},
        )
        self.headers |= {
            "mcp-session-id": r.headers["mcp-session-id"],
            "mcp-protocol-version": "2025-11-25",
        }
        await self.http.post(
            self.url,
            headers=self.headers,
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
        )

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        r = await self.http.post(self.url, headers=self.headers, json=body)
        for line in r.text.splitlines():
            if line.startswith("data:") and line[5:].strip():
                message = json.loads(line[5:])
                if message.get("id") == self.next_id:
                    if "error" in message:
                        raise RuntimeError(message["error"])
                    return dict(message["result"])
        raise RuntimeError(f"no answer to {method}: {r.text[:300]}")


async def modern_call(http: httpx2.AsyncClient, url: str, code: str, tasks: bool) -> Any:
    """execute_code on 2026-07-28, declaring the tasks extension if `tasks`: its result."""
    extensions: dict[str, Any] = {"io.modelcontextprotocol/tasks": {}} if tasks else {}
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {"extensions": extensions},
    }
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {TOKEN}",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tools/call",
        "Mcp-Name": "execute_code",
    }
    params = {"name": "execute_code", "arguments": {"code": code}, "_meta": meta}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
    r = await http.post(url, headers=headers, json=body)
    answer = r.json() if r.headers["content-type"].startswith("application/json") else None
    if answer is None:
        lines = [ln[5:] for ln in r.text.splitlines() if ln.startswith("data:") and ln[5:].strip()]
        answer = json.loads(lines[-1])
    result = answer["result"]
    assert result["resultType"] == "complete", result  # a short cell: never a task
    return result["structuredContent"]["result"]["data"]["text/plain"]


async def main(runs: int) -> None:
    state = tempfile.mkdtemp(prefix="mf-bench-tasks-", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        GATEWAY, "gateway", "--http", f"127.0.0.1:{port}", "--token", TOKEN,
        env={**os.environ, "MCPFORGE_STATE_DIR": state}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while b"MCP over HTTP" not in await proc.stderr.readline():
            pass
    plain, task, answered = [], [], []
    modern: list[float] = []
    declared: list[float] = []
    try:
        async with httpx2.AsyncClient(timeout=60) as http:
            mcp = Session(http, f"http://127.0.0.1:{port}/mcp")
            await mcp.open()
            args = {"name": "execute_code", "arguments": {"code": "1+1"}}
            for _ in range(5):  # the default session started, and warm
                await mcp.call("tools/call", **args)
            for _ in range(runs):
                t0 = time.perf_counter()
                await mcp.call("tools/call", **args)
                plain.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                created = await mcp.call("tools/call", **args, task={"ttl": 60_000})
                answered.append((time.perf_counter() - t0) * 1000)
                result = await mcp.call("tasks/result", taskId=created["task"]["taskId"])
                task.append((time.perf_counter() - t0) * 1000)
                assert result["structuredContent"]["result"]["data"]["text/plain"] == "2", result
                for kept, tasks in ((modern, False), (declared, True)):
                    t0 = time.perf_counter()
                    assert await modern_call(http, mcp.url, "1+1", tasks) == "2"
                    kept.append((time.perf_counter() - t0) * 1000)
    finally:
        proc.terminate()
        await proc.wait()
        await delete_all(Path(state))  # an HTTP client's default session outlives its gateway
    base = stats(plain)[0]
    title = f"execute_code 1+1 over HTTP, ms (n={runs})"
    print(f"{title:<50}{'median':>8}{'p90':>8}{'vs plain':>10}")
    for name, xs in (
        ("plain execute_code (baseline)", plain),
        ("as a task: tools/call + tasks/result", task),
        ("as a task: until the task is answered", answered),
        ("2026-07-28: plain execute_code", modern),
        ("2026-07-28: declaring the tasks extension", declared),
    ):
        median, p90 = stats(xs)
        print(f"{name:<50}{median:>8.2f}{p90:>8.2f}{median / base:>9.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    asyncio.run(main(p.parse_args().runs))
