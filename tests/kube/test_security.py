"""What only a real cluster can show: admission and the network, enforced.

* PodSecurity admission enforces "restricted" in each test's namespace: the kernel pod the
  operator renders is admitted there, and a pod that breaks the profile is refused.
* kube-router enforces NetworkPolicies: a pod that is not a gateway cannot reach a kernel's
  ports, a gateway pod can; a kernel reaches nothing (not even a listener this test runs in
  a pod next to it) unless its session says `network.egress: All`; a kernel pod that no
  session's or pool's policy selects (as one is while a claim moves it) admits nobody.

Connections go only to pods of the test's own namespace.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import kubernetes
import pytest

from mcp_forge.clients.kube import Kube
from mcp_forge.control.baseline import Baseline
from mcp_forge.control.render import BASELINE_POLICY, KERNEL_LABELS, render_baseline_policy

from .conftest import KubeAPI
from .harness import (
    KS,
    condition,
    connect_code,
    eventually,
    kernel,
    probe_pod,
    run_in_kernel,
    running_operator,
    session_body,
)

GATEWAY = {"app.kubernetes.io/name": "mcp-forge", "app.kubernetes.io/component": "gateway"}
START = 90.0


@pytest.fixture
async def operator(kube: Kube) -> AsyncIterator[Any]:
    async with running_operator(kube) as op:
        yield op


async def ready_session(kube: Kube, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    await asyncio.to_thread(kube.create, session_body(name, ns, **spec))
    obj = await eventually(
        kube,
        KS,
        ns,
        name,
        lambda o: condition(o, "Ready").get("status") == "True",
        timeout=START,
        what="Ready",
    )
    assert obj is not None
    return obj


async def probe(kube: Kube, kube_api: KubeAPI, labels: dict[str, str], code: str) -> str:
    """Run a probe pod to its end; what it printed."""
    name = f"probe-{secrets.token_hex(3)}"
    ns = kube_api.namespace
    await asyncio.to_thread(kube.create, probe_pod(name, ns, labels, code))
    done = await eventually(
        kube,
        "Pod",
        ns,
        name,
        lambda p: ((p or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"),
        timeout=START,
        what="the probe ran",
    )
    assert done is not None
    assert done["status"]["phase"] == "Succeeded", done["status"]
    return await asyncio.to_thread(kube_api.kubectl, "logs", name)


async def listener(kube: Kube, kube_api: KubeAPI, labels: dict[str, str] | None = None) -> str:
    """A pod of this test listening on 8080 (Python's http.server); its IP once it serves."""
    name = f"listener-{secrets.token_hex(3)}"
    body = probe_pod(name, kube_api.namespace, labels or {"role": "listener"}, "")
    container = body["spec"]["containers"][0]
    container["command"] = ["python3", "-m", "http.server", "8080", "--directory", "/"]
    container["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    await asyncio.to_thread(kube.create, body)
    pod = await eventually(
        kube,
        "Pod",
        kube_api.namespace,
        name,
        lambda p: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in ((p or {}).get("status") or {}).get("conditions") or []
        ),
        timeout=START,
        what="the listener ready",
    )
    assert pod is not None
    return str(pod["status"]["podIP"])


async def test_the_kernel_pod_is_admitted_under_restricted_and_a_weaker_pod_is_not(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    ns = kube_api.namespace
    namespace = await asyncio.to_thread(kubernetes.client.CoreV1Api().read_namespace, ns)
    labels = namespace.metadata.labels if namespace.metadata else None
    assert labels and labels["pod-security.kubernetes.io/enforce"] == "restricted"
    obj = await ready_session(kube, ns, "strict")
    assert obj["status"]["phase"] == "Ready"
    # The same namespace refuses a pod that keeps its capabilities and may escalate.
    weak = probe_pod("weak", ns, {}, "print(1)")
    weak["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True}
    # A dict body: the client serializes it, though its annotations name only V1Pod.
    create = kubernetes.client.CoreV1Api().create_namespaced_pod
    with pytest.raises(kubernetes.client.ApiException) as refused:
        await asyncio.to_thread(create, ns, weak)  # type: ignore[arg-type]
    assert refused.value.status == 403 and refused.value.body is not None
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, message
    assert "allowPrivilegeEscalation != false" in message, message


async def test_only_gateway_pods_reach_a_kernels_ports(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    ns = kube_api.namespace
    obj = await ready_session(kube, ns, "guarded")
    ip = obj["status"]["podIP"]
    for port in (5555, 5559, 5560):
        out = await probe(kube, kube_api, {"role": "stranger"}, connect_code(ip, port))
        assert out.startswith("closed"), f"a non-gateway pod reached {ip}:{port}: {out}"
    # kube-router admits a new pod's address a moment after the pod appears: keep trying.
    out = await probe(kube, kube_api, GATEWAY, connect_code(ip, 5555, until_open=30))
    assert out.strip() == "open", f"a gateway pod could not reach the kernel: {out}"


async def test_a_kernel_pod_that_no_session_or_pool_policy_selects_is_closed(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    """What a kernel pod is while a claim moves it from its pool's policy to its session's
    (or after its own policy is deleted): selected only by the namespace's baseline."""
    ns = kube_api.namespace
    await ready_session(kube, ns, "first")  # the operator closes the namespace first
    baseline = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, BASELINE_POLICY)
    assert baseline is not None
    assert baseline["spec"]["podSelector"]["matchLabels"].items() <= KERNEL_LABELS.items()
    assert not baseline["spec"].get("ingress") and not baseline["spec"].get("egress")
    # A kernel pod with neither a session's nor a pool's label, serving on 8080.
    ip = await listener(kube, kube_api, dict(KERNEL_LABELS))
    # Even a gateway, which a session's kernel admits, is refused. The network plugin
    # programs a new pod a moment after it starts: try until refused, 30 s at most (with
    # no policy selecting the pod, it stays open and this fails).
    until_closed = (
        "import socket, time\n"
        "deadline = time.monotonic() + 30\n"
        "while True:\n"
        "    s = socket.socket()\n"
        "    s.settimeout(3)\n"
        "    try:\n"
        f"        s.connect(({ip!r}, 8080))\n"
        "        state = 'open'\n"
        "    except OSError as e:\n"
        "        state = 'closed ' + type(e).__name__\n"
        "    finally:\n"
        "        s.close()\n"
        "    if state != 'open' or time.monotonic() > deadline:\n"
        "        print(state)\n"
        "        break\n"
        "    time.sleep(0.5)  # a policy being applied elsewhere: nothing to wait on\n"
    )
    out = await probe(kube, kube_api, GATEWAY, until_closed)
    assert out.startswith("closed"), f"a kernel pod no session selects was reachable: {out}"
    # Narrowed by hand (a label more to match, an expression, a rule): restored whole.
    narrowed = {
        "spec": {
            "podSelector": {
                "matchLabels": {"extra": "label"},
                "matchExpressions": [{"key": "x", "operator": "Exists"}],
            },
            "ingress": [{}],
        }
    }
    await asyncio.to_thread(kube.patch, "NetworkPolicy", ns, BASELINE_POLICY, narrowed)
    await asyncio.to_thread(Baseline(kube).ensure, ns, look=True)
    restored = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, BASELINE_POLICY)
    assert restored is not None
    want = render_baseline_policy(ns)["spec"]
    assert restored["spec"]["podSelector"] == want["podSelector"], restored["spec"]
    assert not restored["spec"].get("ingress") and not restored["spec"].get("egress")


@pytest.mark.parametrize(("egress", "expected"), [("None", "closed"), ("All", "open")])
async def test_a_kernel_reaches_nothing_unless_egress_is_all(
    kube_api: KubeAPI, kube: Kube, operator: Any, egress: str, expected: str
) -> None:
    ns = kube_api.namespace
    target = await listener(kube, kube_api)
    await ready_session(kube, ns, "out", network={"egress": egress})
    async with kernel(kube, ns, "out") as conn:
        out = await run_in_kernel(
            conn, connect_code(target, 8080, until_open=20 if expected == "open" else 0), 60
        )
        routes = await run_in_kernel(conn, "print(open('/proc/net/route').read())")
    assert out.startswith(expected), f"egress {egress}: {out}"
    # Whatever the policy, the kernel has no default route: nothing beyond the cluster.
    assert all(line.split()[1] != "00000000" for line in routes.splitlines()[1:] if line)
