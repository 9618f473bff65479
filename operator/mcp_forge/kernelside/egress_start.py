"""Starts the kernel pod's egress relay (egress_relay.py), once, and gives the kernel its
proxy settings.

Run silently by the gateway in globals of its own holding ENV (the proxy variables),
PORT, SOCKET (the egress socket as the pod sees it) and RELAY (the relay's source). The
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


def start(env: dict[str, str], port: int, path: str, relay: str) -> None:
    os.environ.update(env)
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
    start(_given["ENV"], _given["PORT"], _given["SOCKET"], _given["RELAY"])
