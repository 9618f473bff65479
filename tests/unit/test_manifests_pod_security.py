"""The kernel, operator and gateway pods held to the Pod Security Standards' "restricted"
profile, by a checker written from the PSS page and shown to catch violating pods."""

from __future__ import annotations

from typing import Any

import pytest
from manifests_support import INSTALLS, SYSTEM, _session, build, key

from mcp_forge.api.connection import ConnectionInfo
from mcp_forge.control.render import render_kubernetes

# ---- Pod Security Standards, "restricted" ----------------------------------------------------

# From https://kubernetes.io/docs/concepts/security/pod-security-standards/ (v1.33).
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _context_violations(where: str, sc: dict[str, Any]) -> list[str]:
    """Baseline rules that read the same in a pod's and a container's securityContext."""
    out = []
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}: hostProcess")
    se = sc.get("seLinuxOptions") or {}
    if se.get("user") or se.get("role") or se.get("type", "") not in SELINUX_TYPES:
        out.append(f"{where}: seLinuxOptions")
    if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") == "Unconfined":
        out.append(f"{where}: appArmorProfile Unconfined")
    if sc.get("runAsUser") == 0:
        out.append(f"{where}: runAsUser 0")
    return out


def pss_restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every way `pod_spec` breaks the restricted profile (which includes baseline)."""
    out: list[str] = []
    psc = pod_spec.get("securityContext") or {}
    containers = [
        *pod_spec.get("initContainers", []),
        *pod_spec.get("containers", []),
        *pod_spec.get("ephemeralContainers", []),
    ]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(host):
            out.append(f"{host}")
    out += _context_violations("pod", psc)
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {volume['name']}: {', '.join(sorted(kinds - ALLOWED_VOLUMES))}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    for c in containers:
        name = c["name"]
        sc = c.get("securityContext") or {}
        out += _context_violations(name, sc)
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        added = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"{name}: capabilities add {', '.join(sorted(added))}")
    return out


CONN = ConnectionInfo("tcp", "", "k" * 64)


def kernel_pod(**spec: Any) -> dict[str, Any]:
    objs = render_kubernetes(_session(**spec), CONN, gateway_namespace=SYSTEM)
    (pod,) = [o for o in objs if o["kind"] == "Pod"]
    return pod


@pytest.mark.parametrize(
    "spec",
    [{}, {"sharedGroup": "team", "network": {"egress": "All"}}],
    ids=["default", "shared-and-egress"],
)
def test_the_kernel_pod_passes_the_restricted_pod_security_standard(spec: dict[str, Any]) -> None:
    assert pss_restricted_violations(kernel_pod(**spec)["spec"]) == []


@pytest.mark.parametrize("name", INSTALLS)
def test_the_operator_and_gateway_pods_pass_the_restricted_pod_security_standard(
    name: str,
) -> None:
    for dep in (o for o in build(name) if o["kind"] == "Deployment"):
        assert pss_restricted_violations(dep["spec"]["template"]["spec"]) == [], key(dep)


def test_the_node_pods_are_beyond_restricted_only_by_their_hostpath_and_uid_0() -> None:
    """The two pods beyond "restricted" (docs/security.md): the sweeper may remove the
    kubelet's checkpoints, root's, and the key placer write the nodes' snapshot key, and
    nothing more (no API token for the placer); alone in a namespace that allows it."""
    objs = build("overlays/snapshots")
    placer, sweeper = sorted(
        (o for o in objs if o["kind"] == "DaemonSet"), key=lambda o: o["metadata"]["name"]
    )
    node_ns = sweeper["metadata"]["namespace"]
    assert pss_restricted_violations(sweeper["spec"]["template"]["spec"]) == [
        "pod: runAsUser 0",
        "volume checkpoints: hostPath",
        "sweeper: runAsNonRoot must be true",
    ]
    spec = placer["spec"]["template"]["spec"]
    assert pss_restricted_violations(spec) == [
        "pod: runAsUser 0",
        "volume node: hostPath",
        "snapshot-key: runAsNonRoot must be true",
    ]
    (host,) = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert host == "/etc/mcp-forge" and spec["automountServiceAccountToken"] is False
    pods = [o for o in objs if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Pod")]
    assert [o for o in pods if o["metadata"]["namespace"] == node_ns] == [placer, sweeper]
    (namespace,) = [
        o for o in objs if o["kind"] == "Namespace" and o["metadata"]["name"] == node_ns
    ]
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"


_REMOVE = object()


def _break(path: str, value: Any) -> Any:
    """A change to a pod spec at a dotted path (list items by index), or its removal."""

    def change(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        index: Any = int(last) if last.isdigit() else last
        if value is _REMOVE:
            node.pop(index)
        else:
            node[index] = value

    return change


VIOLATIONS = {
    "privileged": (_break("containers.0.securityContext.privileged", True), "privileged"),
    "host network": (_break("hostNetwork", True), "hostNetwork"),
    "host PID": (_break("hostPID", True), "hostPID"),
    "hostPath": (
        _break("volumes", [{"name": "host", "hostPath": {"path": "/etc"}}]),
        "hostPath",
    ),
    "hostPort": (_break("containers.0.ports.0.hostPort", 5555), "hostPort"),
    "root user": (_break("containers.0.securityContext.runAsUser", 0), "runAsUser 0"),
    "root pod": (_break("securityContext.runAsUser", 0), "runAsUser 0"),
    "no runAsNonRoot": (
        lambda s: (
            s["securityContext"].pop("runAsNonRoot"),
            s["containers"][0]["securityContext"].pop("runAsNonRoot"),
        ),
        "runAsNonRoot",
    ),
    "escalation": (
        _break("containers.0.securityContext.allowPrivilegeEscalation", True),
        "allowPrivilegeEscalation",
    ),
    "escalation unset": (
        _break("containers.0.securityContext.allowPrivilegeEscalation", _REMOVE),
        "allowPrivilegeEscalation",
    ),
    "capability added": (
        _break("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
        "SYS_ADMIN",
    ),
    "capabilities kept": (
        _break("containers.0.securityContext.capabilities.drop", ["NET_RAW"]),
        "drop ALL",
    ),
    "seccomp unconfined": (
        _break("containers.0.securityContext.seccompProfile", {"type": "Unconfined"}),
        "seccompProfile",
    ),
    "no seccomp": (
        lambda s: (
            s["securityContext"].pop("seccompProfile"),
            s["containers"][0]["securityContext"].pop("seccompProfile"),
        ),
        "seccompProfile",
    ),
    "unsafe sysctl": (
        _break("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
        "kernel.msgmax",
    ),
    "unmasked proc": (_break("containers.0.securityContext.procMount", "Unmasked"), "procMount"),
    "SELinux user": (_break("securityContext.seLinuxOptions", {"user": "system_u"}), "seLinux"),
    "AppArmor off": (
        _break("containers.0.securityContext.appArmorProfile", {"type": "Unconfined"}),
        "appArmorProfile",
    ),
    "host IPC": (_break("hostIPC", True), "hostIPC"),
    "bare init container": (
        _break("initContainers", [{"name": "init", "image": "busybox"}]),
        "init: allowPrivilegeEscalation",
    ),
}


@pytest.mark.parametrize("violation", VIOLATIONS, ids=list(VIOLATIONS))
def test_the_pod_security_checker_catches_a_violating_pod(violation: str) -> None:
    change, words = VIOLATIONS[violation]
    spec = kernel_pod()["spec"]
    change(spec)
    found = pss_restricted_violations(spec)
    assert any(words in v for v in found), found
