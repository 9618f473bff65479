"""A small, typed door to the Kubernetes API, for the operator and the gateway.

Plain dictionaries in and out (the objects as the API spells them, camelCase), through
the official client's connection handling and authentication (kubeconfig or the pod's
service account), without its generated models: the renderer already speaks dicts, and
a round trip through models would rename every field. Blocking, like the client: async
callers use `asyncio.to_thread`. Every call has a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Generator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import kubernetes
import kubernetes.utils
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from mcp_forge import __version__
from mcp_forge.api import secret as secrets
from mcp_forge.api.kernelsession import API_VERSION, KernelSession
from mcp_forge.errors import ApiError

log = logging.getLogger(__name__)

# kind -> (path prefix, plural)
PATHS: dict[str, tuple[str, str]] = {
    "Pod": ("api/v1", "pods"),
    "Secret": ("api/v1", "secrets"),
    "ConfigMap": ("api/v1", "configmaps"),
    "Service": ("api/v1", "services"),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),
    "Lease": ("apis/coordination.k8s.io/v1", "leases"),
    "Event": ("api/v1", "events"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "KernelSession": (f"apis/{API_VERSION}", "kernelsessions"),
    "KernelSessionPool": (f"apis/{API_VERSION}", "kernelsessionpools"),
}
MERGE = "application/merge-patch+json"
MANAGER = "mcp-forge"  # the field manager of writes; the operator and gateway name theirs
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
REQUEST_TIMEOUT = 30.0
POOL_SIZE = 32  # connections kept open to the API server
BODY_MAX = 64_000_000  # one list of 200 sessions is ~1 MB; refuse a runaway answer


# Set on a session's activity Lease by a gateway, read by the operator.
BUSY_PREFIX = "busy.mcpforge.dev/"  # + its identity: until when it runs code in the kernel
RESTART = "mcpforge.dev/restart"  # the kernelId (pod uid) it wants restarted


def connection_file_of(secret: dict[str, Any] | None) -> dict[str, Any] | None:
    """The connection file (connection.json) a connection Secret holds, if it is a JSON
    object."""
    if not secret:
        return None
    raw: str | None = None
    data = secret.get("data") or {}
    if isinstance(data.get("connection.json"), str):
        with contextlib.suppress(ValueError):
            raw = base64.b64decode(data["connection.json"]).decode()
    if raw is None:  # stringData: what an API server turns into data (and an emulator keeps)
        raw = (secret.get("stringData") or {}).get("connection.json")
    try:
        info = json.loads(raw or "")
    except (ValueError, TypeError):
        return None
    return info if isinstance(info, dict) else None


def key_of(secret: dict[str, Any] | None) -> str | None:
    """The HMAC key in a connection Secret, if it holds a readable one."""
    key = (connection_file_of(secret) or {}).get("key")
    return key if isinstance(key, str) and len(key) >= 32 else None


def secret_env(kube: Kube, session: KernelSession) -> dict[str, str]:
    """The values of the session's env taken from Secrets (of its namespace), by variable;
    SecretError names a missing Secret or key, never a value."""

    def lookup(name: str) -> secrets.Secret | None:
        body = kube.get("Secret", session.namespace, name)
        return secrets.load(body) if body is not None else None

    return secrets.resolve(session.spec.env, session.namespace, lookup)


def _error(exc: ApiException) -> ApiError:
    message = exc.reason or ""
    reason = exc.reason or ""
    try:
        body = json.loads(exc.body or "{}")
        message = str(body.get("message") or message)
        reason = str(body.get("reason") or reason)
    except (ValueError, AttributeError):
        pass
    return ApiError(int(exc.status or 0), reason, message)


def load_config() -> kubernetes.client.Configuration:
    """The pod's service account inside a cluster, else the kubeconfig ($KUBECONFIG)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config(client_configuration=config)  # type: ignore[no-untyped-call]
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise ApiError(
                0, "NoConfig", f"no in-cluster config and no kubeconfig: {exc}"
            ) from None
    return config


def quantity(text: Any) -> Decimal | None:
    """A quantity as the API writes it ("1Gi", "500M", "1073741824"); None if it is not
    one (a missing field, or garbage)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        value: Decimal = kubernetes.utils.parse_quantity(text)  # type: ignore[no-untyped-call]
    except (ValueError, ArithmeticError):
        return None
    return value


@dataclass(frozen=True)
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    object: dict[str, Any]


class Kube:
    """`manager` names whoever writes through it (the operator, a gateway): every write
    carries it as its field manager, so managedFields and tools that read them (Argo
    CD's `managedFieldsManagers`) can tell them apart."""

    def __init__(
        self, config: kubernetes.client.Configuration | None = None, *, manager: str = MANAGER
    ) -> None:
        self.manager = manager
        config = config or load_config()
        # Callers run calls side by side from threads (the operator's reconciles); a
        # connection beyond the pool's size is closed after one use (a new TLS handshake).
        config.connection_pool_maxsize = max(config.connection_pool_maxsize or 0, POOL_SIZE)
        self.client = kubernetes.client.ApiClient(config)
        # Watches have connections of their own: one a watch leaves mid-stream is no
        # good for another call (see `watch`), and the calls' own stay warm meanwhile.
        self._watches = kubernetes.client.ApiClient(config)
        # Audit logs name the user, which the operator and a gateway may share (a test's
        # admin, a kubeconfig): the agent says which of them asked.
        for client in (self.client, self._watches):
            client.user_agent = f"{manager}/{__version__}"

    def close(self) -> None:
        self.client.close()  # type: ignore[no-untyped-call]
        self._watches.close()  # type: ignore[no-untyped-call]

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        """`namespace` "" with no name: every namespace's (a list across the cluster)."""
        prefix, plural = PATHS[kind]
        if not namespace and name is None:
            return f"/{prefix}/{plural}"
        path = f"/{prefix}/namespaces/{namespace}/{plural}"
        if name is not None:
            path += f"/{name}"
        if sub is not None:
            path += f"/{sub}"
        return path

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] = REQUEST_TIMEOUT,
        stream: bool = False,
        accept: str = "application/json",
    ) -> Any:
        client = self._watches if stream else self.client
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        if method in ("POST", "PATCH", "PUT"):
            query = [*(query or []), ("fieldManager", self.manager)]
        try:
            m, url, h, b, _ = client.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = client.call_api(m, url, h, b, _request_timeout=timeout)
            if stream:
                if resp.status >= 300:
                    resp.read()  # type: ignore[no-untyped-call]
                    raise ApiException(http_resp=resp)
                return resp
            data = resp.read()  # type: ignore[no-untyped-call]
            if resp.status >= 300:
                raise ApiException(http_resp=resp)
        except ApiException as exc:
            raise _error(exc) from None
        except Exception as exc:  # urllib3: refused, reset, timed out
            raise ApiError(0, type(exc).__name__, str(exc)) from None
        if len(data) > BODY_MAX:
            raise ApiError(0, "TooLarge", f"an answer of {len(data)} bytes from {path}")
        return json.loads(data) if data else None

    # ---- objects -----------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if there is none."""
        try:
            obj: dict[str, Any] = self._call("GET", self.path(kind, namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        return obj

    def list(
        self,
        kind: str,
        namespace: str,
        *,
        labels: dict[str, str] | None = None,
        fields: dict[str, str] | None = None,
        metadata_only: bool = False,
        cached: bool = False,
        limit: int | None = None,
        after: str | None = None,
    ) -> dict[str, Any]:
        """The list object (items and metadata.resourceVersion); with `metadata_only`,
        each item's metadata alone (a PartialObjectMetadataList: no data, no spec).
        With `limit`, one page: `metadata.continue` is the next page's `after`.

        `cached`: as the API server's watch cache has it now (resourceVersion 0), which
        may be a few milliseconds behind. Else the list is consistent, and the API server
        holds it until its cache has caught up with etcd: up to 100 ms while nothing of
        that kind changes (measured: 65-97 ms for a namespace's pods). For callers whose
        writes are guarded by resourceVersion, or that a later reconcile corrects."""
        query = [("resourceVersion", "0")] if cached else []
        if limit is not None:
            query.append(("limit", str(limit)))
        if after:
            query.append(("continue", after))
        if labels:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items())))
        if fields:
            query.append(("fieldSelector", ",".join(f"{k}={v}" for k, v in fields.items())))
        accept = METADATA_ONLY if metadata_only else "application/json"
        result: dict[str, Any] = self._call(
            "GET", self.path(kind, namespace), query=query, accept=accept
        )
        return result

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        obj: dict[str, Any] = self._call(
            "POST", self.path(body["kind"], meta["namespace"]), body=body
        )
        return obj

    def ensure(
        self, body: dict[str, Any], *, likely_new: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """The object of that name, created from `body` if absent; (object, created).

        With `likely_new` it is created first and read only if it was there already: one
        call instead of two for an object just asked for (a new session's children).
        """
        meta = body["metadata"]
        if not likely_new:
            existing = self.get(body["kind"], meta["namespace"], meta["name"])
            if existing is not None:
                return existing, False
        try:
            return self.create(body), True
        except ApiError as exc:
            if not exc.conflict:
                raise
        # Made meanwhile by someone else (another reconcile, a restarted operator).
        existing = self.get(body["kind"], meta["namespace"], meta["name"])
        if existing is None:
            raise ApiError(409, "Conflict", f"{body['kind']} {meta['name']} came and went")
        return existing, False

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        status: bool = False,
        timeout: float = REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386), of the status subresource with `status`; with
        `metadata.resourceVersion` in it, only if the object is unchanged since (409)."""
        obj: dict[str, Any] = self._call(
            "PATCH",
            self.path(kind, namespace, name, "status" if status else None),
            body=patch,
            content_type=MERGE,
            timeout=timeout,
        )
        return obj

    def delete(
        self,
        kind: str,
        namespace: str,
        name: str,
        *,
        grace: int | None = None,
        uid: str = "",
        resource_version: str = "",
    ) -> bool:
        """Delete it (only that incarnation, with `uid`; only if unchanged since it was
        read, with `resource_version`); False if it was gone already, or is not that."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace is not None:
            options["gracePeriodSeconds"] = grace
        preconditions = {"uid": uid, "resourceVersion": resource_version}
        if uid or resource_version:
            options["preconditions"] = {k: v for k, v in preconditions.items() if v}
        try:
            self._call("DELETE", self.path(kind, namespace, name), body=options)
        except ApiError as exc:
            if exc.not_found:
                return False
            if exc.conflict and (uid or resource_version):
                return False  # a newer incarnation, or changed: not ours to delete
            raise
        return True

    def watch(
        self,
        kind: str,
        namespace: str,
        *,
        resource_version: str,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Generator[Event, None, None]:
        """Events after `resource_version`, until `timeout` passes without one. With
        `labels`, of objects with them only (one that loses them is DELETED).

        The API may end the stream at any time; callers list again and go on.

        Watches use connections of their own: one left before its stream ended (the
        caller had what it waited for) is closed, and were it the calls' pool's, the
        next call would open a new TLS connection where the API server is busiest, right
        after the change watched for (5 ms on a quiet host, 15-25 ms after a warm claim:
        tests/bench/bench_operator.py).
        """
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(max(1, int(timeout)))),
        ]
        if name is not None:
            query.append(("fieldSelector", f"metadata.name={name}"))
        if labels:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items())))
        resp = self._call(
            "GET", self.path(kind, namespace), query=query, stream=True, timeout=(10.0, timeout)
        )
        ended = False
        try:
            for line in iter_resp_lines(resp.response):  # type: ignore[no-untyped-call]
                if len(line) > BODY_MAX:
                    raise ApiError(0, "TooLarge", f"a watch event of {len(line)} bytes")
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise ApiError(int(obj.get("code") or 0), "WatchError", str(obj.get("message")))
                if name is not None and (obj.get("metadata") or {}).get("name") != name:
                    continue
                yield Event(str(event.get("type")), obj)
            ended = True
        except ApiError:
            raise
        except Exception as exc:  # read timed out, connection reset: the stream ended
            log.debug("watch of %s ended: %s", kind, exc)
        finally:
            if ended:
                resp.response.release_conn()
            else:
                resp.response.close()
