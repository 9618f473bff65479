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

import raw_mcp

pytestmark = pytest.mark.podman

RELATED = "io.modelcontextprotocol/related-task"
AFTER = 1.0  # seconds: on 2026-07-28 a call still running then becomes a task
SLOW = "import time\nprint('started', flush=True)\ntime.sleep(2)\nanswer = 42\nanswer"


@pytest.fixture(scope="module")
async def gw(state_dir: Path, tmp_path_factory: Any) -> AsyncIterator[HttpGateway]:
    env = {"MCPFORGE_TASK_AFTER": str(AFTER)}
    async with running_gateway(state_dir, tmp_path_factory.mktemp("tasks"), env=env) as g:
        yield g
    await delete_sessions(state_dir, None)


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE)) as c:
        yield c


async def rpc(
    http: httpx2.AsyncClient, gw: HttpGateway, sent: dict[str, str], method: str, **params: Any
) -> dict[str, Any]:
    return await raw_mcp.rpc(http, gw.url, sent, method, **params)


async def task_of(
    http: httpx2.AsyncClient, gw: HttpGateway, sent: dict[str, str], code: str, **args: Any
) -> str:
    return await raw_mcp.task_of(http, gw.url, sent, code, **args)


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
    assert raw_mcp.shown(after) == "(False, 1)", after


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


async def test_on_2026_07_28_a_call_past_its_moment_becomes_a_task_for_a_client_that_takes_them(
    gw: HttpGateway, http: httpx2.AsyncClient
) -> None:
    """The tasks extension (SEP-2663): declared in server/discover; a short call answered
    as ever, a long one with a task whose tasks/get inlines the result; never a task for a
    call that does not declare the extension; tasks/update acknowledged; the same store
    as 2025-11-25's tasks."""
    token = gw.tokens["alice"]

    async def modern(method: str, **params: Any) -> dict[str, Any]:
        return await raw_mcp.modern(http, gw.url, token, method, **params)

    found = (await modern("server/discover"))["result"]
    assert found["capabilities"]["extensions"] == {raw_mcp.TASKS_EXTENSION: {}}, found
    assert "tasks" not in found["capabilities"], found  # 2025-11-25's form: not here
    short = await modern("tools/call", name="execute_code", arguments={"code": "6 * 7"})
    assert short["result"]["resultType"] == "complete" and raw_mcp.shown(short) == "42", short

    long = await modern("tools/call", name="execute_code", arguments={"code": SLOW})
    task = long["result"]
    assert task["resultType"] == "task" and task["status"] == "working", long
    assert task["ttlMs"] > 0 and task["pollIntervalMs"] > 0 and "content" not in task, long
    got = (await modern("tasks/get", taskId=task["taskId"]))["result"]
    assert got["resultType"] == "complete" and got["status"] in ("working", "completed"), got
    # Waited for as 2025-11-25 does (tasks/result): one store, one owner.
    alice = await opened(http, gw, "alice")
    await rpc(http, gw, alice, "tasks/result", taskId=task["taskId"])
    got = (await modern("tasks/get", taskId=task["taskId"]))["result"]
    assert got["status"] == "completed", got
    assert got["result"]["structuredContent"]["result"]["data"]["text/plain"] == "42", got
    assert got["result"]["structuredContent"]["stdout"] == "started\n", got
    ack = await modern("tasks/update", taskId=task["taskId"], inputResponses={"x": {}})
    assert ack["result"]["resultType"] == "complete", ack
    # Not declared: the long call is answered when it ends, never with a task.
    plain = await raw_mcp.modern(
        http, gw.url, token, "tools/call", tasks=False, name="execute_code",
        arguments={"code": SLOW},
    )  # fmt: skip
    assert raw_mcp.shown(plain) == "42", plain
    # Asked for without declaring the extension: the capability it needs is named.
    undeclared = await raw_mcp.modern(
        http, gw.url, token, "tasks/get", tasks=False, taskId=task["taskId"]
    )
    assert undeclared["error"]["code"] == -32021, undeclared
    assert undeclared["error"]["data"]["requiredCapabilities"] == {
        "extensions": {raw_mcp.TASKS_EXTENSION: {}}
    }, undeclared
    # Another client, or a made-up id: unknown.
    for taken in (task["taskId"], "no-such-task"):
        foreign = await raw_mcp.modern(http, gw.url, gw.tokens["bob"], "tasks/get", taskId=taken)
        assert foreign["error"]["code"] == -32602, foreign


async def test_on_2026_07_28_a_cancelled_task_interrupts_the_kernel_and_keeps_the_session(
    gw: HttpGateway, http: httpx2.AsyncClient
) -> None:
    token = gw.tokens["alice"]

    async def modern(method: str, **params: Any) -> dict[str, Any]:
        return await raw_mcp.modern(http, gw.url, token, method, **params)

    await modern("tools/call", name="execute_code", arguments={"code": "kept = 2"})
    code = "import time\ntime.sleep(120)\nafter = 1"
    task = (await modern("tools/call", name="execute_code", arguments={"code": code}))["result"]
    assert task["resultType"] == "task", task
    ack = await modern("tasks/cancel", taskId=task["taskId"])
    assert ack["result"]["resultType"] == "complete", ack
    got = (await modern("tasks/get", taskId=task["taskId"]))["result"]
    assert got["status"] == "cancelled" and "result" not in got, got
    again = await modern("tasks/cancel", taskId=task["taskId"])  # ended: acknowledged
    assert again["result"]["resultType"] == "complete", again
    after = await modern(
        "tools/call", name="execute_code", arguments={"code": "('after' in globals(), kept)"}
    )
    assert raw_mcp.shown(after) == "(False, 2)", after
