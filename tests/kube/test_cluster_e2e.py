"""End to end on the real test cluster, with real kernel pods on its real kubelet.

The operator is the real one (kopf, in a thread); the gateway is the real `mcp-forge
gateway --kubernetes`, run on this host as a subprocess and driven over streamable HTTP by
the official MCP SDK client. From the host it dials kernels at their pod IPs
(`MCPFORGE_KUBE_CONNECT=pod-ip`): Service names resolve inside the cluster only.
tests/kube/test_install.py runs the gateway as users do, in a pod, through the Services.
"""

from __future__ import annotations

import asyncio
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

from mcp_forge.clients.kube import Kube

from .harness import KS, SMALL, eventually, phase, pool_body, running_operator

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
START_DEADLINE = 60.0
CALL_DEADLINE = 120.0
STOP_DEADLINE = 30.0


@dataclass
class Gateway:
    process: asyncio.subprocess.Process
    url: str
    token: str
    log: list[str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _read(process: asyncio.subprocess.Process, log: list[str], until: str = "") -> bool:
    assert process.stderr is not None
    while line := (await process.stderr.readline()).decode():
        log.append(line)
        if until and until in line:
            return True
    return False


@asynccontextmanager
async def cluster_gateway(
    kube_api: Any, tokens_file: Path, token: str, *extra: str, env: dict[str, str] | None = None
) -> AsyncIterator[Gateway]:
    port = free_port()
    env = {
        **kube_api.env(),
        "MCPFORGE_SESSION_NAMESPACE": kube_api.namespace,
        "MCPFORGE_KUBE_CONNECT": "pod-ip",
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        *(GATEWAY, "gateway", "--kubernetes", "--http", f"127.0.0.1:{port}"),
        *("--tokens-file", str(tokens_file)),
        *extra,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    gw = Gateway(process, f"http://127.0.0.1:{port}/mcp", token, [])
    try:
        async with asyncio.timeout(START_DEADLINE):
            if not await _read(process, gw.log, until="MCP over HTTP at"):
                pytest.fail(f"the gateway exited ({await process.wait()}):\n" + "".join(gw.log))
        drain = asyncio.create_task(_read(process, gw.log))
        yield gw
        killed = process.returncode is not None  # by the test itself: SIGKILL, no other end
        if not killed:
            process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(STOP_DEADLINE):
            assert await process.wait() == (-signal.SIGKILL if killed else 0), "".join(gw.log)
            await drain
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@asynccontextmanager
async def connect(gw: Gateway) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {gw.token}"},
        timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE),
    )
    async with (
        http,
        Client(
            streamable_http_client(gw.url, http_client=http), read_timeout_seconds=CALL_DEADLINE
        ) as c,
    ):
        yield c


async def make_filled(kube: Kube, pool: dict[str, Any]) -> None:
    """Create the KernelSessionPool and wait until the operator has it full."""
    await asyncio.to_thread(kube.create, pool)
    meta, size = pool["metadata"], pool["spec"]["size"]
    await eventually(
        kube,
        "KernelSessionPool",
        meta["namespace"],
        meta["name"],
        lambda o: (o or {}).get("status", {}).get("ready") == size,
        timeout=120,
        what=f"{size} ready",
    )


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_a_cluster_gateway_runs_code_survives_its_restart_and_deletes(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    async with running_operator(kube):
        async with cluster_gateway(kube_api, tokens, token) as gw, connect(gw) as agent:
            made = await agent.call_tool("create_session", {"variant": "minimal"})
            assert not made.is_error, text(made)
            sid = made.structured_content["session_id"]
            ran = await agent.call_tool("execute_code", {"session_id": sid, "code": "x = 41"})
            assert not ran.is_error, text(ran)
        obj = await asyncio.to_thread(kube.get, KS, ns, sid)
        assert obj is not None, "a cluster gateway leaves its sessions to the cluster"
        assert obj["status"]["phase"] == "Ready"
        lease = await asyncio.to_thread(kube.get, "Lease", ns, f"ks-{sid}")
        assert lease is not None and lease["spec"]["renewTime"], "activity is on the Lease"
        # Who wrote what, by name (managedFields): the gateway made the session and renews
        # its Lease, the operator wrote its status.
        wrote = {(m["manager"], m.get("subresource", "")) for m in obj["metadata"]["managedFields"]}
        assert {("mcp-forge-gateway", ""), ("mcp-forge-operator", "status")} <= wrote, wrote
        assert not [m for m, _ in wrote if m == "OpenAPI-Generator"], wrote
        renewed = {m["manager"] for m in lease["metadata"]["managedFields"]}
        assert "mcp-forge-gateway" in renewed and "OpenAPI-Generator" not in renewed, renewed
        # A new gateway process, no store: it reattaches to the same kernel.
        async with cluster_gateway(kube_api, tokens, token) as gw, connect(gw) as agent:
            listed = await agent.call_tool("list_sessions", {})
            assert sid in [s["session_id"] for s in listed.structured_content["sessions"]]
            ran = await agent.call_tool("execute_code", {"session_id": sid, "code": "print(x + 1)"})
            assert "42" in text(ran), text(ran)
            # A kernel restart goes through the operator: a new pod, variables gone.
            restarted = await agent.call_tool("restart_kernel", {"session_id": sid})
            assert not restarted.is_error, text(restarted)
            ran = await agent.call_tool(
                "execute_code", {"session_id": sid, "code": "print('x' in dir())"}
            )
            assert "False" in text(ran), text(ran)
            after = await asyncio.to_thread(kube.get, KS, ns, sid)
            assert after is not None
            assert after["status"]["kernelId"] != obj["status"]["kernelId"]
            assert after["status"]["connection"]["generation"] == 2
            closed = await agent.call_tool("close_session", {"session_id": sid})
            assert not closed.is_error, text(closed)
        await eventually(kube, KS, ns, sid, lambda o: o is None, what="deleted")
        await eventually(
            kube, "Pod", ns, f"ks-{sid}", lambda p: p is None, timeout=60, what="pod gone"
        )


async def test_a_kernel_killed_on_the_cluster_is_reported_and_restarted(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, tokens, token) as gw,
        connect(gw) as agent,
    ):
        made = await agent.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        died = await agent.call_tool(
            "execute_code", {"session_id": sid, "code": "import os; os.kill(os.getpid(), 9)"}
        )
        assert "SIGKILL" in text(died), text(died)
        assert "restarted" in text(died), text(died)
        ran = await agent.call_tool("execute_code", {"session_id": sid, "code": "print(6 * 7)"})
        assert "42" in text(ran), text(ran)
        obj = await asyncio.to_thread(kube.get, KS, ns, sid)
        assert obj is not None
        assert obj["status"]["lastTermination"]["exitCode"] == 137
        assert obj["status"]["restarts"] == 1
        await agent.call_tool("close_session", {"session_id": sid})


async def test_two_gateway_replicas_serve_the_same_session(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, tokens, token) as one,
        cluster_gateway(kube_api, tokens, token) as two,
        connect(one) as via_one,
        connect(two) as via_two,
    ):
        made = await via_one.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        await via_one.call_tool("execute_code", {"session_id": sid, "code": "y = 'from one'"})
        ran = await via_two.call_tool("execute_code", {"session_id": sid, "code": "print(y)"})
        assert "from one" in text(ran), text(ran)
        closed = await via_two.call_tool("close_session", {"session_id": sid})
        assert not closed.is_error, text(closed)
        gone = await via_one.call_tool("execute_code", {"session_id": sid, "code": "1"})
        assert gone.is_error


async def test_a_declared_session_suspended_for_idleness_resumes_when_used(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    declared = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": KS,
        "metadata": {
            "name": "declared",
            "namespace": ns,
            "annotations": {"mcpforge.dev/clients": "agent"},
        },
        "spec": {"image": images["minimal"], "idleTimeout": "3s", "idleAction": "Suspend"},
    }
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, tokens, token) as gw,
        connect(gw) as agent,
    ):
        await asyncio.to_thread(kube.create, declared)
        await eventually(kube, KS, ns, "declared", lambda o: phase(o) == "Ready", timeout=60)
        ran = await agent.call_tool("execute_code", {"session_id": "declared", "code": "x = 1"})
        assert not ran.is_error, text(ran)
        asleep = await eventually(
            kube, KS, ns, "declared", lambda o: phase(o) == "Suspended", timeout=60
        )
        assert asleep is not None and asleep["status"]["reason"] == "Idle"
        ran = await agent.call_tool(
            "execute_code", {"session_id": "declared", "code": "print('x' in dir())"}
        )
        assert not ran.is_error and "False" in text(ran), text(ran)
        awake = await asyncio.to_thread(kube.get, KS, ns, "declared")
        assert phase(awake) == "Ready"
        closed = await agent.call_tool("close_session", {"session_id": "declared"})
        assert closed.is_error, "agents cannot close a declared session"
        await asyncio.to_thread(kube.delete, KS, ns, "declared")


async def test_code_mode_on_the_cluster_and_after_a_kernel_restart(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    """The gateway dials the kernel pod's bridge (TCP 5560) as it dials its channels."""
    import json

    from mcp_servers.config import upstream_config

    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps(upstream_config(tmp_path)))
    add = "import mcp_tools\nprint(mcp_tools.edge.add(a=40)['sum'])"
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, tokens, token, "--mcp-config", str(config)) as gw,
        connect(gw) as agent,
    ):
        made = await agent.call_tool(
            "create_session", {"variant": "minimal", "mcp_servers": [{"name": "edge"}]}
        )
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        ran = await agent.call_tool("execute_code", {"session_id": sid, "code": add})
        assert "42" in text(ran), text(ran)
        restarted = await agent.call_tool("restart_kernel", {"session_id": sid})
        assert not restarted.is_error, text(restarted)
        ran = await agent.call_tool("execute_code", {"session_id": sid, "code": add})
        assert "42" in text(ran), "the module is injected again after a restart: " + text(ran)
        await agent.call_tool("close_session", {"session_id": sid})


async def test_warm_sessions_through_the_gateway_get_their_env_once(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    """A pool the operator keeps: create_session claims from it (the result says warm);
    a declared session claims with env of its own, which the gateway gives the running
    kernel when it connects, once: a new gateway process leaves it as the code set it.
    Code mode works in a claimed kernel (its bridge's certificate is the pool's Secret's)."""
    import json

    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    pool = pool_body("warm", ns, 2, images["minimal"])
    declared = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": KS,
        "metadata": {
            "name": "given",
            "namespace": ns,
            "annotations": {"mcpforge.dev/clients": "agent"},
        },
        "spec": {
            "image": images["minimal"],
            "resources": SMALL,
            "poolRef": {"name": "warm"},
            "env": [
                {"name": "GREETING", "value": "hello from the claim"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "t"}}},
            ],
            "files": [{"path": "data/in.txt", "content": "seeded"}],
        },
    }
    # Its cold twin (more memory than the pool's template): the kubelet gives the env,
    # the gateway the working files.
    cold = json.loads(json.dumps(declared))
    cold["metadata"]["name"] = "coldtwin"
    cold["spec"]["resources"] = {"cpu": "100m", "memory": "300Mi"}
    token_value = secrets.token_hex(16)
    api_secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "api", "namespace": ns},
        "stringData": {"t": token_value},
    }
    show = "import os; print(os.environ.get('GREETING'), os.environ['MCPFORGE_SESSION'])"
    show_token = "import os; print('token', os.environ.get('TOKEN'))"
    show_file = "print('file', open('data/in.txt').read())"
    from mcp_servers.config import upstream_config

    config = tmp_path / "mcp.json"
    config.write_text(json.dumps(upstream_config(tmp_path)))
    add = "import mcp_tools\nprint(mcp_tools.edge.add(a=40)['sum'])"
    async with running_operator(kube):
        await make_filled(kube, pool)
        async with (
            cluster_gateway(
                kube_api, tokens, token, "--pool", "warm", "--mcp-config", str(config)
            ) as gw,
            connect(gw) as agent,
        ):
            made = await agent.call_tool(
                "create_session",
                {
                    "variant": "minimal",
                    "memory": "256Mi",
                    "cpu": "100m",
                    "mcp_servers": [{"name": "edge"}],
                },
            )
            assert not made.is_error, text(made)
            assert made.structured_content["start"] == "warm", made.structured_content
            sid = made.structured_content["session_id"]
            ran = await agent.call_tool("execute_code", {"session_id": sid, "code": show})
            assert f"None {sid}" in text(ran), text(ran)
            ran = await agent.call_tool("execute_code", {"session_id": sid, "code": add})
            assert "42" in text(ran), "code mode in a claimed kernel: " + text(ran)

            await asyncio.to_thread(kube.create, api_secret)
            await asyncio.to_thread(kube.create, declared)
            await asyncio.to_thread(kube.create, cold)
            await eventually(kube, KS, ns, "given", lambda o: phase(o) == "Ready", timeout=90)
            obj = await asyncio.to_thread(kube.get, KS, ns, "given")
            assert obj is not None and obj["status"]["podName"].startswith("ksp-warm-")
            ran = await agent.call_tool("execute_code", {"session_id": "given", "code": show})
            assert "hello from the claim given" in text(ran), text(ran)
            ran = await agent.call_tool("execute_code", {"session_id": "given", "code": show_token})
            assert f"token {token_value}" in text(ran), text(ran)
            ran = await agent.call_tool("execute_code", {"session_id": "given", "code": show_file})
            assert "file seeded" in text(ran), text(ran)
            await eventually(kube, KS, ns, "coldtwin", lambda o: phase(o) == "Ready", timeout=90)
            twin = await asyncio.to_thread(kube.get, KS, ns, "coldtwin")
            assert twin is not None and twin["status"]["podName"] == "ks-coldtwin"
            both = f"{show_token}\n{show_file}"
            ran = await agent.call_tool("execute_code", {"session_id": "coldtwin", "code": both})
            assert f"token {token_value}" in text(ran) and "file seeded" in text(ran), text(ran)
            claimed = await asyncio.to_thread(kube.get, "Pod", ns, obj["status"]["podName"])
            assert token_value not in str(claimed), "the Secret's value is not in the pod"
            again = await asyncio.to_thread(kube.get, KS, ns, "given")
            assert token_value not in str(again), "nor in the session"
            changed = "import os; os.environ['GREETING'] = 'changed by the code'"
            ran = await agent.call_tool("execute_code", {"session_id": "given", "code": changed})
            assert not ran.is_error, text(ran)
            assert "hello from the claim" not in str(obj["status"]), "env is not in status"
        assert not any(token_value in line for line in gw.log), "nor in the gateway's log"
        async with cluster_gateway(kube_api, tokens, token) as gw, connect(gw) as agent:
            ran = await agent.call_tool("execute_code", {"session_id": "given", "code": show})
            assert "changed by the code given" in text(ran), text(ran)
        await asyncio.to_thread(kube.delete, KS, ns, "given")
        await asyncio.to_thread(kube.delete, KS, ns, "coldtwin")


async def test_a_gateway_without_a_pool_claims_from_one_whose_template_serves_the_request(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    """No --pool: each create_session looks for a pool of the namespace that serves it.
    A request the pool's template fits claims one of its kernels (warm, and counted); a
    request for more memory than any pool's template starts cold, naming no pool."""
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {token}\n")
    pool = pool_body("picked", ns, 1, images["minimal"])
    async with running_operator(kube):
        await make_filled(kube, pool)
        async with cluster_gateway(kube_api, tokens, token) as gw, connect(gw) as agent:
            fits = {"variant": "minimal", "memory": "256Mi", "cpu": "100m"}
            made = await agent.call_tool("create_session", fits)
            assert not made.is_error, text(made)
            assert made.structured_content["start"] == "warm", made.structured_content
            warm = made.structured_content["session_id"]
            obj = await asyncio.to_thread(kube.get, KS, ns, warm)
            assert obj is not None and obj["spec"]["poolRef"] == {"name": "picked"}, obj
            assert obj["status"]["podName"].startswith("ksp-picked-"), obj["status"]
            ran = await agent.call_tool("execute_code", {"session_id": warm, "code": "6 * 7"})
            assert "42" in text(ran), text(ran)

            bigger = {**fits, "memory": "320Mi"}
            made = await agent.call_tool("create_session", bigger)
            assert not made.is_error, text(made)
            assert made.structured_content["start"] == "cold", made.structured_content
            cold = made.structured_content["session_id"]
            obj = await asyncio.to_thread(kube.get, KS, ns, cold)
            assert obj is not None, cold
            assert "poolRef" not in obj["spec"], obj["spec"]
            assert obj["status"]["podName"] == f"ks-{cold}", obj["status"]
            for sid in (warm, cold):
                closed = await agent.call_tool("close_session", {"session_id": sid})
                assert not closed.is_error, text(closed)

        # One claim served; the cold session named no pool, so it is no pool's miss.
        def counts(o: dict[str, Any] | None) -> tuple[Any, Any]:
            status = (o or {}).get("status") or {}
            return status.get("claims"), status.get("misses", 0)

        await eventually(
            kube,
            "KernelSessionPool",
            ns,
            "picked",
            lambda o: counts(o) == (1, 0),
            what="1 claim and no miss counted",
        )


def agent_tokens(tmp_path: Path) -> tuple[Path, str]:
    """A tokens file with one client, `agent`, and its token."""
    token = secrets.token_urlsafe(24)
    (tmp_path / "tokens").write_text(f"agent {token}\n")
    return tmp_path / "tokens", token


async def test_install_packages_reaches_a_cluster_kernel_over_its_channels(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    policy = ("--packages-deny", "six")
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, *agent_tokens(tmp_path), *policy) as gw,
        connect(gw) as agent,
    ):
        sid = (await agent.call_tool("create_session", {"variant": "minimal"})).structured_content[
            "session_id"
        ]
        got = await agent.call_tool(
            "install_packages", {"session_id": sid, "packages": ["msgpack==1.0.8"]}
        )
        assert not got.is_error, text(got)
        assert [p["name"] for p in got.structured_content["installed"]] == ["msgpack"]
        ran = await agent.call_tool(
            "execute_code",
            {
                "session_id": sid,
                "code": "import msgpack; print(msgpack.unpackb(msgpack.packb([7])))",
            },
        )
        assert "[7]" in text(ran), text(ran)
        denied = await agent.call_tool("install_packages", {"session_id": sid, "packages": ["six"]})
        assert denied.is_error and "PackageDenied: 'six'" in text(denied), text(denied)
        closed = await agent.call_tool("close_session", {"session_id": sid})
        assert not closed.is_error, text(closed)


async def test_spec_packages_are_installed_by_the_gateway_in_a_cluster_kernel(
    kube_api: Any, kube: Kube, images: dict[str, str], tmp_path: Path
) -> None:
    """The operator never speaks to kernels: the gateway's first connection installs
    spec.packages (under its policy) before the agent's code runs; a refused one fails
    that call, naming the package, and the session stays as it was."""
    ns = kube_api.namespace

    def declared(name: str, packages: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": KS,
            "metadata": {
                "name": name,
                "namespace": ns,
                "annotations": {"mcpforge.dev/clients": "agent"},
            },
            # Small: both on the 2-CPU node beside what earlier tests' namespaces still hold.
            "spec": {
                "image": images["minimal"],
                "packages": packages,
                "resources": {"cpu": "250m"},
            },
        }

    async with (
        running_operator(kube),
        cluster_gateway(kube_api, *agent_tokens(tmp_path), "--packages-deny", "six") as gw,
        connect(gw) as agent,
    ):
        for body in (declared("pkgs", ["tabulate==0.9.0"]), declared("denied", ["six"])):
            await asyncio.to_thread(kube.create, body)
        for name in ("pkgs", "denied"):
            await eventually(kube, KS, ns, name, lambda o: phase(o) == "Ready", timeout=60)
        ran = await agent.call_tool(
            "execute_code",
            {"session_id": "pkgs", "code": "import tabulate; print(tabulate.__version__)"},
        )
        assert not ran.is_error and "0.9.0" in text(ran), text(ran)
        restarted = await agent.call_tool("restart_kernel", {"session_id": "pkgs"})
        assert not restarted.is_error, text(restarted)
        again = await agent.call_tool(
            "execute_code",
            {"session_id": "pkgs", "code": "import tabulate; print(tabulate.__file__)"},
        )
        assert not again.is_error and "/workspace/.packages/" in text(again), text(again)
        refused = await agent.call_tool("execute_code", {"session_id": "denied", "code": "1"})
        assert refused.is_error and "PackageDenied: 'six'" in text(refused), text(refused)
        for name in ("pkgs", "denied"):
            await asyncio.to_thread(kube.delete, KS, ns, name)
