"""The fault drills (tests/drills/faults.py) in their short form: three gateway SIGKILLs,
then the kernel's container, the pod's infra container and conmon killed mid-call. And
the noisy-neighbour drill (tests/drills/neighbours.py): one noisy client of each kind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "drills"))
import faults
import neighbours

pytestmark = pytest.mark.podman


@pytest.mark.timeout(900)
async def test_the_fault_drills_pass_in_their_short_form() -> None:
    """Each drill's outcome line is its evidence: sessions, variables, orphans, mounts,
    sockets, and what the call in flight was told."""
    outcomes = await faults.drills(rounds=3, image=faults.MINIMAL_IMAGE)
    assert [o.drill for o in outcomes] == ["gateway", "kernel", "infra", "conmon"]
    failed = [o.line() for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    gateway = outcomes[0].facts
    assert gateway["counter"] == 3 and gateway["orphan_pods"] == []


@pytest.mark.timeout(240)
async def test_a_quiet_client_keeps_its_latency_next_to_noisy_ones_and_nothing_is_left() -> None:
    """The noisy-neighbour drill (tests/drills/neighbours.py) in its short form: one noisy
    client of each kind for 10 s; the quiet client's p99 of list_sessions and of
    execute_code 1+1 stays within 50 ms of idle, and the host keeps nothing of the run."""
    outcomes = await neighbours.drill(clients=4, seconds=10, samples=60)
    print("\n".join(o.line() for o in outcomes))  # the figures, with -s
    failed = [o.line() for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    assert [o.drill for o in outcomes] == [
        "latency list_sessions",
        "latency execute_code 1+1",
        "noise",
        "leftovers",
    ]
