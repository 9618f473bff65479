"""The local gateway's CPU weight over its kernels', and its helpers' return to the host's.

On a host whose cores are all busy (ten kernels at their CPU caps, their output passing
through the gateway), a thread of the host's root cgroup waited up to 160 ms for a core:
a sleeper waking every 10 ms, its run-queue delay read from /proc (p99 19-26 ms, max
69-161 ms), while Podman's parent cgroup of pods (`libpod_parent`, cpu.shares 1024) held
the kernels. The gateway's loop is such a thread, and every client's call waited with
it: in tests/drills/neighbours.py a quiet client's list_sessions p99 rose 90-160 ms; a
nice of -10 changed nothing, because a nice weighs a thread against the threads of its
cgroup, not against another cgroup. With that parent's weight cut to 64 the sleeper's
p99 was 2 ms. The kubelet does the same for a node's daemons (system-reserved CPU, the
pods under `kubepods` with a weight of their own).

So a local gateway that runs as root on a cgroup v1 host moves itself, once, into a
cgroup of its own, `mcp-forge-gateway` under the cpu controller's root, weighing ten
times Podman's parent of pods (cpu.shares 10240 against 1024). The weight orders who
runs first when all want to; it takes nothing from an idle host, and the gateway's own
work is bounded by what it accepts (message and result limits, installs and exports at
once). Gateways of one host share the cgroup and its weight. It is left in place when
they stop, as Podman leaves its own.

What the gateway starts that is not its own work (the host's pip, the notebook worker,
upstream MCP servers: work a kernel or client asks for) goes back to the cgroup the
gateway came from, through `prefix()`, so no kernel borrows the weight through them.
Podman's own commands stay: they are the gateway's work, and conmon and the pods go where
Podman puts them.

A cgroup v2 host (systemd's) is the service manager's: the weight is the unit's
`CPUWeight=` (docs/local.md), and nothing is moved; nor for a gateway that is not root.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

V1_CPU = Path("/sys/fs/cgroup/cpu")
NAME = "mcp-forge-gateway"
SHARES = 10240  # ten times a cgroup's default (1024), as Podman's libpod_parent has

# The cgroup.procs file of the cgroup the gateway came from, once it has moved.
_origin: Path | None = None


def cpu_cgroup(pid: int | str = "self") -> str | None:
    """The cgroup v1 cpu controller's path of `pid` ("/" for the root), or None on a host
    without one (cgroup v2) or for a process that is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return None


def raise_weight() -> str:
    """Move this process into the gateway's cgroup, as the module docstring says; what was
    done, or why nothing was (a line for the log)."""
    global _origin
    if os.geteuid() != 0:
        return "CPU weight: the host's (the gateway is not root)"
    here = cpu_cgroup()
    if here is None or not (V1_CPU / "cpu.shares").is_file():
        return "CPU weight: the service manager's (cgroup v2: see CPUWeight= in docs/local.md)"
    target = V1_CPU / NAME
    if here.strip("/") == NAME:
        return f"CPU weight: cpu.shares {read_shares(target)} in /{NAME} (started there)"
    try:
        target.mkdir(exist_ok=True)
        (target / "cpu.shares").write_text(str(SHARES))
        (target / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        log.warning("could not move the gateway into /%s: %s", NAME, exc)
        return f"CPU weight: the host's (moving into /{NAME} failed: {exc.strerror})"
    _origin = V1_CPU / here.strip("/") / "cgroup.procs"
    return f"CPU weight: cpu.shares {SHARES} in /{NAME}; kernels' parent has {podman_shares()}"


def prefix() -> list[str]:
    """The argv prefix that starts a program in the cgroup the gateway came from (empty if
    it never moved). A shell writes its own pid there and execs the program; a failed
    write leaves it where it is, it does not stop it."""
    if _origin is None:
        return []
    return ["/bin/sh", "-c", 'echo $$ > "$0" 2>/dev/null; exec "$@"', str(_origin)]


def read_shares(cgroup: Path) -> int | None:
    try:
        return int((cgroup / "cpu.shares").read_text())
    except (OSError, ValueError):
        return None


def podman_shares() -> str:
    shares = read_shares(V1_CPU / "libpod_parent")
    return "cpu.shares 1024 (not made yet)" if shares is None else f"cpu.shares {shares}"
