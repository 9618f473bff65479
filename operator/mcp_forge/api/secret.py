"""Secrets (core/v1) as local mode keeps them, and the env values they give. Pure: no I/O.

A session's `spec.env` may take a value from a key of a Secret of its namespace
(`valueFrom.secretKeyRef`). On a cluster the kubelet reads it; locally `mcp-forge apply`
stores Secrets in the local store, checked here the way the API server checks them:
`data` holds base64, `stringData` plain text that is merged into `data` (it wins), keys
are `[-._a-zA-Z0-9]+`, and all of it is at most 1 MiB.

No message made here holds a value: errors name the Secret, the field and the key.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcp_forge.api.kernelsession import EnvVar
from mcp_forge.api.status import INVALID_SECRET, SECRET_NOT_FOUND
from mcp_forge.errors import InvalidSession, SecretError

API_VERSION = "v1"
KIND = "Secret"
MAX_BYTES = 2**20  # the API server's limit on a Secret's data
NAME_MAX = 253
KEY_MAX = 253
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")
_FIELDS = frozenset({"apiVersion", "kind", "metadata", "type", "data", "stringData", "immutable"})
_META_FIELDS = frozenset({"name", "namespace", "labels", "annotations"})


@dataclass(frozen=True)
class Secret:
    """A stored Secret: its keys may be shown, its values never (not even by repr)."""

    name: str
    namespace: str
    data: Mapping[str, bytes] = field(repr=False)
    body: dict[str, Any] = field(repr=False)

    @property
    def keys(self) -> list[str]:
        return sorted(self.data)


def validate(obj: Any, *, default_namespace: str = "default") -> dict[str, Any]:
    """A Secret as the store keeps it: metadata, type, and `data` (base64) with
    `stringData` merged in. InvalidSession names the first offending field."""
    if not isinstance(obj, dict):
        raise InvalidSession("a Secret must be a mapping", field="(root)")
    if obj.get("apiVersion") != API_VERSION:
        raise InvalidSession(
            f"must be {API_VERSION}, got {obj.get('apiVersion')!r}", field="apiVersion"
        )
    if obj.get("kind") != KIND:
        raise InvalidSession(f"must be {KIND}, got {obj.get('kind')!r}", field="kind")
    extra = sorted(map(str, set(obj) - _FIELDS))
    if extra:
        raise InvalidSession("unknown field", field=extra[0])
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise InvalidSession("required field missing", field="metadata")
    extra = sorted(map(str, set(meta) - _META_FIELDS - {"uid", "creationTimestamp"}))
    if extra:
        raise InvalidSession("unknown field", field=f"metadata.{extra[0]}")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidSession("required field missing", field="metadata.name")
    if len(name) > NAME_MAX or not _NAME_RE.match(name):
        raise InvalidSession(
            f"{name!r} must be at most {NAME_MAX} characters of a-z, 0-9, '-' and '.' "
            "(a DNS subdomain)",
            field="metadata.name",
        )
    namespace = meta.get("namespace", default_namespace)
    if not isinstance(namespace, str) or len(namespace) > 63 or not _LABEL_RE.match(namespace):
        raise InvalidSession(f"{namespace!r} is not a valid namespace", field="metadata.namespace")
    for part in ("labels", "annotations"):
        value = meta.get(part, {})
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise InvalidSession("must be a mapping of strings", field=f"metadata.{part}")
    kind = obj.get("type", "Opaque")
    if not isinstance(kind, str) or not kind or len(kind) > 253:
        raise InvalidSession("must be a non-empty string", field="type")
    if not isinstance(obj.get("immutable", False), bool):
        raise InvalidSession("must be a boolean", field="immutable")

    decoded = _decode(obj.get("data"), "data", text=False)
    decoded.update(_decode(obj.get("stringData"), "stringData", text=True))
    total = sum(len(k) + len(v) for k, v in decoded.items())
    if total > MAX_BYTES:
        raise InvalidSession(
            f"the Secret's data is {total} bytes; at most {MAX_BYTES} (1 MiB)", field="data"
        )
    kept = {k: copy.deepcopy(meta[k]) for k in ("labels", "annotations") if meta.get(k)}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, **kept},
        "type": kind,
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(decoded.items())},
    }


def _decode(section: Any, where: str, *, text: bool) -> dict[str, bytes]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise InvalidSession("must be a mapping of keys to strings", field=where)
    out: dict[str, bytes] = {}
    for key, value in section.items():
        if not isinstance(key, str) or len(key) > KEY_MAX or not _KEY_RE.match(key):
            shown = key if isinstance(key, str) else type(key).__name__
            raise InvalidSession(
                f"key {shown[:KEY_MAX]!r} must be at most {KEY_MAX} characters of "
                "a-z, A-Z, 0-9, '-', '_' and '.'",
                field=where,
            )
        if not isinstance(value, str):
            # Only the type: the value may be a secret that YAML read as a number.
            raise InvalidSession(
                f"must be a string, not {type(value).__name__}", field=f"{where}.{key}"
            )
        if text:
            out[key] = value.encode()
            continue
        try:
            out[key] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidSession(
                "is not valid base64 (put plain text in stringData)", field=f"{where}.{key}"
            ) from None
    return out


def load(body: dict[str, Any]) -> Secret:
    """A Secret from a validated body (as stored)."""
    meta = body["metadata"]
    data = {k: base64.b64decode(v) for k, v in (body.get("data") or {}).items()}
    return Secret(meta["name"], meta.get("namespace", "default"), data, body)


def refs(env: Sequence[EnvVar]) -> list[tuple[str, str, str]]:
    """(variable, Secret, key) of each variable taken from a Secret."""
    return [(e.name, *e.secret) for e in env if e.secret is not None]


def resolve(
    env: Sequence[EnvVar], namespace: str, lookup: Callable[[str], Secret | None]
) -> dict[str, str]:
    """The values of the variables of `env` taken from Secrets (by variable name).

    SecretError (reason SecretNotFound) names the first Secret or key that is missing;
    (reason InvalidSecret) a value that is no environment string: not UTF-8, or a NUL.
    """
    out: dict[str, str] = {}
    secrets: dict[str, Secret | None] = {}
    for var, name, key in refs(env):
        if name not in secrets:
            secrets[name] = lookup(name)
        secret = secrets[name]
        if secret is None:
            raise SecretError(
                SECRET_NOT_FOUND,
                f"spec.env {var}: Secret {name!r} not found in namespace {namespace!r}",
            )
        if key not in secret.data:
            raise SecretError(
                SECRET_NOT_FOUND,
                f"spec.env {var}: Secret {name!r} has no key {key!r} "
                f"(it has: {', '.join(secret.keys) or 'none'})",
            )
        try:
            value = secret.data[key].decode()
        except UnicodeDecodeError:
            value = "\0"
        if "\0" in value:
            raise SecretError(
                INVALID_SECRET,
                f"spec.env {var}: key {key!r} of Secret {name!r} is not text an environment "
                "variable can hold (UTF-8, no NUL byte)",
            )
        out[var] = value
    return out
