"""`cluster down`: the test cluster's processes stopped, every trace of it removed.

Besides ROOT, `down` removes what components put elsewhere: the pods' processes and cgroups,
mounts, network namespaces, the bridge, the nftables tables of kube-proxy, the iptables chains
and ipsets of the kubelet and kube-router, containerd's runc state. `up` first makes /run/netns
a shared mount, so that `down` can still reach the pods' network namespaces there.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from .cluster_common import BRIDGE, ROOT, STOP_TIMEOUT, ClusterError, log, run
from .cluster_processes import stop

# Kept outside ROOT by their authors; removed by `down`.
STRAY_DIRS = (
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet/plugins_registry",
    "/var/log/containers",
    "/var/lib/cni/results",
    "/run/containerd/fifo",
    "/run/containerd/runc",
    "/run/containerd/io.containerd.runtime.v2.task",
    "/run/containerd/s",  # the shims' sockets
)
# Made by them, removed only when empty (another kubelet or containerd may use them).
STRAY_PARENTS = ("/var/lib/kubelet", "/var/lib/cni", "/run/containerd")


def share_netns_dir() -> None:
    """Make /run/netns a shared mount of itself before the CNI plugins mount pods' network
    namespaces in it, as `ip netns` and Podman do when they first need it. Otherwise the
    first of them to run later (a local session's pod) bind-mounts /run/netns over itself,
    hiding the cluster's namespaces from `down`: their mounts can no longer be reached by
    path, and `down` fails on them (seen here: a Podman pod played after `up`)."""
    netns = Path("/run/netns")
    netns.mkdir(parents=True, exist_ok=True)
    mounted = any(
        line.split()[4] == str(netns)
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )
    if not mounted:
        run("mount", "--bind", str(netns), str(netns))
    run("mount", "--make-rshared", str(netns))


def down() -> None:
    """Stop every process and remove every trace; safe to run again, or on nothing."""
    t0 = time.monotonic()
    for name in ("local-path-provisioner", "kube-router", "kube-proxy", "kubelet"):
        stop(name)
    kill_pods()
    stop("containerd")
    kill_shims()
    for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        stop(name)
    unmount_all()
    clean_network()
    for d in STRAY_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    for d in STRAY_PARENTS:
        with contextlib.suppress(OSError):
            os.rmdir(d)
    if ROOT.exists():
        shutil.rmtree(ROOT, ignore_errors=True)
    left = leftovers()
    if left:
        raise ClusterError("down left traces behind:\n  " + "\n  ".join(left))
    log(f"cluster down in {time.monotonic() - t0:.1f}s")


def leftovers() -> list[str]:
    """Whatever of a cluster is still on this machine: empty after a complete `down`."""
    left = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and os.readlink(proc / "exe").startswith(str(cache_dir())):
                left.append(f"process {proc.name}: {os.readlink(proc / 'exe')}")
    prefixes = (str(ROOT) + "/", "/run/containerd/", "/run/netns/cni-")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if line.split()[4].startswith(prefixes):
            left.append(f"mount {line.split()[4]}")
    left += [f"cgroup {d}" for d in cgroup_dirs()]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        left.append(f"bridge {BRIDGE}")
    tables = run("nft", "list", "tables", check=False).stdout
    left += [f"nftables {t}" for t in tables.splitlines() if t.endswith(" kube-proxy")]
    for save in ("iptables-save", "ip6tables-save"):
        if shutil.which(save):
            chains = [x for x in run(save, check=False).stdout.splitlines() if "KUBE-" in x]
            left += [f"{save}: {x}" for x in chains]
    if shutil.which("ipset"):
        sets = run("ipset", "list", "-n", check=False).stdout.split()
        left += [f"ipset {n}" for n in sets if "KUBE-" in n or "kube-router" in n]
    left += [f"directory {d}" for d in (str(ROOT), *STRAY_DIRS) if Path(d).exists()]
    return left


def cgroup_dirs() -> Iterator[Path]:
    """Every cgroup the kubelet made for pods (cgroupfs driver: `kubepods` under each
    hierarchy), deepest first. os.walk, not rglob: cgroups vanish while we walk."""
    base = Path("/sys/fs/cgroup")
    tops = [base, *(p for p in base.iterdir() if p.is_dir())] if base.exists() else []
    for top in tops:
        for path, _dirs, _files in os.walk(top / "kubepods", topdown=False):
            yield Path(path)


def kill_pods() -> None:
    """SIGKILL every process in the pods' cgroups, then remove the cgroups (deepest first)."""
    deadline = time.monotonic() + STOP_TIMEOUT
    while True:
        pids = set()
        for d in cgroup_dirs():
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise ClusterError(f"pod processes survived SIGKILL: {sorted(pids)}")
        time.sleep(0.05)  # the kernel reaps them
    for d in cgroup_dirs():
        with contextlib.suppress(OSError):
            d.rmdir()


def kill_shims() -> None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            exe = os.readlink(proc / "exe")
        except OSError:
            continue
        if Path(exe).name == "containerd-shim-runc-v2" and exe.startswith(str(cache_dir())):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def cache_dir() -> Path:
    return Path(os.environ.get("MCPFORGE_CACHE_DIR", "/var/cache/mcp-forge"))


def unmount_all() -> None:
    """Every mount under our directory, containerd's run dir and its CNI network namespaces."""
    prefixes = (str(ROOT) + "/", "/run/containerd/", "/run/netns/cni-", "/var/run/netns/cni-")
    for _ in range(5):
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        ours = [m for m in mounts if m.startswith(prefixes)]
        if not ours:
            break
        for m in sorted(ours, key=len, reverse=True):
            run("umount", "-l", m, check=False)
    for ns in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
        with contextlib.suppress(OSError):
            ns.unlink()


def clean_network() -> None:
    run("ip", "link", "delete", BRIDGE, check=False)
    for family in ("ip", "ip6"):
        run("nft", "delete", "table", family, "kube-proxy", check=False)
    # The kubelet's and kube-router's iptables chains (KUBE-*), in every table, both families.
    for save, tool in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
        if shutil.which(save) is None:
            continue
        table = ""
        rules: list[tuple[str, str]] = []
        chains: list[tuple[str, str]] = []
        for line in run(save, check=False).stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                chains.append((table, line[1:].split()[0]))
            elif line.startswith("-A ") and " KUBE-" in line + " " and "-j KUBE-" in line:
                rules.append((table, line))
        for table, rule in rules:
            words = shlex.split(rule)
            if words[1].startswith("KUBE-"):
                continue  # goes with its chain
            run(tool, "-t", table, "-D", *words[1:], check=False)
        for table, chain in chains:
            run(tool, "-t", table, "-F", chain, check=False)
        for table, chain in chains:
            run(tool, "-t", table, "-X", chain, check=False)
    if shutil.which("ipset"):
        for name in run("ipset", "list", "-n", check=False).stdout.split():
            if name.startswith(("KUBE-", "kube-router", "inet6:KUBE-", "inet6:kube-router")):
                run("ipset", "destroy", name, check=False)
