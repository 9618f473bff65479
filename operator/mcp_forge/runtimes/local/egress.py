"""A local session's way out (issue 28): its socket, the proxy's rules, the kernel's settings.

A local kernel's pod has no network but `lo`. A session with an allow-list
(`spec.network.allow`) gets one socket more in its run directory, bound here by the
gateway (root, in the sealed run/, so the kernel can neither replace nor remove it) and
given to the kernel's uid alone; the egress proxy serves it (egress/). In the kernel, a
relay on the pod's loopback carries `HTTP(S)_PROXY` connections to that socket
(kernelside/egress_relay.py, started by kernelside/egress_start.py). The kernel's proxy
credential is derived from its key; the proxy also knows each connection's socket, so a
credential is only good through its own session's socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from mcp_forge.api.connection import RUN_DIR_IN_POD
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.egress import protocol
from mcp_forge.egress.client import EgressProxy
from mcp_forge.kernelside import compiled, run_silently, source

BACKLOG = 128


def proxy_name(session: KernelSession) -> str:
    return f"{session.namespace}/{session.name}"


def bind(path: Path, uid: int, gid: int) -> socket.socket:
    """The session's listening socket at `path`, the kernel's alone (0600)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket of an earlier start (or anything put there before sealing)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chown(path, uid, gid)
        os.chmod(path, 0o600)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def open_for(
    proxy: EgressProxy, session: KernelSession, run: Path, ids: tuple[int, int], key: str
) -> str:
    """Serve the session's socket in `run` with its rules; the silent program that gives
    its kernel the proxy settings and starts the relay."""
    token = protocol.token_for(key)
    listener = bind(run / protocol.SOCKET_NAME, *ids)
    rules = list(session.body["spec"].get("network", {}).get("allow", []))
    try:
        await proxy.open(proxy_name(session), token, rules, listener)
    except BaseException:
        listener.close()
        raise
    return start_program(token)


def start_program(token: str) -> str:
    names = {
        "ENV": protocol.proxy_env(token),
        "PORT": protocol.RELAY_PORT,
        "SOCKET": f"{RUN_DIR_IN_POD}/{protocol.SOCKET_NAME}",
        "RELAY": source("egress_relay"),
    }
    return run_silently(compiled("egress_start"), {k: repr(v) for k, v in names.items()})
