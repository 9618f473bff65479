"""A session's workspace files and its notebook as MCP resources, for clients that attach
files by resource rather than call read_file.

    forge://sessions/{session_id}/files/{+path}   a file of the session's /workspace
    forge://sessions/{session_id}/notebook        every cell run in it, as .ipynb

Both are templates (resources/templates/list); resources/list names each session the
client may use by its notebook (a workspace's files are listed by list_files: listing
every file of every session on each resources/list would cost a kernel round trip per
session). Reads go through the same calls and checks as the tools (read_file,
export_notebook without saving): the client must be allowed the session, paths stay in
/workspace, links are never followed, sizes are bounded. An error is a JSON-RPC error
naming what was wrong: -32602 for a session or file that is not there (or not the
client's), -32603 otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcp import MCPError
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ListResourcesResult, PaginatedRequestParams, Resource

from mcp_forge.errors import ForgeError, InvalidRequest, SessionNotFound

if TYPE_CHECKING:
    from mcp_forge.gateway.mcp.tools import Tools

FILES = "forge://sessions/{session_id}/files/{+path}"
NOTEBOOK = "forge://sessions/{session_id}/notebook"
NOTEBOOK_TYPE = "application/x-ipynb+json"
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


def _error(exc: ForgeError) -> MCPError:
    missing = isinstance(exc, (SessionNotFound, InvalidRequest))
    return MCPError(code=INVALID_PARAMS if missing else INTERNAL_ERROR, message=str(exc))


class Resources:
    """The resources of the sessions a client may use, read through the tools' calls."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools

    def register(self, server: MCPServer) -> None:
        server.resource(
            FILES,
            name="workspace-file",
            title="A file of a session's /workspace",
            description="A file in the session's /workspace (up to 10 MB): UTF-8 text as "
            "text, anything else as a blob. Links are never followed.",
        )(self.file)
        server.resource(
            NOTEBOOK,
            name="notebook",
            title="A session's notebook",
            description="Every cell run in the session so far, as a Jupyter notebook "
            "(nbformat 4, at most 10 MB), as export_notebook builds it (nothing is saved).",
            mime_type=NOTEBOOK_TYPE,
        )(self.notebook)
        server._lowlevel_server.add_request_handler(
            "resources/list", PaginatedRequestParams, self.list
        )

    async def file(self, session_id: str, path: str, ctx: Context) -> str | bytes:
        try:
            session = await self.tools._session_for(ctx, session_id)
            data = await self.tools.gateway.read_file(
                session.name, path, namespace=session.namespace
            )
        except ForgeError as exc:
            raise _error(exc) from exc
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data

    async def notebook(self, session_id: str, ctx: Context) -> str:
        try:
            session = await self.tools._session_for(ctx, session_id)
            nb = await self.tools.gateway.export_notebook(
                session.name,
                namespace=session.namespace,
                client=self.tools._client_of(ctx).owner,
            )
        except ForgeError as exc:
            raise _error(exc) from exc
        return nb.text

    async def list(self, ctx: Any, params: PaginatedRequestParams) -> ListResourcesResult:
        """The notebook of each session the client may use (its workspace by template)."""
        headers = getattr(ctx.request, "headers", None)
        try:
            client = self.tools._client_from(headers)
            sessions = await self.tools.service.list(client)
        except ForgeError as exc:
            raise _error(exc) from exc
        return ListResourcesResult(
            resources=[
                Resource(
                    uri=NOTEBOOK.format(session_id=s.name),
                    name=f"{s.name}-notebook",
                    title=f"The notebook of session {s.name}",
                    mime_type=NOTEBOOK_TYPE,
                )
                for s in sessions
            ]
        )
