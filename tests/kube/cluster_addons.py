"""What the test cluster gets through its API once it answers: RBAC, storage and DNS.

kube-router may read what its NetworkPolicies need; local-path-provisioner serves
PersistentVolumes behind the default StorageClass `standard`; CoreDNS answers for the cluster's
names behind the kube-dns Service.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .cluster_common import DNS_SERVICE_IP, PROVISIONER, STORAGE_CLASS, STORAGE_NAMESPACE
from .cluster_images import static_image, static_ref
from .cluster_processes import api_get, kubectl


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
        storage_class(),
    ]


def storage_class() -> dict[str, Any]:
    """The default StorageClass: PersistentVolumeClaims that name none get it."""
    return {
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
    }


def apply(bins: Path, items: list[dict[str, Any]]) -> None:
    kubectl(
        bins,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )


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
        coredns_deployment(image, labels, meta),
    ]
    apply(bins, items)


def coredns_deployment(image: str, labels: dict[str, str], meta: dict[str, str]) -> dict[str, Any]:
    """CoreDNS's Deployment: one replica, uid 65534, port 53 opened by the namespaced sysctl."""
    return {
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
                        "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}],
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
    }


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
