"""The operator stops even while a reconcile waits on API calls still queued on the
reconciler's pool (a real Reconciler; the calls are plain callables, no API is asked)."""

from __future__ import annotations

import threading
from typing import Any

import kubernetes

from mcp_forge.clients.kube import Kube
from mcp_forge.control.reconciler import CALLS, Reconciler
from mcp_forge.settings import Settings

DEADLINE = 30.0


def test_a_reconcile_waiting_on_queued_calls_ends_when_the_operator_stops() -> None:
    reconciler = Reconciler(Kube(kubernetes.client.Configuration()), Settings.from_env())
    gate = threading.Event()
    busy = threading.Semaphore(0)

    def call() -> str:
        busy.release()
        gate.wait(DEADLINE)
        return "done"

    got: dict[str, Any] = {}

    def reconcile() -> None:  # as _children does: calls side by side, all awaited
        try:
            got["results"] = reconciler._at_once(*[call] * (CALLS + 4))
        except Exception as exc:  # an error is an answer too: the reconcile ended
            got["error"] = exc

    waiting = threading.Thread(target=reconcile, daemon=True)
    waiting.start()
    for _ in range(CALLS):  # every thread of the pool busy: four calls still queued
        assert busy.acquire(timeout=DEADLINE)
    stopping = threading.Thread(target=reconciler.close, daemon=True)
    stopping.start()  # the operator stops (kopf's cleanup handler)
    gate.set()
    stopping.join(DEADLINE)
    waiting.join(DEADLINE)
    assert not stopping.is_alive(), "closing the reconciler did not return"
    assert not waiting.is_alive(), "a reconcile waiting on queued calls never ended"
    assert got.get("results") == ["done"] * (CALLS + 4), got
