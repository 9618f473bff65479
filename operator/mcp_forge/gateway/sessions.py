"""Sessions as agents see them: who owns which, each client's default session, cleanup.

A client is the one stdio client, or an HTTP client named by its bearer token. A
session an agent creates through the gateway carries two annotations: its owner (the
client) and the id of the gateway process that created it. A client sees and uses:

* the sessions it owns;
* declared sessions (applied with kubectl / GitOps / `mcp-forge apply`, no owner) that
  grant it use in the annotation `mcpforge.dev/clients` (comma-separated client names,
  or `*`). The stdio client runs as the host's own user and may use every declared one.

A session the client may not use is reported exactly as one that does not exist.
Created sessions get unguessable names (`s-` and 12 random hex digits) unless the client
picks one, and claim a ready kernel of the gateway's pool when it serves their spec (a
cluster gateway given no pool picks, per session, one of the namespace's pools that
serves it, the one with most ready kernels first: `kernelsessionpool.choose`); a
client's shared group is its own (other clients' groups with the same name are
different volumes). When the gateway stops, it deletes what it created but HTTP clients'
default sessions (`cleanup`).

Nothing here lives only in this process, so gateway replicas (and a restarted gateway)
agree: a client's default session is found by its name, derived from the client; the
quota is a reservation the runtime counts with the client's sessions atomically
(api/quota.py: a Lease per client on a cluster, the store locally).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mcp_forge.api import egress, forks, kernelsession, quota
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.kernelsessionpool import KernelSessionPool
from mcp_forge.errors import (
    ForgeError,
    InvalidRequest,
    InvalidSession,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.image.kernel import VARIANTS, image_ref
from mcp_forge.logsafe import quoted
from mcp_forge.runtimes.base import SessionCatalog
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

OWNER = "mcpforge.dev/owner"
CREATED_BY = "mcpforge.dev/created-by"
CLIENTS = "mcpforge.dev/clients"
DEFAULT = "mcpforge.dev/default-session"  # "true" on a client's default session
DEFAULT_PREFIX = "default-"  # + a hash of the owner: a default session's name
DEFAULT_TRIES = 3
SETTLE_POLL = 0.01  # first pause while a default session is new or going (then doubles)
NAMESPACE = "default"  # local mode's; a cluster gateway's is settings.session_namespace
STDIO = "stdio"


@dataclass(frozen=True)
class Client:
    """Who is calling: `name` is the stdio client's or the HTTP token's."""

    name: str
    stdio: bool = False

    @property
    def owner(self) -> str:
        return f"{'stdio' if self.stdio else 'http'}:{self.name}"


def stdio_client() -> Client:
    return Client(f"{STDIO}-{secrets.token_hex(8)}", stdio=True)


@dataclass(frozen=True)
class SessionRequest:
    """What a client may choose when it creates a session."""

    name: str | None = None
    variant: str = "default"
    memory: str | None = None
    cpu: str | None = None
    env: dict[str, str] | None = None
    shared_group: str | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # code mode: spec.mcpServers
    allow: list[dict[str, Any]] | None = None  # spec.network.allow, within what is offered


def offered_egress(settings: Settings) -> tuple[egress.Rule, ...]:
    """The destinations clients may choose (Settings.egress_client_allow), or InvalidRequest
    naming the setting."""
    if not settings.egress_client_allow.strip():
        return ()
    name = "MCPFORGE_EGRESS_CLIENT_ALLOW"
    try:
        return egress.parse_rules(json.loads(settings.egress_client_allow), field=name)
    except ValueError as exc:  # JSON's, or InvalidSession naming the rule
        raise InvalidRequest(f"{name}: {exc}") from None


def _annotations(session: KernelSession) -> dict[str, Any]:
    annotations: dict[str, Any] = session.body["metadata"].get("annotations") or {}
    return annotations


def owner_of(session: KernelSession) -> str | None:
    owner = _annotations(session).get(OWNER)
    return owner if isinstance(owner, str) else None


class SessionService:
    """Ownership-checked access to sessions, on top of a runtime's SessionCatalog."""

    def __init__(
        self,
        runtime: SessionCatalog,
        settings: Settings | None = None,
        *,
        namespace: str = NAMESPACE,
    ) -> None:
        self.runtime = runtime
        self.settings = settings or Settings.from_env()
        self.namespace = namespace  # where this gateway's clients have their sessions
        self.mcp_servers: set[str] = set()  # code mode: the upstream servers configured
        self.pool: str | None = None  # new sessions claim a kernel of this pool if it serves
        # Without `pool`: where the pools to choose from are found (a cluster's); None: cold.
        self.find_pools: Callable[[str], Awaitable[builtins.list[KernelSessionPool]]] | None = None
        self.gateway_id = secrets.token_hex(8)
        self.offered = offered_egress(self.settings)  # what a client may list in `allow`
        # One create of a default session at a time per client in this process (the
        # others wait and find it); across replicas the name decides (default_name).
        self._default_locks: dict[str, asyncio.Lock] = {}

    def owns(self, client: Client, session: KernelSession) -> bool:
        return owner_of(session) == client.owner

    def may_use(self, client: Client, session: KernelSession) -> bool:
        if ksp.LABEL_POOL in (session.body["metadata"].get("labels") or {}):
            return False  # a pool's kernel, not claimed yet: nobody's session
        owner = owner_of(session)
        if owner is not None:
            return owner == client.owner
        if client.stdio:
            return True
        granted = str(_annotations(session).get(CLIENTS, ""))
        names = {n.strip() for n in granted.split(",")}
        return "*" in names or client.name in names

    async def resolve(self, client: Client, session_id: str) -> KernelSession:
        """The session `session_id` if this client may use it; else SessionNotFound."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequest("session_id must be a non-empty string")
        try:
            session = await self.runtime.get(session_id, self.namespace)
        except SessionNotFound:
            session = None
        if session is None or not self.may_use(client, session):
            raise SessionNotFound(f"no session {quoted(session_id)} (list_sessions shows yours)")
        return session

    async def list(self, client: Client) -> builtins.list[KernelSession]:
        return [s for s in await self.runtime.list(self.namespace) if self.may_use(client, s)]

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        return await self.runtime.memory_usage(sessions)

    def _shared_group(self, client: Client, group: str) -> str:
        # The group is the client's own: the same name from another client is another
        # volume. (Declared sessions name their groups freely.)
        tag = hashlib.sha256(client.owner.encode()).hexdigest()[:8]
        return f"{group[:31]}-{tag}"

    async def create(
        self, client: Client, request: SessionRequest, *, default: bool = False
    ) -> KernelSession:
        s = self.settings
        body = self._body(client, request, default=default)  # field-named errors, first
        typed = kernelsession.spec_of(body)
        if typed.memory_bytes > kernelsession.parse_quantity(s.session_memory_max, field="memory"):
            raise InvalidSession(f"at most {s.session_memory_max} per session", field="memory")
        if typed.cpu_milli > kernelsession.parse_cpu_milli(s.session_cpu_max, field="cpu"):
            raise InvalidSession(f"at most {s.session_cpu_max} CPUs per session", field="cpu")
        if request.shared_group is not None:
            body["spec"]["sharedGroup"] = self._shared_group(client, request.shared_group)
        if self.pool is None and self.find_pools is not None:
            chosen = ksp.choose(await self.find_pools(self.namespace), body["spec"])
            if chosen is not None:  # none: cold, and the result says so
                body["spec"]["poolRef"] = {"name": chosen.name}
        name = body["metadata"]["name"]
        # The quota holds across replicas: a reservation, counted with the client's
        # sessions atomically where every replica writes them (api/quota.py).
        claim = quota.Seat(
            self.namespace,
            client.owner,
            name,
            s.sessions_per_client_max,
            owns=lambda b: (b["metadata"].get("annotations") or {}).get(OWNER) == client.owner,
        )
        await self.runtime.reserve(claim)
        try:
            return await self.runtime.create(body)
        except InvalidSession as exc:
            if exc.field != "metadata.name":
                raise
            raise InvalidSession(
                f"the name {name!r} is taken; choose another", field="name"
            ) from None
        except ForgeError:
            # Never given to the client: a session that failed to start holds no place
            # of its quota, nor a pod.
            await asyncio.shield(self._drop_failed(client, name))
            raise
        finally:
            # Made, or failed: either way the place is the session's or free again.
            await asyncio.shield(self._release(claim))

    async def fork(
        self,
        client: Client,
        parent: KernelSession,
        count: int,
        env: dict[str, str] | None = None,
    ) -> builtins.list[KernelSession]:
        """`count` new sessions of `client`'s from the live session `parent` (which it
        created; the caller holds its queue): each with its memory and files, its own
        key and user namespace, and `env` for the parent's session variables (the
        parent's spec's if None). Each takes a place of the client's quota, reserved
        first: none is made if they do not all fit. Forks that ended Failed are
        deleted, and returned as they ended (their status says why)."""
        forks.check_count(count)
        if not self.owns(client, parent):
            # A declared session's spec is an operator's (its resources, shared group,
            # lifetime): a client's copies would be sessions it could not have created.
            raise InvalidRequest(
                f"session {parent.name!r} was declared outside the gateway; only sessions "
                "you created can be forked"
            )
        annotations = {OWNER: client.owner, CREATED_BY: self.gateway_id}
        bodies = [
            forks.body(parent, f"s-{secrets.token_hex(6)}", annotations=annotations, env=env)
            for _ in range(count)
        ]
        seats = [
            quota.Seat(
                self.namespace,
                client.owner,
                body["metadata"]["name"],
                self.settings.sessions_per_client_max,
                owns=lambda b: (b["metadata"].get("annotations") or {}).get(OWNER) == client.owner,
            )
            for body in bodies
        ]
        reserved: builtins.list[quota.Seat] = []
        try:
            for seat in seats:
                try:
                    await self.runtime.reserve(seat)
                except InvalidRequest as exc:
                    raise InvalidRequest(f"{count} copies do not fit your quota: {exc}") from None
                reserved.append(seat)
            made = await self.runtime.fork(parent.name, parent.namespace, bodies)
        finally:
            for seat in reserved:
                await asyncio.shield(self._release(seat))
        for child in made:
            if child.status.get("phase") == st.FAILED:
                await self._delete_quietly(child)
        return made

    def _body(self, client: Client, request: SessionRequest, *, default: bool) -> dict[str, Any]:
        """The KernelSession a client's request asks for, validated (nothing stored yet)."""
        if request.variant not in VARIANTS:
            raise InvalidRequest(
                f"variant must be one of {', '.join(VARIANTS)}, got {request.variant!r}"
            )
        if not default and (request.name or "").startswith(DEFAULT_PREFIX):
            raise InvalidSession(
                f"names starting with {DEFAULT_PREFIX!r} are the gateway's", field="name"
            )
        annotations = {OWNER: client.owner, CREATED_BY: self.gateway_id}
        if default:
            annotations[DEFAULT] = "true"
        spec: dict[str, Any] = {"image": image_ref(request.variant), "resources": {}}
        if request.memory is not None:
            spec["resources"]["memory"] = request.memory
        if request.cpu is not None:
            spec["resources"]["cpu"] = request.cpu
        if request.env:
            spec["env"] = [{"name": k, "value": v} for k, v in request.env.items()]
        if request.shared_group is not None:
            spec["sharedGroup"] = request.shared_group
        if request.mcp_servers:
            unknown = sorted(
                {str(m.get("name")) for m in request.mcp_servers if isinstance(m, dict)}
                - set(self.mcp_servers)
            )
            if unknown:
                have = ", ".join(sorted(self.mcp_servers)) or "none"
                raise InvalidSession(
                    f"no MCP server named {', '.join(unknown)} here (configured: {have})",
                    field="mcp_servers",
                )
            spec["mcpServers"] = request.mcp_servers
        if request.allow:
            asked = egress.parse_rules(request.allow, field="allow")
            covering = egress.permitted(asked, self.offered)
            allow = [
                {**raw, "addresses": [str(n) for n in by.addresses]} if by.addresses else raw
                for raw, by in zip(request.allow, covering, strict=True)
            ]
            spec["network"] = {"allow": allow}
        if self.pool is not None:  # warm if the pool serves this spec, else cold (and why)
            spec["poolRef"] = {"name": self.pool}
        return kernelsession.validate(
            {
                "apiVersion": kernelsession.API_VERSION,
                "kind": kernelsession.KIND,
                "metadata": {
                    "name": request.name or f"s-{secrets.token_hex(6)}",
                    "namespace": self.namespace,
                    "annotations": annotations,
                },
                "spec": spec,
            }
        )

    async def _drop_failed(self, client: Client, name: str) -> None:
        """Delete the session `name` this gateway just failed to create for `client`."""
        try:
            session = await self.runtime.get(name, self.namespace)
        except ForgeError:
            return
        annotations = session.body["metadata"].get("annotations") or {}
        if (
            annotations.get(CREATED_BY) == self.gateway_id
            and annotations.get(OWNER) == client.owner
            and session.status.get("phase") == st.FAILED
        ):
            await self._delete_quietly(session)

    async def _release(self, claim: quota.Seat) -> None:
        try:
            await self.runtime.release(claim)
        except ForgeError as exc:  # it lapses by itself (quota.RESERVATION_TTL)
            log.warning("could not release the reservation of %s: %s", claim.name, exc)

    async def close(self, client: Client, session_id: str) -> KernelSession:
        """Delete a session the client created; returns it as it was."""
        session = await self.resolve(client, session_id)
        if not self.owns(client, session):
            raise InvalidRequest(
                f"session {session_id!r} was declared outside the gateway; delete it where it "
                "was declared (kubectl delete ks, or mcp-forge delete)"
            )
        await self.runtime.delete(session.name, session.namespace)
        return session

    def default_name(self, client: Client) -> str:
        """The client's default session's name, the same on every replica and after a
        restart: derived from the client (its owner annotation), never chosen."""
        return DEFAULT_PREFIX + hashlib.sha256(client.owner.encode()).hexdigest()[:16]

    async def default(self, client: Client) -> KernelSession:
        """This client's default session, created on first use (and again if it went
        away or failed). Its name is the client's (`default_name`): replicas racing to
        create it make one, the others find it."""
        async with self._default_locks.setdefault(client.owner, asyncio.Lock()):
            return await self._default_locked(client)

    async def _default_locked(self, client: Client) -> KernelSession:
        name = self.default_name(client)
        for _ in range(DEFAULT_TRIES):
            try:
                session = await self._settled(await self.resolve(client, name))
            except SessionNotFound:  # none, or it was being deleted and now is
                try:
                    return await self.create(client, SessionRequest(name=name), default=True)
                except InvalidSession as exc:
                    if exc.field != "name":
                        raise
                    continue  # another replica made it meanwhile: use that one
            if session.status.get("phase") != st.FAILED:
                return session
            await self._delete_quietly(session)
        raise SessionNotReady(
            f"the default session {name!r} came and went {DEFAULT_TRIES} times; try again"
        )

    async def _settled(self, session: KernelSession) -> KernelSession:
        """The session once it is neither new nor going: one another replica (or a create
        of this one that lost the race) just stored is Pending, or has no phase before
        the operator sees it, until its kernel is asked for (then refreshing waits while
        it starts); one being deleted (a closed default session on a cluster, whose
        deletion the operator finishes) is waited out: SessionNotFound once gone."""
        deadline = time.monotonic() + self.settings.kernel_ready_timeout
        pause = SETTLE_POLL
        while True:
            phase = session.status.get("phase")
            going = phase == st.TERMINATING or bool(
                session.body["metadata"].get("deletionTimestamp")
            )
            if not going and phase not in (None, st.PENDING):
                return session
            if time.monotonic() > deadline:
                raise SessionNotReady(
                    f"session {session.name!r} stayed {phase or 'new'} for "
                    f"{self.settings.kernel_ready_timeout:.0f}s"
                )
            before = (phase, going)
            if going:
                session = await self.runtime.get(session.name, session.namespace)
            else:
                session = await self.runtime.refresh(session)
            if (session.status.get("phase"), going) == before:  # its maker is between steps
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def cleanup(self) -> int:
        """The gateway stops: delete every session it created for clients, all at once
        (a stdio client gives its server a few seconds after closing stdin), but HTTP
        clients' default sessions: another replica, or this gateway restarted, gives
        them to the same client (they go when idle, like any session)."""
        mine = [
            s
            for s in await self.runtime.list(self.namespace)
            if _annotations(s).get(CREATED_BY) == self.gateway_id
            and not (
                _annotations(s).get(DEFAULT) == "true"
                and not (owner_of(s) or "").startswith(f"{STDIO}:")
            )
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
