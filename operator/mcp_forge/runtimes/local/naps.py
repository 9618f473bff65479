"""A local session suspended with its memory, and resumed with it (issue 27; `Naps`, a
part of LocalRuntime).

Suspending (idleAction Suspend, operatingMode Suspended) a Ready kernel: the gateways of
this process let go of it (CRIU cannot take along a Unix socket whose other end is outside
the pod, and the Jupyter channels are such sockets), and its container is checkpointed.
By default in place (`_keep`): a keeper container holds the pod up, CRIU's images stay in
the container's Podman directory (root's, where no pod mounts), and a resume restores the
container there. With snapshot_in_pod off (`_export`), into an archive in the session's
directory (snapshots.py: root's, 0600), and the pod is removed; a resume makes the pod
again, its infra alone (`podman pod create` with the namespaces, user namespace and labels
`kube play` gives it), and restores the archive into it, in the session's own user
namespace. Either way its workspace stays, and so does its /tmp, a tmpfs the kernel's
open files may be in (memory, bounded by its size), and the restored kernel must answer
kernel_info. Whatever fails on the way, the session starts afresh and says that its
variables were lost, and why; the snapshot is gone either way, so a broken one is never
tried twice. A session keeps one snapshot, the newest, and loses it with itself, or when
its pod's spec changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from mcp_forge.api import status as st
from mcp_forge.api.connection import BRIDGE_SOCKET, ConnectionInfo
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import stamp
from mcp_forge.clients import podman
from mcp_forge.control.render import (
    CRIU_ANNOTATION,
    CRIU_CONFIG,
    SECCOMP_PROFILE,
    SECCOMP_PROFILE_ROOT,
    podman_pod_name,
)
from mcp_forge.errors import ForgeError, SessionNotReady
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.local import criu, orphans, snapshots, volumes
from mcp_forge.runtimes.local.kernelpods import KernelPods, unsealed, userns_flag

log = logging.getLogger(__name__)

SNAPSHOT = "snapshot.tar"
KEEPER = "keeper"  # the container that holds a suspended kernel's pod up
KEEPER_UID = 65534  # nobody: not the kernel's user, within every session's id map
KEEPER_USER = f"{KEEPER_UID}:{KEEPER_UID}"
# CRIU's words for a socket whose peer is outside the container: a gateway's connection
# that is still closing (ZMQ closes its sockets in its own thread). Tried again meanwhile.
EXTERNAL_SOCKET = re.compile(r"Unix socket \d+ not found|External socket")
CLOSING = (0.1, 0.3, 0.6, 1.0, 2.0)  # seconds between the tries
TEMPORARY = re.compile(r"\.b\d+")  # the bridge socket's name as the kernel first binds it

Release = Callable[[KernelSession], Awaitable[None]]
Become = Callable[[ConnectionInfo], Awaitable[None]]  # makes a restored kernel a fork


class Naps(KernelPods):
    """Suspend with memory, resume from it (see the module's text)."""

    # Gateways in this process, each told to close its connections to a kernel that
    # is about to be checkpointed (Gateway adds its own).
    releasers: list[Release]
    _criu: tuple[bool, str] | None = None

    async def criu_usable(self) -> tuple[bool, str]:
        """(whether snapshots can be taken here, why not): asked of CRIU once."""
        if not self.settings.snapshots:
            return False, "live snapshots are off (MCPFORGE_SNAPSHOTS=false)"
        if self._criu is None:
            self._criu = await criu.probe()
        return self._criu

    def _snapshot(self, session: KernelSession) -> Path:
        return self._dir(session) / SNAPSHOT

    async def _nap(self, session: KernelSession) -> str | None:
        """Checkpoint the kernel with its memory; None once done. Else why not: the
        kernel is left as it was, or, if it was checkpointed and the snapshot could not
        be kept, stopped with its memory lost (the caller goes on as for a suspend
        without memory, which says so, and removes the pod)."""
        usable, why = await self.criu_usable()
        if not usable:
            return why
        for release in self.releasers:
            await release(session)
        in_pod = self.settings.snapshot_in_pod
        try:
            taken = await (self._keep(session) if in_pod else self._export(session))
        except ForgeError as exc:  # the keeper, the checkpoint: the kernel runs on
            log.warning("session %s: %s", session.name, exc)
            return str(exc)
        if taken.size > self.settings.snapshot_max:
            await asyncio.to_thread(self._snapshot(session).unlink, True)
            limit = self.settings.snapshot_max
            return f"its snapshot was {taken.size} bytes, over the {limit} kept"
        seconds = round(taken.seconds, 3)
        self._patch(
            session,
            snapshot={"size": taken.size, "takenAt": stamp(), "seconds": seconds, "inPod": in_pod},
        )
        log.info("session %s: suspended with its memory (%d bytes)", session.name, taken.size)
        return None

    async def _keep(self, session: KernelSession) -> snapshots.Taken:
        """In its pod: a keeper holds the pod up (a played pod stops with its last
        container; it takes a PID no thread of the live kernel holds), and the kernel
        is checkpointed in place. The keeper stays after a resume (its removal cost a
        resume 0.1 s), and the next suspend finds it; it goes when the kernel dies and
        no new one comes at once (drop_keeper), so that the pod stops as before."""
        keeper = self._keeper(session)
        if not await self._keeper_fit(keeper):
            await self._start_keeper(session, keeper)
        container, folder = self.container_name(session), await self.kept_images(session)
        try:
            return await self._checkpoint(lambda: snapshots.keep(container, folder))
        except BaseException:
            await podman.run("rm", "-f", "-t", "0", keeper, check=False)
            raise

    def _keeper(self, session: KernelSession) -> str:
        return f"{self.pod_name(session)}-{KEEPER}"

    async def drop_keeper(self, session: KernelSession) -> None:
        """The session's keeper removed, if it has one."""
        keeper = self._keeper(session)
        if await self.containers.inspect(keeper) is not None:
            await podman.run("rm", "-f", "-t", "0", keeper, check=False)

    async def kept_images(self, session: KernelSession) -> Path:
        """Where the session's kernel's images are kept in place (its Podman directory)."""
        container = self.container_name(session)
        return snapshots.images_of(container, await self.containers.inspect(container))

    async def _keeper_fit(self, keeper: str) -> bool:
        """Whether `keeper` runs, as nobody (one an older gateway left, as the kernel's
        user, is replaced)."""
        found = await self.containers.inspect(keeper) or {}
        user = (found.get("Config") or {}).get("User")
        return bool((found.get("State") or {}).get("Running")) and user == KEEPER_USER

    async def _start_keeper(self, session: KernelSession, keeper: str) -> None:
        """The keeper: the kernel's image asleep, with nothing, out of the kernel's
        reach though it lives beside it: as nobody (the kernel, uid 1000, can neither
        signal it nor write its memory through /proc), under the kernel's own seccomp
        profile and CRIU options (whatever the image's annotations say), on a sliver of
        a CPU."""
        profile = Path(SECCOMP_PROFILE_ROOT) / SECCOMP_PROFILE
        async with self._playing():  # a container in the pod's user namespace, as a play
            await podman.run(
                "run", "-d", "--replace", f"--pod={self.pod_name(session)}", f"--name={keeper}",
                f"--user={KEEPER_USER}", "--read-only", "--cap-drop=all",
                "--security-opt=no-new-privileges", f"--security-opt=seccomp={profile}",
                f"--annotation={CRIU_ANNOTATION}={CRIU_CONFIG}", "--memory=32m",
                "--pids-limit=8", "--cpus=0.05", session.spec.image, "sleep", "infinity",
                timeout=self.settings.podman_timeout,
            )  # fmt: skip

    async def _export(self, session: KernelSession) -> snapshots.Taken:
        """Out of its pod: the kernel checkpointed into an archive in the session's
        directory, and its pod removed."""
        archive = self._snapshot(session)
        taken = await self._checkpoint(
            lambda: snapshots.take(self.container_name(session), archive)
        )
        await self._remove_pod(session)
        return taken

    async def _checkpoint(self, take: Callable[[], Awaitable[snapshots.Taken]]) -> snapshots.Taken:
        """`take`, tried again while a gateway's connection is still closing."""
        for pause in (*CLOSING, None):
            try:
                return await take()
            except snapshots.SnapshotError as exc:
                if not EXTERNAL_SOCKET.search(str(exc)):
                    raise
                if pause is None:
                    raise snapshots.SnapshotError(
                        "a connection from outside its pod to the kernel stayed open (a "
                        "gateway of another process?): CRIU cannot take it along"
                    ) from exc
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def _forget_snapshot(self, session: KernelSession, why: str) -> None:
        """Drop the session's snapshot, if it has one (a kernel of another spec is due,
        or it was kept too long): with its pod if it is kept there, and its /tmp."""
        archive = self._snapshot(session)
        held = self._kept_in_pod(session)
        if held or await asyncio.to_thread(archive.exists):
            await asyncio.to_thread(archive.unlink, True)
            if held:
                await self._remove_pod(session)
                if self.host_paths(session).tmp:
                    await volumes.unmount(Path(str(self.host_paths(session).tmp)))
            gone = {"outcome": "Discarded", "at": stamp(), "message": why}
            self._patch(session, snapshot=None, lastRestore=gone)

    def _kept_in_pod(self, session: KernelSession) -> bool:
        """Whether the session's snapshot is its kernel's container, kept in its pod."""
        status = self.store.get(session.namespace, session.name).get("status") or {}
        return bool((status.get("snapshot") or {}).get("inPod"))

    async def _wake(self, session: KernelSession, *, wait: bool) -> None:
        """The session's kernel again: from its snapshot if it has one, else, or if that
        fails, a new one that says its variables were lost."""
        archive = self._snapshot(session)
        lost = ""
        in_pod = self._kept_in_pod(session)
        if in_pod or await asyncio.to_thread(archive.exists):
            try:
                lost = await self._try_restore(
                    session,
                    self._restore_kept(session) if in_pod else self._restore(session, archive),
                    "the kernel was restored with its memory",
                )
            finally:
                await asyncio.to_thread(archive.unlink, True)
            if not lost:
                return
        await self._cold_instead(session, lost, wait=wait)

    async def _try_restore(
        self, session: KernelSession, restore: Awaitable[None], said: str, **status: Any
    ) -> str:
        """Await `restore`: "" once the kernel answers from its snapshot (the session
        Ready, saying `said`, with `status` fields); else why not, its pod removed."""
        started = time.monotonic()
        try:
            await restore
        except (ForgeError, OSError) as exc:
            lost = f"its snapshot could not be restored ({str(exc)[:500]})"
            log.warning("session %s: %s; starting afresh", session.name, lost)
            await self._remove_pod(session)
            return lost
        seconds = round(time.monotonic() - started, 3)
        restored = {"outcome": "Restored", "at": stamp(), "seconds": seconds}
        self._patch(session, snapshot=None, lastRestore=restored, **status)
        self.mark_ready(session, said)
        return ""

    async def _cold_instead(self, session: KernelSession, lost: str, *, wait: bool) -> None:
        """A new kernel for the session, which says why its variables were lost (`lost`,
        if it had a snapshot)."""
        await self._realize(session, wait=wait)
        if lost:
            failed = {"outcome": "Failed", "at": stamp(), "message": lost}
            self._patch(session, snapshot=None, lastRestore=failed)
            if wait:
                self.mark_ready(session, f"a new kernel: its variables were lost: {lost}")

    async def _restore(
        self,
        session: KernelSession,
        archive: Path,
        *,
        consume: bool = True,
        become: Become | None = None,
        moved_from: Path | None = None,
        reason: str = "Resuming",
    ) -> None:
        """`archive` restored into a new pod of the session, in its user namespace. With
        `consume` the archive may be changed (it is not wanted after). A fork's comes
        from the session whose directory is `moved_from` (its mounts are made this
        one's), and `become` is run on the restored kernel before it must answer with
        the session's key."""
        idmap = self.idmap(session)
        if idmap is None:
            raise snapshots.SnapshotError("the session has no user namespace to restore into")
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        paths = self._prepare_dirs(session, info)  # a fresh run/ for the sockets it binds
        await self._mount(session)
        pod = podman_pod_name(session.namespace, session.name)
        self._patch(
            session, phase=st.STARTING, reason=reason, message="restoring its memory", podName=pod
        )
        labels = pod_labels(
            orphans.manifest(session, paths, orphans.store_tag(self.settings.state_dir))
        )
        async with self._playing():  # Podman's storage locks, as a play takes them
            await podman.run(
                "pod", "create", f"--name={pod}", "--share=uts,pid,ipc,net", userns_flag(idmap),
                "--network=none", "--exit-policy=stop", *(f"--label={k}={v}" for k, v in labels),
                timeout=self.settings.podman_timeout,
            )  # fmt: skip
            await podman.run("pod", "start", pod, timeout=self.settings.podman_timeout)
        to = await snapshots.target_of(pod, idmap)
        if moved_from is not None:  # a fork: its own files, not its parent's
            to = dataclasses.replace(to, moved=(str(moved_from), str(self._dir(session))))
        await snapshots.restore(
            archive,
            to,
            self.container_name(session),
            limit=self.settings.snapshot_max,
            consume=consume,  # then it goes after the restore, whatever happens
        )
        await self._answering(session, info, become)

    async def _restore_kept(self, session: KernelSession) -> None:
        """The kernel restored in place, in its pod (kept alive by the keeper, which
        stays: see _keep)."""
        key = self.store.key(session.namespace, session.name)
        info = ConnectionInfo("ipc", self.host_paths(session).run + "/kernel", key)
        self._prepare_dirs(session, info)  # a fresh run/ for the sockets it binds
        await self._mount(session)
        self._patch(session, phase=st.STARTING, reason="Resuming", message="restoring its memory")
        container, folder = self.container_name(session), await self.kept_images(session)
        await snapshots.restore_kept(container, folder)
        await self._answering(session, info)

    async def _answering(
        self, session: KernelSession, info: ConnectionInfo, become: Become | None = None
    ) -> None:
        """A restored kernel's run/ checked and sealed, its container taken on, made
        the session's (`become`, a fork's), and its answer to kernel_info waited for."""
        run = Path(info.host).parent
        await asyncio.to_thread(name_the_bridge, run / "bridge")
        self._seal(session)
        problem = unsealed(run, self.kernel_ids(session)[0])
        if problem:
            raise snapshots.SnapshotError(f"the restored kernel's sockets are not right: {problem}")
        await self._adopt(session)
        if become is not None:
            await become(info)
        conn = KernelConnection(info, max_frame=1_000_000, max_message=1_000_000)
        try:
            await conn.wait_ready(self.settings.kernel_ready_timeout)
        except (TimeoutError, ForgeError) as exc:
            raise SessionNotReady(f"the restored kernel did not answer: {exc}") from None
        finally:
            conn.close()


def name_the_bridge(folder: Path) -> None:
    """Code mode's bridge socket at its name again. The kernel binds it under a temporary
    name and renames it (kernelside/mcp_channel.py); CRIU binds it again under the name
    it was bound to. So the one socket named so in the new folder (made for the restore:
    nothing else is in it) takes the name the gateway dials."""
    try:
        bound = [p for p in folder.iterdir() if TEMPORARY.fullmatch(p.name)]
    except FileNotFoundError:
        return  # no code mode: no bridge
    if len(bound) == 1 and stat.S_ISSOCK(bound[0].lstat().st_mode):
        bound[0].rename(folder / BRIDGE_SOCKET)


def pod_labels(manifest: str) -> list[tuple[str, str]]:
    """The labels of the session's pod, as its manifest gives them to `kube play`."""
    for doc in yaml.safe_load_all(manifest):
        if doc.get("kind") == "Pod":
            return sorted((doc["metadata"].get("labels") or {}).items())
    return []
