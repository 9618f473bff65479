"""Kernel pods no session owns any more, found and removed by housekeeping.

A gateway killed while it started or deleted kernels (SIGKILL, a crash) leaves pods
that no row of the store names: `podman kube play` runs in a session of its own and
finishes after its gateway died, or a pod outlives the row deleted with it. No later
pass would look at them, and each holds a kernel's memory.

Every pod is labelled with the store it belongs to (`STORE_LABEL`: a hash of the
state directory) when its manifest is written, and a session's row is stored, with
its pod's name, before its pod is played; a pod is removed only after its row. So a
pod of this store, listed *before* the rows were read, that no row names, is no
session's, now or later: it is removed by its id (a new pod of the same name, played
meanwhile, is another id). Pods of another store (another state directory: another
gateway's sessions, live or not) are never touched.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients import podman
from mcp_forge.control.render import HostPaths, podman_pod_name, render_podman
from mcp_forge.errors import PodmanError

if TYPE_CHECKING:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

log = logging.getLogger(__name__)

STORE_LABEL = "mcpforge.dev/store"


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
    owned = {
        str(s.status.get("podName") or podman_pod_name(s.namespace, s.name))
        for s in await runtime.list()
    }
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
