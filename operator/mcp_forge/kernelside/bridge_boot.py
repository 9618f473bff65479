"""Starts code mode's bridge in a kernel, or finds the one already running there.

The gateway runs this module silently (introspection.bridge_program), in a namespace of
its own holding `BRIDGE_ADDRESS` (where to listen: see mcp_channel.listen) and `SOURCES`
(the sources of framing.py, mcp_stubs.py, mcp_channel.py and mcp_tools.py, by module
name). The kernel has no mcp_forge package, so this module makes them itself: each of
MODULES in turn as a module object that holds the ones made before it, by name, then
mcp_tools' code in a namespace that holds them all (these modules import each other only
when they are imported as part of mcp_forge). It registers the module the user imports,
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

# mcp_tools' modules in the order they are made: each uses only those before it.
MODULES = ("framing", "mcp_stubs", "mcp_channel")


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
    """A new bridge: MODULES in order, then mcp_tools, run from their sources."""
    modules: dict[str, types.ModuleType] = {}
    for name in MODULES:
        module = types.ModuleType(f"mcp_tools.{name}")
        module.__dict__.update(modules)
        exec(compile(sources[name], f"<mcp_tools.{name}>", "exec"), module.__dict__)
        modules[name] = module
    namespace = {
        "__name__": "mcp_tools",
        "__package__": None,
        "__builtins__": builtins,
        **modules,
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
