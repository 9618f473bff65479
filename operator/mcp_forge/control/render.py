"""The renderer: a KernelSession becomes the manifests that run it. Pure: no I/O.

One function per target, both built from the same pod template, so the security
profile lives in one place:

* ``kubernetes``: Secret (connection file with the key), Service (the five ZMQ ports),
  NetworkPolicy (ingress from the gateway only; egress per spec), Pod. Valid for
  ``kubectl apply``.
* ``podman``: the Pod alone, as ``podman kube play`` runs it. Podman ignores Services and
  NetworkPolicies, and 4.3.1 crashes on secret volumes, so the connection file and the
  workspace are host directories (written by local mode) and the pod has no network:
  the kernel's channels are Unix sockets in its run directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mcp_forge import kernelside
from mcp_forge.api.connection import (
    BRIDGE_PORT,
    CONF_DIR_IN_POD,
    PORTS,
    RUN_DIR_IN_POD,
    ConnectionInfo,
)
from mcp_forge.api.kernelsession import API_VERSION, KIND, KernelSession, parse_quantity
from mcp_forge.api.keys import BridgeCert
from mcp_forge.control import render_egress
from mcp_forge.control.render_egress import Route
from mcp_forge.egress.protocol import token_for
from mcp_forge.kernelside import launch
from mcp_forge.sandbox import KERNEL_CMD, KERNEL_UID, SESSION_VARIABLE, WORKSPACE

Target = Literal["kubernetes", "podman"]
TARGETS: tuple[Target, ...] = ("kubernetes", "podman")

CONTAINER = "kernel"
SHARED = "/shared"
CONNECTION_KEY = "connection.json"  # the connection Secret's one key
TMP_SIZE = "256Mi"  # a cluster pod's /tmp: a memory emptyDir, or in its writable layer
TMP_BYTES = 256 << 20
MOUNTS = {  # where each volume a pod may have is mounted, in this order
    "conf": CONF_DIR_IN_POD,  # local mode only: the connection file, read-only
    "workspace": WORKSPACE,
    "tmp": "/tmp",
    "run": RUN_DIR_IN_POD,  # local mode only: the kernel's Unix sockets
    "shared": SHARED,
}
MANAGED_BY = "mcp-forge"
LABEL_SESSION = "mcpforge.dev/session"
LABEL_NAMESPACE = "mcpforge.dev/namespace"
LABEL_COMPONENT = "app.kubernetes.io/component"
TEMPLATE_HASH = "mcpforge.dev/template-hash"
GATEWAY_SELECTOR = {"app.kubernetes.io/name": "mcp-forge", LABEL_COMPONENT: "gateway"}
OPERATOR_SELECTOR = {"app.kubernetes.io/name": "mcp-forge", LABEL_COMPONENT: "operator"}
# The project's seccomp profile (docs/seccomp.md): Podman's default less namespaces,
# keyrings, mounts and tracing. Local mode plays pods with this directory as
# --seccomp-profile-root; on clusters it is installed on each node and named by the
# `seccomp_profile` setting.
SECCOMP_PROFILE = "kernel-seccomp.json"
SECCOMP_PROFILE_ROOT = str(Path(__file__).parents[1] / "profiles")
# On a cluster the kernel's pod is started, and its session Ready, once the kernel answers
# a kernel_info_request (kernelside/probe.py), as local mode waits for one before Ready:
# asked every second, for up to STARTUP_SECONDS; then the kubelet kills the kernel.
STARTUP_SECONDS = 120
# The first time a second after the start: the operator asks the kernel as soon as the
# pod has an IP (control/answers.py), and the kubelet's probe, a Python started in the
# container, took a core for 0.1-0.2 s right beside the kernel's own start or wake (on 2
# cores: a new session's Ready 0.84-0.87 s where 0.91-0.96, a 500 MB wake's 0.94-0.97 s
# where 0.99). Only a kernel the operator cannot reach is Ready a second later for it.
STARTUP_DELAY = 1
# Podman 4.3.1's kube play ignores securityContext.seccompProfile and reads a Localhost
# profile only from this (deprecated in Kubernetes) annotation: "localhost/<file>".
SECCOMP_ANNOTATION = f"container.seccomp.security.alpha.kubernetes.io/{CONTAINER}"
# runc gives CRIU the options of the file a container's annotation org.criu.config names,
# at its checkpoint and at its restore. Local pods name the package's own (profiles/
# criu.conf, root's as the package is); Podman copies a played pod's annotations to its
# containers. A KernelSession's own annotations never reach its pod's.
CRIU_ANNOTATION = "org.criu.config"
CRIU_CONFIG = str(Path(SECCOMP_PROFILE_ROOT) / "criu.conf")
RUNTIME_DEFAULT: dict[str, str] = {"type": "RuntimeDefault"}
# Below /etc (root's; locally the read-only connection mount), so it never exists and
# cannot be made: IPython then works in a new temporary directory at every start, and a
# startup file planted in the last one (in /tmp, which outlives a kernel restart) never
# runs in the next kernel.
IPYTHON_DIR = f"{CONF_DIR_IN_POD}/ipython"


@dataclass(frozen=True)
class HostPaths:
    """Host directories that local mode mounts into the pod."""

    conf: str  # root-owned, mounted read-only: the connection file
    run: str  # the kernel's Unix sockets
    workspace: str
    shared: str | None = None
    # /tmp. Podman 4.3.1 plays an emptyDir as a named volume called after it, which every
    # pod with an emptyDir "tmp" would share: local mode gives each session a directory.
    tmp: str | None = None


def child_name(session: KernelSession) -> str:
    """Name of the Pod, Service and NetworkPolicy on Kubernetes."""
    return f"ks-{session.name}"


def connection_secret_of(pod_name: str) -> str:
    """The Secret holding a kernel pod's key: `<pod>-conn`, for a session's own pod and a
    pool's alike."""
    return f"{pod_name}-conn"


def secret_name(session: KernelSession) -> str:
    return connection_secret_of(child_name(session))


def _connection_ref(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The secretKeyRef of a cluster kernel pod's connection (launch.ENV), if it has one."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") != CONTAINER:
            continue
        for env in container.get("env") or []:
            if env.get("name") == launch.ENV:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                return ref if isinstance(ref, dict) else None
    return None


def connection_secret_in(pod: Mapping[str, Any]) -> str | None:
    """The Secret a cluster kernel pod takes its connection from."""
    name = (_connection_ref(pod) or {}).get("name")
    return name if isinstance(name, str) else None


def give_connection_secret(pod: dict[str, Any], secret: str) -> None:
    """Make a rendered cluster pod take its connection from `secret` (a pool's kernel)."""
    ref = _connection_ref(pod)
    if ref is None:
        raise ValueError("not a cluster kernel pod: no connection to take from a Secret")
    ref["name"] = secret


def workspace_claim_name(session: KernelSession) -> str:
    """The PersistentVolumeClaim of a persistent workspace: named after the session (not
    its uid), so a retained one is found again by the next session of that name."""
    return f"{child_name(session)}-workspace"


def podman_pod_name(namespace: str, name: str) -> str:
    """Podman pods have no namespaces, so the name carries it."""
    return f"mcpforge-{namespace}-{name}"


KERNEL_LABELS = {
    "app.kubernetes.io/name": "mcp-forge",
    LABEL_COMPONENT: "kernel",
    "app.kubernetes.io/managed-by": MANAGED_BY,
}


def labels(session: KernelSession) -> dict[str, str]:
    return {**KERNEL_LABELS, LABEL_SESSION: session.name, LABEL_NAMESPACE: session.namespace}


def _owner(session: KernelSession) -> list[dict[str, Any]]:
    if not session.uid:
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": session.name,
            "uid": session.uid,
            "controller": True,
        }
    ]


def _metadata(session: KernelSession, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": session.namespace, "labels": labels(session)}
    owners = _owner(session)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def _cpu(session: KernelSession) -> str:
    return f"{session.spec.cpu_milli}m"


def kernel_command(session: KernelSession) -> list[str]:
    """The kernel's command line, replacing the image's entrypoint (tini in ours).

    The pod shares one PID namespace, so its infra process (root: catatonit on Podman,
    pause on Kubernetes) is PID 1 and reaps orphans, out of the kernel uid's reach.
    prlimit (util-linux) sets RLIMIT_FSIZE to the workspace size, soft and hard, then
    execs the kernel: no file it writes can outgrow the workspace.
    """
    return [*_file_size_limit(session), *KERNEL_CMD]


def _file_size_limit(session: KernelSession) -> list[str]:
    """prlimit's prefix: RLIMIT_FSIZE at the workspace size, soft and hard."""
    size = parse_quantity(session.spec.workspace_size, field="spec.workspace.size")
    return ["prlimit", f"--fsize={size}", "--"]


def _cluster_kernel_command(session: KernelSession) -> list[str]:
    """kernel_command on a cluster: the connection comes from the Secret in the
    environment, and kernelside/launch.py writes it to the pod's own /tmp."""
    return [*_file_size_limit(session), "python", "-P", "-c", kernelside.source("launch")]


def _volume_less(session: KernelSession) -> bool:
    """A cluster pod of an ephemeral session without a sharedGroup has no volume (each
    one costs its cold start 300 ms in the kubelet: kernelside/launch.py): its workspace
    and /tmp are the container's writable layer, bounded by its ephemeral-storage limit
    as the workspace's emptyDir was by its sizeLimit, and they end with the pod as an
    emptyDir does (restartPolicy Never)."""
    return not session.spec.persistent and not session.spec.shared_group


def _ephemeral_storage(session: KernelSession) -> str:
    """The writable layer's bound when it holds the workspace and /tmp: both sizes."""
    size = parse_quantity(session.spec.workspace_size, field="spec.workspace.size")
    return str(size + TMP_BYTES)


def startup_probe() -> dict[str, Any]:
    """The kernel container's startupProbe on a cluster: does the kernel answer?"""
    return {
        "exec": {"command": ["python", "-I", "-c", kernelside.source("probe")]},
        "initialDelaySeconds": STARTUP_DELAY,
        "periodSeconds": 1,
        "timeoutSeconds": 5,
        "failureThreshold": STARTUP_SECONDS,
    }


def _container(
    session: KernelSession,
    target: Target,
    volumes: list[dict[str, Any]],
    seccomp: dict[str, str],
) -> dict[str, Any]:
    spec = session.spec
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": WORKSPACE},
        {"name": "IPYTHONDIR", "value": IPYTHON_DIR},
        {"name": "MPLCONFIGDIR", "value": "/tmp/matplotlib"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": SESSION_VARIABLE, "value": session.name},
    ]
    if target == "kubernetes":  # kernelside/launch.py: the pod has no Secret volume
        ref = {"name": secret_name(session), "key": CONNECTION_KEY}
        env.append({"name": launch.ENV, "valueFrom": {"secretKeyRef": ref}})
    for e in spec.env:
        if e.secret is None:
            env.append({"name": e.name, "value": e.value})
        elif target == "kubernetes":  # the kubelet reads the Secret: no value in the pod
            ref = {"name": e.secret[0], "key": e.secret[1]}
            env.append({"name": e.name, "valueFrom": {"secretKeyRef": ref}})
        # podman: a pod's env shows in `podman inspect`; local mode gives the kernel these
        # over its own channel at every start, before the session is Ready
    named = {v["name"] for v in volumes}
    mounts: list[dict[str, Any]] = [
        {"name": name, "mountPath": path, **({"readOnly": True} if name == "conf" else {})}
        for name, path in MOUNTS.items()
        if name in named
    ]
    limits = {"memory": spec.memory, "cpu": _cpu(session)}
    if not volumes:  # the writable layer holds the workspace and /tmp
        limits["ephemeral-storage"] = _ephemeral_storage(session)
    command = kernel_command(session)
    if target == "kubernetes":
        command = _cluster_kernel_command(session)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "workingDir": WORKSPACE,
        "env": env,
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "securityContext": {
            "runAsUser": KERNEL_UID,
            "runAsGroup": KERNEL_UID,
            "runAsNonRoot": True,
            # Without volumes the image's files stay the image's by their modes (root's,
            # 0755/0644): the kernel's uid writes only where it could with /workspace and
            # /tmp mounted (docs/security.md, tests/kube/test_security.py).
            "readOnlyRootFilesystem": bool(volumes),
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": dict(seccomp),
        },
    }
    if mounts:
        container["volumeMounts"] = mounts
    if target == "kubernetes":
        container["startupProbe"] = startup_probe()
        container["ports"] = [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in {**PORTS, "bridge": BRIDGE_PORT}.items()
        ]
    return container


def _pod(
    session: KernelSession,
    target: Target,
    volumes: list[dict[str, Any]],
    seccomp: dict[str, str],
) -> dict[str, Any]:
    spec = session.spec
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # kernel death is seen and handled by us, then recreated
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "shareProcessNamespace": True,  # PID 1 is the infra process: see kernel_command
        "terminationGracePeriodSeconds": 5,
        "securityContext": {
            "runAsUser": KERNEL_UID,
            "runAsGroup": KERNEL_UID,
            "runAsNonRoot": True,
            "fsGroup": KERNEL_UID,
            "seccompProfile": dict(seccomp),
        },
        "containers": [_container(session, target, volumes, seccomp)],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if target == "kubernetes":
        meta = _metadata(session, child_name(session))
        pod_spec["hostname"] = "kernel"
        # A persistent workspace's files keep their modes: the kubelet makes them fsGroup's
        # (g+rw) only when the volume's root is not already, not at each pod's start, so a
        # kernel woken from a checkpoint finds the files it holds open as they were (CRIU
        # checks their modes), and a large workspace is not walked at each start.
        pod_spec["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
    else:
        meta = {
            "name": podman_pod_name(session.namespace, session.name),
            "labels": labels(session),
            "annotations": {
                # Honoured by Podman >= 4.4; local mode also writes the cgroup limit itself.
                f"io.podman.annotations.pids-limit/{CONTAINER}": str(spec.pids),
                SECCOMP_ANNOTATION: f"localhost/{SECCOMP_PROFILE}",
                CRIU_ANNOTATION: CRIU_CONFIG,
            },
        }
        pod_spec["hostname"] = "kernel"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


BASELINE_POLICY = "mcpforge-kernels-closed"
FORK_FILES = "fork-files"  # the component of the pod copying a fork's workspace (forkfiles.py)
SNAPSHOT_STORE = "snapshot-store"  # of the pod that has a snapshot stored (snapstore.py)
BASELINE_COMPONENTS = ["kernel", FORK_FILES, SNAPSHOT_STORE]  # the pods the baseline closes


def render_baseline_policy(namespace: str) -> dict[str, Any]:
    """A NetworkPolicy selecting every kernel pod of `namespace` that admits nothing.

    Policies add up: a pod selected by several is allowed what any of them allows. A
    session's policy (or its pool's) allows what its kernel may do; this one only makes
    sure that a kernel pod is always selected by some policy. Without it a pod that no
    policy selects is open both ways, as one is for a moment while a claim moves it from
    its pool's policy to its session's (one label write, which the network plugin
    programs when it gets to it), or when its own policy is deleted. It selects the pod
    that copies a fork's workspace too, which no other policy does.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": BASELINE_POLICY,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "mcp-forge",
                "app.kubernetes.io/managed-by": MANAGED_BY,
            },
        },
        "spec": {
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "mcp-forge"},
                # A kernel, and the pod that copies a fork's workspace (control/forkfiles.py).
                "matchExpressions": [
                    {"key": LABEL_COMPONENT, "operator": "In", "values": BASELINE_COMPONENTS}
                ],
            },
            "policyTypes": ["Ingress", "Egress"],
        },
    }


def render_kubernetes(
    session: KernelSession,
    connection: ConnectionInfo,
    *,
    gateway_namespace: str | None = None,
    runtime_class: str | None = None,
    seccomp_profile: str | None = None,
    egress: Route | None = None,
    egress_ca: BridgeCert | None = None,
    snapshots: bool = False,
) -> list[dict[str, Any]]:
    """Secret, Service, NetworkPolicy and Pod for a cluster.

    The key comes in `connection` (the operator keeps it in the Secret across
    reconciles). The NetworkPolicy admits gateway pods of `gateway_namespace` (the
    session's own namespace if None). `runtime_class` (gVisor, Kata) is the cluster
    admin's choice, not the session's: the operator is configured with it. So is
    `seccomp_profile`, the project's profile as installed on every node (a path below
    the kubelet's seccomp root, docs/seccomp.md); None keeps the runtime's default.
    `egress` is where the cluster's egress proxy is, for a session with an allow-list
    (control/render_egress.py), and `egress_ca` its CA, kept in its Secret. With
    `snapshots` the pod has a user namespace of its own (`hostUsers: false`), as a
    checkpoint and a restore on the node's restore handler need (control/snapshots.py).
    """
    route = egress if session.spec.egress_rules else None
    data = {CONNECTION_KEY: connection.to_file()}
    if route is not None and connection.key:
        data |= render_egress.secret_data(token_for(connection.key), egress_ca)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(session, secret_name(session)),
        "type": "Opaque",
        "stringData": data,
    }
    seccomp = (
        {"type": "Localhost", "localhostProfile": seccomp_profile}
        if seccomp_profile
        else RUNTIME_DEFAULT
    )
    pod = _pod(session, "kubernetes", _kubernetes_volumes(session), seccomp)
    if runtime_class:
        pod["spec"]["runtimeClassName"] = runtime_class
    if snapshots:
        pod["spec"]["hostUsers"] = False
    policy = _network_policy(session, gateway_namespace)
    if route is not None:
        reads = any(rule.reads_requests for rule in session.spec.egress_rules)
        pod["spec"]["containers"][0]["env"] += render_egress.env(secret_name(session), route, reads)
        policy["spec"]["egress"].append(render_egress.policy_rule(route))
    pod["metadata"]["annotations"] = {TEMPLATE_HASH: template_hash(pod)}
    return [secret, _service(session), policy, pod]


def _service(session: KernelSession) -> dict[str, Any]:
    """The kernel's ports (and its bridge's), by the session's name in its namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(session, child_name(session)),
        "spec": {
            "type": "ClusterIP",
            # The session is Ready when its kernel answers (control/answers.py), which may
            # be before the kubelet's startupProbe passes: the pod is reachable from its
            # start. One kernel pod at most carries the session's label at a time.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_SESSION: session.name, LABEL_COMPONENT: "kernel"},
            "ports": [
                {"name": p, "port": n, "targetPort": n, "protocol": "TCP"}
                for p, n in {**PORTS, "bridge": BRIDGE_PORT}.items()
            ],
        },
    }


def _network_policy(session: KernelSession, gateway_namespace: str | None) -> dict[str, Any]:
    """In: gateway pods only (of `gateway_namespace`, else the session's), to the kernel's
    and the bridge's ports; and the operator (which runs there too) to the shell port,
    to ask a starting kernel whether it answers (control/answers.py). Out: nothing,
    unless spec.network.egress is All."""
    gateways: dict[str, Any] = {"podSelector": {"matchLabels": dict(GATEWAY_SELECTOR)}}
    operators: dict[str, Any] = {"podSelector": {"matchLabels": dict(OPERATOR_SELECTOR)}}
    if gateway_namespace is not None:
        where = {"matchLabels": {"kubernetes.io/metadata.name": gateway_namespace}}
        gateways["namespaceSelector"] = where
        operators["namespaceSelector"] = dict(where)
    egress: list[dict[str, Any]] = [{}] if session.spec.egress == "All" else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(session, child_name(session)),
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_SESSION: session.name, LABEL_COMPONENT: "kernel"}
            },
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [gateways],
                    "ports": [
                        {"port": n, "protocol": "TCP"} for n in [*PORTS.values(), BRIDGE_PORT]
                    ],
                },
                {"from": [operators], "ports": [{"port": PORTS["shell"], "protocol": "TCP"}]},
            ],
            "egress": egress,
        },
    }


def _kubernetes_volumes(session: KernelSession) -> list[dict[str, Any]]:
    """None for an ephemeral session without a sharedGroup (_volume_less); else the
    workspace (a claim if persistent), a memory /tmp, and /shared for a sharedGroup. The
    connection never is a volume: it comes in the environment (kernelside/launch.py)."""
    spec = session.spec
    if _volume_less(session):
        return []
    volumes: list[dict[str, Any]] = [
        (
            {
                "name": "workspace",
                "persistentVolumeClaim": {"claimName": workspace_claim_name(session)},
            }
            if spec.persistent
            else {"name": "workspace", "emptyDir": {"sizeLimit": spec.workspace_size}}
        ),
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": TMP_SIZE}},
    ]
    if spec.shared_group:
        volumes.append(
            {
                "name": "shared",
                "persistentVolumeClaim": {"claimName": f"mcpforge-shared-{spec.shared_group}"},
            }
        )
    return volumes


def render_workspace_claim(session: KernelSession) -> dict[str, Any] | None:
    """The PersistentVolumeClaim of a persistent workspace (None: the pod's emptyDir).

    Owned by the session, so the garbage collector deletes it with the session; with
    reclaimPolicy Retain it has no owner and outlives it (its labels name the session).
    The pod mounts it by name: every kernel pod of the session, the same files.
    """
    spec = session.spec
    if not spec.persistent:
        return None
    meta = _metadata(session, workspace_claim_name(session))
    meta["labels"][LABEL_COMPONENT] = "workspace"
    if spec.retain_workspace:
        meta.pop("ownerReferences", None)
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.workspace_size}},
    }
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def template_hash(pod: dict[str, Any]) -> str:
    """A digest of what a running kernel pod cannot change: its spec."""
    text = json.dumps(pod["spec"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render_lease(session: KernelSession) -> dict[str, Any]:
    """The Lease a gateway renews while it uses the session (activity, without spec writes)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": _metadata(session, child_name(session)),
        "spec": {},
    }


def render_podman(session: KernelSession, paths: HostPaths) -> list[dict[str, Any]]:
    """The Pod that `podman kube play --network none --seccomp-profile-root
    SECCOMP_PROFILE_ROOT` runs: with the project's seccomp profile, always."""
    volumes: list[dict[str, Any]] = [
        {"name": "conf", "hostPath": {"path": paths.conf, "type": "Directory"}},
        {"name": "run", "hostPath": {"path": paths.run, "type": "Directory"}},
        {"name": "workspace", "hostPath": {"path": paths.workspace, "type": "Directory"}},
        (
            {"name": "tmp", "hostPath": {"path": paths.tmp, "type": "Directory"}}
            if paths.tmp
            else {"name": "tmp", "emptyDir": {"medium": "Memory"}}
        ),
    ]
    if session.spec.shared_group:
        if paths.shared is None:
            raise ValueError("a session with sharedGroup needs a shared host path")
        volumes.append({"name": "shared", "hostPath": {"path": paths.shared, "type": "Directory"}})
    seccomp = {"type": "Localhost", "localhostProfile": SECCOMP_PROFILE}
    return [_pod(session, "podman", volumes, seccomp)]
