"""Helpers shared by test modules (tests/ is on sys.path: `from support import ...`;
tests/drills/faults.py, also run as a script, puts it there itself)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Self

from mcp_forge.api import kernelsession
from mcp_forge.errors import ForgeError

log = logging.getLogger(__name__)

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
CALL_DEADLINE = 120.0


class StdioGateway:
    """One `mcp-forge gateway` process over stdio, spoken to in JSON-RPC lines: no SDK to
    tidy the requests or to hide what happens. Open one with `StdioGateway.open`."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        # Ids a caller writes by hand into raw lines stay below 100: none answers one of ours.
        self.next_id = 100

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, state_dir: Path, *, client: str) -> AsyncIterator[Self]:
        """Start a gateway on `state_dir` and initialize it as `client`. On exit its stdin
        is closed and it gets 60 s to end (then it is killed), unless it is gone already."""
        process = await asyncio.create_subprocess_exec(
            GATEWAY,
            "gateway",
            env={**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            limit=2**24,
        )
        gw = cls(process)
        try:
            init = await gw.request(
                "initialize",
                {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": client, "version": "0"},
                },
            )
            assert "result" in init, init
            await gw.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            yield gw
        finally:
            if process.returncode is None:  # a drill may have killed it
                if process.stdin is not None:
                    process.stdin.close()
                try:
                    async with asyncio.timeout(60):
                        await process.wait()
                except TimeoutError:
                    process.kill()
                    await process.wait()

    async def send(self, line: bytes | dict[str, Any]) -> None:
        """Write one line: a message, or raw bytes sent as they are."""
        assert self.process.stdin is not None
        data = line if isinstance(line, bytes) else json.dumps(line).encode()
        self.process.stdin.write(data + b"\n")
        await self.process.stdin.drain()

    async def start(
        self, method: str, params: dict[str, Any] | None = None, *, progress: bool = False
    ) -> int:
        """Send one request and return its id; with `progress`, the id is its progress token."""
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if progress:
            params = {**(params or {}), "_meta": {"progressToken": self.next_id}}
        if params is not None:
            msg["params"] = params
        await self.send(msg)
        return self.next_id

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one request and return its response (notifications in between are skipped)."""
        return await self.response(await self.start(method, params))

    async def response(
        self,
        request_id: int,
        *,
        on_message: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The response to `request_id`, within CALL_DEADLINE; every message read before it
        goes to `on_message`. ConnectionError if the gateway closes its stdout first."""
        assert self.process.stdout is not None
        async with asyncio.timeout(CALL_DEADLINE):
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    raise ConnectionError("the gateway closed its stdout")
                msg = json.loads(line)
                if msg.get("id") == request_id:
                    return dict(msg)
                if on_message is not None:
                    on_message(msg)


async def read_to_end(
    reader: asyncio.StreamReader, *, limit: int = 1 << 16, deadline: float = 20.0
) -> bytes:
    """What a peer sends until it closes: at most `limit` bytes, within `deadline` s. For a
    listener that must refuse us (a TLS alert at most, then the close)."""
    data = b""
    async with asyncio.timeout(deadline):
        while chunk := await reader.read(limit):
            data += chunk
            assert len(data) <= limit, f"the peer sent more than {limit} bytes"
    return data


@contextlib.contextmanager
def scratch_state_dir(prefix: str = "mf-") -> Iterator[Path]:
    """A fresh state directory, released (see `release_state_dir`) after use."""
    # Short, because the kernel's Unix sockets live under it (107-byte limit).
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        release_state_dir(path)


def release_state_dir(state_dir: Path) -> None:
    """Delete every session a test run left in `state_dir` — pods, workspace filesystems,
    loop devices, /tmp mounts —, then the directory. Removing the directory alone would
    leave the mounts behind (and empty the workspaces through them)."""
    if (state_dir / "store.db").exists():
        errors: list[BaseException] = []

        def delete_all() -> None:
            from mcp_forge.runtimes.local.runtime import LocalRuntime
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


def kernel_session(**spec: Any) -> kernelsession.KernelSession:
    """A validated KernelSession named demo (512Mi unless told), for tests of pure code."""
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "demo"},
        "spec": {"resources": {"memory": "512Mi"}, **spec},
    }
    return kernelsession.load(kernelsession.validate(body))


def pod_of(state_dir: Path, session_id: str, namespace: str = "default") -> str:
    """The Podman pod a local session runs in, as its status says: a session that claimed
    a pool's kernel keeps the pod the pool named (`mcpforge-<ns>-<pool>-<hex>`)."""
    from mcp_forge.runtimes.local.store import Store

    status = Store(state_dir / "store.db").get(namespace, session_id).get("status") or {}
    return str(status.get("podName") or f"mcpforge-{namespace}-{session_id}")


async def pods() -> set[str]:
    """The names of every Podman pod on the machine."""
    done = await asyncio.to_thread(
        subprocess.run,
        ["podman", "pod", "ls", "--format", "{{.Name}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


def gateway_pools(names: set[str]) -> set[str]:
    """Those of `names` that are kernels of a local gateway's own pool."""
    return {n for n in names if n.startswith("mcpforge-default-gateway-")}


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A Prometheus endpoint's samples: (name, labels) -> value (sync; call in a thread)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: metrics\r\n"  # no blank line: never ends


def half_sent(port: int, n: int) -> list[Any]:
    """`n` connections to a loopback HTTP port, each with a request that never ends."""
    import socket

    opened = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(HALF_SENT)
        opened.append(s)
    return opened


def wait_closed(sockets: list[Any], seconds: float) -> list[Any]:
    """The sockets their server closed (EOF or reset) within `seconds`, waited on
    together (sync; call in a thread)."""
    import select
    import time

    left, done = list(sockets), []
    deadline = time.monotonic() + seconds
    while left and (wait := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select(left, [], [], wait)
        for s in readable:
            left.remove(s)
            try:
                gone = s.recv(1) == b""
            except ConnectionError:
                gone = True
            if gone:
                done.append(s)
    return done


async def cancelled_call(c: Any, sid: str, seconds: int = 120) -> None:
    """An execute_code call (of an MCP client `c`) cancelled while it runs: the gateway
    drops its connections to the kernel (and its bridge)."""
    started = asyncio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    call = asyncio.create_task(
        c.call_tool(
            "execute_code",
            {"code": f"import time\ntime.sleep({seconds})", "session_id": sid},
            progress_callback=on_progress,
        )
    )
    await asyncio.wait_for(started.wait(), 60)
    call.cancel()
    try:
        await call
    except asyncio.CancelledError:
        return
    raise AssertionError("the call was not cancelled")


# Code mode: `n` calls to the edge server's echo (tests/mcp_servers), each result or why
# it was refused, as the cell's value.
SPEND_CALLS = (
    "import mcp_tools\n"
    "results = []\n"
    "for i in range({n}):\n"
    "    try:\n"
    "        results.append(mcp_tools.edge.echo(text=str(i))['text'])\n"
    "    except mcp_tools.ToolError as e:\n"
    "        results.append(str(e))\n"
    "results"
)


async def value(c: Any, code: str, session_id: str | None = None) -> tuple[str, Any]:
    """Run `code` with an MCP client `c` (in its default session without `session_id`):
    (the session that ran it, the text/plain of its value)."""
    args = {"code": code} if session_id is None else {"code": code, "session_id": session_id}
    r = await c.call_tool("execute_code", args)
    said = "\n".join(str(getattr(x, "text", "")) for x in r.content)
    assert not r.is_error and r.structured_content["status"] == "ok", said
    data = (r.structured_content.get("result") or {}).get("data") or {}
    return r.structured_content["session_id"], data.get("text/plain")
