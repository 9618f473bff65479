"""Where KernelSessions are realized: the interface the gateway sees.

Two implementations, chosen once at start-up: `LocalRuntime` (an embedded store and
Podman, this package's local mode) and, later, the Kubernetes one (the API server,
with the operator doing the realizing). The gateway holds no session state of its
own: everything it needs to reach a kernel comes from here.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any, Protocol

from .connection import ConnectionInfo
from .resource import KernelSession


@dataclass(frozen=True)
class Termination:
    """Why a kernel stopped."""

    reason: str  # "OOMKilled", "Error", "Completed"
    exit_code: int | None
    message: str


class Runtime(Protocol):
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

    async def record_activity(self, session: KernelSession) -> None: ...

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        """Bytes of memory each running kernel uses now, by session name."""
        ...
