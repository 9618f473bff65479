"""Each namespace with kernels gets a NetworkPolicy that keeps every kernel pod closed.

The operator makes it (render.render_baseline_policy) before a namespace's first session
or pool kernel needs it, and looks again now and then: someone may delete it. A look is
one read; a write happens only when it is missing or was changed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mcp_forge.clients.kube import Kube
from mcp_forge.control.render import render_baseline_policy

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

    def ensure(self, namespace: str) -> None:
        with self._lock:
            if time.monotonic() - self._seen.get(namespace, -self.recheck) < self.recheck:
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
            # A merge patch: null removes any rule someone added.
            patch = {"spec": {**want["spec"], "ingress": None, "egress": None}}
            self.kube.patch("NetworkPolicy", namespace, name, patch)
        with self._lock:
            self._seen[namespace] = time.monotonic()


def _changed(current: dict[str, Any], want: dict[str, Any]) -> bool:
    return (
        current.get("podSelector") != want["podSelector"]
        or sorted(current.get("policyTypes") or []) != sorted(want["policyTypes"])
        or bool(current.get("ingress") or current.get("egress"))
    )
