"""A fork of a local session: new sessions made from its live snapshot, each answering
with its variables (issue 27; `Forks`, a part of LocalRuntime).

Under the parent's lock, the gateways of this process let go of its kernel, which is
checkpointed while it runs on (`--leave-running`) into an archive in the parent's
directory; the parent's workspace filesystem is frozen for the instant its image is
copied for each fork, and its /tmp copied (forkfiles.py). Each fork is then a session
of its own: a row in the store with its own key, a user namespace of its own (unless
its sharedGroup gives it the group's), its own copy of the files, given to that
namespace, and a pod into which the archive is restored (naps.py `_restore`). The
restored kernel still signs with its parent's key and holds its parent's session
variables: before it must answer, it is told, over its own channel and in its parent's
key, to take the fork's key and environment (kernelside/fork.py); from the reply on,
only the fork's key reaches it. A fork whose restore fails starts a new kernel that
says its variables were lost, as a resume does. The archive goes when all are made.

What a fork does not get new: its parent's memory, which is all of it, including any
value its code copied from a variable of the parent's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_forge.api import forks
from mcp_forge.api import status as st
from mcp_forge.api.connection import ConnectionInfo, new_key
from mcp_forge.api.kernelsession import KernelSession, load
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.errors import ForgeError, InvalidSession, SessionNotFound, SessionNotReady
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes.local import forkfiles, snapshots, volumes
from mcp_forge.runtimes.local.kernelpods import TELL_TIMEOUT
from mcp_forge.runtimes.local.lifecycle import Lifecycle
from mcp_forge.sandbox import SESSION_VARIABLE

log = logging.getLogger(__name__)


FORKS = "forks"  # under the state directory: the archives of forks under way
STALE = 3600.0  # seconds after which what a fork left is another process's debris
# Copies restored side by side. One: two at once took 11.2 s for three copies of a
# 500 MB kernel against 12.5 s one by one (the disk is the bound: each restore writes
# the archive's copy and Podman's import of it), not worth Podman's locks taken at once.
RESTORES_AT_ONCE = 1


class Forks(Lifecycle):
    """Forks of a Ready session (see the module's text). Deleting a session whose lock
    is held is LocalRuntime's, declared here for the type checker."""

    if TYPE_CHECKING:

        async def delete_locked(self, session: KernelSession) -> None: ...

        def locked_if_free(
            self, session: KernelSession
        ) -> contextlib.AbstractAsyncContextManager[bool]: ...

    async def fork(
        self, name: str, namespace: str, bodies: list[dict[str, Any]]
    ) -> list[KernelSession]:
        """Make a session of each body (api/forks.body: validated, new names) from the
        Ready session `name`'s memory and files; the new sessions, as they ended (Ready,
        restored or started afresh; Failed if even that failed). ForgeError, and no new
        session, if the parent's kernel could not be checkpointed or its files copied."""
        usable, why = await self.criu_usable()
        if not usable:
            raise ForgeError(f"session {name!r} cannot be forked here: {why}")
        self._check_names(namespace, [b["metadata"]["name"] for b in bodies])
        parent = await self.get(name, namespace)
        archive = await asyncio.to_thread(self._fork_archive)
        children: list[KernelSession] = []
        try:
            async with contextlib.AsyncExitStack() as held:
                async with self._locked(parent):
                    parent = await self.get(name, namespace)
                    phase = parent.status.get("phase")
                    if phase != st.READY:
                        raise SessionNotReady(
                            f"session {name!r} is {phase}: only a Ready one forks"
                        )
                    for body in bodies:  # each new session locked from its first moment
                        children.append(self._new_row(body))
                        await held.enter_async_context(self._locked(children[-1]))
                    await self._take_for_forks(parent, archive)
                    await self._copy_files(parent, children, archive)
                at_once = asyncio.Semaphore(RESTORES_AT_ONCE)

                async def restore(i: int, child: KernelSession) -> None:
                    # The archive may change in itself for the last restore, when no other
                    # is under way beside it.
                    last = i == len(children) - 1 and (RESTORES_AT_ONCE == 1 or i == 0)
                    async with at_once:
                        await self._restore_fork(parent, child, archive, last=last)

                await asyncio.gather(*(restore(i, c) for i, c in enumerate(children)))
        except BaseException:
            await asyncio.shield(self._unmake(children))
            raise
        finally:
            await asyncio.to_thread(archive.unlink, True)
        return [await self.get(c.name, c.namespace) for c in children]

    def _check_names(self, namespace: str, names: list[str]) -> None:
        if len(set(names)) != len(names):
            raise InvalidSession("two copies may not have one name", field="metadata.name")
        for taken in names:
            with contextlib.suppress(SessionNotFound):
                self.store.get(namespace, taken)
                raise InvalidSession(
                    f"a session named {taken!r} exists already", field="metadata.name"
                )

    def _fork_archive(self) -> Path:
        """Where a fork's archive is kept while it is under way: a folder of root's (0700)
        of its own, not the parent's (whose deletion meanwhile must not take it)."""
        folder = self.settings.state_dir / FORKS
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder / f"{uuid.uuid4().hex}.tar"

    def _new_row(self, body: dict[str, Any]) -> KernelSession:
        body["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=stamp(), generation=1)
        body["status"] = {"phase": st.PENDING, "restarts": 0}
        self.store.create(body, new_key())
        session = load(body)
        self._dir(session).mkdir(parents=True, exist_ok=True, mode=0o700)
        return session

    async def _unmake(self, children: list[KernelSession]) -> None:
        """Forks that could not be made from the snapshot: gone, with what they held."""
        for child in children:
            try:
                async with self._locked(child):
                    await self.delete_locked(child)
            except SessionNotFound:
                continue
            except ForgeError as exc:
                log.warning("could not remove the fork %s: %s", child.name, exc)

    async def _take_for_forks(self, parent: KernelSession, archive: Path) -> None:
        """The parent's kernel checkpointed into `archive`, running on."""
        for release in self.releasers:
            await release(parent)
        taken = await self._checkpoint(
            lambda: snapshots.take(self.container_name(parent), archive, leave_running=True)
        )
        if taken.size > self.settings.snapshot_max:
            limit = self.settings.snapshot_max
            raise snapshots.SnapshotError(
                f"session {parent.name!r}'s snapshot was {taken.size} bytes, over the {limit} "
                "a snapshot may take (MCPFORGE_SNAPSHOT_MAX)"
            )

    async def _copy_files(
        self, parent: KernelSession, children: list[KernelSession], archive: Path
    ) -> None:
        """Each fork's directory, user namespace, workspace and /tmp, mounted: copied
        while the parent's kernel is paused (just after its memory was taken), its
        workspace's filesystem frozen only for the first copy of its image (the others
        are copied from that one); see forkfiles.py."""
        workspace = Path(self.host_paths(parent).workspace)
        image = workspace.with_name("workspace.img")
        if volumes.mounted(workspace) != "ext4" or not await asyncio.to_thread(image.is_file):
            raise ForgeError(f"session {parent.name!r}'s workspace is not a volume of its own")
        await asyncio.to_thread(self._room_for, parent, len(children), image, archive)
        for child in children:
            self._claim_idmap(child)
            key = self.store.key(child.namespace, child.name)
            run = self.host_paths(child).run
            self._prepare_dirs(child, ConnectionInfo("ipc", run + "/kernel", key))
        images = [Path(self.host_paths(c).workspace).with_name("workspace.img") for c in children]
        tmp = Path(str(self.host_paths(parent).tmp))
        async with forkfiles.paused(self.container_name(parent), self._dir(parent)):
            async with forkfiles.frozen(workspace):
                await forkfiles.copy_image(image, images[0])
            for to in images[1:]:
                await forkfiles.copy_image(images[0], to)
            for child in children:
                await self._mount(child)  # the copy given to the fork's kernel (volumes.give)
                to_tmp = Path(str(self.host_paths(child).tmp))
                await forkfiles.copy_tmp(
                    tmp, self.kernel_ids(parent), to_tmp, self.kernel_ids(child)
                )

    def _room_for(self, parent: KernelSession, count: int, image: Path, archive: Path) -> None:
        """ForgeError, naming the sizes, unless the state directory's disk has room for
        `count` copies of the workspace image and one more of the archive (a retarget)."""
        need = count * image.stat().st_blocks * 512 + archive.stat().st_size
        disk = os.statvfs(self.settings.state_dir)
        free = disk.f_bavail * disk.f_frsize
        if need > free:
            raise ForgeError(
                f"{count} copies of session {parent.name!r} need {need} bytes on the state "
                f"directory's disk ({self.settings.state_dir}); {free} are free"
            )

    async def clean_forks(self) -> list[str]:
        """What a process that died while forking left (the supervisor's pass): a kernel
        left paused or a workspace left frozen, new sessions still Pending, archives.
        Only what has stayed so past STALE, and only a session whose lock is free. The
        names of the sessions deleted."""
        await forkfiles.release_left(self.settings.state_dir / "k", STALE)
        cutoff = time.time() - STALE
        await asyncio.to_thread(forkfiles.drop_older, self.settings.state_dir / FORKS, cutoff)
        gone = []
        for session in await self.list():
            made = parse_time(session.body["metadata"].get("creationTimestamp"))
            forked = forks.FORKED_FROM in (session.body["metadata"].get("annotations") or {})
            if not forked or session.status.get("phase") != st.PENDING or (made or 0) > cutoff:
                continue
            async with self.locked_if_free(session) as free:
                if free:
                    log.warning("removing %s: a fork left unmade", session.name)
                    await self.delete_locked(session)
                    gone.append(session.name)
        return gone

    async def _restore_fork(
        self, parent: KernelSession, child: KernelSession, archive: Path, *, last: bool
    ) -> None:
        """The archive restored as the fork's kernel, made the fork's; a new kernel that
        says why if that fails, or the fork Failed if even that does (its status says)."""

        async def become(info: ConnectionInfo) -> None:
            await self._become(parent, child, info)

        restore = self._restore(
            child,
            archive,
            consume=last,
            become=become,
            moved_from=self._dir(parent),
            reason="Forking",
        )
        lost = await self._try_restore(
            child,
            restore,
            f"forked from {parent.name!r} with its memory",
            kernelId=str(uuid.uuid4()),
            startedAt=stamp(),
        )
        if lost:
            with contextlib.suppress(ForgeError):  # Failed, and its status says why
                await self._cold_instead(child, lost, wait=True)

    async def _become(
        self, parent: KernelSession, child: KernelSession, info: ConnectionInfo
    ) -> None:
        """Tell the restored kernel, in its parent's key, to take the fork's key (info's)
        and environment (its spec's values and Secrets'); its reply is in the new key."""
        env = {v.name: v.value for v in child.spec.env if v.secret is None}
        env.update(self.secrets.values(child))
        env[SESSION_VARIABLE] = child.name
        parents = self.store.key(parent.namespace, parent.name)
        conn = KernelConnection(
            ConnectionInfo(info.transport, info.host, parents),
            max_frame=100_000,
            max_message=100_000,
        )
        try:
            code = forks.program(info.key, parent, env)
            msg_id = conn.send_execute(code, silent=True, store_history=False)
            conn.rekey(info.key)
            reply = await conn.reply(conn.shell, msg_id, TELL_TIMEOUT)
        finally:
            conn.close()
        if reply is None:
            raise SessionNotReady(f"the forked kernel did not take its key in {TELL_TIMEOUT:.0f}s")
        content = reply["content"]
        if content.get("status") != "ok":
            said = f"{content.get('ename', '')}: {content.get('evalue', '')}"[:300]
            raise SessionNotReady(f"the forked kernel refused its key and environment ({said})")
