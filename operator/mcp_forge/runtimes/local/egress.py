"""A local session's way out (issue 28): its socket, the proxy's rules, the kernel's settings.

A local kernel's pod has no network but `lo`. A session with an allow-list
(`spec.network.allow`) gets one socket more in its run directory, bound here by the
gateway (root, in the sealed run/, so the kernel can neither replace nor remove it) and
given to the kernel's uid alone; the egress proxy serves it (egress/). In the kernel, a
relay on the pod's loopback carries `HTTP(S)_PROXY` connections to that socket
(kernelside/egress_relay.py, started by kernelside/egress_start.py). The kernel's proxy
credential is derived from its key; the proxy also knows each connection's socket, so a
credential is only good through its own session's socket.

Where a rule has the proxy read its requests (values added from Secrets, or methods and
paths over HTTPS), the session gets a CA of its own, kept in its directory: the proxy
signs the certificates it shows the kernel with it, and the kernel trusts it (a bundle
of the image's CAs and this one, named by SSL_CERT_FILE and the like). The values are
read from the store's Secrets at every start and go to the proxy only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

from mcp_forge.api import keys
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.keys import BridgeCert
from mcp_forge.api.secret import Secret
from mcp_forge.egress import grant, protocol
from mcp_forge.egress.client import EgressProxy, Given
from mcp_forge.egress.kernel import relay_program

BACKLOG = 128
CA_FILE = "egress-ca.json"  # in the session's directory: root's


proxy_name = grant.session_name
values = grant.values


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
    proxy: EgressProxy,
    session: KernelSession,
    paths: tuple[Path, Path],
    ids: tuple[int, int],
    key: str,
    lookup: Callable[[str], Secret | None],
) -> str:
    """Serve the session's socket in its run directory with its rules (and, where it has
    destinations the proxy reads, its CA, kept in the session's directory, and the values
    added from Secrets); the silent program that gives its kernel the proxy settings
    (and that CA to trust) and starts the relay. SecretError names a missing value."""
    run, directory = paths
    rules = list(session.body["spec"].get("network", {}).get("allow", []))
    reads = grant.reads_requests(session)
    given = Given(
        protocol.token_for(key),
        rules,
        session_ca(directory, proxy_name(session)) if reads else None,
        grant.values(session, lookup),
    )
    listener = bind(run / protocol.SOCKET_NAME, *ids)
    try:
        await proxy.open(proxy_name(session), given, listener)
    except BaseException:
        listener.close()
        raise
    return relay_program(given.token, given.ca.cert if given.ca else None)


def session_ca(directory: Path, name: str) -> BridgeCert:
    """The session's egress CA, made once and kept in its directory (root's, 0600): the
    kernel trusts the same certificate after a restart of the proxy or the gateway."""
    path = directory / CA_FILE
    try:
        kept = json.loads(path.read_text())
        return BridgeCert(str(kept["cert"]), str(kept["key"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    ca = keys.new_egress_ca(name)
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"cert": ca.cert, "key": ca.key}, f)
    os.replace(temporary, path)
    return ca
