"""What `heap.settle` does to the collector (mcp_forge/heap.py): objects alive when a
process settles are no longer collected, even once they are garbage in a cycle, until
`thaw` gives them back. The gateway's and the operator's pauses: docs/performance.md."""

from __future__ import annotations

import gc
import weakref

import pytest

from mcp_forge import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settled_objects_are_out_of_the_collectors_way_until_thawed() -> None:
    held = [Node(), Node()]
    held[0].other, held[1].other = held[1], held[0]
    alive = weakref.ref(held[0])
    try:
        assert heap.settle() >= 2  # our two nodes among everything the process has
        assert gc.get_freeze_count() > 0
        del held  # garbage now, in a cycle: only the collector could free it
        gc.collect()
        assert alive() is not None, "a frozen cycle was collected"
        made_since = cycle()  # made after settling: collected as ever
        gc.collect()
        assert made_since() is None
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None, "a thawed cycle was not collected"


def test_a_settled_block_thaws_when_it_raises() -> None:
    """The gateway's and the operator's ends by an error (a port in use, a cleanup that
    fails) give the heap back too."""
    frozen: list[int] = []

    def serve() -> None:
        with heap.settled(collect=False):
            frozen.append(gc.get_freeze_count())
            raise RuntimeError("a port in use")

    with pytest.raises(RuntimeError):
        serve()
    assert frozen[0] > 0
    assert gc.get_freeze_count() == 0
