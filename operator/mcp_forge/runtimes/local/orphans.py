"""What a kernel leaves behind that no session owns, found and removed by housekeeping:
pods, and kernel containers only Podman's storage still holds.

Pods. A gateway killed while it started or deleted kernels (SIGKILL, a crash) leaves
pods that no row of the store names: `podman kube play` runs in a session of its own
and finishes after its gateway died, or a pod outlives the row deleted with it. No
later pass would look at them, and each holds a kernel's memory.

Every pod is labelled with the store it belongs to (`STORE_LABEL`: a hash of the
state directory) when its manifest is written, and a session's row is stored, with
its pod's name, before its pod is played; a pod is removed only after its row. So a
pod of this store, listed *before* the rows were read, that no row names, is no
session's, now or later: it is removed by its id (a new pod of the same name, played
meanwhile, is another id). Pods of another store (another state directory: another
gateway's sessions, live or not) are never touched.

Storage-only containers. A container can lose its record in Podman's database and keep
its storage: its layer (disk nothing frees) and its name, which the next play of a pod
with that container finds taken ("the container name ... is already in use").
`podman ps -a` does not list one; `podman ps -a --external` does, with State "storage"
and Command ["storage"] (["buildah"] for a buildah working container, which Podman
lists the same way), no labels and no pod; `podman container inspect` knows none.
Podman 4.3.1 leaves one when a `podman create` or `kube play` dies between making the
storage and writing the record (killed, as run() kills a play at its timeout), and when
a removal fails to tear the storage down (the record is removed all the same). A
killed `podman rm` leaves none: it leaves the record, in state Removing.

Nothing in the storage says which store made one (its metadata: image, name, creation
time), so one is ours by its name, and only where that is safe: it is named as the
kernel container of the pod a session of this store owns (`kernel_container`: kube
play names it `<pod>-<container>`), and Podman made it, not buildah. It is removed
holding that session's lock, found again under the lock, by its id: a play of the
session's pod, the only thing of this store that makes a container of that name, holds
the same lock, so none is halfway. (By id: Podman 4.3.1's `rm --storage` removes a
container its database knows like plain `rm`, and an id, unlike a name, is never
another container's.) Left alone: any other name; infra containers (named after their
pod's id, they hold no name a later pod needs); and a kernel container of a pod no
session of this store owns: by its name it may be another store's (pod names carry
namespace and session name only). A session of this store that comes to own that name
frees it when its play finds it taken (`name_in_use`, `free_name`: kernelpods.py), or
the next pass does.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients import podman
from mcp_forge.control.render import CONTAINER, HostPaths, podman_pod_name, render_podman
from mcp_forge.errors import PodmanError, SessionNotFound

if TYPE_CHECKING:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

log = logging.getLogger(__name__)

STORE_LABEL = "mcpforge.dev/store"
# How `podman create` and `kube play` say a container name is taken (Podman 4.3.1).
_NAME_IN_USE = re.compile(r'the container name "([^"]+)" is already in use')


def store_tag(state_dir: Path) -> str:
    """The label value naming the store of `state_dir`."""
    return hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]


def manifest(session: KernelSession, paths: HostPaths, tag: str) -> str:
    """The session's pod as `podman kube play` reads it, labelled with its store."""
    docs = render_podman(session, paths)
    for doc in docs:
        if doc.get("kind") == "Pod":
            doc["metadata"].setdefault("labels", {})[STORE_LABEL] = tag
    return yaml.safe_dump_all(docs, sort_keys=False)


def orphans(pods: list[dict[str, Any]], owned: set[str]) -> list[tuple[str, str]]:
    """(id, name) of each listed pod whose name no session owns."""
    out = []
    for pod in pods:
        name, pod_id = str(pod.get("Name") or ""), str(pod.get("Id") or "")
        if name and pod_id and name not in owned:
            out.append((pod_id, name))
    return out


async def remove_orphans(runtime: LocalRuntime) -> list[str]:
    """Remove the pods of this store that no session owns (see the module docstring);
    returns their names. Errors are logged: the next pass tries again."""
    tag = store_tag(runtime.settings.state_dir)
    try:
        pods = await podman.run_json(
            "pod", "ps", "--filter", f"label={STORE_LABEL}={tag}", "--format", "json"
        )
    except (PodmanError, ValueError) as exc:
        log.warning("cannot list kernel pods: %s", exc)
        return []
    # Read after the pods: a pod listed has had its row since before it was played.
    owned = {_pod(s) for s in await runtime.list()}
    removed = []
    for pod_id, name in orphans(pods if isinstance(pods, list) else [], owned):
        if await _remove(pod_id, name):
            log.warning("removed kernel pod %s: no session owns it", name)
            removed.append(name)
    return removed


async def _remove(pod_id: str, name: str) -> bool:
    """Remove a pod by id; False if it is still there, or was removed meanwhile by
    whoever removes it. podman.remove_pod finishes a pod Podman 4.3 left half removed."""
    try:
        return await podman.remove_pod(pod_id)
    except PodmanError as exc:
        log.warning("could not remove kernel pod %s: %s", name, exc)
        return False


def kernel_container(session: KernelSession) -> str:
    """The name of the session's kernel container: kube play's `<pod>-<container>`."""
    return f"{_pod(session)}-{CONTAINER}"


def _pod(session: KernelSession) -> str:
    return str(session.status.get("podName") or podman_pod_name(session.namespace, session.name))


def storage_only(containers: list[dict[str, Any]]) -> dict[str, str]:
    """Name to id of each container listed by `podman ps -a --external` that only the
    storage holds and that Podman made (not buildah: see the module docstring)."""
    out = {}
    for container in containers:
        names = container.get("Names") or []
        container_id = str(container.get("Id") or "")
        podmans = container.get("State") == "storage" and container.get("Command") == ["storage"]
        if podmans and container_id and len(names) == 1:
            out[str(names[0])] = container_id
    return out


async def remove_storage_only(runtime: LocalRuntime) -> list[str]:
    """Remove the storage-only containers named as the kernel container of a pod that a
    session of this store owns (see the module docstring); returns their names. One
    whose session's lock is busy waits for the next pass. Errors are logged."""
    held = storage_only(await _containers())
    if not held:
        return []
    sessions = {kernel_container(s): s for s in await runtime.list()}
    removed = []
    for name in sorted(held.keys() & sessions.keys()):
        session = sessions[name]
        async with runtime.locked_if_free(session) as mine:
            if not mine or not await _still(runtime, session, name):
                continue
            # Not beside a play of this runtime's: storage locks taken in different orders
            # by two podman processes can stall both (kernelpods.py, _realize).
            async with runtime._playing():
                if await free_name(name):
                    removed.append(name)
    return removed


async def _still(runtime: LocalRuntime, session: KernelSession, name: str) -> bool:
    """Whether the session, its lock held, is still stored as itself, with that kernel
    container (not deleted, nor a new session of its name, meanwhile)."""
    try:
        current = await runtime.get(session.name, session.namespace)
    except SessionNotFound:
        return False
    return current.uid == session.uid and kernel_container(current) == name


def name_in_use(stderr: str) -> str | None:
    """The container name a failed `podman create` or `kube play` found taken, if that
    is why it failed."""
    found = _NAME_IN_USE.search(stderr)
    return found.group(1) if found else None


async def free_name(name: str) -> bool:
    """Remove the storage-only container Podman made that holds `name`, if there is one,
    by its id: True once removed. The caller holds the lock of the session whose kernel
    container is called `name` (see the module docstring)."""
    container_id = storage_only(await _containers()).get(name)
    if container_id is None:
        return False
    try:
        done = await podman.run("rm", "--storage", container_id, check=False)
    except PodmanError as exc:
        log.warning("could not remove storage-only container %s: %s", name, exc)
        return False
    if done.returncode != 0:
        if "no such container" not in done.stderr:  # else removed meanwhile
            log.warning("could not remove storage-only container %s: %s", name, done.stderr)
        return False
    log.warning("removed storage-only container %s (%s)", name, container_id[:12])
    return True


async def _containers() -> list[dict[str, Any]]:
    """Every container, those only the storage holds included ([] if podman fails)."""
    try:
        listed = await podman.run_json("ps", "-a", "--external", "--format", "json")
    except (PodmanError, ValueError) as exc:
        log.warning("cannot list containers: %s", exc)
        return []
    return listed if isinstance(listed, list) else []
