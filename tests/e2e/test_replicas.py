"""Gateways that share nothing in memory: two real `mcp-forge gateway --http` processes on
one store (the same tokens), and one started again, driven by the official SDK client,
with real kernels in real Podman pods. What one replica knows, the other does: a
client's default session, its quota, its sessions' call rates (tests/kube has the same
on the cluster)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from test_http import CLIENTS, HttpGateway, connect, running_gateway, text

from mcp_servers.config import upstream_config
from support import SPEND_CALLS, cancelled_call, value

pytestmark = pytest.mark.podman

QUOTA = 3


def new_tokens() -> dict[str, str]:
    """Clients named afresh, a token each: a client's default session outlives the
    gateways, and the store is the test run's (test_http.py's alice may have one)."""
    return {f"{name}-{secrets.token_hex(4)}": secrets.token_urlsafe(24) for name in CLIENTS}


@asynccontextmanager
async def replicas(
    state_dir: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[HttpGateway, HttpGateway, str]]:
    """Two gateways on one store, with the same tokens; and the name of a client."""
    tokens = new_tokens()
    async with (
        running_gateway(state_dir, tmp_path, *args, tokens=tokens, env=env) as one,
        running_gateway(state_dir, tmp_path, *args, tokens=tokens, env=env) as two,
    ):
        yield one, two, next(iter(tokens))


async def test_two_replicas_and_a_restarted_one_give_a_client_one_default_session(
    state_dir: Path, tmp_path: Path
) -> None:
    tokens = new_tokens()
    client = next(iter(tokens))
    async with running_gateway(state_dir, tmp_path, tokens=tokens) as one:
        async with (
            running_gateway(state_dir, tmp_path, tokens=tokens) as two,
            connect(one, client) as via_one,
            connect(two, client) as via_two,
        ):
            # First use on both replicas at once: they race to create it, one session comes.
            (sid, _), (other, _) = await asyncio.gather(
                value(via_one, "x = 41"), value(via_two, "y = 1")
            )
            assert sid == other, "two replicas made two default sessions"
            assert await value(via_two, "x + y") == (sid, "42")
        # Replica two stopped (SIGTERM): the session is there, with its variables.
        async with connect(one, client) as via_one:
            assert await value(via_one, "x + y") == (sid, "42")
    # Both stopped; a gateway started again gives alice the same kernel.
    async with (
        running_gateway(state_dir, tmp_path, tokens=tokens) as three,
        connect(three, client) as alice,
    ):
        assert await value(alice, "x + y") == (sid, "42")
        closed = await alice.call_tool("close_session", {"session_id": sid})
        assert not closed.is_error, text(closed)
        # Closed, it is made again on next use: the same name, a new kernel.
        assert await value(alice, "'x' in dir()") == (sid, "False")
        await alice.call_tool("close_session", {"session_id": sid})


async def test_concurrent_creates_on_two_replicas_never_exceed_the_quota(
    state_dir: Path, tmp_path: Path
) -> None:
    env = {"MCPFORGE_SESSIONS_PER_CLIENT_MAX": str(QUOTA)}
    async with (
        replicas(state_dir, tmp_path, env=env) as (one, two, client),
        connect(one, client) as via_one,
        connect(two, client) as via_two,
    ):
        create = {"variant": "minimal"}
        # All but one place taken, then six creates at once, three on each replica: both
        # replicas check the count at once, and both would see the last place free.
        first = await asyncio.gather(
            *(c.call_tool("create_session", create) for c in (via_one, via_two))
        )
        assert not any(r.is_error for r in first), [text(r) for r in first]
        results = await asyncio.gather(
            *(c.call_tool("create_session", create) for c in (via_one, via_two) * 3)
        )
        made = [r.structured_content["session_id"] for r in [*first, *results] if not r.is_error]
        refused = [text(r) for r in results if r.is_error]
        try:
            assert len(made) == QUOTA, refused
            assert all("the most a client may have" in t for t in refused), refused
            listed = await via_two.call_tool("list_sessions", {})
            assert sorted(s["session_id"] for s in listed.structured_content["sessions"]) == sorted(
                made
            )
        finally:
            for sid in made:
                await via_one.call_tool("close_session", {"session_id": sid})


async def test_a_rate_limit_holds_across_replicas_and_a_cancelled_call(
    state_dir: Path, tmp_path: Path
) -> None:
    """callsPerMinute is the session's, wherever its calls come from: spent through one
    replica, after a cancelled call there (which drops the kernel's bridge), a second
    replica still refuses."""
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps(upstream_config(tmp_path)))
    async with (
        replicas(state_dir, tmp_path, "--mcp-config", str(config)) as (one, two, client),
        connect(one, client) as via_one,
        connect(two, client) as via_two,
    ):
        made = await via_one.call_tool(
            "create_session",
            {"variant": "minimal", "mcp_servers": [{"name": "edge", "callsPerMinute": 3}]},
        )
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        try:
            _, spent = await value(via_one, SPEND_CALLS.format(n=4), sid)
            assert spent.startswith("['0', '1', '2', ") and "rate limit of 3" in spent, spent
            await cancelled_call(via_one, sid, seconds=60)
            _, again = await value(via_two, SPEND_CALLS.format(n=2), sid)
            assert again.count("rate limit of 3") == 2, again
        finally:
            await via_two.call_tool("close_session", {"session_id": sid})
