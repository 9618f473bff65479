"""The install as users do it, on the real test cluster, for each kustomization that runs here.

The operator and gateway images are built from this checkout without a registry
(`mcp-forge image build --control-plane`) and copied into the node; then, as
manifests/README.md says: `kubectl apply -k manifests/base`, the gateway's tokens Secret,
a KernelSession applied with kubectl, an MCP client through `kubectl port-forward
svc/mcp-forge-gateway 8765` with a token from that Secret. The operator and the gateway run
in pods with exactly the ServiceAccounts, RBAC and NetworkPolicies of manifests/base; the
gateway dials kernels through their Services, resolved by the cluster's DNS.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent
from prometheus_client.parser import text_string_to_metric_families

from mcp_forge.clients.kube import Kube
from mcp_forge.gateway.mcp.tasks_kube import PREFIX
from mcp_forge.image.control_plane import TARGETS, build_control_plane, image_ref
from mcp_forge.runtimes.cluster import QUOTA_LEASE
from raw_mcp import open_session, rpc, shown, task_of

from .conftest import ClusterUnderTest, KubeAPI, install_crds
from .test_security import probe

pytestmark = pytest.mark.podman

ROOT = Path(__file__).parents[2]
SYSTEM, SESSIONS = "mcp-forge-system", "mcp-forge-sessions"
EGRESS = "mcp-forge-egress"  # the egress proxy's namespace
PORT = 8765  # the documented `kubectl port-forward svc/mcp-forge-gateway 8765`
DEADLINE = "180s"
MONITORING = "mcpforge.dev/monitoring"  # the namespace label the NetworkPolicy "metrics" admits


def kubectl(cluster: ClusterUnderTest, *args: str, input: str | None = None) -> str:
    done = subprocess.run(
        [cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args],
        input=input,
        text=True,
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


# Each kustomization that can run here (overlays/gvisor needs a gVisor runtime on the node).
KUSTOMIZATIONS = ["base", "overlays/namespace-scoped"]
# How each is applied: client-side as `kubectl apply -k` does, server-side as Argo CD and
# Flux do in their server-side modes; each is then diffed the other way.
SERVER_SIDE = {"base": False, "overlays/namespace-scoped": True}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def installed(test_cluster: ClusterUnderTest, request: pytest.FixtureRequest) -> Iterator[str]:
    """A kustomization applied with the images on the node; the gateway's token."""
    kustomization = ROOT / "manifests" / request.param
    if not test_cluster.own:
        pytest.skip("the images are copied into this machine's test cluster only")
    asyncio.run(build_control_plane(progress=lambda line: None))
    imported = subprocess.run(
        [str(Path(__file__).parent / "cluster"), "import", *(image_ref(n) for n in TARGETS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    token = secrets.token_urlsafe(32)
    how = ["--server-side", "--force-conflicts"] if SERVER_SIDE[request.param] else []
    try:
        kubectl(test_cluster, "apply", *how, "-k", str(kustomization))
        kubectl(
            test_cluster,
            "-n",
            SYSTEM,
            "create",
            "secret",
            "generic",
            "mcp-forge-gateway-tokens",
            "--from-literal",
            f"tokens=agent {token}\n",
        )
        for namespace, deployment in (
            (SYSTEM, "mcp-forge-operator"),
            (SYSTEM, "mcp-forge-gateway"),
            (EGRESS, "mcp-forge-egress"),
        ):
            kubectl(
                test_cluster, "-n", namespace, "rollout", "status", f"deploy/{deployment}",
                f"--timeout={DEADLINE}",
            )  # fmt: skip
        assert_unchanged(test_cluster, kustomization, server_side=not how)
        yield token
    finally:
        uninstall(test_cluster, kustomization)


def assert_unchanged(cluster: ClusterUnderTest, kustomization: Path, *, server_side: bool) -> None:
    """Applying it again (server-side or client-side) would change nothing: `kubectl
    diff` exits 0 for no differences, 1 for some (printed), more for an error."""
    done = subprocess.run(
        [cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "diff",
         *(["--server-side"] if server_side else []), "-k", str(kustomization)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    # Taking over a client-side apply, kubectl rewrites its own bookkeeping, the
    # last-applied-configuration annotation (a JSON line), and a Deployment's generation
    # goes up with any annotation change (its strategy copies them to ReplicaSets; the
    # pod template is unchanged, nothing restarts): that is no drift. Anything else is.
    changed = [
        line[1:].strip()
        for line in done.stdout.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    drift = [x for x in changed if not x.startswith(('{"apiVersion"', "generation: "))]
    assert drift == [], f"{kustomization.name}: {drift[:20]}"


def uninstall(cluster: ClusterUnderTest, kustomization: Path) -> None:
    """Everything the kustomization made but the CRD, which the other tests share."""
    built = kubectl(cluster, "kustomize", str(kustomization))
    objects = [o for o in yaml.safe_load_all(built) if o]
    for obj in objects:
        if obj["kind"] in ("CustomResourceDefinition", "Namespace"):
            continue
        if obj["metadata"].get("namespace"):
            continue  # goes with its namespace
        kubectl(cluster, "delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")
    kubectl(cluster, "delete", "namespace", SYSTEM, SESSIONS, EGRESS, "--ignore-not-found",
            "--wait=true", f"--timeout={DEADLINE}")  # fmt: skip
    install_crds(cluster.kubeconfig)


@pytest.fixture
async def gateway_url(test_cluster: ClusterUnderTest, installed: str) -> AsyncIterator[str]:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.fail(f"port {PORT} is taken on this host: the documented port-forward needs it")
    async with forwarded(test_cluster, "svc/mcp-forge-gateway", str(PORT)):
        yield f"http://localhost:{PORT}/mcp"


@asynccontextmanager
async def forwarded(cluster: ClusterUnderTest, target: str, ports: str) -> AsyncIterator[int]:
    """`kubectl port-forward TARGET PORTS` in mcp-forge-system while in the block; the
    local port it forwards from."""
    proc = await asyncio.create_subprocess_exec(
        cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", SYSTEM,
        "port-forward", target, ports,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        found = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
        assert found, line
        yield int(found.group(1))
    finally:
        proc.terminate()
        await proc.wait()


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_kubectl_apply_k_serves_agents_through_the_gateway_service(
    test_cluster: ClusterUnderTest, installed: str, gateway_url: str, kube: Kube, kube_api: KubeAPI
) -> None:
    # A session a user declares with kubectl, for this client.
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "minimal.yaml").read_text())
    example["metadata"]["annotations"] = {"mcpforge.dev/clients": "agent"}
    kubectl(test_cluster, "-n", SESSIONS, "apply", "-f", "-", input=json.dumps(example))
    kubectl(
        test_cluster, "-n", SESSIONS, "wait", "--for=condition=Ready", "kernelsession/scratch",
        f"--timeout={DEADLINE}",
    )  # fmt: skip
    # Ready when its kernel answered the operator itself: the installed NetworkPolicies
    # let the operator reach the kernel's shell port (control/answers.py).
    said = json.loads(kubectl(test_cluster, "-n", SESSIONS, "get", "ks", "scratch", "-o", "json"))
    assert said["status"]["message"] == "the kernel answered the operator", said["status"]

    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {installed}"}, timeout=httpx2.Timeout(30, read=120)
    )
    async with http, Client(streamable_http_client(gateway_url, http_client=http)) as agent:
        ran = await agent.call_tool(
            "execute_code", {"session_id": "scratch", "code": "import socket\nx = 6 * 7\nprint(x)"}
        )
        assert not ran.is_error and "42" in text(ran), text(ran)
        # The node has 2 CPUs, and `scratch` holds 1 of them (its default limit = request).
        made = await agent.call_tool("create_session", {"variant": "minimal", "cpu": "250m"})
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        ran = await agent.call_tool("execute_code", {"session_id": sid, "code": "print('warm')"})
        assert "warm" in text(ran), text(ran)
        closed = await agent.call_tool("close_session", {"session_id": sid})
        assert not closed.is_error, text(closed)
    # A long cell as a task: kept in the API, in the gateway's own namespace (its Role).
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=120)) as raw:
        sent = await open_session(raw, gateway_url, installed)
        task = await task_of(raw, gateway_url, sent, "x * 2", session_id="scratch")
        assert shown(await rpc(raw, gateway_url, sent, "tasks/result", taskId=task)) == "84"
    kept = json.loads(kubectl(test_cluster, "-n", SYSTEM, "get", "secrets", "-o", "json"))
    assert PREFIX + task in [x["metadata"]["name"] for x in kept["items"]], "not in the API"

    # The operator asked for nothing its RBAC forbids (namespace-scoped: kopf no longer
    # lists namespaces and CRDs cluster-wide, which held the first session back 55 s).
    logs = kubectl(test_cluster, "-n", SYSTEM, "logs", "deploy/mcp-forge-operator")
    assert "Forbidden" not in logs, logs[-3000:]

    # What a user reads: the printer columns and the status.
    table = kubectl(test_cluster, "-n", SESSIONS, "get", "ks")
    header, *rows = table.splitlines()
    assert header.split()[:3] == ["NAME", "PHASE", "RESTARTS"], header
    row = next(r.split() for r in rows if r.startswith("scratch "))
    assert row[1:3] == ["Ready", "0"], table
    obj = json.loads(kubectl(test_cluster, "-n", SESSIONS, "get", "ks", "scratch", "-o", "json"))
    status = obj["status"]
    assert status["connection"]["host"] == f"ks-scratch.{SESSIONS}.svc"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Ready"]["observedGeneration"] == obj["metadata"]["generation"]
    assert status["lastActivity"], "the gateway reported activity on the Lease"
    # Its create done, the client's quota Lease is deleted (the Role allows it).
    leases = json.loads(kubectl(test_cluster, "-n", SESSIONS, "get", "leases", "-o", "json"))
    names = [x["metadata"]["name"] for x in leases["items"]]
    assert not [n for n in names if n.startswith(QUOTA_LEASE)], names
    # Prometheus finds both by their pods' annotations; the numbers moved.
    gateway_metrics = await scrape(test_cluster, "gateway")
    ok = ("mcpforge_tool_calls_total", (("outcome", "ok"), ("tool", "execute_code")))
    assert gateway_metrics.get(ok, 0) >= 2, gateway_metrics
    operator_metrics = await scrape(test_cluster, "operator")
    reconciles = ("mcpforge_reconcile_seconds_count", (("kind", "KernelSession"),))
    assert operator_metrics.get(reconciles, 0) >= 1, operator_metrics
    # Through the pod network, as Prometheus in another namespace would: the NetworkPolicy
    # "metrics" admits 9090 from a namespace labelled for monitoring, and nothing else (the
    # operator's liveness port stays closed). Unlabelled, the namespace reaches neither.
    ips = {c: pod_of(test_cluster, c)["status"]["podIP"] for c in ("gateway", "operator")}
    once = SCRAPE.format(until=0, **ips)
    barred = json.loads(await probe(kube, kube_api, {"role": "prometheus"}, once))
    assert barred["gateway"] is not True and barred["operator"] is not True, barred
    label = ("label", "namespace", kube_api.namespace)
    kubectl(test_cluster, *label, f"{MONITORING}=true", "--overwrite")
    try:
        admitted = SCRAPE.format(until=60, **ips)
        seen = json.loads(await probe(kube, kube_api, {"role": "prometheus"}, admitted))
    finally:
        kubectl(test_cluster, *label, f"{MONITORING}-")
    assert seen == {"gateway": True, "operator": True, "healthz": seen["healthz"]}, seen
    assert seen["healthz"] != "open", seen
    # The gateway pod has the rights of its ServiceAccount and no more: no pods.
    gateway = f"system:serviceaccount:{SYSTEM}:mcp-forge-gateway"
    assert can_i(test_cluster, gateway, "list", "pods") == "no"
    assert can_i(test_cluster, gateway, "create", "kernelsessions") == "yes"
    assert can_i(test_cluster, gateway, "list", "kernelsessionpools") == "yes", "to pick one"
    assert can_i(test_cluster, gateway, "list", "secrets") == "no", "kernels' keys are there"


# With `until` > 0, each scrape is tried again for that long: the CNI applies a policy's
# change (a namespace label) some moments after the API server has it.
SCRAPE = """
import json, socket, time, urllib.request
seen = {{}}
for name, ip in (("gateway", "{gateway}"), ("operator", "{operator}")):
    deadline = time.monotonic() + {until}
    while True:
        try:
            with urllib.request.urlopen(f"http://{{ip}}:9090/metrics", timeout=5) as r:
                seen[name] = b"mcpforge_" in r.read()
            break
        except OSError as e:
            seen[name] = type(e).__name__
            if time.monotonic() > deadline:
                break
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("{operator}", 8080))
    seen["healthz"] = "open"
except OSError as e:
    seen["healthz"] = type(e).__name__
print(json.dumps(seen))
"""


def pod_of(cluster: ClusterUnderTest, component: str) -> dict[str, Any]:
    pods = json.loads(
        kubectl(cluster, "-n", SYSTEM, "get", "pods", "-o", "json", "-l",
                f"app.kubernetes.io/name=mcp-forge,app.kubernetes.io/component={component}")
    )["items"]  # fmt: skip
    running = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert len(running) == 1, [p["metadata"]["name"] for p in pods]
    found: dict[str, Any] = running[0]
    return found


async def scrape(
    cluster: ClusterUnderTest, component: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples at the port and path the component's pod annotations name, reached by
    `kubectl port-forward` to that pod: (name, sorted labels) -> value."""
    pod = pod_of(cluster, component)
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true", (component, notes)
    target, port = f"pod/{pod['metadata']['name']}", notes["prometheus.io/port"]
    async with forwarded(cluster, target, f":{port}") as local:
        url = f"http://127.0.0.1:{local}{notes['prometheus.io/path']}"
        async with httpx2.AsyncClient(timeout=30) as http:
            got = await http.get(url)
        assert got.status_code == 200, (url, got.status_code)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(got.text)
        for sample in family.samples
    }


def can_i(cluster: ClusterUnderTest, user: str, verb: str, resource: str) -> str:
    done = subprocess.run(
        [cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "auth", "can-i", verb,
         resource, "-n", SESSIONS, f"--as={user}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip()
