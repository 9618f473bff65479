"""Warm pools on the real test cluster: the operator (real kopf) fills KernelSessionPools
with real kernel pods on the real kubelet, and sessions claim them.

What a claim must never do is checked against the API server itself: two sessions never
hold one pod or one key, a claimed pod is never restarted or deleted by its pool, and an
operator that stops between its claim and its status write leaves nothing claimed twice
or leaked.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import kubernetes
import pytest

from kstatus import kstatus
from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.poolkeeper import PoolKeeper, Tally
from mcp_forge.control.render import LABEL_SESSION, TEMPLATE_HASH
from mcp_forge.errors import ApiError
from mcp_forge.settings import Settings

from .conftest import KubeAPI
from .harness import (
    KS,
    SMALL,
    condition,
    events_of,
    eventually,
    kernel,
    key_in,
    phase,
    pod_ready,
    pool_body,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
)

POOL = ksp.KIND
FILL = 120.0  # a pool of two to ready, on a busy 2-core machine


async def members(kube: Kube, ns: str, pool: str) -> list[dict[str, Any]]:
    listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={ksp.LABEL_POOL: pool})
    return [p for p in listed.get("items") or [] if not p["metadata"].get("deletionTimestamp")]


async def filled(
    kube: Kube, ns: str, pool: str, size: int, *, claimed: int = 0, hash_: str = ""
) -> dict[str, Any]:
    """The pool once its status counts `size` ready kernels (of template `hash_`) and
    `claimed` claimed ones."""

    def full(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (
            status.get("ready") == size
            and status.get("claimed", 0) == claimed
            and (not hash_ or status.get("templateHash") == hash_)
        )

    obj = await eventually(kube, POOL, ns, pool, full, timeout=FILL, what=f"{size} ready")
    assert obj is not None
    return obj


async def counted(kube: Kube, ns: str, pool: str, claims: int, misses: int) -> dict[str, Any]:
    """The pool once its status counts exactly these claims and misses (written after
    the claims, off their path)."""

    def right(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("claims", 0), status.get("misses", 0)) == (claims, misses)

    what = f"{claims} claims and {misses} misses counted"
    obj = await eventually(kube, POOL, ns, pool, right, timeout=30, what=what)
    assert obj is not None
    return obj


async def restarts(kube: Kube, ns: str, pod: str) -> int:
    obj = await asyncio.to_thread(kube.get, "Pod", ns, pod)
    assert obj is not None, f"pod {pod} is gone"
    return sum(int(c.get("restartCount", 0)) for c in obj["status"]["containerStatuses"])


def served_by(kube_api: KubeAPI, ns: str, service: str, pod: str, timeout: int = 30) -> bool:
    """Whether the Service's endpoints come to be `pod` within `timeout` (a watch)."""
    core = kubernetes.client.CoreV1Api(kube_api.api_client())
    stream = kubernetes.watch.Watch().stream(
        core.list_namespaced_endpoints,
        ns,
        field_selector=f"metadata.name={service}",
        timeout_seconds=timeout,
    )
    for event in stream:
        subsets = event["object"].subsets or []
        if any(
            a.target_ref and a.target_ref.name == pod for s in subsets for a in s.addresses or []
        ):
            return True
    return False


async def test_a_pool_fills_with_kernels_each_with_its_own_key_and_a_claim_moves_one(
    kube: Kube, kube_api: KubeAPI, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("warm", ns, 2, images["minimal"]))
    pool = await filled(kube, ns, "warm", 2)
    assert condition(pool, "Ready")["status"] == "True"
    # `kubectl wait` reads the same condition (returns at once: it holds already).
    kube_api.kubectl("wait", "--for=condition=Ready", "ksp/warm", "--timeout=10s")
    pods = await members(kube, ns, "warm")
    assert len(pods) == 2 and all(pod_ready(p) for p in pods)
    # What `kubectl describe ksp` shows of an ordinary life: each kernel made, then filled.
    told = await events_of(kube, ns, "warm", {"Started", "Filled"})
    made = {e["message"] for e in told if e["reason"] == "Started"}
    assert made == {f"kernel {p['metadata']['name']} made" for p in pods}, told
    assert all(e["type"] == "Normal" for e in told), told
    keys = set()
    for pod in pods:
        meta = pod["metadata"]
        assert meta["ownerReferences"][0]["kind"] == POOL
        secret = await asyncio.to_thread(kube.get, "Secret", ns, f"{meta['name']}-conn")
        assert secret is not None
        assert secret["metadata"]["ownerReferences"][0]["uid"] == meta["uid"], "the pod owns it"
        keys.add(key_in(secret))
    assert len(keys) == 2, "never one key shared by two kernels"

    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    await asyncio.to_thread(
        kube.create,
        session_body(
            "alpha", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "warm"}
        ),
    )
    obj = await ready(kube, ns, "alpha")
    status = obj["status"]
    assert status["podName"] in before, status
    assert before[status["podName"]] == status["kernelId"], "the same pod: no new one"
    warm = condition(obj, ksp.WARM_START)
    assert (warm["status"], warm["reason"]) == ("True", ksp.CLAIMED), warm
    assert status["connection"]["secretName"] == f"{status['podName']}-conn"
    own = await asyncio.to_thread(kube.get, "Secret", ns, "ks-alpha-conn")
    assert own is None, "a claimed kernel's Secret came with it: the session makes none"
    claimed = await asyncio.to_thread(kube.get, "Pod", ns, status["podName"])
    assert claimed is not None
    assert claimed["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert ksp.LABEL_POOL not in claimed["metadata"]["labels"]
    assert await restarts(kube, ns, status["podName"]) == 0, "no restart on claim"
    async with kernel(kube, ns, "alpha") as conn:
        assert (await run_in_kernel(conn, "print(6 * 7)")).strip() == "42"
    # The session's Service now selects the claimed pod (kube-proxy routes to it).
    assert await asyncio.to_thread(served_by, kube_api, ns, "ks-alpha", status["podName"])

    # The pool refills; then its count says one is claimed, and one claim was served.
    await filled(kube, ns, "warm", 2, claimed=1)
    await counted(kube, ns, "warm", claims=1, misses=0)
    assert status["podName"] not in {p["metadata"]["name"] for p in await members(kube, ns, "warm")}

    # Deleting the session takes the claimed pod and its Secret with it (garbage collector).
    await asyncio.to_thread(kube.delete, KS, ns, "alpha")
    await eventually(
        kube, "Pod", ns, status["podName"], lambda p: p is None, timeout=60, what="pod gone"
    )
    await eventually(
        kube, "Secret", ns, f"{status['podName']}-conn", lambda s: s is None, what="Secret gone"
    )
    for kind in ("Service", "NetworkPolicy", "Lease"):
        await eventually(kube, kind, ns, "ks-alpha", lambda o: o is None, what=f"{kind} gone")
    left = await asyncio.to_thread(kube.list, "Secret", ns, labels={LABEL_SESSION: "alpha"})
    assert not left["items"], [s["metadata"]["name"] for s in left["items"]]


async def test_two_claims_at_once_never_share_a_kernel(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("duo", ns, 2, images["minimal"]))
    await filled(kube, ns, "duo", 2)
    names = ("one", "two", "three")
    await asyncio.gather(
        *(
            asyncio.to_thread(
                kube.create,
                session_body(
                    n, ns, image=images["minimal"], resources=SMALL, poolRef={"name": "duo"}
                ),
            )
            for n in names
        )
    )
    objs = [await ready(kube, ns, n) for n in names]
    pods = [o["status"]["podName"] for o in objs]
    assert len(set(pods)) == 3, pods
    reasons = sorted(condition(o, ksp.WARM_START)["reason"] for o in objs)
    # Two were in the pool; the third found it empty (or claimed a refill already ready).
    assert reasons.count(ksp.CLAIMED) >= 2, reasons
    assert set(reasons) <= {ksp.CLAIMED, ksp.POOL_EXHAUSTED}, reasons
    # Claimed at once, counted exactly: a claim per warm session, a miss per cold one.
    await counted(kube, ns, "duo", reasons.count(ksp.CLAIMED), reasons.count(ksp.POOL_EXHAUSTED))
    secrets = [o["status"]["connection"]["secretName"] for o in objs]
    keys = set()
    for name in secrets:
        secret = await asyncio.to_thread(kube.get, "Secret", ns, name)
        assert secret is not None, name
        keys.add(key_in(secret))
    assert len(keys) == 3


async def test_a_pool_at_its_maximum_keeps_fewer_ready_and_refills_when_a_claim_goes(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    bad = pool_body("capped", ns, 2, images["minimal"])
    bad["spec"]["maxSize"] = 1
    with pytest.raises(ApiError, match=r"spec\.maxSize must be at least spec\.size"):
        await asyncio.to_thread(kube.create, bad)  # the API server's own check (CEL)
    body = pool_body("capped", ns, 1, images["minimal"])
    body["spec"]["maxSize"] = 2
    await asyncio.to_thread(kube.create, body)
    await filled(kube, ns, "capped", 1)

    async def claim(name: str) -> dict[str, Any]:
        spec = {"image": images["minimal"], "resources": SMALL, "poolRef": {"name": "capped"}}
        await asyncio.to_thread(kube.create, session_body(name, ns, **spec))
        return await ready(kube, ns, name)

    assert condition(await claim("first"), ksp.WARM_START)["reason"] == ksp.CLAIMED
    await filled(kube, ns, "capped", 1, claimed=1)  # 1 claimed + 1 ready: the maximum
    assert condition(await claim("second"), ksp.WARM_START)["reason"] == ksp.CLAIMED
    pool = await filled(kube, ns, "capped", 0, claimed=2)
    at_max = condition(pool, "Ready")
    assert (at_max["status"], at_max["reason"]) == ("True", ksp.AT_MAXIMUM)
    assert "at its maximum of 2 (2 claimed)" in at_max["message"]
    assert await members(kube, ns, "capped") == []
    assert condition(await claim("third"), ksp.WARM_START)["reason"] == ksp.POOL_EXHAUSTED

    # A claimed session still counts while its kernel pod is replaced (deleted here, as a
    # restart or an update deletes it): a reconcile of the pool at once, before the
    # session has its next pod, starts nothing.
    listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={LABEL_SESSION: "second"})
    (pod,) = listed["items"]
    await asyncio.to_thread(kube.delete, "Pod", ns, pod["metadata"]["name"])
    keeper = PoolKeeper(kube, Settings.from_env())
    await asyncio.to_thread(keeper.reconcile, ns, "capped")
    assert await members(kube, ns, "capped") == []
    back = await eventually(
        kube,
        KS,
        ns,
        "second",
        lambda o: phase(o) == "Ready" and (o or {})["status"].get("restarts") == 1,
        timeout=FILL,
        what="second Ready on its next pod",
    )
    assert back is not None
    await asyncio.to_thread(keeper.reconcile, ns, "capped")
    assert await members(kube, ns, "capped") == []
    await filled(kube, ns, "capped", 0, claimed=2)

    # A claimed kernel going brings the pool back under its maximum: it refills at once
    # (the pod's deletion is heard), well before its periodic resync (60 s).
    await asyncio.to_thread(kube.delete, KS, ns, "first")

    def refilled(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("ready"), status.get("claimed")) == (1, 1)

    await eventually(kube, POOL, ns, "capped", refilled, timeout=45, what="refilled")
    # So does deleting "second", whose kernel now runs in a pod of its own (ks-second, no
    # claimed-from label to be heard going): the session's deletion is heard instead.
    await asyncio.to_thread(kube.delete, KS, ns, "second")

    def let_go(o: dict[str, Any] | None) -> bool:
        status = (o or {}).get("status") or {}
        return (status.get("ready"), status.get("claimed")) == (1, 0)

    await eventually(kube, POOL, ns, "capped", let_go, timeout=45, what="second not counted")


async def test_a_session_the_pool_cannot_serve_starts_cold_and_says_why(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("small", ns, 1, images["minimal"]))
    await filled(kube, ns, "small", 1)
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        "big": (
            {
                "image": images["minimal"],
                "resources": {"memory": "1Gi"},
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "spec.resources",
        ),
        "nowhere": (
            {"image": images["minimal"], "resources": SMALL, "poolRef": {"name": "absent"}},
            ksp.POOL_NOT_FOUND,
            "absent",
        ),
        "startup": (
            {
                "image": images["minimal"],
                "resources": SMALL,
                "env": [{"name": "PYTHONHASHSEED", "value": "1"}],
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "PYTHONHASHSEED",
        ),
        "kept": (
            {
                "image": images["minimal"],
                "resources": SMALL,
                "workspace": {"persistent": True, "size": "16Mi"},
                "poolRef": {"name": "small"},
            },
            ksp.POOL_MISMATCH,
            "spec.workspace is persistent",
        ),
    }
    for name, (spec, _, _) in cases.items():
        await asyncio.to_thread(kube.create, session_body(name, ns, **spec))
    for name, (_, reason, names) in cases.items():
        obj = await ready(kube, ns, name)
        warm = condition(obj, ksp.WARM_START)
        assert (warm["status"], warm["reason"]) == ("False", reason), warm
        assert names in warm["message"] and "started cold" in warm["message"], warm
        assert obj["status"]["podName"] == f"ks-{name}", "its own pod"
    # None of them touched the pool; the three it could not serve are its misses (the
    # session naming a pool that does not exist is nobody's).
    assert len(await members(kube, ns, "small")) == 1
    await counted(kube, ns, "small", claims=0, misses=3)


async def test_a_template_change_replaces_unclaimed_kernels_only(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("roll", ns, 1, images["minimal"]))
    first = await filled(kube, ns, "roll", 1)
    await asyncio.to_thread(
        kube.create,
        session_body(
            "keep", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "roll"}
        ),
    )
    held = (await ready(kube, ns, "keep"))["status"]
    await filled(kube, ns, "roll", 1, claimed=1)
    old = {p["metadata"]["name"] for p in await members(kube, ns, "roll")}
    assert len(old) == 1, old
    await asyncio.to_thread(
        kube.patch, POOL, ns, "roll", {"spec": {"template": {"resources": {"memory": "320Mi"}}}}
    )
    changed = await eventually(
        kube,
        POOL,
        ns,
        "roll",
        lambda o: (
            (o or {}).get("status", {}).get("templateHash")
            not in (None, first["status"]["templateHash"])
        ),
        what="a new template hash",
    )
    assert changed is not None
    await filled(kube, ns, "roll", 1, claimed=1, hash_=changed["status"]["templateHash"])
    now = await members(kube, ns, "roll")
    # The old unclaimed kernel goes once the new one is ready (it may still be terminating).
    await eventually(
        kube, "Pod", ns, next(iter(old)), lambda p: p is None, timeout=60, what="old kernel gone"
    )
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["memory"] == "320Mi" for p in now)
    # The claimed one is untouched: same pod, never restarted, the session still Ready.
    pod = await asyncio.to_thread(kube.get, "Pod", ns, held["podName"])
    assert pod is not None and pod["metadata"]["uid"] == held["kernelId"]
    assert await restarts(kube, ns, held["podName"]) == 0
    assert phase(await asyncio.to_thread(kube.get, KS, ns, "keep")) == "Ready"

    # At its maximum (2: one claimed, room for one more), the next change has the old
    # kernel make way for the new one: never two unclaimed kernels alive at once.
    listed = await asyncio.to_thread(kube.list, "Pod", ns)
    rv = str(listed["metadata"]["resourceVersion"])
    alive: set[str] = set()
    most: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        nonlocal rv
        while not stop.is_set():
            for event in kube.watch("Pod", ns, resource_version=rv, timeout=5):
                meta = event.object["metadata"]
                rv = str(meta["resourceVersion"])
                if (meta.get("labels") or {}).get(ksp.LABEL_POOL) != "roll":
                    alive.discard(meta["name"])  # claimed, or not the pool's
                elif event.type == "DELETED" or meta.get("deletionTimestamp"):
                    alive.discard(meta["name"])
                else:
                    alive.add(meta["name"])
                most.append(len(alive))

    alive.update(p["metadata"]["name"] for p in await members(kube, ns, "roll"))
    watcher = asyncio.create_task(asyncio.to_thread(watch))
    try:
        patch = {"spec": {"maxSize": 2, "template": {"resources": {"memory": "300Mi"}}}}
        second = await asyncio.to_thread(kube.patch, POOL, ns, "roll", patch)
        hash_ = changed["status"]["templateHash"]
        newer = await eventually(
            kube,
            POOL,
            ns,
            "roll",
            lambda o: (o or {}).get("status", {}).get("templateHash") not in (None, hash_),
            what="a newer template hash",
        )
        assert newer is not None and second is not None
        await filled(kube, ns, "roll", 1, claimed=1, hash_=newer["status"]["templateHash"])
    finally:
        stop.set()
        await watcher
    assert most and max(most) == 1, most


async def test_deleting_a_pool_leaves_claimed_sessions_alone(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    await asyncio.to_thread(kube.create, pool_body("gone", ns, 2, images["minimal"]))
    await filled(kube, ns, "gone", 2)
    await asyncio.to_thread(
        kube.create,
        session_body(
            "stay", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "gone"}
        ),
    )
    held = (await ready(kube, ns, "stay"))["status"]
    unclaimed = [p["metadata"]["name"] for p in await members(kube, ns, "gone")]
    await asyncio.to_thread(kube.delete, POOL, ns, "gone")
    for name in unclaimed:
        await eventually(kube, "Pod", ns, name, lambda p: p is None, timeout=60, what="GC'd")
    pod = await asyncio.to_thread(kube.get, "Pod", ns, held["podName"])
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")
    assert await asyncio.to_thread(kube.get, "Secret", ns, f"{held['podName']}-conn")
    async with kernel(kube, ns, "stay") as conn:
        assert (await run_in_kernel(conn, "print('alive')")).strip() == "alive"


async def test_an_operator_stopped_between_claim_and_status_leaves_nothing_twice(
    kube: Kube, ns: str, images: dict[str, str]
) -> None:
    """The claim is written (the pod moved) and the operator stops before the session's
    status says so: the next operator finds that pod and neither claims another nor
    starts a cold one. Two keepers racing for the pool's one kernel: one wins."""
    async with running_operator(kube):
        await asyncio.to_thread(kube.create, pool_body("race", ns, 1, images["minimal"]))
        await filled(kube, ns, "race", 1)
    # No operator runs now. Two sessions, and two keepers claim for them at once.
    bodies = [
        await asyncio.to_thread(
            kube.create,
            session_body(n, ns, image=images["minimal"], resources=SMALL, poolRef={"name": "race"}),
        )
        for n in ("left", "right")
    ]
    sessions = [kernelsession.load(kernelsession.validate(b, default_namespace=ns)) for b in bodies]
    keepers = [PoolKeeper(kube, Settings.from_env()) for _ in sessions]
    claims = await asyncio.gather(
        *(asyncio.to_thread(k.claim, s, "h") for k, s in zip(keepers, sessions, strict=True))
    )
    won = [c for c in claims if c.pod is not None]
    assert len(won) == 1, [c.reason for c in claims]
    assert {c.reason for c in claims} == {ksp.CLAIMED, ksp.POOL_EXHAUSTED}
    winner = sessions[claims.index(won[0])].name
    # Two keepers, two writers of the pool's counters: both counts land.
    await counted(kube, ns, "race", claims=1, misses=1)
    taken = won[0].pod
    assert taken is not None and taken["metadata"]["annotations"][TEMPLATE_HASH] == "h"
    # The operator starts again: the winner adopts the claimed pod, the other starts cold.
    async with running_operator(kube):
        objs = {n: await ready(kube, ns, n) for n in ("left", "right")}
        assert objs[winner]["status"]["podName"] == taken["metadata"]["name"]
        assert objs[winner]["status"]["kernelId"] == taken["metadata"]["uid"]
        loser = "right" if winner == "left" else "left"
        assert objs[loser]["status"]["podName"] == f"ks-{loser}"
        # The pool refills: exactly one unclaimed kernel, and no pod of either session twice.
        await filled(kube, ns, "race", 1, claimed=1)
        listed = await asyncio.to_thread(kube.list, "Pod", ns)
        live = [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]
        owners = [r["name"] for p in live for r in p["metadata"].get("ownerReferences") or []]
        assert sorted(owners) == sorted(["left", "right", "race"]), owners
        # A Secret left by a pool reconcile cut short (no pod made) is collected.
        race = await asyncio.to_thread(kube.get, POOL, ns, "race")
        assert race is not None
        pool_uid = race["metadata"]["uid"]
        orphan = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "ksp-race-deadbeef-conn",
                "namespace": ns,
                "labels": {ksp.LABEL_POOL: "race"},
                "ownerReferences": [
                    {
                        "apiVersion": "mcpforge.dev/v1alpha1",
                        "kind": POOL,
                        "name": "race",
                        "uid": pool_uid,
                        "controller": True,
                    }
                ],
            },
            "stringData": {"connection.json": "{}"},
        }
        await asyncio.to_thread(kube.create, orphan)
        await asyncio.to_thread(kube.patch, POOL, ns, "race", {"spec": {"maxStarting": 3}})
        await eventually(
            kube, "Secret", ns, "ksp-race-deadbeef-conn", lambda s: s is None, what="collected"
        )


async def test_counts_written_at_once_by_many_operators_are_all_kept(
    kube: Kube, ns: str, images: dict[str, str]
) -> None:
    """Eight tallies (as eight operators would) add to one pool's counters at the same
    moment, while its status is also written: every count lands, none twice."""
    body = await asyncio.to_thread(kube.create, pool_body("tally", ns, 0, images["minimal"]))
    pool = ksp.load(ksp.validate(body, default_namespace=ns))
    tallies = [Tally(kube) for _ in range(8)]
    go = threading.Barrier(len(tallies) + 1)

    def add(tally: Tally, field: str) -> None:
        go.wait(timeout=30)
        tally.add(pool, field)

    def write_status() -> None:
        go.wait(timeout=30)
        for n in range(5):
            kube.patch(POOL, ns, "tally", {"status": {"starting": n}}, status=True)

    threads = [
        threading.Thread(target=add, args=(t, "claims" if i % 4 else "misses"))
        for i, t in enumerate(tallies)
    ]
    threads.append(threading.Thread(target=write_status))
    for thread in threads:
        thread.start()
    for thread in threads:
        await asyncio.to_thread(thread.join, 60)
    await counted(kube, ns, "tally", claims=6, misses=2)
    for tally in tallies[1:]:
        tally.close()
    # A count for a pool deleted and made again under its name is not the new pool's.
    await asyncio.to_thread(kube.delete, POOL, ns, "tally")
    await eventually(kube, POOL, ns, "tally", lambda o: o is None, what="pool gone")
    await asyncio.to_thread(kube.create, pool_body("tally", ns, 0, images["minimal"]))
    tallies[0].add(pool, "claims")
    await asyncio.to_thread(tallies[0].close)  # its write is done
    again = await asyncio.to_thread(kube.get, POOL, ns, "tally")
    assert again is not None and "claims" not in (again.get("status") or {}), again


async def test_a_claim_whose_secret_is_missing_takes_no_kernel_and_its_cold_pod_says_why(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """The gateway gives Secret values to a claimed kernel; the operator claims only when
    they are there. Without: a cold pod, whose kubelet names the missing Secret."""
    await asyncio.to_thread(kube.create, pool_body("sec", ns, 1, images["minimal"]))
    await filled(kube, ns, "sec", 1)
    ref = {"secretKeyRef": {"name": "absent", "key": "token"}}
    body = session_body(
        "lacking",
        ns,
        image=images["minimal"],
        resources=SMALL,
        poolRef={"name": "sec"},
        env=[{"name": "TOKEN", "valueFrom": ref}],
    )
    await asyncio.to_thread(kube.create, body)
    obj = await eventually(
        kube, KS, ns, "lacking", lambda o: phase(o) == "Failed", timeout=90, what="Failed"
    )
    assert obj is not None
    warm = condition(obj, ksp.WARM_START)
    assert (warm["status"], warm["reason"]) == ("False", ksp.CLAIM_FAILED), warm
    assert "'absent'" in warm["message"], warm
    assert obj["status"]["reason"] == "CreateContainerConfigError", obj["status"]
    assert "absent" in obj["status"]["message"]
    assert len(await members(kube, ns, "sec")) == 1, "the pool's kernel is still there"


async def test_a_pool_of_a_missing_image_backs_off_stalls_and_recovers_when_fixed(
    kube: Kube, ns: str, images: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad template makes a handful of pods, not a churn: each failure waits a backoff
    (1 s here, doubling), the third in a row makes the pool Stalled with the kubelet's
    reason (kstatus: Failed); a fixed template clears it and the pool fills."""
    monkeypatch.setenv("MCPFORGE_POOL_BACKOFF", "1")
    async with running_operator(kube):
        bad = pool_body("broken", ns, 1, "localhost/mcp-forge-no-such-image:0")
        await asyncio.to_thread(kube.create, bad)
        stalled = await eventually(
            kube, POOL, ns, "broken",
            lambda o: condition(o, "Stalled").get("status") == "True", timeout=FILL,
            what="Stalled",
        )  # fmt: skip
        assert stalled is not None
        said = condition(stalled, "Stalled")
        assert said["reason"] in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"), said
        failures = stalled["status"]["failures"]
        assert failures["count"] >= 3 and failures["reason"] == said["reason"], failures
        assert kstatus(stalled) == ["Failed"]
        made = await asyncio.to_thread(kube.list, "Event", ns, fields={"reason": "Scheduled"})
        assert len(made.get("items") or []) <= failures["count"] + 1, "a churn of pods"
        told = await events_of(kube, ns, "broken", {said["reason"], "Stalled"})
        warned = {e["reason"] for e in told if e["type"] == "Warning"}
        assert {said["reason"], "Stalled"} <= warned, told
        assert {e["reason"] for e in told if e["type"] == "Normal"} == {"Started"}, told

        fix = {"spec": {"template": {"image": images["minimal"]}}}
        await asyncio.to_thread(kube.patch, POOL, ns, "broken", fix)
        fixed = await filled(kube, ns, "broken", 1)
        assert condition(fixed, "Stalled")["status"] == "False"
        assert "failures" not in fixed["status"], fixed["status"]
        assert kstatus(fixed) == ["Current"]
