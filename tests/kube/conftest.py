"""The Kubernetes API for tests: the emulator (tests/kube/emulator.py), or a real cluster.

``kube_api`` is the one place the API server is chosen. By default it starts an ``Emulator`` on a
random local port, in the test's event loop. With ``MCPFORGE_TEST_KUBECONFIG=/path/to/kubeconfig``
it uses that cluster instead (no emulator; ``.emulator`` is None; nothing is cleaned up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kubernetes
import pytest
import yaml

from mcp_forge.kube import Kube

from .emulator import Emulator

CRD_PATH = Path(__file__).parents[2] / "crds" / "kernelsession.yaml"
NAMESPACES = ("default", "sessions")
VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}

# Declared unless load_bundled() has them: (group/version/plural, kind, namespaced).
REQUIRED = [
    ("v1/pods", "Pod", True),
    ("v1/services", "Service", True),
    ("v1/secrets", "Secret", True),
    ("v1/events", "Event", True),
    ("v1/namespaces", "Namespace", False),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True),
    ("coordination.k8s.io/v1/leases", "Lease", True),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
]


@dataclasses.dataclass(frozen=True)
class KubeAPI:
    url: str  # e.g. http://127.0.0.1:40123 (no trailing slash)
    kubeconfig: Path
    emulator: Emulator | None  # None against a real cluster

    def env(self) -> dict[str, str]:
        """os.environ for a subprocess: KUBECONFIG set, KUBERNETES_SERVICE_HOST removed."""
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        return {**env, "KUBECONFIG": str(self.kubeconfig)}

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new client of the official library for this API (sync: call it in a thread)."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))


def declare_resources(emulator: Emulator, crd: dict[str, Any]) -> None:
    with warnings.catch_warnings():  # kmock 0.8 uses the deprecated importlib.resources API
        warnings.simplefilter("ignore", DeprecationWarning)
        emulator.resources.load_bundled()
    names, spec = crd["spec"]["names"], crd["spec"]
    for version in spec["versions"]:
        emulator.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = (
            kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular"),
                namespaced=spec["scope"] == "Namespaced",
                shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                subresources=version.get("subresources", {}).keys(),
                verbs=VERBS,
            )
        )
    for key, kind, namespaced in REQUIRED:
        if key not in emulator.resources:
            emulator.resources[key] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=VERBS
            )


def write_kubeconfig(path: Path, url: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "dummy-token"}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "tester", "namespace": "default"},
            }
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))


def prepare_cluster(kubeconfig: Path, crd: dict[str, Any], real: bool) -> None:
    """Ensure the namespaces and the CRD object exist (sync: called in a thread)."""
    with kubernetes.config.new_client_from_config(config_file=str(kubeconfig)) as client:
        core = kubernetes.client.CoreV1Api(client)
        ext = kubernetes.client.ApiextensionsV1Api(client)
        for name in NAMESPACES:
            _create_if_missing(core.create_namespace, {"metadata": {"name": name}})
        _create_if_missing(ext.create_custom_resource_definition, crd)
        if real:  # a real cluster serves a new CRD once it is Established
            _wait_established(ext, crd["metadata"]["name"])


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


def _create_if_missing(create: Any, body: dict[str, Any]) -> None:
    try:
        create(body)
    except kubernetes.client.ApiException as e:
        if e.status != 409:
            raise


@pytest.fixture
async def kube_api(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KubeAPI]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    real_kubeconfig = os.environ.get("MCPFORGE_TEST_KUBECONFIG")
    async with contextlib.AsyncExitStack() as stack:
        emulator: Emulator | None = None
        if real_kubeconfig:
            kubeconfig = Path(real_kubeconfig)
            config = kubernetes.client.Configuration()
            kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
            url = config.host
        else:
            emulator = await stack.enter_async_context(Emulator())
            await stack.enter_async_context(kmock.Server(emulator))
            kubeconfig = tmp_path_factory.mktemp("kube") / "kubeconfig"
            url = str(emulator.url).rstrip("/")
            declare_resources(emulator, crd)
            write_kubeconfig(kubeconfig, url)

        # The kubernetes library reads $KUBECONFIG at import: patch its copies too.
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(kubernetes.config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        monkeypatch.setattr(
            kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
        )
        # Make CoreV1Api() etc. (default configuration) reach it too; restored afterwards.
        monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)
        kubernetes.config.load_kube_config(str(kubeconfig))

        await asyncio.to_thread(prepare_cluster, kubeconfig, crd, real=emulator is None)
        yield KubeAPI(url=url, kubeconfig=kubeconfig, emulator=emulator)


@pytest.fixture
async def kube(kube_api: KubeAPI) -> AsyncIterator[Kube]:
    """The project's own API client (mcp_forge.kube) for that API server."""
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kube_api.kubeconfig), client_configuration=config)
    k = Kube(config)
    yield k
    k.close()
