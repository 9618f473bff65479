"""Code that runs inside the kernel, sent by the gateway.

Each module here is a real module (linted, typed, tested), whose source the gateway
reads with importlib.resources and runs silently in the kernel in a namespace of its
own; its settings reach it as globals of that namespace.
"""

from __future__ import annotations

from importlib import resources


def source(module: str) -> str:
    """The source of one kernel-side module, as the gateway sends it."""
    return resources.files(__name__).joinpath(f"{module}.py").read_text()
