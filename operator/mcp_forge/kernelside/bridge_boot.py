"""Starts code mode's bridge in a kernel, or finds the one already running there.

The gateway runs this module silently (introspection.bridge_program), in a namespace of
its own holding `BRIDGE_ADDRESS` (where to listen: see mcp_tools.listen) and `SOURCES`
(the source of framing.py and of mcp_tools.py, by module name). The kernel has no
mcp_forge package, so this module makes the two itself: framing as a module object,
then mcp_tools' code in a namespace that holds it (mcp_tools imports framing only when
it is imported as part of mcp_forge). It registers the module the user imports,
`mcp_tools`, in `sys.modules`, and starts the listener the gateway dials.

Run again (a gateway that connects again) it finds the running bridge, through
`sys.modules`, or through its listener thread if user code dropped it from there, and
changes nothing; after a kernel restart it starts afresh.
"""

from __future__ import annotations

import builtins
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any


def find() -> Any:
    """The bridge running in this process, or None."""
    bridge = getattr(sys.modules.get("mcp_tools"), "__mcp_forge_bridge__", None)
    if bridge is None:
        for thread in threading.enumerate():
            bridge = getattr(thread, "mcp_forge_bridge", None)
            if bridge is not None:
                break
    return bridge


def build(sources: Mapping[str, str]) -> Any:
    """A new bridge: framing, then mcp_tools, run from their sources."""
    framing = types.ModuleType("mcp_tools.framing")
    exec(compile(sources["framing"], "<mcp_tools.framing>", "exec"), framing.__dict__)
    namespace = {
        "__name__": "mcp_tools",
        "__package__": None,
        "__builtins__": builtins,
        "framing": framing,
    }
    exec(compile(sources["mcp_tools"], "<mcp_tools>", "exec"), namespace)
    return namespace["BRIDGE"]


def start(address: Any, sources: Mapping[str, str]) -> None:
    """Listen at `address` (unless the running bridge already does); `import mcp_tools`."""
    bridge = find()
    if bridge is None:
        bridge = build(sources)
    bridge.start(address)
    sys.modules["mcp_tools"] = bridge.module


if "BRIDGE_ADDRESS" in globals() and "SOURCES" in globals():
    start(globals()["BRIDGE_ADDRESS"], globals()["SOURCES"])
