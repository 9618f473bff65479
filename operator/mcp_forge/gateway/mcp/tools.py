"""The gateway's MCP tools: the methods of Tools, which is given the session service and
the gateway core. The session tools (create, list and close a session) and the machinery
that registers every tool live in session_tools.py, in SessionTools, which Tools extends
with the tools that use a session. Each tool's docstring is its description, written for a
model; its body is a thin step to the service or the core. An error of ours (ForgeError)
reaches the model as a tool error with its message; an exception raised by the user's code
is not an error here but an isError result of execute_code, with its traceback."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult
from pydantic import Field

from mcp_forge import tracing
from mcp_forge.errors import InvalidRequest
from mcp_forge.gateway.mcp.content import execution_result, file_result
from mcp_forge.gateway.mcp.models import (
    ExecuteOutput,
    FileEntry,
    FileList,
    FileRead,
    FileWritten,
    InstalledPackage,
    Interrupted,
    KernelTools,
    NotebookExported,
    PackagesInstalled,
    Restarted,
    Variable,
    Variables,
)
from mcp_forge.gateway.mcp.notifications import keeping_informed
from mcp_forge.gateway.mcp.session_tools import READ_ONLY, SessionTools, _hints, tool


class Tools(SessionTools):
    """The tools of one server: the session tools (SessionTools) and those below, which run
    code in a session or reach its kernel and files."""

    @tool(_hints(read_only=False, destructive=False, idempotent=False))
    async def execute_code(
        self,
        ctx: Context,
        code: Annotated[
            str,
            Field(
                description=(
                    "Python source to run, as in a Jupyter cell; the last expression's value is "
                    "returned."
                )
            ),
        ],
        session_id: Annotated[
            str | None,
            Field(
                description=(
                    "Session to run in; omit to use your default session (created on first use)."
                )
            ),
        ] = None,
        timeout: Annotated[
            float | None,
            Field(
                description="Seconds before the code is interrupted (default 300, at most 3600)."
            ),
        ] = None,
    ) -> Annotated[CallToolResult, ExecuteOutput]:
        """Run Python code in a stateful kernel and return what it printed and produced.

        State persists across calls on a session: variables, imports, files in
        /workspace. Returns stdout, stderr, the last expression's value, every display
        (matplotlib figures come back as PNG images) and, if the code raised, the
        traceback (isError is then true). Limits: code up to 1 MB; about 100 KB of text
        comes back, the full output is saved in /workspace/.mcp-forge/outputs/. Past the
        timeout the code is interrupted and variables are kept; if it does not stop, the
        kernel is restarted and variables are lost (state_lost). status 'died' means the
        kernel crashed or ran out of memory: it was restarted, variables are lost.
        In a session created with mcp_servers, code can call those servers' tools with
        `import mcp_tools` (code mode): see list_kernel_tools for what it may call.
        The kernel has no network access."""
        limit = self.gateway.check_code(
            code, timeout
        )  # bad input is refused before a kernel starts
        session = await self._session_for(ctx, session_id)
        async with keeping_informed(ctx, limit) as on_stream:
            result = await self.gateway.execute(
                session.name,
                code,
                timeout=limit,
                namespace=session.namespace,
                on_stream=on_stream,
                read=session,  # just read, to check who may use it: not read again
            )
        answer = execution_result(session.name, result)
        if (trace_id := tracing.trace_id()) is not None:  # the SDK's span of this call
            answer.meta = {tracing.TRACE_ID_META: trace_id}
        return answer

    @tool(_hints(read_only=False, destructive=False, idempotent=True))
    async def interrupt_kernel(self, ctx: Context, session_id: str) -> Interrupted:
        """Interrupt the code a session is running (like Ctrl-C); variables are kept.

        The running execute_code call then returns with status 'interrupted'."""
        session = await self._session_for(ctx, session_id)
        acked = await self.gateway.interrupt(session.name, namespace=session.namespace)
        return Interrupted(session_id=session.name, interrupted=acked)

    @tool(_hints(read_only=False, destructive=True, idempotent=False))
    async def restart_kernel(self, ctx: Context, session_id: str) -> Restarted:
        """Restart a session's kernel: a fresh interpreter, all variables and imports are
        lost; files in /workspace are kept."""
        session = await self._session_for(ctx, session_id)
        await self.gateway.restart(session.name, namespace=session.namespace)
        return Restarted(
            session_id=session.name,
            restarted=True,
            message="variables cleared; workspace files kept",
        )

    @tool(READ_ONLY)
    async def list_kernel_tools(
        self,
        ctx: Context,
        session_id: Annotated[
            str | None, Field(description="Session; omit for your default session.")
        ] = None,
    ) -> KernelTools:
        """Code mode: the Python functions code in this session may call through
        `import mcp_tools` (one per upstream MCP server tool, with signatures and
        docstrings), as stubs. Call them from execute_code, e.g.
        `import mcp_tools; mcp_tools.files.read_text_file(path="a.txt")`; many at once
        with `await mcp_tools.<server>.<tool>.aio(...)`. Filter and combine results in
        the kernel and return only what matters."""
        session = await self._session_for(ctx, session_id)
        listing = await self.gateway.kernel_tools(session.name, namespace=session.namespace)
        return KernelTools(session_id=session.name, **listing)

    @tool(READ_ONLY)
    async def list_variables(self, ctx: Context, session_id: str) -> Variables:
        """The variables defined in a session: name, type, shape, dtype, length, size in
        bytes and a short repr. Computed inside the kernel; nothing changes. Each value
        gets about 2 s of its own code (repr, len, shape): one that takes longer shows a
        note in place of its repr."""
        session = await self._session_for(ctx, session_id)
        items = await self.gateway.variables(session.name, namespace=session.namespace)
        return Variables(session_id=session.name, variables=[Variable(**v) for v in items])

    @tool(READ_ONLY)
    async def inspect_variable(self, ctx: Context, session_id: str, name: str) -> Variable:
        """One variable in detail, with a longer repr (up to 2000 characters)."""
        session = await self._session_for(ctx, session_id)
        return Variable(
            **await self.gateway.inspect_variable(session.name, name, namespace=session.namespace)
        )

    @tool(READ_ONLY)
    async def read_file(
        self,
        ctx: Context,
        session_id: str,
        path: Annotated[
            str, Field(description="Path in the session's /workspace, relative or absolute.")
        ],
    ) -> Annotated[CallToolResult, FileRead]:
        """Read a file from the session's /workspace (up to 10 MB). Images come back as
        image content, UTF-8 text as text, other files as base64. Symbolic links are never
        followed, even to a file inside /workspace (SymlinkRefused: read the target's own
        path); FIFOs, sockets and devices are refused (NotARegularFile)."""
        session = await self._session_for(ctx, session_id)
        data = await self.gateway.read_file(session.name, path, namespace=session.namespace)
        return file_result(session.name, path, data)

    @tool(_hints(read_only=False, destructive=True, idempotent=True))
    async def write_file(
        self,
        ctx: Context,
        session_id: str,
        path: Annotated[
            str, Field(description="Path in the session's /workspace; directories are created.")
        ],
        content: str,
        encoding: Annotated[
            Literal["text", "base64"], Field(description="text: UTF-8; base64: binary data.")
        ] = "text",
    ) -> FileWritten:
        """Write a file into the session's /workspace (up to 10 MB), replacing it if it
        exists. Paths cannot leave /workspace; symbolic links on the path are never
        followed (SymlinkRefused), and a file with other hard links is not written
        (HardLinkRefused)."""
        session = await self._session_for(ctx, session_id)
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest("content is not valid base64") from exc
        else:
            data = content.encode()
        size = await self.gateway.write_file(session.name, path, data, namespace=session.namespace)
        return FileWritten(session_id=session.name, path=path, size=size)

    @tool(_hints(read_only=False, destructive=True, idempotent=True))
    async def export_notebook(
        self,
        ctx: Context,
        session_id: Annotated[
            str | None,
            Field(description="Session to export; omit for your default session."),
        ] = None,
        path: Annotated[
            str, Field(description="Where to save it in the session's /workspace.")
        ] = "notebook.ipynb",
    ) -> NotebookExported:
        """Save every cell run in the session so far as a Jupyter notebook (.ipynb,
        nbformat 4): code, outputs, images, errors, execution counts and timings, in
        order; a kernel restart is marked where variables were lost. It is written to
        `path` in /workspace (replacing a file there) for a person to open in JupyterLab;
        read_file returns it. Cells are recorded as they run, so they outlive a gateway
        restart; outputs are as execute_code returned them (bounded). The notebook is at
        most 10 MB (the file limit): past it, cells are kept without their outputs
        (outputs_omitted counts them), and if the code of the cells alone is over it, the
        export is refused. A client runs one export at a time: another one meanwhile is
        an error."""
        session = await self._session_for(ctx, session_id)
        nb = await self.gateway.export_notebook(
            session.name,
            namespace=session.namespace,
            save_to=path,
            client=self._client_of(ctx).owner,
        )
        return NotebookExported(
            session_id=session.name,
            path=path,
            cells=nb.cells,
            size=len(nb.text.encode()),
            skipped=nb.skipped,
            outputs_omitted=nb.omitted,
        )

    @tool(READ_ONLY)
    async def list_files(
        self,
        ctx: Context,
        session_id: str,
        path: Annotated[
            str | None, Field(description="Directory in /workspace; the top if omitted.")
        ] = None,
    ) -> FileList:
        """List a directory of the session's /workspace: name, type (file, dir, symlink,
        other), size, mtime; at most 1,000 entries, sorted by name (truncated says there are
        more). Links are listed, never followed. Name bytes that are not UTF-8 are shown as
        \\xNN escapes."""
        session = await self._session_for(ctx, session_id)
        listing = await self.gateway.list_files(
            session.name, path or ".", namespace=session.namespace
        )
        return FileList(
            session_id=session.name,
            path=listing["path"],
            entries=[FileEntry(**e) for e in listing["entries"]],
            truncated=listing["truncated"],
        )

    @tool(_hints(read_only=False, destructive=False, idempotent=True))
    async def install_packages(
        self,
        ctx: Context,
        packages: Annotated[
            list[str],
            Field(
                description=(
                    'Requirements, e.g. ["tabulate", "msgpack==1.0.8", "rich>=13"]: names with '
                    "optional extras and version specifiers; no URLs, paths or pip options."
                )
            ),
        ],
        session_id: Annotated[
            str | None, Field(description="Session; omit for your default session.")
        ] = None,
    ) -> PackagesInstalled:
        """Install Python packages from the package index into a session, though its
        kernel has no network: the gateway resolves and downloads wheels (dependencies
        included), the kernel installs them offline into /workspace/.packages, which is on
        its sys.path at once and after a restart. Import them in execute_code straight
        after. Returns each distribution installed (name, version, size) and the total.

        The gateway's policy may refuse a package or a dependency (PackageDenied, named),
        or one over its size limit (PackageTooLarge); PackageNotFound names a requirement
        with no wheel for the kernel (CPython 3.11, Linux x86_64); PackageBusy says you (or
        the gateway) have as many installs running as allowed: wait for one to finish. A
        package the session imported already keeps its loaded version until
        restart_kernel."""
        session = await self._session_for(ctx, session_id)
        done = await self.gateway.install_packages(
            session.name,
            packages,
            namespace=session.namespace,
            read=session,
            client=self._client_of(ctx).owner,
        )
        return PackagesInstalled(
            session_id=session.name,
            installed=[InstalledPackage(**p) for p in done["installed"]],
            total_bytes=done["total_bytes"],
            path=done["path"],
        )
