"""A real single-node Kubernetes on this machine, for tests and by hand (`tests/kube/cluster`).

    tests/kube/cluster up                builds what is missing, starts it, prints the kubeconfig
    tests/kube/cluster status            each process, the node; exit 0 when it is Ready
    tests/kube/cluster down              stops everything and removes every trace (idempotent)
    tests/kube/cluster import IMAGE...   copies Podman images into the node's containerd

What runs, each a process of its own, started and stopped by PID: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler (the control plane), containerd with Debian's runc,
the kubelet, kube-proxy (nftables), kube-router (NetworkPolicy only) and local-path-provisioner
(PersistentVolumes, behind the default StorageClass `standard`). The binaries come from
tests/kube/node/build (the Go module proxy, pinned, cached). Client certificates and RBAC for
everyone, the ServiceAccount token signer, PodSecurity admission (on by default: namespaces opt in
with their labels). The node's address is this machine's own primary address (the API server is
bound to it, as pods reach it there through the `kubernetes` Service); pods get addresses on a
bridge of their own with a route to the Service range only: no default route, nothing leaves the
machine. Pods pull nothing: images are imported (`import`) and the node never collects them.

Everything lives under one directory (MCPFORGE_TEST_CLUSTER_DIR, default
/var/lib/mcp-forge/test-cluster): certificates, etcd's data, each component's config and log,
containerd's root and state, the kubelet's root, pod logs, CNI's address leases. `down` also
removes what components put elsewhere: the pods' processes and cgroups, mounts, network
namespaces, the bridge, the nftables tables of kube-proxy, the iptables chains and ipsets of the
kubelet and kube-router, containerd's runc state.

Only the standard library: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
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


class ClusterError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"== {msg}", file=sys.stderr, flush=True)


def run(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, text=True, capture_output=True, **kw)


# --- binaries, addresses, certificates -------------------------------------------------------


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


# --- configuration of each component ---------------------------------------------------------


def write_configs(ip: str, bins: Path) -> None:
    pki = ROOT / "pki"
    server = f"https://{ip}:{API_PORT}"
    conf = ROOT / "conf"
    conf.mkdir(parents=True, exist_ok=True)
    for user in (
        "admin",
        "controller-manager",
        "scheduler",
        "kubelet",
        "kube-proxy",
        "kube-router",
        "local-path-provisioner",
    ):
        kubeconfig(conf / f"{user}.kubeconfig", pki, user, server)
    write_storage_config(conf, bins)

    (conf / "net.d").mkdir(exist_ok=True)
    cni = {
        "cniVersion": "1.0.0",
        "name": "mcpforge-test",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ROOT / "cni-ipam"),
                    "ranges": [[{"subnet": POD_CIDR}]],
                    # Only the Service range: a pod has no default route.
                    "routes": [{"dst": SERVICE_CIDR}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (conf / "net.d" / "10-mcpforge-test.conflist").write_text(json.dumps(cni, indent=1))

    cri = "plugins.'io.containerd.cri.v1.runtime'"
    (conf / "containerd.toml").write_text(
        f"""version = 3
root = '{ROOT}/containerd/root'
state = '{ROOT}/containerd/state'
[grpc]
  address = '{ROOT}/containerd/containerd.sock'
[ttrpc]
  address = '{ROOT}/containerd/containerd.sock.ttrpc'
[debug]
  address = ''
[metrics]
  address = ''
[{cri}]
  # root here has no CAP_SYS_RESOURCE: runc cannot lower a sandbox's oom_score_adj.
  restrict_oom_score_adj = true
  disable_apparmor = true
[{cri}.cni]
  bin_dirs = ['/usr/lib/cni']
  conf_dir = '{conf}/net.d'
  max_conf_num = 1
[{cri}.containerd]
  default_runtime_name = 'runc'
[{cri}.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
[{cri}.containerd.runtimes.runc.options]
  BinaryName = '/usr/sbin/runc'
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{static_ref("pause", catatonit())}'
"""
    )

    audit = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            # The node's own chatter is not what anyone here wants to count.
            {"level": "None", "userGroups": ["system:nodes"]},
            {"level": "None", "users": ["system:kube-scheduler", "system:kube-proxy"]},
            {
                "level": "None",
                "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
                "namespaces": ["kube-system", "kube-node-lease"],
            },
            {"level": "Metadata"},
        ],
    }
    (conf / "audit-policy.json").write_text(json.dumps(audit, indent=1))

    kubelet = {
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "address": ip,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "readOnlyPort": 0,
        "healthzPort": 0,
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{ROOT}/containerd/containerd.sock",
        "podLogsDir": str(ROOT / "pod-logs"),
        "clusterDomain": "cluster.local",
        "clusterDNS": [DNS_SERVICE_IP],
        "serializeImagePulls": False,
        # Images are imported, never pulled: the node must not collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "maxPods": 250,
        "protectKernelDefaults": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }
    (conf / "kubelet.json").write_text(json.dumps(kubelet, indent=1))

    proxy = {
        "kind": "KubeProxyConfiguration",
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(conf / "kube-proxy.kubeconfig")},
        "hostnameOverride": NODE,
        "clusterCIDR": POD_CIDR,
        "bindAddress": ip,
        "healthzBindAddress": "",
        "metricsBindAddress": "127.0.0.1:10249",
        # No CAP_SYS_RESOURCE-like changes to the host's conntrack table.
        "conntrack": {"maxPerCore": 0, "min": 0},
    }
    (conf / "kube-proxy.json").write_text(json.dumps(proxy, indent=1))


def volume_helper(bins: Path) -> str:
    """The image of local-path-provisioner's helper pods: volume-helper alone."""
    return static_ref("volume-helper", bins / "volume-helper")


def write_storage_config(conf: Path, bins: Path) -> None:
    """local-path-provisioner's configuration: volumes under ROOT/volumes (ROOT is root's,
    0700: no other user of the machine reaches them), each made and removed by a helper pod
    running volume-helper (tests/kube/node/local-path-provisioner/cmd/volume-helper)."""
    config = {
        "nodePathMap": [
            {"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": [str(ROOT / "volumes")]}
        ],
        "setupCommand": "/volume-helper",
        "teardownCommand": "/volume-helper",
        "cmdTimeoutSeconds": 60,
    }
    (conf / "local-path.json").write_text(json.dumps(config, indent=1))
    helper = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "helper-pod"},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [
                {"name": "helper", "image": volume_helper(bins), "imagePullPolicy": "Never"}
            ],
        },
    }
    (conf / "local-path-helper-pod.json").write_text(json.dumps(helper, indent=1))


def commands(ip: str, bins: Path) -> dict[str, list[str]]:
    pki, conf = ROOT / "pki", ROOT / "conf"
    etcd_url = f"http://127.0.0.1:{ETCD_PORT}"
    return {
        "etcd": [
            f"{bins}/etcd",
            "--name=default",
            f"--data-dir={ROOT}/etcd",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{ETCD_PORT + 1}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PORT + 1}",
            f"--initial-cluster=default=http://127.0.0.1:{ETCD_PORT + 1}",
            "--listen-metrics-urls=",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            f"{bins}/kube-apiserver",
            f"--etcd-servers={etcd_url}",
            f"--bind-address={ip}",
            f"--advertise-address={ip}",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={pki}/apiserver.crt",
            f"--tls-private-key-file={pki}/apiserver.key",
            f"--client-ca-file={pki}/ca.crt",
            f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={pki}/apiserver-kubelet-client.key",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--anonymous-auth=false",
            "--profiling=false",
            # Who asked what (tests/bench/bench_operator.py counts the operator's requests).
            f"--audit-policy-file={conf}/audit-policy.json",
            f"--audit-log-path={ROOT}/logs/audit.log",
            "--audit-log-maxsize=200",
            "--audit-log-maxbackup=1",
            "--v=1",
        ],
        "kube-controller-manager": [
            f"{bins}/kube-controller-manager",
            f"--kubeconfig={conf}/controller-manager.kubeconfig",
            f"--authentication-kubeconfig={conf}/controller-manager.kubeconfig",
            f"--authorization-kubeconfig={conf}/controller-manager.kubeconfig",
            f"--service-account-private-key-file={pki}/sa.key",
            f"--root-ca-file={pki}/ca.crt",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--profiling=false",
            "--v=1",
        ],
        "kube-scheduler": [
            f"{bins}/kube-scheduler",
            f"--kubeconfig={conf}/scheduler.kubeconfig",
            f"--authentication-kubeconfig={conf}/scheduler.kubeconfig",
            f"--authorization-kubeconfig={conf}/scheduler.kubeconfig",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--profiling=false",
            "--v=1",
        ],
        "containerd": [f"{bins}/containerd", f"--config={conf}/containerd.toml"],
        "kubelet": [
            f"{bins}/kubelet",
            f"--config={conf}/kubelet.json",
            f"--kubeconfig={conf}/kubelet.kubeconfig",
            f"--root-dir={ROOT}/kubelet",
            f"--cert-dir={ROOT}/kubelet/pki",
            f"--hostname-override={NODE}",
            f"--node-ip={ip}",
            "--v=1",
        ],
        "kube-proxy": [f"{bins}/kube-proxy", f"--config={conf}/kube-proxy.json", "--v=1"],
        "kube-router": [
            f"{bins}/kube-router",
            f"--kubeconfig={conf}/kube-router.kubeconfig",
            f"--hostname-override={NODE}",
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--enable-cni=false",
            "--health-port=0",
            "--metrics-port=0",
            "--v=1",
        ],
        "local-path-provisioner": [
            f"{bins}/local-path-provisioner",
            "start",
            f"--kubeconfig={conf}/local-path-provisioner.kubeconfig",
            f"--config={conf}/local-path.json",
            f"--helper-pod-file={conf}/local-path-helper-pod.json",
            f"--helper-image={volume_helper(bins)}",
            f"--namespace={STORAGE_NAMESPACE}",
            "--service-account-name=volume-helper",
            f"--provisioner-name={PROVISIONER}",
        ],
    }


# --- processes -------------------------------------------------------------------------------


def pidfile(name: str) -> Path:
    return ROOT / "run" / f"{name}.pid"


def running(name: str) -> int | None:
    """The PID of our `name` process, if one runs (checked by its executable, not just the PID)."""
    try:
        pid = int(pidfile(name).read_text())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    return pid if Path(exe).name == name else None


def start(name: str, argv: list[str], env: dict[str, str]) -> None:
    (ROOT / "logs").mkdir(parents=True, exist_ok=True)
    (ROOT / "run").mkdir(parents=True, exist_ok=True)
    with open(ROOT / "logs" / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # outlives `cluster up`; stopped by PID
        )
    pidfile(name).write_text(str(proc.pid))


def stop(name: str) -> None:
    pid = running(name)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not wait_gone(pid, STOP_TIMEOUT):
            # One API server SIGTERM hung past 40 s here: a deadline, then SIGKILL.
            log(f"{name} ({pid}) ignored SIGTERM for {STOP_TIMEOUT:.0f}s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_gone(pid, STOP_TIMEOUT)
    pidfile(name).unlink(missing_ok=True)


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited. Our children are reaped; others are polled in /proc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return True
        except ChildProcessError:
            pass  # not our child: look at /proc
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)  # polling a PID that is not ours: nothing to wait on
    return False


# --- readiness -------------------------------------------------------------------------------


def api_get(path: str, timeout: float = 5.0) -> Any:
    """GET on the API server as the admin (client certificate), decoded."""
    pki = ROOT / "pki"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    ip = (ROOT / "node-ip").read_text().strip()
    url = f"https://{ip}:{API_PORT}{path}"
    with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def wait_until(what: str, check: Any, timeout: float = START_TIMEOUT) -> None:
    """Poll `check()` (a process we do not control) until true, or fail naming the last error."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
            last = e
        dead = [n for n in started_so_far if running(n) is None]
        if dead:
            raise ClusterError(
                f"{dead[0]} exited while waiting for {what}; the end of {logfile(dead[0])}:\n"
                + log_tail(dead[0])
            )
        time.sleep(0.2)  # processes and an API we do not control: polled, under a deadline
    raise ClusterError(f"{what} not reached within {timeout:.0f}s (last error: {last})")


started_so_far: list[str] = []


def logfile(name: str) -> Path:
    return ROOT / "logs" / f"{name}.log"


def log_tail(name: str, lines: int = 25) -> str:
    """The last lines of a component's log (bounded: a log may be large), for an error."""
    try:
        with open(logfile(name), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def node_ready() -> bool:
    node = api_get(f"/api/v1/nodes/{NODE}")
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def kubectl(bins: Path, *args: str, input: str | None = None) -> str:
    return run(
        f"{bins}/kubectl", f"--kubeconfig={ROOT}/conf/admin.kubeconfig", *args, input=input
    ).stdout


# --- up / down / status ----------------------------------------------------------------------


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
    os.chmod(ROOT, 0o700)
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


def etcd_healthy() -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{ETCD_PORT}/health", timeout=2) as r:
        return bool(json.loads(r.read()).get("health") == "true")


def bootstrap(bins: Path) -> None:
    """What kube-router may read: pods, namespaces, policies, nodes (nothing it may write)."""
    read = ["get", "list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "mcp-forge-test:kube-router"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "namespaces", "nodes"], "verbs": read},
            {"apiGroups": [""], "resources": ["services", "endpoints"], "verbs": read},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": read},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
        ],
    }
    user = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kube-router"}
    apply(bins, [role, binding("mcp-forge-test:kube-router", user), *storage()])


def storage() -> list[dict[str, Any]]:
    """The default StorageClass and what local-path-provisioner may do (its upstream RBAC).

    Its PersistentVolumes are `local` volumes (defaultVolumeType), which the kubelet gives
    each pod's fsGroup as it mounts them, as it does any volume it manages: a kernel
    running as a non-root uid writes into a volume that volume-helper made root's, 0700.
    Its helper pods mount the volumes' parent directory and run as root, so their namespace
    is privileged; nothing else runs there.
    """
    read = ["get", "list", "watch"]
    name = "mcp-forge-test:local-path-provisioner"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["nodes", "persistentvolumeclaims", "configmaps", "pods", "pods/log"],
                "verbs": read,
            },
            {
                "apiGroups": [""],
                "resources": ["persistentvolumes"],
                "verbs": [*read, "create", "patch", "update", "delete"],
            },
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
            {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": read},
        ],
    }
    user = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "User",
        "name": "local-path-provisioner",
    }
    ns = {"namespace": STORAGE_NAMESPACE}
    helpers = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "local-path-provisioner", **ns},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": [*read, "create", "delete"]}],
    }
    helpers_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "local-path-provisioner", **ns},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "local-path-provisioner",
        },
        "subjects": [user],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": STORAGE_NAMESPACE,
                "labels": {"pod-security.kubernetes.io/enforce": "privileged"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "volume-helper", **ns},
            "automountServiceAccountToken": False,
        },
        role,
        binding(name, user),
        helpers,
        helpers_binding,
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {
                    "storageclass.kubernetes.io/is-default-class": "true",
                    "defaultVolumeType": "local",
                },
            },
            "provisioner": PROVISIONER,
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Delete",
        },
    ]


def apply(bins: Path, items: list[dict[str, Any]]) -> None:
    kubectl(
        bins,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )


def ctr(bins: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    sock = ROOT / "containerd" / "containerd.sock"
    return run(f"{bins}/ctr", f"--address={sock}", "--namespace=k8s.io", *args, **kw)


def catatonit() -> Path:
    return Path(shutil.which("catatonit") or "/usr/libexec/podman/catatonit")


def ensure_pause_image(bins: Path) -> None:
    """The sandbox image: Debian's static catatonit, as Podman's own pause image is made."""
    static_image(bins, static_ref("pause", catatonit()), catatonit(), ["/catatonit", "-P"])


def static_ref(name: str, binary: Path) -> str:
    """The image of one static binary, tagged with the binary's hash (a new build, a new tag)."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:12]
    return f"localhost/mcp-forge-{name}:{digest}"


def static_image(bins: Path, image: str, binary: Path, entrypoint: list[str]) -> None:
    """An image of one static binary, made with Podman (once) and imported into the node."""
    if image in ctr(bins, "images", "ls", "-q").stdout.split():
        return
    if run("podman", "image", "exists", image, check=False).returncode != 0:
        work = ROOT / "image-build"
        shutil.rmtree(work, ignore_errors=True)
        (work / "rootfs").mkdir(parents=True)
        shutil.copy(binary, work / "rootfs" / entrypoint[0].lstrip("/"))
        tar = work / "rootfs.tar"
        run("tar", "-C", str(work / "rootfs"), "--owner=0", "--group=0", "-cf", str(tar), ".")
        change = f"ENTRYPOINT {json.dumps(entrypoint)}"
        run("podman", "import", "--change", change, str(tar), image)
        shutil.rmtree(work, ignore_errors=True)
    import_images(bins, [image])


COREFILE = """.:53 {
    errors
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loadbalance
}
"""


def start_dns(bins: Path) -> None:
    """CoreDNS as clusters run it: a Deployment in kube-system behind the kube-dns Service.

    It listens on 53 as clusters' DNS does (NetworkPolicies name that port), as uid 65534
    with the namespaced sysctl that opens low ports, and resolves names in the cluster only
    (no upstream: nothing here resolves outside names).
    """
    image = static_ref("coredns", bins / "coredns")
    static_image(bins, image, bins / "coredns", ["/coredns", "-conf", "/etc/coredns/Corefile"])
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": "kube-system"}
    items: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "mcp-forge-test:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "pods", "namespaces", "endpoints"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        binding("mcp-forge-test:coredns", {"kind": "ServiceAccount", **meta}),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "selector": labels,
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": 53, "protocol": "TCP"},
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "dnsPolicy": "Default",
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65534,
                            "seccompProfile": {"type": "RuntimeDefault"},
                            "sysctls": [
                                {"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}
                            ],
                        },
                        "containers": [
                            {
                                "name": "coredns",
                                "image": image,
                                "imagePullPolicy": "Never",
                                "ports": [
                                    {"containerPort": 53, "protocol": "UDP"},
                                    {"containerPort": 53, "protocol": "TCP"},
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": 8181},
                                    "periodSeconds": 1,
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}],
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
    ]
    apply(bins, items)


def dns_ready() -> bool:
    d = api_get("/apis/apps/v1/namespaces/kube-system/deployments/coredns")
    return bool((d.get("status") or {}).get("readyReplicas"))


def binding(role: str, subject: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [subject],
    }


def import_images(bins: Path, images: list[str]) -> None:
    """`podman save` each image into the node's containerd (k8s.io namespace).

    An image the node already has, imported from the same Podman image ID, is not saved
    and imported again (tens of seconds each for the control plane's). The IDs imported
    are kept under ROOT, which `down` removes with the node's containerd.
    """
    done = ROOT / "imported"
    done.mkdir(parents=True, exist_ok=True)
    listed = ctr(bins, "images", "ls", "-q").stdout.split()
    for image in images:
        image_id = run("podman", "image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
        marker = done / hashlib.sha256(image.encode()).hexdigest()
        if image in listed and marker.is_file() and marker.read_text() == image_id:
            continue
        marker.unlink(missing_ok=True)
        archive = ROOT / "image.tar"
        # podman refuses to save over a file: one left by an `up` that was killed midway
        # would fail every later one.
        archive.unlink(missing_ok=True)
        try:
            run("podman", "save", "--format", "docker-archive", "-o", str(archive), image)
            ctr(bins, "images", "import", "--no-unpack=false", str(archive))
        finally:
            archive.unlink(missing_ok=True)
        if image not in ctr(bins, "images", "ls", "-q").stdout.split():
            raise ClusterError(f"{image} is not in the node's containerd after import")
        marker.write_text(image_id)


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
