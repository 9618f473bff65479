"""MCP transport: malformed and hostile requests reach the gateway, which answers what it
can, refuses the rest by name, and keeps serving. The client is the attacker here (an
agent that was told to misbehave), through the real gateway over stdio."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from support import CALL_DEADLINE, StdioGateway, pods

from .conftest import gateway, run, text

pytestmark = pytest.mark.podman


@asynccontextmanager
async def raw_gateway(state_dir: Path) -> AsyncIterator[StdioGateway]:
    """The gateway over stdio, spoken to line by line; it must exit cleanly at the end."""
    async with StdioGateway.open(state_dir, client="attacker") as raw:
        yield raw
    assert raw.process.returncode == 0, f"the gateway exited with {raw.process.returncode}"


def tool_result(response: dict[str, Any]) -> dict[str, Any]:
    assert "result" in response, response
    return dict(response["result"])


async def test_garbage_lines_do_not_stop_the_gateway(state_dir: Path) -> None:
    """Not JSON, JSON that is not JSON-RPC, a 200 KB nest of brackets, a request whose params
    nest 5,000 deep: the gateway drops each, then answers the next real request and runs code."""
    async with raw_gateway(state_dir) as raw:
        for line in (
            b"not json at all",
            b"[]",
            b'{"jsonrpc": "2.0", "id": {"nested": true}, "method": 7}',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":'
            + b'{"a":' * 5_000
            + b"1"
            + b"}" * 5_000
            + b"}",
            b"\xff\xfe\x00 invalid utf-8",
        ):
            await raw.send(line)
        tools = tool_result(await raw.request("tools/list"))
        assert "execute_code" in {t["name"] for t in tools["tools"]}
        done = tool_result(
            await raw.request("tools/call", {"name": "execute_code", "arguments": {"code": "6*7"}})
        )
        assert done["structuredContent"]["result"]["data"]["text/plain"] == "42"


@pytest.mark.parametrize(
    ("tool", "arguments", "named"),
    [
        ("execute_code", {"code": {"nested": ["code"]}}, "code"),
        ("execute_code", {"code": "1", "timeout": "ten"}, "timeout"),
        ("execute_code", {"code": "1", "timeout": 1e308}, "timeout"),
        ("execute_code", {"code": "1", "session_id": ["s"]}, "session_id"),
        ("create_session", {"memory": "1e100Gi"}, "memory"),
        ("create_session", {"cpu": "-1"}, "cpu"),
        ("create_session", {"name": "../../etc"}, "name"),
        ("create_session", {"env": {"LD_PRELOAD": 5}}, "env"),
        ("write_file", {"session_id": "DEFAULT", "path": {"p": 1}, "content": "x"}, "path"),
        ("read_file", {"session_id": "DEFAULT", "path": "a\x00b"}, "path"),
    ],
)
async def test_ill_typed_arguments_are_refused_by_name(
    state_dir: Path, tool: str, arguments: dict[str, Any], named: str
) -> None:
    """Type confusion in every kind of argument: a tool error naming the field; the gateway
    serves the next call, and no pod was made for a refused create."""
    async with raw_gateway(state_dir) as raw:
        if arguments.get("session_id") == "DEFAULT":  # the file tools need a session
            ran = await raw.request(
                "tools/call", {"name": "execute_code", "arguments": {"code": "1"}}
            )
            arguments = {
                **arguments,
                "session_id": ran["result"]["structuredContent"]["session_id"],
            }
        before = await _session_ids(raw)
        got = await raw.request("tools/call", {"name": tool, "arguments": arguments})
        refused = got.get("error") or tool_result(got)
        assert refused.get("isError", True) is True, got
        assert named in json.dumps(got), got
        assert await _session_ids(raw) == before
        tools = tool_result(await raw.request("tools/list"))
        assert tools["tools"]


async def test_session_ids_that_look_like_paths_or_other_namespaces_are_not_found(
    state_dir: Path,
) -> None:
    """session_id as a path, a namespace-qualified name, a 10,000-character name, a name with
    a NUL: each "no session", never a lookup outside the client's sessions."""
    async with gateway(state_dir) as c:
        for sid in ("../default", "default/s-1", "kube-system/x", "s" * 10_000, "a\x00b", "*"):
            r = await c.call_tool("execute_code", {"code": "1", "session_id": sid})
            assert r.is_error, sid
            assert "no session" in text(r) or "session_id" in text(r), text(r)
        assert (await run(c, "1 + 1"))["status"] == "ok"


async def test_the_client_quota_holds_against_concurrent_creates(state_dir: Path) -> None:
    """Six create_session calls at once against a quota of two: exactly two sessions (and
    two pods) come to be; four are refused, naming the limit."""
    env = {"MCPFORGE_SESSIONS_PER_CLIENT_MAX": "2"}
    async with gateway(state_dir, env=env) as c:
        results = await asyncio.gather(
            *(c.call_tool("create_session", {"variant": "minimal"}) for _ in range(6))
        )
        made = [r.structured_content["session_id"] for r in results if not r.is_error]
        refused = [text(r) for r in results if r.is_error]
        assert len(made) == 2, refused
        assert len(refused) == 4 and all("the most a client may have" in t for t in refused)
        listed = await c.call_tool("list_sessions", {})
        assert sorted(s["session_id"] for s in listed.structured_content["sessions"]) == sorted(
            made
        )
        assert {f"mcpforge-default-{sid}" for sid in made} <= await pods()


async def test_concurrent_calls_on_one_session_queue_and_never_mix(state_dir: Path) -> None:
    """Twenty execute_code calls at once on one session: each answer carries exactly its own
    output, and the kernel saw all twenty, one at a time."""
    async with gateway(state_dir) as c:
        await run(c, "seen = []")
        code = "import time\nseen.append({i})\ntime.sleep(0.01)\nprint('tag-{i}', len(seen))"
        results = await asyncio.gather(*(run(c, code.format(i=i)) for i in range(20)))
        for i, r in enumerate(results):
            assert r["status"] == "ok", r["_text"]
            lines = r["stdout"].split()
            assert lines[0] == f"tag-{i}", r["stdout"]  # its own output, no other call's
        counts = sorted(int(r["stdout"].split()[1]) for r in results)
        assert counts == list(range(1, 21))  # one at a time: every length seen once
        r = await run(c, "sorted(seen) == list(range(20))")
        assert r["result"]["data"]["text/plain"] == "True"


async def test_a_cancel_storm_leaves_the_session_working_with_its_variables(
    state_dir: Path,
) -> None:
    """Ten long calls started and cancelled at once: the kernel is interrupted, the session
    answers the next call, and the variables set before the storm are still there."""
    async with gateway(state_dir) as c:
        await run(c, "kept = 'before the storm'")
        running = asyncio.Event()

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            running.set()

        sleep = {"code": "import time; time.sleep(600)"}
        calls = [
            asyncio.create_task(c.call_tool("execute_code", sleep, progress_callback=on_progress))
            for _ in range(10)
        ]
        await asyncio.wait_for(running.wait(), CALL_DEADLINE)  # one runs, nine queue
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        r = await asyncio.wait_for(run(c, "kept"), CALL_DEADLINE)
        assert r["result"]["data"]["text/plain"] == "'before the storm'"


async def test_code_with_nul_bytes_and_lone_surrogates_is_run_or_refused_cleanly(
    state_dir: Path,
) -> None:
    """NUL bytes in code and output, and a lone surrogate (which no UTF-8 can carry): the
    first runs; the second is dropped as malformed JSON-RPC (the SDK's parser refuses it;
    nothing of it reaches a kernel) or refused, and the session goes on."""
    async with raw_gateway(state_dir) as raw:
        nul = tool_result(
            await raw.request(
                "tools/call",
                {"name": "execute_code", "arguments": {"code": "print('a\\x00b'); 'c\\x00d'"}},
            )
        )
        assert nul["structuredContent"]["stdout"] == "a\x00b\n"
        await raw.send(
            b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"execute_code",'
            b'"arguments":{"code":"x = \'\\ud800\'"}}}'
        )
        after = tool_result(
            await raw.request("tools/call", {"name": "execute_code", "arguments": {"code": "1"}})
        )
        assert after["structuredContent"]["status"] == "ok"


async def _session_ids(raw: StdioGateway) -> set[str]:
    listed = tool_result(
        await raw.request("tools/call", {"name": "list_sessions", "arguments": {}})
    )
    return {s["session_id"] for s in listed["structuredContent"]["sessions"]}
