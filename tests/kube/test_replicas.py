"""Cluster gateways that share nothing in memory: two real `mcp-forge gateway --kubernetes`
processes (one token), and one started again, against the real test cluster and the real
operator. A client's default session, its quota and its sessions' call rates live in the
API (the session's name, a per-client Lease, the session's activity Lease), so what one
replica did the other sees (tests/e2e/test_replicas.py has the same locally)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import quota
from mcp_forge.clients.kube import Kube
from mcp_forge.errors import InvalidRequest
from mcp_forge.runtimes.cluster import QUOTA_LEASE, RATES, RESERVATIONS, KubernetesRuntime
from mcp_forge.settings import Settings
from support import SPEND_CALLS, cancelled_call, value

from .harness import SMALL, running_operator
from .test_cluster_e2e import cluster_gateway, connect, text

pytestmark = pytest.mark.podman

QUOTA = 3


async def test_two_cluster_replicas_and_a_restarted_one_share_a_clients_state(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    """One default session for both replicas and after a restart, variables kept; six
    creates at once over both replicas never pass the quota; a rate limit spent through
    one replica (and a cancelled call there) holds on the other."""
    from mcp_servers.config import upstream_config

    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps(upstream_config(tmp_path)))
    args = ("--mcp-config", str(config))
    env = {"MCPFORGE_SESSIONS_PER_CLIENT_MAX": str(QUOTA)}
    async with running_operator(kube):
        async with (
            cluster_gateway(kube_api, tokens, token, *args, env=env) as one,
            cluster_gateway(kube_api, tokens, token, *args, env=env) as two,
            connect(one) as via_one,
            connect(two) as via_two,
        ):
            # First use on both replicas at once: one default session.
            (sid, _), (other, _) = await asyncio.gather(
                value(via_one, "x = 41"), value(via_two, "y = 1")
            )
            assert sid == other, "two replicas made two default sessions"
            assert await value(via_two, "x + y") == (sid, "42")

            # The rate: callsPerMinute 3, spent through one, a cancelled call there.
            made = await via_one.call_tool(
                "create_session",
                {
                    **SMALL,
                    "variant": "minimal",
                    "mcp_servers": [{"name": "edge", "callsPerMinute": 3}],
                },
            )
            assert not made.is_error, text(made)
            coded = made.structured_content["session_id"]
            _, spent = await value(via_one, SPEND_CALLS.format(n=4), coded)
            assert spent.startswith("['0', '1', '2', ") and "rate limit of 3" in spent, spent
            await cancelled_call(via_one, coded, seconds=60)
            _, again = await value(via_two, SPEND_CALLS.format(n=2), coded)
            assert again.count("rate limit of 3") == 2, again
            lease = await asyncio.to_thread(kube.get, "Lease", ns, f"ks-{coded}")
            assert lease is not None and RATES in lease["metadata"]["annotations"]

            # The quota: two held, six creates at once over both replicas, one place.
            results = await asyncio.gather(
                *(
                    c.call_tool("create_session", {**SMALL, "variant": "minimal"})
                    for c in (via_one, via_two) * 3
                )
            )
            new = [r.structured_content["session_id"] for r in results if not r.is_error]
            refused = [text(r) for r in results if r.is_error]
            assert len(new) == QUOTA - 2, "\n".join(refused)
            assert all("the most a client may have" in t for t in refused), refused
            listed = await via_one.call_tool("list_sessions", {})
            held = {s["session_id"] for s in listed.structured_content["sessions"]}
            assert held == {sid, coded, *new}
            # Every create done, its reservation released: the client's quota Lease is gone.
            leases = await asyncio.to_thread(kube.list, "Lease", ns)
            left = [x["metadata"] for x in leases["items"]]
            assert not [m for m in left if m["name"].startswith(QUOTA_LEASE)], left
            for name in (coded, *new):
                closed = await via_two.call_tool("close_session", {"session_id": name})
                assert not closed.is_error, text(closed)
        # Both stopped: a gateway started again gives the client the same kernel.
        async with (
            cluster_gateway(kube_api, tokens, token, *args, env=env) as three,
            connect(three) as agent,
        ):
            assert await value(agent, "x + y") == (sid, "42")
            closed = await agent.call_tool("close_session", {"session_id": sid})
            assert not closed.is_error, text(closed)
            # Closed, it is made again on next use: the same name, a new kernel.
            assert await value(agent, "'x' in dir()") == (sid, "False")
            await agent.call_tool("close_session", {"session_id": sid})


async def test_quota_reservations_race_their_leases_deletion_and_lose_nothing(
    kube_api: Any, kube: Kube
) -> None:
    """Two replicas' runtimes reserve and release one client's places at once, on the real
    API server: a Lease deleted once empty (resourceVersion precondition) never takes a
    live reservation with it, and no more than the limit are ever held."""
    ns = kube_api.namespace
    one, two = (
        KubernetesRuntime(Settings(session_namespace=ns), Kube(kube.client.configuration))
        for _ in range(2)
    )
    lease = QUOTA_LEASE + hashlib.sha256(b"racer").hexdigest()[:16]

    def claim(name: str) -> quota.Seat:
        return quota.Seat(ns, "racer", name, QUOTA, owns=lambda b: False)

    async def reserve(runtime: KubernetesRuntime, name: str) -> str | None:
        try:
            await runtime.reserve(claim(name))
        except InvalidRequest:
            return None
        return name

    async def reserved() -> set[str]:
        body = await asyncio.to_thread(kube.get, "Lease", ns, lease)
        if body is None:
            return set()
        raw = (body["metadata"].get("annotations") or {}).get(RESERVATIONS)
        return set(quota.load_reservations(raw))

    try:
        held: set[str] = set()
        for round_ in range(6):
            # Releases of every place held, and twice as many reserves, all at once.
            # (With none held, exactly the limit's worth of them get a place.)
            asked = [f"r{round_}-{i}" for i in range(2 * QUOTA)]
            free = not held
            got = await asyncio.gather(
                *((one, two)[i % 2].release(claim(n)) for i, n in enumerate(sorted(held))),
                *(reserve((one, two)[i % 2], n) for i, n in enumerate(asked)),
            )
            held = {n for n in got if n}
            assert len(held) == QUOTA if free else len(held) <= QUOTA, got
            assert await reserved() == held
        await asyncio.gather(*(one.release(claim(n)) for n in held))
        assert await asyncio.to_thread(kube.get, "Lease", ns, lease) is None
        # The last place released on one replica (its Lease then deleted) while the other
        # reserves: the new reservation is never deleted with the Lease.
        for i in range(8):
            await one.reserve(claim(f"a{i}"))
            await asyncio.gather(one.release(claim(f"a{i}")), two.reserve(claim(f"b{i}")))
            assert await reserved() == {f"b{i}"}, i
            await two.release(claim(f"b{i}"))
            assert await asyncio.to_thread(kube.get, "Lease", ns, lease) is None, i
    finally:
        one.close()
        two.close()
