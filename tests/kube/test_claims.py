"""Claims of warm kernels on the real test cluster, checked against the API server
itself: two sessions never hold one pod or one key, a claim made beside a policy not made
yet is taken up rather than made twice, an operator that stops between its claim and its
status write leaves nothing claimed twice or leaked, and every claim and miss is counted
once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from typing import Any

from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.poolkeeper import PoolKeeper, Tally
from mcp_forge.control.render import LABEL_SESSION, TEMPLATE_HASH
from mcp_forge.settings import Settings

from .cluster_common import ROOT
from .harness import (
    HOLD,
    KS,
    SMALL,
    condition,
    eventually,
    failed_tries,
    key_in,
    phase,
    pool_body,
    ready,
    running_operator,
    session_body,
)
from .pooling import POOL, counted, filled, members

AUDIT = ROOT / "logs" / "audit.log"  # the test cluster API server's (cluster_config.py)


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


def operator_requests(since: int) -> list[str]:
    """The operator's requests in the API server's audit log after byte `since` (the
    operator's client names itself in its user agent), as "verb uri"."""
    with AUDIT.open("rb") as f:
        f.seek(since)
        data = f.read()
    out = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        event = json.loads(line)
        if str(event.get("userAgent", "")).startswith("mcp-forge-operator/"):
            out.append(f"{event['verb']} {urllib.parse.unquote(event['requestURI'])}")
    return out


async def test_a_claim_is_made_from_what_the_watches_showed_of_the_pool(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """A fresh session's claim starts from the pool and its kernels as the operator's
    watches showed them (control/watched.py): neither is read between the session's
    creation and its Ready, by the API server's own audit log; nor is the session itself
    before its claim (its ADDED event brought it)."""
    await asyncio.to_thread(kube.create, pool_body("seen", ns, 2, images["minimal"]))
    await filled(kube, ns, "seen", 2)
    since = AUDIT.stat().st_size
    await asyncio.to_thread(
        kube.create,
        session_body(
            "delta", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "seen"}
        ),
    )
    obj = await ready(kube, ns, "delta")
    assert condition(obj, ksp.WARM_START)["reason"] == ksp.CLAIMED, obj["status"]
    asked = operator_requests(since)
    claimed = f"patch /api/v1/namespaces/{ns}/pods/{obj['status']['podName']}"
    claims = [i for i, a in enumerate(asked) if a.startswith(claimed)]
    assert claims, asked  # the log holds the claim
    session = f"get /apis/mcpforge.dev/v1alpha1/namespaces/{ns}/kernelsessions/delta"
    assert session not in asked[: claims[0]], asked
    # The pool's own reconcile may run meanwhile: it reads the pool, then lists the
    # namespace's sessions (and kernels), and may write the claim's count (a read of the
    # pool, then its status), as the counter's own thread does half a second after a
    # claim. So the claim's reads are those before its patch: each read of the pool there
    # is a reconcile's, whose list of sessions follows before the pool is read again.
    pool_get = f"get /apis/mcpforge.dev/v1alpha1/namespaces/{ns}/kernelsessionpools/seen"
    session_list = f"list /apis/mcpforge.dev/v1alpha1/namespaces/{ns}/kernelsessions"
    before, after = asked[: claims[0]], asked[claims[0] :]
    upto = after.index(pool_get) if pool_get in after else len(after)
    lists = before.count(session_list) + after[:upto].count(session_list)
    assert before.count(pool_get) <= lists, asked
    pods = f"list /api/v1/namespaces/{ns}/pods"
    assert not [a for a in asked if a.startswith(pods) and f"{ksp.LABEL_POOL}=seen" in a], asked


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
        warm = condition(objs[winner], ksp.WARM_START)  # said as the claim would have
        assert (warm["status"], warm["reason"]) == ("True", ksp.CLAIMED), warm
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


async def test_a_claim_made_beside_a_policy_not_made_yet_is_kept_not_made_twice(
    kube: Kube, ns: str, operator: Any, images: dict[str, str]
) -> None:
    """A fresh session's claim is made beside its Service, NetworkPolicy and Lease. Its
    NetworkPolicy cannot be made while an earlier one of that name is still being
    removed (held here by a finalizer): the claim is written, the reconcile fails and is
    tried again (each failed try a ReconcileError Event). No try claims a second kernel,
    the session is not Ready while the policy is missing, and once it can be made the
    session is Ready on the kernel first claimed, saying it started warm; the pool
    counts one claim."""
    await asyncio.to_thread(kube.create, pool_body("beside", ns, 2, images["minimal"]))
    await filled(kube, ns, "beside", 2)
    pool_pods = {p["metadata"]["name"] for p in await members(kube, ns, "beside")}
    held = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "ks-gamma", "namespace": ns, "finalizers": [HOLD]},
        "spec": {
            "podSelector": {"matchLabels": {LABEL_SESSION: "gamma"}},
            "policyTypes": ["Ingress", "Egress"],
        },
    }
    await asyncio.to_thread(kube.create, held)
    try:
        await asyncio.to_thread(
            kube.create,
            session_body(
                "gamma", ns, image=images["minimal"], resources=SMALL, poolRef={"name": "beside"}
            ),
        )
        # Two tries failed: the first claimed, the second found that claim.
        await failed_tries(kube, ns, "gamma", 2, timeout=60)
        obj = await asyncio.to_thread(kube.get, KS, ns, "gamma")
        assert phase(obj) != "Ready", obj
        listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={LABEL_SESSION: "gamma"})
        holding = [p["metadata"]["name"] for p in listed["items"]]
        assert len(holding) == 1 and holding[0] in pool_pods, (holding, pool_pods)
    finally:
        await asyncio.to_thread(
            kube.patch, "NetworkPolicy", ns, "ks-gamma", {"metadata": {"finalizers": None}}
        )
    obj = await ready(kube, ns, "gamma")
    assert obj["status"]["podName"] == holding[0], obj["status"]
    warm = condition(obj, ksp.WARM_START)
    assert (warm["status"], warm["reason"]) == ("True", ksp.CLAIMED), warm
    policy = await asyncio.to_thread(kube.get, "NetworkPolicy", ns, "ks-gamma")
    assert policy is not None and policy["metadata"]["ownerReferences"][0]["name"] == "gamma"
    listed = await asyncio.to_thread(kube.list, "Pod", ns, labels={LABEL_SESSION: "gamma"})
    assert [p["metadata"]["name"] for p in listed["items"]] == holding
    await counted(kube, ns, "beside", claims=1, misses=0)
    await filled(kube, ns, "beside", 2, claimed=1)


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
