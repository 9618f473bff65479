"""The kubelet's checkpoint API, called on the node itself (issue 27, docs/design.md §14).

`POST https://<node>:<kubelet port>/checkpoint/<namespace>/<pod>/<container>` has the
kubelet checkpoint a running container with CRIU; it answers with the archive's path on
that node. Called at the kubelet directly, the operator needs only `create` on
`nodes/checkpoint` (the kubelet asks the API server whether the caller may); through the
API server's node proxy it would need `nodes/proxy`, which also lets its holder run
commands in every pod of the node.

The kubelet is shown a token of the checkpointer ServiceAccount when one is set
(`checkpoint_service_account`: a TokenRequest of ten minutes, which may only checkpoint;
a node that kept it could do no more, for no longer), else the operator's own
credentials (its ServiceAccount's token, or a kubeconfig's). Its serving certificate is
checked against the cluster's CA: a node's kubelet must serve a certificate the cluster
signed (`serverTLSBootstrap`, or one signed by hand as on the test node) for the node's
address, which is what is dialled.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import kubernetes
from kubernetes.client.exceptions import ApiException

from mcp_forge.clients.kube import Kube
from mcp_forge.errors import ApiError
from mcp_forge.settings import service_account

log = logging.getLogger(__name__)

# Seconds: CRIU writes the kernel's memory to the node's disk. The kubelet's own bound on
# a runtime call is 2 minutes by default (runtimeRequestTimeout): asked for as much.
CHECKPOINT_TIMEOUT = 120
FREEZE_TRIES = 3  # checkpoints of a container runc could not freeze (`unfrozen`)
FREEZE_BACKOFF = 0.25  # seconds before the second try, twice that before the third
ANSWER_MAX = 64 << 10
TOKEN_LIFE = 600  # seconds: the shortest a TokenRequest may ask for
TOKEN_SPARE = 180  # seconds of life left when a token is asked for again
TOKEN_TIMEOUT = 10.0  # seconds: other checkpoints wait on the one asking


@dataclass(frozen=True)
class Taken:
    node: str
    archive: str  # its path on the node


def endpoint(node: dict[str, Any]) -> str:
    """The kubelet's URL of a Node object: its InternalIP (else any address) and port."""
    status = node.get("status") or {}
    addresses = status.get("addresses") or []
    chosen = next((a["address"] for a in addresses if a.get("type") == "InternalIP"), None)
    chosen = chosen or next((a["address"] for a in addresses if a.get("address")), None)
    if not chosen:
        raise ApiError(0, "NoAddress", f"node {node['metadata']['name']} has no address")
    port = int(
        ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 10250
    )
    try:
        host = f"[{chosen}]" if ipaddress.ip_address(chosen).version == 6 else chosen
    except ValueError:
        host = chosen  # a name
    return f"https://{host}:{port}"


def dial(
    api: kubernetes.client.Configuration, host: str, token: str = ""
) -> kubernetes.client.Configuration:
    """A configuration for the kubelet at `host`: the API server's CA, and `token` or
    else the API server's credentials, and nothing else of `api`. Not a copy: an
    in-cluster configuration's token refresh hook sets `host` back to the API server's at
    every call, and a kubeconfig's proxy or TLS server name are the API server's."""
    config = kubernetes.client.Configuration()
    config.host = host
    config.ssl_ca_cert = api.ssl_ca_cert
    config.verify_ssl = api.verify_ssl
    if token:  # the kubelet would take a client certificate first
        config.api_key = {"BearerToken": f"Bearer {token}"}
        return config
    config.cert_file, config.key_file = api.cert_file, api.key_file
    bearer = api.get_api_key_with_prefix("BearerToken", alias="authorization")
    if bearer:  # "Bearer <token>", read now (the hook refreshes an expiring one)
        config.api_key = {"BearerToken": bearer}
    return config


class Kubelet:
    """Calls to nodes' kubelets with the CA of `kube`, and the token of
    `service_account` ("<namespace>/<name>") or else the credentials of `kube`."""

    def __init__(self, kube: Kube, account: str = "") -> None:
        self.account = service_account(account)  # InvalidRequest if malformed
        self.kube = kube
        self.service_account = account
        self._token = ("", 0.0)  # the token and when to ask again (monotonic)
        self._lock = threading.Lock()

    def token(self) -> str:
        """A token of the checkpointer ServiceAccount ("" if none is set), asked for
        again once most of its life is gone. ApiError if the API server refuses."""
        if not self.service_account:
            return ""
        with self._lock:
            token, renew = self._token
            if token and time.monotonic() < renew:
                return token
            path = self.kube.path("ServiceAccount", *self.account, "token")
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOKEN_LIFE},
            }
            asked = time.monotonic()
            said = self.kube._call("POST", path, body=body, timeout=TOKEN_TIMEOUT) or {}
            token = str((said.get("status") or {}).get("token") or "")
            if not token:
                raise ApiError(0, "NoToken", f"no token for {self.service_account}")
            self._token = (token, asked + TOKEN_LIFE - TOKEN_SPARE)
            return token

    def forget(self) -> None:
        """The token is asked for again at the next call (the kubelet refused it: its
        ServiceAccount made again, say)."""
        with self._lock:
            self._token = ("", 0.0)

    def checkpoint(self, node: str, namespace: str, pod: str, container: str) -> Taken:
        """Checkpoint the container; where the archive is. ApiError says why not (the
        kubelet's answer: CRIU's failure, a container not running, a refusal). A token
        the kubelet does not know (401) is asked for afresh and tried once more; a
        container the runtime could not freeze is tried again (`unfrozen`)."""
        for attempt in range(1, FREEZE_TRIES + 1):
            try:
                return self._authorized(node, namespace, pod, container)
            except ApiError as exc:
                if not unfrozen(exc) or attempt == FREEZE_TRIES:
                    raise
                log.warning("%s/%s: not frozen for its checkpoint (%s); again", namespace, pod, exc)
                time.sleep(FREEZE_BACKOFF * attempt)  # a retry's backoff: runc thawed it
        raise AssertionError("unreachable")

    def _authorized(self, node: str, namespace: str, pod: str, container: str) -> Taken:
        try:
            return self._checkpoint(node, namespace, pod, container)
        except ApiError as exc:
            if exc.status != 401 or not self.service_account:
                raise
        self.forget()
        return self._checkpoint(node, namespace, pod, container)

    def _checkpoint(self, node: str, namespace: str, pod: str, container: str) -> Taken:
        body = self.kube._call("GET", f"/api/v1/nodes/{quote(node, safe='')}")
        config = dial(self.kube.client.configuration, endpoint(body), self.token())
        client = kubernetes.client.ApiClient(config)
        path = "/checkpoint/" + "/".join(quote(p, safe="") for p in (namespace, pod, container))
        try:
            method, url, headers, payload, _ = client.param_serialize(
                "POST", path, query_params=[("timeout", str(CHECKPOINT_TIMEOUT))],
                header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
            )  # fmt: skip
            resp = client.call_api(
                method, url, headers, payload, _request_timeout=(10, CHECKPOINT_TIMEOUT + 10)
            )
            data = resp.read()  # type: ignore[no-untyped-call]
            if resp.status >= 300:
                raise ApiException(http_resp=resp)
        except ApiException as exc:
            said = (
                (exc.body or b"").decode(errors="replace")
                if isinstance(exc.body, bytes)
                else str(exc.body or exc.reason)
            )
            raise ApiError(int(exc.status or 0), "CheckpointFailed", said[:2000]) from None
        except Exception as exc:  # urllib3: refused, reset, timed out, a certificate refused
            raise ApiError(0, type(exc).__name__, f"kubelet of {node}: {exc}"[:2000]) from None
        finally:
            client.close()  # type: ignore[no-untyped-call]
        try:
            items = json.loads(data[:ANSWER_MAX])["items"]
            archive = str(items[0])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ApiError(0, "CheckpointFailed", f"the kubelet answered {data[:200]!r}") from None
        return Taken(node, archive)


def unfrozen(exc: ApiError) -> bool:
    """A checkpoint that failed because runc could not freeze the container's cgroup: a
    process of it raced the freezer (a thread starting, a busy host; seen in CI on
    December 6 as "OCI runtime pause failed: unable to freeze"). runc thawed it; nothing
    was taken, and a second try most often freezes it."""
    return exc.status == 500 and "unable to freeze" in str(exc)
