"""Each namespace with kernels gets a NetworkPolicy that keeps every kernel pod closed.

The operator makes it (render.render_baseline_policy) before a namespace's first session
or pool kernel needs it, looks again before each pool kernel is started or claimed (a
read, side by side with the claim's other reads) and otherwise once per RECHECK: someone
may delete or change it. A write happens only when it is missing or was changed. It
goes when nothing of ours is left in the namespace to keep closed (`release`), so an
uninstall leaves nothing behind.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mcp_forge.api import kernelsession as ks
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.clients.kube import Kube
from mcp_forge.control.render import (
    BASELINE_COMPONENTS,
    BASELINE_POLICY,
    LABEL_COMPONENT,
    render_baseline_policy,
)

log = logging.getLogger(__name__)

# How long a namespace's policy is taken to be there after a look.
RECHECK = 300.0


class Baseline:
    """Ensures the baseline policy per namespace, at most one look per RECHECK each."""

    def __init__(self, kube: Kube, recheck: float = RECHECK) -> None:
        self.kube = kube
        self.recheck = recheck
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def ensure(self, namespace: str, *, look: bool = False) -> None:
        """The namespace's baseline policy, made or restored if need be. Looked at only
        once per RECHECK unless `look`: before a kernel of a pool is started or claimed,
        when it must be there now (it may have been deleted, or the namespace made anew,
        since the last look)."""
        with self._lock:
            recent = time.monotonic() - self._seen.get(namespace, -self.recheck) < self.recheck
            if recent and not look:
                return
        want = render_baseline_policy(namespace)
        current, made = self.kube.ensure(want)
        name = want["metadata"]["name"]
        if made:
            log.info(
                "namespace %s: kernel pods closed by default (NetworkPolicy %s)", namespace, name
            )
        elif _changed(current.get("spec") or {}, want["spec"]):
            log.warning("namespace %s: NetworkPolicy %s was changed; restoring it", namespace, name)
            # A merge patch: null removes what someone added (rules, labels that would
            # narrow the selector), expressions are replaced whole (a list), and the rest
            # is set as it should be.
            spec, selector = current.get("spec") or {}, want["spec"]["podSelector"]
            added = (spec.get("podSelector") or {}).get("matchLabels") or {}
            labels = {**dict.fromkeys(added), **selector["matchLabels"]}
            patch = {
                "spec": {
                    "podSelector": {
                        "matchLabels": labels,
                        "matchExpressions": selector.get("matchExpressions"),
                    },
                    "policyTypes": want["spec"]["policyTypes"],
                    "ingress": None,
                    "egress": None,
                }
            }
            self.kube.patch("NetworkPolicy", namespace, name, patch)
        with self._lock:
            self._seen[namespace] = time.monotonic()

    def release(self, namespace: str) -> bool:
        """Delete the namespace's policy if nothing of ours is left there: no session, no
        pool, no pod it selects (a terminating one counts: it goes with its own event). A
        session or pool made meanwhile makes it again, and a claim always looks first.
        True if it was deleted now."""
        ours = [
            {"app.kubernetes.io/name": "mcp-forge", LABEL_COMPONENT: c} for c in BASELINE_COMPONENTS
        ]
        for kind, labels in ((ks.KIND, None), (ksp.KIND, None), *(("Pod", o) for o in ours)):
            if self.kube.list(kind, namespace, labels=labels, metadata_only=True).get("items"):
                return False
        gone = self.kube.delete("NetworkPolicy", namespace, BASELINE_POLICY)
        with self._lock:  # after the delete: an ensure meanwhile must look again
            self._seen.pop(namespace, None)
        if gone:
            log.info("namespace %s: no kernels left; NetworkPolicy %s removed", namespace,
                     BASELINE_POLICY)  # fmt: skip
        return gone


def _changed(current: dict[str, Any], want: dict[str, Any]) -> bool:
    return (
        (current.get("podSelector") or {}) != want["podSelector"]
        or sorted(current.get("policyTypes") or []) != sorted(want["policyTypes"])
        or bool(current.get("ingress") or current.get("egress"))
    )
