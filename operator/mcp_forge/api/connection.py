"""How a kernel is reached: fixed ports, a per-session key, and the transport.

Each kernel has its own pod, so the five Jupyter channels use fixed numbers; nothing is
allocated and nothing can conflict. On Kubernetes they are TCP ports behind a Service.
Locally they are Unix sockets (ZMQ `ipc`) in a directory shared only between the host
and that one pod, whose network is `none`: no other kernel, and no host user but root,
can reach them. On a cluster the channels are CurveZMQ and the bridge TLS, with keys of
the session's own (keys.py), when its Secret has them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from mcp_forge.api.keys import (
    BRIDGE_CERT,
    BRIDGE_KEY,
    CURVE_PUBLIC,
    CURVE_SECRET,
    BridgeCert,
    CurveKeys,
    keys_of,
)
from mcp_forge.errors import KernelProtocolError

PORTS: dict[str, int] = {
    "shell": 5555,
    "iopub": 5556,
    "stdin": 5557,
    "control": 5558,
    "hb": 5559,
}

# Code mode's bridge (docs/bridge.md): the kernel listens, the gateway dials, as for the
# five channels. TCP on a cluster; locally a Unix socket in a directory of the run dir
# that the kernel's uid may write.
BRIDGE_PORT = 5560
BRIDGE_DIR_IN_POD = "/run/mcp-forge/bridge"
BRIDGE_SOCKET = "bridge.sock"

CONF_DIR_IN_POD = "/etc/mcp-forge"  # read-only: the connection file (a Secret on Kubernetes)
CONNECTION_FILE_IN_POD = f"{CONF_DIR_IN_POD}/connection.json"
RUN_DIR_IN_POD = "/run/mcp-forge"  # local mode only: the kernel's Unix sockets
IPC_PREFIX_IN_POD = f"{RUN_DIR_IN_POD}/kernel"
# ZMQ ipc endpoints are Unix socket paths: at most 107 bytes on Linux.
IPC_PATH_MAX = 100
# Live keys are new_key()'s 64 characters; anything under 128 bits signs nothing worth
# trusting (an empty key would make every signature check pass).
KEY_MIN = 32

Transport = Literal["tcp", "ipc"]


def check_key(key: str) -> None:
    """Refuse a key that cannot authenticate messages: empty, or shorter than KEY_MIN."""
    if not isinstance(key, str) or len(key) < KEY_MIN:
        size = len(key) if isinstance(key, str) else 0
        raise KernelProtocolError(
            f"the kernel's connection key is {size} characters; at least {KEY_MIN} are needed "
            "(an empty or short key would let anyone forge the kernel's messages)"
        )


def new_key() -> str:
    """A fresh HMAC key, unique per session (256 bits)."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ConnectionInfo:
    transport: Transport
    host: str  # IP or DNS name for tcp; socket path prefix for ipc
    key: str = field(repr=False)
    # A cluster session's: channels encrypted with Curve, the bridge with TLS (keys.py).
    # None: a session from before them (plaintext), or a local one (ipc, no network).
    curve: CurveKeys | None = field(default=None, repr=False)
    bridge: BridgeCert | None = field(default=None, repr=False)

    def kernel_side(self) -> ConnectionInfo:
        """The info as the kernel binds it inside its pod."""
        if self.transport == "ipc":
            return replace(self, host=IPC_PREFIX_IN_POD)
        return replace(self, host="0.0.0.0")

    def to_jupyter(self) -> dict[str, Any]:
        """The connection-file dictionary jupyter-client and ipykernel understand."""
        info: dict[str, Any] = {f"{name}_port": port for name, port in PORTS.items()}
        info.update(
            transport=self.transport,
            ip=self.host,
            key=self.key,
            signature_scheme="hmac-sha256",
            kernel_name="python3",
        )
        if self.curve is not None:
            info.update({CURVE_PUBLIC: self.curve.public, CURVE_SECRET: self.curve.secret})
        if self.bridge is not None:
            info.update({BRIDGE_CERT: self.bridge.cert, BRIDGE_KEY: self.bridge.key})
        return info

    def to_file(self) -> str:
        return json.dumps(self.kernel_side().to_jupyter(), indent=2, sort_keys=True)

    def public(self) -> dict[str, Any]:
        """What may be shown in status: everything but the keys."""
        return {"transport": self.transport, "host": self.host, "ports": dict(PORTS)}


def connection_from_file(info: Mapping[str, Any], host: str, where: str) -> ConnectionInfo:
    """A cluster kernel's connection from its connection file (as its Secret holds it), to
    be reached at `host`: Curve and the bridge's TLS when the file has their keys.

    KernelProtocolError names `where` and what is wrong: a short key, a malformed Curve
    key or bridge certificate.
    """
    key = info.get("key")
    if not isinstance(key, str):
        raise KernelProtocolError(f"{where}: the connection file has no key")
    try:
        check_key(key)
    except KernelProtocolError as exc:
        raise KernelProtocolError(f"{where}: {exc}") from None
    curve, bridge = keys_of(info, where)
    return ConnectionInfo("tcp", host, key, curve, bridge)


@dataclass(frozen=True)
class Address:
    """Where a kernel's bridge listens, as the gateway reaches it."""

    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0
    # Locally: does this pid belong to the session's kernel container? (SO_PEERCRED)
    peer_check: Callable[[int], bool] | None = None
    # On a cluster: mutual TLS with the session's own certificate, pinned (keys.py).
    tls: BridgeCert | None = None
