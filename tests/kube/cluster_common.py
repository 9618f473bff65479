"""The test cluster's names, addresses, places and deadlines, and the helpers every part uses.

Everything lives under one directory (MCPFORGE_TEST_CLUSTER_DIR, default
/var/lib/mcp-forge/test-cluster): certificates, etcd's data, each component's config and log,
containerd's root and state, the kubelet's root, pod logs, CNI's address leases. The binaries
come from tests/kube/node/build (the Go module proxy, pinned, cached). The node's address is
this machine's own primary address (the API server is bound to it, as pods reach it there
through the `kubernetes` Service).

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("MCPFORGE_TEST_CLUSTER_DIR", "/var/lib/mcp-forge/test-cluster"))
NODE = "mcpforge-test-node"
API_PORT = 6443  # where most control planes listen (manifests/ admit it)
ETCD_PORT = 23790
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.97.0.0/16"
API_SERVICE_IP = "10.97.0.1"
BRIDGE = "mcpft0"
DNS_SERVICE_IP = "10.97.0.10"
# Deadlines, in seconds.
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0
# Start order; `down` stops in reverse (node side first, then the control plane).
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
    "kube-router",
    "local-path-provisioner",
)
STORAGE_CLASS = "standard"  # the default one: PersistentVolumeClaims that name none get it
STORAGE_NAMESPACE = "local-path-storage"  # where its helper pods run (make and remove dirs)
PROVISIONER = "rancher.io/local-path"


class ClusterError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"== {msg}", file=sys.stderr, flush=True)


def run(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, text=True, capture_output=True, **kw)


# --- binaries, addresses ---------------------------------------------------------------------


def build() -> Path:
    """The directory of the pinned binaries (built now if the cache has none)."""
    out = subprocess.run(
        [str(HERE / "node" / "build")], check=True, text=True, stdout=subprocess.PIPE
    ).stdout
    return Path(out.strip().splitlines()[-1])


def node_ip() -> str:
    """This machine's primary address: the source address of its default route."""
    routes = json.loads(run("ip", "-4", "-json", "route", "show", "default").stdout or "[]")
    devs = [r["dev"] for r in routes if "dev" in r]
    addrs = json.loads(run("ip", "-4", "-json", "addr", "show").stdout)
    for link in sorted(addrs, key=lambda a: a.get("ifname") not in devs):
        for a in link.get("addr_info", []):
            if a.get("scope") == "global" and not ipaddress.ip_address(a["local"]).is_loopback:
                return str(a["local"])
    raise ClusterError("no global IPv4 address on this machine for the node")
