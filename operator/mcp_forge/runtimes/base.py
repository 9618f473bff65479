"""Where KernelSessions are realized: the interfaces the gateway sees, one per caller.

Two implementations, chosen once at start-up: `LocalRuntime` (local/: an embedded
store and Podman) and `KubernetesRuntime` (cluster.py: the API server, with the
operator doing the realizing). The gateway holds no session state of its own:
everything it needs to reach a kernel comes from here.
"""

from __future__ import annotations

import builtins
from typing import Any, Protocol

from mcp_forge.api.connection import Address, ConnectionInfo
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.quota import Seat
from mcp_forge.api.status import Termination
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.settings import Settings


class SessionCatalog(Protocol):
    """Sessions as the gateway's session service keeps them (gateway/sessions.py):
    made, read, deleted, their kernels' memory, and the quota that bounds them."""

    settings: Settings

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        """The session, with status kept true; SessionNotFound if there is none."""
        ...

    async def list(self, namespace: str | None = None) -> list[KernelSession]: ...

    async def create(self, body: dict[str, Any]) -> KernelSession:
        """Create a session from a KernelSession body and wait until it is Ready."""
        ...

    async def delete(self, name: str, namespace: str = "default") -> None:
        """Delete a session and everything it created."""
        ...

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        """The session with status made true; with `restart`, a dead kernel is restarted
        per restartPolicy (else its death is only recorded)."""
        ...

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        """Bytes of memory each running kernel uses now, by session name."""
        ...

    async def fork(
        self, name: str, namespace: str, bodies: builtins.list[dict[str, Any]]
    ) -> builtins.list[KernelSession]:
        """Make a session of each body (api/forks.body) from the Ready session `name`'s
        memory and files (a live snapshot of its kernel); the new sessions as they
        ended. ForgeError, and no new session, if no snapshot could be taken."""
        ...

    async def reserve(self, claim: Seat) -> None:
        """Reserve a place for a session before creating it, atomically across gateway
        replicas (api/quota.py); InvalidRequest if the owner holds its limit of sessions
        and reservations already. The creator calls `release` once the session exists
        or its create failed."""
        ...

    async def release(self, claim: Seat) -> None:
        """Drop the reservation (nothing if there is none)."""
        ...


class KernelAccess(Protocol):
    """A session's kernel as the gateway's core runs code in it (gateway/core.py, its
    connections in connections.py): reached, kept true, restarted, and its use recorded."""

    settings: Settings

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        """The session, with status kept true; SessionNotFound if there is none."""
        ...

    async def connection(self, session: KernelSession) -> ConnectionInfo:
        """How the gateway reaches the session's kernel (key included)."""
        ...

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        """The session with status made true; with `restart`, a dead kernel is restarted
        per restartPolicy (else its death is only recorded)."""
        ...

    async def termination(self, session: KernelSession) -> Termination | None:
        """Why the kernel stopped, or None if it is running."""
        ...

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        """Start the kernel afresh (workspace kept) and wait until it answers."""
        ...

    async def record_activity(self, session: KernelSession, *, busy: bool = False) -> None:
        """The session is in use (`busy`: its kernel runs code now): not idle."""
        ...


class KernelExtras(Protocol):
    """What a new connection to a kernel is given (gateway/attach.py): claim-time
    setup, spec.packages, and code mode's bridge and its call rate."""

    async def kernel_setup(self, session: KernelSession) -> str | None:
        """Silent code the gateway runs in the session's kernel when it connects, before
        any of the agent's (claim_program: the env a kernel claimed from a pool was
        started without, and working files); None: nothing to give."""
        ...

    async def kernel_packages(self, session: KernelSession, conn: KernelConnection) -> None:
        """spec.packages in a kernel the gateway has just connected to, unless it has them
        (runtimes/spec_packages.py): where the runtime does not install them at start."""
        ...

    async def bridge_address(self, session: KernelSession) -> tuple[tuple[str | int, ...], Address]:
        """Code mode: where the kernel's bridge listens (inside its pod), and how the
        gateway reaches it."""
        ...

    async def count_call(self, session: KernelSession, server: str, per_minute: int) -> bool:
        """Code mode: count a call of the session to `server`, where every replica counts
        (api/quota.py); False, and not counted, if `per_minute` calls were made in the
        last minute."""
        ...


class Kernels(KernelAccess, KernelExtras, Protocol):
    """What the gateway (gateway/core.py with connections.py, attach.py and workspace.py)
    needs."""


class Runtime(SessionCatalog, Kernels, Protocol):
    """A whole runtime: what `mcp-forge gateway` picks at start (gateway/serve.py)."""
