"""What only a real cluster can show: admission and the network, enforced.

* PodSecurity admission enforces "restricted" in each test's namespace: the kernel pod the
  operator renders is admitted there, and a pod that breaks the profile is refused.
* An ephemeral session's kernel pod has no volume (docs/security.md): its root is not
  read-only, yet the kernel writes nowhere a mounted /workspace and /tmp did not let it,
  and its connection is in neither the pod object nor its environment.
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
    key_in,
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


# Run in the kernel: every path of the root filesystem its uid may write, outside the
# places it owns; what became of the connection; and the writes it must not make.
WRITABLE_WALK = """
import json, os
# Its workspace, the image's sandbox user's home, and Debian's sticky 1777 directories.
OWN = ("/workspace", "/home/sandbox", "/tmp", "/var/tmp", "/run/lock", "/dev/shm")
writable = []
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    if root.startswith(OWN):
        dirs[:] = []
        continue
    for name in dirs + files:
        path = os.path.join(root, name)
        if path.startswith(OWN) or os.path.islink(path):
            continue
        if os.access(path, os.W_OK):
            writable.append(path)
refused = {}
for attempt in ("/usr/lib/os-release", "/etc/passwd", "/opt/kernel/bin/python-planted"):
    try:
        open(attempt, "a").close()
        refused[attempt] = False
    except OSError:
        refused[attempt] = True
try:
    os.makedirs("/etc/mcp-forge/ipython")
    refused["/etc/mcp-forge/ipython"] = False
except OSError:
    refused["/etc/mcp-forge/ipython"] = True
conn = "/tmp/.mcp-forge/connection.json"
print(json.dumps({
    "writable": writable,
    "refused": refused,
    "env": sorted(k for k in os.environ if "CONNECTION" in k),
    "file": oct(os.stat(conn).st_mode & 0o777),
    "dir": oct(os.stat(os.path.dirname(conn)).st_mode & 0o777),
    "owner": os.stat(conn).st_uid,
}))
"""


async def test_an_ephemeral_kernel_writes_only_its_own_places_and_its_key_is_nowhere_shown(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    ns = kube_api.namespace
    await ready_session(kube, ns, "layer")
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-layer")
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-layer-conn")
    assert pod is not None and secret is not None
    assert not pod["spec"].get("volumes"), pod["spec"].get("volumes")
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert key_in(secret) not in json.dumps(pod)  # a secretKeyRef, never the value
    async with kernel(kube, ns, "layer") as conn:
        found = json.loads(await run_in_kernel(conn, WRITABLE_WALK, 120))
    assert found["writable"] == [], found["writable"][:20]
    assert all(found["refused"].values()), found["refused"]
    assert found["env"] == []  # the launcher took it out of the kernel's environment
    assert (found["file"], found["dir"], found["owner"]) == ("0o400", "0o700", 1000)


async def test_a_kernel_past_its_writable_layers_bound_is_evicted_and_the_session_says_so(
    kube_api: KubeAPI, kube: Kube, operator: Any
) -> None:
    """The bound of an ephemeral pod's workspace and /tmp is its ephemeral-storage limit
    (64Mi + 256Mi here), which the kubelet enforces by eviction, as it did an emptyDir's
    sizeLimit; each file stays under RLIMIT_FSIZE (64Mi)."""
    ns = kube_api.namespace
    await ready_session(kube, ns, "fill", workspace={"size": "64Mi"})
    fill = (
        "import os\nfor i in range(6):\n    open(f'/workspace/f{i}', 'wb').write(bytes(60 << 20))\n"
    )
    async with kernel(kube, ns, "fill") as conn:
        await run_in_kernel(conn, fill, 60)

    def evicted(obj: dict[str, Any] | None) -> bool:
        ended = ((obj or {}).get("status") or {}).get("lastTermination") or {}
        return ended.get("reason") == "Evicted"

    obj = await eventually(kube, KS, ns, "fill", evicted, timeout=START, what="evicted")
    assert obj is not None
    message = obj["status"]["lastTermination"]["message"]
    assert "evicted" in message and "ephemeral local storage" in message, message
