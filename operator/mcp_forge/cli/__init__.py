"""The `mcp-forge` command line. A thin adapter: it parses, calls the core, and prints.

One module a noun: the group and what its commands share (common.py); KernelSessions,
pools and Secrets as resources: render, apply, get, delete (resources.py); a session's
kernel: exec, interrupt, restart, export (kernels.py); this host: image build, doctor
(host.py); the long-running processes: gateway, operator (serve.py).
"""

from mcp_forge.cli import host, kernels, resources, serve  # noqa: F401  (register the commands)
from mcp_forge.cli.common import main

__all__ = ["main"]
