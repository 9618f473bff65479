"""The emulator's gaps over stock kmock, closed; proven through the official `kubernetes` client.

The emulator serves in the test's event loop: every sync client call runs in a thread
(`asyncio.to_thread`), and watches run in threads with a server-side timeout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiException

from .conftest import KubeAPI
from .emulator import Emulator

GROUP, VERSION, PLURAL = "mcpforge.dev", "v1alpha1", "kernelsessions"
KS = f"{GROUP}/{VERSION}/{PLURAL}"
NS = "default"
Event = tuple[str, dict[str, Any]]


@dataclass
class Api:
    core: kubernetes.client.CoreV1Api
    custom: kubernetes.client.CustomObjectsApi
    emulator: Emulator

    # KernelSessions (the CRD, with a status subresource), sync: call them through run().
    def create(self, name: str = "", ns: str = NS, **body: Any) -> dict[str, Any]:
        meta = {"name": name} if name else {}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "KernelSession", **body}
        body["metadata"] = {**meta, **body.get("metadata", {})}
        body.setdefault("spec", {"image": "img"})
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

    def get(self, name: str, ns: str = NS) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)

    def patch(self, name: str, body: Any, **kwargs: Any) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, name, body, **kwargs
        )

    def patch_status(self, name: str, body: Any) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NS, PLURAL, name, body
        )

    def delete(self, name: str) -> Any:
        return self.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def list(self, ns: str = NS, **kwargs: Any) -> dict[str, Any]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kwargs)

    def pod(self, name: str, ns: str = NS, **meta: Any) -> Any:
        body = {"metadata": {"name": name, **meta}, "spec": {"containers": [{"name": "c"}]}}
        return self.core.create_namespaced_pod(ns, body)


@pytest.fixture
def api(kube_api: KubeAPI) -> Iterator[Api]:
    if kube_api.emulator is None:
        pytest.skip("these tests check the emulator itself (MCPFORGE_TEST_KUBECONFIG is set)")
    client = kube_api.api_client()
    yield Api(
        kubernetes.client.CoreV1Api(client),
        kubernetes.client.CustomObjectsApi(client),
        kube_api.emulator,
    )
    client.close()


async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def fails(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the Status body of a call that must fail."""
    with pytest.raises(ApiException) as info:
        await run(fn, *args, **kwargs)
    body = json.loads(info.value.body)
    assert body["kind"] == "Status"
    assert body["code"] == info.value.status
    return info.value.status, body


def _watch(
    fn: Callable[..., Any], *args: Any, until: Callable[[list[Event]], bool], **kw: Any
) -> list[Event]:
    events: list[Event] = []
    watch = kubernetes.watch.Watch()
    # The server ends the stream after 10 s; the client gives up after 15 s of silence.
    for event in watch.stream(fn, *args, timeout_seconds=10, _request_timeout=15, **kw):
        events.append((event["type"], event["raw_object"]))
        if until(events):
            watch.stop()
    return events


def watch(
    fn: Callable[..., Any], *args: Any, until: Callable[[list[Event]], bool], **kw: Any
) -> asyncio.Future[list[Event]]:
    """Start a watch in a thread; it ends when until(events) holds, or after 10 s (server-side)."""
    return asyncio.ensure_future(asyncio.to_thread(_watch, fn, *args, until=until, **kw))


def names(events: list[Event]) -> list[tuple[str, str]]:
    return [(kind, obj["metadata"]["name"]) for kind, obj in events]


# --- server-set fields ----------------------------------------------------------------------


async def test_create_sets_server_fields(api: Api) -> None:
    body = {"metadata": {"name": "a"}, "spec": {"image": "img"}, "status": {"phase": "Fake"}}
    a = await run(api.custom.create_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, body)
    meta = a["metadata"]
    assert a["apiVersion"] == f"{GROUP}/{VERSION}"
    assert a["kind"] == "KernelSession"
    assert meta["namespace"] == NS
    assert len(meta["uid"]) == 36
    assert meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    assert int(meta["resourceVersion"]) == api.emulator.resource_version
    assert "status" not in a  # the status subresource: a create ignores status
    b = await run(api.create, "b")
    assert int(b["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert b["metadata"]["uid"] != meta["uid"]
    pod = await run(api.pod, "p")
    assert (pod.kind, pod.api_version, pod.metadata.namespace) == ("Pod", "v1", NS)
    secret = {"metadata": {"name": "s"}, "stringData": {"k": "v"}}
    secret = await run(api.core.create_namespaced_secret, NS, secret)
    assert (secret.data, secret.string_data) == ({"k": "dg=="}, None)
    assert await run(api.get, "a") == a


async def test_generation_and_resource_version(api: Api) -> None:
    a = await run(api.create, "a", spec={"image": "one"})
    rv = int(a["metadata"]["resourceVersion"])

    a = await run(api.patch, "a", {"spec": {"image": "two"}})
    assert (a["metadata"]["generation"], int(a["metadata"]["resourceVersion"])) == (2, rv + 1)
    a = await run(api.patch, "a", {"metadata": {"labels": {"x": "y"}}})
    assert (a["metadata"]["generation"], int(a["metadata"]["resourceVersion"])) == (2, rv + 2)
    a = await run(api.patch_status, "a", {"status": {"phase": "Ready"}})
    assert (a["metadata"]["generation"], int(a["metadata"]["resourceVersion"])) == (2, rv + 3)
    a = await run(api.patch, "a", {"spec": {"image": "two"}})  # no change: nothing happens
    assert (a["metadata"]["generation"], int(a["metadata"]["resourceVersion"])) == (2, rv + 3)
    # Server fields cannot be overwritten by a client.
    a = await run(api.patch, "a", {"metadata": {"uid": "x", "generation": 9, "name": "b"}})
    assert a["metadata"]["uid"] != "x"
    assert (a["metadata"]["generation"], a["metadata"]["name"]) == (2, "a")


async def test_generate_name(api: Api) -> None:
    first = await run(api.create, metadata={"generateName": "gen-"})
    second = await run(api.create, metadata={"generateName": "gen-"})
    assert first["metadata"]["name"].startswith("gen-")
    assert len(first["metadata"]["name"]) == len("gen-") + 5
    assert first["metadata"]["name"] != second["metadata"]["name"]
    status, body = await fails(api.create, "", metadata={})
    assert (status, body["reason"]) == (422, "Invalid")


async def test_namespace_comes_from_the_url(api: Api) -> None:
    a = await run(api.create, "a", ns="sessions")
    assert a["metadata"]["namespace"] == "sessions"
    assert [i["metadata"]["name"] for i in (await run(api.list, "sessions"))["items"]] == ["a"]
    assert (await run(api.list, NS))["items"] == []
    status, _ = await fails(api.create, "b", ns=NS, metadata={"namespace": "sessions"})
    assert status == 400
    status, body = await fails(api.create, "c", ns="nowhere")
    assert (status, body["reason"]) == (404, "NotFound")


# --- errors ---------------------------------------------------------------------------------


async def test_errors_are_status_bodies(api: Api) -> None:
    status, body = await fails(api.get, "missing")
    assert (status, body["reason"], body["details"]["name"]) == (404, "NotFound", "missing")
    assert (await fails(api.patch, "missing", {"spec": {}}))[0] == 404
    assert (await fails(api.delete, "missing"))[0] == 404
    assert (await fails(api.core.read_namespaced_pod, "missing", NS))[0] == 404

    await run(api.create, "a")
    status, body = await fails(api.create, "a")
    assert (status, body["reason"], body["status"]) == (409, "AlreadyExists", "Failure")
    assert api.emulator.errors == []  # API answers are not emulator failures


async def test_optimistic_concurrency(api: Api) -> None:
    a = await run(api.create, "a")
    stale = a["metadata"]["resourceVersion"]
    await run(api.patch, "a", {"spec": {"image": "two"}})

    status, body = await fails(
        api.patch, "a", {"metadata": {"resourceVersion": stale}, "spec": {"image": "x"}}
    )
    assert (status, body["reason"]) == (409, "Conflict")
    current = (await run(api.get, "a"))["metadata"]["resourceVersion"]
    a = await run(
        api.patch, "a", {"metadata": {"resourceVersion": current}, "spec": {"image": "three"}}
    )
    assert a["spec"]["image"] == "three"

    # kopf's style: a JSON patch guarded by a `test` op on the resourceVersion.
    guarded = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": stale},
        {"op": "add", "path": "/metadata/finalizers", "value": ["kopf"]},
    ]
    status, body = await fails(api.patch, "a", guarded)
    assert (status, body["reason"]) == (422, "Invalid")
    guarded[0]["value"] = a["metadata"]["resourceVersion"]
    a = await run(api.patch, "a", guarded)
    assert a["metadata"]["finalizers"] == ["kopf"]

    # A replace (PUT) with a stale resourceVersion, and with the current one.
    pod = await run(api.pod, "p")
    pod.metadata.labels = {"x": "y"}
    replaced = await run(api.core.replace_namespaced_pod, "p", NS, pod)
    assert replaced.metadata.labels == {"x": "y"}
    assert replaced.metadata.uid == pod.metadata.uid
    assert (await fails(api.core.replace_namespaced_pod, "p", NS, pod))[0] == 409
    body = {"preconditions": {"resourceVersion": "1"}}  # preconditions in a DELETE too
    assert (await fails(api.core.delete_namespaced_pod, "p", NS, body=body))[0] == 409


# --- status subresource ---------------------------------------------------------------------


async def test_status_subresource_isolation(api: Api) -> None:
    await run(api.create, "a", spec={"image": "one"})
    a = await run(api.patch_status, "a", {"spec": {"image": "evil"}, "status": {"phase": "Up"}})
    assert (a["spec"]["image"], a["status"]["phase"]) == ("one", "Up")
    a = await run(api.patch, "a", {"spec": {"image": "two"}, "status": {"phase": "Evil"}})
    assert (a["spec"]["image"], a["status"]["phase"]) == ("two", "Up")
    a = await run(api.patch_status, "a", {"metadata": {"labels": {"x": "y"}}, "status": None})
    assert "status" not in a
    assert "labels" not in a["metadata"]

    await run(api.pod, "p")
    pod = await run(api.core.patch_namespaced_pod, "p", NS, {"status": {"phase": "Running"}})
    assert pod.status is None or pod.status.phase is None
    pod = await run(api.core.patch_namespaced_pod_status, "p", NS, {"status": {"phase": "Running"}})
    assert pod.status.phase == "Running"
    # Secrets declare no status subresource: there is no such endpoint.
    await run(api.core.create_namespaced_secret, NS, {"metadata": {"name": "s"}})
    path = f"/api/v1/namespaces/{NS}/secrets/s/status"  # via kmock's own client
    async with api.emulator.patch(path, json={"status": {}}) as response:
        assert response.status == 404


# --- deletion, finalizers, garbage collection -----------------------------------------------


async def test_delete_without_finalizers(api: Api) -> None:
    a = await run(api.create, "a")
    rv = a["metadata"]["resourceVersion"]
    task = watch(api.custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                 resource_version=rv, until=lambda events: len(events) >= 1)  # fmt: skip
    await run(api.delete, "a")
    events = await asyncio.wait_for(task, 15)
    assert names(events) == [("DELETED", "a")]
    assert int(events[0][1]["metadata"]["resourceVersion"]) > int(rv)
    assert (await fails(api.get, "a"))[0] == 404
    assert (await run(api.list))["items"] == []
    await run(api.create, "a")  # the name is free again


async def test_finalizers(api: Api) -> None:
    a = await run(api.create, "a", metadata={"finalizers": ["f1"]})
    rv = a["metadata"]["resourceVersion"]
    task = watch(api.custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                 resource_version=rv, until=lambda events: events[-1][0] == "DELETED")  # fmt: skip
    await run(api.delete, "a")
    a = await run(api.get, "a")
    assert a["metadata"]["deletionTimestamp"]
    assert int(a["metadata"]["resourceVersion"]) == int(rv) + 1
    await run(api.delete, "a")  # again: nothing changes
    assert (await run(api.get, "a")) == a
    status, body = await fails(api.patch, "a", {"metadata": {"finalizers": ["f1", "f2"]}})
    assert (status, body["reason"]) == (422, "Invalid")
    await run(api.patch, "a", {"metadata": {"finalizers": None}})
    events = await asyncio.wait_for(task, 15)
    assert names(events) == [("MODIFIED", "a"), ("DELETED", "a")]
    assert (await fails(api.get, "a"))[0] == 404


async def test_garbage_collection(api: Api) -> None:
    owner = await run(api.create, "owner")
    other = await run(api.create, "other")

    def ref(obj: dict[str, Any]) -> dict[str, Any]:
        kind, name, uid = obj["kind"], obj["metadata"]["name"], obj["metadata"]["uid"]
        return {"apiVersion": obj["apiVersion"], "kind": kind, "name": name, "uid": uid}

    child = await run(api.pod, "child", ownerReferences=[ref(owner)])
    await run(api.pod, "kept", ownerReferences=[ref(owner), ref(other)])  # one owner remains
    await run(api.pod, "blocked", ownerReferences=[ref(owner)], finalizers=["f"])
    pod_ref = {"apiVersion": "v1", "kind": "Pod", "name": "child", "uid": child.metadata.uid}
    await run(api.core.create_namespaced_secret, NS, {"metadata": {"name": "grandchild",
              "ownerReferences": [pod_ref]}})  # fmt: skip
    rv = (await run(api.core.list_namespaced_pod, NS)).metadata.resource_version

    task = watch(api.core.list_namespaced_pod, NS, resource_version=rv,
                 until=lambda events: len(events) >= 2)  # fmt: skip
    await run(api.delete, "owner")
    events = await asyncio.wait_for(task, 15)
    assert sorted(names(events)) == [("DELETED", "child"), ("MODIFIED", "blocked")]
    blocked = await run(api.core.read_namespaced_pod, "blocked", NS)
    assert blocked.metadata.deletion_timestamp is not None
    assert (await run(api.core.read_namespaced_pod, "kept", NS)).metadata.deletion_timestamp is None
    await api.emulator.wait_for(lambda: not api.emulator.objects["v1/secrets", NS, "grandchild"])
    assert (await fails(api.core.read_namespaced_secret, "grandchild", NS))[0] == 404

    # A dependent whose owner never existed is collected too.
    ghost = {**pod_ref, "name": "ghost", "uid": "00000000-0000-0000-0000-000000000000"}
    await run(api.pod, "dangling", ownerReferences=[ghost])
    await api.emulator.wait_for(lambda: not api.emulator.objects["v1/pods", NS, "dangling"])

    bad_ref = {"apiVersion": "v1", "kind": "Pod", "name": "x"}  # no uid
    status, body = await fails(api.create, "orphan", metadata={"ownerReferences": [bad_ref]})
    assert (status, body["reason"]) == (422, "Invalid")


# --- watches --------------------------------------------------------------------------------


async def test_watch_replays_only_newer_events(api: Api) -> None:
    await run(api.create, "a")
    await run(api.create, "b")
    listed = await run(api.list)
    rv = listed["metadata"]["resourceVersion"]
    assert int(rv) == api.emulator.resource_version
    await run(api.create, "c")
    await run(api.patch, "a", {"spec": {"image": "two"}})
    await run(api.delete, "b")

    def done(events: list[Event]) -> bool:
        return events[-1][1]["metadata"]["name"] == "z"

    task = watch(api.custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                 resource_version=rv, until=done)  # fmt: skip
    await run(api.create, "z")
    events = await asyncio.wait_for(task, 15)
    assert names(events) == [("ADDED", "c"), ("MODIFIED", "a"), ("DELETED", "b"), ("ADDED", "z")]
    assert events[1][1]["spec"]["image"] == "two"
    rvs = [int(obj["metadata"]["resourceVersion"]) for _, obj in events]
    assert rvs == sorted(rvs)
    assert rvs[0] > int(rv)


async def test_watch_without_resource_version_loses_and_repeats_nothing(api: Api) -> None:
    await run(api.create, "before")

    def done(events: list[Event]) -> bool:
        return events[-1][1]["metadata"]["name"] == "after"

    task = watch(api.custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, until=done)
    await api.emulator.wait_for(lambda: api.emulator.watches(KS) >= 1)
    await run(api.create, "after")
    events = await asyncio.wait_for(task, 15)
    assert names(events) == [("ADDED", "before"), ("ADDED", "after")]


async def test_watch_timeout_seconds_ends_the_stream(api: Api) -> None:
    w = kubernetes.watch.Watch()
    stream = w.stream(api.core.list_namespaced_pod, NS, timeout_seconds=1, _request_timeout=5)
    assert await run(list, stream) == []


# --- selectors ------------------------------------------------------------------------------


async def test_label_and_field_selectors(api: Api) -> None:
    await run(api.pod, "a1", labels={"app": "a", "tier": "web"})
    await run(api.pod, "a2", labels={"app": "a"})
    await run(api.pod, "b1", labels={"app": "b", "tier": "db"})
    await run(api.pod, "n1")
    await run(api.pod, "s1", ns="sessions", labels={"app": "a"})

    async def pods(ns: str = NS, **kwargs: Any) -> list[str]:
        if ns == "*":
            result = await run(api.core.list_pod_for_all_namespaces, **kwargs)
        else:
            result = await run(api.core.list_namespaced_pod, ns, **kwargs)
        return sorted(pod.metadata.name for pod in result.items)

    assert await pods(label_selector="app=a") == ["a1", "a2"]
    assert await pods(label_selector="app==a,tier=web") == ["a1"]
    assert await pods(label_selector="app!=a") == ["b1", "n1"]
    assert await pods(label_selector="tier") == ["a1", "b1"]
    assert await pods(label_selector="!tier") == ["a2", "n1"]
    assert await pods(label_selector="app in (a, b),tier") == ["a1", "b1"]
    assert await pods(label_selector="app notin (a)") == ["b1", "n1"]
    assert await pods("*", label_selector="app=a") == ["a1", "a2", "s1"]
    assert await pods("*", field_selector="metadata.name=a1") == ["a1"]
    assert await pods("*", field_selector="metadata.namespace=sessions") == ["s1"]
    assert await pods("*", field_selector="metadata.namespace!=sessions,metadata.name!=n1") == [
        "a1",
        "a2",
        "b1",
    ]
    assert (await fails(api.core.list_namespaced_pod, NS, label_selector="app=(x"))[0] == 400

    # In a watch too; and in a delete-collection.
    rv = (await run(api.core.list_namespaced_pod, NS)).metadata.resource_version
    task = watch(api.core.list_namespaced_pod, NS, resource_version=rv, label_selector="app=b",
                 until=lambda events: len(events) >= 2)  # fmt: skip
    await run(api.pod, "a3", labels={"app": "a"})
    await run(api.pod, "b2", labels={"app": "b"})
    await run(api.core.patch_namespaced_pod, "a1", NS, {"metadata": {"labels": {"tier": "x"}}})
    await run(api.core.patch_namespaced_pod, "b1", NS, {"metadata": {"labels": {"tier": "x"}}})
    assert names(await asyncio.wait_for(task, 15)) == [("ADDED", "b2"), ("MODIFIED", "b1")]
    await run(api.core.delete_collection_namespaced_pod, NS, label_selector="app=a")
    assert await pods() == ["b1", "b2", "n1"]


# --- namespaces and the fixture -------------------------------------------------------------


async def test_namespaces_resource(api: Api) -> None:
    spaces = await run(api.core.list_namespace)
    assert {ns.metadata.name for ns in spaces.items} == {"default", "sessions"}
    assert (await run(api.core.read_namespace, "sessions")).kind == "Namespace"
    await run(api.core.create_namespace, {"metadata": {"name": "extra"}})
    await run(api.pod, "p", ns="extra")
    await run(api.core.delete_namespace, "extra")
    assert (await fails(api.core.read_namespace, "extra"))[0] == 404
    assert (await fails(api.pod, "q", ns="extra"))[0] == 404


async def test_fixture_points_everything_at_the_api(kube_api: KubeAPI) -> None:
    import os

    assert os.environ["KUBECONFIG"] == str(kube_api.kubeconfig)
    assert "KUBERNETES_SERVICE_HOST" not in os.environ
    location = kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    assert location == str(kube_api.kubeconfig)
    assert kube_api.env()["KUBECONFIG"] == str(kube_api.kubeconfig)
    assert kube_api.url.startswith("http://127.0.0.1:")

    # The default configuration (what kopf's login sets up, and CoreV1Api() uses).
    spaces = await run(lambda: kubernetes.client.CoreV1Api().list_namespace())
    assert {ns.metadata.name for ns in spaces.items} >= {"default", "sessions"}

    # Discovery serves the CRD with its status subresource, and kopf's peerings.
    async def discover(group_version: str) -> set[str]:
        with kube_api.api_client() as client:
            url = f"{kube_api.url}/apis/{group_version}"
            data = json.loads(await run(lambda: client.call_api("GET", url).read()))
        return {r["name"] for r in data["resources"]}

    assert {"kernelsessions", "kernelsessions/status"} <= await discover(f"{GROUP}/{VERSION}")
    assert "kopfpeerings" in await discover("kopf.dev/v1")
    assert "networkpolicies" in await discover("networking.k8s.io/v1")
    assert "leases" in await discover("coordination.k8s.io/v1")

    # A subprocess reaches it through env().
    code = "import kubernetes as k; k.config.load_kube_config(); print(len(k.client.CoreV1Api().list_namespace().items))"  # noqa: E501
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=kube_api.env(), stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, stdout.strip()) == (0, b"2")
