"""The gateway's calls that run a helper in the kernel: its code-mode tools, variables,
files, the notebook export and package installs (`WorkspaceCalls`, a part of `Gateway`).

Each takes the session's turn (it does not wait behind running code for long), runs one
of kernelside's programs silently (gateway/introspection.py) and checks its reply: the
kernel is untrusted, so every reply is bounded and parsed by type, and what it asks the
host to do (a notebook built from its journal, wheels for its packages) runs confined.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import InvalidRequest, KernelProtocolError, PackageError, SessionNotReady
from mcp_forge.gateway import introspection
from mcp_forge.gateway.attach import Handle, silently
from mcp_forge.gateway.notebook import Notebook
from mcp_forge.gateway.notebook_worker import ExportSlots, WorkerLimits, build_in_worker
from mcp_forge.gateway.sessions import owner_of
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import NOTEBOOK_JOURNAL, OUTPUT_DIR, Collector
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings
from mcp_forge.wheels import fetch

_WRITE_CHUNK = 1_000_000
_JOURNAL_WINDOW = 1_000_000  # bytes of the notebook journal read at once (see there)


class WorkspaceCalls:
    """Helpers run in the kernel. The session and its connection (gateway/connections.py),
    its turn and its activity (gateway/core.py) are the gateway's, declared here for the
    type checker."""

    settings: Settings
    _exports: ExportSlots

    if TYPE_CHECKING:

        async def _session(
            self, name: str, namespace: str, *, read: KernelSession | None = None
        ) -> KernelSession: ...

        def _handle(self, session: KernelSession) -> Handle: ...

        def _turn(
            self, handle: Handle, session: KernelSession
        ) -> contextlib.AbstractAsyncContextManager[None]: ...

        async def _connect(self, handle: Handle, session: KernelSession) -> KernelConnection: ...

        async def _record_activity(
            self, handle: Handle, session: KernelSession, *, busy: bool = False
        ) -> None: ...

        async def _settle_after_cancel(
            self,
            handle: Handle,
            conn: KernelConnection,
            session: KernelSession,
            collector: Collector,
        ) -> None: ...

    async def _helper(self, name: str, namespace: str, op: str, **args: Any) -> dict[str, Any]:
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            reply = await self._helper_locked(handle, session, op, **args)
            await self._record_activity(handle, session)
            return reply

    async def _helper_locked(
        self,
        handle: Handle,
        session: KernelSession,
        op: str,
        *,
        wait: float | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """The helper's reply; InvalidRequest naming what it refused. `wait`: seconds for
        its reply (helper_timeout)."""
        reply = await self._ask_locked(handle, session, op, wait=wait, **args)
        if "error" in reply:
            raise InvalidRequest(f"{reply['error']}: {reply.get('message', '')}")
        return reply

    async def _ask_locked(
        self,
        handle: Handle,
        session: KernelSession,
        op: str,
        *,
        wait: float | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """The helper's reply as it is, a refusal ({"error": kind, "message"}) included."""
        s = self.settings
        wait = s.helper_timeout if wait is None else wait
        conn = await self._connect(handle, session)
        code, marker = introspection.program(op, **args)
        collector = Collector("", budget=s.helper_reply_max, spool_max=0, data_budget=0)
        await conn.before_request()
        collector.msg_id = conn.send_execute(code, silent=True, store_history=False)
        try:
            done = await conn.pump(collector, wait)
        except asyncio.CancelledError:
            await self._settle_after_cancel(handle, conn, session, collector)
            raise
        if not done:
            await self._settle_after_cancel(handle, conn, session, collector)
            raise SessionNotReady(f"the kernel did not answer within {wait:.0f}s")
        result = collector.finish(duration=0)
        if result.truncated:
            raise KernelProtocolError(
                f"the kernel's reply is over the {s.helper_reply_max} character limit"
            )
        return introspection.parse_reply(result.stdout, marker, limit=s.helper_reply_max)

    async def kernel_tools(self, name: str, *, namespace: str = "default") -> dict[str, Any]:
        """The `mcp_tools` stubs (signatures, docstrings) code in this session may call."""
        reply = await self._helper(name, namespace, "tools", max=self.settings.helper_reply_max)
        servers = reply.get("servers")
        stubs = reply.get("stubs")
        if not isinstance(servers, list) or not isinstance(stubs, str):
            raise KernelProtocolError("the kernel's tool listing is malformed")
        return {"servers": [str(s) for s in servers], "stubs": stubs}

    async def variables(self, name: str, *, namespace: str = "default") -> list[dict[str, Any]]:
        """The user's variables: name, type, shape, dtype, length, size, bounded repr."""
        s = self.settings
        reply = await self._helper(
            name, namespace, "variables", max=s.variables_max, repr_max=s.repr_list_max
        )
        items = reply.get("variables")
        if not isinstance(items, list):
            raise KernelProtocolError("the kernel's variable list is malformed")
        return [_variable(v) for v in items[: s.variables_max]]

    async def inspect_variable(
        self, name: str, var: str, *, namespace: str = "default"
    ) -> dict[str, Any]:
        if not isinstance(var, str) or not var.isidentifier():
            raise InvalidRequest(f"{var!r} is not a Python identifier")
        reply = await self._helper(
            name, namespace, "inspect", var=var, repr_max=self.settings.repr_max
        )
        return _variable(reply.get("variable"))

    async def list_files(
        self, name: str, path: str = ".", *, namespace: str = "default"
    ) -> dict[str, Any]:
        rel = introspection.workspace_path(path)
        reply = await self._helper(
            name, namespace, "list", path=rel, max=self.settings.list_files_max
        )
        entries = reply.get("entries")
        if not isinstance(entries, list):
            raise KernelProtocolError("the kernel's file list is malformed")
        return {
            "path": rel,
            "entries": [_entry(e) for e in entries[: self.settings.list_files_max]],
            "truncated": reply.get("truncated") is True,
        }

    async def read_file(self, name: str, path: str, *, namespace: str = "default") -> bytes:
        rel = introspection.workspace_path(path)
        reply = await self._helper(name, namespace, "read", path=rel, max=self.settings.file_max)
        return _decoded(reply.get("base64"), self.settings.file_max)

    async def export_notebook(
        self,
        name: str,
        *,
        namespace: str = "default",
        save_to: str | None = None,
        client: str | None = None,
    ) -> Notebook:
        """The session's notebook: every cell run in it, as its journal has them; also
        written to `save_to` in its workspace if given (replacing a file there). It is
        built in a worker process (the journal is the kernel's), at most file_max long;
        each client (`client`, who asks; else the session's owner) runs a bounded number
        of exports at once."""
        rel = None
        if save_to is not None:
            rel = introspection.workspace_path(save_to)
            if rel == ".":
                raise InvalidRequest("path names the workspace itself, not a file")
        session = await self._session(name, namespace)
        handle = self._handle(session)
        s = self.settings
        limits = WorkerLimits(
            size=s.file_max, seconds=s.notebook_timeout, memory=s.notebook_memory_max
        )
        with self._exports.hold(client or owner_of(session) or ""):
            async with self._turn(handle, session):  # no cell is half-written meanwhile
                journal = self._journal_locked(handle, session)
                nb = await build_in_worker(journal, session=name, limits=limits)
                if rel is not None:
                    await self._write_locked(handle, session, rel, nb.text.encode())
                await self._record_activity(handle, session)
        return nb

    async def _journal_locked(self, handle: Handle, session: KernelSession) -> AsyncIterator[bytes]:
        """The session's notebook journal, read in windows of at most _JOURNAL_WINDOW, as
        they come.

        Each window is a helper reply parsed and base64-decoded on the loop, in one step:
        windows of file_max (10 MB) held the loop ~100 ms each (tests/drills/neighbours.py,
        10 noisy clients: every client's call waited behind them); 1 MB is ~10 ms.
        """
        read = 0
        window = min(self.settings.file_max, _JOURNAL_WINDOW)
        most = self.settings.notebook_max + self.settings.data_budget  # its last record
        while True:
            reply = await self._ask_locked(
                handle, session, "read", path=NOTEBOOK_JOURNAL, max=window, offset=read
            )
            if reply.get("error") == "FileNotFound" and not read:
                return  # no cell has run yet
            if "error" in reply:
                raise InvalidRequest(f"{reply['error']}: {reply.get('message', '')}")
            part = _decoded(reply.get("base64"), window)
            read += len(part)
            if read > most:
                raise InvalidRequest(
                    f"the notebook journal of {session.name!r} is over {most} bytes: "
                    f"read it with read_file ({NOTEBOOK_JOURNAL}) in parts"
                )
            yield part
            if len(part) < window:
                return

    async def write_file(
        self, name: str, path: str, data: bytes, *, namespace: str = "default"
    ) -> int:
        rel = introspection.workspace_path(path)
        if rel == ".":
            raise InvalidRequest("path names the workspace itself, not a file")
        if len(data) > self.settings.file_max:
            raise InvalidRequest(
                f"content is {len(data)} bytes; the limit is {self.settings.file_max}"
            )
        session = await self._session(name, namespace)
        handle = self._handle(session)
        async with self._turn(handle, session):
            size = await self._write_locked(handle, session, rel, data)
            await self._record_activity(handle, session)
            return size

    async def _write_locked(
        self, handle: Handle, session: KernelSession, rel: str, data: bytes
    ) -> int:
        size: Any = None
        chunks = [data[i : i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            reply = await self._helper_locked(
                handle,
                session,
                "write",
                path=rel,
                base64=base64.b64encode(chunk).decode(),
                append=i > 0,
            )
            size = reply.get("size")
        if not isinstance(size, int):
            raise KernelProtocolError("the kernel's write reply is malformed")
        return size

    # ---- packages --------------------------------------------------------------------------

    async def install_packages(
        self,
        name: str,
        requirements: Any,
        *,
        namespace: str = "default",
        read: KernelSession | None = None,
        client: str | None = None,
    ) -> dict[str, Any]:
        """Resolve and download `requirements` on the host under the package policy
        (wheels/fetch.py), send the wheels over the kernel's channels and have it
        install them offline into its workspace's package directory, which is on its
        sys.path at once (and in every later kernel of the session: guard_program).
        `client` (who asks) is held to its share of installs in flight.
        What was installed (name, version, size) and the bytes in all."""
        reqs = fetch.parse_requirements(requirements)
        policy = fetch.PackagePolicy.of(self.settings)
        session = await self._session(name, namespace, read=read)  # refused before fetching
        with tempfile.TemporaryDirectory(prefix="mcp-forge-packages-") as tmp:
            wheels = await fetch.download(reqs, policy, Path(tmp), client=client)
            session = await self._session(name, namespace)
            handle = self._handle(session)
            async with self._turn(handle, session):
                await self._install_locked(handle, session, wheels, policy.timeout)
                await self._record_activity(handle, session)
        return {
            "installed": [{"name": w.name, "version": w.version, "size": w.size} for w in wheels],
            "total_bytes": sum(w.size for w in wheels),
            "path": f"{WORKSPACE}/{fetch.PACKAGES_DIR}",
        }

    async def _install_locked(
        self,
        handle: Handle,
        session: KernelSession,
        wheels: list[fetch.Wheel],
        seconds: float,
    ) -> None:
        batch = f"{OUTPUT_DIR.rsplit('/', 1)[0]}/wheels"  # emptied by the install, come what may
        for wheel in wheels:
            data = await asyncio.to_thread(wheel.path.read_bytes)
            await self._write_locked(handle, session, f"{batch}/{wheel.path.name}", data)
        try:
            await self._helper_locked(
                handle,
                session,
                "install",
                wait=seconds + self.settings.helper_timeout,
                wheels=batch,
                target=fetch.PACKAGES_DIR,
                files=[w.path.name for w in wheels],
                seconds=seconds,
            )
        except InvalidRequest as exc:
            raise PackageError(f"the kernel could not install them: {exc}") from None
        conn = await self._connect(handle, session)
        failure = "the kernel could not put its packages on sys.path"
        await silently(conn, fetch.path_program(), failure, self.settings.helper_timeout)


def _decoded(data: Any, limit: int) -> bytes:
    """A file's bytes as the kernel's helper sent them (base64), at most `limit`."""
    if not isinstance(data, str):
        raise KernelProtocolError("the kernel's file reply is malformed")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as exc:
        raise KernelProtocolError("the kernel's file reply is not base64") from exc
    if len(raw) > limit:
        raise KernelProtocolError("the kernel sent more than the file limit")
    return raw


_VAR_FIELDS: dict[str, type] = {
    "name": str,
    "type": str,
    "shape": list,
    "dtype": str,
    "length": int,
    "size": int,
    "repr": str,
}
_ENTRY_FIELDS: dict[str, type] = {"name": str, "type": str, "size": int, "mtime": float}


def _fields(
    raw: Any, spec: dict[str, type], what: str, required: tuple[str, ...]
) -> dict[str, Any]:
    """Keep only known fields of the expected types from a kernel-made object."""
    if not isinstance(raw, dict):
        raise KernelProtocolError(f"the kernel's {what} is malformed")
    out: dict[str, Any] = {}
    for key, kind in spec.items():
        value = raw.get(key)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, list) and not all(
                isinstance(x, int) and not isinstance(x, bool) for x in value
            ):
                continue
            out[key] = value[:10_000] if isinstance(value, str | list) else value
    if any(key not in out for key in required):
        raise KernelProtocolError(f"the kernel's {what} lacks {', '.join(required)}")
    return out


def _variable(raw: Any) -> dict[str, Any]:
    return _fields(raw, _VAR_FIELDS, "variable description", ("name", "type"))


def _entry(raw: Any) -> dict[str, Any]:
    return _fields(raw, _ENTRY_FIELDS, "file entry", ("name", "type"))
