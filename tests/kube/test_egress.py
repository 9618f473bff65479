"""Egress by name on the real test cluster (issue 28): the proxy's Deployment as
manifests/base installs it (its image imported into the node), the real operator writing
grants, the real gateway running code in real kernel pods.

Stand-ins for internet hosts listen on this machine's own address, which is the test
node's (tests/egress_standins.py); the proxy's resolver maps the test names to it, and
checks the stand-ins' certificates against the test CA, both given to the proxy's
container by a ConfigMap in this test only.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from egress_index import Hosts, hosts_standing
from egress_kernel import holding_search
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.render_egress import PROXY_KEY, TOKEN_KEY
from mcp_forge.egress.protocol import token_for
from mcp_forge.image.control_plane import build_control_plane, image_ref

from .conftest import ClusterUnderTest
from .harness import KS, condition, eventually, phase, running_operator
from .test_cluster_e2e import Gateway, cluster_gateway, connect, text
from .test_install import kubectl

pytestmark = pytest.mark.podman

ROOT = Path(__file__).resolve().parents[2]
EGRESS = "mcp-forge-egress"
DEADLINE = 180
PACKAGE = "forge-egress-probe"
SECRET = "egress-api"
RESOURCES = {"cpu": "500m", "memory": "512Mi"}  # two sessions and the proxy on 2 cores
POOLED = {"cpu": "250m", "memory": "512Mi"}  # B's, claimed from a pool
VALUE = f"inj-{secrets.token_hex(16)}"  # in the session namespace's Secret; never in a kernel
VALUE_B = f"inj-b-{secrets.token_hex(16)}"  # B's, added to its requests to other.test
POOL = "egress-warm"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with hosts_standing(tmp_path_factory.mktemp("egress-ca"), PACKAGE) as standing:
        yield standing


def egress_objects(cluster: ClusterUnderTest, hosts: Hosts) -> list[dict[str, Any]]:
    """What manifests/base installs for the proxy (its namespace's objects), with the
    test names and the test CA given to the proxy: a ConfigMap, two flags."""
    built = kubectl(cluster, "kustomize", str(ROOT / "manifests" / "base"))
    objects = [
        o
        for o in yaml.safe_load_all(built)
        if o
        and (
            o["metadata"].get("namespace") == EGRESS
            or (o["kind"] == "Namespace" and o["metadata"]["name"] == EGRESS)
        )
    ]
    names = {n: [hosts.address] for n in ("api.test", "files.test", "other.test", "pypi.test")}
    names |= {
        "loop.test": ["127.0.0.1"],
        "kube.test": ["10.96.0.1"],
        "meta.test": ["169.254.169.254"],
    }
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "egress-test", "namespace": EGRESS},
            "data": {"resolve.json": json.dumps(names), "ca.pem": hosts.ca.ca_path.read_text()},
        }
    )
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (proxy,) = [c for c in pod["containers"] if c["name"] == "proxy"]
    proxy["args"] = [
        *proxy.get("args", []),
        "--resolve", "/etc/egress-test/resolve.json",
        "--upstream-ca", "/etc/egress-test/ca.pem",
    ]  # fmt: skip
    proxy.setdefault("volumeMounts", []).append(
        {"name": "egress-test", "mountPath": "/etc/egress-test", "readOnly": True}
    )
    pod.setdefault("volumes", []).append(
        {"name": "egress-test", "configMap": {"name": "egress-test"}}
    )
    return objects


@pytest.fixture(scope="module")
def proxy(test_cluster: ClusterUnderTest, hosts: Hosts) -> Iterator[None]:
    """The egress proxy's Deployment running on the node, as installed."""
    if not test_cluster.own:
        pytest.skip("the images are copied into this machine's test cluster only")
    asyncio.run(build_control_plane(progress=lambda line: None))
    imported = subprocess.run(
        [str(Path(__file__).parent / "cluster"), "import", image_ref("egress")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    objects = egress_objects(test_cluster, hosts)
    try:
        kubectl(test_cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objects))
        kubectl(test_cluster, "-n", EGRESS, "rollout", "status", f"deploy/{EGRESS}",
                f"--timeout={DEADLINE}s")  # fmt: skip
        yield
    finally:
        kubectl(test_cluster, "delete", "namespace", EGRESS, "--ignore-not-found",
                "--wait=true", f"--timeout={DEADLINE}s")  # fmt: skip


def rules(hosts: Hosts) -> list[dict[str, Any]]:
    own = [f"{hosts.address}/32"]
    port, index = hosts.https.port, hosts.index.port
    ref = {"secretKeyRef": {"name": SECRET, "key": "token"}}
    return [
        {"host": "api.test", "ports": [port], "addresses": own},
        {"host": "files.test", "ports": [port], "addresses": own,
         "inject": [{"header": "Authorization", "prefix": "Bearer ", **ref}]},
        {"host": "pypi.test", "ports": [index], "addresses": own},
        {"host": "loop.test", "ports": [port]},
        {"host": "kube.test", "ports": [443]},
        {"host": "meta.test", "ports": [80]},
    ]  # fmt: skip


def declared(
    ns: str, name: str, image: str, allow: list[dict[str, Any]], **spec: Any
) -> dict[str, Any]:
    clients = {"mcpforge.dev/clients": "agent"}
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": KS,
        "metadata": {"name": name, "namespace": ns, "annotations": clients},
        "spec": {"image": image, "resources": RESOURCES, "network": {"allow": allow}, **spec},
    }


def pool_of(ns: str, image: str, allow: list[dict[str, Any]]) -> dict[str, Any]:
    """A pool of one kernel with B's template: started with no way out, as pools' are."""
    template = {"image": image, "resources": POOLED, "network": {"allow": allow}}
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": ksp.KIND,
        "metadata": {"name": POOL, "namespace": ns},
        "spec": {"size": 1, "template": template},
    }


def fetch_code(url: str, headers: dict[str, str] | None = None) -> str:
    """urllib in the kernel, proxies from its environment; the test CA trusted for tunnels,
    the session's bundle (SSL_CERT_FILE) where the proxy reads."""
    return f"""
import json, os, ssl, urllib.request, urllib.error
ctx = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"))
ctx.load_verify_locations(cadata={{CA!r}})
try:
    req = urllib.request.Request({url!r}, headers={headers or {}!r})
    with urllib.request.urlopen(req, context=ctx, timeout=20) as r:
        out = {{"status": r.status, "length": len(r.read())}}
except urllib.error.HTTPError as e:
    out = {{"status": e.code, "reason": e.reason}}
except (urllib.error.URLError, OSError) as e:
    out = {{"error": str(getattr(e, "reason", e))[:500]}}
print(json.dumps(out))
"""


@dataclasses.dataclass
class Kernel:
    agent: Any
    sid: str
    ca: str

    async def run(self, code: str, timeout: float = 60) -> str:
        ran = await self.agent.call_tool(
            "execute_code", {"session_id": self.sid, "code": code, "timeout": timeout}
        )
        assert not ran.is_error, text(ran)
        return text(ran).removeprefix("[stdout]\n")

    async def fetch(self, url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
        out = await self.run(fetch_code(url, headers).replace("{CA!r}", repr(self.ca)))
        return dict(json.loads(out.strip().splitlines()[-1]))


@asynccontextmanager
async def kernels(gw: Gateway, hosts: Hosts) -> AsyncIterator[tuple[Kernel, Kernel]]:
    """Sessions A and B as an agent of the gateway uses them (an MCP client in this task)."""
    ca = hosts.ca.ca_path.read_text()
    async with connect(gw) as agent:
        yield Kernel(agent, "egress-a", ca), Kernel(agent, "egress-b", ca)


@pytest.fixture
async def sessions(
    proxy: None, kube_api: Any, kube: Kube, hosts: Hosts, images: dict[str, str], tmp_path: Path
) -> AsyncIterator[Gateway]:
    """Two declared sessions in the test's namespace, Ready: A with the rules above, and
    B with other.test only (a header added), its kernel claimed from a pool; the gateway
    an agent may use both through."""
    ns = kube_api.namespace
    token = secrets.token_urlsafe(24)
    (tmp_path / "tokens").write_text(f"agent {token}\n")
    data = {k: base64.b64encode(v.encode()).decode() for k, v in (("token", VALUE), ("b", VALUE_B))}
    await asyncio.to_thread(
        kube.create,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": ns},
         "data": data},
    )  # fmt: skip
    inject = [{"header": "X-Api-Key", "secretKeyRef": {"name": SECRET, "key": "b"}}]
    other = [{"host": "other.test", "ports": [hosts.https.port],
              "addresses": [f"{hosts.address}/32"], "inject": inject}]  # fmt: skip
    offered = [{"host": "api.test", "ports": [hosts.https.port],
                "addresses": [f"{hosts.address}/32"]}]  # fmt: skip
    env = {"MCPFORGE_EGRESS_CLIENT_ALLOW": json.dumps(offered)}
    async with (
        running_operator(kube),
        cluster_gateway(kube_api, tmp_path / "tokens", token, env=env) as gw,
    ):
        image = images["minimal"]
        await asyncio.to_thread(kube.create, pool_of(ns, image, other))
        await asyncio.to_thread(kube.create, declared(ns, "egress-a", image, rules(hosts)))
        await eventually(kube, ksp.KIND, ns, POOL,
                         lambda o: ((o or {}).get("status") or {}).get("ready") == 1,
                         timeout=90, what="the pool's kernel ready")  # fmt: skip
        await a_pool_kernel_has_no_way_out(kube, ns)
        b = declared(ns, "egress-b", image, other, resources=POOLED, poolRef={"name": POOL})
        await asyncio.to_thread(kube.create, b)
        for name in ("egress-a", "egress-b"):
            await eventually(kube, KS, ns, name, lambda o: phase(o) == "Ready", timeout=90,
                             what="Ready")  # fmt: skip
        await asyncio.to_thread(kube.delete, ksp.KIND, ns, POOL)  # no refill: 2 cores
        yield gw
        for name in ("egress-a", "egress-b"):
            await asyncio.to_thread(kube.delete, KS, ns, name)
        for name in ("egress-a", "egress-b"):
            await eventually(kube, "Secret", EGRESS, f"{ns}.{name}", lambda o: o is None,
                             timeout=30, what="grant deleted")  # fmt: skip


async def test_egress_by_name_on_a_cluster(
    sessions: Gateway, hosts: Hosts, kube: Kube, kube_api: Any, test_cluster: ClusterUnderTest
) -> None:
    """One pair of sessions, every check (each pair costs two kernel pods' starts)."""
    async with kernels(sessions, hosts) as (a, b):
        await reaches_its_names_and_nothing_else(a, b, hosts)
        await no_way_out_but_the_proxy(a, hosts)
        await a_secret_is_added_on_the_way_out_and_never_in_the_kernel(a, b, hosts)
        await a_kernel_claimed_from_a_pool_gets_its_way_out(b, hosts, kube, kube_api.namespace)
        await a_credential_is_good_from_its_own_pod_only(b, hosts, kube, kube_api.namespace)
        await pip_installs_from_an_allowed_index(a, hosts)
        await a_client_chooses_within_what_is_offered(a.agent, hosts)
    await the_credential_is_the_sessions_and_the_grant_holds_it(kube, kube_api.namespace)
    await a_stopped_session_keeps_no_grant(kube, kube_api.namespace)
    verdicts_are_counted_by_the_feeder(test_cluster)


async def reaches_its_names_and_nothing_else(a: Kernel, b: Kernel, hosts: Hosts) -> None:
    got = await a.fetch(hosts.https.url("api.test", "/bytes/1000"))
    assert got == {"status": 200, "length": 1000}, got
    seen = hosts.https.wait_for(lambda r: r.path == "/bytes/1000", timeout=10)
    assert seen.server_name == "api.test"
    for name, why in (
        ("other.test", "no rule allows other.test"),
        ("loop.test", "127.0.0.1"),
        ("kube.test", "10.96.0.1"),
        ("meta.test", "169.254.169.254"),
    ):
        port = {"kube.test": 443, "meta.test": 80}.get(name, hosts.https.port)
        scheme = "http" if name == "meta.test" else "https"
        got = await a.fetch(f"{scheme}://{name}:{port}/latest/meta-data/")
        if scheme == "http":  # a plain request's refusal is the proxy's answer
            assert got.get("status") == 403 and why in got.get("reason", ""), (name, got)
            continue
        assert "403" in got.get("error", "") and why in got["error"], (name, got)
    got = await a.fetch(f"https://{hosts.address}:{hosts.https.port}/echo")
    assert "403" in got.get("error", "") and "IP address" in got["error"], got
    # B's rules are its own: other.test is B's, api.test is A's.
    assert (await b.fetch(hosts.https.url("other.test", "/bytes/10")))["status"] == 200
    got = await b.fetch(hosts.https.url("api.test", "/echo"))
    assert "no rule allows api.test" in got.get("error", ""), got


async def no_way_out_but_the_proxy(a: Kernel, hosts: Hosts) -> None:
    """A direct connection to the stand-in (this machine's address, which the node's pods
    have a route to) gets no answer: the NetworkPolicy drops it. The kernel has no DNS."""
    code = f"""
import socket
out = []
try:
    socket.create_connection(({hosts.address!r}, {hosts.https.port}), timeout=3).close()
    out.append("connected")
except OSError as e:
    out.append(type(e).__name__)
try:
    socket.getaddrinfo("kubernetes.default.svc", 443)
    out.append("resolved")
except OSError:
    out.append("no dns")
print(out)
"""
    out = await a.run(code)
    assert "connected" not in out and "resolved" not in out and "no dns" in out, out


async def a_secret_is_added_on_the_way_out_and_never_in_the_kernel(
    a: Kernel, b: Kernel, hosts: Hosts
) -> None:
    got = await a.fetch(
        hosts.https.url("files.test", "/bytes/16"), {"Authorization": "Bearer forged"}
    )
    assert got == {"status": 200, "length": 16}, got
    seen = hosts.https.wait_for(lambda q: q.path == "/bytes/16", timeout=10)
    assert dict(seen.headers)["Authorization"] == f"Bearer {VALUE}"
    assert seen.server_name == "files.test"
    assert (await a.run(holding_search(VALUE), timeout=120)).strip() == "[]"
    # B's requests never carry A's value: files.test is not B's at all.
    got = await b.fetch(hosts.https.url("files.test", "/bytes/17"))
    assert "no rule allows files.test" in got.get("error", ""), got


async def pip_installs_from_an_allowed_index(a: Kernel, hosts: Hosts) -> None:
    url = f"https://pypi.test:{hosts.index.port}/simple/"
    code = f"""
import os, subprocess, sys, tempfile
with tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False) as f:
    f.write({hosts.ca.ca_path.read_text()!r})
env = {{k: v for k, v in os.environ.items() if not k.endswith(("_CA_BUNDLE", "PIP_CERT"))}}
done = subprocess.run(
    [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
     "--index-url", {url!r}, "--cert", f.name, "--target", "/tmp/lib", {PACKAGE!r}],
    capture_output=True, text=True, timeout=120, env=env)
print(done.returncode, done.stderr[-800:])
"""
    out = await a.run(code, timeout=180)
    assert out.split()[:1] == ["0"], out
    wheel = hosts.index.wheels[PACKAGE]
    out = await a.run(
        f"import sys; sys.path.insert(0, '/tmp/lib'); import {wheel.module} as m; print(m.VALUE)"
    )
    assert out.strip() == wheel.value, out


async def the_credential_is_the_sessions_and_the_grant_holds_it(kube: Kube, ns: str) -> None:
    """The token in A's Secret is the HMAC of A's key, and the grant the proxy reads holds
    that token and the value; the kernel's pod object holds neither."""
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-egress-a-conn")
    assert secret is not None
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    key = json.loads(data["connection.json"])["key"]
    assert data[TOKEN_KEY] == token_for(key)
    grant = await asyncio.to_thread(kube.get, "Secret", EGRESS, f"{ns}.egress-a")
    assert grant is not None
    body = json.loads(base64.b64decode(grant["data"]["grant.json"]))
    assert body["token"] == data[TOKEN_KEY] and body["values"][0][2] == VALUE
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-egress-a")
    dumped = json.dumps(pod)
    assert data[TOKEN_KEY] not in dumped and VALUE not in dumped


async def a_stopped_session_keeps_no_grant(kube: Kube, ns: str) -> None:
    """B suspended: its pod goes, and its grant with it (the pod's address is free)."""
    suspend = {"spec": {"operatingMode": "Suspended"}}
    await asyncio.to_thread(kube.patch, KS, ns, "egress-b", suspend)
    await eventually(kube, "Secret", EGRESS, f"{ns}.egress-b", lambda o: o is None,
                     timeout=30, what="the suspended session's grant deleted")  # fmt: skip


async def a_client_chooses_within_what_is_offered(agent: Any, hosts: Hosts) -> None:
    """create_session's `allow`, within what the gateway offers (the offered rule's
    address range goes with it); anything else is refused, naming the field."""
    port = hosts.https.port
    asked = {"variant": "minimal", "cpu": "250m", "memory": "512Mi"}
    refused = await agent.call_tool(
        "create_session", {**asked, "allow": [{"host": "other.test", "ports": [port]}]}
    )
    assert refused.is_error and "allow[0]" in text(refused), text(refused)
    made = await agent.call_tool(
        "create_session", {**asked, "allow": [{"host": "api.test", "ports": [port]}]}
    )
    assert not made.is_error, text(made)
    chosen = Kernel(agent, made.structured_content["session_id"], hosts.ca.ca_path.read_text())
    assert (await chosen.fetch(hosts.https.url("api.test", "/bytes/7")))["status"] == 200
    got = await chosen.fetch(hosts.https.url("other.test", "/echo"))
    assert "no rule allows other.test" in got.get("error", ""), got
    closed = await agent.call_tool("close_session", {"session_id": chosen.sid})
    assert not closed.is_error, text(closed)


async def a_pool_kernel_has_no_way_out(kube: Kube, ns: str) -> None:
    """Before its claim, a pool's kernel has no proxy settings, and its pool's
    NetworkPolicy lets it out nowhere."""
    pods = await asyncio.to_thread(kube.list, "Pod", ns, labels={ksp.LABEL_POOL: POOL})
    (pod,) = pods["items"]
    names = {e["name"] for c in pod["spec"]["containers"] for e in c.get("env") or []}
    assert not names & {"HTTP_PROXY", "HTTPS_PROXY", "MCPFORGE_EGRESS_TOKEN"}, names
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, f"ksp-{POOL}")
    assert policy is not None
    assert not policy["spec"].get("egress"), policy["spec"]


async def a_kernel_claimed_from_a_pool_gets_its_way_out(
    b: Kernel, hosts: Hosts, kube: Kube, ns: str
) -> None:
    """B's kernel was started by the pool with no way out; claimed, it was told the proxy
    and its CA by the gateway, and its Secret holds its own credential."""
    obj = await asyncio.to_thread(kube.get, KS, ns, "egress-b")
    warm = condition(obj, ksp.WARM_START)
    assert (warm.get("status"), warm.get("reason")) == ("True", ksp.CLAIMED), warm
    got = await b.fetch(hosts.https.url("other.test", "/bytes/11"))
    assert got == {"status": 200, "length": 11}, got
    seen = hosts.https.wait_for(lambda q: q.path == "/bytes/11", timeout=10)
    assert dict(seen.headers)["X-Api-Key"] == VALUE_B and seen.server_name == "other.test"
    await no_way_out_but_the_proxy(b, hosts)  # the session's NetworkPolicy holds it now
    assert obj is not None
    secret = await asyncio.to_thread(
        kube.get, "Secret", ns, obj["status"]["connection"]["secretName"]
    )
    assert secret is not None
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    key = json.loads(data["connection.json"])["key"]
    assert data[TOKEN_KEY] == token_for(key) and data[PROXY_KEY], sorted(data)
    # Given the credential and the CA's certificate only: neither the value nor the CA's key.
    ca_key_line = data["egress-ca-key.pem"].splitlines()[1]
    for held in (VALUE_B, ca_key_line):
        assert (await b.run(holding_search(held), timeout=120)).strip() == "[]", held[:8]
    grant = await asyncio.to_thread(kube.get, "Secret", EGRESS, f"{ns}.egress-b")
    assert grant is not None
    body = json.loads(base64.b64decode(grant["data"]["grant.json"]))
    assert body["token"] == data[TOKEN_KEY], "the grant names the claimed kernel's credential"


async def a_credential_is_good_from_its_own_pod_only(
    b: Kernel, hosts: Hosts, kube: Kube, ns: str
) -> None:
    """A's credential, leaked to B's kernel (here: the test hands it over), names no
    session from B's pod: A's grant names A's pod's address."""
    secret = await asyncio.to_thread(kube.get, "Secret", ns, "ks-egress-a-conn")
    pod = await asyncio.to_thread(kube.get, "Pod", ns, "ks-egress-a")
    grant = await asyncio.to_thread(kube.get, "Secret", EGRESS, f"{ns}.egress-a")
    assert secret is not None and pod is not None and grant is not None
    body = json.loads(base64.b64decode(grant["data"]["grant.json"]))
    assert body["sources"] == [pod["status"]["podIP"]], body["sources"]
    stolen = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    code = f"""
import os, re, urllib.request, urllib.error
proxy = re.sub(r"//[^@]*@", "//session:{stolen}@", os.environ["HTTPS_PROXY"])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{"https": proxy}}))
try:
    opener.open({hosts.https.url("api.test", "/echo")!r}, timeout=20)
    print("reached")
except (urllib.error.URLError, OSError) as e:
    print(str(getattr(e, "reason", e))[:300])
"""
    out = await b.run(code)
    assert "403" in out and "from its own pod only" in out, out


def verdicts_are_counted_by_the_feeder(cluster: ClusterUnderTest) -> None:
    """The proxy's verdicts reach the feeder's metrics (its audit socket)."""
    pod = kubectl(cluster, "-n", EGRESS, "get", "pod", "-o", "name").split()[0]
    scrape = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9090/metrics').read().decode())"
    metrics = kubectl(cluster, "-n", EGRESS, "exec", pod, "-c", "feeder", "--",
                      "/opt/mcp-forge/bin/python", "-c", scrape)  # fmt: skip
    counted = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith("mcpforge_egress_total{")
    }
    for verdict in ("allowed", "refused"):
        key = f'mcpforge_egress_total{{event="connect",verdict="{verdict}"}}'
        assert counted.get(key, 0) >= 1, (key, counted)
