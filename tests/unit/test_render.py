"""The renderer: the security profile, and manifests valid for Kubernetes and Podman."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mcp_forge import kernelside
from mcp_forge.api import kernelsession, kernelsessionpool
from mcp_forge.api.connection import PORTS, ConnectionInfo
from mcp_forge.control.poolplan import pool_labels
from mcp_forge.control.render import (
    CRIU_ANNOTATION,
    CRIU_CONFIG,
    SECCOMP_ANNOTATION,
    SECCOMP_PROFILE,
    SECCOMP_PROFILE_ROOT,
    HostPaths,
    connection_secret_in,
    give_connection_secret,
    render_baseline_policy,
    render_kubernetes,
    render_podman,
    render_workspace_claim,
)
from mcp_forge.kernelside import launch

K8S_VERSION = "1.33"


def session(**spec: Any) -> kernelsession.KernelSession:
    body = kernelsession.validate(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "demo", "namespace": "team", "uid": "1234-abcd"},
            "spec": spec,
        }
    )
    return kernelsession.load(body)


CONN = ConnectionInfo("tcp", "", "k" * 64)
PATHS = HostPaths(
    "/var/lib/mcp-forge/k/x/conf",
    "/var/lib/mcp-forge/k/x/run",
    "/var/lib/mcp-forge/k/x/workspace",
    "/srv/shared",
)


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas() -> None:
    for obj in render_kubernetes(
        session(sharedGroup="team-a", env=[{"name": "A", "value": "1"}]), CONN
    ):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_child_is_owned_by_the_kernel_session_and_labelled() -> None:
    for obj in render_kubernetes(session(), CONN):
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "KernelSession"
        assert owner["uid"] == "1234-abcd"
        assert owner["controller"] is True
        assert obj["metadata"]["labels"]["mcpforge.dev/session"] == "demo"
        assert obj["metadata"]["namespace"] == "team"


@pytest.mark.parametrize("target", ["kubernetes", "podman"])
def test_the_pod_carries_the_restricted_security_profile(target: str) -> None:
    s = session(resources={"memory": "512Mi", "cpu": "500m"})
    objs = render_kubernetes(s, CONN) if target == "kubernetes" else render_podman(s, PATHS)
    pod = by_kind(objs)["Pod"]
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["shareProcessNamespace"] is True  # the infra process is PID 1, not the kernel
    c = spec["containers"][0]
    assert c["name"] == "kernel"
    sc = c["securityContext"]
    assert sc["runAsUser"] == 1000
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "args" not in c  # the command replaces the image's entrypoint (tini)
    assert c["command"][:3] == ["prlimit", f"--fsize={2**30}", "--"]  # the default 1Gi
    assert c["command"][3:5] == ["python", "-P"]  # -P: /workspace is not on sys.path


def test_a_local_pod_reads_its_connection_from_a_read_only_mount() -> None:
    s = session(resources={"memory": "512Mi", "cpu": "500m"})
    c = by_kind(render_podman(s, PATHS))["Pod"]["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["resources"]["limits"] == {"memory": "512Mi", "cpu": "500m"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert {"/workspace", "/tmp", "/etc/mcp-forge", "/run/mcp-forge"} <= set(mounts)
    assert mounts["/etc/mcp-forge"]["readOnly"] is True
    # ipykernel's launcher, minus writing the connection file (a read-only mount)
    assert c["command"][-2:] == ["-f", "/etc/mcp-forge/connection.json"]
    assert "write_connection_file = lambda" in c["command"][-3]


def test_an_ephemeral_cluster_pod_has_no_volume_and_takes_its_connection_from_the_secret() -> None:
    """Each volume costs a cold start the kubelet's 300 ms mount poll (kernelside/launch.py):
    the workspace and /tmp are the writable layer, bounded by ephemeral-storage."""
    s = session(resources={"memory": "512Mi", "cpu": "500m"})
    objs = by_kind(render_kubernetes(s, CONN))
    spec = objs["Pod"]["spec"]
    assert "volumes" not in spec
    c = spec["containers"][0]
    assert "volumeMounts" not in c
    assert c["securityContext"]["readOnlyRootFilesystem"] is False
    bound = str(2**30 + (256 << 20))  # the workspace's 1Gi and /tmp's 256Mi
    assert c["resources"]["limits"] == {
        "memory": "512Mi",
        "cpu": "500m",
        "ephemeral-storage": bound,
    }
    assert c["resources"]["requests"] == c["resources"]["limits"]
    (ref,) = [e for e in c["env"] if e["name"] == launch.ENV]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "ks-demo-conn", "key": "connection.json"}
    assert objs["Secret"]["metadata"]["name"] == "ks-demo-conn"
    assert c["command"][-2:] == ["-c", kernelside.source("launch")]
    assert connection_secret_in(objs["Pod"]) == "ks-demo-conn"
    give_connection_secret(objs["Pod"], "ksp-a-1234-conn")
    assert connection_secret_in(objs["Pod"]) == "ksp-a-1234-conn"


def test_the_kubelet_first_asks_a_kernel_a_second_after_its_start_and_a_local_pod_never() -> None:
    """The operator asks as soon as the pod has an IP: the kubelet's probe (a Python of its
    own in the container) waits a second, out of the kernel's start, and still kills a
    kernel that never answers."""
    s = session()
    (c,) = by_kind(render_kubernetes(s, CONN))["Pod"]["spec"]["containers"]
    probe = c["startupProbe"]
    assert probe["exec"]["command"] == ["python", "-I", "-c", kernelside.source("probe")]
    assert probe["initialDelaySeconds"] == 1
    assert probe["periodSeconds"] * probe["failureThreshold"] == 120
    (local,) = by_kind(render_podman(s, PATHS))["Pod"]["spec"]["containers"]
    assert "startupProbe" not in local


def test_a_cluster_pod_with_volumes_keeps_a_read_only_root_and_no_secret_volume() -> None:
    objs = by_kind(render_kubernetes(session(sharedGroup="team"), CONN))
    spec = objs["Pod"]["spec"]
    assert {v["name"] for v in spec["volumes"]} == {"workspace", "tmp", "shared"}
    c = spec["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "ephemeral-storage" not in c["resources"]["limits"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/workspace", "/tmp", "/shared"}
    assert connection_secret_in(objs["Pod"]) == "ks-demo-conn"


def test_the_service_exposes_the_fixed_ports_and_the_secret_holds_the_key() -> None:
    objs = by_kind(render_kubernetes(session(), CONN))
    ports = {p["name"]: p["port"] for p in objs["Service"]["spec"]["ports"]}
    assert ports == {**PORTS, "bridge": 5560}  # the five channels, and code mode's bridge
    conn = yaml.safe_load(objs["Secret"]["stringData"]["connection.json"])
    assert conn["key"] == "k" * 64
    assert conn["ip"] == "0.0.0.0"
    assert conn["shell_port"] == PORTS["shell"]
    assert "k" * 64 not in yaml.safe_dump(objs["Pod"])


def test_the_network_policy_admits_only_the_gateway_and_no_egress_by_default() -> None:
    policy = by_kind(render_kubernetes(session(), CONN))["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []
    gateway, operator = policy["ingress"]

    def pods(component: str) -> list[dict[str, Any]]:
        labels = {"app.kubernetes.io/name": "mcp-forge", "app.kubernetes.io/component": component}
        return [{"podSelector": {"matchLabels": labels}}]

    assert gateway["from"] == pods("gateway")
    assert len(gateway["ports"]) == 6  # the five ZMQ ports and the bridge's
    # The operator asks a starting kernel whether it answers: the shell port, no other.
    assert operator == {"from": pods("operator"), "ports": [{"port": 5555, "protocol": "TCP"}]}
    elsewhere = render_kubernetes(session(), CONN, gateway_namespace="mcp-forge-system")
    where = {"matchLabels": {"kubernetes.io/metadata.name": "mcp-forge-system"}}
    rules = by_kind(elsewhere)["NetworkPolicy"]["spec"]["ingress"]
    assert [r["from"][0]["namespaceSelector"] for r in rules] == [where, where]
    allowed = by_kind(render_kubernetes(session(network={"egress": "All"}), CONN))["NetworkPolicy"]
    assert allowed["spec"]["egress"] == [{}]


def test_the_podman_target_is_a_pod_without_secret_volumes() -> None:
    objs = render_podman(session(sharedGroup="team-a"), PATHS)
    assert [o["kind"] for o in objs] == ["Pod"]
    volumes = objs[0]["spec"]["volumes"]
    assert not any("secret" in v for v in volumes)
    paths = {v["hostPath"]["path"] for v in volumes if "hostPath" in v}
    assert paths == {PATHS.conf, PATHS.run, PATHS.workspace, "/srv/shared"}
    assert objs[0]["metadata"]["name"] == "mcpforge-team-demo"
    assert objs[0]["metadata"]["annotations"]["io.podman.annotations.pids-limit/kernel"] == "256"


def test_rendering_is_pure_and_repeatable() -> None:
    s = session()
    assert render_kubernetes(s, CONN) == render_kubernetes(s, CONN)
    assert render_podman(s, PATHS) == render_podman(s, PATHS)


def test_the_network_policy_can_admit_gateways_of_another_namespace() -> None:
    objs = render_kubernetes(session(), CONN, gateway_namespace="mcp-forge-system")
    (peer,) = by_kind(objs)["NetworkPolicy"]["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "mcp-forge-system"}
    }
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _seccomp_profiles(pod: dict[str, Any]) -> list[dict[str, str]]:
    spec = pod["spec"]
    return [spec["securityContext"]["seccompProfile"]] + [
        c["securityContext"]["seccompProfile"] for c in spec["containers"]
    ]


def test_clusters_keep_the_runtime_default_profile_unless_ours_is_installed() -> None:
    plain = by_kind(render_kubernetes(session(), CONN))["Pod"]
    assert _seccomp_profiles(plain) == [{"type": "RuntimeDefault"}] * 2
    ours = by_kind(
        render_kubernetes(session(), CONN, seccomp_profile="mcp-forge/kernel-seccomp.json")
    )["Pod"]
    local = {"type": "Localhost", "localhostProfile": "mcp-forge/kernel-seccomp.json"}
    assert _seccomp_profiles(ours) == [local] * 2
    kubernetes_validate.validate(ours, K8S_VERSION, strict=True)
    assert ours["metadata"]["annotations"] != plain["metadata"]["annotations"]  # a new template


def test_local_pods_always_run_under_the_projects_profile() -> None:
    (pod,) = render_podman(session(), PATHS)
    # Podman 4.3.1 reads the annotation; later versions read the security contexts.
    assert pod["metadata"]["annotations"][SECCOMP_ANNOTATION] == f"localhost/{SECCOMP_PROFILE}"
    local = {"type": "Localhost", "localhostProfile": SECCOMP_PROFILE}
    assert _seccomp_profiles(pod) == [local] * 2  # the pod, the kernel
    assert (Path(SECCOMP_PROFILE_ROOT) / SECCOMP_PROFILE).is_file()


def test_local_pods_give_criu_the_packages_options_and_no_session_can_name_its_own() -> None:
    """runc reads CRIU's options from the file org.criu.config names, as root: a local
    pod names the package's own, whatever the session's metadata says, and only there."""
    body = session().body
    body["metadata"]["annotations"] = {CRIU_ANNOTATION: "/tmp/theirs.conf"}
    theirs = kernelsession.load(body)
    (pod,) = render_podman(theirs, PATHS)
    assert pod["metadata"]["annotations"][CRIU_ANNOTATION] == CRIU_CONFIG
    assert all(
        CRIU_ANNOTATION not in (c.get("annotations") or {}) for c in pod["spec"]["containers"]
    )
    options = [line.split("#")[0].strip() for line in Path(CRIU_CONFIG).read_text().splitlines()]
    assert [o for o in options if o] == ["network-lock skip"]
    cluster = by_kind(render_kubernetes(theirs, CONN))["Pod"]
    assert CRIU_ANNOTATION not in cluster["metadata"].get("annotations", {})  # the node's


def test_the_file_size_limit_is_the_workspace_size() -> None:
    for size, limit in (("1Gi", 2**30), ("20Gi", 20 * 2**30), ("100Mi", 100 * 2**20)):
        s = session(workspace={"size": size})
        for pod in (by_kind(render_kubernetes(s, CONN))["Pod"], render_podman(s, PATHS)[0]):
            c = pod["spec"]["containers"][0]
            assert c["command"][1] == f"--fsize={limit}"


# The seccomp profile: Podman's default less what an unprivileged kernel never needs.

PROFILE: dict[str, Any] = json.loads((Path(SECCOMP_PROFILE_ROOT) / SECCOMP_PROFILE).read_text())
DENIED = {
    "unshare", "setns", "keyctl", "add_key", "request_key", "mount", "umount", "umount2",
    "pivot_root", "mount_setattr", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "syslog",
    "reboot",
}  # fmt: skip
CLONE_NEW_FLAGS = 0x7E020000  # NS, CGROUP, UTS, IPC, USER, PID, NET


def _rules(name: str) -> list[dict[str, Any]]:
    return [r for r in PROFILE["syscalls"] if name in r["names"]]


def test_the_profile_denies_namespaces_keyrings_mounts_and_tracing_with_eperm() -> None:
    assert PROFILE["defaultAction"] == "SCMP_ACT_ERRNO"
    for name in DENIED:
        (rule,) = _rules(name)
        assert (rule["action"], rule["errnoRet"]) == ("SCMP_ACT_ERRNO", 1), name


def test_clone_is_allowed_only_without_namespace_flags_and_clone3_is_enosys() -> None:
    allow, *deny = _rules("clone")
    assert allow["action"] == "SCMP_ACT_ALLOW"
    assert allow["args"] == [
        {"index": 0, "value": CLONE_NEW_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    ]
    # One EPERM rule per flag (seccomp has no "masked not equal"): else the default, ENOSYS.
    flags = [rule["args"][0]["value"] for rule in deny]
    assert sum(flags) == CLONE_NEW_FLAGS and all(f & (f - 1) == 0 for f in flags)
    for rule, flag in zip(deny, flags, strict=True):
        assert (rule["action"], rule["errnoRet"]) == ("SCMP_ACT_ERRNO", 1)
        assert rule["args"] == [
            {"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
        ]
    (clone3,) = _rules("clone3")
    assert (clone3["action"], clone3["errnoRet"]) == ("SCMP_ACT_ERRNO", 38)


def test_the_profile_is_plain_oci_with_no_capability_conditions() -> None:
    # containerd reads a Localhost profile as an OCI LinuxSeccomp and would drop
    # "includes"/"excludes", turning a rule meant for CAP_SYS_ADMIN into one for all.
    allowed_keys = {"names", "action", "errnoRet", "args"}
    for rule in PROFILE["syscalls"]:
        assert set(rule) <= allowed_keys, rule
    assert set(PROFILE) == {"defaultAction", "defaultErrnoRet", "syscalls"}


PODMAN_DEFAULT = Path("/usr/share/containers/seccomp.json")


@pytest.mark.skipif(not PODMAN_DEFAULT.exists(), reason="no Podman default profile here")
def test_everything_else_the_podman_default_allows_unconditionally_stays_allowed() -> None:
    default = json.loads(PODMAN_DEFAULT.read_text())
    plain = {
        n
        for r in default["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") and not r.get("includes")
        for n in r["names"]
    }
    ours = {
        n
        for r in PROFILE["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")
        for n in r["names"]
    }
    assert plain - ours == (DENIED | {"clone", "clone3"}) & plain
    assert ours - plain <= {"arch_prctl", "modify_ldt"}  # per-arch rules of the default


def test_pods_run_the_kernel_alone_and_ipython_in_a_directory_it_cannot_make() -> None:
    """One container (local restarts play a new pod, so nothing has to keep the old one
    up); IPYTHONDIR lies below /etc (root's) and, locally, the read-only connection mount,
    so IPython takes a new temporary directory at every start and a planted startup file
    never runs again."""
    local = render_podman(session(), PATHS)[0]
    cluster = by_kind(render_kubernetes(session(), CONN))["Pod"]
    for pod in (local, cluster):
        (kernel,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in kernel["env"]}
        assert env["IPYTHONDIR"].startswith("/etc/")
        mounts = kernel.get("volumeMounts", [])
        conf = [m for m in mounts if env["IPYTHONDIR"].startswith(m["mountPath"])]
        assert [m["readOnly"] for m in conf] == ([True] if pod is local else []), mounts


def test_a_secret_env_var_is_a_secret_key_ref_on_a_cluster_and_absent_from_a_local_pod() -> None:
    """The kubelet reads the Secret; local mode gives the value to the kernel itself, so
    neither pod spec holds it (`podman inspect` shows a container's env)."""
    ref = {"secretKeyRef": {"name": "api-keys", "key": "token"}}
    s = session(env=[{"name": "PLAIN", "value": "1"}, {"name": "TOKEN", "valueFrom": ref}])
    cluster = by_kind(render_kubernetes(s, CONN))["Pod"]
    (kernel,) = cluster["spec"]["containers"]
    env = {e["name"]: e for e in kernel["env"]}
    assert env["TOKEN"] == {"name": "TOKEN", "valueFrom": ref}
    assert env["PLAIN"] == {"name": "PLAIN", "value": "1"}
    kubernetes_validate.validate(cluster, K8S_VERSION, strict=True)

    (local,) = render_podman(s, PATHS)[0]["spec"]["containers"]
    names = [e["name"] for e in local["env"]]
    assert "PLAIN" in names and "TOKEN" not in names
    assert "valueFrom" not in json.dumps(local)


def test_a_persistent_workspace_is_a_claim_of_the_session_s_that_its_pod_mounts() -> None:
    assert render_workspace_claim(session()) is None, "an emptyDir by default"
    s = session(workspace={"persistent": True, "size": "2Gi", "storageClassName": "fast"})
    claim = render_workspace_claim(s)
    assert claim is not None
    kubernetes_validate.validate(claim, K8S_VERSION, strict=True)
    assert claim["metadata"]["name"] == "ks-demo-workspace"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    assert claim["metadata"]["labels"]["mcpforge.dev/session"] == "demo"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "2Gi"}},
        "storageClassName": "fast",
    }
    pod = by_kind(render_kubernetes(s, CONN))["Pod"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "workspace"]
    assert volume == {
        "name": "workspace",
        "persistentVolumeClaim": {"claimName": "ks-demo-workspace"},
    }
    kept = render_workspace_claim(
        session(workspace={"persistent": True, "reclaimPolicy": "Retain"})
    )
    assert kept is not None and "ownerReferences" not in kept["metadata"], "outlives the session"
    assert "storageClassName" not in kept["spec"], "the cluster's default class"


def test_the_baseline_policy_selects_every_kernel_pod_and_admits_nothing() -> None:
    """Policies add up: this one only makes sure a kernel pod is always selected by one."""
    policy = render_baseline_policy("team")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    spec = policy["spec"]
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert "ingress" not in spec and "egress" not in spec
    selector = spec["podSelector"]["matchLabels"].items()
    session_pod = by_kind(render_kubernetes(session(), CONN))["Pod"]
    pool = kernelsessionpool.load(
        kernelsessionpool.validate(
            {
                "apiVersion": "mcpforge.dev/v1alpha1",
                "kind": "KernelSessionPool",
                "metadata": {"name": "warm", "namespace": "team", "uid": "5678"},
                "spec": {"size": 1},
            }
        )
    )
    (component,) = spec["podSelector"]["matchExpressions"]
    assert component == {
        "key": "app.kubernetes.io/component",
        "operator": "In",
        "values": ["kernel", "fork-files", "snapshot-store"],  # a fork's copier, a store
    }
    assert selector <= session_pod["metadata"]["labels"].items()
    assert selector <= pool_labels(pool).items()  # and so a pod mid-claim, with either set
    for labels in (session_pod["metadata"]["labels"], pool_labels(pool)):
        assert labels["app.kubernetes.io/component"] in component["values"]
    # Not other projects' kernels (Enterprise Gateway labels its pods component=kernel too).
    assert selector == {("app.kubernetes.io/name", "mcp-forge")}
