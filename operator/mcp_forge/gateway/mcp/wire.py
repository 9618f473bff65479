"""The HTTP wire as the MCP specification has it, where the SDK's streamable HTTP
transport (mcp 2.3) says otherwise: an ASGI wrapper in front of its app.

- A POST whose Content-Type is not application/json gets 415 Unsupported Media Type
  (the SDK's transport security check answers 400 before its own 415 is reached).
- A JSON-RPC batch (a JSON array) gets -32600 Invalid Request, HTTP 400: the gateway
  serves single messages (2025-06-18 removed batches; the SDK said -32602).
- A request the client cancelled is not answered. The specification says the receiver
  of notifications/cancelled should not respond; the SDK's transport writes -32800
  "Request cancelled" on the call's SSE stream so that the stream ends with a response
  (`StreamableHTTPServerTransport._terminate_unanswered_request`). That event is
  dropped here and the stream simply ends. (Upstream: the transport could close the
  request's stream without a message, as its stdio transport and its 2026-07-28 path
  already do.)

Errors are JSON-RPC error objects with `id: null`, bounded and naming what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

REQUEST_CANCELLED = -32800  # the SDK's code for the answer it gives a cancelled request
INVALID_REQUEST = -32600
PEEK_MAX = 64 * 1024  # bytes of a body read before its first character is known

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _error(code: int, message: str) -> bytes:
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
    return json.dumps(body).encode()


async def _reply(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def cancelled_answer(chunk: bytes) -> bool:
    """Whether an SSE body chunk is the SDK's -32800 answer to a cancelled request (one
    event per chunk: sse-starlette sends each event in one body message)."""
    if b"-32800" not in chunk:
        return False
    for line in chunk.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            message = json.loads(line[5:])
        except ValueError:
            return False
        error = message.get("error") if isinstance(message, dict) else None
        return isinstance(error, dict) and error.get("code") == REQUEST_CANCELLED
    return False


class Wire:
    """ASGI middleware for the three corrections in the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST":
            headers = dict(scope.get("headers") or [])
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1")[:100] or "none"
                why = f"Content-Type must be application/json, not {shown}"
                await _reply(send, 415, _error(INVALID_REQUEST, why))
                return
            read, receive = await _peek(receive)
            if read.lstrip()[:1] == b"[":
                why = "JSON-RPC batches are not supported: send one message per request"
                await _reply(send, 400, _error(INVALID_REQUEST, why))
                return

        stream = False  # the response is an SSE stream (a JSON body is never touched)

        async def answering(message: dict[str, Any]) -> None:
            nonlocal stream
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers") or []).get(b"content-type", b"")
                stream = kind.startswith(b"text/event-stream")
            elif stream and cancelled_answer(message.get("body", b"")):
                if not message.get("more_body", False):  # the last message: end the body
                    await send({"type": "http.response.body", "body": b""})
                return
            await send(message)

        await self.app(scope, receive, answering)


async def _peek(receive: Receive) -> tuple[bytes, Receive]:
    """The start of the request body (until its first non-blank byte, or PEEK_MAX), and a
    `receive` that gives the app the whole body as it came."""
    taken: list[dict[str, Any]] = []
    head = b""
    while True:
        message = await receive()
        taken.append(message)
        if message["type"] != "http.request":
            break
        head += message.get("body", b"")
        if head.lstrip() or not message.get("more_body") or len(head) > PEEK_MAX:
            break

    async def replay() -> dict[str, Any]:
        if taken:
            return taken.pop(0)
        return await receive()

    return head, replay
