"""A node's snapshot archives that no KernelSession holds are removed (issue 27): on a
cluster, a snapshot goes with its session.

    mcp-forge snapshot-sweeper --node NODE --checkpoints /checkpoints [--every 60] [--grace 300]

The kubelet writes each checkpoint into its checkpoints directory as
`checkpoint-<pod>_<namespace>-<container>-<time>.tar` and never removes it. The node's
restore handler (images/node/runc-restore) removes an archive once a pod has tried to
wake from it; this removes the others, on each node (a DaemonSet of
manifests/overlays/snapshots, the directory mounted): an archive of a session's kernel
(pod `ks-<session>`, container `kernel`) that no KernelSession's `status.snapshot` names
on this node, once it is `grace` seconds old. Its session was deleted, or dropped the
snapshot (expired, past `snapshot_max_age`, which the operator applies), or the operator
stopped between the checkpoint and its status write (the grace covers that write). A
checkpoint of a session's kernel taken by someone else is removed the same way.

Nothing else in the directory is touched, nothing is read or followed, and a round whose
list of sessions fails removes nothing.

Each round also says how large the archives sessions hold are: a ConfigMap of the
sweeper's namespace (`sizes_name(node)`, its `sizes.json` an object of archive names to
bytes), written when it changes. The operator reads it into `status.snapshot.size`
(control/snapshots.py): nothing else that may read the node's files can tell it, and
the sweeper writes nothing but that ConfigMap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_forge.clients.kube import Kube
from mcp_forge.control.render import CONTAINER
from mcp_forge.errors import ApiError

log = logging.getLogger(__name__)

GRACE = 300.0  # seconds an archive no session holds is kept (its status write may follow)
# Seconds the operator hands one archive to further forks of a batch (control/forking.py):
# a grace shorter than this and a minute could remove it under them.
SHARED_REUSE = 120.0
GRACE_MIN = SHARED_REUSE + 60.0
EVERY = 60.0  # seconds between two rounds
PAGE = 500  # KernelSessions a list asks for at once
# A pod name has no "_", a namespace neither; the time (RFC 3339) has no `-kernel-`.
ARCHIVE = re.compile(
    rf"checkpoint-(?P<pod>ks-[a-z0-9.-]+)_(?P<namespace>[a-z0-9-]+)-{CONTAINER}-[0-9TZ:+.-]+\.tar"
)


SIZES_PREFIX = "mcpforge-snapshots-"  # + the node's name: its ConfigMap of sizes
SIZES_KEY = "sizes.json"
SIZES_MAX = 4000  # archives one node's ConfigMap names (each ~100 bytes: under its 1 MiB)
NAME_MAX = 253  # a ConfigMap's name (a DNS subdomain, as a node's)
REWRITE_EVERY = 10  # rounds: a node's ConfigMap is written again after so many unchanged


@dataclass(frozen=True)
class Archive:
    name: str  # in the checkpoints directory
    namespace: str
    pod: str
    size: int
    mtime: float


def archives(directory: Path) -> list[Archive]:
    """The archives of sessions' kernels in `directory`: regular files (never followed)
    named as the kubelet names a `kernel` container's checkpoint of a pod `ks-...`."""
    found = []
    for name in sorted(os.listdir(directory)):
        match = ARCHIVE.fullmatch(name)
        if match is None:
            continue
        try:
            st = os.lstat(directory / name)
        except FileNotFoundError:
            continue  # woken from meanwhile
        if stat.S_ISREG(st.st_mode):
            found.append(Archive(name, match["namespace"], match["pod"], st.st_size, st.st_mtime))
    return found


def held(kube: Kube, node: str) -> set[str]:
    """The archives on `node` that KernelSessions' statuses name, a page at a time (a
    list from the API server's cache would ignore the limit and come whole, for every
    node each minute). ApiError if the list fails: then nothing may be removed."""
    names: set[str] = set()
    after = None
    while True:
        page = kube.list("KernelSession", "", limit=PAGE, after=after)
        for item in page.get("items") or []:
            snap = (item.get("status") or {}).get("snapshot") or {}
            if snap.get("node") == node and snap.get("archive"):
                names.add(str(snap["archive"]))
        after = (page.get("metadata") or {}).get("continue")
        if not after:
            return names


def stale(found: list[Archive], holding: set[str], now: float, *, grace: float) -> list[Archive]:
    """Which of `found` go: those no session holds, `grace` seconds old or more."""
    return [a for a in found if a.name not in holding and now - a.mtime >= grace]


def sizes_name(node: str) -> str:
    """The name of `node`'s ConfigMap of sizes: a long node name is cut, and told apart
    from another cut alike by a hash of it."""
    name = f"{SIZES_PREFIX}{node}"
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{name[: NAME_MAX - 11].rstrip('.-')}-{digest}"


def sizes(found: list[Archive], holding: set[str]) -> str:
    """`sizes.json` for the archives of `found` that sessions hold: name -> bytes."""
    held_ones = sorted((a.name, a.size) for a in found if a.name in holding)[:SIZES_MAX]
    return json.dumps(dict(held_ones), separators=(",", ":"), sort_keys=True)


class Reporter:
    """Writes a node's ConfigMap of sizes into `namespace` when what it says changes, and
    every REWRITE_EVERY reports whatever it says (the first one too): a ConfigMap deleted
    or written over meanwhile is put right."""

    def __init__(self, kube: Kube, namespace: str, node: str) -> None:
        self.kube, self.namespace, self.name = kube, namespace, sizes_name(node)
        self.written: str | None = None
        self.unwritten = 0  # reports since the last write

    def report(self, text: str) -> None:
        self.unwritten += 1
        if text == self.written and self.unwritten < REWRITE_EVERY:
            return
        patch = {"data": {SIZES_KEY: text}}
        try:
            self.kube.patch("ConfigMap", self.namespace, self.name, patch)
        except ApiError as exc:
            if not exc.not_found:
                raise
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": self.name,
                    "namespace": self.namespace,
                    "labels": {
                        "app.kubernetes.io/name": "mcp-forge",
                        "app.kubernetes.io/component": "snapshot-sweeper",
                    },
                },
                **patch,
            }
            _, created = self.kube.ensure(body, likely_new=True)
            if not created:  # made meanwhile (a sweeper before this one, restarted)
                self.kube.patch("ConfigMap", self.namespace, self.name, patch)
        self.written, self.unwritten = text, 0


def sweep(
    kube: Kube,
    node: str,
    directory: Path,
    *,
    grace: float = GRACE,
    reporter: Reporter | None = None,
) -> list[Archive]:
    """One round: the archives removed. The directory is listed before the sessions, so
    an archive made after the list of sessions is not judged by it. One that cannot be
    removed is logged, and the others still are. With `reporter`, the sizes of those
    sessions hold are written (an empty directory says so too)."""
    found = archives(directory)
    if not found:
        _report(reporter, sizes([], set()))
        return []
    holding = held(kube, node)
    removed = []
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for archive in stale(found, holding, time.time(), grace=grace):
            try:
                os.unlink(archive.name, dir_fd=fd)
            except FileNotFoundError:
                continue  # woken from meanwhile
            except OSError as exc:
                log.warning("could not remove %s: %s", archive.name, exc.strerror)
                continue
            removed.append(archive)
            log.info(
                "removed %s (%d bytes, %s/%s): no session holds it",
                archive.name, archive.size, archive.namespace, archive.pod[3:],
            )  # fmt: skip
    finally:
        os.close(fd)
    _report(reporter, sizes(found, holding))  # the held ones: none was removed
    return removed


def _report(reporter: Reporter | None, text: str) -> None:
    """Sizes are for show: a report that fails is logged, and removals go on."""
    if reporter is None:
        return
    try:
        reporter.report(text)
    except ApiError as exc:
        log.warning("sizes not reported in ConfigMap %s: %s", reporter.name, exc)


def run(
    kube: Kube,
    node: str,
    directory: Path,
    *,
    every: float = EVERY,
    grace: float = GRACE,
    namespace: str = "",
    stop: threading.Event | None = None,
) -> None:
    """A round every `every` seconds until `stop` (or SIGTERM, SIGINT run from the main
    thread). A round that fails is logged and the next one tries again. With
    `namespace`, each round writes the node's ConfigMap of sizes there."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():

        def stopped(number: int, _: Any) -> None:
            stop.set()

        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, stopped)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoints directory at {directory}")
    log.info("sweeping %s for node %s every %.0f s", directory, node, every)
    reporter = Reporter(kube, namespace, node) if namespace else None
    while not stop.is_set():
        try:
            sweep(kube, node, directory, grace=grace, reporter=reporter)
        except (ApiError, OSError) as exc:
            log.warning("snapshot sweep: %s: again in %.0f s", exc, every)
        stop.wait(every)
