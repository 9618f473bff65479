"""Code that runs inside the kernel's container, sent as its source.

Each module here is a real module (linted, typed, tested), whose source is read with
importlib.resources: the gateway runs the helpers, the guard and code mode's modules
silently in the kernel, each in a namespace of its own, its settings reaching it as
globals of that namespace; the renderer puts probe.py into a cluster pod's startupProbe.
"""

from __future__ import annotations

from importlib import resources


def source(module: str) -> str:
    """The source of one kernel-side module, as the gateway sends it."""
    return resources.files(__name__).joinpath(f"{module}.py").read_text()
