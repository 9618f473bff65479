"""Tasks on a cluster (gateway/mcp/tasks_kube.py): two real cluster gateways (one token)
against the real test cluster and operator keep a client's tasks in the API, so that
what one replica runs the other answers for: its status, its result, its cancel (the
replica running the cell interrupts the kernel), and the end of the replica that ran
it. Raw JSON-RPC (tests/raw_mcp.py): the SDK clients do not make tasks."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import httpx2
import pytest

from mcp_forge.clients.kube import Kube
from mcp_forge.gateway.mcp import tasks_kube
from raw_mcp import open_session, rpc, shown, task_of

from .harness import running_operator
from .test_cluster_e2e import CALL_DEADLINE, cluster_gateway

pytestmark = pytest.mark.podman

HEARTBEAT = 0.5  # seconds: a killed replica's tasks are stale after three


async def test_a_clients_tasks_are_answered_by_every_replica_and_outlive_the_one_running_them(
    kube_api: Any, kube: Kube, tmp_path: Path
) -> None:
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    env = {"MCPFORGE_TASKS_NAMESPACE": ns, "MCPFORGE_TASK_HEARTBEAT": str(HEARTBEAT)}
    http = httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE))
    async with (
        http,
        running_operator(kube),
        cluster_gateway(kube_api, tokens, token, env=env) as one,
        cluster_gateway(kube_api, tokens, token, env=env) as two,
    ):
        assert any(f"Secrets in namespace {ns}" in line for line in one.log), one.log
        via_one = await open_session(http, one.url, token)
        via_two = await open_session(http, two.url, token)
        first = await rpc(
            http,
            one.url,
            via_one,
            "tools/call",
            name="execute_code",
            arguments={"code": "kept = 1"},
        )
        assert shown(first) is None and "result" in first, first

        # Run on one, followed and picked up through two.
        done = await task_of(http, one.url, via_one, "import time\ntime.sleep(1)\n6 * 7")
        seen = (await rpc(http, two.url, via_two, "tasks/get", taskId=done))["result"]
        assert seen["status"] in ("working", "completed"), seen
        result = await rpc(http, two.url, via_two, "tasks/result", taskId=done)
        assert shown(result) == "42", result
        listed = (await rpc(http, two.url, via_two, "tasks/list"))["result"]["tasks"]
        assert done in [t["taskId"] for t in listed], listed
        secret = await asyncio.to_thread(kube.get, "Secret", ns, tasks_kube.PREFIX + done)
        assert secret is not None and secret["type"] == "mcpforge.dev/task"
        assert (
            token not in json.dumps(secret)
            and "agent" not in secret["metadata"]["labels"][tasks_kube.OWNER]
        )

        # Cancelled through two while one runs it: one interrupts the kernel.
        long = await task_of(http, one.url, via_one, "import time\ntime.sleep(120)\nafter = 1")
        cancelled = (await rpc(http, two.url, via_two, "tasks/cancel", taskId=long))["result"]
        assert cancelled["status"] == "cancelled", cancelled
        after = await rpc(
            http,
            two.url,
            via_two,
            "tools/call",
            name="execute_code",
            arguments={"code": "('after' in globals(), kept)"},
        )
        assert shown(after) == "(False, 1)", after
        for url, sent in ((one.url, via_one), (two.url, via_two)):  # the cancel stands
            ended = (await rpc(http, url, sent, "tasks/get", taskId=long))["result"]
            assert ended["status"] == "cancelled", ended

        # One is killed while it runs a cell: through two the task says its runner is gone.
        cut = await task_of(http, one.url, via_one, "import time\ntime.sleep(120)")
        one.process.kill()
        await one.process.wait()
        # tasks/result waits (two asks the API) until the missed heartbeats say so.
        async with asyncio.timeout(30):
            said = await rpc(http, two.url, via_two, "tasks/result", taskId=cut)
        assert "stopped" in said["error"]["message"], said
        status = (await rpc(http, two.url, via_two, "tasks/get", taskId=cut))["result"]
        assert status["status"] == "failed" and "stopped" in status["statusMessage"], status
