"""Long cells as tasks (MCP 2025-11-25) on the real gateway over streamable HTTP: a
task-augmented execute_code answered at once, its result picked up on another
connection, after the gateway restarted, by its client only; a cancelled task
interrupts the kernel. Plain JSON-RPC over HTTP: the SDK clients do not make tasks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from test_http import CALL_DEADLINE, HttpGateway, delete_sessions, free_port, running_gateway
from test_protocol import messages, opened

pytestmark = pytest.mark.podman

RELATED = "io.modelcontextprotocol/related-task"
SLOW = "import time\nprint('started', flush=True)\ntime.sleep(2)\nanswer = 42\nanswer"


@pytest.fixture(scope="module")
async def gw(state_dir: Path, tmp_path_factory: Any) -> AsyncIterator[HttpGateway]:
    async with running_gateway(state_dir, tmp_path_factory.mktemp("tasks")) as g:
        yield g
    await delete_sessions(state_dir, None)


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE)) as c:
        yield c


async def rpc(
    http: httpx2.AsyncClient, gw: HttpGateway, sent: dict[str, str], method: str, **params: Any
) -> dict[str, Any]:
    """One request on the session whose headers are `sent`: its answer (result or error)."""
    r = await http.post(
        gw.url, headers=sent, json={"jsonrpc": "2.0", "id": 9, "method": method, "params": params}
    )
    assert r.status_code == 200, r.text
    [answer] = [m for m in messages(r) if m.get("id") == 9]
    return answer


async def task_of(
    http: httpx2.AsyncClient, gw: HttpGateway, sent: dict[str, str], code: str, **args: Any
) -> str:
    call = await rpc(
        http,
        gw,
        sent,
        "tools/call",
        name="execute_code",
        arguments={"code": code, **args},
        task={"ttl": 600_000},
    )
    assert "result" in call, call
    task = call["result"]["task"]
    assert task["status"] == "working" and task["ttl"] == 600_000, call
    assert task["pollInterval"] > 0 and task["createdAt"].endswith("Z"), call
    return str(task["taskId"])


async def test_a_task_is_answered_at_once_and_its_result_picked_up_on_another_connection(
    gw: HttpGateway, http: httpx2.AsyncClient
) -> None:
    alice = await opened(http, gw, "alice")
    r = await http.post(
        gw.url,
        headers=alice,
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            },
        },
    )
    declared = messages(r)[0]["result"]["capabilities"]
    assert declared["tasks"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}, (
        declared
    )
    tools = (await rpc(http, gw, alice, "tools/list"))["result"]["tools"]
    execution = {t["name"]: t.get("execution") for t in tools}
    assert execution["execute_code"] == {"taskSupport": "optional"}
    assert execution["read_file"] is None  # only execute_code runs as a task
    refused = await rpc(
        http, gw, alice, "tools/call", name="read_file", arguments={"path": "x"}, task={}
    )
    assert refused["error"]["code"] == -32601, refused

    task_id = await task_of(http, gw, alice, SLOW)
    # Its connection is gone; a new MCP session of the same client picks it up.
    again = await opened(http, gw, "alice")
    got = (await rpc(http, gw, again, "tasks/get", taskId=task_id))["result"]
    assert got["taskId"] == task_id and got["status"] in ("working", "completed"), got
    result = (await rpc(http, gw, again, "tasks/result", taskId=task_id))["result"]
    assert result["structuredContent"]["result"]["data"]["text/plain"] == "42", result
    assert result["structuredContent"]["stdout"] == "started\n"
    assert result["_meta"][RELATED] == {"taskId": task_id}
    assert (await rpc(http, gw, again, "tasks/get", taskId=task_id))["result"][
        "status"
    ] == "completed"
    listed = (await rpc(http, gw, again, "tasks/list"))["result"]["tasks"]
    assert task_id in [t["taskId"] for t in listed]
    # Another client: as if it did not exist.
    bob = await opened(http, gw, "bob")
    for method in ("tasks/get", "tasks/result", "tasks/cancel"):
        foreign = await rpc(http, gw, bob, method, taskId=task_id)
        assert foreign["error"]["code"] == -32602 and "not yours" in foreign["error"]["message"], (
            foreign
        )
    assert task_id not in json.dumps((await rpc(http, gw, bob, "tasks/list"))["result"])


async def test_a_cancelled_task_interrupts_the_kernel_and_keeps_the_session(
    gw: HttpGateway, http: httpx2.AsyncClient
) -> None:
    alice = await opened(http, gw, "alice")
    await rpc(http, gw, alice, "tools/call", name="execute_code", arguments={"code": "kept = 1"})
    task_id = await task_of(http, gw, alice, "import time\ntime.sleep(120)\nafter = 1")
    cancelled = (await rpc(http, gw, alice, "tasks/cancel", taskId=task_id))["result"]
    assert cancelled["status"] == "cancelled", cancelled
    failed = await rpc(http, gw, alice, "tasks/result", taskId=task_id)
    assert "cancelled" in failed["error"]["message"], failed
    again = await rpc(http, gw, alice, "tasks/cancel", taskId=task_id)
    assert again["error"]["code"] == -32602 and "cannot be cancelled" in again["error"]["message"]
    # The kernel was interrupted (the next call runs now), and kept its variables.
    code = "('after' in globals(), kept)"
    after = await rpc(http, gw, alice, "tools/call", name="execute_code", arguments={"code": code})
    assert (after["result"]["structuredContent"]["result"] or {}).get("data", {}).get(
        "text/plain"
    ) == "(False, 1)", after


async def test_a_finished_task_outlives_a_gateway_restart_and_a_cut_off_one_says_so(
    state_dir: Path, tmp_path: Path, http: httpx2.AsyncClient
) -> None:
    port = free_port()
    async with running_gateway(state_dir, tmp_path, port=port) as gw:
        alice = await opened(http, gw, "alice")
        done = await task_of(http, gw, alice, "6 * 7")
        await rpc(http, gw, alice, "tasks/result", taskId=done)
        cut = await task_of(http, gw, alice, "import time\ntime.sleep(120)")
        tokens = gw.tokens
    async with running_gateway(state_dir, tmp_path, tokens=tokens, port=port) as gw:
        alice = await opened(http, gw, "alice")
        result = await rpc(http, gw, alice, "tasks/result", taskId=done)
        assert "result" in result, result
        result = result["result"]
        assert result["structuredContent"]["result"]["data"]["text/plain"] == "42", result
        status = (await rpc(http, gw, alice, "tasks/get", taskId=cut))["result"]
        assert status["status"] == "failed" and "gateway" in status["statusMessage"], status
        said = await rpc(http, gw, alice, "tasks/result", taskId=cut)
        assert "gateway" in said["error"]["message"], said
    await delete_sessions(state_dir, None)
