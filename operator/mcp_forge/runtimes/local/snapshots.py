"""Live snapshots of a local kernel (issue 27): its container checkpointed by CRIU, through
Podman, into an archive the session owns; restored from it into a pod of the session's.

`take` checkpoints a kernel's container into an archive (`podman container checkpoint
--export`): its memory, threads, open files and sockets, and what it wrote outside its
volumes. `bring_back` restores an archive into a live pod as a new container of it
(`podman container restore --import --pod`), in that pod's user namespace: CRIU 4.2.1 as
images/criu/build patches it (restore-into-userns.patch) makes the restored task inside
that namespace, as the container's was made. The pod must be alive: a kube-played pod
stops with its last container, so the kernel's pod keeps a second one while the kernel
sleeps.

An archive names the pod it came from: its infra container (whose namespaces the kernel
joined), the user namespace by that infra's PID, and the uid and gid maps. Podman 4.3.1
moves a restored container's network, IPC and UTS namespaces to the new pod but not its
user namespace, so an archive for another pod (a fork; the session's pod played again) is
`retarget`ed first: those names rewritten for the target, and the CRIU images given to the
target namespace's root, who opens them while restoring. Nothing in the archive is
unpacked or run: the images (the kernel's memory, untrusted) are copied as they are,
under a size bound; only Podman's own two small JSON files are read.

Uncompressed (`--compress=none`): a retarget streams the archive once, and a restore does
not wait for a decompression; CRIU leaves out the pages the kernel never touched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import tarfile
import time
from pathlib import Path
from typing import Any

from mcp_forge.clients import podman
from mcp_forge.errors import ForgeError, PodmanError

CONFIG = "config.dump"  # Podman's container config (its namespaces by container id)
SPEC = "spec.dump"  # the OCI spec (namespace paths, id maps)
DUMP_LIMIT = 4_000_000  # either JSON file: a few KB in practice
CHECKPOINT_DIR = "checkpoint"  # CRIU's images
PROC_NS = {"network": "net", "mount": "mnt"}  # the OCI spec's names -> /proc/PID/ns/


class SnapshotError(ForgeError):
    """A snapshot could not be taken, read or restored; says which and why."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A live pod to restore into: its ids, its infra's PID (the user namespace to join
    is /proc/PID/ns/user) and the host ids its namespace maps 0 to, over `size` ids."""

    pod_id: str
    infra_id: str
    infra_pid: int
    uid: int
    gid: int
    size: int
    # (the source session's directory, the target's): a fork's mounts are its own files
    moved: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Taken:
    archive: Path
    size: int  # bytes
    seconds: float


async def take(
    container: str, archive: Path, *, leave_running: bool = False, timeout: float = 300.0
) -> Taken:
    """Checkpoint `container` into `archive` (replaced). Without `leave_running` the
    container stops, and its memory is freed."""
    started = time.monotonic()
    part = archive.with_name(archive.name + ".part")
    part.unlink(missing_ok=True)
    args = ["container", "checkpoint", f"--export={part}", "--compress=none"]
    if leave_running:
        args.append("--leave-running")
    try:
        await podman.run(*args, container, timeout=timeout)
    except PodmanError as exc:
        part.unlink(missing_ok=True)
        said = await asyncio.to_thread(criu_errors, exc.stderr)
        raise SnapshotError(f"could not checkpoint the kernel: {said or exc}") from exc
    return Taken(archive, _settle(part, archive), time.monotonic() - started)


async def keep(container: str, folder: Path, *, timeout: float = 300.0) -> Taken:
    """Checkpoint `container` in place (`--keep`): CRIU's images stay in its Podman
    directory (`folder`, from `images_of`: Taken.archive), the container stops and its
    memory is freed. `restore_kept` brings it back, in its pod, which must be alive."""
    started = time.monotonic()
    try:
        await podman.run("container", "checkpoint", "--keep", container, timeout=timeout)
    except PodmanError as exc:
        said = await asyncio.to_thread(criu_errors, exc.stderr)
        raise SnapshotError(f"could not checkpoint the kernel: {said or exc}") from exc
    return Taken(folder, await asyncio.to_thread(_size_of, folder), time.monotonic() - started)


async def restore_kept(container: str, folder: Path, *, timeout: float = 300.0) -> float:
    """Restore `container` from the images `keep` left in `folder`; the seconds it took.
    The folder is opened (0755) to the pod's namespace root, who reads them (they are
    0644; the folder's parent is that root's alone, 0700)."""
    started = time.monotonic()
    await asyncio.to_thread(_open_to_namespace, folder)
    try:
        await podman.run("container", "restore", "--keep", container, timeout=timeout)
    except PodmanError as exc:
        said = await asyncio.to_thread(criu_errors, exc.stderr)
        raise SnapshotError(f"could not restore the kernel: {said or exc}") from exc
    return time.monotonic() - started


def images_of(container: str, inspected: dict[str, Any] | None) -> Path:
    """Where Podman keeps a container's checkpoint images, from its inspect data
    (Podman's API: a few ms, where `podman container inspect` takes 50)."""
    static = str((inspected or {}).get("StaticDir") or "")
    if not static:
        raise SnapshotError(f"container {container} has no directory of Podman's")
    return Path(static) / CHECKPOINT_DIR


def _open_to_namespace(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_uid != 0:
            raise SnapshotError(f"{folder} is not root's: its images are not restored")
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


def _size_of(folder: Path) -> int:
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder) if e.is_file())


def _settle(part: Path, archive: Path) -> int:
    """The finished archive in its place, root's alone; its size."""
    os.chmod(part, 0o600)
    part.replace(archive)
    return archive.stat().st_size


async def target_of(pod: str, idmap: dict[str, int]) -> Target:
    """The live pod `pod` (name or id) as a Target, with the session's id map."""
    found = await podman.run_json("pod", "inspect", pod)
    found = found[0] if isinstance(found, list) else found
    infra = str(found.get("InfraContainerID") or "")
    if not infra:
        raise SnapshotError(f"pod {pod} has no infra container to restore into")
    state = await podman.run_json("container", "inspect", infra)
    pid = int((state[0] if isinstance(state, list) else state)["State"]["Pid"] or 0)
    if pid <= 0:
        raise SnapshotError(f"pod {pod} is not running: nothing to restore into")
    return Target(str(found["Id"]), infra, pid, idmap["uid"], idmap["gid"], idmap["size"])


async def restore(
    archive: Path, to: Target, name: str, *, limit: int, consume: bool = False
) -> float:
    """Restore `archive` into the pod `to` as container `name` (which must not exist);
    the seconds it took. Retargeted in place when `consume` allows it (the archive is
    not wanted after: a resume) and it can be, else through a copy beside it."""
    started = time.monotonic()
    if consume and await asyncio.to_thread(retarget_in_place, archive, to, limit):
        await bring_back(archive, to, name)
        return time.monotonic() - started
    copy = archive.with_name(f"{archive.name}.{to.pod_id[:12]}")
    try:
        await _copy_retargeted(archive, copy, to, limit=limit)
        await bring_back(copy, to, name)
    finally:
        copy.unlink(missing_ok=True)
    return time.monotonic() - started


async def _copy_retargeted(archive: Path, copy: Path, to: Target, *, limit: int) -> None:
    """`copy`: `archive` retargeted for `to`. Copied by the kernel (copy_file_range) and
    retargeted in itself where that can be (half the time of a rewrite through tarfile);
    rewritten (`retarget`) where it cannot."""
    copied = await asyncio.to_thread(_copy_file, archive, copy, limit)
    if copied and await asyncio.to_thread(retarget_in_place, copy, to, limit):
        return
    await retarget(archive, copy, to, limit=limit)


def _copy_file(src: Path, dst: Path, limit: int) -> bool:
    """`src` copied to a new `dst` (root's, 0600); False, and no `dst`, over `limit`."""
    if src.stat().st_size > limit:
        return False
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
        left = os.fstat(f.fileno()).st_size
        while left > 0:
            copied = os.copy_file_range(f.fileno(), out.fileno(), min(left, 1 << 30))
            if copied == 0:
                break
            left -= copied
    return True


def retarget_in_place(archive: Path, to: Target, limit: int) -> bool:
    """`retarget`'s work done in the archive itself, when that can be: Podman's two files
    rewritten no longer than they were (then padded with blanks, which JSON allows), and
    CRIU's images left root's but their folder opened (0755) to the target namespace's
    root, who reads them (they are 0644; runc reads its own files there as root). False,
    and the archive as it was, when the rewrite would be longer or an image is not
    readable so; True once done."""
    try:
        return _in_place(archive, to, limit)
    except (tarfile.TarError, EOFError) as exc:
        raise SnapshotError(f"the snapshot is damaged: {exc}") from None


def _in_place(archive: Path, to: Target, limit: int) -> bool:
    if archive.stat().st_size > limit:
        raise SnapshotError(
            f"the snapshot is {archive.stat().st_size} bytes, over its {limit} limit"
        )
    with tarfile.open(archive, "r:") as tar:
        members = tar.getmembers()
        for member in members:
            _check(member)
        config, spec = _dumps(tar, members)
    new = {CONFIG: _for_config(config, to), SPEC: _for_spec(spec, config, to)}
    writes: list[tuple[int, bytes]] = []
    for member in members:
        name = _name(member)
        if name in new:
            if len(new[name]) > member.size:
                return False
            writes.append((member.offset_data, new[name].ljust(member.size)))
        elif name == CHECKPOINT_DIR and member.isdir():
            writes.append(_opened(archive, member))
        elif name.endswith(".img") and member.isfile() and not member.mode & 0o004:
            return False  # an image CRIU reads in the namespace (runc's files it reads as root)
    fd = os.open(archive, os.O_RDWR | os.O_NOFOLLOW)
    with os.fdopen(fd, "r+b") as f:
        for offset, data in writes:
            f.seek(offset)
            f.write(data)
    return True


def _opened(archive: Path, folder: tarfile.TarInfo) -> tuple[int, bytes]:
    """The images' folder's header block, its mode made 0755 (and its checksum redone)."""
    at = folder.offset_data - tarfile.BLOCKSIZE  # the ustar block, after any PAX block
    with open(archive, "rb") as f:
        f.seek(at)
        block = bytearray(f.read(tarfile.BLOCKSIZE))
    block[100:108] = b"%07o\0" % (folder.mode | 0o755)
    block[148:156] = b" " * 8  # the checksum counts its own field as blanks
    block[148:156] = b"%06o\0 " % sum(block)
    return at, bytes(block)


async def bring_back(archive: Path, to: Target, name: str, *, timeout: float = 300.0) -> float:
    """Restore `archive`, retargeted for the pod `to`, into it as container `name` (which
    must not exist); the seconds it took."""
    started = time.monotonic()
    args = ["container", "restore", f"--import={archive}", f"--pod={to.pod_id}", f"--name={name}"]
    try:
        await podman.run(*args, timeout=timeout)
    except PodmanError as exc:
        said = await asyncio.to_thread(criu_errors, exc.stderr)
        raise SnapshotError(f"could not restore the kernel: {said or exc}") from exc
    return time.monotonic() - started


def criu_errors(stderr: str, most: int = 4) -> str:
    """CRIU's own error lines, from the log Podman names in `stderr` ("" if none)."""
    found = re.search(r"log file: (/\S+\.log)", stderr)
    if found is None:
        return ""
    try:
        with open(found.group(1), errors="replace") as log:
            lines = [line.strip() for line in log if "Error (" in line]
    except OSError:
        return ""
    return "; ".join(lines[-most:])[-800:]


async def retarget(src: Path, dst: Path, to: Target, *, limit: int) -> None:
    """Write `dst`: the archive `src` made to restore into the pod `to` (see the module's
    text). At most `limit` bytes of archive are read."""
    await asyncio.to_thread(_retarget, src, dst, to, limit)


def _retarget(src: Path, dst: Path, to: Target, limit: int) -> None:
    try:
        _rewrite(src, dst, to, limit)
    except (tarfile.TarError, EOFError) as exc:
        raise SnapshotError(f"the snapshot is damaged: {exc}") from None


def _rewrite(src: Path, dst: Path, to: Target, limit: int) -> None:
    if src.stat().st_size > limit:
        raise SnapshotError(f"the snapshot is {src.stat().st_size} bytes, over its {limit} limit")
    with tarfile.open(src, "r:") as tar:
        members = tar.getmembers()
        for member in members:  # all of it checked before anything is written
            _check(member)
        config, spec = _dumps(tar, members)
        rewritten = {CONFIG: _for_config(config, to), SPEC: _for_spec(spec, config, to)}
        part = dst.with_name(dst.name + ".part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:") as out:
                for member in members:
                    _copy(tar, out, member, rewritten, to)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    part.replace(dst)


def _check(member: tarfile.TarInfo) -> None:
    """Only files and folders, named inside the archive: no link, device or FIFO."""
    name = _name(member)
    if not (member.isfile() or member.isdir()):
        raise SnapshotError(f"the snapshot holds {name[:100]!r}, neither a file nor a folder")


def _dumps(
    tar: tarfile.TarFile, members: list[tarfile.TarInfo]
) -> tuple[dict[str, Any], dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for member in members:
        name = _name(member)
        if name not in (CONFIG, SPEC):
            continue
        if not member.isfile() or member.size > DUMP_LIMIT:
            raise SnapshotError(
                f"the snapshot's {name} is not a file of at most {DUMP_LIMIT} bytes"
            )
        data = tar.extractfile(member)
        assert data is not None
        try:
            found[name] = json.loads(data.read())
        except ValueError as exc:
            raise SnapshotError(f"the snapshot's {name} is not JSON: {exc}") from None
    missing = [n for n in (CONFIG, SPEC) if not isinstance(found.get(n), dict)]
    if missing:
        raise SnapshotError(f"not a Podman checkpoint: no {' or '.join(missing)} in it")
    return found[CONFIG], found[SPEC]


def _name(member: tarfile.TarInfo) -> str:
    """A member's name without "./"; one that could reach outside the archive is refused."""
    name = member.name.removeprefix("./")
    parts = Path(name).parts
    if name.startswith("/") or ".." in parts:
        raise SnapshotError(f"the snapshot holds an entry named {member.name[:100]!r}")
    return name


def _for_config(config: dict[str, Any], to: Target) -> bytes:
    """config.dump for `to`: the old infra's id and the old pod's, wherever they are
    (namespace owners, the shm path), and the id maps."""
    infra = str(config.get("userNsCtr") or config.get("netNsCtr") or "")
    pod = str(config.get("pod") or "")
    if not infra or not pod:
        raise SnapshotError("the snapshot is not of a pod's container: it names no infra")
    text = json.dumps(config).replace(infra, to.infra_id).replace(pod, to.pod_id)
    new = json.loads(text)
    maps = new.get("idMappingsOptions") or {}
    for key, host in (("UIDMap", to.uid), ("GIDMap", to.gid)):
        maps[key] = [{"container_id": 0, "host_id": host, "size": to.size}]
    for key in ("AdditionalUIDMappings", "AdditionalGIDMappings"):
        maps.pop(key, None)
    _move_mounts((new.get("spec") or {}).get("mounts") or [], to)
    return _compact(new)


def _for_spec(spec: dict[str, Any], config: dict[str, Any], to: Target) -> bytes:
    """spec.dump for `to`: namespaces by the target infra's PID, the target's id maps."""
    linux = spec.get("linux") or {}
    for ns in linux.get("namespaces") or []:
        if ns.get("path"):
            kind = PROC_NS.get(ns["type"], ns["type"])
            ns["path"] = f"/proc/{to.infra_pid}/ns/{kind}"
    linux["uidMappings"] = [{"containerID": 0, "hostID": to.uid, "size": to.size}]
    linux["gidMappings"] = [{"containerID": 0, "hostID": to.gid, "size": to.size}]
    infra, pod = str(config.get("userNsCtr") or ""), str(config.get("pod") or "")
    new = json.loads(json.dumps(spec).replace(infra, to.infra_id).replace(pod, to.pod_id))
    _move_mounts(new.get("mounts") or [], to)
    return _compact(new)


def _move_mounts(mounts: list[dict[str, Any]], to: Target) -> None:
    """Mounts of the source session's files (below its directory) made the target's."""
    if to.moved is None:
        return
    old, new = to.moved
    for mount in mounts:
        source = str(mount.get("source") or "")
        if source == old or source.startswith(old + "/"):
            mount["source"] = new + source[len(old) :]


def _compact(obj: Any) -> bytes:
    """JSON as Go writes it (no blanks), so that a rewrite is no longer than Podman's."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _copy(
    tar: tarfile.TarFile,
    out: tarfile.TarFile,
    member: tarfile.TarInfo,
    rewritten: dict[str, bytes],
    to: Target,
) -> None:
    name = _name(member)
    if name in rewritten:
        data = rewritten[name]
        new = tarfile.TarInfo(member.name)
        new.size, new.mode, new.mtime = len(data), member.mode, member.mtime
        out.addfile(new, io.BytesIO(data))
        return
    if name == CHECKPOINT_DIR or name.startswith(CHECKPOINT_DIR + "/"):
        member.uid, member.gid = to.uid, to.gid  # CRIU opens them as the namespace's root
    out.addfile(member, tar.extractfile(member) if member.isfile() else None)
