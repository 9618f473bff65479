"""What a kernel Pod's status says about its KernelSession. Pure: no I/O.

For the Kubernetes operator (and a gateway in cluster mode): the kubelet reports the
kernel container's state; this turns it into the session's phase, its Ready condition
and, when the kernel died, a Termination named as local mode names it (OOMKilled with
the memory limit, a signal, an exit code). The operator decides what to do with it
(control/lifecycle.py, control/reconciler.py); this module only reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import Termination, termination_of
from mcp_forge.control.render import CONTAINER

# Waiting reasons that will not fix themselves: the session has failed until its spec changes.
STUCK = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


ANSWERED = "the kernel answered the operator"
PROBED = "the kernel answered its startup probe"


@dataclass(frozen=True)
class Observation:
    phase: str  # Pending, Starting, Ready, Restarting, Failed
    reason: str
    message: str
    termination: Termination | None = None
    started_at: str | None = None
    pod_ip: str | None = None

    @property
    def ready(self) -> bool:
        return self.phase == st.READY


def dead(session: KernelSession, term: Termination, pod_ip: str | None = None) -> Observation:
    """A session whose kernel died: Restarting if restartPolicy starts another, else Failed
    (on a cluster and locally alike)."""
    phase = st.RESTARTING if session.spec.restart_policy == "Always" else st.FAILED
    return Observation(phase, term.reason, term.message, term, None, pod_ip)


def kernel_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The kernel container's status as the kubelet reports it ({} if none yet)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if isinstance(status, Mapping) and status.get("name") == CONTAINER:
            return status
    return {}


def _transient(message: str) -> bool:
    """A kubelet error that passes by itself: its Secret and ConfigMap caches wait at most a
    second for a new reflector to sync ("failed to sync secret cache: timed out waiting for
    the condition", kubelet's watch_based_manager.go) and the pod worker tries again about
    10 s later. A busy node shows it for an env var from a Secret, which every cluster
    kernel has (its connection). The session stays Starting, under its progress deadline."""
    return message.startswith("failed to sync ") and " cache" in message


def observe(
    session: KernelSession,
    pod: Mapping[str, Any] | None,
    answered: tuple[str, str] | None = None,
) -> Observation:
    """The session as its kernel Pod shows it (None: there is no Pod). `answered`: when
    the pod's kernel answered the operator's own kernel_info (control/answers.py), which
    is Ready before the kubelet's startupProbe says so, and at which address: Ready
    carries one even when the pod was read from a cache that does not show it yet."""
    if pod is None:
        return Observation(st.PENDING, st.POD_MISSING, "the kernel's pod does not exist yet")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return Observation(st.RESTARTING, "PodTerminating", "the kernel's pod is being deleted")
    status = pod.get("status") or {}
    pod_ip = status.get("podIP") if isinstance(status.get("podIP"), str) else None
    state = kernel_status(pod).get("state") or {}
    if answered is not None and "terminated" not in state and status.get("phase") != "Failed":
        when, address = answered
        return Observation(st.READY, st.KERNEL_READY, ANSWERED, None, when, pod_ip or address)
    if "running" in state:
        # Ready (its startupProbe passed, and the kubelet has said so in full): not merely
        # started, which the kubelet writes one status update earlier.
        if not kernel_status(pod).get("ready"):
            why = "the kernel runs; it has not answered yet"
            return Observation(st.STARTING, "KernelStarting", why, None, None, pod_ip)
        # startedAt is when the kernel answered (idleness counts from it): the pod's
        # ContainersReady transition, else (an older kubelet) when the process started.
        answered = next(
            (
                c.get("lastTransitionTime")
                for c in status.get("conditions") or []
                if c.get("type") == "ContainersReady" and c.get("status") == "True"
            ),
            None,
        )
        started = answered or (state.get("running") or {}).get("startedAt")
        return Observation(st.READY, st.KERNEL_READY, PROBED, None, started, pod_ip)
    if "terminated" in state:
        ended = state.get("terminated") or {}
        code = ended.get("exitCode")
        term = termination_of(
            code if isinstance(code, int) else None,
            oom=ended.get("reason") == "OOMKilled",
            memory_limit=session.spec.memory,
        )
        if status.get("reason") == st.EVICTED:  # the kubelet's words: which limit, how much
            why = str(status.get("message") or "").strip()[:500] or "no reason given"
            term = Termination(st.EVICTED, term.exit_code, f"the kernel's pod was evicted: {why}")
        return dead(session, term, pod_ip)
    waiting = state.get("waiting") or {}
    reason = str(waiting.get("reason") or status.get("reason") or "ContainerCreating")
    message = str(waiting.get("message") or status.get("message") or "the kernel is starting")
    if reason in STUCK and not _transient(message):
        return Observation(st.FAILED, reason, message[:1000], None, None, pod_ip)
    if status.get("phase") == "Failed":
        return Observation(st.FAILED, reason, message[:1000], None, None, pod_ip)
    for cond in status.get("conditions") or []:  # not placed: no node fits, a missing PVC
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            why = str(cond.get("message") or "the pod cannot be scheduled")
            return Observation(st.STARTING, str(cond.get("reason") or "Unschedulable"), why[:1000])
    return Observation(st.STARTING, reason, message[:1000], None, None, pod_ip)


def signature(
    session: KernelSession, pod: Mapping[str, Any], answered: tuple[str, str] | None
) -> tuple[Any, ...]:
    """All a reconcile acts on in a kernel pod: which pod it is (uid, name, owners,
    labels, annotations, node, being deleted), its phase and addresses, and what
    `observe` makes of its state. Two
    versions of a pod with one signature lead to the same reconcile: the kubelet's
    writes of a starting pod that change neither (a condition that only it reads, its
    host's IP, a start time) are not worth one."""
    meta = pod.get("metadata") or {}
    owners = sorted(
        (str(r.get("uid")), bool(r.get("controller"))) for r in meta.get("ownerReferences") or []
    )
    return (
        meta.get("uid"),
        meta.get("name"),
        meta.get("deletionTimestamp"),
        tuple(sorted((meta.get("labels") or {}).items())),
        tuple(sorted((meta.get("annotations") or {}).items())),
        tuple(owners),
        (pod.get("spec") or {}).get("nodeName"),
        (pod.get("status") or {}).get("phase"),
        repr((pod.get("status") or {}).get("podIPs")),  # an egress grant's addresses
        observe(session, pod, answered),
    )


def owned_by(obj: Mapping[str, Any], session: KernelSession) -> bool:
    """Whether a child the operator made for `session` (a helper pod, a claim) is this
    session's, not an earlier one's of the same name (a session with no uid: any)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return not session.uid or any(ref.get("uid") == session.uid for ref in refs)


def ended_message(pod: Mapping[str, Any], limit: int) -> str:
    """What a helper pod's container said as it ended (its termination message, else its
    exit code), or the pod's own message: at most `limit` characters, its end kept."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        ended = (status.get("state") or {}).get("terminated") or {}
        if ended:
            text = str(ended.get("message") or "").strip() or f"exit {ended.get('exitCode')}"
            return text[-limit:]
    return str((pod.get("status") or {}).get("message") or "its pod failed")[:limit]
