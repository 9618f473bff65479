"""A real single-node Kubernetes on this machine, for tests and by hand (`tests/kube/cluster`).

    tests/kube/cluster up                builds what is missing, starts it, prints the kubeconfig
    tests/kube/cluster status            each process, the node; exit 0 when it is Ready
    tests/kube/cluster down              stops everything and removes every trace (idempotent)
    tests/kube/cluster import IMAGE...   copies Podman images into the node's containerd

What runs, each a process of its own, started and stopped by PID: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler (the control plane), containerd with Debian's runc,
the kubelet, kube-proxy (nftables), kube-router (NetworkPolicy only) and local-path-provisioner
(PersistentVolumes, behind the default StorageClass `standard`). Everything lives under one
directory (ROOT); `down` removes it and every trace the components leave elsewhere.

This module is the entry point (`up`, `status`, the command line); the parts are modules of
their own: cluster_common (names, places, addresses), cluster_pki (certificates, kubeconfigs),
cluster_config (each component's configuration and command line), cluster_processes (starting,
stopping, waiting), cluster_images (the node's images), cluster_addons (RBAC, storage, DNS),
cluster_teardown (`down`).

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script (tests/kube/cluster): its parts are the package `kube`, in tests/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "kube"

from .cluster_addons import bootstrap, dns_ready, start_dns
from .cluster_common import COMPONENTS, NODE, ROOT, ClusterError, build, log, node_ip
from .cluster_config import commands, write_configs
from .cluster_images import ctr, ensure_pause_image, import_images, static_image, volume_helper
from .cluster_pki import make_pki
from .cluster_processes import (
    api_get,
    etcd_healthy,
    log_tail,
    node_ready,
    running,
    start,
    started_so_far,
    wait_until,
)
from .cluster_teardown import down, share_netns_dir

# --- up / status -----------------------------------------------------------------------------


def up() -> Path:
    """Start whatever is not running; return the admin kubeconfig."""
    for tool in ("openssl", "ipset", "iptables", "nft", "runc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} is missing: run .ci/setup (it installs the node's tools)")
    if not Path("/usr/lib/cni/bridge").exists():
        raise ClusterError(
            "CNI plugins missing (/usr/lib/cni): apt-get install containernetworking-plugins"
        )
    bins = build()
    ip = node_ip()
    share_netns_dir()
    ROOT.mkdir(parents=True, exist_ok=True)
    # Searchable, as containerd's own directories are: the runc of a pod with a user
    # namespace prepares its root already as that namespace's root, under this one.
    os.chmod(ROOT, 0o711)
    (ROOT / "containerd").mkdir(exist_ok=True)
    os.chmod(ROOT / "containerd", 0o711)
    old = ROOT / "node-ip"
    if old.exists() and old.read_text().strip() != ip:
        raise ClusterError("this machine's address changed since the cluster was made: run down")
    old.write_text(ip)
    make_pki(ROOT / "pki", ip)
    write_configs(ip, bins)
    (ROOT / "bin").unlink(missing_ok=True)
    (ROOT / "bin").symlink_to(bins)
    env = {
        "PATH": f"{bins}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(ROOT),
        "LANG": "C.UTF-8",
    }
    argv = commands(ip, bins)
    t0 = time.monotonic()
    for name in COMPONENTS:
        if running(name) is None:
            start(name, argv[name], env)
        started_so_far.append(name)
        if name == "etcd":
            wait_until("etcd health", lambda: etcd_healthy())
        elif name == "kube-apiserver":
            wait_until("API server ready", lambda: api_get("/readyz") == "ok")
            bootstrap(bins)
        elif name == "containerd":
            # Not the socket's existence: one left by a containerd that died, or made a moment
            # before it listens, refused the first `ctr` in a CI run. Answering is the event.
            wait_until(
                "containerd answering", lambda: ctr(bins, "version", check=False).returncode == 0
            )
            ensure_pause_image(bins)
            static_image(bins, volume_helper(bins), bins / "volume-helper", ["/volume-helper"])
        elif name == "kubelet":  # kube-router needs the Node object to exist
            wait_until("node Ready", node_ready)
    start_dns(bins)
    wait_until("cluster DNS ready", dns_ready)
    wait_until(
        "default ServiceAccount",
        lambda: bool(api_get("/api/v1/namespaces/default/serviceaccounts/default")),
    )
    log(f"cluster up in {time.monotonic() - t0:.1f}s: node {NODE} at {ip}")
    return ROOT / "conf" / "admin.kubeconfig"


def status() -> bool:
    ok = True
    for name in COMPONENTS:
        pid = running(name)
        ok &= pid is not None
        print(f"{name:24} {'running, pid ' + str(pid) if pid else 'stopped'}")
    ready = False
    if ok:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError, KeyError):
            ready = node_ready()
    print(f"{'node ' + NODE:24} {'Ready' if ready else 'not Ready'}")
    if ready:
        print(f"kubeconfig               {ROOT / 'conf' / 'admin.kubeconfig'}")
    return ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/kube/cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the cluster; print the admin kubeconfig")
    sub.add_parser("status", help="which processes run; exit 0 when the node is Ready")
    sub.add_parser("down", help="stop it and remove every trace (idempotent)")
    imp = sub.add_parser("import", help="copy Podman images into the node")
    imp.add_argument("images", nargs="+")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the test cluster needs root", file=sys.stderr)
        return 1
    try:
        if args.command == "up":
            print(up())
        elif args.command == "status":
            return 0 if status() else 3
        elif args.command == "down":
            down()
        elif args.command == "import":
            import_images(build(), args.images)
    except (ClusterError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or ""
        print(f"error: {e}\n{detail}".rstrip(), file=sys.stderr)
        for name in started_so_far:  # a component that died is the likeliest cause: say how
            if running(name) is None:
                print(
                    f"{name} is not running; the end of its log:\n{log_tail(name)}", file=sys.stderr
                )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
