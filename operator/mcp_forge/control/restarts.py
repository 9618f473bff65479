"""When a kernel that keeps dying is started again: one policy for the operator and local mode.

A kernel that dies sooner than QUICK_DEATH after it started is crash-looping (a
sitecustomize that exits, an import that segfaults). It is started again after a
backoff that doubles with each such death in a row, as a kubelet does; the operator
keeps waiting at CRASH_BACKOFF_MAX, local mode (nothing watches its kernels between
calls) gives up there and fails the session with the reason.

Local mode starts a kernel again at once after its first quick death: that death is
most often the code of the call that just ran (an OOM, an os._exit), the call is
answered with it, and the next call must find a kernel. It backs off from the second
quick death in a row, one step behind the operator.
"""

from __future__ import annotations

QUICK_DEATH = 10.0  # a kernel that dies sooner after starting is crash-looping
CRASH_BACKOFF = 5.0  # ... and is started again after this, doubling per death
CRASH_BACKOFF_MAX = 300.0


def crash_backoff(quick_deaths: int) -> float:
    """Seconds to wait before the next start, after `quick_deaths` quick deaths in a row."""
    if quick_deaths <= 0:
        return 0.0
    return min(CRASH_BACKOFF_MAX, CRASH_BACKOFF * 2.0 ** (quick_deaths - 1))


def gives_up(quick_deaths: int) -> bool:
    """True once the backoff would pass CRASH_BACKOFF_MAX."""
    return quick_deaths > 0 and CRASH_BACKOFF * 2.0 ** (quick_deaths - 1) > CRASH_BACKOFF_MAX


def local_backoff(quick_deaths: int) -> float:
    """Local mode's wait before the next start (see the module docstring)."""
    return crash_backoff(quick_deaths - 1)


def local_gives_up(quick_deaths: int) -> bool:
    """Local mode's restart limit: its backoff would pass CRASH_BACKOFF_MAX."""
    return gives_up(quick_deaths - 1)
