"""The nodes' snapshot key, placed on every node from one Secret (issue 27).

    mcp-forge snapshot-key --source /key/snapshot.key --target /node/snapshot.key [--every 30]

Snapshots stored in claims (MCPFORGE_SNAPSHOT_STORE=claim) are signed by the node that
stores them and checked by the node that wakes from them, with a key every node holds:
the restore handler's `/etc/mcp-forge/snapshot.key` (images/node/runc-restore/store.go:
a regular file of root's, mode 0600, at least 32 bytes once trimmed). A DaemonSet of
manifests/overlays/snapshots runs this on every node: it reads the key from the Secret
`mcp-forge-snapshot-key` (mounted, optional) and writes it where the handler reads it,
then looks again every `every` seconds (a Secret's new value reaches its pods within the
kubelet's sync period), so a node added later gets the key, and a key changed in the
Secret reaches every node.

What it writes is the Secret's, checked first as the handler checks it: a key shorter
than 32 bytes, or larger than the handler reads (4096 bytes), or not ASCII (where
Python's and Go's trims of white space differ), is refused and the node's
key left as it is, said in the log. So is a Secret without the key (none made, or
removed): the node keeps what it has. A key the node already has is not written again.
It is written whole or not at all: a new file of root's, 0600, of a random name beside
the old one (one a killed placer left is removed once 5 minutes old), synced, then
renamed over it, so the handler never reads half of a key, and a link
planted at the target is replaced, not followed. The key itself is never logged: only
the first 12 hex digits of its SHA-256, to tell nodes' keys apart.

A rotation keeps what was stored: the Secret's `previous.key`, a second key the nodes
accept but never sign with (the new key at a rotation's first step, the old one at its
second), is placed beside the key as `<target>.previous` (first, so that a node never
signs with a key without the other beside it), and the handler checks stored copies
against both. Both are read from one version of the Secret (the kubelet's `..data`
resolved once). Once the Secret has a good key and no `previous.key`, the node's
previous key is removed and copies signed with it are refused (their sessions wake
afresh); a `previous.key` the handler would refuse leaves the node's as it is, said in
the log. A key changed without it loses what was stored (docs/kubernetes.md says how to
rotate, in three steps, so that no node refuses a copy another signed).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

KEY_MIN = 32  # bytes once trimmed, as the handler's keyMin
KEY_MAX = 4096  # the handler reads no more
PREVIOUS_SOURCE = "previous.key"  # the Secret's key for the key a rotation replaced


class KeyRefused(ValueError):
    """The Secret's key is not one the handler would take."""


def fingerprint(key: bytes) -> str:
    return hashlib.sha256(key.strip()).hexdigest()[:12]


def read_source(source: Path) -> bytes | None:
    """The Secret's key (None if there is none), checked as the handler checks it."""
    try:
        with source.open("rb") as f:  # the kubelet's links (..data/snapshot.key) followed
            raw = f.read(KEY_MAX + 1)
    except FileNotFoundError:
        return None
    if len(raw) > KEY_MAX:
        raise KeyRefused(f"the key in {source} is larger than {KEY_MAX} bytes")
    if not raw.isascii():  # Go's TrimSpace and Python's strip agree on ASCII only
        raise KeyRefused(f"the key in {source} is not ASCII (hex or base64, say)")
    if len(raw.strip()) < KEY_MIN:
        raise KeyRefused(f"the key in {source} holds fewer than {KEY_MIN} bytes")
    return raw


def current(target: Path) -> bytes | None:
    """The node's key as the handler would take it (None if it would take none)."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            return None
        return f.read(KEY_MAX + 1)


def place(source: Path, target: Path) -> str:
    """Write the Secret's keys at target (and its previous key beside it) where the node
    lacks them; what was done (a log line, "" if nothing). KeyRefused if the Secret's key
    is not one the handler would take: then nothing is changed."""
    source = one_version(source)
    key = read_source(source)
    if key is None:
        return f"no key in {source}: the node's keys are left as they are"
    # The previous key first: at a rotation's start a node then never holds the new key
    # without the old one beside it.
    said = [place_previous(source, target), write(target, key, "the snapshot key")]
    return "; ".join(line for line in said if line)


def one_version(source: Path) -> Path:
    """source, read through the Secret's version as it is now: the kubelet swaps its
    `..data` link to a new directory at an update, and two reads through the link could
    see two versions (a rotation's step half taken)."""
    data = source.parent / "..data"
    try:
        version = os.readlink(data)
    except OSError:
        return source  # not a kubelet's mount: the files are read as they are
    return source.parent / version / source.name


def previous_paths(source: Path, target: Path) -> tuple[Path, Path]:
    """Where the Secret's previous key is mounted and where the handler reads it."""
    return source.with_name(PREVIOUS_SOURCE), target.with_name(target.name + ".previous")


def holds(target: Path) -> str:
    """The node's keys, by fingerprint (a log line at the placer's start)."""
    key, previous = current(target), current(previous_paths(target, target)[1])
    keys = [f"{what} {fingerprint(k)}" for what, k in (("key", key), ("previous", previous)) if k]
    return f"the node holds {', '.join(keys) or 'no snapshot key'} at {target.parent}"


def place_previous(source: Path, target: Path) -> str:
    """The second key the nodes accept, while the Secret has it: stored copies signed
    with it wake. The Secret's key is good here, so a Secret without a previous key says
    the rotation is over, and the node's previous key goes. One the handler would refuse
    (a step typed wrong) leaves the node's as it is: removing it would lose the copies
    signed with it."""
    source, target = previous_paths(source, target)
    try:
        key = read_source(source)
    except KeyRefused as exc:
        return f"the node's previous key is left as it is: {exc}"
    if key is not None:
        return write(target, key, "the previous snapshot key")
    old = current(target)
    try:
        target.unlink()
    except FileNotFoundError:
        return ""
    what = f" {fingerprint(old)}" if old is not None else ""
    return f"removed the previous snapshot key{what} at {target}: the Secret has none"


def write(target: Path, key: bytes, what: str) -> str:
    """Write key at target whole, root's, 0600, unless it is there already."""
    if current(target) == key:
        return ""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sweep(target)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # 0600
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return f"placed {what} {fingerprint(key)} at {target}"


STALE = 300.0  # seconds: a scratch file older is one a killed placer left


def sweep(target: Path) -> None:
    """Remove the scratch files of placers killed between their write and its rename
    (another's, at most seconds old, is left to it)."""
    now = time.time()
    for left in target.parent.glob(f".{target.name}.*"):
        with contextlib.suppress(OSError):
            if now - left.lstat().st_mtime > STALE:
                left.unlink()


def run(source: Path, target: Path, *, every: float, stop: threading.Event | None = None) -> None:
    """Place the key now and every `every` seconds until stopped (SIGTERM, or `stop`).
    A refused key or a failed write is logged and tried again the next round."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("%s", holds(target))  # what a node has, even if this start changes nothing
    said = ""
    while not stop.is_set():
        try:
            line = place(source, target)
        except (KeyRefused, OSError) as exc:
            line = f"the node's keys are left as they are: {exc}"
        if line and line != said:  # a state, said once until it changes
            level = logging.WARNING if "left as" in line else logging.INFO
            log.log(level, "%s", line)
        said = line or said
        stop.wait(every)
