"""`mcp-forge doctor`: check the host for local mode, and say exactly what to fix."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable

from . import podman, resource
from .errors import ForgeError

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
    image = resource.default_image()
    exists = (await podman.run("image", "exists", image, check=False)).returncode == 0
    result(exists, f"kernel image {image}", "mcp-forge image build")
    if not exists:
        return ok
    name = f"mcpforge-doctor-{uuid.uuid4().hex[:8]}"
    done = await podman.run(
        "run",
        "--rm",
        "--name",
        name,
        "--network=none",
        "--read-only",
        "--cap-drop=ALL",
        "--user=1000:1000",
        "--security-opt=no-new-privileges",
        image,
        "python",
        "-c",
        "import ipykernel, os; print(os.getuid(), ipykernel.__version__)",
        check=False,
        timeout=120,
    )
    started = done.returncode == 0 and re.match(rb"1000 ", done.stdout) is not None
    detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    fix = (
        "a container could not start: "
        + detail
        + "\n     if it mentions ulimit or rlimit: "
        + conf_fix
    )
    result(
        started, "a sandboxed kernel container starts (uid 1000, no network, read-only root)", fix
    )
    return ok
