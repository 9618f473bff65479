"""Events on KernelSessions, for `kubectl describe` and whoever watches Events: what a
person would want to know happened (its kernel pod made, Ready, restarted and why, an
OOM kill with the limit, suspended, resumed, claimed from a pool, failed), decided from
the status the operator writes (`changes`: pure) and written as core/v1 Events.

Written as client-go's event recorder writes them: an Event per (object, type, reason,
message), named from them, its `count` and `lastTimestamp` bumped when it happens
again; at most BURST per object, then one per REFILL seconds (client-go's spam filter).
Messages come from the status, which holds no secret. An Event that cannot be written
is logged and dropped: it never holds a reconcile up.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import API_VERSION
from mcp_forge.clients.kube import Kube
from mcp_forge.errors import ApiError

log = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"
# A reconcile that failed and will be tried again: counted apart, so a session failing for
# long never uses up the Warnings its kernel's death or an OOM kill would need.
RECONCILE_ERROR = "ReconcileError"
COMPONENT = "mcp-forge-operator"
BURST = 25  # Events per object at once
REFILL = 300.0  # then one per this many seconds
REMEMBERED = 4096  # Events whose count is kept in memory
MESSAGE_MAX = 1024
# An Event is written this long after it was recorded: a claim's come at once would be
# beside the client's first reads of its kernel, on an API server with 2 cores.
DELAY = 0.3

Change = tuple[str, str, str]  # type, reason, message


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The Events a session's status going from `old` to `new` deserves."""
    found: list[Change] = []
    died, last = new.get("lastTermination") or {}, old.get("lastTermination") or {}
    death = bool(died) and (died.get("at"), died.get("kernelId")) != (
        last.get("at"),
        last.get("kernelId"),
    )
    if death:
        why = str(died.get("message") or died.get("reason") or "the kernel ended")
        kind = "OOMKilled" if died.get("reason") == "OOMKilled" else "KernelDied"
        found.append((WARNING, kind, why))
    claimed = _warm(new)
    if claimed is not None and claimed != _warm(old):
        found.append((NORMAL, "Claimed", claimed))
    was, phase = old.get("phase"), new.get("phase")
    reason, message = str(new.get("reason") or ""), str(new.get("message") or "")
    moved = phase != was or (phase in (st.RESTARTING, st.FAILED) and reason != old.get("reason"))
    if not moved or not phase:
        return found
    if phase == st.STARTING and new.get("podName") and new.get("podName") != old.get("podName"):
        found.append((NORMAL, "Resumed" if was == st.SUSPENDED else "Starting",
                      f"kernel pod {new['podName']} made"))  # fmt: skip
    elif phase == st.READY:
        found.append((NORMAL, "Ready", message or "the kernel answered"))
    elif phase == st.RESTARTING and not death:  # a death says why itself
        asked = reason in (st.RESTART_REQUESTED, st.UPDATING)  # else a death's, a back-off's
        kind = NORMAL if asked else WARNING
        found.append((kind, reason or "Restarting", message or "a new kernel is coming"))
    elif phase == st.SUSPENDED:
        found.append((NORMAL, "Suspended", message or reason))
    elif phase == st.FAILED:
        found.append((WARNING, reason or "Failed", message or "the session failed"))
    elif phase == st.EXPIRED:
        found.append((NORMAL, "Expired", message or "past its maxLifetime"))
    return found


def _warm(status: Mapping[str, Any]) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "WarmStart" and c.get("status") == "True":
            return str(c.get("message") or "its kernel came from a pool")
    return None


class Recorder:
    """Writes Events in a thread of its own, in the order they were recorded, as
    client-go's broadcaster does: a reconcile never waits on them."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.instance = os.environ.get("HOSTNAME", "") or "mcp-forge-operator"
        self._counts: OrderedDict[str, int] = OrderedDict()  # by Event name
        self._tokens: dict[str, tuple[float, float]] = {}  # by "uid/type": (tokens, at)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "mcp-forge-events")
        self._closing = threading.Event()

    def record(self, obj: Mapping[str, Any], found: list[Change]) -> None:
        """Write the Events `found` for `obj`, after those recorded before, DELAY from now
        (at once when closing); returns at once."""
        if found:
            due = time.monotonic() + DELAY
            try:
                self._writer.submit(self._write, dict(obj), list(found), due)
            except RuntimeError:  # closed: the operator is stopping
                log.info("event %s on %s not written: stopping", found[0][1],
                         obj["metadata"]["name"])  # fmt: skip

    def close(self) -> None:
        """Write what was recorded (bounded by the API's timeouts), then stop."""
        self._closing.set()
        self._writer.shutdown(wait=True)

    def _write(self, obj: Mapping[str, Any], found: list[Change], due: float) -> None:
        self._closing.wait(max(0.0, due - time.monotonic()))  # a delay, cut short by close
        for type_, reason, message in found:
            try:
                self._one(obj, type_, reason, message[:MESSAGE_MAX])
            except ApiError as exc:
                log.warning("event %s on %s not written: %s", reason, obj["metadata"]["name"], exc)
            except Exception:  # a thread of its own: nobody else would hear of it
                log.exception("event %s on %s not written", reason, obj["metadata"]["name"])

    def _allowed(self, uid: str) -> bool:
        now = time.monotonic()
        tokens, at = self._tokens.get(uid, (float(BURST), now))
        tokens = min(float(BURST), tokens + (now - at) / REFILL)
        if tokens < 1:
            self._tokens[uid] = (tokens, now)
            return False
        self._tokens[uid] = (tokens - 1, now)
        if len(self._tokens) > REMEMBERED:
            self._tokens.pop(next(iter(self._tokens)))
        return True

    def _one(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        uid = str(meta.get("uid") or "")
        bucket = (
            f"{uid}/{type_}/{RECONCILE_ERROR}" if reason == RECONCILE_ERROR else f"{uid}/{type_}"
        )
        if not self._allowed(bucket):  # a busy pool's Normal ones spare its Warnings
            return
        digest = hashlib.sha256(f"{uid}\0{type_}\0{reason}\0{message}".encode()).hexdigest()
        name = f"{meta['name']}.{digest[:16]}"
        now = st.stamp()
        count = self._counts.pop(name, 0)
        if count == 0:
            try:
                self.kube.create(self._event(obj, name, type_, reason, message, now))
                self._remember(name, 1)
                return
            except ApiError as exc:
                if not exc.conflict:
                    raise
            there = self.kube.get("Event", meta["namespace"], name) or {}
            count = int(there.get("count") or 1)
        # It happened again: counted on the Event it already has.
        patch = {"count": count + 1, "lastTimestamp": now}
        self.kube.patch("Event", meta["namespace"], name, patch)
        self._remember(name, count + 1)

    def _event(
        self, obj: Mapping[str, Any], name: str, type_: str, reason: str, message: str, now: str
    ) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": obj.get("kind", "KernelSession"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": str(meta.get("uid") or ""),
            },
            "type": type_,
            "reason": reason[:128],
            "message": message,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance[:128],
        }

    def _remember(self, name: str, count: int) -> None:
        self._counts[name] = count
        while len(self._counts) > REMEMBERED:
            self._counts.popitem(last=False)
