"""The kernel's launcher on a cluster: its connection file comes in the environment.

A cluster's kernel pod has no Secret volume: every volume costs a cold start 300 ms in
the kubelet (its volume manager polls mounts at that interval before it starts a pod's
containers), and a pod of an ephemeral session has no volume at all. The kubelet puts
the session Secret's `connection.json` in ENV (a secretKeyRef: the pod object holds the
reference, never the value); this program takes it out of the environment (so `%env`
and subprocesses never see it), writes it to FILE, readable by the kernel's uid only,
and starts ipykernel on it, as sandbox.KERNEL_LAUNCH does with a mounted file. The
startup probe (probe.py) reads the same variable, which the kubelet gives every exec.

Run as `python -P -c <source>`: the standard library and ipykernel only.
"""

from __future__ import annotations

import os
import sys

ENV = "MCPFORGE_CONNECTION"
FILE = "/tmp/.mcp-forge/connection.json"  # a pod's own /tmp, made at its start
# Egress (control/render_egress.py): the session's CA certificate, when the proxy reads
# some of its requests, joins the image's CAs in a bundle the pod's environment names.
EGRESS_CA_ENV = "MCPFORGE_EGRESS_CA"
EGRESS_TOKEN_ENV = "MCPFORGE_EGRESS_TOKEN"  # already in HTTP(S)_PROXY, where tools read it
EGRESS_BUNDLE = "/tmp/.mcp-forge-egress/ca-bundle.pem"
EGRESS_CA_FILE = "/tmp/.mcp-forge-egress/session-ca.pem"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def write_connection(text: str, path: str = FILE, mode: int = 0o400) -> None:
    """Write `text` to a new file at `path`, mode 0400, in a directory of mode 0700.

    Never over something already there (O_EXCL, no link followed): the pod's /tmp is new,
    so anything at `path` was planted, and the kernel does not start on it.
    """
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def write_trust(ca: str) -> None:
    """The egress bundle: the image's CAs and the session's, and the session's alone
    (for Node's NODE_EXTRA_CA_CERTS)."""
    import ssl

    system = ""
    for path in (SYSTEM_BUNDLE, ssl.get_default_verify_paths().openssl_cafile):
        try:  # Debian's bundle, else where this image's OpenSSL keeps its own
            with open(path, encoding="ascii", errors="replace") as f:
                system = f.read()
            break
        except OSError:
            continue
    write_connection(system.rstrip("\n") + "\n" + ca, EGRESS_BUNDLE, 0o444)
    write_connection(ca, EGRESS_CA_FILE, 0o444)


def main() -> None:
    text = os.environ.pop(ENV, None)
    if not text:
        sys.exit(f"mcp-forge: {ENV} is not set: the pod has no connection file to start on")
    write_connection(text)
    os.environ.pop(EGRESS_TOKEN_ENV, None)
    ca = os.environ.pop(EGRESS_CA_ENV, None)
    if ca:
        write_trust(ca)
    from ipykernel.kernelapp import IPKernelApp

    # As sandbox.KERNEL_LAUNCH: every port is fixed and the file is the Secret's, so
    # ipykernel never rewrites it (7.4 does whenever it holds Curve keys).
    IPKernelApp.write_connection_file = lambda self, **kw: None  # type: ignore[method-assign]
    # IPython's history in memory, not in an SQLite file: its directory is one the kernel
    # cannot write, so the file would be a temporary one in this pod's /tmp, gone with
    # the pod, and a kernel woken from a checkpoint in a new pod could not open it again.
    IPKernelApp.launch_instance(argv=["-f", FILE, "--HistoryManager.hist_file=:memory:"])


if __name__ == "__main__":
    main()
