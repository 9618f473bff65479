"""A third realizer of runtimes/base.Runtime, for the gateway's unit tests: each session's
kernel is a real ipykernel in a local process (no pod, no store), reached over ipc
sockets in a directory of the test's, as local mode's kernels are.

It realizes only what the gateway's core needs to be tested in seconds: sessions made,
read and deleted, the kernel's connection, its death seen (`termination`), a restart
(a new process, variables gone), activity counted. Quota, code mode, packages and
memory are the real runtimes' (tests/integration, tests/kube): here they say so.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mcp_forge.api import kernelsession
from mcp_forge.api import status as st
from mcp_forge.api.connection import PORTS, Address, ConnectionInfo, new_key
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.quota import Seat
from mcp_forge.api.status import Termination, stamp, termination_of
from mcp_forge.errors import InvalidSession, SessionNotFound, SessionNotReady
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.settings import Settings

READY_TIMEOUT = 30.0


class ProcessRuntime:
    """Sessions whose kernels are local ipykernel processes under `root`."""

    def __init__(self, root: Path, settings: Settings | None = None) -> None:
        self.root = root
        self.settings = settings or Settings()
        self.bodies: dict[tuple[str, str], dict[str, Any]] = {}
        self.kernels: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.keys: dict[tuple[str, str], str] = {}
        self.activity: list[tuple[str, bool]] = []  # (session, busy), as recorded

    # ---- the sessions ------------------------------------------------------------------

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        try:
            return kernelsession.load(json.loads(json.dumps(self.bodies[namespace, name])))
        except KeyError:
            raise SessionNotFound(f"no KernelSession {name!r}") from None

    async def list(self, namespace: str | None = None) -> builtins.list[KernelSession]:
        return [
            await self.get(name, ns)
            for ns, name in self.bodies
            if namespace is None or ns == namespace
        ]

    async def create(self, body: dict[str, Any]) -> KernelSession:
        body = kernelsession.validate(body)
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if key in self.bodies:
            raise InvalidSession(f"a session named {meta['name']!r} exists already")
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=stamp(), generation=1)
        body["status"] = {"phase": st.STARTING, "restarts": 0, "connection": {"generation": 0}}
        self.bodies[key] = body
        self.keys[key] = new_key()
        await self._start(key)
        return await self.get(meta["name"], meta["namespace"])

    async def delete(self, name: str, namespace: str = "default") -> None:
        if self.bodies.pop((namespace, name), None) is None:
            raise SessionNotFound(f"no KernelSession {name!r}")
        await self._stop((namespace, name))

    async def close(self) -> None:
        for key in builtins.list(self.kernels):
            await self._stop(key)

    # ---- the kernel ----------------------------------------------------------------------

    def _dir(self, key: tuple[str, str]) -> Path:
        return self.root / f"{key[0]}-{key[1]}"

    def _info(self, key: tuple[str, str]) -> ConnectionInfo:
        return ConnectionInfo("ipc", str(self._dir(key) / "kernel"), self.keys[key])

    async def _start(self, key: tuple[str, str]) -> None:
        """A new ipykernel for the session, waited for until it answers."""
        body = self.bodies[key]
        directory = self._dir(key)
        directory.mkdir(parents=True, exist_ok=True)
        for port in PORTS.values():  # a dead kernel's sockets
            (directory / f"kernel-{port}").unlink(missing_ok=True)
        info = self._info(key)
        conn_file = directory / "connection.json"
        conn_file.write_text(json.dumps(info.to_jupyter()))
        self.kernels[key] = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, "-m", "ipykernel_launcher", "-f", str(conn_file)],
            cwd=directory,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        conn = KernelConnection(info, max_frame=1_000_000, max_message=1_000_000)
        try:
            await conn.wait_ready(READY_TIMEOUT)
        finally:
            conn.close()
        status = body["status"]
        status.update(
            phase=st.READY,
            reason=st.KERNEL_READY,
            kernelId=str(uuid.uuid4()),
            startedAt=stamp(),
            connection={"generation": int(status["connection"]["generation"]) + 1},
        )

    async def _stop(self, key: tuple[str, str]) -> None:
        process = self.kernels.pop(key, None)
        if process is not None and process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait, 10)

    def kill(self, name: str, namespace: str = "default") -> None:
        """Kill the session's kernel, as the OOM killer or a crash would."""
        process = self.kernels[namespace, name]
        process.kill()
        process.wait(10)

    def replace_pod(
        self, name: str, why: Termination, namespace: str = "default", *, kernel: str = ""
    ) -> None:
        """Kill the session's kernel and record why, as the local supervisor does before it
        removes the dead kernel's pod to play a new one: until the next refresh, the
        kernel's pod is gone. The record names the kernel (`kernel`: another one's)."""
        key = (namespace, name)
        self.kill(name, namespace)
        del self.kernels[key]
        status = self.bodies[key]["status"]
        status["phase"] = st.RESTARTING
        status["lastTermination"] = {
            "at": stamp(),
            "reason": why.reason,
            "message": why.message,
            "kernelId": kernel or status["kernelId"],
        }

    async def connection(self, session: KernelSession) -> ConnectionInfo:
        return self._info((session.namespace, session.name))

    async def termination(self, session: KernelSession) -> Termination | None:
        key = (session.namespace, session.name)
        process = self.kernels.get(key)
        if process is None and key in self.bodies:
            return Termination(st.POD_MISSING, None, "the kernel's pod is gone")
        if process is None or process.poll() is None:
            return None
        return termination_of(process.returncode, oom=False, memory_limit="")

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        key = (session.namespace, session.name)
        if key not in self.bodies:
            raise SessionNotFound(f"no KernelSession {session.name!r}")
        term = await self.termination(session)
        if term is not None:
            status = self.bodies[key]["status"]
            status.update(
                phase=st.RESTARTING,
                reason=term.reason,
                message=term.message,
                restarts=int(status.get("restarts", 0)) + 1,
            )
            if restart:
                await self._start(key)
                status.update(reason=term.reason, message=term.message)
        return await self.get(session.name, session.namespace)

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        key = (session.namespace, session.name)
        await self._stop(key)
        await self._start(key)

    async def record_activity(self, session: KernelSession, *, busy: bool = False) -> None:
        self.activity.append((session.name, busy))

    async def kernel_setup(self, session: KernelSession) -> str | None:
        return None

    async def kernel_packages(self, session: KernelSession, conn: KernelConnection) -> None:
        if session.spec.packages:
            raise SessionNotReady("spec.packages: not in the process runtime (tests/integration)")

    # ---- what the real runtimes do -------------------------------------------------------

    async def reserve(self, claim: Seat) -> None:
        """Quotas are the real runtimes' (tests/e2e, tests/kube): every seat is free here."""

    async def release(self, claim: Seat) -> None:
        """Nothing reserved, nothing to release."""

    async def count_call(self, session: KernelSession, server: str, per_minute: int) -> bool:
        return True

    async def bridge_address(self, session: KernelSession) -> tuple[tuple[str | int, ...], Address]:
        raise SessionNotReady("code mode: not in the process runtime (tests/integration)")

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        return {}


@contextlib.asynccontextmanager
async def process_runtime(settings: Settings | None = None) -> AsyncIterator[ProcessRuntime]:
    """A ProcessRuntime in a short directory of its own (ipc socket paths are bounded),
    its kernels stopped and the directory removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="mfp-"))
    runtime = ProcessRuntime(root, settings)
    try:
        yield runtime
    finally:
        await runtime.close()
        shutil.rmtree(root, ignore_errors=True)
