"""The fault drills (tests/drills/faults.py) in their short form: three gateway SIGKILLs,
then the kernel's container, the pod's infra container and conmon killed mid-call."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "drills"))
import faults

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
