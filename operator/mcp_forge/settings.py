"""Named settings: every deadline and limit has a name, a default, and an env override."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from mcp_forge.errors import InvalidRequest


def _default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/mcp-forge")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(base) / "mcp-forge"


@dataclass(frozen=True)
class Settings:
    """Read from MCPFORGE_<NAME> environment variables, e.g. MCPFORGE_EXECUTE_TIMEOUT=60."""

    state_dir: Path = field(default_factory=_default_state_dir)
    # Deadlines, in seconds.
    kernel_ready_timeout: float = 60.0  # play → first kernel_info reply
    execute_timeout: float = 300.0  # default per-call timeout
    execute_timeout_max: float = 3600.0
    interrupt_grace: float = 3.0  # after interrupt_request, before a forced restart
    heartbeat_interval: float = 1.0  # liveness check while waiting on a busy kernel
    heartbeat_timeout: float = 1.5
    helper_timeout: float = 30.0  # namespace listing, variable inspection, file operations
    # On connecting: a kernel that leaves kernel_info unanswered this long is busy (an idle
    # kernel answers in milliseconds; this allows for a loaded host, not a long cell).
    busy_probe: float = 8.0
    podman_timeout: float = 120.0
    lock_wait: float = 10.0  # a helper or restart waits this long for a running call
    shutdown_grace: float = 5.0  # HTTP requests in flight get this long at shutdown
    activity_interval: float = 1.0  # lastActivity is written at most this often per session
    kernel_info_retry: float = 2.0  # re-ask kernel_info this often while waiting
    backoff_wait: float = 30.0  # a call waits out a crash-loop backoff this short
    notebook_timeout: float = 60.0  # the worker process that builds an exported notebook
    # Sizes, in bytes.
    code_max: int = 1_000_000
    output_budget: int = 100_000  # text returned per call; the rest goes to a file
    output_spool_max: int = 10_000_000  # most output kept in the workspace file per call
    data_budget: int = 10_000_000  # non-text output (images, JSON) returned per call
    frame_max: int = 16_000_000  # one ZMQ frame from the kernel
    message_max: int = 32_000_000  # one Jupyter message from the kernel (all its frames)
    helper_reply_max: int = 16_000_000  # a file of file_max, base64-encoded, fits
    file_max: int = 10_000_000  # read_file / write_file
    notebook_max: int = 50_000_000  # a session's notebook journal; past it, no outputs
    notebook_memory_max: int = 400_000_000  # address space of the notebook's worker
    repr_max: int = 2_000  # variable repr, when inspected
    repr_list_max: int = 200  # variable repr, in a namespace listing
    variables_max: int = 500  # entries in a namespace listing
    list_files_max: int = 1_000
    # What one MCP client may ask for.
    sessions_per_client_max: int = 10
    mcp_processes_per_client_max: int = 8  # code mode: isolated upstream processes
    notebook_exports_max: int = 2  # notebook exports running at once, in one gateway
    notebook_exports_per_client_max: int = 1
    session_memory_max: str = "16Gi"
    session_cpu_max: str = "4"
    # Kubernetes (the operator, and the gateway with --kubernetes).
    session_namespace: str = ""  # where the gateway makes sessions; "" is the mode's default
    gateway_namespace: str = ""  # kernel NetworkPolicies admit gateways of it ("" = their own)
    runtime_class: str = ""  # runtimeClassName of every kernel pod (gVisor, Kata); "" = none
    # Live snapshots on a cluster (control/snapshots.py): the RuntimeClass of the nodes'
    # mcpforge-restore handler (images/node). Set, kernel pods run on it with a user
    # namespace of their own, and a suspend keeps the kernel's memory; it takes the place
    # of runtime_class. "" = a suspend stops the kernel. snapshot_max_age (below) holds
    # there too: an older snapshot is discarded, and the nodes' sweepers remove it.
    snapshot_runtime_class: str = ""
    # The nodes' sweepers' namespace (manifests/overlays/snapshots), where each writes the
    # sizes of its node's archives; how often a snapshot's size is looked for there.
    snapshot_sweeper_namespace: str = "mcp-forge-node"
    snapshot_size_recheck: float = 30.0
    # Where a snapshot is kept (control/snapstore.py): "node" (only where the kubelet took
    # it: the pod wakes there, and the memory is lost with the node) or "claim" (also
    # copied into a PersistentVolumeClaim of its session, `ks-<name>-snapshot`, of this
    # storage class, "" = the cluster's default: it wakes elsewhere when its node is gone).
    snapshot_store: str = "node"
    snapshot_storage_class: str = ""
    # "<namespace>/<name>" of the ServiceAccount whose short-lived token the operator shows
    # kubelets for a checkpoint (it may only checkpoint); "" = the operator's own credentials.
    checkpoint_service_account: str = ""
    # Kernel pods' Localhost seccomp profile below the kubelet's seccomp root, as installed
    # on every node (docs/seccomp.md); "" = RuntimeDefault. Local mode always uses ours.
    seccomp_profile: str = ""
    kube_connect: str = "service"  # the gateway dials the session's Service, or "pod-ip"
    lease_renew: float = 10.0  # the gateway renews a session's activity Lease at most this often
    # Tasks of a cluster gateway: Secrets in this namespace ("" = the gateway's own).
    tasks_namespace: str = ""
    # 2026-07-28: execute_code still running after this long becomes a task (for clients
    # that declare the tasks extension on the call); shorter calls are answered as ever.
    task_after: float = 5.0
    task_heartbeat: float = 10.0  # a running task's sign of life; 3 missed: its gateway is gone
    operator_resync: float = 60.0  # every session is reconciled at least this often
    # A session Pending, Starting or Restarting this long without being Ready is Stalled
    # (it still tries; kstatus reads it as Failed); 0: never.
    progress_deadline: float = 600.0
    pool_backoff: float = 10.0  # after a pool's kernel failed; doubling, at most 5 minutes
    # Code mode.
    bridge_call_timeout: float = 60.0  # one upstream tool call made by kernel code
    # install_packages: the gateway's package policy (wheels/fetch.py). Names are
    # comma-separated, compared PEP 503-normalized, and apply to dependencies too.
    packages_allow: str = ""  # only these distributions ("" = any not denied)
    packages_deny: str = ""  # never these
    packages_max: int = 200_000_000  # bytes of all the files one install downloads
    packages_file_max: int = 100_000_000  # bytes of one downloaded file
    packages_allow_sdist: bool = False  # source distributions, built in a sandbox container
    packages_timeout: float = 300.0  # resolving and downloading; again for the kernel's install
    packages_index_url: str = "https://pypi.org/simple"  # the only index installs use
    packages_cache_max: int = 1_000_000_000  # bytes of pip's cache kept after an install
    packages_installs_max: int = 4  # installs in flight in one gateway
    packages_client_installs_max: int = 2  # installs in flight for one client
    # Live snapshots (local mode): a suspended kernel keeps its memory in an archive.
    snapshots: bool = True  # false: a suspended session's kernel starts afresh (as before)
    snapshot_max: int = 20_000_000_000  # bytes of one session's snapshot; past it, none
    snapshot_max_age: float = 604_800.0  # seconds a suspended kernel's memory is kept; 0: always
    # A suspended kernel's pod stays, its infra and a sleeping keeper (a few MB), and the
    # kernel is restored in place, its images read where CRIU wrote them; false: the pod
    # goes too, the snapshot is an archive in the session's directory (slower to resume).
    snapshot_in_pod: bool = True
    # Egress by name (egress/): the proxy's Python, in a venv of its own ("" = the
    # .venv-egress beside the gateway's venv, as .ci/setup makes it).
    egress_python: str = ""
    egress_connections_max: int = 64  # one session's open connections through the proxy
    egress_bandwidth_max: int = 64 << 20  # bytes a second, per session and direction; 0: none
    egress_ready_timeout: float = 30.0  # the proxy's start, until it listens
    # What an MCP client may list in create_session's `allow`: a JSON list of rules as in
    # spec.network.allow; a client's rule must fall within one ("" = none: only sessions
    # an operator declares reach anything).
    egress_client_allow: str = ""
    # Tests only: a JSON file of names to this machine's addresses, asked before DNS, and
    # the CA that the servers behind them are checked against.
    egress_resolve: str = ""
    egress_upstream_ca: str = ""
    # A cluster's egress proxy (manifests/base/common/egress.yaml): the namespace of its
    # Service, where the operator writes each session's grant, and the Service's name.
    egress_namespace: str = "mcp-forge-egress"
    egress_service: str = "mcp-forge-egress"

    @classmethod
    def from_env(cls) -> Settings:
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"MCPFORGE_{f.name.upper()}")
            if raw is None:
                continue
            if f.name == "state_dir":
                values[f.name] = Path(raw)
            elif f.type in ("str", str):
                values[f.name] = raw
            elif f.type in ("bool", bool):
                if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise InvalidRequest(
                        f"MCPFORGE_{f.name.upper()}={raw!r} is not a boolean (true or false)"
                    )
                values[f.name] = raw.lower() in ("1", "true", "yes")
            else:
                kind = float if f.type in ("float", float) else int
                try:
                    number = kind(raw)
                except ValueError:
                    raise InvalidRequest(
                        f"MCPFORGE_{f.name.upper()}={raw!r} is not a {kind.__name__}"
                    ) from None
                if number <= 0:
                    raise InvalidRequest(f"MCPFORGE_{f.name.upper()} must be positive, got {raw}")
                values[f.name] = number
        service_account(str(values.get("checkpoint_service_account", "")))
        if values.get("snapshot_store", "node") not in SNAPSHOT_STORES:
            raise InvalidRequest(
                f"MCPFORGE_SNAPSHOT_STORE={str(values['snapshot_store'])[:100]!r}: expected "
                + " or ".join(SNAPSHOT_STORES)
            )
        return cls(**values)  # type: ignore[arg-type]

    @property
    def kernel_runtime_class(self) -> str | None:
        """The runtimeClassName of a cluster's kernel pods (None: the cluster's default)."""
        return self.snapshot_runtime_class or self.runtime_class or None

    @property
    def store_path(self) -> Path:
        return self.state_dir / "store.db"


SNAPSHOT_STORES = ("node", "claim")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def service_account(text: str) -> tuple[str, str]:
    """`<namespace>/<name>` of a ServiceAccount (MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT) as
    its two parts; ("", "") for ""; InvalidRequest naming the value if it is not one."""
    if not text:
        return "", ""
    namespace, _, name = text.partition("/")
    if not (_NAME.fullmatch(namespace) and _NAME.fullmatch(name.replace(".", "-"))):
        raise InvalidRequest(
            f"MCPFORGE_CHECKPOINT_SERVICE_ACCOUNT={text[:300]!r}: expected <namespace>/<name> "
            "of a ServiceAccount (lowercase letters, digits and '-')"
        )
    return namespace, name
