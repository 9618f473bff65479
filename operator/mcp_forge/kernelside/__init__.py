"""Code that runs inside the kernel's container, sent as its source.

Each module here is a real module (linted, typed, tested), whose source is read with
importlib.resources: the gateway runs the helpers, the guard and code mode's modules
silently in the kernel, each in a namespace of its own, its settings reaching it as
globals of that namespace; the renderer puts probe.py into a cluster pod's startupProbe.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources


def source(module: str) -> str:
    """The source of one kernel-side module, as the gateway sends it."""
    return resources.files(__name__).joinpath(f"{module}.py").read_text()


def compiled(module: str, filename: str | None = None) -> str:
    """An expression that compiles one kernel-side module's source in the kernel."""
    return f"compile({source(module)!r}, {filename or f'<mcp-forge-{module}>'!r}, 'exec')"


def run_silently(code: str, names: Mapping[str, str]) -> str:
    """Code that runs `code` (an expression giving a code object, or a source string's
    literal) in globals of its own: `__builtins__` and `names`, each name given as a
    Python expression evaluated as the runner starts (a literal made by repr, which
    round-trips what it holds; or a name of the user's namespace, such as get_ipython).
    Nothing is left in the user's namespace. The one runner of kernel-side programs."""
    given = "".join(f", {name!r}: {expr}" for name, expr in names.items())
    return f"exec({code}, {{'__builtins__': __builtins__{given}}})"
