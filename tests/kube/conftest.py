"""The Kubernetes cluster for tests: a real one.

``test_cluster`` is the one place the cluster is chosen, once per test session:

* by default, the single-node cluster of tests/kube/testcluster.py on this machine (etcd, the
  API server, controller manager, scheduler, containerd, kubelet, kube-proxy, kube-router,
  CoreDNS, local-path-provisioner; built from the Go module proxy by tests/kube/node/build).
  If `tests/kube/cluster up` already runs it, it is used and left running; otherwise it is
  started here and torn down, completely, when the session ends. The kernel images are
  imported into its containerd.
* with ``MCPFORGE_TEST_KUBECONFIG=/path/to/kubeconfig``, that cluster (kind, k3d, a cloud):
  nothing is started or stopped. Its nodes must have the kernel images
  (``localhost/mcp-forge-kernel:0.1.0`` and ``…-minimal``), the host running the tests must
  reach its pod IPs, and it must enforce NetworkPolicies for the policy tests to pass.

``kube_api`` gives each test a namespace of its own (``kube_api.namespace``), labelled to
enforce the "restricted" Pod Security Standard, deleted after the test.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from mcp_forge.clients.kube import Kube

from . import testcluster
from .harness import running_operator

CRD_PATH = Path(__file__).parents[2] / "crds" / "kernelsession.yaml"
POOL_CRD_PATH = CRD_PATH.with_name("kernelsessionpool.yaml")
CLUSTER = Path(__file__).parent / "cluster"
KERNEL_IMAGES = ("localhost/mcp-forge-kernel:0.1.0", "localhost/mcp-forge-kernel:0.1.0-minimal")
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@dataclasses.dataclass(frozen=True)
class ClusterUnderTest:
    kubeconfig: Path
    own: bool  # ours (tests/kube/cluster): the tests may import images, read node state

    def bin(self, name: str) -> str:
        """A binary of the test cluster's build (kubectl, ctr), or the one on PATH."""
        local = testcluster.ROOT / "bin" / name
        return str(local) if self.own and local.exists() else name


@dataclasses.dataclass(frozen=True)
class KubeAPI:
    url: str  # e.g. https://192.0.2.2:6443 (no trailing slash)
    kubeconfig: Path
    namespace: str  # this test's own
    cluster: ClusterUnderTest

    def env(self) -> dict[str, str]:
        """os.environ for a subprocess: KUBECONFIG set, KUBERNETES_SERVICE_HOST removed."""
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        return {**env, "KUBECONFIG": str(self.kubeconfig)}

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new client of the official library for this API (sync: call it in a thread)."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """kubectl against this cluster, in this test's namespace (sync)."""
        done = subprocess.run(
            [
                self.cluster.bin("kubectl"),
                f"--kubeconfig={self.kubeconfig}",
                "-n",
                self.namespace,
                *args,
            ],
            input=input,
            text=True,
            capture_output=True,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout + (done.stderr if not check else "")


def _cluster_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLUSTER), *args], text=True, capture_output=True, check=False)


@pytest.fixture(scope="session")
def test_cluster() -> Iterator[ClusterUnderTest]:
    external = os.environ.get("MCPFORGE_TEST_KUBECONFIG")
    if external:
        cluster = ClusterUnderTest(Path(external), own=False)
        install_crds(cluster.kubeconfig)
        yield cluster
        return
    already = _cluster_cli("status").returncode == 0
    if not already:
        up = _cluster_cli("up")
        if up.returncode != 0:
            pytest.fail(f"tests/kube/cluster up failed:\n{up.stderr}")
    try:
        imported = _cluster_cli("import", *KERNEL_IMAGES)
        if imported.returncode != 0:
            pytest.fail(f"importing the kernel images failed:\n{imported.stderr}")
        cluster = ClusterUnderTest(testcluster.ROOT / "conf" / "admin.kubeconfig", own=True)
        install_crds(cluster.kubeconfig)
        yield cluster
    finally:
        if not already:  # ours: gone completely, or the session ends in an error
            down = _cluster_cli("down")
            assert down.returncode == 0, f"tests/kube/cluster down failed:\n{down.stderr}"


def install_crds(kubeconfig: Path) -> None:
    """Both of ours: KernelSession and KernelSessionPool."""
    install_crd(kubeconfig)
    install_crd(kubeconfig, yaml.safe_load(POOL_CRD_PATH.read_text()))


def install_crd(kubeconfig: Path, crd: dict[str, Any] | None = None) -> None:
    """Create or update the CRD (ours by default), then wait until the API serves it."""
    crd = copy.deepcopy(crd) if crd else yaml.safe_load(CRD_PATH.read_text())
    with kubernetes.config.new_client_from_config(config_file=str(kubeconfig)) as client:
        ext = kubernetes.client.ApiextensionsV1Api(client)
        name = crd["metadata"]["name"]
        # The body is the CRD's YAML as a dict: the client serializes a dict as well as its
        # models, though its annotations name only the model.
        try:
            ext.create_custom_resource_definition(crd)  # type: ignore[arg-type]
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
            current = ext.read_custom_resource_definition(name)
            assert current.metadata is not None
            crd["metadata"]["resourceVersion"] = current.metadata.resource_version
            ext.replace_custom_resource_definition(name, crd)  # type: ignore[arg-type]
        _wait_established(ext, name)


def _wait_established(ext: Any, name: str, timeout: int = 30) -> None:
    """Block (in a thread) until the CRD's Established condition is True: a watch."""
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        ext.list_custom_resource_definition,
        field_selector=f"metadata.name={name}",
        timeout_seconds=timeout,
    ):
        conditions = event["object"].status.conditions or []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            watch.stop()
            return
    raise TimeoutError(f"CRD {name} was not Established within {timeout}s")


def _namespace_for(nodeid: str) -> str:
    """A DNS label from the test's name, unique: t-<words>-<random>."""
    words = re.sub(r"[^a-z0-9]+", "-", nodeid.split("::")[-1].lower()).strip("-")
    return f"t-{words[:40].strip('-')}-{secrets.token_hex(3)}"


def make_namespace(kubeconfig: Path, name: str, labels: dict[str, str]) -> None:
    """Create it and wait for its default ServiceAccount (pods are refused until it exists)."""
    with kubernetes.config.new_client_from_config(config_file=str(kubeconfig)) as client:
        core = kubernetes.client.CoreV1Api(client)
        metadata = kubernetes.client.V1ObjectMeta(name=name, labels=labels)
        core.create_namespace(kubernetes.client.V1Namespace(metadata=metadata))
        watch = kubernetes.watch.Watch()
        for event in watch.stream(
            core.list_namespaced_service_account,
            name,
            field_selector="metadata.name=default",
            timeout_seconds=30,
        ):
            if event["type"] in ("ADDED", "MODIFIED"):
                watch.stop()
                return
        raise TimeoutError(f"namespace {name}: no default ServiceAccount within 30s")


def delete_namespace(kubeconfig: Path, name: str) -> None:
    """Delete it in the background: pods end on their own time, the next test does not wait."""
    with kubernetes.config.new_client_from_config(config_file=str(kubeconfig)) as client:
        try:
            kubernetes.client.CoreV1Api(client).delete_namespace(name)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise


@pytest.fixture
async def kube_api(
    test_cluster: ClusterUnderTest, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KubeAPI]:
    kubeconfig = test_cluster.kubeconfig
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
    # The kubernetes library reads $KUBECONFIG at import: patch its copies too (kopf uses them).
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes.config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.setattr(
        kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
    )
    # Make CoreV1Api() etc. (default configuration) reach it too; restored afterwards.
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)
    kubernetes.config.load_kube_config(str(kubeconfig))

    namespace = _namespace_for(request.node.nodeid)
    await asyncio.to_thread(make_namespace, kubeconfig, namespace, RESTRICTED)
    try:
        yield KubeAPI(config.host.rstrip("/"), kubeconfig, namespace, test_cluster)
    finally:
        await asyncio.to_thread(delete_namespace, kubeconfig, namespace)


@pytest.fixture
async def kube(kube_api: KubeAPI) -> AsyncIterator[Kube]:
    """The project's own API client (mcp_forge.clients.kube) for that API server."""
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kube_api.kubeconfig), client_configuration=config)
    k = Kube(config)
    yield k
    k.close()


@pytest.fixture
async def operator(kube: Kube) -> AsyncIterator[Any]:
    """The real operator (kopf, in a thread of its own) for this test."""
    async with running_operator(kube) as op:
        yield op


@pytest.fixture
def ns(kube_api: KubeAPI) -> str:
    """This test's own namespace."""
    return kube_api.namespace
