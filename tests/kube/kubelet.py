"""A stand-in for the kubelet, for tests: the API's kernel Pods, run as Podman pods.

There is no cluster here, only an API server emulator, where Pods never run. `Kubelet`
watches the kernel Pods (label ``app.kubernetes.io/component=kernel``) of some
namespaces and does for each what a kubelet does, on this host, with `podman kube play`:

* reads the Secret its ``secret`` volumes name and writes the files to a host directory
  (under a root-only 0700 state directory), mounted read-only where the Secret would be;
  a Secret that does not exist yet is read again with a backoff (waiting
  ContainerCreating, the message saying why) until it does, as a kubelet retries a mount;
* converts the Pod into one Podman 4.3.1 can play (see `Kubelet.manifest`), on the
  bridge network ``podman``, so the pod gets an IP the host reaches, as a pod IP;
* writes status through the status subresource, as a kubelet reports it: Pending
  (waiting ContainerCreating) → Running (podIP, containerStatuses running, Ready) →
  Failed/Succeeded when the containers exit (terminated with exitCode and reason
  OOMKilled, Error or Completed). An image that is not on the host is ErrImagePull:
  this kubelet never pulls;
* when the Pod is deleted (DELETED, or deletionTimestamp set), removes the podman pod and,
  once no finalizer is left, deletes the Pod with grace 0 as a kubelet does after a
  graceful deletion;
* applies a pids limit (`pids_limit`, like the kubelet's podPidsLimit) to each container's
  cgroup, as local mode does: 4.3.1's kube play has none. Memory and CPU limits come from
  the Pod's resources, ulimits from containers.conf.

What it does not emulate: scheduling (no nodeName, every Pod of its namespaces is
its own), restarts (restartPolicy is taken as Never, restartCount stays 0), probes,
init containers, image pulls and ImagePullBackOff, volumes other than secret, emptyDir
and hostPath (the Pod waits with CreateContainerConfigError), NetworkPolicies (every
pod on the bridge reaches every other), emptyDir size limits and ``medium: Memory``
(Podman 4.3.1 plays both as plain named volumes), and a Pod changed after it started.

Podman pods are named ``kubelet-<namespace>-<name>`` and labelled `LABEL`, so
`remove_leftovers` finds what a killed test run left behind. Their labels are not the
Pod's: the project's own labels would put these pods in local mode's listings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import anyio
import kubernetes
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from mcp_forge import podman
from mcp_forge.errors import PodmanError
from mcp_forge.local import oom_kills

log = logging.getLogger(__name__)

LABEL = "mcpforge.dev/test-kubelet"  # value: the Kubelet's id
KERNEL_SELECTOR = "app.kubernetes.io/component=kernel"
Key = tuple[str, str]  # (namespace, name)
OnEvent = Callable[[str, dict[str, Any]], None]


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def podman_pod_name(namespace: str, name: str) -> str:
    return f"kubelet-{namespace}-{name}"


def api_client(config: kubernetes.client.Configuration | str | os.PathLike[str] | None) -> Any:
    """An ApiClient for a Configuration, a kubeconfig path, or (None) the default config."""
    if config is None:
        config = kubernetes.client.Configuration.get_default_copy()
    elif not isinstance(config, kubernetes.client.Configuration):
        path = os.fspath(config)
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
    return kubernetes.client.ApiClient(config)


# ---- watching ------------------------------------------------------------------------------


class PodWatch:
    """Watch the Pods of a namespace (None: all) in a thread; hand events to the loop.

    The sync `kubernetes` client blocks, and the API emulator runs in this loop, so the
    stream is read in a thread of its own and each event is delivered with
    `call_soon_threadsafe`. A watch that ends is opened again from the last
    resourceVersion seen (an emulator that keeps none replays every Pod as ADDED: callers
    are idempotent). `stop` interrupts a blocked read by shutting the socket down.
    """

    def __init__(
        self,
        api: Any,
        namespace: str | None,
        on_event: OnEvent,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._version = resource_version
        self._core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self._on_event = on_event
        self._on_error = on_error
        self._selectors = {
            k: v
            for k, v in (("label_selector", label_selector), ("field_selector", field_selector))
            if v is not None
        }
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._resp: urllib3.BaseHTTPResponse | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None

    async def start(self, timeout: float) -> None:
        """Start the thread; return once the first watch request is answered."""
        self._loop = asyncio.get_running_loop()
        self._connected = self._loop.create_future()
        self._done = self._loop.create_future()
        threading.Thread(target=self._run, name=f"pod-watch-{self.namespace}", daemon=True).start()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._connected)
        except BaseException:
            await self.stop()
            raise

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            if self._resp is not None:
                self._resp.shutdown()  # urllib3 2.3+: interrupts a read in another thread
        if self._done is not None:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._done)

    def _deliver(self, fn: Callable[..., None], *args: Any) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()
            return False
        return True

    def _resolve(self, future: asyncio.Future[None] | None, error: BaseException | None) -> None:
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _run(self) -> None:
        version = self._version
        backoff = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    version = self._stream(version)
                    backoff = 0.1
                except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                    if self._stopping.is_set():
                        break
                    if isinstance(exc, ApiException) and exc.status == 410:
                        version = None  # expired: start over with a full replay
                        continue
                    log.warning("watch of pods in %s failed: %s", self.namespace, exc)
                    if self._on_error is not None:
                        self._deliver(self._on_error, exc)
                    # The API may be restarting: wait a little (or until stopped), retry.
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            self._deliver(self._resolve, self._connected, RuntimeError("the watch stopped"))
            self._deliver(self._resolve, self._done, None)

    def _stream(self, version: str | None) -> str | None:
        """One watch request, read to its end; return the last resourceVersion seen."""
        kwargs: dict[str, Any] = dict(
            self._selectors, watch=True, allow_watch_bookmarks=True, _preload_content=False
        )
        if version:
            kwargs["resource_version"] = version
        resp: Any  # a urllib3 response (_preload_content=False)
        if self.namespace is None:
            resp = self._core.list_pod_for_all_namespaces(**kwargs)
        else:
            resp = self._core.list_namespaced_pod(self.namespace, **kwargs)
        with self._lock:
            if self._stopping.is_set():
                resp.close()
                return version
            self._resp = resp
        self._deliver(self._resolve, self._connected, None)
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind != "BOOKMARK" and not self._deliver(self._on_event, kind, obj):
                    break
                if self._stopping.is_set():
                    break
        finally:
            with self._lock:
                self._resp = None
            resp.close()
        return version


async def wait_for_pod(
    api: Any,
    namespace: str,
    name: str,
    predicate: Callable[[str, dict[str, Any]], bool],
    *,
    timeout: float,
    since: str | None = None,
) -> dict[str, Any]:
    """The Pod as of the first watch event (type, pod) that `predicate` accepts.

    The watch starts with the Pod's current state (ADDED), so a predicate that already
    holds returns at once; with `since` (a resourceVersion) it starts with the events
    after that one instead, e.g. a DELETED that already happened. TimeoutError after
    `timeout` seconds, naming the last state seen.
    """
    loop = asyncio.get_running_loop()
    found: asyncio.Future[dict[str, Any]] = loop.create_future()
    last: list[tuple[str, dict[str, Any]]] = []

    def on_event(kind: str, pod: dict[str, Any]) -> None:
        if (pod.get("metadata") or {}).get("name") != name or found.done():
            return
        last[:] = [(kind, pod)]
        if predicate(kind, pod):
            found.set_result(pod)

    watch = PodWatch(
        api, namespace, on_event, field_selector=f"metadata.name={name}", resource_version=since
    )
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            await watch.start(timeout)
            return await found
    except TimeoutError:
        seen = f"{last[0][0]} with status {last[0][1].get('status')}" if last else "no event"
        raise TimeoutError(
            f"pod {namespace}/{name}: not as expected after {time.monotonic() - started:.1f}s;"
            f" last seen: {seen}"
        ) from None
    finally:
        await watch.stop()


# ---- the kubelet ---------------------------------------------------------------------------


class _NotEmulated(Exception):
    """A Pod this kubelet cannot run: reported as CreateContainerConfigError."""


class _VolumeNotReady(Exception):
    """A Secret (or its key) that is missing: a kubelet retries until it appears."""


@dataclass
class _Run:
    """One API Pod (one uid) and the podman pod that realizes it."""

    namespace: str
    name: str
    uid: str | None
    pod: dict[str, Any]
    dir: Path
    task: asyncio.Task[None] | None = None
    play: asyncio.Task[Any] | None = None
    publishing: asyncio.Lock = field(default_factory=asyncio.Lock)
    states: dict[str, dict[str, Any]] = field(default_factory=dict)  # container → state
    ids: dict[str, str] = field(default_factory=dict)  # container → podman id
    image_ids: dict[str, str] = field(default_factory=dict)
    pod_ip: str | None = None
    start_time: str = field(default_factory=now)
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type → (status, at)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def podman_name(self) -> str:
        return podman_pod_name(self.namespace, self.name)

    @property
    def containers(self) -> list[dict[str, Any]]:
        containers: list[dict[str, Any]] = self.pod["spec"]["containers"]
        return containers


class Kubelet:
    """Runs the kernel Pods of `namespaces` (None: every namespace) with Podman.

    `config` is a kubernetes Configuration, a kubeconfig path, or None for the client's
    default configuration. Use it as an async context manager, or call `start` and,
    always, `stop`: it removes every podman pod it made. See the module docstring.
    """

    def __init__(
        self,
        config: kubernetes.client.Configuration | str | os.PathLike[str] | None = None,
        namespaces: Iterable[str] | None = ("default",),
        *,
        network: str = "podman",
        pids_limit: int = 1024,
        state_dir: Path | None = None,
        podman_timeout: float = 120.0,
        start_timeout: float = 30.0,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.namespaces = None if namespaces is None else tuple(namespaces)
        self.network = network
        self.pids_limit = pids_limit  # the kubelet's podPidsLimit
        self.podman_timeout = podman_timeout
        self.start_timeout = start_timeout
        self.errors: list[BaseException] = []  # what went wrong in the background; tests check
        self.host_ip: str | None = None
        self._api = api_client(config)
        self._core = kubernetes.client.CoreV1Api(self._api)
        self._state_dir = state_dir
        self._own_state_dir = state_dir is None
        self._watches: list[PodWatch] = []
        self._runs: dict[Key, _Run] = {}
        self._removals: dict[Key, asyncio.Task[None]] = {}
        self._rm_lock = asyncio.Lock()  # podman 4.3.1 can panic on concurrent `pod rm`
        self._removed = asyncio.Event()  # set (and replaced) whenever a removal ends
        self._stopped = False

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Kubelet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start watching; return once every watch is established."""
        if self._state_dir is None:
            self._state_dir = Path(tempfile.mkdtemp(prefix="kubelet-"))  # 0700, root's
        os.chmod(self._state_dir, 0o700)
        self.host_ip = await self._gateway_ip()
        for namespace in self.namespaces or (None,):
            watch = PodWatch(
                self._api,
                namespace,
                self._on_event,
                label_selector=KERNEL_SELECTOR,
                on_error=self.errors.append,
            )
            self._watches.append(watch)
            await watch.start(self.start_timeout)

    async def stop(self) -> None:
        """Stop watching and remove every podman pod this kubelet made (bounded, shielded)."""
        self._stopped = True
        with anyio.move_on_after(self.podman_timeout, shield=True) as scope:
            for watch in self._watches:
                with contextlib.suppress(TimeoutError):
                    await watch.stop()
            for run in list(self._runs.values()):
                self._retire(run, delete_from_api=False)
            while pending := [t for t in self._removals.values() if not t.done()]:
                await asyncio.gather(*pending, return_exceptions=True)
            await self._remove_labelled(f"{LABEL}={self.id}")
            if self._own_state_dir and self._state_dir is not None:
                await asyncio.to_thread(shutil.rmtree, self._state_dir, True)
        if scope.cancelled_caught:
            log.error("the kubelet did not stop within %ss; pods may be left", self.podman_timeout)
        self._api.close()

    async def wait_removed(self, namespace: str, name: str, *, timeout: float) -> None:
        """Return once the Pod's podman pod is removed (after its API Pod was deleted)."""
        key = (namespace, name)
        async with asyncio.timeout(timeout):
            while key in self._runs or key in self._removals:
                await self._removed.wait()

    @classmethod
    async def remove_leftovers(cls) -> list[str]:
        """Remove the podman pods of every Kubelet (e.g. of a killed run); return their names."""
        return await cls._remove_labelled(LABEL)

    @classmethod
    async def _remove_labelled(cls, label: str) -> list[str]:
        done = await podman.run("pod", "ps", "--filter", f"label={label}", "--format", "{{.Name}}")
        names = done.stdout.decode().split()
        for name in names:
            await _remove_pod(name)
        return names

    # ---- events (called in the loop, from the watch threads) --------------------------------

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        # Emulators may ignore the selector; a kubelet of some namespaces takes only those.
        if self._stopped or labels.get("app.kubernetes.io/component") != "kernel":
            return
        if self.namespaces is not None and key[0] not in self.namespaces:
            return
        uid = meta.get("uid")
        run = self._runs.get(key)
        same = run is not None and run.uid == uid
        if kind == "DELETED":
            if run is not None and same:
                self._retire(run, delete_from_api=False)
            return
        if meta.get("deletionTimestamp"):
            delete = not meta.get("finalizers")
            if run is not None and same:
                self._retire(run, delete_from_api=delete)
            elif run is None and delete:
                self._retire_key(key, uid, delete_from_api=True)
            return
        if same:
            return  # our own status writes, or a change this kubelet does not act on
        if run is not None:  # a new Pod of the same name: the old one is gone
            self._retire(run, delete_from_api=False)
        run = _Run(key[0], key[1], uid, pod, self._pod_dir(key, uid))
        self._runs[key] = run
        run.task = asyncio.create_task(self._serve(run, self._removals.get(key)))
        run.task.add_done_callback(self._record_failure)

    def _retire(self, run: _Run, *, delete_from_api: bool) -> None:
        if self._runs.get(run.key) is run:
            del self._runs[run.key]
        if run.task is not None:
            run.task.cancel()
        self._retire_key(run.key, run.uid, delete_from_api=delete_from_api, run=run)

    def _retire_key(
        self, key: Key, uid: str | None, *, delete_from_api: bool, run: _Run | None = None
    ) -> None:
        task = asyncio.create_task(
            self._remove(key, uid, run, self._removals.get(key), delete_from_api)
        )
        self._removals[key] = task

        def done(task: asyncio.Task[None]) -> None:
            if self._removals.get(key) is task:
                del self._removals[key]
            self._removed.set()
            self._removed = asyncio.Event()
            self._record_failure(task)

        task.add_done_callback(done)

    def _record_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            assert error is not None
            log.error("kubelet: %s", error, exc_info=error)
            self.errors.append(error)

    # ---- running a Pod -------------------------------------------------------------------

    def _pod_dir(self, key: Key, uid: str | None) -> Path:
        assert self._state_dir is not None
        return self._state_dir / f"{key[0]}_{key[1]}_{(uid or uuid.uuid4().hex)[:8]}"

    async def _serve(self, run: _Run, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:  # the podman pod of the same name must be gone first
            await asyncio.shield(previous)
        images = {c["name"]: c.get("image", "") for c in run.containers}
        run.states = {name: {"waiting": {"reason": "ContainerCreating"}} for name in images}
        await self._publish(run)
        missing = [image for image in images.values() if not await _image_exists(image)]
        if missing:
            message = f"image {missing[0]!r} is not on this host (this test kubelet never pulls)"
            return await self._wait_with(run, "ErrImagePull", message)
        await asyncio.to_thread(run.dir.mkdir, 0o700)
        delay = 0.1
        while True:
            try:
                manifest = await self.manifest(run.pod, run.dir)
                break
            except _NotEmulated as exc:
                return await self._wait_with(run, "CreateContainerConfigError", str(exc))
            except _VolumeNotReady as exc:
                # A kubelet retries a failed mount with a backoff until the Secret appears.
                if run.states[run.containers[0]["name"]]["waiting"].get("message") != str(exc):
                    await self._wait_with(run, "ContainerCreating", str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        path = run.dir / "pod.yaml"
        await asyncio.to_thread(path.write_text, yaml.safe_dump(manifest, sort_keys=False))
        # Shielded: a deletion waits for the play to end rather than killing podman midway.
        run.play = asyncio.create_task(
            podman.run(
                "kube",
                "play",
                "--replace",
                f"--network={self.network}",
                str(path),
                timeout=self.podman_timeout,
            )
        )
        try:
            await asyncio.shield(run.play)
        except PodmanError as exc:
            return await self._wait_with(run, "RunContainerError", str(exc))
        infos = await _inspect(*(f"{run.podman_name}-{name}" for name in images))
        run.pod_ip = await self._pod_ip(run.podman_name)
        for name, info in zip(images, infos, strict=True):
            run.ids[name] = info["Id"]
            run.image_ids[name] = f"sha256:{info.get('Image', '')}"
            if info["State"].get("Running"):  # else it exited already: its waiter says so
                _limit_pids(info, self.pids_limit)
                started = _rfc3339(info["State"]["StartedAt"])
                run.states[name] = {"running": {"startedAt": started}}
        await self._publish(run)
        await asyncio.gather(*(self._wait_exit(run, name) for name in images))

    async def _wait_with(self, run: _Run, reason: str, message: str) -> None:
        for name in run.states:
            run.states[name] = {"waiting": {"reason": reason, "message": message[:2000]}}
        await self._publish(run)

    async def _wait_exit(self, run: _Run, container: str) -> None:
        """Report the container's exit once `podman wait` returns (no polling)."""
        name = f"{run.podman_name}-{container}"
        while True:
            with contextlib.suppress(PodmanError):  # only a timeout: wait again
                await podman.run(
                    "wait",
                    "--condition=exited",
                    "--condition=stopped",
                    name,
                    check=False,
                    timeout=3600,
                )
            found = await _inspect(name, missing_ok=True)
            if not found:
                return  # removed: the Pod is being deleted, nothing to report
            info = found[0]
            if not info["State"].get("Running"):
                break
        state = info["State"]
        code = int(state.get("ExitCode", 0))
        # Podman's OOMKilled is not set when tini (PID 1) outlives the killed kernel on
        # cgroup v1; the Linux kernel's record of memory-cgroup OOM kills names the
        # container. A container runs once here (no restarts), so any record is this death.
        oom = bool(state.get("OOMKilled")) or (code == 137 and await oom_kills(info["Id"]) > 0)
        reason = "OOMKilled" if oom else ("Completed" if code == 0 else "Error")
        run.states[container] = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": _rfc3339(state.get("StartedAt", "")),
                "finishedAt": _rfc3339(state.get("FinishedAt", "")),
                "containerID": f"podman://{info['Id']}",
            }
        }
        await self._publish(run)

    async def _publish(self, run: _Run) -> None:
        """Write the Pod's status as a kubelet does (merge-patch of the status subresource).

        One write at a time per Pod, each from the state as of its turn, so the last
        write is the newest state.
        """
        async with run.publishing:
            await self._call(
                "patch_namespaced_pod_status",
                run.name,
                run.namespace,
                {"status": self._status(run)},
                _content_type="application/merge-patch+json",
            )

    def _status(self, run: _Run) -> dict[str, Any]:
        states = [run.states[c["name"]] for c in run.containers]
        running = [("running" in s) for s in states]
        ended = [s["terminated"] for s in states if "terminated" in s]
        if len(ended) == len(states):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
        elif any(running) or ended:
            phase = "Running"
        else:
            phase = "Pending"
        ready = all(running)
        not_ready = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
        conditions = [
            self._condition(run, "PodScheduled", True),
            self._condition(run, "Initialized", True),
            self._condition(run, "ContainersReady", ready, "" if ready else not_ready),
            self._condition(run, "Ready", ready, "" if ready else not_ready),
        ]
        statuses = []
        for container, state, up in zip(run.containers, states, running, strict=True):
            status: dict[str, Any] = {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": run.image_ids.get(container["name"], ""),
                "ready": up,
                "started": up,
                "restartCount": 0,
                "state": state,
                "lastState": {},
            }
            if container["name"] in run.ids:
                status["containerID"] = f"podman://{run.ids[container['name']]}"
            statuses.append(status)
        status = {
            "phase": phase,
            "hostIP": self.host_ip,
            "startTime": run.start_time,
            "conditions": conditions,
            "containerStatuses": statuses,
        }
        if run.pod_ip and phase == "Running":
            status.update(podIP=run.pod_ip, podIPs=[{"ip": run.pod_ip}])
        return status

    def _condition(self, run: _Run, kind: str, value: bool, reason: str = "") -> dict[str, Any]:
        text = "True" if value else "False"
        old = run.transitions.get(kind)
        since = old[1] if old is not None and old[0] == text else now()
        run.transitions[kind] = (text, since)
        condition = {
            "type": kind,
            "status": text,
            "lastProbeTime": None,
            "lastTransitionTime": since,
        }
        if reason:
            condition["reason"] = reason
        return condition

    async def _remove(
        self,
        key: Key,
        uid: str | None,
        run: _Run | None,
        previous: asyncio.Task[None] | None,
        delete_from_api: bool,
    ) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        if run is not None:
            for task in (run.task, run.play):  # a play is never cut short: wait for its end
                if task is not None:
                    await asyncio.gather(task, return_exceptions=True)
            async with self._rm_lock:
                await _remove_pod(run.podman_name)
            await asyncio.to_thread(shutil.rmtree, run.dir, True)
        if delete_from_api and not self._stopped:
            # What a kubelet does once a gracefully deleted Pod's containers are gone.
            options = kubernetes.client.V1DeleteOptions(
                grace_period_seconds=0,
                preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None,
            )
            try:
                await self._call("delete_namespaced_pod", key[1], key[0], body=options)
            except ApiException as exc:
                if exc.status != 409:  # 409: the uid is another Pod's now, not ours to delete
                    raise

    # ---- the Pod as Podman plays it --------------------------------------------------------

    async def manifest(self, pod: Mapping[str, Any], pod_dir: Path) -> dict[str, Any]:
        """The Pod as `podman kube play` 4.3.1 runs it; writes its Secrets under `pod_dir`.

        * secret volumes become read-only host directories holding the Secret's files
          (4.3.1 crashes on secret volumes), with the modes and group (fsGroup) a kubelet
          gives them;
        * emptyDirs are renamed per pod: 4.3.1 makes each a named volume called after the
          volume, which every pod using the same name would share;
        * container ports are dropped: 4.3.1 publishes every containerPort on the host
          (0.0.0.0), so two pods could not both listen on one port; the pod IP is enough;
        * imagePullPolicy is Never; securityContext and resources are kept.
        """
        meta = pod["metadata"]
        name = podman_pod_name(meta["namespace"], meta["name"])
        spec = json.loads(json.dumps(pod["spec"]))  # a deep copy
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        renamed: dict[str, str] = {}
        secrets: set[str] = set()
        volumes = []
        for volume in spec.get("volumes") or []:
            vname = volume["name"]
            if "secret" in volume:
                target = pod_dir / "volumes" / vname
                await self._write_secret(meta["namespace"], volume["secret"], target, fs_group)
                secrets.add(vname)
                host = {"path": str(target), "type": "Directory"}
                volumes.append({"name": vname, "hostPath": host})
            elif "emptyDir" in volume:
                renamed[vname] = f"{name}-{vname}"
                volumes.append({"name": renamed[vname], "emptyDir": {}})
            elif "hostPath" in volume:
                volumes.append(volume)
            else:
                kind = next((k for k in volume if k != "name"), "?")
                raise _NotEmulated(f"volume {vname!r}: {kind} volumes are not emulated")
        spec["volumes"] = volumes
        for container in spec["containers"]:
            container.pop("ports", None)
            container["imagePullPolicy"] = "Never"
            for mount in container.get("volumeMounts") or []:
                if mount["name"] in secrets:  # a kubelet mounts Secrets read-only, always
                    mount["readOnly"] = True
                mount["name"] = renamed.get(mount["name"], mount["name"])
        if spec.get("initContainers"):
            raise _NotEmulated("init containers are not emulated")
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {
                    LABEL: self.id,
                    "mcpforge.dev/test-kubelet-pod": f"{meta['namespace']}.{meta['name']}",
                },
                # Honoured by Podman >= 4.4; the cgroup is written after the start anyway.
                "annotations": {
                    f"io.podman.annotations.pids-limit/{c['name']}": str(self.pids_limit)
                    for c in spec["containers"]
                },
            },
            "spec": spec,
        }

    async def _write_secret(
        self, namespace: str, volume: Mapping[str, Any], target: Path, fs_group: int | None
    ) -> None:
        secret = await self._call("read_namespaced_secret", volume["secretName"], namespace)
        if secret is None:
            raise _VolumeNotReady(f"secret {volume['secretName']!r} not found")
        files: dict[str, bytes] = {
            k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()
        }
        # An emulator may keep stringData as it was sent; an API server folds it into data.
        files.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
        default_mode = int(volume.get("defaultMode", 0o644))
        items = volume.get("items") or [{"key": k, "path": k} for k in files]
        wanted: list[tuple[PurePosixPath, bytes, int]] = []
        for item in items:
            if item["key"] not in files:
                raise _VolumeNotReady(f"secret {volume['secretName']!r} has no key {item['key']!r}")
            path = PurePosixPath(item["path"])
            if path.is_absolute() or ".." in path.parts:
                raise _NotEmulated(f"secret item path {item['path']!r} is not relative")
            wanted.append((path, files[item["key"]], int(item.get("mode", default_mode))))
        await asyncio.to_thread(_write_files, target, wanted, fs_group)

    # ---- API and Podman --------------------------------------------------------------------

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A CoreV1Api call in a thread, as plain JSON; None if the object is gone (404)."""

        def call() -> Any:
            resp = getattr(self._core, method)(*args, _preload_content=False, **kwargs)
            try:
                return json.loads(resp.data or b"null")
            finally:
                resp.release_conn()

        try:
            return await asyncio.to_thread(call)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def _gateway_ip(self) -> str | None:
        done = await podman.run("network", "inspect", self.network, timeout=self.podman_timeout)
        for net in json.loads(done.stdout or b"[]"):
            for subnet in net.get("subnets") or []:
                if subnet.get("gateway"):
                    return str(subnet["gateway"])
        return None

    async def _pod_ip(self, pod: str) -> str | None:
        done = await podman.run("pod", "inspect", pod, timeout=self.podman_timeout)
        data = json.loads(done.stdout)
        info = data[0] if isinstance(data, list) else data
        (infra,) = await _inspect(info["InfraContainerID"])
        networks = (infra.get("NetworkSettings") or {}).get("Networks") or {}
        address = (networks.get(self.network) or {}).get("IPAddress")
        return str(address) if address else None


def _write_files(
    target: Path, files: list[tuple[PurePosixPath, bytes, int]], group: int | None
) -> None:
    """A secret volume's files: root's, group `group` (fsGroup) if set, the item modes."""
    shutil.rmtree(target, ignore_errors=True)  # a retry starts afresh
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    target.mkdir(mode=0o750 if group is not None else 0o755)
    os.chown(target, 0, group if group is not None else 0)
    for rel, data, mode in files:
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchown(f.fileno(), 0, group if group is not None else 0)
            os.fchmod(f.fileno(), mode)


def _rfc3339(podman_time: str) -> str:
    """Podman's '2026-11-29T20:55:05.117745818Z' as the API writes it (seconds, Z)."""
    return podman_time[:19] + "Z" if len(podman_time) >= 19 else now()


async def _image_exists(image: str) -> bool:
    return (await podman.run("image", "exists", image, check=False)).returncode == 0


async def _inspect(*names: str, missing_ok: bool = False) -> list[dict[str, Any]]:
    done = await podman.run("container", "inspect", *names, check=not missing_ok)
    if done.returncode != 0:
        return []
    data: list[dict[str, Any]] = json.loads(done.stdout or b"[]")
    return data


async def _remove_pod(name: str) -> None:
    """`podman pod rm -f`; 4.3.1 sometimes panics on concurrent removals: once more then."""
    for attempt in (1, 2):
        done = await podman.run("pod", "rm", "-f", "-t", "0", name, check=False)
        if done.returncode == 0 or "no pod with name" in done.stderr.lower():
            return
        if "panic:" not in done.stderr or attempt == 2:
            raise PodmanError(["pod", "rm", "-f", name], done.returncode, done.stderr)
        log.warning("podman panicked removing %s; trying again", name)


def _limit_pids(info: Mapping[str, Any], limit: int) -> None:
    """Write pids.max of the container's cgroup (4.3.1's kube play has no pids limit)."""
    cgroup = str(info.get("State", {}).get("CgroupPath", "")).lstrip("/")
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        target = root / cgroup / "pids.max"
        if cgroup and target.is_file():
            with contextlib.suppress(FileNotFoundError):  # it died meanwhile: no cgroup
                target.write_text(str(limit))
            return
    log.warning("no pids cgroup for container %s: its pids limit is not applied", info.get("Id"))
