"""The HTTP listener."""

from __future__ import annotations


def test_the_http_listener_disables_nagle_for_its_connections() -> None:
    import socket

    from mcp_forge.gateway.mcp.http import HttpServer

    async def app(scope: object, receive: object, send: object) -> None:
        return None

    server = HttpServer(app, host="127.0.0.1", port=0, grace=1)
    try:
        assert server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server.socket.close()
