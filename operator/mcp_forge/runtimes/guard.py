"""The output guard's program (kernelside/guard.py), as a kernel is given it.

Local mode gives it to each new kernel before the kernel is Ready (a pool's too), with
the settings of the process that starts it; the gateway's first connection to a kernel
then only asks, in the silent probe that tells it the kernel is idle (gateway/busy.py),
whether the guard the kernel holds is this gateway's and no user cell has run since. If
so it is kept; if not (a cluster pod, whose operator never speaks to its kernel; a
gateway with other limits; a kernel that has run code since), it is installed again.
The program is about 20 KB: the kernel compiles it in about 15 ms, which was a
quarter of a warm session's first call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mcp_forge.jupyter.execution import (
    EVALUE_MAX,
    GUARD_KEY,
    NOTEBOOK_JOURNAL,
    OUTPUT_DIR,
    TRACEBACK_MAX,
)
from mcp_forge.kernelside import compiled, run_silently
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings
from mcp_forge.wheels import fetch

# Where a kernel keeps the fingerprint of the guard it was given: an attribute of its
# kernel object (the user's namespace holds no name of ours).
MARK = "_mcp_forge_guard"

# The user expression the idle probe carries: the guard's fingerprint while no user cell
# has run (IPython numbers the next cell 1 until one has), else None. Evaluated in the
# user's namespace: code that rebinds get_ipython only makes the guard be installed again.
STATE = (
    f"getattr(get_ipython().kernel, {MARK!r}, None) if get_ipython().execution_count == 1 else None"
)


@dataclass(frozen=True)
class GuardProgram:
    code: str  # silent code: installs the guard, then marks the kernel with `fingerprint`
    fingerprint: str

    def held(self, expressions: dict[str, Any]) -> bool:
        """Does a kernel whose idle probe answered `expressions` (its `guard` user
        expression, STATE) hold this program, with no user cell run since?"""
        state = expressions.get("guard")
        if not isinstance(state, dict) or state.get("status") != "ok":
            return False
        return (state.get("data") or {}).get("text/plain") == repr(self.fingerprint)


def guard_program(settings: Settings) -> GuardProgram:
    """The silent code that installs the kernel-side output guard with these settings'
    limits, puts the session's installed packages on sys.path, and marks the kernel with
    the program's fingerprint; like the helpers, it leaves no name in the user's
    namespace."""
    limits = {
        "text": settings.output_budget,
        "data": settings.data_budget,
        "spool": min(settings.output_spool_max, settings.file_max),  # read_file can open it
        "evalue": EVALUE_MAX,
        "traceback": TRACEBACK_MAX,
        "spill_dir": f"{WORKSPACE}/{OUTPUT_DIR}",
        "report_key": GUARD_KEY,
        "journal": f"{WORKSPACE}/{NOTEBOOK_JOURNAL}",
        "journal_max": settings.notebook_max,
        "journal_record_max": settings.file_max,  # a larger cell fits no notebook
    }
    # First, the packages install_packages gave earlier kernels of the session.
    guard = run_silently(compiled("guard"), {"get_ipython": "get_ipython", "LIMITS": repr(limits)})
    program = fetch.path_program() + "\n" + guard
    mark = hashlib.sha256(program.encode()).hexdigest()[:16]
    code = f"{program}\nsetattr(get_ipython().kernel, {MARK!r}, {mark!r})"
    return GuardProgram(code, mark)
