"""A small upstream MCP server for code mode's edge cases, built on the official SDK.

Run it as `python tests/mcp_servers/edge_server.py` (stdio), or with `--http PORT` for
streamable HTTP at http://127.0.0.1:PORT/mcp (PORT 0 picks a free port). In HTTP mode it
binds its socket first, then prints one line, `MCP over HTTP at <url>`, on stdout; with
EDGE_HTTP_TOKEN set, it answers 401 to requests without `Authorization: Bearer <token>`.

Its tools are the cases a client of upstream servers must survive: structured results,
a slow call to cancel, an error result, a result of 20 MB, an image, a destructive tool,
a server that dies mid-call, a note (`write_note`) and `pid` to tell processes and their
state apart, and `env_has_secret` to prove the server got the secret
environment variable its configuration gave it (and the kernel did not).
"""

from __future__ import annotations

import argparse
import hmac
import os
import socket
import struct
import zlib
from typing import Annotated, Any

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field
from starlette.types import ASGIApp

SECRET_ENV = "EDGE_SECRET"
TOKEN_ENV = "EDGE_HTTP_TOKEN"  # if set, HTTP requests need it as a bearer token
CRASH_STATUS = 3

READ_ONLY = ToolAnnotations(
    read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
)
# Reads a counter that every call, this one included, moves: read-only, not idempotent.
COUNTER = ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False)
DESTRUCTIVE = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
)


class Echoed(BaseModel):
    text: str


class Sum(BaseModel):
    sum: int


class Counts(BaseModel):
    calls: int = Field(description="Tool calls this process has received, this one included.")
    cancelled: int = Field(description="Calls of `slow` cancelled while they slept.")


class NoteWritten(BaseModel):
    previous: str | None


class SecretPresence(BaseModel):
    present: bool


class Process(BaseModel):
    pid: int


def png(width: int = 4, height: int = 4, rgb: tuple[int, int, int] = (220, 40, 40)) -> bytes:
    """A valid PNG of one colour (8-bit RGB), from the format's chunks."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))  # filter 0: none
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def build_server() -> MCPServer:
    server: MCPServer = MCPServer(name="edge", version="1.0.0", subscriptions=False)
    counts = {"calls": 0, "cancelled": 0}
    note: list[str] = []

    async def count_calls(
        ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.method == "tools/call":
            counts["calls"] += 1
        return await call_next(ctx)

    server.middleware.append(count_calls)

    @server.tool(
        description="Return the text unchanged, as structured content.", annotations=READ_ONLY
    )
    def echo(text: Annotated[str, Field(description="Any text.")]) -> Echoed:
        return Echoed(text=text)

    @server.tool(
        description=(
            "Sleep, then say how long. Reports progress 0 of `seconds` when it starts sleeping. "
            "Stops at once when the call is cancelled."
        ),
        annotations=READ_ONLY,
        structured_output=False,
    )
    async def slow(
        ctx: Context,
        seconds: Annotated[float, Field(description="How long to sleep.", ge=0)] = 5,
    ) -> str:
        await ctx.report_progress(0, seconds, "sleeping")
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            counts["cancelled"] += 1
            raise
        return f"slept {seconds:g} s"

    @server.tool(
        description="Fail: an error result (isError) whose only text is `message`.",
        annotations=READ_ONLY,
        structured_output=False,
    )
    def fail(message: Annotated[str, Field(description="The error's text.")]) -> CallToolResult:
        # Not ToolError: the SDK would prefix "Error executing tool fail: ".
        return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)

    @server.tool(
        description="Return text of exactly `size` bytes (ASCII 'x'), to test size limits.",
        annotations=READ_ONLY,
        structured_output=False,
    )
    def huge(
        size: Annotated[int, Field(description="Bytes of text to return.", ge=0)] = 20_000_000,
    ) -> str:
        return "x" * size

    @server.tool(description="Return a 4x4 red PNG as image content.", annotations=READ_ONLY)
    def image() -> Image:
        return Image(data=png(), format="png")

    @server.tool(description="Add two integers.", annotations=READ_ONLY)
    def add(
        a: Annotated[int, Field(description="First addend.")],
        b: Annotated[int, Field(description="Second addend.")] = 2,
    ) -> Sum:
        return Sum(sum=a + b)

    @server.tool(
        description=(
            "Replace this process's note with `text` (the old one is lost) and return the "
            "previous note, or null."
        ),
        annotations=DESTRUCTIVE,
    )
    def write_note(text: Annotated[str, Field(description="The new note.")]) -> NoteWritten:
        previous = note[0] if note else None
        note[:] = [text]
        return NoteWritten(previous=previous)

    @server.tool(
        description=f"Kill this server process at once (exit status {CRASH_STATUS}), no answer.",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
        ),
        structured_output=False,
    )
    def crash() -> None:
        os._exit(CRASH_STATUS)

    @server.tool(
        description="How many tool calls this process has received (this one included), and "
        "how many `slow` calls were cancelled.",
        annotations=COUNTER,
    )
    def count() -> Counts:
        return Counts(**counts)

    @server.tool(
        description="This server's process id (to tell processes apart, and see them end).",
        annotations=READ_ONLY,
    )
    def pid() -> Process:
        return Process(pid=os.getpid())

    @server.tool(
        description=f"Whether this server's environment has {SECRET_ENV} (its value is not sent).",
        annotations=READ_ONLY,
    )
    def env_has_secret() -> SecretPresence:
        return SecretPresence(present=bool(os.environ.get(SECRET_ENV)))

    return server


class RequireToken:
    """ASGI middleware: 401 unless `Authorization: Bearer <token>`, to test configured headers."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            presented = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(presented, self.expected):
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)


async def serve_http(server: MCPServer, port: int) -> None:
    import uvicorn

    # Bound before the address is printed, so a reader of that line can connect at once.
    sock = socket.create_server(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    app: ASGIApp = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    if token := os.environ.get(TOKEN_ENV):
        app = RequireToken(app, token)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    print(f"MCP over HTTP at {url}", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP instead")
    args = parser.parse_args(argv)
    server = build_server()
    if args.http is None:
        server.run("stdio")
    else:
        anyio.run(serve_http, server, args.http)


if __name__ == "__main__":
    main()
