"""What each session's reconcile last wrote or read of its kernel pod and Lease, so that
the watch's events that bring nothing new start no reconcile.

A reconcile that claims or makes a kernel pod, or makes a Lease, writes its status from
what the API server answered; the watch brings the same write a moment later. Beside a
client's first reads of a claimed kernel, a second reconcile (five reads and a list) of
that event cost it tens of ms on 2 cores. So do the kubelet's writes of a starting pod
that change nothing a reconcile acts on (control/pods.py `signature`), beside the new
kernel's own start. Entries are set from the reconcile threads and read in the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.control.pods import signature

Seen = tuple[KernelSession, tuple[Any, ...]]
# When the pod `uid` of a session answered the operator, and at which address, if it has
# (control/answers.py `Answers.of`).
Answered = Callable[[str, str, str | None], tuple[str, str] | None]


class Heard:
    def __init__(self, answered: Answered) -> None:
        self.answered = answered
        # (namespace, session, kind) -> the child's resourceVersion, and of a pod the
        # session and what the reconcile acted on.
        self._last: dict[tuple[str, str, str], tuple[str, Seen | None]] = {}
        # (namespace, session) -> the latest watch event's pod, for `missed`.
        self._latest: dict[tuple[str, str], Mapping[str, Any]] = {}

    def wrote(self, session: KernelSession, child: Mapping[str, Any]) -> None:
        """`child` (its kernel pod, its Lease) is as the session's reconcile just wrote or
        read it: set from that reconcile's thread as soon as the API server answers,
        most often before the watch brings the same write (`news`)."""
        ns, name, kind = session.namespace, session.name, str(child.get("kind") or "Pod")
        meta = child.get("metadata") or {}
        version = str(meta.get("resourceVersion") or "")
        seen: Seen | None = None
        if kind == "Pod":
            answered = self.answered(ns, name, meta.get("uid"))
            seen = (session, signature(session, child, answered))
        self._last[(ns, name, kind)] = (version, seen)

    def news(self, namespace: str, name: str, child: Mapping[str, Any]) -> bool:
        """Whether a watch event of the session's kernel pod or Lease says something its
        reconcile has not seen: not so for the event of its own claim or creation, nor
        for a later version of the pod that a reconcile would act on alike."""
        meta = child.get("metadata") or {}
        if child.get("kind", "Pod") == "Pod":
            self._latest[(namespace, name)] = child
        version, seen = self._last.get(
            (namespace, name, str(child.get("kind") or "Pod")), ("", None)
        )
        if meta.get("resourceVersion") and version == meta.get("resourceVersion"):
            return False
        if seen is None:
            return True
        session, was = seen
        return signature(session, child, self.answered(namespace, name, meta.get("uid"))) != was

    def acted(self, session: KernelSession, pod: Mapping[str, Any] | None) -> None:
        """A reconcile ended having acted on `pod`, or on no pod (it stopped the kernel,
        or waits before starting one): then every pod event is news again."""
        if pod is not None:
            self.wrote(session, pod)
        else:
            self._last[(session.namespace, session.name, "Pod")] = ("", None)

    def missed(self, namespace: str, name: str) -> bool:
        """Whether the latest event of the pod a reconcile just acted on is news to it.
        An event that came while it ran was weighed against the one before: a pod that
        went from A to B and back to A while it read B would be left at B. Only that same
        pod's: another pod's event was news when it came (another uid), and a reconcile
        that acted on no pod has nothing to weigh it against."""
        latest = self._latest.get((namespace, name))
        _, seen = self._last.get((namespace, name, "Pod"), ("", None))
        if latest is None or seen is None:
            return False
        uid = (latest.get("metadata") or {}).get("uid")
        return uid == seen[1][0] and self.news(namespace, name, latest)  # [0]: its uid

    def gone(self, namespace: str, name: str, pod: Mapping[str, Any]) -> None:
        """The session's pod `pod` was deleted: its last event is not kept."""
        latest = self._latest.get((namespace, name))
        uid = (pod.get("metadata") or {}).get("uid")
        if latest is not None and (latest.get("metadata") or {}).get("uid") == uid:
            del self._latest[(namespace, name)]

    def forget(self, namespace: str, name: str) -> None:
        """Nothing is known of the session's children: each next event is news (its
        reconcile failed, or it is gone)."""
        for kind in ("Pod", "Lease"):
            self._last.pop((namespace, name, kind), None)
        self._latest.pop((namespace, name), None)
