"""Local KernelSessionPools: real kernels in real Podman pods, played ahead of time and
claimed by sessions (runtimes/local/pools.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients import podman
from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway import busy
from mcp_forge.gateway.codemode.upstream import Upstream, parse_config
from mcp_forge.gateway.core import Gateway
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.guard import STATE, guard_program
from mcp_servers.config import missing_servers, upstream_config

pytestmark = pytest.mark.podman

CLI = str(Path(sys.executable).parent / "mcp-forge")
SECRET = "s3cr3t-🔑-'quoted' \"and\" \\back"

PoolFactory = Callable[..., Awaitable[str]]


def pool_body(name: str, image: str, size: int, **template: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name},
        "spec": {
            "size": size,
            "template": {"image": image, "resources": {"memory": "512Mi"}, **template},
        },
    }


def session_body(pool: str, image: str, **spec: Any) -> dict[str, Any]:
    spec.setdefault("resources", {"memory": "512Mi"})
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"c-{uuid.uuid4().hex[:10]}"},
        "spec": {"image": image, "poolRef": {"name": pool}, **spec},
    }


def warm_start(session: Any) -> dict[str, Any]:
    found = [c for c in session.status.get("conditions", []) if c["type"] == ksp.WARM_START]
    assert len(found) == 1, session.status
    return dict(found[0])


@pytest.fixture
async def make_pool(runtime: Any, images: dict[str, str]) -> AsyncIterator[PoolFactory]:
    """Apply pools (minimal image, 512Mi) and fill them; delete them and every session
    the test made from them afterwards."""
    made: list[str] = []

    async def make(size: int = 2, max_size: int | None = None, **template: Any) -> str:
        name = f"p{uuid.uuid4().hex[:8]}"
        body = pool_body(name, images["minimal"], size, **template)
        if max_size is not None:
            body["spec"]["maxSize"] = max_size
        await runtime.pools.apply(body)
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(SessionNotFound):
            await runtime.pools.delete(name)
        for session in await runtime.list():
            annotations = session.body["metadata"].get("annotations") or {}
            if annotations.get(ksp.ANNOTATION_CLAIMED_FROM) == name:
                with contextlib.suppress(SessionNotFound):
                    await runtime.delete(session.name)


@pytest.fixture
async def claims(runtime: Any, images: dict[str, str]) -> AsyncIterator[Callable[..., Any]]:
    """Claim sessions (runtime.apply of a body with poolRef); deleted afterwards."""
    names: list[str] = []

    async def claim(pool: str, **spec: Any) -> Any:
        body = session_body(pool, images["minimal"], **spec)
        names.append(body["metadata"]["name"])
        return (await runtime.apply(body)).session

    yield claim
    for name in names:
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)


async def pods() -> set[str]:
    rows = await podman.run_json("pod", "ps", "--format", "json")
    return {r["Name"] for r in rows or []}


async def value(gw: Gateway, name: str, code: str) -> Any:
    r = await gw.execute(name, code)
    assert r.status == "ok", (r.error, r.stderr)
    return json.loads(r.stdout)


async def test_a_pool_fills_to_its_size_each_kernel_with_its_own_key(
    runtime: Any, make_pool: PoolFactory
) -> None:
    name = await make_pool(size=3)
    pool = runtime.pools.get(name)
    members = runtime.pools.members(pool)
    assert len(members) == 3
    assert {m.status["phase"] for m in members} == {"Ready"}
    keys = {runtime.store.key(m.namespace, m.name) for m in members}
    assert len(keys) == 3  # never one key shared by pods
    assert {runtime.pod_name(m) for m in members} <= await pods()
    status = pool.body["status"]
    assert (status["ready"], status["starting"], status["claimed"]) == (3, 0, 0)
    assert [c["reason"] for c in status["conditions"] if c["type"] == "Ready"] == ["Filled"]


async def test_a_claim_gets_a_ready_kernel_with_its_env_kept_out_of_status_and_logs(
    runtime: Any, make_pool: PoolFactory, claims: Any, gateway: Gateway
) -> None:
    name = await make_pool(size=2)
    members = {m.name: m for m in runtime.pools.members(runtime.pools.get(name))}
    session = await claims(name, env=[{"name": "API_TOKEN", "value": SECRET}])

    assert session.status["phase"] == "Ready"
    assert warm_start(session)["status"] == "True"
    assert warm_start(session)["reason"] == ksp.CLAIMED
    # The pod, the key and the kernel are a pool kernel's: nothing was started for it.
    pod = runtime.pod_name(session)
    claimed = [m for m in members.values() if runtime.pod_name(m) == pod]
    assert len(claimed) == 1
    assert session.status["kernelId"] == claimed[0].status["kernelId"]
    assert session.uid == claimed[0].uid
    with pytest.raises(SessionNotFound):  # it is a member no more
        await runtime.get(claimed[0].name)
    # It holds the output guard it was given as it started, with these limits, and has
    # run no cell: the gateway's first call keeps it (runtimes/guard.py).
    info = await runtime.connection(session)
    conn = KernelConnection(info, max_frame=1_000_000, max_message=1_000_000)
    try:
        await conn.wait_ready(30)
        held = await busy.check_idle(conn, busy.send_probe(conn, {"guard": STATE}), session, 30)
    finally:
        conn.close()
    assert guard_program(gateway.settings).held(held), held

    seen = await value(
        gateway,
        session.name,
        "import os, json; print(json.dumps([os.environ['API_TOKEN'], "
        "os.environ['MCPFORGE_SESSION'], len(get_ipython().history_manager.input_hist_raw)]))",
    )
    # The env, exactly; its session name; and the claim left nothing in the history
    # (entry 0 is IPython's empty one, entry 1 this cell).
    assert seen == [SECRET, session.name, 2]

    stored = json.dumps((await runtime.get(session.name)).body["status"])
    assert "s3cr3t" not in stored
    logs = await podman.run("logs", runtime.container_name(session), check=False)
    assert b"s3cr3t" not in logs.stdout and "s3cr3t" not in logs.stderr
    # The pool is refilled to its size with a new kernel, with a key of its own.
    await runtime.pools.fill(runtime.pools.get(name))
    refilled = runtime.pools.members(runtime.pools.get(name))
    assert len(refilled) == 2 and {m.status["phase"] for m in refilled} == {"Ready"}
    keys = {runtime.store.key(s.namespace, s.name) for s in [*refilled, session]}
    assert len(keys) == 3
    status = runtime.pools.get(name).body["status"]
    assert (status["ready"], status["claimed"], status["claims"]) == (2, 1, 1)


async def test_concurrent_claims_never_share_a_kernel_and_the_extra_one_starts_cold(
    runtime: Any, make_pool: PoolFactory, claims: Any
) -> None:
    name = await make_pool(size=2)
    sessions = await asyncio.gather(*(claims(name) for _ in range(3)))
    reasons = sorted(warm_start(s)["reason"] for s in sessions)
    assert reasons == [ksp.CLAIMED, ksp.CLAIMED, ksp.POOL_EXHAUSTED]
    assert {s.status["phase"] for s in sessions} == {"Ready"}
    assert len({runtime.pod_name(s) for s in sessions}) == 3
    assert len({s.status["kernelId"] for s in sessions}) == 3
    assert len({runtime.store.key(s.namespace, s.name) for s in sessions}) == 3
    cold = next(s for s in sessions if warm_start(s)["reason"] == ksp.POOL_EXHAUSTED)
    assert "had no ready kernel" in warm_start(cold)["message"]


async def test_a_pool_at_its_maximum_keeps_fewer_ready_and_refills_when_a_claim_goes(
    runtime: Any, make_pool: PoolFactory, claims: Any
) -> None:
    name = await make_pool(size=1, max_size=2)

    def counts() -> tuple[int, int, int, str, str]:
        pool = runtime.pools.get(name)
        status = pool.body["status"]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        members = len(runtime.pools.members(pool))
        return status["ready"], status["claimed"], members, ready["reason"], ready["message"]

    first = await claims(name)
    await runtime.pools.fill(runtime.pools.get(name))
    assert counts() == (1, 1, 1, "Filled", "1 of 1 kernels ready")  # 1 claimed + 1 ready
    second = await claims(name)
    assert warm_start(second)["reason"] == ksp.CLAIMED
    await runtime.pools.fill(runtime.pools.get(name))
    assert counts() == (
        0,
        2,
        0,
        ksp.AT_MAXIMUM,
        "0 of 1 kernels ready: at its maximum of 2 (2 claimed)",
    )
    third = await claims(name)
    assert warm_start(third)["reason"] == ksp.POOL_EXHAUSTED
    assert third.status["phase"] == "Ready"  # cold, and served all the same

    runtime.pools.wanted.clear()
    await runtime.delete(first.name)
    assert runtime.pools.wanted.is_set()  # the gateway's keeper refills now, not later
    await runtime.pools.fill(runtime.pools.get(name))
    assert counts() == (1, 1, 1, "Filled", "1 of 1 kernels ready")


@pytest.mark.parametrize(
    ("spec", "reason", "says"),
    [
        ({"resources": {"memory": "256Mi"}}, ksp.POOL_MISMATCH, "spec.resources"),
        ({"env": [{"name": "PYTHONPATH", "value": "/x"}]}, ksp.POOL_MISMATCH, "PYTHONPATH"),
        ({"sharedGroup": "team"}, ksp.POOL_MISMATCH, "sharedGroup"),
        ({"poolRef": {"name": "no-such-pool"}}, ksp.POOL_NOT_FOUND, "no-such-pool"),
    ],
    ids=["memory", "startup-env", "shared-group", "no-pool"],
)
async def test_a_claim_no_pool_can_serve_starts_cold_and_says_why(
    runtime: Any,
    make_pool: PoolFactory,
    claims: Any,
    gateway: Gateway,
    spec: dict[str, Any],
    reason: str,
    says: str,
) -> None:
    name = await make_pool(size=1)
    before = runtime.pools.members(runtime.pools.get(name))
    session = await claims(name, **spec)
    assert session.status["phase"] == "Ready"
    condition = warm_start(session)
    assert (condition["status"], condition["reason"]) == ("False", reason)
    assert says in condition["message"] and "started cold" in condition["message"]
    assert runtime.pod_name(session) not in {runtime.pod_name(m) for m in before}
    assert runtime.pools.members(runtime.pools.get(name)) == before  # the pool is untouched
    assert (await gateway.execute(session.name, "print(6 * 7)")).stdout == "42\n"


async def test_a_template_change_replaces_unclaimed_kernels_only(
    runtime: Any, make_pool: PoolFactory, claims: Any, gateway: Gateway, images: dict[str, str]
) -> None:
    name = await make_pool(size=2)
    session = await claims(name)
    await gateway.execute(session.name, "kept = 'still here'")
    old = {m.name for m in runtime.pools.members(runtime.pools.get(name))}
    old_pods = {runtime.pod_name(m) for m in runtime.pools.members(runtime.pools.get(name))}
    assert len(old) == 1  # the claim's refill has not run: no keeper here

    changed = pool_body(name, images["minimal"], 2, workspace={"size": "256Mi"})
    applied = await runtime.pools.apply(changed)
    assert applied.action == "configured"
    members = runtime.pools.members(applied.pool)
    assert len(members) == 2 and not old & {m.name for m in members}
    assert {m.body["metadata"]["labels"][ksp.LABEL_TEMPLATE] for m in members} == {
        applied.pool.template_hash
    }
    assert not old_pods & await pods()  # the old kernel's pod is gone
    # The claimed kernel was not touched: same kernel, its variable alive.
    after = await runtime.get(session.name)
    assert after.status["kernelId"] == session.status["kernelId"]
    assert (await gateway.execute(session.name, "print(kept)")).stdout == "still here\n"
    # A claim of the old template's spec no longer matches.
    cold = await claims(name)
    assert warm_start(cold)["reason"] == ksp.POOL_MISMATCH


async def test_a_template_change_at_its_maximum_never_holds_more_than_it(
    runtime: Any, make_pool: PoolFactory, claims: Any, images: dict[str, str]
) -> None:
    name = await make_pool(size=2, max_size=2)
    await claims(name)  # one claimed: room for one unclaimed kernel (no keeper refills)
    assert len(runtime.pools.members(runtime.pools.get(name))) == 1
    seen: list[int] = []  # the pool's unclaimed kernels, sampled while the change rolls
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            seen.append(len(runtime.pools.members(runtime.pools.get(name))))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.02):
                    await done.wait()

    sampler = asyncio.create_task(sample())
    changed = pool_body(name, images["minimal"], 2, workspace={"size": "256Mi"})
    changed["spec"]["maxSize"] = 2
    try:
        applied = await runtime.pools.apply(changed)
    finally:
        done.set()
        await sampler
    members = runtime.pools.members(applied.pool)
    assert [m.body["metadata"]["labels"][ksp.LABEL_TEMPLATE] for m in members] == [
        applied.pool.template_hash
    ]
    assert members[0].status["phase"] == "Ready"
    # The old kernel made way for the new one: never two unclaimed beside the claimed one.
    assert len(seen) > 1 and max(seen) == 1, seen


async def test_deleting_a_pool_deletes_its_kernels_and_leaves_claimed_sessions_alone(
    runtime: Any, make_pool: PoolFactory, claims: Any, gateway: Gateway
) -> None:
    name = await make_pool(size=2)
    session = await claims(name)
    members = runtime.pools.members(runtime.pools.get(name))
    member_pods = {runtime.pod_name(m) for m in members}
    assert await runtime.pools.delete(name) == 1
    with pytest.raises(SessionNotFound):
        runtime.pools.get(name)
    assert not member_pods & await pods()
    for m in members:
        with pytest.raises(SessionNotFound):
            await runtime.get(m.name)
    assert (await runtime.get(session.name)).status["phase"] == "Ready"
    assert (await gateway.execute(session.name, "print('alive')")).stdout == "alive\n"


async def test_a_claim_whose_process_dies_midway_is_finished_by_the_next_user(
    runtime: Any, make_pool: PoolFactory, cli_env: dict[str, str], images: dict[str, str],
    gateway: Gateway, tmp_path: Path,
) -> None:  # fmt: skip
    """`mcp-forge apply` of a claim is killed while the claimed kernel cannot answer (its
    container paused): the session was taken, its env not given yet. The next user of
    the session finishes the claim; no kernel is claimed twice, none is leaked."""
    name = await make_pool(size=2)
    members = runtime.pools.members(runtime.pools.get(name))
    for m in members:  # neither can answer the claim's environment
        await podman.run("pause", runtime.container_name(m))
    body = session_body(name, images["minimal"], env=[{"name": "FROM_CLAIM", "value": "yes"}])
    claimed_name = body["metadata"]["name"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    proc = await asyncio.create_subprocess_exec(
        CLI, "apply", "-f", str(tmp_path / "s.yaml"), env=cli_env
    )
    try:
        async with asyncio.timeout(60):  # until the claim has taken a kernel (renamed it)
            while True:
                with contextlib.suppress(SessionNotFound):
                    taken = await runtime.get(claimed_name)
                    if taken.status.get("reason") == ksp.CLAIMED:
                        break
                await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        for m in members:
            await podman.run("unpause", runtime.container_name(m), check=False)
    assert taken.status["phase"] == "Starting"
    # A second claim meanwhile gets the other kernel, never the one being claimed.
    second = (await runtime.apply(session_body(name, images["minimal"]))).session
    try:
        assert warm_start(second)["reason"] == ksp.CLAIMED
        assert runtime.pod_name(second) != runtime.pod_name(taken)
        # The next use finishes the interrupted claim: Ready, with its env.
        seen = await value(
            gateway, claimed_name, "import os, json; print(json.dumps(os.environ['FROM_CLAIM']))"
        )
        assert seen == "yes"
        done = await runtime.get(claimed_name)
        assert done.status["phase"] == "Ready" and warm_start(done)["status"] == "True"
        # Every kernel pod belongs to exactly one stored session.
        stored = [runtime.pod_name(s) for s in await runtime.list()]
        ours = {p for p in await pods() if p.startswith(f"mcpforge-default-{name}-")}
        assert len(stored) == len(set(stored))
        assert ours <= set(stored)
    finally:
        for n in (claimed_name, second.name):
            with contextlib.suppress(SessionNotFound):
                await runtime.delete(n)


async def test_a_claimed_kernel_calls_code_mode_servers_given_at_claim_time(
    runtime: Any, make_pool: PoolFactory, claims: Any, settings: Any, tmp_path: Path
) -> None:
    config = upstream_config(tmp_path)
    missing = missing_servers(config)
    if missing:
        pytest.fail("; ".join(missing.values()))
    upstreams = {n: Upstream(c) for n, c in parse_config(config).items()}
    gw = Gateway(runtime, settings, upstreams=upstreams)
    try:
        name = await make_pool(size=1)
        session = await claims(name, mcpServers=[{"name": "edge"}])
        assert warm_start(session)["reason"] == ksp.CLAIMED
        r = await gw.execute(session.name, "import mcp_tools; print(mcp_tools.edge.add(a=40))")
        assert (r.status, r.stdout) == ("ok", "{'sum': 42}\n"), (r.error, r.stderr)
    finally:
        await gw.close()
        for u in upstreams.values():
            await u.close()
