"""Availability: kernels do not starve the gateway of CPU, and do not borrow its weight.

On a host whose cores are all busy, the gateway's loop waited for a core as long as any
host process (up to 160 ms at a time, whatever its nice), and every client's call with
it (tests/drills/neighbours.py). A local gateway that is root on a cgroup v1 host moves
into a cgroup that outweighs Podman's parent of pods (mcp_forge/cpuweight.py). What it
starts on a kernel's or client's behalf (upstream MCP servers, the host's pip, the
notebook worker) must not share that weight: a kernel calling a tool in a loop would
otherwise run the tool's server ahead of every other kernel. These tests read where each
process really is, from /proc and the cgroup filesystem.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_forge import cpuweight
from mcp_servers.config import EDGE_SERVER, PYTHON, ROOT

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
DEADLINE = 60.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (cpuweight.V1_CPU / "cpu.shares").is_file(),
    reason="the gateway moves itself only as root on a cgroup v1 host",
)


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir():
        children = (task / "children").read_text().split()
        found.extend(int(c) for c in children)
    return found


def _argv(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


async def test_the_gateway_outweighs_kernels_and_its_upstream_servers_do_not(
    tmp_path: Path,
) -> None:
    config = tmp_path / "mcp.json"
    edge = {"command": str(PYTHON), "args": [str(EDGE_SERVER)], "cwd": str(ROOT)}
    config.write_text(json.dumps({"mcpServers": {"edge": {**edge, "isolation": "shared"}}}))
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(tmp_path / "state"), "MCPFORGE_POOL_SIZE": "0"}
    process = await asyncio.create_subprocess_exec(
        *(GATEWAY, "gateway", "--mcp-config", str(config)),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    said: list[str] = []
    try:
        assert process.stderr is not None
        async with asyncio.timeout(DEADLINE):  # the shared server is connected at start
            while not any("upstream MCP server edge:" in line for line in said):
                line = (await process.stderr.readline()).decode()
                assert line, f"the gateway exited: {said}"
                said.append(line)
        assert any(f"cpu.shares {cpuweight.SHARES} in /{cpuweight.NAME}" in s for s in said), said
        assert cpuweight.cpu_cgroup(process.pid) == f"/{cpuweight.NAME}"
        assert cpuweight.read_shares(cpuweight.V1_CPU / cpuweight.NAME) == cpuweight.SHARES
        [server] = [p for p in _children(process.pid) if str(EDGE_SERVER).encode() in _argv(p)]
        # Back where the gateway came from: this test's own cgroup.
        assert cpuweight.cpu_cgroup(server) == cpuweight.cpu_cgroup(), _argv(server)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            async with asyncio.timeout(DEADLINE):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


PROBE = """
import subprocess, sys
from mcp_forge import confine, cpuweight
print(cpuweight.raise_weight(), flush=True)
waits = "print('up', flush=True); input()"
argv = confine.command([sys.executable, "-I", "-c", waits], what="a probe")
child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "up\\n"  # the chain ran: its first process is bwrap now
print(cpuweight.cpu_cgroup(child.pid), flush=True)
child.communicate("")
"""


def test_confined_host_work_runs_at_the_hosts_weight_not_the_gateways() -> None:
    """The host's pip and the notebook worker run through confine.command: a process that
    moved as the gateway does starts one, which must be back in the cgroup it came from
    (read from outside: inside, a cgroup namespace shows its own root)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=DEADLINE
    )
    assert done.returncode == 0, done.stderr
    said, where = done.stdout.splitlines()
    assert f"in /{cpuweight.NAME}" in said, said
    assert where == cpuweight.cpu_cgroup() != f"/{cpuweight.NAME}", where
