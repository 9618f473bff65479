"""Forks on a cluster (issue 27): a KernelSession made with the annotation
`mcpforge.dev/forked-from: <parent>` starts from its parent's memory.

With snapshots on (control/snapshots.py), a new session naming a parent of its namespace
that is Ready on a kernel pod of its own has the kubelet checkpoint that kernel, which
runs on, into an archive of its own (the handler spends an archive it wakes from), and
its first pod wakes from it on that node, as a resume does (`snapshots.waking`).
`status.fork` says how it went: Restoring, then Forked or Failed.

The woken kernel still signs with its parent's key, so the fork's Secret starts as a
copy of its parent's, with the fork's own HMAC key beside it (FORK_KEY) and the names of
the parent's session variables (FORK_DROP). Once its kernel answers and the kubelet has
seen it start, the operator tells it, over its shell channel and in its parent's key, to
take the fork's key and environment (kernelside/fork.py; the reply comes signed with the
new key), and only then writes that key into the Secret and shows the session Ready: no
gateway reaches the fork before it signs with a key of its own. An operator stopped in
between finds FORK_KEY still there and goes on from where the kernel is (`_rekey`).

No kernel but the woken one ever starts on a Secret holding its parent's keys: a pod
that will not wake from the snapshot is made only after the Secret got keys of its own
(`before_pod`), and a woken kernel that was replaced before it took its key (its pod
gone, its container started again) fails the fork. Its transport keys (its Curve pair
and bridge certificate, FORK_KEYS until then) are given to the woken kernel once it
signs with the fork's key (kernelside/rebind.py binds its channels again), and written
into the Secret once it answers in them; a kernel that cannot take them keeps its
parent's (FORK_TRANSPORT marks them) until its next kernel that does not wake from a
snapshot. Its persistent workspace is a copy of its parent's
(control/forkfiles.py). A parent that cannot be checkpointed (not Ready, snapshots off,
a pool's kernel, egress rules, whose grant its memory would carry), a restore that
fails, or a kernel that will not take its key gives a fork that starts afresh with keys
of its own, and says why.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mcp_forge.api import forks
from mcp_forge.api import status as st
from mcp_forge.api.connection import new_key
from mcp_forge.api.kernelsession import KIND, KernelSession, load
from mcp_forge.api.kernelsessionpool import CLAIM_MARK
from mcp_forge.api.keys import BRIDGE_CERT, BRIDGE_KEY, CURVE_PUBLIC, CURVE_SECRET
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.clients.kube import connection_file_of, secret_env
from mcp_forge.control import snapshots
from mcp_forge.control.pods import Observation, kernel_status
from mcp_forge.control.render import CONTAINER, child_name, secret_name
from mcp_forge.control.sweeper import SHARED_REUSE
from mcp_forge.errors import ApiError, ForgeError, SecretError
from mcp_forge.kernelside import compiled, probe, run_silently
from mcp_forge.sandbox import SESSION_VARIABLE

if TYPE_CHECKING:
    from mcp_forge.control.realize import Pass
    from mcp_forge.control.reconciler import Reconciler

log = logging.getLogger(__name__)

FORK_KEY = "fork-key"  # Secret data: the fork's own HMAC key, until its kernel signs with it
FORK_DROP = "fork-drop"  # Secret data: its parent's session variables, a JSON list
FORK_KEYS = "fork-keys"  # Secret data: its own Curve pair and certificate, until its kernel's
FORK_TRANSPORT = "fork-transport"  # Secret data: its Curve pair and certificate are its parent's
FORK_DATA = (FORK_KEY, FORK_DROP, FORK_KEYS, FORK_TRANSPORT)
# The connection file's fields that make its transport keys (api/keys.py).
TRANSPORT_FIELDS = (CURVE_PUBLIC, CURVE_SECRET, BRIDGE_CERT, BRIDGE_KEY)
RESTORING, FORKED, FAILED = "Restoring", "Forked", "Failed"
ASK_MS = 10_000  # the woken kernel's wait for the request that makes it the fork's
WOKEN_CHECK = (
    "import os\n"
    "if os.environ.get(WAS[0]) != WAS[1]:\n"
    "    raise RuntimeError(f'not a woken copy of {WAS[1]!r}: {WAS[0]} says otherwise')\n"
)
BUSY_RECHECK = 5.0  # seconds: a fork of a busy parent looks again (its Lease is not watched)
# A batch's checkpoint is used again for this long: less than the node's sweeper leaves
# an archive no session holds (control/sweeper.py, whose grace may not be shorter).
SHARE_WITHIN = SHARED_REUSE
Snap = dict[str, Any]
_batches: dict[tuple[str, str, str, str], tuple[float, Snap]] = {}  # by (ns, parent, batch, pod)
_batches_lock = threading.Lock()


class Unforkable(ForgeError):
    """The parent's kernel cannot be checkpointed for a fork, or its copy made the fork's."""


class ParentBusy(ForgeError):
    """The parent runs a call: its copy would too, and not answer the fork's request.
    Or its hold is too new for calls begun before it to be seen; looked at again after
    `recheck` seconds."""

    def __init__(self, message: str, recheck: float = BUSY_RECHECK) -> None:
        super().__init__(message)
        self.recheck = recheck


# What a fork's steps may raise: the API's answers, and what a hostile kernel or Secret
# can make of the parsing (a key or list that is not base64, JSON or UTF-8).
REFUSED = (Unforkable, ApiError, SecretError, ValueError, RecursionError)


def parent_of(session: KernelSession) -> str | None:
    """The session it was made a fork of (FORKED_FROM), if any."""
    named = (session.body["metadata"].get("annotations") or {}).get(forks.FORKED_FROM)
    return named if isinstance(named, str) and named else None


def begin(r: Reconciler, p: Pass) -> str | None:
    """A fork's first start: its parent's kernel checkpointed, the fork's Secret a copy of
    its parent's, and its first pod to wake from the archive (`snapshots.waking`). What
    cannot be forked starts afresh, on keys of its own; `status.fork` says why. Written
    at once: a pass that fails after it neither checkpoints again nor loses the archive.
    Why its start waits (another checkpoint of its parent under way), or None."""
    parent = parent_of(p.session)
    if parent is None or p.old.get("fork") or ran(p.old):
        return None  # the annotation added to a session that ran: nothing of it is replaced
    ns, name = p.session.namespace, p.session.name
    with snapshots.checkpoints_of(ns, parent, wait=False) as mine:
        if not mine:
            p.due.append(p.now + 1.0)
            return f"waiting for another checkpoint of {parent} to end"
        try:
            secret, snap = _take(r, p, parent)
        except ParentBusy as exc:
            p.due.append(p.now + exc.recheck)
            return str(exc)
        except REFUSED as exc:
            why = (
                f"not forked from {parent}: {exc}; a new kernel starts, with nothing of its memory"
            )
            p.status["fork"] = {"from": parent, "outcome": RESTORING}
            _failed(r, p, why)  # an earlier pass may have given it its parent's keys
            return None
    p.found = replace(p.found, secret=secret)
    fork = {"from": parent, "outcome": RESTORING, "at": stamp(p.now)}
    p.status.update(snapshot=snap, fork=fork)
    r.kube.patch(KIND, ns, name, {"status": {"snapshot": snap, "fork": fork}}, status=True)
    log.info("%s/%s: forked from %s in %.2fs", ns, name, parent, snap["seconds"])
    return None


def ran(status: dict[str, Any]) -> bool:
    """Whether the session has had a kernel (or a snapshot) of its own."""
    kept = ("kernelId", "startedAt", "snapshot", "lastRestore", "lastTermination", "restarts")
    return any(status.get(k) for k in kept)


def _take(r: Reconciler, p: Pass, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fork's Secret (its parent's keys, its own beside them) and its snapshot."""
    session, ns = p.session, p.session.namespace
    if not r.settings.snapshot_runtime_class:
        raise Unforkable("snapshots are off on this cluster")
    if session.spec.egress_rules:
        raise Unforkable("a session with egress rules is not forked (its grant is its own)")
    body = r.kube.get(KIND, ns, name)
    if body is None:
        raise Unforkable(f"no session {name!r} in namespace {ns!r}")
    parent = load(body)
    if parent.spec.egress_rules:
        raise Unforkable(f"{name} has egress rules, whose credential its kernel holds")
    if (body.get("status") or {}).get("phase") != st.READY:
        raise Unforkable(f"{name} is not Ready")
    pod = r.kube.get("Pod", ns, child_name(parent))
    if pod is None or not snapshots.checkpointable(r, parent, pod):
        raise Unforkable(f"{name}'s kernel cannot be checkpointed (not its own, or not on "
                         "the restore handler, or not answering)")  # fmt: skip
    theirs = r.kube.get("Secret", ns, secret_name(parent))
    if theirs is None or connection_file_of(theirs) is None:
        raise Unforkable(f"{name} has no readable Secret")
    # Its calls wait until the fork's workspace is copied (forkfiles.py).
    held = body if session.spec.persistent and parent.spec.persistent else None
    snap = _checkpoint(r, p, parent, pod, held)
    want = r._render(session, theirs)[0]
    drop = sorted({v.name for v in parent.spec.env} | {CLAIM_MARK})
    own = json.loads(r._render(session, None)[0]["stringData"]["connection.json"])
    keys = {k: own[k] for k in TRANSPORT_FIELDS if k in own}
    want["stringData"].update(
        {FORK_KEY: new_key(), FORK_DROP: json.dumps(drop), FORK_KEYS: json.dumps(keys)}
    )
    # A fresh session's Secret was made with keys of its own beside its other children
    # (reconciler `_children`): its parent's replace them.
    r._ensure(want, session, likely_new=True)
    patch = {"stringData": want["stringData"]}
    secret = r.kube.patch("Secret", ns, want["metadata"]["name"], patch)
    return secret, snap


def _hold(r: Reconciler, p: Pass, parent: dict[str, Any]) -> float:
    """The parent held for this fork (api/forks.py HOLDS): a gateway starts none of its
    calls until the fork's workspace copy has ended, so the fork's files are those of
    the memory it wakes with; how long the hold has stood (0 when written now). Code the
    parent runs by itself (a thread) is not held. forkfiles.py lets it go; one that no
    operator lets go lapses (HOLD_FOR)."""
    session, status = p.session, parent.get("status") or {}
    mine = forks.live_holds(status, p.now).get(session.name) or {}
    since = parse_time(mine.get("since"))
    if mine.get("uid") == session.uid and since is not None:
        return p.now - since - 1  # `since` is stamped to the second, down
    patch = forks.hold(status, session.name, session.uid, p.now)
    meta = parent["metadata"]
    r.kube.patch(
        KIND, meta["namespace"], meta["name"], {"status": {forks.HOLDS: patch}}, status=True
    )
    return 0.0


def _checkpoint(
    r: Reconciler,
    p: Pass,
    parent: KernelSession,
    pod: dict[str, Any],
    held: dict[str, Any] | None = None,
) -> Snap:
    """The snapshot the fork wakes from: the parent's kernel checkpointed now, or, for a
    fork of a batch (FORK_BATCH: made together, the gateway's copies), the checkpoint an
    earlier fork of the batch took of that kernel within SHARE_WITHIN. A batch's archive
    is shared: the node's handler leaves it for the sweeper, which removes it once no
    session holds it and it is its grace old (at least SHARE_WITHIN and a minute). A
    parent running a call is waited for (ParentBusy) before a new checkpoint only.

    With `held` (the parent as read), the parent is held for the fork (`_hold`): once it
    is not busy, and the checkpoint waits until the hold has stood HOLD_SETTLE, so that a
    call begun before it, on any gateway, has ended or been marked busy (a gateway marks
    a call busy once it has run a heartbeat interval)."""
    ns, meta = parent.namespace, pod["metadata"]
    batch = (p.session.body["metadata"].get("annotations") or {}).get(forks.FORK_BATCH)
    # That kernel: its pod, and its container (one started again has other memory).
    container = str(kernel_status(pod).get("containerID") or "")
    key = (ns, parent.name, str(batch), f"{meta.get('uid')}/{container}")
    now = time.monotonic()
    with _batches_lock:
        for k in [k for k, (at, _) in _batches.items() if now - at >= SHARE_WITHIN]:
            del _batches[k]
        shared = dict(_batches[key][1]) if batch and key in _batches else None
    if shared is not None:
        if held is not None:
            _hold(r, p, held)
        return shared
    from mcp_forge.control.realize import activity  # realize wires this module in

    lease = r.kube.get("Lease", ns, child_name(parent)) or {}
    if activity(lease, 0.0, p.now)[0].busy(p.now):  # its woken copy would run the call on
        raise ParentBusy(f"waiting for {parent.name} to end the call it is running")
    if held is not None:
        if (stood := _hold(r, p, held)) < forks.HOLD_SETTLE:
            raise ParentBusy(
                f"holding {parent.name} for the copy of its workspace: calls begun before "
                "the hold end first",
                recheck=forks.HOLD_SETTLE - stood + 0.1,
            )
        # A hold that stood long (a busy parent waited for) lasts the copy out from now.
        until = {p.session.name: {"until": stamp(p.now + forks.HOLD_FOR)}}
        r.kube.patch(KIND, ns, parent.name, {"status": {forks.HOLDS: until}}, status=True)
    started, node = time.monotonic(), pod["spec"]["nodeName"]
    taken = r.kubelet.checkpoint(node, ns, meta["name"], CONTAINER)
    snap: Snap = {
        "node": node,
        "archive": os.path.basename(taken.archive),
        "takenAt": stamp(p.now),
        "seconds": round(time.monotonic() - started, 3),
        "inPod": False,
    }
    if batch:
        snap["shared"] = True
        with _batches_lock:
            _batches[key] = (now, dict(snap))
    return snap


def before_pod(r: Reconciler, p: Pass) -> None:
    """A kernel pod about to be made that will not wake from a snapshot starts on keys
    of its own: a fork's Secret that still holds its parent's gets new ones (the fork
    Failed if it was still to wake)."""
    if p.status.get("snapshot"):
        return
    data = (p.found.secret or {}).get("data") or {}
    if not any(k in data for k in FORK_DATA):
        return
    if (p.status.get("fork") or {}).get("outcome") == RESTORING:
        why = "its woken kernel was gone before it took a key of its own"
        _failed(r, p, why)
        p.status["lastRestore"] = {"outcome": "Failed", "at": stamp(p.now), "message": why}
    else:
        _own_keys(r, p)


def abandoned(r: Reconciler, p: Pass) -> None:
    """A fork whose snapshot went unrestored (dropped, or its restore failed): its Secret
    gets keys of its own before any kernel starts on it, and the fork says so."""
    fork = p.status.get("fork") or {}
    if fork.get("outcome") != RESTORING or p.status.get("snapshot"):
        return
    last = p.status.get("lastRestore") or {}
    if last.get("outcome") == "Restored" and _live(p.pod) and snapshots.woke_from(p.pod):
        return  # woken: `made_own` gives it its key
    why = last.get("message") or ("its woken kernel is gone" if last else "dropped")
    _failed(r, p, f"its snapshot was not restored ({why})")


def _live(pod: dict[str, Any] | None) -> bool:
    return pod is not None and not pod["metadata"].get("deletionTimestamp")


def after(r: Reconciler, p: Pass) -> None:
    """After a pass's step, whichever it was: a fork given up on (`abandoned`) has its
    woken pod deleted (it holds its parent's keys, its Secret no longer); and a fork
    still Restoring is not Ready, whatever path its pod was seen by (`made_own` makes
    it the fork's first)."""
    was = (p.old.get("fork") or {}).get("outcome")  # before this pass (settle's too)
    abandoned(r, p)
    outcome = (p.status.get("fork") or {}).get("outcome")
    if was == RESTORING and outcome == FAILED and _live(p.pod) and snapshots.woke_from(p.pod):
        meta = p.pod["metadata"] if p.pod else {}
        r.kube.delete("Pod", p.session.namespace, meta["name"], uid=meta["uid"])
        meta["deletionTimestamp"] = stamp(p.now)
        p.seen = Observation(st.RESTARTING, "ForkFailed", "a new kernel starts; variables lost")
    elif outcome == RESTORING and p.seen is not None and p.seen.ready:
        p.seen = replace(p.seen, phase=st.STARTING, reason="Forking",
                         message="its kernel is being made the fork's")  # fmt: skip


def made_own(r: Reconciler, p: Pass, seen: Observation) -> Observation:
    """A fork's woken kernel made the fork's (module text) once it answers and its
    container has started; until then not Ready. A kernel that is not the woken one (its
    container started again), or one that will not take its key, fails the fork: its
    pod is deleted, and the next starts afresh on keys of its own."""
    fork, pod = p.status.get("fork") or {}, p.pod
    if fork.get("outcome") != RESTORING or pod is None or seen.reason == "RestoreFailed":
        return seen
    kernel = kernel_status(pod)
    if not snapshots.woke_from(pod) or int(kernel.get("restartCount") or 0) > 0:
        return _give_up(r, p, "its woken kernel was replaced before it took a key of its own")
    if not seen.ready:
        return seen
    if not kernel.get("started"):  # the kubelet's probe signs with the old key
        p.due.append(p.now + 2.0)  # its pod's next event comes first, most likely
        return replace(seen, phase=st.STARTING, reason="Forking",
                       message="its kernel is being made the fork's")  # fmt: skip
    try:
        _rekey(r, p)
    except REFUSED as exc:
        return _give_up(r, p, f"its kernel did not take a key of its own ({exc})")
    p.status["fork"] = {**fork, "outcome": FORKED, "at": stamp(p.now)}
    return seen


def _give_up(r: Reconciler, p: Pass, why: str) -> Observation:
    meta = (p.pod or {}).get("metadata") or {}
    if meta.get("name") and meta.get("uid") and not meta.get("deletionTimestamp"):
        r.kube.delete("Pod", p.session.namespace, meta["name"], uid=meta["uid"])
        meta["deletionTimestamp"] = stamp(p.now)  # as the next read will show it
    _failed(r, p, why)
    p.status["lastRestore"] = {"outcome": "Failed", "at": stamp(p.now), "message": why}
    return Observation(st.RESTARTING, "ForkFailed", f"{why}: a new kernel starts; variables lost")


def _rekey(r: Reconciler, p: Pass) -> None:
    """The woken kernel given the fork's key and environment, then its transport keys;
    the Secret given what it took. A pass that stopped midway is gone on from where the
    kernel is: it answers in its parent's key, in the fork's, or in all the fork's keys."""
    ns, session = p.session.namespace, p.session
    secret = r.kube.get("Secret", ns, secret_name(session))
    info, data = connection_file_of(secret), (secret or {}).get("data") or {}
    host = str((p.pod or {}).get("status", {}).get("podIP") or "")
    if info is None or not host:
        raise Unforkable("its Secret or its pod's address is gone")
    if not isinstance(data.get(FORK_KEY), str):  # promoted by a pass whose status was lost
        if probe.answers(info, host, 2000):
            return
        raise Unforkable("its Secret lost the fork's key")
    mine = {**info, "key": base64.b64decode(data[FORK_KEY]).decode()}
    keys = json.loads(base64.b64decode(data.get(FORK_KEYS) or "e30=").decode())
    own = {**mine, **{k: keys[k] for k in TRANSPORT_FIELDS if isinstance(keys, dict) and k in keys}}
    if probe.answers(info, host, ASK_MS):  # its parent's key still: the usual case
        _become(r, p, info, host, mine["key"], data)
    elif own != mine and probe.answers(own, host, 2000):  # an earlier pass did it all
        return _promote(r, session, own, parents=False)
    elif not probe.answers(mine, host, 2000):
        raise Unforkable("it answers in none of its keys")
    took = _rebound(mine, own, host)
    _promote(r, session, took, parents=took is mine)


def _become(
    r: Reconciler, p: Pass, info: dict[str, Any], host: str, key: str, data: dict[str, Any]
) -> None:
    """Made the fork's in its parent's key (`info`): its key and environment."""
    session = p.session
    drop = json.loads(base64.b64decode(data.get(FORK_DROP) or "W10=").decode())
    env = {**secret_env(r.kube, session), SESSION_VARIABLE: session.name}
    for var in session.spec.env:
        env.setdefault(var.name, var.value)
    names = [d for d in drop if isinstance(d, str)] if isinstance(drop, list) else []
    was = (SESSION_VARIABLE, str((p.status.get("fork") or {}).get("from") or ""))
    # First, in the old key: is it its parent's woken copy (a new kernel, which a node
    # without the handler would start, says the fork's own name)?
    check = run_silently(repr(WOKEN_CHECK), {"WAS": repr(was)})
    _run(info, host, check, info["key"])
    _run(info, host, forks.becoming(key, names, env, was=was), key)  # answered in the new


def _rebound(mine: dict[str, Any], own: dict[str, Any], host: str) -> dict[str, Any]:
    """The kernel, signing with the fork's key (`mine`), given the fork's Curve pair and
    bridge certificate (`own`; kernelside/rebind.py): `own` once it answers in them, or
    `mine` for a kernel that says it cannot take them (an image whose ipykernel lacks
    what is changed), which keeps its parent's. Its channels are bound again, which
    closes the connection the request came on: its reply is not waited for."""
    if own == mine:  # a Secret made by an operator from before rebind.py
        return mine
    names = {"INFO": repr(own)}
    check = run_silently(compiled("rebind"), {**names, "CHECK": "True"})
    request = {"code": check, "silent": True, "store_history": False, "allow_stdin": False}
    said = probe.ask(mine, host, "execute_request", request, ASK_MS)
    if said is None:
        raise Unforkable("it did not say whether it can take transport keys of its own")
    if said.get("status") != "ok":  # its words, the kernel's: at debug only
        log.warning("a fork's kernel keeps its parent's transport keys: it cannot take others")
        log.debug("it said %s: %s", str(said.get("ename"))[:100], str(said.get("evalue"))[:300])
        return mine
    request = {"code": run_silently(compiled("rebind"), names), "silent": True,
               "store_history": False, "allow_stdin": False}  # fmt: skip
    probe.tell(mine, host, "execute_request", request, ASK_MS)
    if probe.answers(own, host, ASK_MS):
        return own
    raise Unforkable("it did not answer in its new transport keys")


def _run(info: dict[str, Any], host: str, code: str, reply_key: str) -> None:
    """Run `code` silently in the kernel; Unforkable unless it says ok, signed with
    `reply_key`."""
    request = {"code": code, "silent": True, "store_history": False, "allow_stdin": False}
    said = probe.ask(info, host, "execute_request", request, ASK_MS, reply_key=reply_key)
    if said is None or said.get("status") != "ok":
        why = "no answer" if said is None else f"{said.get('ename')}: {said.get('evalue')}"
        raise Unforkable(str(why)[:500])


def _promote(r: Reconciler, session: KernelSession, info: dict[str, Any], *, parents: bool) -> None:
    """The fork's keys the Secret's: what gateways and the next kernels read. With
    `parents`, its transport keys are its parent's still, as its kernel holds them
    (FORK_TRANSPORT: its next kernel that does not wake gets its own)."""
    string = {"connection.json": json.dumps(info)}
    gone: dict[str, None] = {FORK_KEY: None, FORK_DROP: None, FORK_KEYS: None}
    if parents:
        string[FORK_TRANSPORT] = "parent"
    else:
        gone[FORK_TRANSPORT] = None
    patch = {"stringData": string, "data": gone}
    r.kube.patch("Secret", session.namespace, secret_name(session), patch)


def _own_keys(r: Reconciler, p: Pass) -> None:
    """Keys of its own in the session's Secret, none of its parent's left."""
    session = p.session
    fresh = r._render(session, None)[0]["stringData"]
    patch = {"stringData": fresh, "data": dict.fromkeys(FORK_DATA)}
    try:
        made = r.kube.patch("Secret", session.namespace, secret_name(session), patch)
    except ApiError as exc:
        if not exc.not_found:
            raise
        return  # none yet: the one made for its next pod has keys of its own
    p.found = replace(p.found, secret=made)


def _failed(r: Reconciler, p: Pass, why: str) -> None:
    """Keys of its own (none of its parent's left in its Secret), and the fork Failed."""
    _own_keys(r, p)
    fork = p.status.get("fork") or {}
    log.warning("%s/%s: fork failed: %s", p.session.namespace, p.session.name, why)
    p.status["fork"] = {**fork, "outcome": FAILED, "at": stamp(p.now), "message": why[:1000]}
