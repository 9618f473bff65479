"""A parent held by its fork (api/forks.py HOLDS), as a gateway sees it: its calls wait
while the fork copies its workspace, are refused naming the fork past lock_wait, and run
at once when the copy ends; an interrupt is never held. The operator sets and clears
holds on a cluster (tests/kube/test_forks.py runs it all there); here the hold is written
into a local store's status, and the fork is a real session of its own uid."""

from __future__ import annotations

import dataclasses
import time

import pytest

from mcp_forge.api import forks
from mcp_forge.errors import SessionNotReady
from mcp_forge.gateway.core import Gateway

pytestmark = pytest.mark.podman


async def test_a_held_parent_waits_for_its_forks_copy_and_an_interrupt_does_not(
    runtime, settings, make_session
) -> None:
    parent, fork = await make_session(), await make_session()
    gateway = Gateway(runtime, dataclasses.replace(settings, lock_wait=1.0))
    try:
        assert (await gateway.execute(parent, "x = 1")).status == "ok"
        uid = (await runtime.get(fork)).uid
        held = forks.hold({}, fork, uid, time.time())
        runtime.store.patch_status("default", parent, {forks.HOLDS: held})
        with pytest.raises(SessionNotReady, match=f"being forked.*{fork}"):
            await gateway.execute(parent, "x = 2")
        assert await gateway.interrupt(parent)
        # A hold of another uid (a fork of that name deleted and made again) holds nothing.
        stale = forks.hold({}, fork, "another-uid", time.time())
        runtime.store.patch_status("default", parent, {forks.HOLDS: stale})
        r = await gateway.execute(parent, "x")
        assert r.result is not None and r.result["data"]["text/plain"] == "1", r
        runtime.store.patch_status("default", parent, {forks.HOLDS: held})
        copied = {"outcome": "Restoring", "workspace": {"outcome": "Copied"}}
        runtime.store.patch_status("default", fork, {"fork": copied})
        r = await gateway.execute(parent, "x + 1")  # the copy ended: at once
        assert r.result is not None and r.result["data"]["text/plain"] == "2", r
    finally:
        await gateway.close()
