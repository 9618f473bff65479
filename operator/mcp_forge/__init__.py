"""MCP-Forge: safe, stateful Python sessions for AI agents.

One ipykernel per KernelSession, each in its own isolated pod, driven over the
Jupyter messaging protocol by a gateway that holds the jupyter-client connections.
"""

__version__ = "0.1.0"
