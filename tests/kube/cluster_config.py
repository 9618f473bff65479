"""Each component of the test cluster: its configuration files (ROOT/conf) and its command line.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler (the control plane), containerd
with Debian's runc, the kubelet, kube-proxy (nftables), kube-router (NetworkPolicy only) and
local-path-provisioner (PersistentVolumes). Client certificates for everyone, the
ServiceAccount token signer, PodSecurity admission (on by default: namespaces opt in with their
labels), an audit log. Pods get addresses on a bridge of their own with routes to the Service
range and to this machine's own address only: no default route, nothing leaves the machine.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

from .cluster_common import (
    API_PORT,
    BRIDGE,
    DNS_SERVICE_IP,
    ETCD_PORT,
    NODE,
    POD_CIDR,
    PROVISIONER,
    ROOT,
    SERVICE_CIDR,
    STORAGE_NAMESPACE,
)
from .cluster_images import catatonit, static_ref, volume_helper
from .cluster_pki import kubeconfig


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
    write_cni_config(conf, ip)
    runc = newer_runc()
    write_containerd_config(conf, runc, restore_runc(conf, runc))
    write_audit_policy(conf)
    write_kubelet_config(conf, pki, ip)
    write_proxy_config(conf, ip)


def write_cni_config(conf: Path, ip: str) -> None:
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
                    # The Service range and this machine's own address (where the egress
                    # tests' stand-ins listen), no more: a pod has no default route.
                    "routes": [{"dst": SERVICE_CIDR}, {"dst": f"{ip}/32"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (conf / "net.d" / "10-mcpforge-test.conflist").write_text(json.dumps(cni, indent=1))


def newer_runc() -> str:
    """The runc of the `userns` runtime handler (tests/kube/runc/build: built once, cached)."""
    build = Path(__file__).parent / "runc" / "build"
    made = subprocess.run([str(build)], check=True, stdout=subprocess.PIPE, text=True)
    return made.stdout.strip()  # what it does (apt-get, a build) shows on stderr


def restore_runc(conf: Path, runc: str) -> str:
    """The program of the `mcpforge-restore` runtime handler: mcpforge-runc (images/node/
    build), told the newer runc, the kubelet's checkpoint directory and the key snapshots
    kept in claims are signed with (store.go) by a script."""
    built = subprocess.run(
        [str(Path(__file__).parents[2] / "images" / "node" / "build")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    key = conf / "snapshot.key"  # the nodes' shared key (one node here): made once
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    script = conf / "mcpforge-runc"
    script.write_text(
        "#!/bin/sh\n"
        f"export MCPFORGE_RUNC='{runc}'\n"
        f"export MCPFORGE_CHECKPOINTS='{ROOT}/kubelet/checkpoints'\n"
        f"export MCPFORGE_RESTORE_DIR='{ROOT}/restore'\n"
        f"export MCPFORGE_SNAPSHOT_KEY='{key}'\n"
        f"exec '{built}' \"$@\"\n"
    )
    script.chmod(0o755)
    return str(script)


def write_containerd_config(conf: Path, runc: str, restore: str) -> None:
    """Pods run on Debian's runc; those of the RuntimeClass whose handler is `userns` run on
    a newer one (`runc`), which can give a pod `hostUsers: false` (Debian's 1.1.5 cannot);
    those whose handler is `mcpforge-restore` on `restore`, which wakes a pod from a
    checkpoint the kubelet took (its annotation mcpforge.dev/restore-from is passed on)."""
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
[{cri}.containerd.runtimes.userns]
  runtime_type = 'io.containerd.runc.v2'
[{cri}.containerd.runtimes.userns.options]
  BinaryName = '{runc}'
  SystemdCgroup = false
[{cri}.containerd.runtimes.mcpforge-restore]
  runtime_type = 'io.containerd.runc.v2'
  pod_annotations = ['mcpforge.dev/restore-from']
  container_annotations = ['io.kubernetes.container.restartCount']
[{cri}.containerd.runtimes.mcpforge-restore.options]
  BinaryName = '{restore}'
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{static_ref("pause", catatonit())}'
"""
    )


def write_audit_policy(conf: Path) -> None:
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


def write_kubelet_config(conf: Path, pki: Path, ip: str) -> None:
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


def write_proxy_config(conf: Path, ip: str) -> None:
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
    """Each component's command line, in COMPONENTS' order."""
    return {**control_plane_commands(ip, bins), **node_commands(ip, bins)}


def control_plane_commands(ip: str, bins: Path) -> dict[str, list[str]]:
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
    }


def node_commands(ip: str, bins: Path) -> dict[str, list[str]]:
    conf = ROOT / "conf"
    return {
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
