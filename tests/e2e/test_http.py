"""Agents over streamable HTTP: the real `mcp-forge gateway --http` (a subprocess) with two
clients, alice and bob (one bearer token each), driven by the official SDK client and by
plain HTTP requests, with real kernels in real Podman pods."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from support import pod_of, pods

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
CLIENTS = ("alice", "bob")
START_DEADLINE = 60.0  # the gateway says it listens, and does
CALL_DEADLINE = 120.0  # one MCP request, a kernel start included
STOP_DEADLINE = 60.0  # SIGTERM until exit, the deletion of its sessions included
MAX_BODY = 16 * 1024 * 1024
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "e2e", "version": "0"},
    },
}


@dataclass(frozen=True)
class HttpGateway:
    process: asyncio.subprocess.Process
    port: int
    tokens: dict[str, str]  # client name → bearer token
    log: list[str]  # its stderr, line by line

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def post(
        self, token: str | None = None, headers: dict[str, str] | None = None, **request: Any
    ) -> httpx2.Response:
        """One plain POST to /mcp (an initialize request unless told), not through the SDK."""
        sent = {"Accept": "application/json, text/event-stream", **(headers or {})}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        if "content" not in request:
            request["json"] = INITIALIZE
        async with httpx2.AsyncClient(timeout=CALL_DEADLINE) as http:
            return await http.post(self.url, headers=sent, **request)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def read_stderr(
    process: asyncio.subprocess.Process, log: list[str], until: str | None = None
) -> bool:
    """Collect its stderr into `log` until a line contains `until` (True) or it ends (False)."""
    assert process.stderr is not None
    while line := (await process.stderr.readline()).decode():
        log.append(line)
        if until is not None and until in line:
            return True
    return False


async def stop(gw: HttpGateway) -> int:
    """SIGTERM, then the exit status (the gateway deletes its sessions first)."""
    if gw.process.returncode is None:
        gw.process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(STOP_DEADLINE):
            return await gw.process.wait()
    except TimeoutError:
        gw.process.kill()
        await gw.process.wait()
        raise


@asynccontextmanager
async def running_gateway(
    state_dir: Path,
    tokens_dir: Path,
    *args: str,
    tokens: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> AsyncIterator[HttpGateway]:
    """A gateway with a token for each of CLIENTS (these `tokens`: replicas share them),
    on `port` (a restarted gateway: the same one) or a free one."""
    port = port or free_port()
    tokens = tokens or {name: secrets.token_urlsafe(24) for name in CLIENTS}
    tokens_file = tokens_dir / f"tokens-{port}"
    tokens_file.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))
    process = await asyncio.create_subprocess_exec(
        *(GATEWAY, "gateway", "--http", f"127.0.0.1:{port}", "--tokens-file", str(tokens_file)),
        *args,
        env={**os.environ, "MCPFORGE_STATE_DIR": str(state_dir), **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    gw = HttpGateway(process, port, tokens, [])
    try:
        async with asyncio.timeout(START_DEADLINE):
            # The gateway binds its port before it prints the address.
            if not await read_stderr(process, gw.log, until="MCP over HTTP at"):
                pytest.fail(f"the gateway exited ({await process.wait()}):\n" + "".join(gw.log))
        # Keep reading its stderr: a full pipe would block the gateway's logging.
        drain = asyncio.create_task(read_stderr(process, gw.log))
        try:
            yield gw
        finally:
            await stop(gw)
            async with asyncio.timeout(STOP_DEADLINE):
                await drain
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.fixture(scope="module")
async def http_gateway(state_dir: Path, tmp_path_factory) -> AsyncIterator[HttpGateway]:
    async with running_gateway(state_dir, tmp_path_factory.mktemp("http")) as gw:
        yield gw
    # Its clients' default sessions outlive it (test_sigterm_...): not the next module's.
    await delete_sessions(state_dir, None)


async def delete_sessions(state_dir: Path, names: set[str] | None) -> None:
    """Delete these sessions (None: every client's default session)."""
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=state_dir))
    for session in await runtime.list():
        if session.name in names if names is not None else session.name.startswith("default-"):
            await runtime.delete(session.name, session.namespace)


@asynccontextmanager
async def connect(gw: HttpGateway, client: str, **headers: str) -> AsyncIterator[Client]:
    """The official SDK client over streamable HTTP, with `client`'s token."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {gw.tokens[client]}", **headers},
        timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE),
    )
    async with (
        http,
        Client(
            streamable_http_client(gw.url, http_client=http), read_timeout_seconds=CALL_DEADLINE
        ) as c,
    ):
        yield c


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def session_ids(result: Any) -> list[str]:
    return [s["session_id"] for s in result.structured_content["sessions"]]


@pytest.mark.parametrize(
    ("credential", "scheme"),
    [(None, ""), ("wrong", "Bearer"), ("alice", ""), ("alice", "Basic")],
    ids=["no-token", "wrong-token", "token-without-scheme", "token-as-basic"],
)
async def test_a_request_without_a_clients_bearer_token_gets_401(
    http_gateway: HttpGateway, credential: str | None, scheme: str
) -> None:
    headers = {}
    if credential is not None:
        token = http_gateway.tokens.get(credential) or secrets.token_urlsafe(24)
        headers["Authorization"] = f"{scheme} {token}".strip()
    r = await http_gateway.post(headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "mcp-session-id" not in r.headers


async def test_each_clients_token_is_accepted(http_gateway: HttpGateway) -> None:
    for token in http_gateway.tokens.values():
        r = await http_gateway.post(token)
        assert r.status_code == 200, r.text
        assert '"serverInfo"' in r.text, r.text


async def test_a_foreign_origin_gets_403_even_with_a_valid_token(
    http_gateway: HttpGateway,
) -> None:
    token = http_gateway.tokens["alice"]
    evil = await http_gateway.post(token, {"Origin": "http://evil.example"})
    assert evil.status_code == 403
    assert "Origin" in evil.text
    own = await http_gateway.post(token, {"Origin": f"http://localhost:{http_gateway.port}"})
    assert own.status_code == 200, own.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1:1"])
async def test_a_foreign_host_header_gets_421_even_with_a_valid_token(
    http_gateway: HttpGateway, host: str
) -> None:
    # DNS rebinding: a browser sends the attacker's name as Host. The SDK answers 421
    # Misdirected Request.
    r = await http_gateway.post(
        http_gateway.tokens["alice"], {"Host": host.format(port=http_gateway.port)}
    )
    assert r.status_code == 421
    assert "Host" in r.text


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_over_16_mb_gets_413_and_the_gateway_keeps_serving(
    http_gateway: HttpGateway, framing: str
) -> None:
    head = b'{"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"pad": "'
    body = head + b"x" * (MAX_BODY + 1 - len(head)) + b'"}}'

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit counts bytes
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    r = await http_gateway.post(
        http_gateway.tokens["alice"],
        {"Content-Type": "application/json"},
        content=body if framing == "content-length" else chunks(),
    )
    assert r.status_code == 413
    assert "too large" in r.text
    async with connect(http_gateway, "alice") as alice:
        assert not (await alice.call_tool("list_sessions", {})).is_error


async def test_a_client_neither_sees_nor_uses_another_clients_session(
    http_gateway: HttpGateway,
) -> None:
    # Bob also claims to be alice in the header the gateway uses internally for the
    # client's name: only the token counts.
    async with (
        connect(http_gateway, "alice") as alice,
        connect(http_gateway, "bob", **{"X-MCPForge-Client": "alice"}) as bob,
    ):
        made = await alice.call_tool("create_session", {"variant": "minimal"})
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        assert made.structured_content["owned"] is True
        ran = await alice.call_tool("execute_code", {"session_id": sid, "code": "x = 1"})
        assert not ran.is_error, text(ran)
        wrote = await alice.call_tool(
            "write_file", {"session_id": sid, "path": "secret.txt", "content": "alice's"}
        )
        assert not wrote.is_error, text(wrote)

        assert sid not in session_ids(await bob.call_tool("list_sessions", {}))
        missing = "s-000000000000"
        calls: list[tuple[str, dict[str, Any]]] = [
            ("execute_code", {"code": "x = 2"}),
            ("read_file", {"path": "secret.txt"}),
            ("write_file", {"path": "secret.txt", "content": "bob's"}),
            ("list_files", {}),
            ("list_variables", {}),
            ("list_kernel_tools", {}),
            ("install_packages", {"packages": ["tabulate"]}),
            ("inspect_variable", {"name": "x"}),
            ("interrupt_kernel", {}),
            ("restart_kernel", {}),
            ("close_session", {}),
        ]
        for tool, args in calls:
            foreign = await bob.call_tool(tool, {**args, "session_id": sid})
            assert foreign.is_error, (tool, text(foreign))
            assert f"no session '{sid}'" in text(foreign), (tool, text(foreign))
            # Exactly what a session that does not exist gets: nothing tells them apart.
            absent = await bob.call_tool(tool, {**args, "session_id": missing})
            assert text(foreign).replace(sid, missing) == text(absent), tool

        assert sid in session_ids(await alice.call_tool("list_sessions", {}))
        x = await alice.call_tool("execute_code", {"session_id": sid, "code": "x"})
        assert x.structured_content["result"]["data"]["text/plain"] == "1"
        back = await alice.call_tool("read_file", {"session_id": sid, "path": "secret.txt"})
        assert text(back) == "alice's"
        closed = await alice.call_tool("close_session", {"session_id": sid})
        assert closed.structured_content["closed"] is True, text(closed)


async def test_each_client_gets_its_own_default_session_which_outlives_its_connection(
    http_gateway: HttpGateway,
) -> None:
    async with connect(http_gateway, "alice") as alice, connect(http_gateway, "bob") as bob:
        a, b = await asyncio.gather(
            alice.call_tool("execute_code", {"code": "who = 'alice'"}),
            bob.call_tool("execute_code", {"code": "who = 'bob'"}),
        )
        assert not a.is_error and not b.is_error, (text(a), text(b))
        alices, bobs = a.structured_content["session_id"], b.structured_content["session_id"]
        assert alices != bobs
        assert alices not in session_ids(await bob.call_tool("list_sessions", {}))
        who = await bob.call_tool("execute_code", {"code": "who"})
        assert who.structured_content["session_id"] == bobs
        assert who.structured_content["result"]["data"]["text/plain"] == "'bob'"
    # The token is the client, not the connection: a new connection finds the same session.
    async with connect(http_gateway, "alice") as again:
        who = await again.call_tool("execute_code", {"code": "who"})
        assert who.structured_content["session_id"] == alices
        assert who.structured_content["result"]["data"]["text/plain"] == "'alice'"


async def test_sigterm_deletes_the_sessions_it_created_but_default_ones_and_exits_0(
    state_dir: Path, tmp_path: Path
) -> None:
    """A client's default session outlives the gateway (the next one, or another replica,
    gives it back to the client: test_replicas.py); those it created on request go."""
    async with running_gateway(state_dir, tmp_path, "--pool-size", "2") as gw:
        async with connect(gw, "alice") as alice, connect(gw, "bob") as bob:
            made, ran = await asyncio.gather(
                alice.call_tool("create_session", {"variant": "minimal"}),
                bob.call_tool("execute_code", {"code": "1"}),
            )
            assert not made.is_error and not ran.is_error, (text(made), text(ran))
        created = made.structured_content["session_id"]
        default = ran.structured_content["session_id"]
        made_pod, default_pod = pod_of(state_dir, created), pod_of(state_dir, default)
        assert {made_pod, default_pod} <= await pods()  # either may be a pool's
        (pool,) = re.findall(r"\(pool (gateway-[0-9a-f]+)\)", "".join(gw.log))
        assert await stop(gw) == 0, "".join(gw.log)
    left = await pods()
    assert made_pod not in left
    assert default_pod in left, "bob's default session was deleted with the gateway"
    await delete_sessions(state_dir, {default})
    # The gateway's own pool went with it: no kernel of it is left.
    assert not [p for p in await pods() if p.startswith(f"mcpforge-default-{pool}-")]


async def test_a_shared_group_is_a_clients_own(http_gateway: HttpGateway) -> None:
    async with connect(http_gateway, "alice") as alice, connect(http_gateway, "bob") as bob:
        a = await alice.call_tool("create_session", {"variant": "minimal", "shared_group": "team"})
        b = await bob.call_tool("create_session", {"variant": "minimal", "shared_group": "team"})
        a_id, b_id = a.structured_content["session_id"], b.structured_content["session_id"]
        wrote = await alice.call_tool(
            "execute_code", {"session_id": a_id, "code": "open('/shared/a.txt', 'w').write('x')"}
        )
        assert not wrote.is_error, text(wrote)
        seen = await bob.call_tool(
            "execute_code", {"session_id": b_id, "code": "import os; os.listdir('/shared')"}
        )
        assert seen.structured_content["result"]["data"]["text/plain"] == "[]"
        await alice.call_tool("close_session", {"session_id": a_id})
        await bob.call_tool("close_session", {"session_id": b_id})


async def test_a_declared_session_serves_only_the_clients_it_names(
    http_gateway: HttpGateway, state_dir: Path, images: dict[str, str]
) -> None:
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=state_dir))
    await runtime.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "for-alice", "annotations": {"mcpforge.dev/clients": "alice"}},
            "spec": {"image": images["minimal"], "resources": {"memory": "256Mi"}},
        }
    )
    try:
        async with connect(http_gateway, "alice") as alice, connect(http_gateway, "bob") as bob:
            ran = await alice.call_tool("execute_code", {"session_id": "for-alice", "code": "1"})
            assert not ran.is_error, text(ran)
            refused = await bob.call_tool("execute_code", {"session_id": "for-alice", "code": "1"})
            assert refused.is_error and "no session 'for-alice'" in text(refused)
            assert "for-alice" not in session_ids(await bob.call_tool("list_sessions", {}))
    finally:
        await runtime.delete("for-alice")


async def test_an_mcp_session_id_works_only_with_the_token_that_opened_it(
    http_gateway: HttpGateway,
) -> None:
    opened = await http_gateway.post(http_gateway.tokens["alice"])
    assert opened.status_code == 200, opened.text
    mcp_session = opened.headers.get("mcp-session-id")
    assert mcp_session
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    borrowed = await http_gateway.post(
        http_gateway.tokens["bob"], headers={"mcp-session-id": mcp_session}, json=ping
    )
    assert borrowed.status_code == 404
