"""fork_session through the real gateway over HTTP, with two clients (alice, bob): copies
answer with the original's variables and the environment asked for, count against the
client's quota, and are nobody else's. Real kernels in real pods; the CRIU that
images/criu/build makes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from test_http import HttpGateway, connect, delete_sessions, running_gateway, session_ids, text

pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

QUOTA = 4  # sessions per client, this module's gateway


@pytest.fixture(scope="module")
async def gateway(state_dir: Path, tmp_path_factory: Any) -> AsyncIterator[HttpGateway]:
    env = {"MCPFORGE_SESSIONS_PER_CLIENT_MAX": str(QUOTA)}
    async with running_gateway(state_dir, tmp_path_factory.mktemp("forks"), env=env) as gw:
        yield gw
    await delete_sessions(state_dir, None)


async def made(c: Client, **args: Any) -> str:
    result = await c.call_tool("create_session", {"variant": "minimal", **args})
    assert not result.is_error, text(result)
    sid: str = result.structured_content["session_id"]
    return sid


async def printed(c: Client, sid: str, code: str) -> str:
    result = await c.call_tool("execute_code", {"code": code, "session_id": sid})
    assert not result.is_error, text(result)
    assert result.structured_content["status"] == "ok", result.structured_content
    out: str = result.structured_content["stdout"]
    return out


async def test_copies_answer_with_the_originals_variables_and_count_against_the_quota(
    gateway: HttpGateway,
) -> None:
    async with connect(gateway, "alice") as alice:
        sid = await made(alice, env={"MODE": "a", "TOKEN": "original's"})
        await printed(
            alice, sid, "import os\nx = 41\nwith open('notes.txt', 'w') as f: f.write('hi')"
        )
        result = await alice.call_tool(
            "fork_session", {"session_id": sid, "count": 2, "env": {"MODE": "b"}}
        )
        assert not result.is_error, text(result)
        copies = result.structured_content["forks"]
        assert len(copies) == 2 and all(c["restored"] for c in copies), copies
        for copy in copies:
            assert copy["phase"] == "Ready", copy
            seen = (
                "print(x + 1, os.environ.get('MODE'), os.environ.get('TOKEN'), "
                "open('notes.txt').read())"
            )
            assert await printed(alice, copy["session_id"], seen) == "42 b None hi\n"
        ids = [c["session_id"] for c in copies]
        listed = session_ids(await alice.call_tool("list_sessions", {}))
        assert {sid, *ids} <= set(listed), listed

        # Three held of four: two more copies do not fit, and none is made.
        over = await alice.call_tool("fork_session", {"session_id": sid, "count": 2})
        assert over.is_error and "quota" in text(over), text(over)
        assert len(session_ids(await alice.call_tool("list_sessions", {}))) == len(listed)
        # The original goes on as it was.
        assert await printed(alice, sid, "print(x, os.environ['MODE'])") == "41 a\n"
        for closing in (sid, *ids):
            assert not (await alice.call_tool("close_session", {"session_id": closing})).is_error


async def test_a_client_cannot_fork_or_use_another_clients_session_or_copy(
    gateway: HttpGateway,
) -> None:
    """Attack: bob copies alice's session (its memory: her variables) for himself, or uses
    the copy alice made. Both are refused as if the sessions did not exist."""
    async with connect(gateway, "alice") as alice, connect(gateway, "bob") as bob:
        sid = await made(alice)
        await printed(alice, sid, "secret = 'of alice'")
        stolen = await bob.call_tool("fork_session", {"session_id": sid})
        assert stolen.is_error and "no session" in text(stolen), text(stolen)
        copy = await alice.call_tool("fork_session", {"session_id": sid})
        assert not copy.is_error, text(copy)
        copy_id = copy.structured_content["forks"][0]["session_id"]
        used = await bob.call_tool("execute_code", {"code": "print(secret)", "session_id": copy_id})
        assert used.is_error and "no session" in text(used), text(used)
        assert copy_id not in session_ids(await bob.call_tool("list_sessions", {}))
        for closing in (sid, copy_id):
            assert not (await alice.call_tool("close_session", {"session_id": closing})).is_error


async def test_a_declared_session_a_client_may_use_is_not_forked_for_it(
    gateway: HttpGateway, state_dir: Path
) -> None:
    """A declared session's spec is the operator's (resources, shared group, lifetime):
    alice, granted its use, may not turn it into sessions of her own."""
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=state_dir))
    name = f"declared-{os.getpid()}"
    await runtime.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": name, "annotations": {"mcpforge.dev/clients": "alice"}},
            "spec": {"image": "localhost/mcp-forge-kernel:0.1.0-minimal"},
        }
    )
    try:
        async with connect(gateway, "alice") as alice:
            assert await printed(alice, name, "print('usable')") == "usable\n"
            refused = await alice.call_tool("fork_session", {"session_id": name})
            assert refused.is_error and "only sessions you created" in text(refused), text(refused)
    finally:
        await runtime.delete(name)
