"""A long-running process's heap: what its start made is frozen out of the collector's way.

CPython's cyclic collector walks every object of the generations it collects, and a full
collection walks them all, holding the GIL: on the gateway's event loop, or in the
operator's reconciles, a pause that long. Both processes import large libraries (the
Kubernetes client's model classes, kopf, the MCP SDK, pydantic, jupyter-client) whose
objects live as long as the process and are never garbage. Once a process has started,
`settle` collects once (unless told not to) and moves every object there is into the
permanent generation (`gc.freeze`): later collections walk only what was made since.
Measured: the gateway's full collections under issue 23's drill took 82-99 ms before,
4-14 ms after; the test cluster's operator's 55-66 ms before, 4 ms after
(docs/performance.md). The egress proxy's (mitmproxy and our addon) took 47-56 ms, on
the loop that relays every session's connections.

The collector never walks frozen objects, not even when the interpreter ends (they are
still freed when nothing refers to them); `thaw` (or the end of a `settled` block) gives
them back as the process ends, however it ends short of os._exit, so that what only the
collector would close (a database connection in a cycle) is closed as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def settled(*, collect: bool = True) -> Iterator[None]:
    """`settle` now, `thaw` when the block ends, by an error too."""
    settle(collect=collect)
    try:
        yield
    finally:
        thaw()


def settle(*, collect: bool = True) -> int:
    """Collect once (unless not `collect`: a start someone waits for, whose little
    garbage may as well stay) and freeze what is left; how many objects were frozen."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (at the process's end)."""
    gc.unfreeze()
