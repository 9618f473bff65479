"""Starts the kernel pod's egress relay (egress_relay.py), once, and gives the kernel its
proxy settings.

Run silently by the gateway in globals of its own holding ENV (the proxy variables),
PORT, SOCKET (the egress socket as the pod sees it), RELAY (the relay's source) and CA
(the session's egress CA certificate, or None); on a cluster (a kernel claimed from a
pool) ENV and CA only: the variables name the proxy's Service, and no relay runs. The
port is bound here, before the relay starts, and handed to it: the kernel's next call
finds it served. A relay already serving the port (a gateway connecting again) is kept.
The relay runs in a session of its own, so an interrupt of the kernel does not reach it;
the pod's init reaps it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

# The session's CA, for destinations the proxy reads (it adds secrets to their requests,
# or checks their paths), joins the image's trust in a bundle of the kernel's own.
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUNDLE_DIR = "/tmp/.mcp-forge-egress"
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")


def trust(ca: str) -> dict[str, str]:
    """Write the bundle (the image's CAs and the session's) and name it for OpenSSL,
    requests, curl, pip and Node."""
    os.makedirs(BUNDLE_DIR, mode=0o700, exist_ok=True)
    try:
        with open(SYSTEM_BUNDLE, encoding="ascii", errors="replace") as f:
            system = f.read()
    except OSError:
        system = ""
    bundle = os.path.join(BUNDLE_DIR, "ca-bundle.pem")
    own = os.path.join(BUNDLE_DIR, "session-ca.pem")
    for name, text in ((bundle, system.rstrip("\n") + "\n" + ca), (own, ca)):
        with open(name + ".tmp", "w", encoding="ascii") as f:
            f.write(text)
        os.replace(name + ".tmp", name)
    return {**dict.fromkeys(CA_VARIABLES, bundle), "NODE_EXTRA_CA_CERTS": own}


def start(
    env: dict[str, str], port: int | None, path: str | None, relay: str | None, ca: str | None
) -> None:
    os.environ.update(env)
    if ca:
        os.environ.update(trust(ca))
    if port is None or path is None or relay is None:  # a cluster's proxy: no relay
        return
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", port))
    except OSError:  # served already (or taken by the kernel's own code: its loss)
        listener.close()
        return
    listener.listen(64)
    fd = listener.fileno()
    subprocess.Popen(
        [sys.executable, "-P", "-c", relay, f"fd:{fd}", path],
        pass_fds=(fd,),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    listener.close()


_given: dict[str, Any] = globals()
if "ENV" in _given:
    _relay = (_given.get("PORT"), _given.get("SOCKET"), _given.get("RELAY"))
    start(_given["ENV"], *_relay, _given.get("CA"))
