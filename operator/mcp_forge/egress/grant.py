"""What the egress proxy is given for a session, on both realizers: its credential, its
rules, its CA (where the proxy reads requests) and the values it adds from Secrets.

Locally the gateway sends it over the proxy's control socket (egress/client.py). On a
cluster the operator writes it as a Secret in the proxy's namespace, a *grant*, one per
session (`grant_secret`); the proxy's feeder (egress/feeder.py) reads the grants and
sends each to the proxy the same way. The kernel's pod never holds a grant: its Secret
has the credential and the CA's certificate only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mcp_forge.api import status as st
from mcp_forge.api.egress import VALUE_MAX
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.keys import BridgeCert
from mcp_forge.api.secret import Secret
from mcp_forge.errors import SecretError

GRANT_LABEL = "mcpforge.dev/egress-grant"
GRANT_KEY = "grant.json"
# A grant's JSON: a Secret's data holds at most 1 MiB (etcd's object limit, with room
# for its metadata); the proxy takes up to protocol.MESSAGE_MAX (8 MiB) in one message.
GRANT_MAX = 768 << 10
_SENDABLE = re.compile(rb"[\x20-\x7e\t]*")  # a header's, a query's or a password's value


def session_name(session: KernelSession) -> str:
    """The session as the proxy knows it, on both realizers: `namespace/name`."""
    return f"{session.namespace}/{session.name}"


def values(session: KernelSession, lookup: Callable[[str], Secret | None]) -> list[list[Any]]:
    """The values the proxy adds to the session's requests: [rule number, index, value].
    SecretError names the rule's field and the Secret, never a value."""
    out: list[list[Any]] = []
    for rule in session.spec.egress_rules:
        for i, injection in enumerate(rule.inject):
            where = f"spec.network.allow[{rule.number - 1}].inject[{i}]"
            found = lookup(injection.secret)
            if found is None or injection.key not in found.data:
                missing = "not found" if found is None else f"has no key {injection.key!r}"
                raise SecretError(
                    st.SECRET_NOT_FOUND,
                    f"{where}: Secret {injection.secret!r} {missing} in namespace "
                    f"{session.namespace!r}",
                )
            raw = found.data[injection.key]
            if len(raw) > VALUE_MAX or not _SENDABLE.fullmatch(raw):
                raise SecretError(
                    st.INVALID_SECRET,
                    f"{where}: Secret {injection.secret!r} key {injection.key!r} is not a value "
                    f"to send (printable ASCII, tabs and spaces, at most {VALUE_MAX} bytes)",
                )
            out.append([rule.number, i, raw.decode("ascii")])
    return out


def reads_requests(session: KernelSession) -> bool:
    """Does the proxy read some of the session's requests (and so need its CA)?"""
    return any(rule.reads_requests for rule in session.spec.egress_rules)


def grant(
    session: KernelSession,
    token: str,
    ca: BridgeCert | None,
    added: list[list[Any]],
    sources: list[str] | None = None,
) -> dict[str, Any]:
    """The proxy's `open` message for the session, less its `op`. `sources`: the
    addresses of its kernel's pod, the only ones its credential is good from (a cluster;
    empty while it has none); None: not bound (local mode, where its socket is)."""
    body = {
        "session": session_name(session),
        "token": token,
        "rules": list(session.body["spec"].get("network", {}).get("allow", [])),
        "values": added,
        "ca": {"cert": ca.cert, "key": ca.key} if ca is not None else None,
    }
    if sources is not None:
        body["sources"] = sorted(sources)
    return body


def grant_name(session: KernelSession) -> str:
    """The grant Secret's name: `namespace.name` (both DNS labels, so a DNS subdomain)."""
    return f"{session.namespace}.{session.name}"


def grant_secret(
    session: KernelSession, namespace: str, body: dict[str, Any], labels: dict[str, str]
) -> dict[str, Any]:
    """The grant as a Secret in the proxy's namespace (`namespace`). No owner: a Secret
    cannot be owned across namespaces, so the operator deletes it with its session."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": grant_name(session),
            "namespace": namespace,
            "labels": {**labels, GRANT_LABEL: "true"},
        },
        "type": "Opaque",
        "stringData": {GRANT_KEY: json.dumps(body, separators=(",", ":"), sort_keys=True)},
    }


def parse_grant(text: str | bytes) -> dict[str, Any]:
    """A grant as read back (the feeder's input: a Secret anyone allowed in the proxy's
    namespace may have written). ValueError for anything that is not one."""
    if len(text) > GRANT_MAX:
        raise ValueError(f"a grant of {len(text)} bytes, over {GRANT_MAX}")
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("a grant is a JSON object")
    for name, kind in (("session", str), ("token", str), ("rules", list), ("values", list)):
        if not isinstance(body.get(name), kind):
            raise ValueError(f"a grant's {name!r} is not a {kind.__name__}")
    ca = body.get("ca")
    if ca is not None and not (
        isinstance(ca, dict) and isinstance(ca.get("cert"), str) and isinstance(ca.get("key"), str)
    ):
        raise ValueError("a grant's 'ca' is not {cert, key}")
    sources = body.get("sources")
    if sources is not None and not (
        isinstance(sources, list) and all(isinstance(a, str) for a in sources)
    ):
        raise ValueError("a grant's 'sources' is not a list of addresses")
    return body
