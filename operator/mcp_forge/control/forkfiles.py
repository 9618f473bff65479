"""A fork's workspace on a cluster (issue 27): a copy of its parent's persistent workspace,
made before its first kernel wakes (control/forking.py).

Once the parent's kernel is checkpointed, a pod of the fork's own (`<pod>-fork-files`,
owned by the fork) mounts the parent's PersistentVolumeClaim read-only and the fork's
own, and copies the one into the other with the Python of the fork's image
(kernelside/treecopy.py: no other tool of the image is needed), as the kernel's user,
with the kernel pod's confinement (its user namespace, seccomp profile, runtime class;
no capability, no service account token, a read-only root; the namespace's baseline
NetworkPolicy selects it). It runs on the node the fork wakes on (a
ReadWriteOnce claim is mounted on one node at a time). Links are copied as links, never
followed; FIFOs and sockets are made anew, never opened; a file's contents are never
read but to be copied; what a copy made again finds is replaced, never written through.

The copy is taken after the checkpoint, while the parent runs on, held (forking.py
`_hold`): no gateway starts a call of the parent's until the copy has ended (`_let_go`),
so a call does not show in the fork's files. What the parent's kernel does by itself
meanwhile (a thread writing) may, and a file the woken kernel holds open that has changed
since its checkpoint makes the restore fail (CRIU checks its size and mode; the fork then
starts afresh, its files copied). `status.fork.workspace` says how it went:
Copied, Failed (the message names why: the fork wakes on what was copied), or NotCopied
(no persistent workspace on either side, or its parent's memory not forked). A copy
that has not started COPY_DEADLINE after its pod was made, or not ended twice that, is
given up (the kubelet ends one running past COPY_DEADLINE); no kernel pod is made until
its pod has stopped (`stopping`), or is STOP_DEADLINE old.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Any

from mcp_forge.api import forks
from mcp_forge.api.kernelsession import KIND, KernelSession, load
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.control.pods import ended_message, owned_by
from mcp_forge.control.render import (
    CONTAINER,
    FORK_FILES,
    LABEL_COMPONENT,
    child_name,
    workspace_claim_name,
)
from mcp_forge.errors import ApiError
from mcp_forge.kernelside import source

if TYPE_CHECKING:
    from mcp_forge.control.realize import Pass
    from mcp_forge.control.reconciler import Reconciler

log = logging.getLogger(__name__)

COPIED, FAILED, NOT_COPIED = "Copied", "Failed", "NotCopied"
COPY_DEADLINE = 600  # seconds: to start (its activeDeadlineSeconds bounds it from then)
STOP_DEADLINE = 3 * COPY_DEADLINE  # a copy given up on is waited for until this old
RECHECK = 1.0  # its pod's events do not reach the fork's reconcile: looked at this often
MESSAGE_MAX = 500
LIMITS = {"cpu": "250m", "memory": "128Mi"}
# Each entry of the parent's workspace (not its root: the fork's is its own, made by the
# kubelet; nor ext4's lost+found, root's) copied by the image's Python (kernelside/
# treecopy.py: contents, modes, times and hard links; links as links, special files made
# anew, nothing followed or written through). The owner is the copier's, the kernel's user.
COMMAND = ["python", "-I", "-S", "-c", source("treecopy"), "/from", "/to"]


def pod_name(session: KernelSession) -> str:
    return f"{child_name(session)}-{FORK_FILES}"


def step(r: Reconciler, p: Pass) -> str | None:
    """The fork's workspace copied before its first kernel pod: why it waits, or None
    once the copy ended (or none is to be made), `status.fork.workspace` written. No
    kernel pod is made while a copy may still write (`stopping`)."""
    fork = p.status.get("fork") or {}
    done = fork.get("workspace") or {}
    if not fork or (done and not done.get("stopping")):
        return None
    ns, parent_name = p.session.namespace, str(fork.get("from") or "")
    pod = r.kube.get("Pod", ns, pod_name(p.session))
    if pod is not None and not owned_by(pod, p.session):
        _delete(r, pod)  # an earlier session's of that name, not collected yet
        return _wait(p, "waiting for the copy pod of an earlier session of that name to go")
    made = parse_time((pod or {}).get("metadata", {}).get("creationTimestamp")) or p.now
    if done:  # given up on: its pod deleted, its cp perhaps still writing
        if pod is not None and not _stopped(pod) and p.now - made < STOP_DEADLINE:
            return _wait(p, "waiting for the copy of the workspace to stop")
        _ended(r, p, done["outcome"], done["message"])
        return None
    if pod is None:
        parent, why = _parent(r, p.session, fork)
        if parent is None:
            _ended(r, p, NOT_COPIED, why)
            return None
        node = (p.status.get("snapshot") or {}).get("node")
        r.kube.ensure(render(p.found.want_pod, p.session, parent, node), likely_new=True)
        return _wait(p, f"copying the workspace of {parent_name}")
    # A copy under way is seen to its end, whatever became of the fork meanwhile.
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Succeeded":
        outcome, message = COPIED, f"copied from {parent_name}'s workspace"
    elif phase == "Failed":  # its activeDeadlineSeconds past, too
        outcome, message = (
            FAILED,
            f"the copy of {parent_name}'s workspace failed: {ended_message(pod, MESSAGE_MAX)}",
        )
    elif phase == "Pending" and p.now - made > COPY_DEADLINE:
        outcome, message = FAILED, f"the copy did not start within {COPY_DEADLINE}s"
    elif p.now - made > 2 * COPY_DEADLINE:  # its node lost, say: no kubelet ends it
        outcome, message = FAILED, f"the copy did not end within {2 * COPY_DEADLINE}s"
    else:  # running (or going: once gone, it is made again, and copies over)
        return _wait(p, f"copying the workspace of {parent_name}")
    if outcome == FAILED:
        message += ": the fork wakes on what was copied"
    stopping = not _stopped(pod)
    _ended(r, p, outcome, message, stopping=stopping)  # first: then no copy is made again
    _delete(r, pod)
    return _wait(p, "waiting for the copy of the workspace to stop") if stopping else None


def _wait(p: Pass, why: str) -> str:
    p.due.append(p.now + RECHECK)
    return why


def _stopped(pod: dict[str, Any]) -> bool:
    """Whether none of the pod's containers runs, or will (each has ended)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Succeeded":
        return True
    containers = status.get("containerStatuses") or []
    return bool(containers) and all((c.get("state") or {}).get("terminated") for c in containers)


def _parent(
    r: Reconciler, session: KernelSession, fork: dict[str, Any]
) -> tuple[KernelSession | None, str]:
    """The parent whose workspace is copied, or None and why none is."""
    name = str(fork.get("from") or "")
    if fork.get("outcome") == "Forked":  # woken by an operator that made no copies
        return None, "it woke before forks' workspaces were copied"
    if fork.get("outcome") != "Restoring":
        return None, "its parent's memory was not forked"
    if not session.spec.persistent:
        return None, "the fork's workspace is not persistent"
    body = r.kube.get(KIND, session.namespace, name)
    if body is None:
        return None, f"no session {name!r}"
    parent = load(body)
    if not parent.spec.persistent:
        return None, f"{name}'s workspace is not persistent (its pod's own)"
    if r.kube.get("PersistentVolumeClaim", session.namespace, workspace_claim_name(parent)) is None:
        return None, f"{name}'s workspace claim is gone"
    return parent, ""


def _delete(r: Reconciler, pod: dict[str, Any] | None) -> None:
    if pod is not None and not pod["metadata"].get("deletionTimestamp"):
        meta = pod["metadata"]
        r.kube.delete("Pod", meta["namespace"], meta["name"], uid=meta.get("uid"))


def _ended(r: Reconciler, p: Pass, outcome: str, message: str, *, stopping: bool = False) -> None:
    """Written at once: a pass that fails after it does not copy again. `stopping`: its
    pod may still write, and is waited for before the fork's kernel."""
    done: dict[str, Any] = {"outcome": outcome, "message": message, "at": stamp(p.now)}
    if stopping:
        done["stopping"] = True
    fork = {**p.status["fork"], "workspace": done}
    p.status["fork"] = fork
    r.kube.patch(KIND, p.session.namespace, p.session.name, {"status": {"fork": fork}}, status=True)
    log.info("%s/%s: workspace %s (%s)", p.session.namespace, p.session.name, outcome, message)
    if p.session.spec.persistent and not stopping:
        let_go(r, p.session.namespace, p.session.name, p.session.uid, str(fork.get("from") or ""))


def let_go(r: Reconciler, namespace: str, fork: str, uid: str, parent: str) -> None:
    """The parent's hold for this fork (forking.py `_hold`), if it has one, let go: its
    calls run again. Also as the fork is deleted (handlers.py)."""
    if not parent:
        return
    try:
        body = r.kube.get(KIND, namespace, parent)
        mine = forks.live_holds((body or {}).get("status") or {}, time.time()).get(fork) or {}
        if body is None or mine.get("uid") != uid:
            return
        patch = {"status": {forks.HOLDS: {fork: None}}}
        r.kube.patch(KIND, namespace, parent, patch, status=True)
    except ApiError as exc:  # its hold lapses (HOLD_FOR); gateways ignore it once done
        log.warning("%s/%s: could not let %s go: %s", namespace, fork, parent, exc)


def render(
    kernel_pod: dict[str, Any],
    session: KernelSession,
    parent: KernelSession,
    node: str | None = None,
) -> dict[str, Any]:
    """The copy's pod, confined as the fork's kernel pod (`kernel_pod`, as rendered) is:
    the same user, user namespace, seccomp profile and runtime class; on `node`, where
    the fork wakes (a ReadWriteOnce claim that attaches elsewhere would not mount)."""
    kernel = kernel_pod["spec"]["containers"][0]
    assert kernel["name"] == CONTAINER
    meta = copy.deepcopy(kernel_pod["metadata"])
    meta["name"] = pod_name(session)
    meta["labels"][LABEL_COMPONENT] = FORK_FILES  # not a kernel: no watch of kernels sees it
    meta.pop("annotations", None)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": COPY_DEADLINE,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "securityContext": copy.deepcopy(kernel_pod["spec"]["securityContext"]),
        "containers": [
            {
                "name": "copy",
                "image": kernel["image"],
                "imagePullPolicy": kernel.get("imagePullPolicy", "IfNotPresent"),
                "command": list(COMMAND),
                "workingDir": "/",
                "resources": {"limits": dict(LIMITS), "requests": dict(LIMITS)},
                "securityContext": {
                    **copy.deepcopy(kernel["securityContext"]),
                    "readOnlyRootFilesystem": True,
                },
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": [
                    {"name": "from", "mountPath": "/from", "readOnly": True},
                    {"name": "to", "mountPath": "/to"},
                ],
            }
        ],
        "volumes": [
            {
                "name": "from",
                "persistentVolumeClaim": {
                    "claimName": workspace_claim_name(parent),
                    "readOnly": True,
                },
            },
            {"name": "to", "persistentVolumeClaim": {"claimName": workspace_claim_name(session)}},
        ],
    }
    for key in ("hostUsers", "runtimeClassName"):
        if key in kernel_pod["spec"]:
            spec[key] = kernel_pod["spec"][key]
    if node:
        on = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        spec["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [on]}}
        }  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
