"""`mcp-forge doctor`: check the host for local mode, and say exactly what to fix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from mcp_forge import confine
from mcp_forge.api import kernelsession
from mcp_forge.clients import podman
from mcp_forge.egress import client as egress_client
from mcp_forge.errors import ForgeError
from mcp_forge.runtimes.local import criu, volumes
from mcp_forge.runtimes.local.orphans import STORE_LABEL
from mcp_forge.runtimes.local.userns import SIZE, USERNS_USER, subordinate_ranges

# Podman gives each pod's user namespace at least 1024 ids (the image's users):
# room for many sessions at once.
SUBORDINATE_MIN = 65536

Say = Callable[[str], None]


async def run_checks(say: Say) -> bool:
    ok = True

    def result(passed: bool, what: str, fix: str = "") -> None:
        nonlocal ok
        ok = ok and passed
        say(f"{'ok  ' if passed else 'FAIL'} {what}")
        if not passed and fix:
            say(f"     fix: {fix}")

    if os.geteuid() != 0:
        result(False, "running as root", "local mode needs root (rootful Podman); run with sudo")
    else:
        result(True, "running as root")
    if podman.podman_binary() is None:
        result(False, "podman installed", "apt-get install -y podman runc")
        return False
    version = (await podman.run("--version", check=False)).stdout.decode().strip()
    result(True, version)
    try:
        info = await podman.run_json("info", "--format", "json")
    except ForgeError as exc:
        result(False, "podman info", str(exc))
        return False
    runtime = info.get("host", {}).get("ociRuntime", {}).get("name", "?")
    cgroup = info.get("host", {}).get("cgroupVersion", "?")
    conf_fix = (
        "write /etc/containers/containers.conf with\n"
        '       [containers]\n       default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
        '       [engine]\n       runtime = "runc"\n       events_logger = "file"'
    )
    result(
        runtime == "runc" or cgroup == "v2",
        f"OCI runtime {runtime} (cgroup {cgroup})",
        "crun fails on cgroup v1 hosts: " + conf_fix,
    )
    for path in (Path("/etc/subuid"), Path("/etc/subgid")):
        size = subordinate_ids(path, USERNS_USER)
        result(
            size >= SUBORDINATE_MIN,
            f"{path} gives {USERNS_USER!r} {size} ids (a user namespace of {SIZE} ids per session)",
            f"echo '{USERNS_USER}:2147483647:2147483648' >> {path}",
        )
    missing = [t for t in volumes.TOOLS if shutil.which(t) is None]
    result(
        not missing and _loop_control(),
        "mkfs.ext4, mount and loop devices (each workspace is a filesystem of its size)",
        "apt-get install -y e2fsprogs mount; modprobe loop"
        + (f" (missing: {', '.join(missing)})" if missing else " (no /dev/loop-control)"),
    )
    confined, detail = await confine.probe()
    result(
        confined,
        f"host-side work on untrusted data runs confined ({detail})",
        "apt-get install -y bubblewrap util-linux" if not confined else "",
    )
    await _snapshots(say)
    _egress(say)
    dmesg = await _dmesg_readable()
    say(
        "ok   the kernel log is readable: OOM kills are named as such"
        if dmesg
        else "note the kernel log (dmesg) is not readable: an OOM kill is reported as SIGKILL"
    )
    unlabelled = await _unlabelled_pods()
    if unlabelled:
        say(
            f"note {len(unlabelled)} kernel pod(s) from a gateway older than the store label "
            "(no housekeeping removes them; if no gateway of that age still runs: "
            f"podman pod rm -f {' '.join(unlabelled[:10])}{' ...' if len(unlabelled) > 10 else ''})"
        )
    image = kernelsession.default_image()
    exists = (await podman.run("image", "exists", image, check=False)).returncode == 0
    result(exists, f"kernel image {image}", "mcp-forge image build")
    if not exists:
        return ok
    result(*await _session_check(image), conf_fix)
    return ok


def _egress(say: Say) -> None:
    proxy = egress_client.default_python()
    say(
        f"ok   the egress proxy's Python ({proxy}): sessions may list hosts to reach"
        if proxy.exists()
        else f"note no egress proxy ({proxy} is missing; .ci/setup makes .venv-egress): a "
        "session with spec.network.allow fails to start"
    )


async def _snapshots(say: Say) -> None:
    """CRIU for runc: a note, not a failure, until suspend keeps memory (issue 27)."""
    snapshots, detail = await criu.probe()
    if snapshots:
        say(f"ok   live snapshots: {detail}")
    else:
        say(f"note live snapshots need CRIU 4.2 for runc: {detail}")
        say(f"     fix: {criu.FIX}")


async def _unlabelled_pods() -> list[str]:
    """Our kernel pods without the store label (orphans.py): a gateway before it made
    them, and only such a gateway knows whether a session still owns them."""
    try:
        rows = await podman.run_json(
            "pod", "ps", "--filter", "label=app.kubernetes.io/managed-by=mcp-forge",
            "--format", "json",
        )  # fmt: skip
    except (ForgeError, ValueError):
        return []
    return sorted(
        str(r.get("Name"))
        for r in rows or []
        if isinstance(r, dict) and STORE_LABEL not in (r.get("Labels") or {})
    )


def _loop_control() -> bool:
    return Path("/dev/loop-control").exists()


def subordinate_ids(path: Path, user: str) -> int:
    """How many subordinate ids `path` (/etc/subuid or /etc/subgid) gives `user`."""
    return sum(count for _, count in subordinate_ranges(path, user))


async def _dmesg_readable() -> bool:
    try:
        proc = await asyncio.create_subprocess_exec(
            "dmesg", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError:
        return False
    return await proc.wait() == 0


async def _session_check(image: str) -> tuple[bool, str]:
    """Play a real session (the real pod profile) in a scratch state dir and run code."""
    from mcp_forge.gateway.core import Gateway
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    state = Path(tempfile.mkdtemp(prefix="mf-doctor-", dir="/tmp"))
    runtime = LocalRuntime(Settings(state_dir=state, kernel_ready_timeout=60))
    name = f"doctor-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": kernelsession.API_VERSION,
        "kind": kernelsession.KIND,
        "metadata": {"name": name},
        "spec": {"image": image, "resources": {"memory": "256Mi"}},
    }
    what = (
        "a session starts and runs code (kube play, uid 1000 in a user namespace, no network,"
        " read-only root, a bounded workspace)"
    )
    gateway = Gateway(runtime, runtime.settings)
    try:
        applied = await runtime.apply(body)
        r = await gateway.execute(
            name,
            "import os; (os.getuid(), open('/proc/self/uid_map').read().split()[1],"
            " [m.split()[2] for m in open('/proc/mounts') if m.split()[1] == '/workspace'])",
        )
        seen = (r.result or {}).get("data", {}).get("text/plain")
        if seen is None or not seen.startswith("(1000, "):
            return False, f"{what}: the kernel runs as uid {seen}"
        if seen.startswith("(1000, '0',"):
            return False, f"{what}: the kernel is not in a user namespace ({seen})"
        if "ext4" not in seen:
            return False, f"{what}: its workspace is not a filesystem of its own ({seen})"
        return True, f"{what}: ready in {applied.seconds:.1f}s"
    except ForgeError as exc:
        return False, f"{what}: {exc}"
    finally:
        await gateway.close()
        with contextlib.suppress(ForgeError):
            await runtime.delete(name)
        shutil.rmtree(state, ignore_errors=True)
