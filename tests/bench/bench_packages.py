"""Benchmark: install_packages of one cached wheel, next to the host's own pip, in one run.

    sudo .venv/bin/python tests/bench/bench_packages.py [--runs 15] [--requirement tabulate==0.9.0]

Through the official MCP client over stdio, against a real gateway and a real kernel in a
real Podman pod, interleaved round by round (the machine is shared and noisy):
  * pip (baseline): the host's pip, as a person would run it, downloads the same wheel
    for the kernel's Python (`pip download --only-binary=:all: --no-deps ...`), cached;
  * install_packages: the gateway resolves and downloads it (its isolated pip, its own
    cache, warmed by a first untimed install), sends it over the kernel's channels and
    the kernel installs it offline;
  * execute_code `1+1`: the MCP round trip of the same session, for scale.
Prints the median and p90 of each, and the ratio of install_packages to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_local import stats  # tests/bench, beside this script
from mcp import Client
from mcp.client.stdio import StdioServerParameters

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")


async def host_pip(requirement: str, dest: str) -> float:
    args = [
        sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
        "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
        "--platform", "manylinux2014_x86_64", "--dest", dest, requirement,
    ]  # fmt: skip
    t = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    assert await proc.wait() == 0
    return time.perf_counter() - t


async def timed(c: Client, tool: str, args: dict[str, object]) -> float:
    t = time.perf_counter()
    r = await c.call_tool(tool, args)
    took = time.perf_counter() - t
    assert not r.is_error, r.content
    return took


async def main(runs: int, requirement: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-packages-") as tmp:
        env = {**os.environ, "MCPFORGE_STATE_DIR": tmp, "MCPFORGE_POOL_SIZE": "0"}
        params = StdioServerParameters(command=GATEWAY, args=["gateway"], env=env)
        async with Client(params) as c:
            made = await c.call_tool("create_session", {"variant": "minimal", "memory": "512Mi"})
            assert not made.is_error, made.content
            sid = made.structured_content["session_id"]
            install = {"session_id": sid, "packages": [requirement]}
            execute = {"session_id": sid, "code": "1+1"}
            await timed(c, "install_packages", install)  # warms the gateway's cache
            await host_pip(requirement, tmp + "/warm")  # and the host pip's
            pip, installs, executes = [], [], []
            for i in range(runs):
                pip.append(await host_pip(requirement, f"{tmp}/pip-{i}"))
                installs.append(await timed(c, "install_packages", install))
                executes.append(await timed(c, "execute_code", execute))
            await c.call_tool("delete_session", {"session_id": sid})
    base = stats(pip)
    print(f"medians, n={runs}, {requirement}                  median      p90   ratio")
    rows = [
        ("host pip download, cached (baseline)", stats(pip)),
        ("install_packages, cached wheel", stats(installs)),
        ("execute_code 1+1 (same session)", stats(executes)),
    ]
    for name, (p50, p90) in rows:
        print(f"{name:<44} {p50 * 1000:8.1f} ms {p90 * 1000:8.1f} ms {p50 / base[0]:6.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--requirement", default="tabulate==0.9.0")
    a = parser.parse_args()
    asyncio.run(main(a.runs, a.requirement))
