"""The test cluster's certificates and kubeconfigs, made with openssl under ROOT/pki.

A CA, the API server's and the kubelet's serving certificates, one client certificate for each
component and for the admin (their users are what RBAC grants to), the ServiceAccount token
signer; kubeconfigs with the certificates inline.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from .cluster_common import API_SERVICE_IP, NODE, run


def openssl(*args: str) -> None:
    run("openssl", *args)


def make_pki(pki: Path, ip: str) -> None:
    """A CA, the API server's and kubelet's serving certificates, one client certificate each
    (a client added since the CA was made gets its certificate now)."""
    if (pki / "ca.crt").exists():
        clients(pki)
        return
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)

    openssl(
        "req", "-x509", "-new", "-nodes", "-key", key(pki, "ca"), "-days", "3650",
        "-subj", "/CN=mcp-forge-test-ca", "-out", f"{pki}/ca.crt",
    )  # fmt: skip
    server = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    names = (
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
    )
    cert(pki, "apiserver", "/CN=kube-apiserver", f"{server}subjectAltName={names},IP:{ip},"
         f"IP:{API_SERVICE_IP},IP:127.0.0.1\n")  # fmt: skip
    cert(pki, "kubelet-serving", f"/CN={NODE}", f"{server}subjectAltName=DNS:{NODE},IP:{ip}\n")
    key(pki, "sa")
    openssl("ec", "-in", f"{pki}/sa.key", "-pubout", "-out", f"{pki}/sa.pub")
    clients(pki)


CLIENTS = (
    ("admin", "/O=system:masters/CN=mcp-forge-test-admin"),
    ("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client"),
    ("controller-manager", "/CN=system:kube-controller-manager"),
    ("scheduler", "/CN=system:kube-scheduler"),
    ("kubelet", f"/O=system:nodes/CN=system:node:{NODE}"),
    ("kube-proxy", "/CN=system:kube-proxy"),
    ("kube-router", "/CN=kube-router"),  # bound to a ClusterRole by `up`
    ("local-path-provisioner", "/CN=local-path-provisioner"),  # likewise
)


def clients(pki: Path) -> None:
    """The client certificates not made yet."""
    for name, subject in CLIENTS:
        if not (pki / f"{name}.crt").exists():
            cert(
                pki,
                name,
                subject,
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
            )
    for f in pki.iterdir():
        os.chmod(f, 0o600)


def key(pki: Path, name: str) -> str:
    openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{pki}/{name}.key")
    return f"{pki}/{name}.key"


def cert(pki: Path, name: str, subject: str, ext: str) -> None:
    (pki / f"{name}.ext").write_text(ext)
    openssl("req", "-new", "-key", key(pki, name), "-subj", subject, "-out", f"{pki}/{name}.csr")
    openssl(
        "x509", "-req", "-in", f"{pki}/{name}.csr", "-CA", f"{pki}/ca.crt",
        "-CAkey", f"{pki}/ca.key", "-CAcreateserial", "-days", "3650",
        "-extfile", f"{pki}/{name}.ext", "-out", f"{pki}/{name}.crt",
    )  # fmt: skip


def kubeconfig(path: Path, pki: Path, user: str, server: str) -> None:
    """A kubeconfig (JSON is YAML) with the certificates inline, so it can be copied anywhere."""

    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "mcp-forge-test",
                "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(f"{user}.crt"),
                    "client-key-data": b64(f"{user}.key"),
                },
            }
        ],
        "contexts": [
            {"name": "mcp-forge-test", "context": {"cluster": "mcp-forge-test", "user": user}}
        ],
        "current-context": "mcp-forge-test",
    }
    path.write_text(json.dumps(config, indent=1))
    os.chmod(path, 0o600)
