"""Sessions as agents see them: who owns which, each client's default session, cleanup.

A session an agent creates through the gateway carries two annotations: its owner (an
opaque id of the MCP client connection that created it) and the id of the gateway
process that created it. A client sees and uses the sessions it owns and the declared
ones (applied with kubectl / GitOps / `mcp-forge apply`, which have no owner); a
session owned by another client is reported exactly as one that does not exist.
Created sessions get unguessable names (`s-` and 12 random hex digits) unless the
client picks one. When the gateway stops, it deletes the sessions it created.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from . import resource
from .errors import ForgeError, InvalidRequest, InvalidSession, SessionNotFound
from .image import VARIANTS, image_ref
from .resource import KernelSession
from .runtime import Runtime

log = logging.getLogger(__name__)

OWNER = "mcpforge.dev/owner"
CREATED_BY = "mcpforge.dev/created-by"
NAMESPACE = "default"


def new_owner_id() -> str:
    """An id for one MCP client connection."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class SessionRequest:
    """What a client may choose when it creates a session."""

    name: str | None = None
    variant: str = "default"
    memory: str | None = None
    cpu: str | None = None
    env: dict[str, str] | None = None
    shared_group: str | None = None


class SessionService:
    """Ownership-checked access to sessions, on top of a Runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.gateway_id = secrets.token_hex(8)
        self._defaults: dict[str, str] = {}  # owner → default session name
        self._default_locks: dict[str, asyncio.Lock] = {}

    def visible(self, session: KernelSession, owner: str) -> bool:
        annotations = session.body["metadata"].get("annotations") or {}
        return annotations.get(OWNER) in (None, owner)

    async def resolve(self, owner: str, session_id: str) -> KernelSession:
        """The session `session_id` if this client may use it; else SessionNotFound."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequest("session_id must be a non-empty string")
        try:
            session = await self.runtime.get(session_id, NAMESPACE)
        except SessionNotFound:
            session = None
        if session is None or not self.visible(session, owner):
            raise SessionNotFound(f"no session {session_id!r} (list_sessions shows yours)")
        return session

    async def list(self, owner: str) -> list[KernelSession]:
        return [s for s in await self.runtime.list(NAMESPACE) if self.visible(s, owner)]

    async def create(self, owner: str, request: SessionRequest) -> KernelSession:
        if request.variant not in VARIANTS:
            raise InvalidRequest(
                f"variant must be one of {', '.join(VARIANTS)}, got {request.variant!r}"
            )
        name = request.name or f"s-{secrets.token_hex(6)}"
        spec: dict[str, Any] = {"image": image_ref(request.variant), "resources": {}}
        if request.memory is not None:
            spec["resources"]["memory"] = request.memory
        if request.cpu is not None:
            spec["resources"]["cpu"] = request.cpu
        if request.env:
            spec["env"] = [{"name": k, "value": v} for k, v in request.env.items()]
        if request.shared_group is not None:
            spec["sharedGroup"] = request.shared_group
        body = {
            "apiVersion": resource.API_VERSION,
            "kind": resource.KIND,
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "annotations": {OWNER: owner, CREATED_BY: self.gateway_id},
            },
            "spec": spec,
        }
        resource.validate(body)  # the field-named error, before anything is stored
        try:
            await self.runtime.get(name, NAMESPACE)
        except SessionNotFound:
            return await self.runtime.create(body)
        raise InvalidSession(f"a session named {name!r} exists already", field="name")

    async def close(self, owner: str, session_id: str) -> None:
        session = await self.resolve(owner, session_id)
        annotations = session.body["metadata"].get("annotations") or {}
        if annotations.get(OWNER) != owner:
            raise InvalidRequest(
                f"session {session_id!r} was declared outside the gateway; delete it where it "
                "was declared (kubectl delete ks, or mcp-forge delete)"
            )
        await self.runtime.delete(session.name, session.namespace)
        self._defaults = {o: n for o, n in self._defaults.items() if n != session.name}

    async def default(self, owner: str) -> KernelSession:
        """This client's default session, created on first use (and again if it went away)."""
        lock = self._default_locks.setdefault(owner, asyncio.Lock())
        async with lock:
            name = self._defaults.get(owner)
            if name is not None:
                try:
                    return await self.resolve(owner, name)
                except SessionNotFound:
                    pass  # culled or closed: make a new one
            session = await self.create(owner, SessionRequest())
            self._defaults[owner] = session.name
            return session

    async def forget(self, owner: str) -> None:
        """A client went away: delete the sessions it created."""
        self._defaults.pop(owner, None)
        for session in await self.runtime.list(NAMESPACE):
            annotations = session.body["metadata"].get("annotations") or {}
            if annotations.get(OWNER) == owner:
                await self._delete_quietly(session)  # best effort; failures are logged

    async def cleanup(self) -> int:
        """The gateway stops: delete every session it created for clients, all at once
        (a stdio client gives its server a few seconds after closing stdin)."""
        mine = [
            s
            for s in await self.runtime.list(NAMESPACE)
            if (s.body["metadata"].get("annotations") or {}).get(CREATED_BY) == self.gateway_id
        ]
        return sum(await asyncio.gather(*(self._delete_quietly(s) for s in mine)))

    async def _delete_quietly(self, session: KernelSession) -> int:
        try:
            await self.runtime.delete(session.name, session.namespace)
        except SessionNotFound:
            return 0
        except ForgeError as exc:
            log.warning("could not delete session %s: %s", session.name, exc)
            return 0
        return 1
