"""What the operator writes, and what it hears of writes: on the real test cluster.

A GitOps tool owns a KernelSession's and a pool's spec, labels and annotations; the
operator writes their status and nothing else of them (no change-handler bookkeeping in
an annotation), hears a spec change by its generation, does not take the watch's events
of its own writes for news, and leaves a steady cluster alone.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import kubernetes
import pytest

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.handlers import KOPF_NOTES, kopf_notes
from mcp_forge.control.reconciler import Reconciler
from mcp_forge.settings import Settings

from .conftest import KubeAPI
from .harness import KS, eventually, pod_ready, pool_body, ready, running_operator, session_body


async def create(kube: Kube, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    return await asyncio.to_thread(kube.create, session_body(name, ns, **spec))


def caught_up(generation: int) -> Any:
    """The object once its status observed `generation` and kopf's notes are gone."""

    def check(o: dict[str, Any] | None) -> bool:
        meta = (o or {}).get("metadata") or {}
        status = (o or {}).get("status") or {}
        notes = meta.get("annotations") or {}
        return status.get("observedGeneration") == generation and not kopf_notes(notes)

    return check


async def test_the_operator_writes_only_status_and_hears_a_spec_change_by_its_generation(
    kube: Kube, ns: str, images: dict[str, str], operator: Any
) -> None:
    """A session and a pool as git holds them, one annotation of their owner's and the
    notes an older operator's kopf change handlers kept: the notes are taken off, the
    owner's annotation stays, a spec change is reconciled (its generation observed), and
    every field the operator manages on them is in their status."""
    notes = {"example.com/owner": "git", **dict.fromkeys(KOPF_NOTES, '{"spec": {}}')}
    notes["mcpforge.dev/reconcile_session"] = '{"retries": 2}'  # a handler mid-retry
    body = session_body("git", ns, operatingMode="Suspended")
    body["metadata"]["annotations"] = dict(notes)
    pool = pool_body("gitpool", ns, 0, images["minimal"])
    pool["metadata"]["annotations"] = dict(notes)
    for made in (body, pool):
        await asyncio.to_thread(kube.create, made)
    for kind, name in ((KS, "git"), (ksp.KIND, "gitpool")):
        await eventually(kube, kind, ns, name, caught_up(1), what="generation 1, no note")
    await asyncio.to_thread(kube.patch, KS, ns, "git", {"spec": {"idleTimeout": "2h"}})
    await asyncio.to_thread(kube.patch, ksp.KIND, ns, "gitpool", {"spec": {"maxStarting": 3}})
    for kind, name in ((KS, "git"), (ksp.KIND, "gitpool")):
        obj = await eventually(kube, kind, ns, name, caught_up(2), what="generation 2")
        assert obj is not None
        meta = obj["metadata"]
        assert meta["annotations"] == {"example.com/owner": "git"}, meta["annotations"]
        ours = [m for m in meta["managedFields"] if m["manager"] == "mcp-forge-operator"]
        assert ours and all(m.get("subresource") == "status" for m in ours), ours


def events_after(kube: Kube, kind: str, ns: str, name: str, rv: str, n: int) -> list[Any]:
    """The first `n` watch events of one object after `rv` (fewer if a 30 s wait ends)."""
    got: list[Any] = []
    for event in kube.watch(kind, ns, resource_version=rv, name=name, timeout=30):
        got.append(event.object)
        if len(got) == n:
            break
    return got


async def test_a_reconcile_s_own_writes_are_not_news_and_later_ones_are(
    kube: Kube, kube_api: KubeAPI, ns: str, images: dict[str, str]
) -> None:
    """The watch's events of what a reconcile wrote itself (the kernel pod it made, the
    Lease it made) start no second reconcile: `Heard.news` says no to them, as the
    watch brings them. The next writes, by others (the scheduler's binding of the pod, a
    gateway renewing the Lease), are news."""
    await create(kube, ns, "own", image=images["minimal"], resources={"memory": "256Mi"})
    before = await asyncio.to_thread(kube.list, "Lease", ns)
    rv = str(before["metadata"]["resourceVersion"])
    config = kubernetes.client.Configuration()  # its own client: close() closes it
    kubernetes.config.load_kube_config(str(kube_api.kubeconfig), client_configuration=config)
    reconciler = Reconciler(Kube(config), Settings.from_env())
    try:
        await reconciler.reconcile(ns, "own")
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await asyncio.to_thread(kube.patch, "Lease", ns, "ks-own", {"spec": {"renewTime": now}})
        for kind in ("Lease", "Pod"):
            made, then = await asyncio.to_thread(events_after, kube, kind, ns, "ks-own", rv, 2)
            assert not reconciler.heard.news(ns, "own", made), (
                f"the {kind} as the reconcile made it"
            )
            assert reconciler.heard.news(ns, "own", then), f"the {kind} as another wrote it since"
    finally:
        reconciler.close()


QUIET = 20.0  # ten resyncs


CLUSTER_WRITERS = {"kubelet", "kube-scheduler", "kube-controller-manager"}  # not ours


async def test_a_steady_cluster_gets_no_writes_from_the_operator_in_ten_quiet_resyncs(
    kube: Kube, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reconcile (one per 2 s here) compares what it wants with what the server stored,
    normalized as the server normalizes (empty values, empty lists): no difference, no write."""
    monkeypatch.setenv("MCPFORGE_OPERATOR_RESYNC", "2")
    async with running_operator(kube):
        await create(
            kube,
            ns,
            "steady",
            env=[{"name": "EMPTY"}, {"name": "FULL", "value": "x"}],
            network={"egress": "None"},
        )
        await ready(kube, ns, "steady")
        # The session is Ready when its kernel answered the operator, which may be
        # before the kubelet's startupProbe passes: the kubelet's own writes come first.
        await eventually(kube, "Pod", ns, "ks-steady", pod_ready, what="the kubelet's Ready")
        writes: list[str] = []
        deadline = time.monotonic() + QUIET
        kinds = ["KernelSession", "Pod", "Secret", "Service", "NetworkPolicy", "Lease"]
        versions = {k: await asyncio.to_thread(kube.list, k, ns) for k in kinds}
        # Who made each change: the managedFields entries it added or changed. The
        # kubelet's status writes (a probe's result, which may land just after Ready) are
        # not the operator's; a change that names no writer counts.
        fields = {
            (k, i["metadata"]["name"]): i["metadata"].get("managedFields", [])
            for k in kinds
            for i in versions[k].get("items") or []
        }

        def watch(kind: str) -> None:
            rv = str(versions[kind]["metadata"]["resourceVersion"])
            while (left := deadline - time.monotonic()) > 0:
                for event in kube.watch(kind, ns, resource_version=rv, timeout=left):
                    meta = event.object["metadata"]
                    rv = str(meta["resourceVersion"])
                    now = meta.get("managedFields", [])
                    before = fields.get((kind, meta["name"]), [])
                    fields[(kind, meta["name"])] = now
                    writers = sorted({str(m.get("manager")) for m in now if m not in before})
                    if writers and set(writers) <= CLUSTER_WRITERS:
                        continue
                    writes.append(f"{event.type} {kind} {meta['name']} by {writers}")

        await asyncio.gather(*(asyncio.to_thread(watch, k) for k in kinds))
    assert writes == [], f"{len(writes)} writes in {QUIET:.0f} quiet seconds: {writes}"
