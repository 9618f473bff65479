"""What happens to a session's kernel after it started (`Lifecycle`, a part of
LocalRuntime): a death seen and counted, a restart per restartPolicy with the crash
loop's backoff, activity recorded, and the culler's stops (maxLifetime, idleTimeout).

The decisions are the operator's too (control/lifecycle.py: when a death is quick, how
long the backoff, when a session is idle); what is local is where they are written
(the store) and how a kernel is started again (a new pod, kernelpods.py).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mcp_forge import metrics
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import Termination, parse_time, stamp
from mcp_forge.control.lifecycle import (
    Activity,
    Kernel,
    Stop,
    follow,
    idle_since,
    recorded,
    stop_of,
    stopped,
)
from mcp_forge.control.pods import Observation, dead
from mcp_forge.errors import ForgeError, SessionNotFound, SessionNotReady
from mcp_forge.runtimes.local import volumes
from mcp_forge.runtimes.local.containers import lifetime
from mcp_forge.runtimes.local.naps import Naps

if TYPE_CHECKING:
    from mcp_forge.runtimes.local.pools import Pools

log = logging.getLogger(__name__)

# A busy mark (a gateway runs code in the kernel) lasts this long unless renewed: the
# gateway renews it while the code runs, so it lapses by itself if the gateway goes away.
BUSY_LEASE = 30.0


class Lifecycle(Naps):
    """Deaths, restarts and stops of local sessions. The session's lock, reading and
    deleting it are LocalRuntime's, declared here for the type checker."""

    pools: Pools

    if TYPE_CHECKING:

        def _locked(
            self, session: KernelSession, *, create: bool = False
        ) -> contextlib.AbstractAsyncContextManager[None]: ...

        async def get(self, name: str, namespace: str = "default") -> KernelSession: ...

        async def list(self, namespace: str | None = None) -> builtins.list[KernelSession]: ...

        async def delete(self, name: str, namespace: str = "default") -> None: ...

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        """Bring status in line with what Podman shows.

        With `restart`, a dead kernel is restarted per restartPolicy; without it, the
        death is only recorded (phase Restarting: the next use, or the gateway, restarts it).
        """
        async with self._locked(session):
            return await self._refresh_locked(
                await self.get(session.name, session.namespace), restart=restart
            )

    async def _refresh_locked(self, session: KernelSession, *, restart: bool) -> KernelSession:
        phase = session.status.get("phase")
        if phase == st.SUSPENDED and session.status.get("reason") == st.IDLE and restart:
            await self._wake(session, wait=True)  # used again: it resumes
            return await self.get(session.name, session.namespace)
        if phase not in (st.READY, st.STARTING, st.RESTARTING):
            return session
        term = await self.termination(session)
        if term is None and phase == st.STARTING and session.status.get("reason") == ksp.CLAIMED:
            if restart:  # a claim whose process went away before it was done
                await self.pools.finish(session)
        elif term is None:
            if phase != st.READY and restart:  # a process that was starting it went away
                await self.wait_ready(session)
        else:
            await self._follow(session, dead(session, term), restart=restart)
        return await self.get(session.name, session.namespace)

    async def _follow(
        self,
        session: KernelSession,
        seen: Observation,
        *,
        restart: bool,
        asked: bool = False,
        lived: float | None = None,
    ) -> None:
        """Follow the kernel as the operator follows a pod (control/lifecycle.py): its
        death (`seen` has its Termination) recorded once, then the plan shown and, with
        `restart`, carried out: a new kernel now, or none yet (a crash loop's backoff;
        Failed when restartPolicy is Never or the crash loop is given up on). `asked`: a
        gateway restarts it, whatever restartPolicy says."""
        status = self.store.get(session.namespace, session.name).get("status") or {}
        kernel_id = str(status.get("kernelId") or "")
        last = status.get("lastTermination") or {}
        new_death = not recorded(last, kernel_id, phase=status.get("phase"))
        if seen.termination is not None and lived is None and new_death:
            lived = lifetime(await self.containers.inspect(self.container_name(session)))
        kernel = Kernel(kernel_id, seen, lived)
        followed = follow(session, kernel, status, restart_asked=asked, now=time.time(), local=True)
        plan = followed.plan
        if followed.died is not None:
            fields: dict[str, object] = {"lastTermination": followed.died}
            if plan.seen.phase == st.RESTARTING:  # a restart comes (now, or after a backoff)
                oom = followed.died["reason"] == st.OOM_KILLED
                metrics.KERNEL_RESTARTS.labels(reason="oom" if oom else "died").inc()
                fields["restarts"] = int(status.get("restarts") or 0) + 1
            self._patch(session, **fields)
        self._show(session, plan.seen)
        if not (restart and plan.replace):
            if seen.termination is not None:  # no new kernel yet: its pod may stop
                await self.drop_keeper(session)
            return
        try:
            await self._start_again(session)
        except SessionNotReady as exc:
            if await self.termination(session) is None:
                raise
            # It died while starting: one more quick death, and a backoff before the next.
            why = Termination("StartFailed", None, str(exc)[:1500])
            await self._follow(session, dead(session, why), restart=False, lived=0.0)
            status = self.store.get(session.namespace, session.name).get("status", {})
            raise SessionNotReady(
                f"session {session.name!r} is {status.get('phase')}: {status.get('message')}"
            ) from None
        if plan.seen.termination is not None:  # Ready, and says why it was restarted
            self._patch(session, reason=plan.seen.reason, message=plan.seen.message)

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        """A fresh kernel process in the same pod: the workspace stays, variables go.
        `crashed`: the gateway gave up on it (`reason`): counted as a death."""
        async with self._locked(session):
            session = await self.get(session.name, session.namespace)
            if crashed:
                why = Termination(reason, None, message or reason)
                seen = Observation(st.RESTARTING, why.reason, why.message, why)
            else:
                seen = Observation(st.READY, st.KERNEL_READY, "the kernel answered")
            await self._follow(session, seen, restart=True, asked=True)

    async def _start_again(self, session: KernelSession) -> None:
        """A new kernel: the pod is played again, with the same user namespace and mounts.

        Not `pod stop` + `pod start`: kube play gives pods the exit policy "stop", and the
        clean-up Podman runs after the old kernel exits could land after the infra came back
        but before the new kernel did, stopping the pod again (about one restart in six).
        A new pod has a new id, which no clean-up of the old one can reach. A pod played
        before user namespaces gets one now.
        """
        await self._remove_pod(session)
        await self._realize(session, wait=True, phase=st.RESTARTING)

    async def record_activity(self, session: KernelSession, *, busy: bool = False) -> None:
        with contextlib.suppress(SessionNotFound):
            self.store.patch_status(
                session.namespace,
                session.name,
                {"lastActivity": stamp()},
                private={"busyUntil": time.time() + BUSY_LEASE if busy else None},
            )

    async def cull_idle(self) -> builtins.list[str]:
        """Expire sessions past their maxLifetime; delete or suspend (idleAction) those idle
        past their idleTimeout. Returns their names."""
        culled = []
        for session in await self.list():
            status = session.status
            if status.get("phase") in st.NO_KERNEL:
                continue
            created = parse_time(session.body["metadata"]["creationTimestamp"]) or time.time()
            last = status.get("lastActivity")
            try:
                private = self.store.private(session.namespace, session.name)
            except SessionNotFound:
                continue
            activity = Activity(parse_time(last) or created, private.get("busyUntil"))
            floor = idle_since(activity, started=None, starting_since=None)
            verdict = stop_of(
                session, created=created, idle_from=floor, activity=activity, now=time.time()
            )
            stop = verdict.stop
            if stop is None or (stop.phase == st.SUSPENDED and stop.reason != st.IDLE):
                continue  # operatingMode Suspended is applied by apply, not here
            try:
                log.info(
                    "%s %s/%s: %s",
                    "deleting" if stop.delete else "stopping",
                    session.namespace,
                    session.name,
                    stop.message,
                )
                if stop.delete:
                    await self.delete(session.name, session.namespace)
                else:
                    await self._stop(session, stop)
            except SessionNotFound:
                continue
            except ForgeError as exc:
                log.warning("could not cull %s: %s", session.name, exc)
                continue
            culled.append(session.name)
        return culled

    async def nap(self, name: str, namespace: str = "default") -> KernelSession:
        """Suspend a Ready session now, with its memory (`mcp-forge suspend`); used
        again it resumes, as after idleness. If its memory cannot be kept the kernel is
        left running and ForgeError says why (unless the checkpoint had already stopped
        it: then it is suspended without, and says so)."""
        session = await self.get(name, namespace)
        async with self._locked(session):
            session = await self.get(name, namespace)
            phase = session.status.get("phase")
            if phase != st.READY:
                raise SessionNotReady(f"session {name!r} is {phase}: only a Ready kernel naps")
            asked = "suspended by `mcp-forge suspend`; used again, it resumes"
            why = await self._nap(session)
            if not why:
                stop = Stop(st.SUSPENDED, st.IDLE, f"{asked}; its memory is kept")
                self._napped(session, stop, session.status.get("kernelId"))
            elif await self.termination(session) is not None:
                await self._stop_locked(session, Stop(st.SUSPENDED, st.IDLE, asked))
            else:
                raise ForgeError(f"session {name!r} was not suspended: {why}")
        return await self.get(name, namespace)

    async def drop_old_snapshots(self) -> builtins.list[str]:
        """Drop the snapshots kept longer than snapshot_max_age (0: never): their sessions
        stay suspended, and say that their kernels' memory is gone. Their names."""
        age = self.settings.snapshot_max_age
        dropped = []
        for session in await self.list() if age > 0 else []:
            taken = parse_time((session.status.get("snapshot") or {}).get("takenAt"))
            if taken is None or time.time() - taken < age:
                continue
            why = f"kept longer than {age:.0f}s (MCPFORGE_SNAPSHOT_MAX_AGE)"
            said = str(session.status.get("message") or "").split("; its memory is kept")[0]
            try:
                async with self._locked(session):
                    await self._forget_snapshot(session, why)
                    self._patch(session, message=f"{said}; its memory was dropped: {why}")
            except ForgeError as exc:  # deleted meanwhile, say: the next pass sees
                log.warning("could not drop the snapshot of %s: %s", session.name, exc)
                continue
            dropped.append(session.name)
        return dropped

    async def _stop(self, session: KernelSession, stop: Stop) -> None:
        async with self._locked(session):
            await self._stop_locked(session, stop)

    async def _stop_locked(self, session: KernelSession, stop: Stop) -> None:
        """No kernel, the session kept: Suspended or Expired. A kernel suspended keeps
        its memory in a snapshot where it can (naps.py); otherwise its variables are lost."""
        kernel = session.status.get("kernelId")
        why_not = ""
        if stop.phase == st.SUSPENDED and session.status.get("phase") == st.READY:
            why_not = await self._nap(session) or ""
            if not why_not:
                said = dataclasses.replace(stop, message=f"{stop.message}; its memory is kept")
                self._napped(session, said, kernel)
                return
        await self._remove_pod(session)
        if self.host_paths(session).tmp:  # /tmp is memory: a stopped session holds none
            await volumes.unmount(Path(str(self.host_paths(session).tmp)))
        if why_not:
            stop = dataclasses.replace(stop, message=f"{stop.message}; variables lost: {why_not}")
        self._stopped(session, stop)

    def _napped(self, session: KernelSession, stop: Stop, kernel: object) -> None:
        """Suspended with its memory: the same kernel, and its pod if it is kept there."""
        kept = {"podName": self.pod_name(session)} if self._kept_in_pod(session) else {}
        self._stopped(session, stop, kernelId=kernel, **kept)

    def _stopped(self, session: KernelSession, stop: Stop, **fields: object) -> None:
        with contextlib.suppress(SessionNotFound):
            body = self.store.get(session.namespace, session.name)
            generation = int(body["metadata"].get("generation", 1))
            now = time.time()
            patch = stopped(body.get("status") or {}, stop, generation=generation, now=now)
            self.store.patch_status(session.namespace, session.name, {**patch, **fields})
