"""A cluster kernel's way out (issue 28), as rendered: pure, no I/O.

A session with an allow-list (`spec.network.allow`) reaches the cluster's egress proxy
(manifests/base/common/egress.yaml) and nothing else:

* its Secret holds its proxy credential (derived from the kernel's key, as locally) and,
  where the proxy reads some of its requests, its CA: the certificate, which the kernel
  trusts, and the key, which the pod never refers to (the operator puts it in the
  proxy's grant; whoever may read the Secret holds the kernel's key anyway);
* its pod's environment names the proxy by the Service's address (the kernel has no DNS)
  in `HTTP(S)_PROXY`, the credential coming from the Secret by reference; the CA's
  certificate comes the same way, and kernelside/launch.py makes the trust bundle;
* its NetworkPolicy lets it out to the proxy's pods on the proxy's port, only.

A kernel claimed from a pool was started with none of it (a pool's kernels have no way
out): the claim moves it under the session's NetworkPolicy, the operator adds the egress
keys and the proxy's address to its Secret, and the gateway tells the running kernel the
variables and the CA when it first connects (runtimes/cluster.py), as local claims do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp_forge.api.keys import BridgeCert
from mcp_forge.egress.protocol import PROXY_USER, RELAY_PORT
from mcp_forge.kernelside import launch

TOKEN_KEY = "egress-token"
CA_KEY = "egress-ca.pem"
CA_PRIVATE_KEY = "egress-ca-key.pem"  # never referenced by the pod
# In the Secret of a kernel claimed from a pool only: the proxy's address, which the
# gateway tells that kernel (it was started with no way out, and so without it).
PROXY_KEY = "egress-proxy"
TOKEN_ENV = "MCPFORGE_EGRESS_TOKEN"
PROXY_PORT = RELAY_PORT  # the proxy pods' port (3128), as a NetworkPolicy sees it
EGRESS_SELECTOR = {"app.kubernetes.io/name": "mcp-forge", "app.kubernetes.io/component": "egress"}
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")


@dataclass(frozen=True)
class Route:
    """Where the cluster's egress proxy is: its Service's address, and its namespace."""

    address: str  # host:port, the Service's ClusterIP
    namespace: str


def secret_data(token: str, ca: BridgeCert | None, proxy: str | None = None) -> dict[str, str]:
    """The session Secret's egress keys; with `proxy`, a claimed kernel's Secret's."""
    data = {TOKEN_KEY: token}
    if ca is not None:
        data |= {CA_KEY: ca.cert, CA_PRIVATE_KEY: ca.key}
    if proxy is not None:
        data[PROXY_KEY] = proxy
    return data


def ca_of(data: dict[str, str]) -> BridgeCert | None:
    """The CA kept in a Secret's (decoded) data, if it holds both halves."""
    cert, key = data.get(CA_KEY), data.get(CA_PRIVATE_KEY)
    return BridgeCert(cert, key) if cert and key else None


def env(secret: str, route: Route, ca: bool) -> list[dict[str, Any]]:
    """The kernel's proxy settings: upper and lower case (curl reads only `http_proxy`),
    the credential by reference (the pod object holds no value); with `ca`, the CA's
    certificate for launch.py and the bundle it makes, named for OpenSSL, requests,
    curl, pip and Node."""
    ref = {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}
    url = f"http://{PROXY_USER}:$({TOKEN_ENV})@{route.address}"
    out: list[dict[str, Any]] = [{"name": TOKEN_ENV, "valueFrom": ref}]
    settings = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "NO_PROXY": "localhost,127.0.0.1,::1"}
    for name, value in settings.items():
        out += [{"name": name, "value": value}, {"name": name.lower(), "value": value}]
    if ca:
        ca_ref = {"secretKeyRef": {"name": secret, "key": CA_KEY}}
        out.append({"name": launch.EGRESS_CA_ENV, "valueFrom": ca_ref})
        out += [{"name": name, "value": launch.EGRESS_BUNDLE} for name in CA_VARIABLES]
        out.append({"name": "NODE_EXTRA_CA_CERTS", "value": launch.EGRESS_CA_FILE})
    return out


def policy_rule(route: Route) -> dict[str, Any]:
    """The NetworkPolicy's one way out: the proxy's pods, on its port."""
    where = {"matchLabels": {"kubernetes.io/metadata.name": route.namespace}}
    return {
        "to": [{"namespaceSelector": where, "podSelector": {"matchLabels": dict(EGRESS_SELECTOR)}}],
        "ports": [{"port": PROXY_PORT, "protocol": "TCP"}],
    }
