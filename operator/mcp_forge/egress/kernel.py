"""What a running kernel is told for its egress: the proxy variables and, where the proxy
reads some of its requests, the session's CA to trust (kernelside/egress_start.py).

Locally the program also starts the pod's relay to the session's socket; on a cluster a
kernel claimed from a pool is told the proxy Service's address instead (the kernel of a
session's own pod has it in its environment from the start, control/render_egress.py).
"""

from __future__ import annotations

from mcp_forge.api.connection import RUN_DIR_IN_POD
from mcp_forge.egress import protocol
from mcp_forge.kernelside import compiled, run_silently, source


def relay_program(token: str, ca: str | None = None) -> str:
    """Local mode: the relay on the pod's loopback, to the session's socket, and the
    variables naming it."""
    names = {
        "ENV": protocol.proxy_env(token),
        "PORT": protocol.RELAY_PORT,
        "SOCKET": f"{RUN_DIR_IN_POD}/{protocol.SOCKET_NAME}",
        "RELAY": source("egress_relay"),
        "CA": ca,
    }
    return run_silently(compiled("egress_start"), {k: repr(v) for k, v in names.items()})


def proxy_program(token: str, address: str, ca: str | None = None) -> str:
    """A cluster: the variables naming the proxy at `address` (host:port); no relay."""
    names = {"ENV": protocol.proxy_env(token, address), "CA": ca}
    return run_silently(compiled("egress_start"), {k: repr(v) for k, v in names.items()})
