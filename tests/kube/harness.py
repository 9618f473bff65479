"""Running the real operator (kopf, in a thread) against the test cluster, and waiting on it.

kopf gets a thread and loop of its own, as `mcp-forge operator` would have a process, and
every blocking client call goes through `asyncio.to_thread`. Waiting is on the API's watch
streams, under a deadline: never a sleep. Kernels are real: `kernel` connects to one over
its own ZMQ channels at its pod IP, as a gateway does (the host reaches pod IPs).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf

from mcp_forge.api.connection import BRIDGE_PORT, Address, ConnectionInfo, connection_from_file
from mcp_forge.api.keys import BridgeCert
from mcp_forge.clients.kube import Kube, connection_file_of
from mcp_forge.control.events import RECONCILE_ERROR
from mcp_forge.errors import ApiError
from mcp_forge.gateway import introspection
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import Collector

KS = "KernelSession"
KERNEL_DEADLINE = 60.0


class OperatorThread:
    """`kopf.operator()` with our handlers, cluster-wide and standalone, in its own thread."""

    def __init__(self) -> None:
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kopf", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # raised again by stop(): a crash fails the test
            self.error = exc
        finally:
            self.ready_flag.set()  # wake a start() still waiting; it checks what happened

    async def _serve(self) -> None:
        import mcp_forge.control.handlers  # noqa: F401  (registers the handlers)

        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True  # no CRD/namespace scanning: watch what is declared
        settings.posting.enabled = False
        await kopf.operator(
            registry=kopf.get_default_registry(),
            settings=settings,
            standalone=True,
            clusterwide=True,
            stop_flag=self.stop_flag,
            ready_flag=self.ready_flag,
        )

    def _check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the operator crashed: {self.error!r}") from self.error

    async def start(self, kube: Kube, timeout: float = 20.0) -> None:
        self._thread.start()
        if not await asyncio.to_thread(self.ready_flag.wait, timeout):
            raise TimeoutError("kopf did not get ready")
        self._check()
        if not self._thread.is_alive():
            raise AssertionError("the operator stopped as soon as it started")

    async def stop(self, timeout: float = 90.0) -> None:
        """Stop it; an operator that crashed meanwhile fails the test here.

        Its loop ends once the API calls in flight end, each within the client's 30 s
        timeout: a loaded API server may take that long, so the bound is a few of them.
        """
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"kopf did not stop in {timeout:.0f}s; threads:\n{_stacks()}")
        self._check()


def _stacks() -> str:
    """Every thread's stack, to name what an operator that will not stop is waiting on."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


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
    """The object once `check(object or None)` holds: read, then checked at each watch
    event on it as the event brings it (read again only when a watch ends)."""
    deadline = time.monotonic() + timeout
    while True:
        obj = await asyncio.to_thread(kube.get, kind, namespace, name)
        if check(obj):
            return obj
        left = deadline - time.monotonic()
        if left <= 0:
            said = f"{kind} {namespace}/{name}: {what or 'condition'} not met; {obj}"
            if ((obj or {}).get("status") or {}).get("reason") == "Unschedulable":
                said += "\n" + await asyncio.to_thread(_node_holders)
            raise AssertionError(said)
        rv = "0"
        if obj is not None:
            rv = str(obj["metadata"]["resourceVersion"])
        else:
            listed = await asyncio.to_thread(kube.list, kind, namespace)
            rv = str(listed["metadata"].get("resourceVersion") or "0")
            if any(i["metadata"]["name"] == name for i in listed.get("items") or []):
                continue  # it appeared between the get and the list
        met = await asyncio.to_thread(
            _watch_for, kube, kind, namespace, name, rv, min(left, 10.0), check
        )
        if met:
            return met[0]


def _node_holders() -> str:
    """What holds the node's CPU: every pod not yet ended, with its requests (an
    Unschedulable session is most often one that a test's leftovers crowd out)."""
    import kubernetes

    ended = "status.phase!=Succeeded,status.phase!=Failed"
    api = kubernetes.client.CoreV1Api()
    got: Any = api.list_pod_for_all_namespaces(field_selector=ended, _preload_content=False)
    lines = []
    for p in json.loads(got.data)["items"]:  # raw: the models' every field is Optional
        meta, asked = p["metadata"], [c.get("resources", {}) for c in p["spec"]["containers"]]
        cpu = sum(
            kubernetes.utils.parse_quantity(r.get("requests", {}).get("cpu", "0")) for r in asked
        )
        gone = " (deleted)" if meta.get("deletionTimestamp") else ""
        phase = p["status"].get("phase")
        lines.append(f"  {meta['namespace']}/{meta['name']} {phase}{gone} {cpu * 1000:.0f}m")
    return "pods on the node:\n" + "\n".join(lines)


def _watch_for(
    kube: Kube,
    kind: str,
    namespace: str,
    name: str,
    rv: str,
    timeout: float,
    check: Callable[[dict[str, Any] | None], bool],
) -> tuple[dict[str, Any] | None] | None:
    """(the object) as the first watch event for which `check` holds brings it; None if
    the watch ended first."""
    try:
        for event in kube.watch(kind, namespace, resource_version=rv, name=name, timeout=timeout):
            obj = None if event.type == "DELETED" else event.object
            if check(obj):
                return (obj,)
    except ApiError as exc:
        if exc.status != 410:  # Gone: too old to replay from (a CRD replaced): read again
            raise
    return None


async def events_of(
    kube: Kube, namespace: str, name: str, reasons: set[str], *, timeout: float = 15.0
) -> list[dict[str, Any]]:
    """The Events on object `name` once they include these reasons; woken by each Event
    written in the namespace."""
    deadline = time.monotonic() + timeout
    while True:
        listed = await asyncio.to_thread(
            kube.list, "Event", namespace, fields={"involvedObject.name": name}
        )
        found: list[dict[str, Any]] = listed.get("items") or []
        if reasons <= {e.get("reason") for e in found}:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            seen = [(e.get("type"), e.get("reason"), e.get("message")) for e in found]
            raise AssertionError(f"Events on {name}: no {reasons} in {seen}")
        rv = str(listed["metadata"].get("resourceVersion") or "0")
        await asyncio.to_thread(_next_event, kube, "Event", namespace, None, rv, min(left, 2.0))


def _next_event(
    kube: Kube, kind: str, namespace: str, name: str | None, rv: str, timeout: float
) -> None:
    try:
        for _ in kube.watch(kind, namespace, resource_version=rv, name=name, timeout=timeout):
            return
    except ApiError as exc:
        if exc.status != 410:  # Gone: too old to replay from (a CRD replaced): read again
            raise


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def phase(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("status") or {}).get("phase")


START = 90.0  # a new kernel pod to Ready, on a busy 2-core machine


async def ready(kube: Kube, ns: str, name: str, *, other_than: str = "") -> dict[str, Any]:
    """The session once Ready (its kernel pod running), on a kernel other than `other_than`."""
    obj = await eventually(
        kube,
        KS,
        ns,
        name,
        lambda o: (
            condition(o, "Ready").get("status") == "True"
            and (o or {})["status"].get("kernelId") != other_than
        ),
        timeout=START,
        what="Ready",
    )
    assert obj is not None
    return obj


# Requests are limits, and the test node has 2 CPUs: small kernels, so that a pool, its
# refills and the cold starts of one test all fit on it at once.
SMALL = {"cpu": "100m", "memory": "256Mi"}


def pool_body(name: str, ns: str, size: int, image: str, **template: Any) -> dict[str, Any]:
    """A KernelSessionPool of `size` SMALL kernels of `image`."""
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"size": size, "template": {"image": image, "resources": SMALL, **template}},
    }


def session_body(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": KS,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def key_in(secret: dict[str, Any]) -> str:
    data = secret.get("data") or {}
    text = (
        base64.b64decode(data["connection.json"]).decode()
        if "connection.json" in data
        else secret["stringData"]["connection.json"]
    )
    key: str = json.loads(text)["key"]
    return key


async def connection_of(kube: Kube, namespace: str, name: str) -> ConnectionInfo:
    """The session's kernel as the gateway reaches it from this host: its pod IP, the keys
    of its Secret."""
    obj = await asyncio.to_thread(kube.get, KS, namespace, name)
    assert obj is not None and obj["status"].get("podIP"), f"{name} has no pod IP: {obj}"
    secret_name = obj["status"].get("connection", {}).get("secretName") or f"ks-{name}-conn"
    secret = await asyncio.to_thread(kube.get, "Secret", namespace, secret_name)
    info = connection_file_of(secret)
    assert info is not None, f"{name}: no connection file in {secret}"
    return connection_from_file(info, obj["status"]["podIP"], f"Secret of {name}")


def bridge_inside(info: ConnectionInfo) -> tuple[str | int, ...]:
    """Where a cluster kernel's bridge listens, as the gateway tells it (cluster.py's
    bridge_address): TLS with the session's certificate."""
    assert info.bridge is not None, "the session has no bridge certificate"
    return ("tls", "0.0.0.0", BRIDGE_PORT, info.bridge.cert, info.bridge.key)


async def start_bridge(conn: KernelConnection, info: ConnectionInfo) -> None:
    """Start code mode's bridge in the kernel, as the gateway does (attach.py)."""
    program = introspection.bridge_program(bridge_inside(info))
    collector = Collector(conn.send_execute(program, silent=True, store_history=False), 1, 0)
    assert await conn.pump(collector, 30.0) and collector.error is None, collector.error


async def bridge_takes(conn: KernelConnection, info: ConnectionInfo, cert: BridgeCert) -> bool:
    """Whether the kernel's bridge takes a gateway that presents `cert`, connected and its
    hello applied (a refused one fails its TLS handshake)."""
    bridge = Bridge("test", {}, {})
    try:
        try:
            await bridge.open(Address("tcp", host=info.host, port=BRIDGE_PORT, tls=cert))
        except (ssl.SSLError, ConnectionError):
            return False
        code = "import mcp_tools; print(mcp_tools.wait_connected(10))"
        said = await run_in_kernel(conn, code)
        assert said in ("True\n", "False\n"), said
        return said == "True\n"
    finally:
        await bridge.close()


@contextlib.asynccontextmanager
async def kernel(kube: Kube, namespace: str, name: str) -> AsyncIterator[KernelConnection]:
    """The session's kernel, answering: connected at its pod IP with the keys of its Secret
    (Curve when it has a pair), as the gateway connects."""
    info = await connection_of(kube, namespace, name)
    conn = KernelConnection(info, max_frame=16 << 20, max_message=32 << 20)
    try:
        await conn.wait_ready(KERNEL_DEADLINE)
        yield conn
    finally:
        conn.close()


async def kernel_dies(kube: Kube, namespace: str, name: str, code: str) -> dict[str, Any]:
    """Run `code` (which ends the kernel) and return the pod once its container terminated."""
    async with kernel(kube, namespace, name) as conn:
        conn.send_execute(code, silent=False, store_history=False)
        pod = await eventually(kube, "Pod", namespace, f"ks-{name}", terminated, timeout=60)
    assert pod is not None
    return pod


def pod_ready(pod: dict[str, Any] | None) -> bool:
    """The kubelet says the pod is Ready (its kernel passed the startupProbe)."""
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def terminated(pod: dict[str, Any] | None) -> bool:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return any("terminated" in (c.get("state") or {}) for c in statuses)


async def run_in_kernel(conn: KernelConnection, code: str, timeout: float = 30.0) -> str:
    """Run `code` in the kernel; its stdout (an error's traceback fails the test)."""
    collector = Collector(conn.send_execute(code, silent=False, store_history=False), 100_000, 0)
    assert await conn.pump(collector, timeout), f"no reply within {timeout}s to {code!r}"
    assert collector.error is None, collector.error
    return "".join(collector.stdout)


PROBE_IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"


def probe_pod(name: str, namespace: str, labels: dict[str, str], code: str) -> dict[str, Any]:
    """A pod that runs `python3 -c code` once, as "restricted" admits it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "probe",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", code],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def connect_code(host: str, port: int, until_open: float = 0) -> str:
    """Python that prints `open` if a TCP connection to host:port succeeds within 3 s, else
    `closed` and why; with `until_open`, it tries again for that many seconds first."""
    return (
        "import socket, time\n"
        f"deadline = time.monotonic() + {until_open}\n"
        "while True:\n"
        "    s = socket.socket()\n"
        "    s.settimeout(3)\n"
        "    try:\n"
        f"        s.connect(({host!r}, {port}))\n"
        "        print('open')\n"
        "        break\n"
        "    except OSError as e:\n"
        "        if time.monotonic() > deadline:\n"
        "            print('closed', type(e).__name__)\n"
        "            break\n"
        "        time.sleep(0.5)  # a policy being applied elsewhere: nothing to wait on\n"
        "    finally:\n"
        "        s.close()\n"
    )


HOLD = "mcpforge.dev/test-hold"  # a finalizer of a test's own, so an object stays a while


async def failed_tries(kube: Kube, ns: str, name: str, times: int, timeout: float) -> None:
    """Once the session's ReconcileError Events count `times` failed tries."""
    deadline = time.monotonic() + timeout
    while True:
        listed = await asyncio.to_thread(
            kube.list, "Event", ns, fields={"involvedObject.name": name}
        )
        told = [e for e in listed.get("items") or [] if e.get("reason") == RECONCILE_ERROR]
        if sum(int(e.get("count") or 1) for e in told) >= times:
            return
        left = deadline - time.monotonic()
        assert left > 0, f"fewer than {times} failed tries told: {told}"
        rv = str(listed["metadata"]["resourceVersion"])
        events = kube.watch("Event", ns, resource_version=rv, timeout=min(left, 5.0))
        with contextlib.closing(events):
            await asyncio.to_thread(next, events, None)  # the next Event in the namespace


async def removed(*paths: Path, timeout: float = 10.0) -> bool:
    """True once none of `paths` is there: the node's handler removes what a wake spent
    (its archive, its kept images, a claim's copy) in a process of its own, 3 s after the
    wake (images/node/runc-restore/spent.go); each is renamed out of its path at once.
    Polled: there is nothing to wait on."""
    deadline = time.monotonic() + timeout
    while any(p.exists() or p.is_symlink() for p in paths):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True
