"""Snapshots kept in a claim of their session (issue 27), so that they outlive their node.

With `snapshot_store` "claim" (MCPFORGE_SNAPSHOT_STORE), a suspended session's snapshot,
once the kubelet has taken it on the kernel's node (control/snapshots.py), is copied into
a PersistentVolumeClaim of the session's, `ks-<name>-snapshot`: owned by the session
(deleted with it), of `snapshot_storage_class`, as large as the kernel's memory and
writable layer may be. The node's handler makes the copy (images/node/runc-restore/
store.go) at the creation of a pod of the session's, `ks-<name>-snapshot-store`, annotated
`store:<archive>` and placed on the archive's node: confined as the kernel is (its user
namespace, uid, seccomp profile, runtime class; no token, no capability, a read-only
root, the claim read-only; the baseline NetworkPolicy selects it), it runs nothing but an
empty Python and ends. The handler signs the copy with a key the nodes share (HMAC):
every pod of the namespace may write the claim, none can have a node restore anything the
nodes did not store. The files are root's, unreadable by the pods that mount the claim.

`status.snapshot.stored` says Storing (the pod made), Stored (with `claim`) or Failed and
why (the snapshot stays on its node). A pod that wakes from a stored snapshot mounts the
claim read-only at MOUNT, where the handler looks when its node does not have the
archive, and prefers the archive's node instead of requiring it: a node gone, or taking
no pod, no longer loses the memory (the claim's own volume decides where it can mount).
A session woken before its store ended wakes from its node, and the store pod goes.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

from mcp_forge.api.kernelsession import API_VERSION, KIND, KernelSession, parse_quantity
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.control.pods import ended_message, owned_by
from mcp_forge.control.render import (
    CONTAINER,
    LABEL_COMPONENT,
    SNAPSHOT_STORE,
    TMP_BYTES,
    child_name,
    labels,
)
from mcp_forge.control.snapshots import RESTORE_FROM, STORED, refusal

if TYPE_CHECKING:
    from mcp_forge.control.realize import Pass
    from mcp_forge.control.reconciler import Reconciler

log = logging.getLogger(__name__)

CLAIM = "claim"  # settings.snapshot_store's value that turns this on
MOUNT = "/.mcpforge-snapshot"  # where the handler finds the claim (store.go's claimMount)
STORE_PREFIX = "store:"  # the handler's annotation's value, before the archive's name
STORING, FAILED = "Storing", "Failed"  # and snapshots.STORED
START_DEADLINE = 300.0  # seconds for the store pod to be made and end, from its creation
RECHECK = 1.0  # its pod's events do not reach the session's reconcile: looked at this often
HEADROOM = 64 << 20  # bytes of the claim beyond the kernel's memory and writable layer
MESSAGE_MAX = 500
LIMITS = {"cpu": "100m", "memory": "64Mi"}
VOLUME = "mcpforge-snapshot"


def on(r: Reconciler) -> bool:
    return bool(r.settings.snapshot_runtime_class) and r.settings.snapshot_store == CLAIM


def claim_name(session: KernelSession) -> str:
    return f"{child_name(session)}-snapshot"


def pod_name(session: KernelSession) -> str:
    return f"{child_name(session)}-{SNAPSHOT_STORE}"


def step(r: Reconciler, p: Pass) -> None:
    """While suspended, a snapshot held on a node and not stored yet: its claim, then a
    pod on that node that has it stored; the outcome in `status.snapshot.stored`. A pod or
    claim of those names that is not the session's store's is never touched: the store
    fails, saying so."""
    snap = p.status.get("snapshot") or {}
    done = (snap.get("stored") or {}).get("outcome")
    if not on(r) or not snap.get("archive") or not snap.get("node") or snap.get("shared"):
        return
    if done in (STORED, FAILED):
        return
    ns, archive, name = p.session.namespace, str(snap["archive"]), pod_name(p.session)
    pod = r.kube.get("Pod", ns, name)
    if pod is not None and not _store_pod(pod, p.session):
        return _write(p, _failed(p, f"pod {name} is in the way: it is not this session's store"))
    if pod is not None and (pod["metadata"].get("deletionTimestamp") or _archive(pod) != archive):
        _delete(r, pod)  # an earlier snapshot's store: made again once it is gone
        p.due.append(p.now + RECHECK)
        return
    if pod is None:
        claim, _ = r.kube.ensure(render_claim(p.session, r.settings.snapshot_storage_class))
        if not owned_by(claim, p.session) or claim["metadata"].get("deletionTimestamp"):
            why = f"claim {claim_name(p.session)} is not this session's, or is being deleted"
            return _write(p, _failed(p, why))
        r.kube.ensure(render(p.found.want_pod, p.session, archive, str(snap["node"])))
        _write(p, {"outcome": STORING, "at": stamp(p.now)})
        p.due.append(p.now + RECHECK)
        return
    made = parse_time(pod["metadata"].get("creationTimestamp")) or p.now
    phase = (pod.get("status") or {}).get("phase")
    said = refusal(pod)
    if phase == "Succeeded":
        stored = {
            "outcome": STORED,
            "claim": claim_name(p.session),
            "at": stamp(p.now),
            "seconds": round(max(0.0, p.now - made), 3),
        }
    elif said or phase == "Failed":
        stored = _failed(p, f"the store failed: {said or ended_message(pod, MESSAGE_MAX)}")
    elif p.now - made > START_DEADLINE:
        stored = _failed(p, f"the store did not end within {START_DEADLINE:.0f}s")
    else:
        p.due.append(p.now + RECHECK)
        return
    _write(p, stored)
    log.info("%s/%s: snapshot %s", ns, p.session.name, stored["outcome"])
    _delete(r, pod)


def tidy(r: Reconciler, p: Pass) -> None:
    """What a store leaves once its snapshot goes (woken from, or dropped): a store still
    under way is stopped, and a dropped snapshot's copy goes with its claim (kept no longer
    than the snapshot: `snapshot_max_age`, or snapshots turned off). A woken one's copy
    was spent by the node's handler; its claim is kept for the next store."""
    before = (p.old.get("snapshot") or {}).get("stored") or {}
    if not before or (p.status.get("snapshot") or {}).get("stored"):
        return
    ns = p.session.namespace
    if before.get("outcome") == STORING:
        pod = r.kube.get("Pod", ns, pod_name(p.session))
        if pod is not None and _store_pod(pod, p.session):
            _delete(r, pod)
    if (p.status.get("lastRestore") or {}).get("outcome") == "Discarded":
        claim = r.kube.get("PersistentVolumeClaim", ns, claim_name(p.session))
        labelled = ((claim or {}).get("metadata") or {}).get("labels") or {}
        if (
            claim is not None
            and owned_by(claim, p.session)
            and labelled.get(LABEL_COMPONENT) == "snapshot"
        ):
            meta = claim["metadata"]
            r.kube.delete("PersistentVolumeClaim", ns, meta["name"], uid=meta.get("uid"))


def waking(
    r: Reconciler, session: KernelSession, status: dict[str, Any], pod: dict[str, Any]
) -> None:
    """A pod about to wake from the snapshot (`snapshots.waking` placed it on the archive's
    node): with the snapshot stored, it mounts the claim and only prefers that node; with
    a store still under way, that store's pod goes (the archive is woken from first)."""
    snap = status.get("snapshot") or {}
    outcome = (snap.get("stored") or {}).get("outcome")
    if outcome == STORING:
        store = r.kube.get("Pod", session.namespace, pod_name(session))
        if store is not None and _store_pod(store, session):
            _delete(r, store)
        return
    if outcome != STORED or not on(r) or "affinity" not in pod["spec"]:
        return
    spec = pod["spec"]
    # Read-only in the container only: the node's handler spends the copy it woke from.
    spec.setdefault("volumes", []).append(
        {"name": VOLUME, "persistentVolumeClaim": {"claimName": claim_name(session)}}
    )
    kernel = next(c for c in spec["containers"] if c["name"] == CONTAINER)
    kernel.setdefault("volumeMounts", []).append(
        {"name": VOLUME, "mountPath": MOUNT, "readOnly": True}
    )
    required = spec["affinity"]["nodeAffinity"].pop(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = [
        {"weight": 100, "preference": required["nodeSelectorTerms"][0]}
    ]


def render_claim(session: KernelSession, storage_class: str) -> dict[str, Any]:
    """The session's snapshot claim: room for the kernel's memory and its writable layer
    (the kubelet's archive holds both), owned by the session."""
    spec = session.spec
    size = spec.memory_bytes + parse_quantity(spec.workspace_size, field="spec.workspace.size")
    size += TMP_BYTES + HEADROOM
    meta: dict[str, Any] = {
        "name": claim_name(session),
        "namespace": session.namespace,
        "labels": {**labels(session), LABEL_COMPONENT: "snapshot"},
    }
    if session.uid:
        meta["ownerReferences"] = [_owner(session)]
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(size)}},
    }
    if storage_class:
        claim["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def render(
    kernel_pod: dict[str, Any], session: KernelSession, archive: str, node: str
) -> dict[str, Any]:
    """The store's pod, confined as the session's kernel pod (`kernel_pod`, as rendered):
    its container is named and imaged as the kernel's (the handler checks the archive is
    of both), on the archive's node, the claim mounted read-only where the handler looks."""
    kernel = kernel_pod["spec"]["containers"][0]
    assert kernel["name"] == CONTAINER
    meta = copy.deepcopy(kernel_pod["metadata"])
    meta["name"] = pod_name(session)
    meta["labels"][LABEL_COMPONENT] = SNAPSHOT_STORE  # not a kernel: no watch of kernels sees it
    meta["annotations"] = {RESTORE_FROM: f"{STORE_PREFIX}{archive}"}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": int(START_DEADLINE),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "securityContext": copy.deepcopy(kernel_pod["spec"]["securityContext"]),
        "containers": [
            {
                "name": CONTAINER,
                "image": kernel["image"],
                "imagePullPolicy": kernel.get("imagePullPolicy", "IfNotPresent"),
                "command": ["python", "-I", "-S", "-c", ""],
                "workingDir": "/",
                "resources": {"limits": dict(LIMITS), "requests": dict(LIMITS)},
                "securityContext": {
                    **copy.deepcopy(kernel["securityContext"]),
                    "readOnlyRootFilesystem": True,
                },
                "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}],
            }
        ],
        "volumes": [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim_name(session)}}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
    }
    for key in ("hostUsers", "runtimeClassName"):
        if key in kernel_pod["spec"]:
            spec[key] = kernel_pod["spec"][key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _owner(session: KernelSession) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": session.name,
        "uid": session.uid,
        "controller": True,
    }


def _write(p: Pass, stored: dict[str, Any]) -> None:
    """Into the status this pass writes (whole: a new snapshot keeps nothing of the last)."""
    p.status["snapshot"] = {**(p.status.get("snapshot") or {}), "stored": stored}


def _failed(p: Pass, message: str) -> dict[str, Any]:
    log.warning("%s/%s: %s", p.session.namespace, p.session.name, message)
    return {"outcome": FAILED, "at": stamp(p.now), "message": message[:MESSAGE_MAX]}


def _store_pod(pod: dict[str, Any], session: KernelSession) -> bool:
    labelled = pod["metadata"].get("labels") or {}
    return owned_by(pod, session) and labelled.get(LABEL_COMPONENT) == SNAPSHOT_STORE


def _archive(pod: dict[str, Any]) -> str:
    """The archive a store pod stores."""
    value = (pod["metadata"].get("annotations") or {}).get(RESTORE_FROM)
    return value.removeprefix(STORE_PREFIX) if isinstance(value, str) else ""


def _delete(r: Reconciler, pod: dict[str, Any] | None) -> None:
    if pod is not None and not pod["metadata"].get("deletionTimestamp"):
        meta = pod["metadata"]
        r.kube.delete("Pod", meta["namespace"], meta["name"], uid=meta.get("uid"))
