"""The operator's side of a cluster session's egress (issue 28): where the proxy is, and
each session's grant.

A session with an allow-list gets a grant (egress/grant.py), a Secret in the proxy's
namespace that the proxy's feeder reads: its credential, rules, CA and the values added
from the Secrets its rules name, which the operator reads in the session's namespace at
every reconcile (a changed value reaches the proxy within one resync). A grant has no
owner (none can be set across namespaces): the operator deletes it when its session is
deleted or loses its list, and at its start deletes every grant whose session is gone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
from typing import Any

from mcp_forge.api import secret as secrets
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.keys import new_egress_ca
from mcp_forge.clients.kube import Kube, key_of
from mcp_forge.control import render_egress
from mcp_forge.control.render import connection_secret_in
from mcp_forge.control.render_egress import Route, ca_of
from mcp_forge.egress import grant
from mcp_forge.egress.protocol import token_for
from mcp_forge.errors import SecretError
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)
ROUTE_TTL = 30.0  # the proxy Service's address is looked up again after this
_LABELS = {"app.kubernetes.io/name": "mcp-forge", "app.kubernetes.io/managed-by": "mcp-forge"}


class EgressUnavailable(Exception):
    """The cluster's egress proxy is not installed: its Service is not there."""


class Grants:
    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube = kube
        self.namespace = settings.egress_namespace
        self.service = settings.egress_service
        self._route: tuple[float, Route | None] = (0.0, None)
        self._written: dict[tuple[str, str], str] = {}  # session: its grant's digest, as written
        self._cleared: set[tuple[str, str]] = set()  # stopped sessions whose grant is gone
        self._lock = threading.Lock()

    # ---- where the proxy is ---------------------------------------------------------

    def route(self) -> Route:
        """The proxy Service's address (looked up at most every ROUTE_TTL seconds). Once
        known, a Service gone for a while keeps its last address: the kernels that name
        it are not replaced for that (they get no answer until it is back)."""
        at, route = self._route
        if route is not None and time.monotonic() - at < ROUTE_TTL:
            return route
        service = self.kube.get("Service", self.namespace, self.service)
        spec = (service or {}).get("spec") or {}
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        if (not ip or ip == "None" or not ports) and route is not None:
            log.warning("the egress proxy's Service is gone: its last address stays")
            self._route = (time.monotonic(), route)
            return route
        if not ip or ip == "None" or not ports:
            raise EgressUnavailable(
                "spec.network.allow needs the cluster's egress proxy, and its Service "
                f"{self.namespace}/{self.service} is not there (manifests/base installs it)"
            )
        host = f"[{ip}]" if ":" in ip else ip
        route = Route(f"{host}:{int(ports[0]['port'])}", self.namespace)
        self._route = (time.monotonic(), route)
        return route

    # ---- grants -----------------------------------------------------------------------

    def ensure(
        self,
        session: KernelSession,
        secret: dict[str, Any] | None,
        sources: list[str],
        *,
        verify: bool = False,
    ) -> None:
        """The session's grant, from its connection Secret (`secret`: the credential's
        key and the CA) and the values its rules name, its credential good from `sources`
        only (its kernel pod's addresses; none before the pod has one). SecretError names
        a missing value, or a grant too large for a Secret. `verify`: read the grant even
        if this process wrote the same one (before a kernel pod is made: someone may have
        deleted it)."""
        key = key_of(secret)
        if secret is None or key is None:
            raise SecretError(
                "InvalidSecret", f"the connection Secret of {session.name!r} holds no key yet"
            )
        data = secrets.load(secret).data
        ca = ca_of({k: v.decode() for k, v in data.items() if k.startswith("egress-ca")})

        body = grant.grant(session, token_for(key), ca, self.values(session), sources)
        text = _bounded(body)
        digest = hashlib.sha256(text.encode()).hexdigest()
        where = (session.namespace, session.name)
        if self._written.get(where) == digest and not verify:
            return
        want = grant.grant_secret(
            session,
            self.namespace,
            body,
            {**_LABELS, "mcpforge.dev/session": session.name,
             "mcpforge.dev/namespace": session.namespace},
        )  # fmt: skip
        current = self.kube.get("Secret", self.namespace, want["metadata"]["name"])
        if current is None:
            self.kube.create(want)
        elif _grant_of(current) == body:
            pass  # as written before (this process, or an earlier one)
        else:
            self.kube.patch("Secret", self.namespace, want["metadata"]["name"],
                            {"stringData": want["stringData"]})  # fmt: skip
        with self._lock:
            self._written[where] = digest
            self._cleared.discard(where)
        log.info("egress grant of %s/%s written", *where)

    def values(self, session: KernelSession) -> list[list[Any]]:
        """The values the session's rules name, read now; SecretError names a missing one."""

        def lookup(name: str) -> secrets.Secret | None:
            body = self.kube.get("Secret", session.namespace, name)
            return secrets.load(body) if body is not None else None

        return grant.values(session, lookup)

    def check(self, session: KernelSession) -> None:
        """Refuse now what `ensure` would refuse (a missing value, a grant too large),
        before a kernel is claimed for the session: with a credential and a CA of the
        sizes it will have."""
        ca = new_egress_ca(f"{session.namespace}/{session.name}")
        sources = ["ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"] * 2  # the longest a pod has
        _bounded(grant.grant(session, token_for("-"), ca, self.values(session), sources))

    def claimed(self, session: KernelSession, pod: dict[str, Any], *, verify: bool) -> None:
        """The grant of a session whose kernel was claimed from a pool, from that kernel's
        Secret, which first gains the session's egress keys and the proxy's address (the
        gateway tells the kernel). SecretError as `ensure`; EgressUnavailable."""
        ns, name = session.namespace, connection_secret_in(pod)
        secret = self.kube.get("Secret", ns, name) if name else None
        key = key_of(secret)
        if secret is None or key is None or name is None:
            raise SecretError(
                "InvalidSecret", f"the claimed kernel of {session.name!r} has no readable key"
            )
        have = {
            k: v.decode() for k, v in secrets.load(secret).data.items() if k.startswith("egress-")
        }
        ca = None
        if grant.reads_requests(session):
            ca = ca_of(have) or new_egress_ca(f"{ns}/{session.name}")
        want = render_egress.secret_data(token_for(key), ca, self.route().address)
        if any(have.get(k) != v for k, v in want.items()):
            secret = self.kube.patch("Secret", ns, name, {"stringData": want})
        self.ensure(session, secret, pod_addresses(pod), verify=verify)

    def remove(self, namespace: str, name: str, *, known: bool = False) -> None:
        """Delete the session's grant. Without `known`, only one this operator wrote (a
        session without an allow-list costs no request; `sweep` finds the others)."""
        where = (namespace, name)
        with self._lock:
            written = self._written.get(where)
        if written is None and not known:
            return
        self.kube.delete("Secret", self.namespace, f"{namespace}.{name}")
        with self._lock:  # only once it is gone: a failed delete is tried again
            if self._written.get(where) == written:
                self._written.pop(where, None)
            self._cleared.add(where)

    def clear(self, namespace: str, name: str) -> None:
        """A stopped session's grant goes (no pod, no address to be good from): deleted
        once by this process whoever wrote it (an older operator, one that died between
        the pod and the grant), then no request at each resync."""
        with self._lock:
            done = (namespace, name) in self._cleared and (namespace, name) not in self._written
        if not done:
            self.remove(namespace, name, known=True)

    def sweep(self) -> int:
        """Delete every grant whose session is gone or has no allow-list; how many. Run at
        the operator's start (a session deleted while it was down left its grant)."""
        listed = self.kube.list(
            "Secret", self.namespace, labels={grant.GRANT_LABEL: "true"}, metadata_only=True
        )
        removed = 0
        for item in listed.get("items") or []:
            labels = item["metadata"].get("labels") or {}
            ns, name = labels.get("mcpforge.dev/namespace"), labels.get("mcpforge.dev/session")
            found = self.kube.get("KernelSession", ns, name) if ns and name else None
            if ((found or {}).get("spec") or {}).get("network", {}).get("allow"):
                continue
            self.kube.delete("Secret", self.namespace, item["metadata"]["name"])
            removed += 1
        return removed


def pod_addresses(pod: dict[str, Any] | None) -> list[str]:
    """A pod's addresses as its status shows them: none before it has a sandbox, nor once
    it has ended or is being deleted (its status still shows an address the kubelet has
    given back, which another pod may get)."""
    status = (pod or {}).get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return []
    if ((pod or {}).get("metadata") or {}).get("deletionTimestamp"):
        return []
    found = [a.get("ip") for a in status.get("podIPs") or [] if isinstance(a, dict)]
    found.append(status.get("podIP"))
    return sorted({a for a in found if isinstance(a, str) and a})


def _bounded(body: dict[str, Any]) -> str:
    """A grant's text; SecretError past a Secret's bound, naming the field."""
    text = json.dumps(body, sort_keys=True)
    if len(text) > grant.GRANT_MAX:
        raise SecretError(
            "EgressGrantTooLarge",
            f"spec.network.allow: the egress grant is {len(text)} bytes, over "
            f"{grant.GRANT_MAX} (a Secret's bound): fewer rules, paths or values",
        )
    return text


def _grant_of(secret: dict[str, Any]) -> Any:
    """A grant Secret's body as read (None if unreadable)."""
    try:
        return json.loads(base64.b64decode((secret.get("data") or {}).get(grant.GRANT_KEY, "")))
    except ValueError:
        return None
