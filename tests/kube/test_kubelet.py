"""The test kubelet runs the API's kernel Pods as Podman pods and reports them as a kubelet.

The Secret and Pod come from the renderer, as the operator would create them; the kernel
is reached at the pod IP the kubelet reports, with the key from the Secret. Waiting is on
the API's watch (or on the kubelet's own removal), under deadlines: never a sleep.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kubernetes
import pytest

from mcp_forge import podman, resource
from mcp_forge.connection import ConnectionInfo, new_key
from mcp_forge.execution import Collector, ExecutionResult
from mcp_forge.kernel import KernelConnection
from mcp_forge.observe import observe
from mcp_forge.render import child_name, render_kubernetes

from .kubelet import Kubelet, podman_pod_name, wait_for_pod

pytestmark = pytest.mark.podman

NS = "default"
START_TIMEOUT = 60.0  # Pod created → Running, kernel answering
EXIT_TIMEOUT = 60.0  # the kernel dies → terminated in the API
REMOVE_TIMEOUT = 60.0


@pytest.fixture
def api(kube_api: Any) -> Iterator[Any]:
    client = kube_api.api_client()
    yield client
    client.close()


@pytest.fixture
async def kubelet(kube_api: Any) -> AsyncIterator[Kubelet]:
    async with Kubelet(kube_api.kubeconfig, [NS]) as kubelet:
        yield kubelet
        assert kubelet.errors == []


def render(image: str, memory: str) -> tuple[resource.KernelSession, str, dict[str, Any]]:
    """A new session, its key, and its rendered objects by kind."""
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"k-{uuid.uuid4().hex[:8]}", "namespace": NS},
        "spec": {"image": image, "resources": {"memory": memory, "cpu": "1"}},
    }
    session = resource.load(resource.validate(body))
    key = new_key()
    info = ConnectionInfo(transport="tcp", host=child_name(session), key=key)
    return session, key, {d["kind"]: d for d in render_kubernetes(session, info)}


async def create_kernel(
    api: Any, image: str, memory: str = "256Mi"
) -> tuple[resource.KernelSession, str]:
    """Put a rendered Secret and Pod into the API, as the operator would; return (session, key)."""
    session, key, docs = render(image, memory)
    core = kubernetes.client.CoreV1Api(api)
    await asyncio.to_thread(core.create_namespaced_secret, NS, docs["Secret"])
    await asyncio.to_thread(core.create_namespaced_pod, NS, docs["Pod"])
    return session, key


def kernel_state(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s.get("state") or {} for s in statuses if s.get("name") == "kernel"), {})


def running(kind: str, pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and bool(status.get("podIP"))


def terminated(kind: str, pod: dict[str, Any]) -> bool:
    return "terminated" in kernel_state(pod)


async def wait_running(api: Any, session: resource.KernelSession) -> dict[str, Any]:
    return await wait_for_pod(api, NS, child_name(session), running, timeout=START_TIMEOUT)


async def execute(conn: KernelConnection, code: str) -> ExecutionResult:
    collector = Collector("", budget=100_000, spool_max=100_000)
    collector.msg_id = conn.send_execute(code, silent=False, store_history=True)
    assert await conn.pump(collector, 30), f"no reply to {code!r}"
    return collector.finish(duration=0)


def text(result: ExecutionResult) -> str:
    assert result.status == "ok" and result.result is not None, result
    return str(result.result["data"]["text/plain"])


async def connect(pod: dict[str, Any], key: str) -> KernelConnection:
    info = ConnectionInfo(transport="tcp", host=pod["status"]["podIP"], key=key)
    conn = KernelConnection(info, max_frame=10_000_000, max_message=10_000_000)
    try:
        await conn.wait_ready(START_TIMEOUT)
    except BaseException:
        conn.close()
        raise
    return conn


async def test_a_kernel_pod_runs_and_its_kernel_answers_at_the_pod_ip(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    created = time.monotonic()
    session, key = await create_kernel(api, images["minimal"])
    pod = await wait_running(api, session)
    took = time.monotonic() - created

    status = pod["status"]
    (kernel,) = status["containerStatuses"]
    assert kernel["name"] == "kernel" and kernel["ready"] and kernel["restartCount"] == 0
    assert kernel["image"] == images["minimal"]
    assert "startedAt" in kernel["state"]["running"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert observe(session, pod).ready
    conn = await connect(pod, key)
    try:
        assert text(await execute(conn, "1+1")) == "2"
        # The Secret, as a kubelet mounts it: the pod's fsGroup, defaultMode 0440, read-only.
        seen = await execute(
            conn,
            "import os; st = os.stat('/etc/mcp-forge/connection.json'); "
            "(oct(st.st_mode & 0o777), st.st_uid, st.st_gid, os.access('/etc/mcp-forge', os.W_OK))",
        )
        assert text(seen) == "('0o440', 0, 1000, False)"
    finally:
        conn.close()
    print(f"Pod created → Running with a pod IP in {took:.2f}s")


async def test_a_killed_kernel_is_reported_terminated_with_exit_code_137(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    session, key = await create_kernel(api, images["minimal"])
    conn = await connect(await wait_running(api, session), key)
    try:
        conn.send_execute("import os; os.kill(os.getpid(), 9)", silent=False, store_history=False)
        pod = await wait_for_pod(api, NS, child_name(session), terminated, timeout=EXIT_TIMEOUT)
    finally:
        conn.close()

    ended = kernel_state(pod)["terminated"]
    assert (ended["exitCode"], ended["reason"]) == (137, "Error")
    assert pod["status"]["phase"] == "Failed"
    assert not pod["status"]["containerStatuses"][0]["ready"]
    seen = observe(session, pod)
    assert seen.termination is not None and "SIGKILL" in seen.message


async def test_a_kernel_past_its_memory_limit_is_reported_oomkilled(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    session, key = await create_kernel(api, images["minimal"], memory="128Mi")
    conn = await connect(await wait_running(api, session), key)
    try:
        conn.send_execute(
            "chunks = []\nwhile True:\n    chunks.append(bytearray(50_000_000))",
            silent=False,
            store_history=False,
        )
        pod = await wait_for_pod(api, NS, child_name(session), terminated, timeout=EXIT_TIMEOUT)
    finally:
        conn.close()

    ended = kernel_state(pod)["terminated"]
    assert (ended["exitCode"], ended["reason"]) == (137, "OOMKilled")
    assert pod["status"]["phase"] == "Failed"
    assert "limit 128Mi" in observe(session, pod).message


async def test_a_missing_image_is_reported_as_errimagepull_and_never_pulled(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    image = images["minimal"].rsplit(":", 1)[0] + ":no-such-tag"
    session, _ = await create_kernel(api, image)

    def waiting(kind: str, pod: dict[str, Any]) -> bool:
        return "waiting" in kernel_state(pod) and kernel_state(pod)["waiting"].get(
            "reason"
        ) not in (
            None,
            "ContainerCreating",
        )

    pod = await wait_for_pod(api, NS, child_name(session), waiting, timeout=START_TIMEOUT)
    assert kernel_state(pod)["waiting"]["reason"] == "ErrImagePull"
    assert pod["status"]["phase"] == "Pending"
    assert observe(session, pod).phase == "Failed"
    gone = await podman.run("pod", "exists", podman_pod_name(NS, child_name(session)), check=False)
    assert gone.returncode == 1


async def test_deleting_the_api_pod_removes_the_podman_pod(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    session, _ = await create_kernel(api, images["minimal"])
    pod = await wait_running(api, session)
    name = podman_pod_name(NS, child_name(session))
    assert (await podman.run("pod", "exists", name, check=False)).returncode == 0

    core = kubernetes.client.CoreV1Api(api)
    await asyncio.to_thread(core.delete_namespaced_pod, child_name(session), NS)
    await wait_for_pod(
        api,
        NS,
        child_name(session),
        lambda kind, _: kind == "DELETED",
        timeout=REMOVE_TIMEOUT,
        since=pod["metadata"]["resourceVersion"],
    )
    await kubelet.wait_removed(NS, child_name(session), timeout=REMOVE_TIMEOUT)
    assert (await podman.run("pod", "exists", name, check=False)).returncode == 1


async def test_stopping_the_kubelet_removes_every_podman_pod_it_made(
    api: Any, kube_api: Any, images: dict[str, str]
) -> None:
    async with Kubelet(kube_api.kubeconfig, [NS]) as kubelet:
        session, _ = await create_kernel(api, images["minimal"])
        await wait_running(api, session)
        label = f"label=mcpforge.dev/test-kubelet={kubelet.id}"
        listed = await podman.run("pod", "ps", "--filter", label, "--format", "{{.Name}}")
        assert listed.stdout.decode().split() == [podman_pod_name(NS, child_name(session))]
    listed = await podman.run("pod", "ps", "--filter", label, "--format", "{{.Name}}")
    assert listed.stdout.decode().split() == []
    assert kubelet.errors == []


async def test_a_pod_held_by_a_finalizer_loses_its_podman_pod_and_stays_in_the_api(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    session, _ = await create_kernel(api, images["minimal"])
    name = child_name(session)
    await wait_running(api, session)
    core = kubernetes.client.CoreV1Api(api)
    held = {"metadata": {"finalizers": ["mcpforge.dev/test"]}}
    await asyncio.to_thread(core.patch_namespaced_pod, name, NS, held)

    await asyncio.to_thread(core.delete_namespaced_pod, name, NS)
    await kubelet.wait_removed(NS, name, timeout=REMOVE_TIMEOUT)
    assert (
        await podman.run("pod", "exists", podman_pod_name(NS, name), check=False)
    ).returncode == 1
    pod = await wait_for_pod(
        api, NS, name, lambda kind, pod: kind != "DELETED", timeout=REMOVE_TIMEOUT
    )
    assert pod["metadata"]["deletionTimestamp"]

    released: dict[str, Any] = {"metadata": {"finalizers": []}}
    await asyncio.to_thread(core.patch_namespaced_pod, name, NS, released)
    await wait_for_pod(
        api,
        NS,
        name,
        lambda kind, _: kind == "DELETED",
        timeout=REMOVE_TIMEOUT,
        since=pod["metadata"]["resourceVersion"],
    )


async def test_a_pod_created_before_its_secret_starts_once_the_secret_exists(
    api: Any, kubelet: Kubelet, images: dict[str, str]
) -> None:
    session, key, docs = render(images["minimal"], "256Mi")
    core = kubernetes.client.CoreV1Api(api)
    await asyncio.to_thread(core.create_namespaced_pod, NS, docs["Pod"])

    def mount_failed(kind: str, pod: dict[str, Any]) -> bool:
        return "not found" in (kernel_state(pod).get("waiting") or {}).get("message", "")

    await wait_for_pod(api, NS, child_name(session), mount_failed, timeout=START_TIMEOUT)
    await asyncio.to_thread(core.create_namespaced_secret, NS, docs["Secret"])
    conn = await connect(await wait_running(api, session), key)
    try:
        assert text(await execute(conn, "6*7")) == "42"
    finally:
        conn.close()
