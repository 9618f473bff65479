"""A fork on a cluster, as a gateway makes it (issue 27): new KernelSessions naming their
parent (api/forks.py FORKED_FROM), which the operator starts from checkpoints of the
parent's running kernel (control/forking.py), each under a key of its own.

The copies are made at once, as one batch (FORK_BATCH: the operator checkpoints their
parent once for all of them), and waited for until each is Ready, or Failed. As on a
local gateway, a parent whose kernel could not be checkpointed gives no copy: the copies
made to find out are deleted, and the error says why. A copy whose restore failed is
Ready on a new kernel that says its variables were lost (`lastRestore`), and is returned
as it is.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import secrets
from typing import TYPE_CHECKING, Any

from mcp_forge.api import status as st
from mcp_forge.api.forks import FORK_BATCH
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import ApiError, ForgeError, InvalidSession, SessionNotReady

if TYPE_CHECKING:
    from mcp_forge.runtimes.cluster import KubernetesRuntime

log = logging.getLogger(__name__)

KIND = "KernelSession"


async def fork(
    runtime: KubernetesRuntime, name: str, namespace: str, bodies: list[dict[str, Any]]
) -> list[KernelSession]:
    """Make a session of each body (api/forks.body: validated, new names) from the Ready
    session `name`'s memory; the new sessions as they ended (see the module's text)."""
    parent = await runtime.get(name, namespace)
    phase = parent.status.get("phase")
    if phase != st.READY:
        raise SessionNotReady(f"session {name!r} is {phase}: only a Ready one forks")
    batch = secrets.token_hex(8)  # the copies wake from one checkpoint of their parent
    for body in bodies:
        body["metadata"].setdefault("annotations", {})[FORK_BATCH] = batch
    made: list[dict[str, Any]] = []
    asking: dict[str, Any] | None = None  # the copy whose create is under way
    try:
        for asking in bodies:
            made.append(await runtime.make(asking))
        asking = None
        waits = [asyncio.ensure_future(_ended(runtime, m)) for m in made]
        try:
            ended = await asyncio.gather(*waits)
        finally:
            for wait in waits:  # one failed: the others are not waited for
                wait.cancel()
    except BaseException as exc:
        # A create refused (its name taken, say) made nothing; one cut short may have.
        lost = [asking] if asking is not None and not isinstance(exc, InvalidSession) else []
        await asyncio.shield(_unmake(runtime, made, lost))
        raise
    refused = [s for s in ended if unforked(s)]
    if refused:
        await asyncio.shield(_unmake(runtime, made, []))
        why = (refused[0].status.get("fork") or {}).get("message") or (
            "the operator did not fork it (one that predates forks?)"
        )
        raise ForgeError(f"session {name!r} cannot be forked: {why}")
    return list(ended)


def unforked(session: KernelSession) -> bool:
    """Whether the operator made no checkpoint for the copy (its parent could not be
    checkpointed): Failed before any restore was tried, or not a fork at all."""
    fork = session.status.get("fork") or {}
    if not fork:  # Ready, and no fork said: an operator that does not know them
        return True
    return fork.get("outcome") == "Failed" and not session.status.get("lastRestore")


async def _ended(runtime: KubernetesRuntime, made: dict[str, Any]) -> KernelSession:
    meta = made["metadata"]
    try:
        return await runtime.wait_ready(meta["namespace"], meta["name"], uid=meta["uid"], made=made)
    except SessionNotReady:
        now = await runtime.get(meta["name"], meta["namespace"])
        if now.status.get("phase") == st.FAILED:
            return now  # as it ended: the caller deletes it
        raise


async def _unmake(
    runtime: KubernetesRuntime,
    made: builtins.list[dict[str, Any]],
    lost: builtins.list[dict[str, Any]],
) -> None:
    """The copies made gone (by their uids), and those whose create's answer was lost (by
    their names: new, random ones, asked for by this fork)."""
    doomed = [(m["metadata"], m["metadata"]["uid"]) for m in made]
    doomed += [(b["metadata"], "") for b in lost]
    for meta, uid in doomed:
        try:
            await asyncio.to_thread(
                runtime.kube.delete, KIND, meta["namespace"], meta["name"], uid=uid
            )
        except ApiError as exc:
            log.warning("could not remove the copy %s: %s", meta["name"], exc)
