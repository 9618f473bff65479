"""The gateway as an MCP server: the tools of tools.py on the SDK's MCPServer, served over
stdio here or over streamable HTTP by http.py. The mcp/ package is the only place that
imports the `mcp` SDK (besides code mode's upstream client)."""

from __future__ import annotations

from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp_types import SetLevelRequestParams

from mcp_forge import __version__
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.mcp.notifications import set_level
from mcp_forge.gateway.mcp.resources import Resources
from mcp_forge.gateway.mcp.subscriptions import Subscriptions
from mcp_forge.gateway.mcp.tasks import Tasks
from mcp_forge.gateway.mcp.tasks_store import Store, TaskStore
from mcp_forge.gateway.mcp.tools import Tools
from mcp_forge.gateway.sessions import SessionService

UNSERVED = (
    "prompts/list",
    "prompts/get",
    "subscriptions/listen",
)

INSTRUCTIONS = """\
MCP-Forge runs Python for you in isolated, stateful kernels (ipykernel in a sandboxed
pod: no network, uid 1000, a writable /workspace). Variables, imports and files persist
between execute_code calls on the same session until it is restarted, closed, or idle
for its idle timeout. Call execute_code without session_id to use your own default
session; create_session makes more (e.g. variant "minimal" starts faster, "default" has
numpy, pandas, matplotlib and pillow)."""


def build_server(
    service: SessionService,
    gateway: Gateway,
    *,
    transport: Literal["stdio", "http"],
    tasks: Store | None = None,
) -> tuple[MCPServer, Tasks]:
    """The MCP server with the gateway's tools, for one transport, and its tasks (kept
    in `tasks`: a directory, the API, or memory by default; tasks.py)."""
    server: MCPServer = MCPServer(
        name="mcp-forge", version=__version__, instructions=INSTRUCTIONS, subscriptions=False
    )
    tools = Tools(service, gateway, transport=transport)
    tools.register(server)
    Resources(tools).register(server)
    declare_what_is_served(server)
    Subscriptions(tools).register(server)  # before tasks: a task's end is looked at too
    served = Tasks(tools, tasks if tasks is not None else TaskStore())
    served.register(server)
    return server, served


def declare_what_is_served(server: MCPServer) -> None:
    """Capabilities that say the truth: the SDK declares a capability for each method it
    has a handler for, and MCPServer registers prompts (and subscriptions/listen)
    whatever a server serves. The gateway serves tools, resources (resources.py) and
    logging (the output of running code, up to protocol 2025-11-25, and to requests
    that ask for it on 2026-07-28): the others' methods are taken out (they then answer
    -32601). The SDK has no public way to unregister a handler;
    tests/e2e/test_protocol.py checks the capabilities each version negotiates."""
    lowlevel = server._lowlevel_server
    for method in UNSERVED:
        lowlevel._request_handlers.pop(method, None)
    lowlevel.add_request_handler("logging/setLevel", SetLevelRequestParams, set_level)


async def serve_stdio(server: MCPServer) -> None:
    """Serve one client on stdin/stdout until it closes stdin."""
    await server.run_stdio_async()
