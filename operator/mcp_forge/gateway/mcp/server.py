"""The gateway as an MCP server: the tools of tools.py on the SDK's MCPServer, served over
stdio here or over streamable HTTP by http.py. The mcp/ package is the only place that
imports the `mcp` SDK (besides code mode's upstream client)."""

from __future__ import annotations

from typing import Literal

from mcp.server.mcpserver import MCPServer

from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.mcp.tools import Tools
from mcp_forge.gateway.sessions import SessionService

INSTRUCTIONS = """\
MCP-Forge runs Python for you in isolated, stateful kernels (ipykernel in a sandboxed
pod: no network, uid 1000, a writable /workspace). Variables, imports and files persist
between execute_code calls on the same session until it is restarted, closed, or idle
for its idle timeout. Call execute_code without session_id to use your own default
session; create_session makes more (e.g. variant "minimal" starts faster, "default" has
numpy, pandas, matplotlib and pillow)."""


def build_server(
    service: SessionService, gateway: Gateway, *, transport: Literal["stdio", "http"]
) -> MCPServer:
    """The MCP server with the gateway's tools, for one transport."""
    server: MCPServer = MCPServer(name="mcp-forge", instructions=INSTRUCTIONS)
    Tools(service, gateway, transport=transport).register(server)
    return server


async def serve_stdio(server: MCPServer) -> None:
    """Serve one client on stdin/stdout until it closes stdin."""
    await server.run_stdio_async()
