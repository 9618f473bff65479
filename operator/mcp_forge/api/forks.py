"""A fork: new sessions made from a live session's snapshot, each answering with its
parent's variables (issue 27). Pure: the new sessions' bodies, their names, and the
silent program that makes a restored kernel the new session's.

A fork's spec is its parent's, but for what is the new session's own: it claims no pool
kernel (it has one), it runs (operatingMode Running), its workspace goes with it
(reclaimPolicy Delete), and its env is the one asked for the fork, or else the parent's
spec's (Secrets are read anew for the fork). Its metadata names the parent
(FORKED_FROM) and keeps the user's labels, not ours; annotations are the caller's.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from mcp_forge.api import kernelsession
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.kernelsessionpool import CLAIM_MARK
from mcp_forge.api.status import parse_time, stamp
from mcp_forge.errors import InvalidRequest
from mcp_forge.kernelside import compiled, run_silently

FORKED_FROM = "mcpforge.dev/forked-from"  # annotation: the parent's name
# Annotation: forks of one batch (made together) wake from one checkpoint of their parent,
# on a cluster (control/forking.py).
FORK_BATCH = "mcpforge.dev/fork-batch"
FORK_MAX = 10  # new sessions of one fork
# Status of a parent on a cluster: the forks whose persistent workspace is being copied
# from its own, by name, each {uid, since, until}. Its calls wait until the copies end, so
# that each fork's files are those of the memory it wakes with (control/forking.py sets
# them, control/forkfiles.py clears them; a gateway waits while one is `holding`).
HOLDS = "forkHolds"
HOLD_FOR = 1800  # seconds: a hold an operator never cleared lasts no longer
HOLD_SETTLE = 3.0  # seconds a hold stands before the checkpoint (see forking._checkpoint)
# A fork in one of these phases copies nothing more: it holds no parent. Not Suspended:
# a copy under way runs on while its fork is suspended, and its end is recorded once the
# fork runs again (the hold lapses meanwhile, HOLD_FOR, at the latest).
NOT_COPYING = ("Failed", "Terminating", "Expired")
HOLDS_MAX = 64  # holds a parent keeps: past that, the oldest are let go


def check_count(count: Any) -> int:
    """The number of forks asked for, 1 to FORK_MAX (InvalidRequest naming it else)."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= FORK_MAX:
        raise InvalidRequest(f"count must be a whole number from 1 to {FORK_MAX}, got {count!r}")
    return count


def names(parent: str, count: int) -> list[str]:
    """Names for `count` forks of `parent`: its name (cut to fit) and a random tag."""
    stem = parent[: kernelsession.NAME_MAX - 12].rstrip("-")
    return [f"{stem}-fork-{secrets.token_hex(3)}" for _ in range(count)]


def body(
    parent: KernelSession,
    name: str,
    *,
    annotations: Mapping[str, str],
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The validated KernelSession of one fork of `parent` (see the module's text)."""
    spec = copy.deepcopy(parent.body["spec"])
    spec.pop("poolRef", None)
    spec["operatingMode"] = "Running"
    # The copy's workspace is its own: never kept after it (a Retain'd one would wait
    # under a name no later session takes).
    spec.setdefault("workspace", {})["reclaimPolicy"] = "Delete"
    if env is not None:
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    meta = parent.body["metadata"]
    return kernelsession.validate(
        {
            "apiVersion": kernelsession.API_VERSION,
            "kind": kernelsession.KIND,
            "metadata": {
                "name": name,
                "namespace": parent.namespace,
                # The user's labels; ours (a pool's kernel, say) say what the copy is not.
                "labels": {
                    k: v
                    for k, v in (meta.get("labels") or {}).items()
                    if not k.startswith(f"{kernelsession.GROUP}/")
                },
                "annotations": {**annotations, FORKED_FROM: parent.name},
            },
            "spec": spec,
        }
    )


def program(key: str, parent: KernelSession, env: Mapping[str, str]) -> str:
    """Silent code making a kernel restored from `parent`'s snapshot the fork's: the
    parent's session variables (and claim mark) out of its environment, `env` (the
    fork's, Secrets' values included) in, and `key` its signing key (kernelside/fork.py)."""
    drop: Sequence[str] = sorted({v.name for v in parent.spec.env} | {CLAIM_MARK})
    return becoming(key, drop, env)


def becoming(
    key: str, drop: Sequence[str], env: Mapping[str, str], *, was: tuple[str, str] | None = None
) -> str:
    """`program`, given the names to take out of the environment; with `was` (a variable
    and its value), it refuses, with an error and changing nothing, a kernel whose
    environment does not say so: not the parent's woken copy (a cluster's fork whose pod
    started a new kernel instead). Values are literals made by repr, which round-trips
    every str exactly."""
    given = {"KEY": repr(key), "DROP": repr(list(drop)), "ENV": repr(dict(env)), "WAS": repr(was)}
    return run_silently(compiled("fork"), {"get_ipython": "get_ipython", **given})


def hold(status: Mapping[str, Any], fork: str, uid: str, now: float) -> dict[str, Any]:
    """The merge patch of a parent's status that holds it for `fork` (its uid): holds past
    their time dropped, and the oldest past HOLDS_MAX."""
    kept = live_holds(status, now)
    patch: dict[str, Any] = {k: None for k in _holds(status) if k not in kept}
    oldest_first = sorted(kept, key=lambda k: str(kept[k]["until"]))
    for name in oldest_first[: max(0, len(kept) - HOLDS_MAX + 1)]:
        patch[name] = None
    patch[fork] = {"uid": uid, "since": stamp(now), "until": stamp(now + HOLD_FOR)}
    return patch


def live_holds(status: Mapping[str, Any], now: float) -> dict[str, dict[str, Any]]:
    """The holds of a parent's status not past their time, by fork name."""
    out = {}
    for name, entry in _holds(status).items():
        until = parse_time(entry.get("until")) if isinstance(entry, dict) else None
        if isinstance(name, str) and until is not None and until > now:
            out[name] = dict(entry)
    return out


def _holds(status: Mapping[str, Any]) -> dict[Any, Any]:
    found = status.get(HOLDS)
    return found if isinstance(found, dict) else {}


def holding(fork: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether a fork (its body as read, or None if gone) still holds its parent: the
    one of that uid, its memory being forked (or its checkpoint under way: the hold
    comes first), its workspace copy not ended, and not stopped meanwhile."""
    if not fork or (fork.get("metadata") or {}).get("uid") != uid:
        return False
    if (fork.get("status") or {}).get("phase") in NOT_COPYING:
        return False
    said = (fork.get("status") or {}).get("fork") or {}
    if not said:
        return True
    copied = said.get("workspace") or {}
    return said.get("outcome") == "Restoring" and (not copied or bool(copied.get("stopping")))
