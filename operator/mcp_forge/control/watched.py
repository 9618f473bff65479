"""Pools and their kernels as the operator's watches last showed them, so that a claim
need not read them first.

A fresh session's claim read its pool and the pool's kernel pods (two calls) before it
could patch one: on a 2-core node those reads took 20-30 ms of a warm claim's ~100 ms
beside the session's creates. kopf already watches both (handlers.pool_event and
pool_kernel_event): each event is kept here, and `PoolKeeper.claim` starts from it.

Nothing is trusted that matters: a kernel shown here that was claimed since, or is gone,
is refused to the claim by its resourceVersion (409) or its absence (404); when nothing
here could be claimed, the claim reads the pool and its kernels afresh, as before. A kernel
found gone is dropped, and so is one that a read of the pool's kernels (the claim's, the
pool's reconcile's) no longer has: kopf, listing again after a broken watch, tells no
deletions. A pool found empty is read afresh by the next claim.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

from mcp_forge.api import kernelsessionpool as ksp

Body = dict[str, Any]


def kept(body: Mapping[str, Any]) -> Body:
    """A copy of a watch event's object without its managedFields (kopf's body is a view
    that a later event of the same object replaces; managedFields are most of a pod's
    size and nothing reads them)."""
    kept = copy.deepcopy({k: body[k] for k in body})
    meta = kept.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return kept


def _pool_of(pod: Body) -> str | None:
    label: str | None = (pod["metadata"].get("labels") or {}).get(ksp.LABEL_POOL)
    return label


class Watched:
    """Written from kopf's event handlers (the loop), read from reconcile threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, str], Body] = {}
        # namespace -> pod name -> a pool's kernel (one that carries a pool's label)
        self._kernels: dict[str, dict[str, Body]] = {}

    def saw(self, type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a KernelSessionPool or of a kernel pod (any: one claimed
        since carries no pool label and is dropped)."""
        meta = body.get("metadata") or {}
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        if body.get("kind") == ksp.KIND:
            pool = kept(body) if type != "DELETED" else None
            with self._lock:
                if pool is None:
                    self._pools.pop((ns, name), None)
                else:
                    self._pools[(ns, name)] = pool
            return
        member = ksp.LABEL_POOL in (meta.get("labels") or {}) and type != "DELETED"
        shown = kept(body) if member else None
        with self._lock:
            kernels = self._kernels.setdefault(ns, {})
            if shown is not None:
                kernels[name] = shown
            else:
                kernels.pop(name, None)
                if not kernels:
                    del self._kernels[ns]

    def pool(self, namespace: str, name: str) -> tuple[Body, list[Body]] | None:
        """The pool and its kernels (label pool=<name>) as last shown; None if no event
        of that pool has come (it is read then)."""
        with self._lock:
            body = self._pools.get((namespace, name))
            if body is None:
                return None
            kernels = [
                pod for pod in self._kernels.get(namespace, {}).values() if _pool_of(pod) == name
            ]
        return body, kernels

    def listed(self, namespace: str, pool: str, pods: list[Body]) -> None:
        """The pool's kernels as a read of the API server just gave them: one the watch
        never said was deleted (kopf, listing again after a broken watch, tells no
        deletions) goes. One made since the read goes too, until its next event: it
        is only not offered to a claim."""
        there = {p["metadata"]["name"] for p in pods}
        with self._lock:
            kernels = self._kernels.get(namespace, {})
            for name in [n for n, p in kernels.items() if _pool_of(p) == pool]:
                if name not in there:
                    del kernels[name]
            self._tidy(namespace)

    def gone(self, namespace: str, name: str) -> None:
        """A kernel a claim found gone (404)."""
        with self._lock:
            self._kernels.get(namespace, {}).pop(name, None)
            self._tidy(namespace)

    def dropped(self, namespace: str, pool: str) -> None:
        """A pool its reconcile found gone, with its kernels (a watch may not have said)."""
        self.listed(namespace, pool, [])
        self.forget(namespace, pool)

    def _tidy(self, namespace: str) -> None:
        if not self._kernels.get(namespace, True):
            del self._kernels[namespace]

    def forget(self, namespace: str, name: str) -> None:
        """The pool as shown here was wrong (a claim found nothing of it): read next."""
        with self._lock:
            self._pools.pop((namespace, name), None)
