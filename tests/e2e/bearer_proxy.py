"""A loopback HTTP proxy that adds a bearer token to every request: for clients that
cannot send one (the MCP conformance suite's server scenarios), in front of a gateway
that serves no request without one.

Everything else passes through as sent, the Host and Origin headers included, so the
gateway's own checks (DNS rebinding) see what the client sent; the gateway is told to
allow the proxy's address as a Host (`hosts`). Responses stream back as they come (SSE).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import uvicorn

# Hop-by-hop headers, and those the proxy sets for itself.
_DROPPED = {b"authorization", b"connection", b"content-length", b"keep-alive", b"transfer-encoding"}
START_DEADLINE = 10.0


def hosts(port: int) -> tuple[str, ...]:
    """The Host headers a client of the proxy at `port` sends."""
    return (f"127.0.0.1:{port}", f"localhost:{port}")


class _Proxy:
    def __init__(self, target: str, token: str) -> None:
        self.target = target.rstrip("/")
        self.token = token
        self.http = httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=None))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROPPED]
        headers.append((b"authorization", f"Bearer {self.token}".encode()))
        query = f"?{scope['query_string'].decode()}" if scope.get("query_string") else ""
        request = self.http.build_request(
            scope["method"],
            f"{self.target}{scope['path']}{query}",
            headers=headers,
            content=bytes(body),
        )
        response = await self.http.send(request, stream=True)
        try:
            # Until the response ends or the client goes: a stream the gateway holds open
            # (GET /mcp) ends with its client, not with the gateway.
            relay = asyncio.ensure_future(self._relay(response, send))
            gone = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
            for task in (relay, gone):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay  # its error, if the relay failed
        finally:
            await response.aclose()

    @staticmethod
    async def _relay(response: httpx2.Response, send: Any) -> None:
        out = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROPPED]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def bearer_proxy(target: str, token: str, port: int) -> AsyncIterator[str]:
    """Serve the proxy on 127.0.0.1:`port` (the gateway must allow `hosts(port)`) in
    this loop; yields its base URL."""
    proxy = _Proxy(target, token)
    config = uvicorn.Config(
        proxy,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(START_DEADLINE):
            while not server.started:  # uvicorn has no event for it: looked at, bounded
                if task.done():
                    task.result()  # its error, if it failed to bind
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await proxy.http.aclose()
