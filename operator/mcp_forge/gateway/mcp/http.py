"""The gateway over streamable HTTP: bearer-token auth (each token one client), the ASGI
app at /mcp with its Host/Origin allow-list and request size limit, the wire's
corrections (wire.py), resumable streams (events.py), and uvicorn on a socket bound
before anyone is told the address."""

from __future__ import annotations

import hashlib
import hmac
import socket
from typing import Any

from mcp.server.mcpserver import MCPServer

from mcp_forge.errors import ForgeError
from mcp_forge.gateway.mcp.events import Resumable, SessionEvents
from mcp_forge.gateway.mcp.wire import Wire

CLIENT_HEADER = "x-mcpforge-client"  # set by BearerAuth only
MAX_REQUEST_BODY = 16 * 1024 * 1024  # a 10 MB file, base64-encoded, in a JSON-RPC request


class BearerAuth:
    """ASGI middleware: 401 unless `Authorization: Bearer <token>` names a client.

    Each token is one client's credential (`tokens` maps token → client name). The
    client's name is passed on in the CLIENT_HEADER, which only this middleware sets,
    and as `scope["user"]`, which the SDK uses to bind an MCP session to the credential
    that opened it (another client's session id is then "not found").
    """

    def __init__(self, app: Any, tokens: dict[str, str]) -> None:
        self.app = app
        self.tokens = {t.encode(): name for t, name in tokens.items()}

    def _client(self, authorization: bytes) -> tuple[str, bytes] | None:
        scheme, _, presented = authorization.partition(b" ")
        found = None
        for token, name in self.tokens.items():  # every one compared: no early exit
            if hmac.compare_digest(presented.strip(), token):
                found = (name, token)
        return found if scheme.lower() == b"bearer" else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets and anything else: not served
            return
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != CLIENT_HEADER.encode()]
        found = self._client(dict(headers).get(b"authorization", b""))
        if found is None:
            body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"www-authenticate", b'Bearer realm="mcp-forge"'),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        name, token = found
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken

        user = AuthenticatedUser(
            AccessToken(token=hashlib.sha256(token).hexdigest(), client_id=name, scopes=[])
        )
        scope = {
            **scope,
            "headers": [*headers, (CLIENT_HEADER.encode(), name.encode())],
            "user": user,
        }
        await self.app(scope, receive, send)


def http_app(
    server: MCPServer,
    *,
    host: str,
    port: int,
    tokens: dict[str, str],
    allowed_origins: list[str],
    allowed_hosts: tuple[str, ...] = (),
) -> Any:
    """The streamable-HTTP app at /mcp: bearer token, Host/Origin allow-list, size limit."""
    from mcp.server.transport_security import TransportSecuritySettings

    named = f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header has it
    hosts = {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"{named}:{port}"}
    for h in allowed_hosts:
        if ":" in h.rsplit("]", 1)[-1]:
            hosts.add(h)
        else:  # a bare name: as a client reaching us directly, and through a proxy on 80/443
            hosts.update((h, f"{h}:{port}"))
    origins = {f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"}
    origins.update(allowed_origins)
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=sorted(hosts),
        allowed_origins=sorted(origins),
    )
    app = server.streamable_http_app(
        streamable_http_path="/mcp",
        transport_security=security,
        max_request_body_size=MAX_REQUEST_BODY,
        host=host,
        event_store=SessionEvents(),  # resumable streams (events.py)
    )
    return BearerAuth(Wire(Resumable(app)), tokens)


class HttpServer:
    """uvicorn on a socket bound before anyone is told the address, stopped gracefully."""

    def __init__(self, app: Any, *, host: str, port: int, grace: float) -> None:
        import uvicorn

        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.socket = socket.create_server((host, port), family=family)
            # Accepted connections inherit it. asyncio sets it only when the socket's
            # proto is TCP, which uvicorn's copy of a passed-in socket does not say, and
            # Nagle plus delayed ACKs then add ~40 ms to every response.
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise ForgeError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        # At shutdown, requests in flight (an open SSE stream, a long cell) get `grace`
        # seconds; then they are closed, so SIGTERM always ends the gateway.
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=max(1, round(grace))
        )
        self._server = uvicorn.Server(config)

    async def serve(self) -> None:
        await self._server.serve(sockets=[self.socket])

    def stop(self) -> None:
        """Finish the requests in flight, then return from serve()."""
        self._server.should_exit = True
