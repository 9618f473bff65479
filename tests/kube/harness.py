"""Running the real operator (kopf, in a thread) against the test API, and waiting on it.

The API server runs in the test's event loop (the emulator), so kopf gets a thread and
loop of its own, and every blocking client call goes through `asyncio.to_thread`.
Waiting is on the API's watch streams, under a deadline: never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf

from mcp_forge.kube import Kube

KS = "KernelSession"


class OperatorThread:
    """`kopf.operator()` with our handlers, cluster-wide and standalone, in its own thread."""

    def __init__(self) -> None:
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kopf", daemon=True)

    def _main(self) -> None:
        import mcp_forge.controller  # noqa: F401  (registers the handlers)

        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True  # no CRD/namespace scanning: watch what is declared
        settings.posting.enabled = False
        try:
            asyncio.run(
                kopf.operator(
                    registry=kopf.get_default_registry(),
                    settings=settings,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                )
            )
        except BaseException as exc:  # shown by the test that stops it
            self.error = exc

    async def start(self, kube: Kube, timeout: float = 20.0) -> None:
        self._thread.start()
        if not await asyncio.to_thread(self.ready_flag.wait, timeout):
            raise TimeoutError("kopf did not get ready")

    async def stop(self, timeout: float = 30.0) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            raise TimeoutError("kopf did not stop")


@contextlib.asynccontextmanager
async def running_operator(kube: Kube) -> AsyncIterator[OperatorThread]:
    op = OperatorThread()
    await op.start(kube)
    try:
        yield op
    finally:
        await op.stop()


async def eventually(
    kube: Kube,
    kind: str,
    namespace: str,
    name: str,
    check: Callable[[dict[str, Any] | None], bool],
    *,
    timeout: float = 15.0,
    what: str = "",
) -> dict[str, Any] | None:
    """The object once `check(object or None)` holds; woken by each watch event on it."""
    deadline = time.monotonic() + timeout
    while True:
        obj = await asyncio.to_thread(kube.get, kind, namespace, name)
        if check(obj):
            return obj
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{kind} {namespace}/{name}: {what or 'condition'} not met; {obj}")
        rv = "0"
        if obj is not None:
            rv = str(obj["metadata"]["resourceVersion"])
        else:
            listed = await asyncio.to_thread(kube.list, kind, namespace)
            rv = str(listed["metadata"].get("resourceVersion") or "0")
            if any(i["metadata"]["name"] == name for i in listed.get("items") or []):
                continue  # it appeared between the get and the list
        await asyncio.to_thread(_next_event, kube, kind, namespace, name, rv, min(left, 2.0))


def _next_event(kube: Kube, kind: str, namespace: str, name: str, rv: str, timeout: float) -> None:
    for _ in kube.watch(kind, namespace, resource_version=rv, name=name, timeout=timeout):
        return


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def phase(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("status") or {}).get("phase")


def session_body(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": KS,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def running_status(pod_ip: str = "10.88.0.7") -> dict[str, Any]:
    """What a kubelet reports for a kernel that runs."""
    return {
        "phase": "Running",
        "podIP": pod_ip,
        "containerStatuses": [
            {
                "name": "kernel",
                "ready": True,
                "restartCount": 0,
                "image": "localhost/mcp-forge-kernel:0.1.0",
                "imageID": "",
                "state": {"running": {"startedAt": "2026-11-29T20:00:00Z"}},
            }
        ],
    }


def terminated_status(exit_code: int, reason: str) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "kernel",
                "ready": False,
                "restartCount": 0,
                "image": "localhost/mcp-forge-kernel:0.1.0",
                "imageID": "",
                "state": {"terminated": {"exitCode": exit_code, "reason": reason}},
            }
        ],
    }
