"""Local Secrets: applied with `mcp-forge apply`, kept in the store, read by sessions.

A session's env may take values from keys of Secrets of its namespace. A Podman pod's
env shows in `podman inspect`, so those variables are never in the pod: once the kernel
answers, and after every (re)start, the runtime gives them to it over its own shell
channel in a silent execute (`LocalRuntime.give_env`, the same code that gives a claimed
pool kernel its env), and only then is the session Ready. A Secret or key that is not
there fails the session (reason SecretNotFound), naming them, never a value.

As on a cluster, changing a Secret changes no running kernel: its next start reads it.
"""

from __future__ import annotations

from typing import Any

from mcp_forge.api import secret
from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.secret import Secret
from mcp_forge.errors import SecretError
from mcp_forge.runtimes.local.store import Store


class Secrets:
    """The store's Secrets (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def apply(self, body: dict[str, Any]) -> tuple[Secret, str]:
        """Create or replace a Secret; returns it and "created", "configured" or "unchanged"."""
        body = secret.validate(body)
        meta = body["metadata"]
        current = self.store.get_secret(meta["namespace"], meta["name"]) or {}
        meta["creationTimestamp"] = (current.get("metadata") or {}).get(
            "creationTimestamp"
        ) or st.stamp()
        action = self.store.put_secret(body)
        return secret.load(body), action

    def get(self, name: str, namespace: str = "default") -> Secret:
        body = self.store.get_secret(namespace, name)
        if body is None:
            raise SecretError(st.SECRET_NOT_FOUND, f"no Secret {name!r} in namespace {namespace!r}")
        return secret.load(body)

    def find(self, name: str, namespace: str = "default") -> Secret | None:
        body = self.store.get_secret(namespace, name)
        return secret.load(body) if body is not None else None

    def all(self, namespace: str | None = None) -> list[Secret]:
        return [secret.load(b) for b in self.store.list_secrets(namespace)]

    def delete(self, name: str, namespace: str = "default") -> None:
        """Delete a Secret. Running kernels keep the values they were given."""
        if not self.store.delete_secret(namespace, name):
            raise SecretError(st.SECRET_NOT_FOUND, f"no Secret {name!r} in namespace {namespace!r}")

    def values(self, session: KernelSession) -> dict[str, str]:
        """The session's variables taken from Secrets, by name (SecretError if one is
        missing or unusable)."""
        return secret.resolve(
            session.spec.env, session.namespace, lambda name: self.find(name, session.namespace)
        )
