"""Live snapshots on a cluster (issue 27): a suspend keeps the kernel's memory.

With `snapshot_runtime_class` set (settings.py), kernel pods run on the nodes'
`mcpforge-restore` runtime handler (images/node/runc-restore) with a user namespace of
their own. Then:

- a suspend (`operatingMode: Suspended`, or idleness with `idleAction: Suspend`) has the
  kubelet checkpoint the running kernel (clients/kubelet.py: the archive stays on that
  node) before its pod goes; `status.snapshot` names the node and the archive;
- the next kernel pod wakes from it: it carries the annotation the handler reads and runs
  on that node, and once its kernel answers, `status.lastRestore` says Restored;
- a restore the handler refuses or CRIU fails (the pod's container never starts, the
  reason in its status) deletes that pod: the next one starts afresh, and
  `status.lastRestore` says Failed and why, as does the session's message;
- a checkpoint that fails stops the kernel all the same: the suspend says the variables
  are lost;
- a pod that cannot be scheduled on the node holding the snapshot (gone, or taking no
  pod past the progress deadline) is deleted as a failed restore is;
- a session of a pool wakes from its snapshot, not from a warm kernel; a pool's kernel it
  runs on (claimed, keyed as its pool's) is not checkpointed;
- the snapshot's size comes from the node's sweeper (control/sweeper.py), which alone
  sees the archive: `sized` reads the node's ConfigMap of sizes into
  `status.snapshot.size`, looking again every `snapshot_size_recheck` seconds for up to
  SIZE_PATIENCE after the checkpoint.

What a snapshot keeps and what it cannot is in docs/design.md §14.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from mcp_forge.api import status as st
from mcp_forge.api.status import stamp
from mcp_forge.control.pods import Observation, observe
from mcp_forge.control.render import CONTAINER, child_name
from mcp_forge.control.sweeper import SIZES_KEY, sizes_name
from mcp_forge.errors import ApiError

if TYPE_CHECKING:
    from mcp_forge.api.kernelsession import KernelSession
    from mcp_forge.control.realize import Pass
    from mcp_forge.control.reconciler import Reconciler

log = logging.getLogger(__name__)

RESTORE_FROM = "mcpforge.dev/restore-from"  # read by the node's handler
SHARED = "shared:"  # its value's prefix: other pods wake from the archive too (forks)
SIZE_PATIENCE = 600.0  # seconds after a checkpoint its size is looked for (no sweeper?)
SIZES_READ_MAX = 1 << 20  # bytes of a node's sizes.json parsed (a ConfigMap's own limit)
SIZE_MAX = 2**53 - 1  # bytes: a JSON number every reader keeps exact (the API server too)
HANDLER = "mcpforge-runc"  # how the handler's refusals and failures begin
STORED = "Stored"  # status.snapshot.stored's outcome once its claim has a copy (snapstore.py)


def waking(status: dict[str, Any], pod: dict[str, Any]) -> None:
    """Have `pod` (a rendered kernel pod, about to be made) wake from the snapshot
    `status` holds, if any (`settle` has dropped one past its age): the handler's
    annotation, and the node that has the archive."""
    snap = status.get("snapshot") or {}
    if not snap.get("archive") or not snap.get("node"):
        return
    value = f"{SHARED if snap.get('shared') else ''}{snap['archive']}"
    pod["metadata"].setdefault("annotations", {})[RESTORE_FROM] = value
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [snap["node"]]}
                        ]
                    }
                ]
            }
        }
    }


def take(r: Reconciler, p: Pass) -> None:
    """Before a suspend's delete: checkpoint the running kernel if it can be (the
    session's own pod on the restore handler, in a namespace of its own, its kernel
    answering). The snapshot is written to status at once, before the pod goes: a pass
    that fails after it neither loses it nor takes another."""
    stop, pod = p.stop, p.pod
    if stop is None or stop.phase != st.SUSPENDED or pod is None:
        return
    held = p.status.get("snapshot") or {}  # as `settle` left it
    if held:
        if woke_from(pod) != held.get("archive") or not _tried(pod):
            return  # taken by an earlier pass, or its pod has not tried to wake: kept
        p.status["snapshot"] = None  # this pod woke from it, or failed to: it is spent
    if not checkpointable(r, p.session, pod):
        return
    meta, node = pod["metadata"], pod["spec"]["nodeName"]
    ns, name = p.session.namespace, p.session.name
    started = time.monotonic()
    try:
        with checkpoints_of(ns, name, wait=True):  # after a fork's of it, if one is under way
            taken = r.kubelet.checkpoint(node, ns, meta["name"], CONTAINER)
    except ApiError as exc:
        log.warning("%s/%s: no snapshot: %s", ns, name, exc)
        p.notes.append(f"the checkpoint failed: {exc}")
        return
    seconds = round(time.monotonic() - started, 3)
    snap = {
        "node": node,
        "archive": os.path.basename(taken.archive),
        "takenAt": stamp(p.now),
        "seconds": seconds,
        "inPod": False,
    }
    written = st.merge_patch(p.old.get("snapshot") or {}, snap)  # nothing of the last one kept
    r.kube.patch("KernelSession", ns, name, {"status": {"snapshot": written}}, status=True)
    p.status["snapshot"] = snap
    log.info("%s/%s: checkpointed in %.2fs", ns, name, seconds)


class _Gate:
    """One kernel's checkpoints, one at a time (CRIU freezes it for each)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


_gates: weakref.WeakValueDictionary[tuple[str, str], _Gate] = weakref.WeakValueDictionary()
_gates_lock = threading.Lock()


@contextlib.contextmanager
def checkpoints_of(namespace: str, name: str, *, wait: bool) -> Iterator[bool]:
    """Held while the session's kernel is checkpointed (for its suspend, or a fork of
    it): True if it is this caller's; without `wait`, False at once if another holds it."""
    with _gates_lock:
        gate = _gates.get((namespace, name))
        if gate is None:
            gate = _gates[(namespace, name)] = _Gate()
    if not gate.lock.acquire(blocking=wait):  # `gate` held here: the table keeps it no longer
        yield False
        return
    try:
        yield True
    finally:
        gate.lock.release()


def said(r: Reconciler, p: Pass) -> None:
    """A suspend says whether the memory is kept (every pass, from the status)."""
    stop = p.stop
    if stop is None or stop.phase != st.SUSPENDED or not r.settings.snapshot_runtime_class:
        return
    kept = bool(p.status.get("snapshot"))
    tail = "its memory is kept in a snapshot" if kept else "its variables are lost (no snapshot)"
    p.stop = replace(stop, message=f"{stop.message}; {tail}")


def checkpointable(r: Reconciler, session: KernelSession, pod: dict[str, Any]) -> bool:
    """Whether `pod` is `session`'s own kernel pod on the restore handler, in a user
    namespace of its own, its kernel answering (a pool's kernel is keyed as its pool's)."""
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    if not (
        spec.get("runtimeClassName") == r.settings.snapshot_runtime_class
        and spec.get("hostUsers") is False
        and spec.get("nodeName")
        and meta["name"] == child_name(session)
        and not meta.get("deletionTimestamp")
        and r.settings.snapshot_runtime_class
    ):
        return False
    answers = r.answers.of(session.namespace, session.name, meta.get("uid"))
    return observe(session, pod, answers).ready


def settle(r: Reconciler, p: Pass) -> None:
    """With snapshots turned off, a snapshot held from before is dropped: no pod wakes
    from it any more, and a session of a pool may claim a warm kernel again. So is one
    kept `snapshot_max_age` while no pod is waking from it (a pod that is, `follow`
    sees through, whatever its age): the session is looked at again then, and the
    node's sweeper (control/sweeper.py) removes the archive no status names."""
    snap, max_age = p.old.get("snapshot") or {}, r.settings.snapshot_max_age
    if not r.settings.snapshot_runtime_class:
        discard(p, "snapshots are off")
    elif not snap or _woken_by(p.pod, snap):
        return
    elif expired(snap, max_age, p.now):
        longest = f"{max_age / 86_400:g} days" if max_age >= 86_400 else f"{max_age:g} s"
        discard(p, f"the snapshot was kept for its longest ({longest})")
    elif max_age and (taken := st.parse_time(snap.get("takenAt"))) is not None:
        p.due.append(taken + max_age)


def _woken_by(pod: dict[str, Any] | None, snap: dict[str, Any]) -> bool:
    return bool(snap.get("archive")) and woke_from(pod) == snap["archive"]


def woke_from(pod: dict[str, Any] | None) -> str:
    """The archive a kernel pod was made to wake from ("" none)."""
    notes = ((pod or {}).get("metadata") or {}).get("annotations") or {}
    value = notes.get(RESTORE_FROM)
    return value.removeprefix(SHARED) if isinstance(value, str) else ""


def expired(snap: dict[str, Any], max_age: float, now: float) -> bool:
    """Whether a snapshot was taken `max_age` seconds ago or more (0: never)."""
    taken = st.parse_time(snap.get("takenAt"))
    return bool(max_age) and taken is not None and now - taken >= max_age


def discard(p: Pass, why: str) -> None:
    """A snapshot that will not be woken from (the session expired, or its kernel is
    replaced): dropped, and said so."""
    if p.old.get("snapshot"):
        p.status["snapshot"] = None
        p.status["lastRestore"] = {"outcome": "Discarded", "at": stamp(p.now), "message": why}


def follow(r: Reconciler, p: Pass, seen: Observation) -> Observation:
    """A pod that was to wake from the snapshot: Restored once its kernel answers; a
    restore that failed deletes it (the next pod starts afresh) and says why."""
    pod = p.pod
    assert pod is not None
    meta = pod["metadata"]
    if not r.settings.snapshot_runtime_class or not woke_from(pod) or not p.old.get("snapshot"):
        return seen
    failed = refusal(pod) or ended_early(pod) or _unplaced(r, p, pod, p.old["snapshot"])
    if failed:
        log.warning("%s/%s: restore failed: %s", p.session.namespace, p.session.name, failed)
        if not meta.get("deletionTimestamp"):
            r.kube.delete("Pod", p.session.namespace, meta["name"], uid=meta.get("uid"))
        p.status["snapshot"] = None
        p.status["lastRestore"] = {"outcome": "Failed", "at": stamp(p.now), "message": failed}
        message = "its snapshot could not be restored: a new kernel starts; variables lost"
        return Observation(st.RESTARTING, "RestoreFailed", message)
    if seen.ready:
        made = st.parse_time(meta.get("creationTimestamp")) or p.now
        p.status["snapshot"] = None
        p.status["lastRestore"] = {
            "outcome": "Restored",
            "at": stamp(p.now),
            "seconds": round(max(0.0, p.now - made), 3),
        }
    return seen


def refusal(pod: dict[str, Any]) -> str:
    """What the node's handler said when it would not wake the pod's kernel ("" if it
    did not refuse)."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in ((c.get("state") or {}), (c.get("lastState") or {})):
            for why in state.values():
                message = str((why or {}).get("message") or "")
                if HANDLER in message:
                    return message[message.index(HANDLER) :][:1000]
    return ""


def ended_early(pod: dict[str, Any]) -> str:
    """Why a woken kernel ended before it was seen to answer ("" if it did not): it is
    terminated (kernel pods run with restartPolicy Never), or its container has started
    again, afresh (the node's handler wakes a container at its first start only), so it
    holds none of the snapshot's memory. A page server that
    ended before every page was in kills the kernel it served (images/node/runc-restore/
    lazy.go)."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        now, last = c.get("state") or {}, c.get("lastState") or {}
        if int(c.get("restartCount") or 0) > 0 or "terminated" in last or "terminated" in now:
            why = now.get("terminated") or last.get("terminated") or {}
            return (
                f"the woken kernel ended before it answered ({why.get('reason') or 'ended'}, "
                f"exit code {why.get('exitCode')}): a new kernel starts"
            )
    return ""


def _tried(pod: dict[str, Any]) -> bool:
    """Whether the node's handler has run for the pod's kernel: its container ran, ended,
    or was refused. Until then the archive is untouched."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        state, last = c.get("state") or {}, c.get("lastState") or {}
        if "running" in state or "terminated" in state or last:
            return True
    return bool(refusal(pod))


def _unplaced(r: Reconciler, p: Pass, pod: dict[str, Any], snap: dict[str, Any]) -> str:
    """Why a pod that cannot be scheduled on the node holding its snapshot will not wake:
    the node is gone, or the pod has waited for it past the progress deadline (the node
    cordoned, full, not ready). "" while it may still be placed. A pod that only prefers
    the node (its snapshot stored in its claim: snapstore.py) is held to the deadline
    alone."""
    unscheduled = [
        c
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("type") == "PodScheduled" and c.get("status") == "False"
    ]
    if not unscheduled:
        return ""
    node = str(snap.get("node") or "")
    where = f"the node {node} that holds the snapshot took no pod"
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    if "requiredDuringSchedulingIgnoredDuringExecution" not in affinity:  # from its claim too
        where = f"no node took the pod waking from claim {(snap.get('stored') or {}).get('claim')}"
    else:
        try:
            r.kube._call("GET", f"/api/v1/nodes/{quote(node, safe='')}")
        except ApiError as exc:
            if exc.not_found:
                return f"the node {node} that held the snapshot is gone"
            raise
    since = st.parse_time(unscheduled[0].get("lastTransitionTime")) or p.now
    deadline = r.settings.progress_deadline
    if deadline > 0 and p.now - since >= deadline:
        return f"{where} for {deadline:.0f}s"
    if deadline > 0:
        p.due.append(since + deadline)
    return ""


def sized(r: Reconciler, p: Pass) -> None:
    """A held snapshot's size, from its node's ConfigMap of sizes (the sweeper's, written
    each round); until it is there, the session is looked at again, for SIZE_PATIENCE
    after the checkpoint (then no more: no sweeper, or the operator may not read its
    ConfigMaps). A ConfigMap that cannot be read, or says nothing usable, only leaves
    the size out."""
    snap = p.status.get("snapshot") or {}
    if not (r.settings.snapshot_runtime_class and snap.get("archive") and snap.get("node")):
        return
    taken = st.parse_time(snap.get("takenAt"))
    if snap.get("size") is not None or taken is None or p.now - taken >= SIZE_PATIENCE:
        return
    node, archive = str(snap["node"]), str(snap["archive"])
    try:
        shown = r.kube.get("ConfigMap", r.settings.snapshot_sweeper_namespace, sizes_name(node))
    except ApiError as exc:
        log.debug("%s: no sizes of node %s: %s", p.session.name, node, exc)
        shown = None
    size = _size_in(shown, archive)
    if size is not None:
        p.status["snapshot"] = {**snap, "size": size}
    else:
        p.due.append(p.now + r.settings.snapshot_size_recheck)


def _size_in(config_map: dict[str, Any] | None, archive: str) -> int | None:
    text = ((config_map or {}).get("data") or {}).get(SIZES_KEY)
    if not isinstance(text, str) or len(text) > SIZES_READ_MAX:
        return None
    try:
        said = json.loads(text)
    except (ValueError, RecursionError):  # a node's sweeper wrote it: nested past reason
        return None
    size = said.get(archive) if isinstance(said, dict) else None
    if isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= SIZE_MAX:
        return size
    return None
