"""create_session's mcp_servers through a real MCP client: a plain server name, `"time"`,
is that server with the default policy, next to objects with a policy; anything else is
refused with an error naming the item. The real gateway over stdio, real upstream servers
(tests/mcp_servers), real kernels in Podman pods."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

from mcp_servers.config import missing_servers, upstream_config
from support import scratch_state_dir

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test upstream servers as an --mcp-config file."""
    work = tmp_path_factory.mktemp("names")
    config = upstream_config(work)
    assert not missing_servers(config), missing_servers(config)
    path = work / "mcp.json"
    path.write_text(json.dumps(config))
    return path


@asynccontextmanager
async def gateway(config_file: Path) -> AsyncIterator[Client]:
    with scratch_state_dir() as state:
        env = {**os.environ, "MCPFORGE_STATE_DIR": str(state)}
        args = ["gateway", "--mcp-config", str(config_file)]
        async with Client(StdioServerParameters(command=GATEWAY, args=args, env=env)) as c:
            yield c


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def create(c: Client, servers: Any) -> Any:
    return await c.call_tool("create_session", {"variant": "minimal", "mcp_servers": servers})


async def run(c: Client, sid: str, code: str) -> Any:
    """What the cell printed, as JSON."""
    r = await c.call_tool("execute_code", {"session_id": sid, "code": code})
    assert not r.is_error, text(r)
    return json.loads(r.structured_content["stdout"])


async def test_a_plain_name_is_that_server_with_the_default_policy(config_file: Path) -> None:
    async with gateway(config_file) as c:
        made = await create(c, ["time"])
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        listing = await c.call_tool("list_kernel_tools", {"session_id": sid})
        assert listing.structured_content["servers"] == ["time"]
        tz = await run(
            c,
            sid,
            "import json, mcp_tools\n"
            "print(json.dumps(mcp_tools.time.get_current_time(timezone='UTC')['timezone']))",
        )
        assert tz == "UTC"


async def test_names_and_objects_with_a_policy_mix_in_one_list(config_file: Path) -> None:
    async with gateway(config_file) as c:
        made = await create(c, ["time", {"name": "edge", "deny": ["add"]}])
        assert not made.is_error, text(made)
        sid = made.structured_content["session_id"]
        listing = await c.call_tool("list_kernel_tools", {"session_id": sid})
        assert listing.structured_content["servers"] == ["edge", "time"]
        out = await run(
            c,
            sid,
            "import json, mcp_tools\n"
            "try:\n"
            "    mcp_tools.edge.add(a=1)\n"
            "    denied = None\n"
            "except PermissionError as e:\n"
            "    denied = str(e)\n"
            "print(json.dumps({'denied': denied, 'echo': mcp_tools.edge.echo(text='hi'),\n"
            "    'tz': mcp_tools.time.get_current_time(timezone='UTC')['timezone']}))",
        )
    assert out["denied"] and "denied" in out["denied"], out
    assert out["echo"] == {"text": "hi"} and out["tz"] == "UTC"


REFUSED = [
    ([5], "mcp_servers[0]: must be a server name"),
    (["time", None], "mcp_servers[1]: must be a server name"),
    ([""], "mcp_servers[0]: must be a server name"),
    ([["time"]], "got list"),
    ({"name": "time"}, "mcp_servers: must be a list"),
    ("time", "mcp_servers: must be a list"),
    (["nope"], "no MCP server named nope"),
]


async def test_anything_else_is_refused_with_an_error_naming_the_item(config_file: Path) -> None:
    async with gateway(config_file) as c:
        said = {json.dumps(servers): text(await create(c, servers)) for servers, _ in REFUSED}
        sessions = await c.call_tool("list_sessions", {})
    for servers, says in REFUSED:
        assert says in said[json.dumps(servers)], (servers, said[json.dumps(servers)])
    assert sessions.structured_content["sessions"] == []  # nothing was created


async def test_the_published_schema_takes_names_and_objects(config_file: Path) -> None:
    async with gateway(config_file) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    schema = tools["create_session"].input_schema["properties"]["mcp_servers"]
    array = next(s for s in schema["anyOf"] if s.get("type") == "array")
    assert {s["type"] for s in array["items"]["anyOf"]} == {"string", "object"}
    assert '"time"' in schema["description"]
