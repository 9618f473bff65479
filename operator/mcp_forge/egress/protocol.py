"""What the gateway and the egress proxy share: the kernel's proxy settings, the session's
credential, and the control messages (one JSON object a line, a descriptor beside some).

Standard library only: the proxy's venv holds our package without its dependencies.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import socket
from typing import Any

# The kernel's end: the relay in the pod listens here, on the pod's own loopback.
RELAY_PORT = 3128
# The session's socket as the pod sees it, below the run directory's mount.
SOCKET_NAME = "egress.sock"
PROXY_USER = "session"
# What a value added on the way out reads as where a server repeats it (a redirect).
PLACEHOLDER = "mcp-forge-egress-value"
# One control message: the largest session fits (64 rules of 16 paths of 1 KiB, 4 values
# of 8 KiB each: about 3.2 MiB as JSON).
MESSAGE_MAX = 8 << 20
CONNECTIONS_MAX = 64  # open connections of one session through the proxy
# Cluster mode (server.py --listen): connections not yet identified by a credential, at
# most this many open at once for the whole proxy, each for at most this many seconds.
UNIDENTIFIED_MAX = 256
UNIDENTIFIED_TIMEOUT = 10.0
# What an audit socket's reader may fall behind before it loses records (bytes, in the
# proxy; its socket's own buffer holds about as much again).
AUDIT_BUFFER = 1 << 20
_TOKEN_CONTEXT = b"mcp-forge egress proxy credential v1"


def token_for(key: str | bytes) -> str:
    """The session's proxy credential, derived from its kernel key (the Secret's, on both
    realizers): whoever holds the key may speak for the session, no one else."""
    raw = key.encode() if isinstance(key, str) else key
    return hmac.new(raw, _TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def proxy_env(token: str, address: str = f"127.0.0.1:{RELAY_PORT}") -> dict[str, str]:
    """The kernel's environment for its egress: what pip, requests, httpx, curl and urllib
    read (upper and lower case: curl reads only `http_proxy` lower case). `address`: the
    pod's relay (local), or the cluster proxy Service's host:port."""
    url = f"http://{PROXY_USER}:{token}@{address}"
    local = "localhost,127.0.0.1,::1"
    env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "NO_PROXY": local}
    return {**env, **{k.lower(): v for k, v in env.items()}}


def encoded(message: dict[str, Any]) -> bytes:
    """A message as sent: one JSON line. ValueError past MESSAGE_MAX."""
    data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if len(data) > MESSAGE_MAX:
        raise ValueError(f"control message of {len(data)} bytes, over {MESSAGE_MAX}")
    return data


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message, with descriptors (SCM_RIGHTS) when given. A blocking socket."""
    data = encoded(message)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


class Reader:
    """Messages from a blocking socket, each with the descriptors that came with it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.fds: list[int] = []

    def read(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next message and its descriptors; None at the end of the stream."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > MESSAGE_MAX:
                raise ValueError(f"control message over {MESSAGE_MAX} bytes")
            fds = array.array("i")
            data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_LEN(16 * fds.itemsize))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % fds.itemsize
                    fds.frombytes(payload[:usable])
            self.fds.extend(fds)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        fds_now, self.fds = self.fds, []
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("a control message is a JSON object")
        return message, fds_now
