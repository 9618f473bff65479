"""Limits every gateway replica shares: a client's session quota, a session's call rate. Pure.

Both are kept where every replica (and a restarted one) reads and writes them, under
optimistic concurrency: on a cluster, annotations of a Lease written with a
resourceVersion precondition; locally, the store, in one transaction. These functions
are the decision, given what was read; the runtimes do the reading and the writing.

A client's quota: its sessions (listed) and its reservations, sessions being created
that may not be listed yet. A create reserves its name first, atomically with the
count, so that creates racing on two replicas cannot both take the last place; it
releases the reservation once its session exists (or failed). A reservation left by a
gateway that died meanwhile lapses after RESERVATION_TTL.

A session's call rate: calls a minute to each upstream server, counted in buckets of
RATE_BUCKET seconds (at most 60 / RATE_BUCKET + 1 of them a server: the size is bounded
whatever the limit); a call is refused while the buckets of the last minute hold the
limit. A bucket lapses whole, so a call counts for 60 to 65 seconds: never less strict
than a minute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcp_forge.errors import InvalidRequest

RESERVATION_TTL = 300.0  # a reservation not released by then was left by a dead gateway
RATE_BUCKET = 5.0
RATE_WINDOW = 60.0
VALUE_MAX = 64_000  # bytes of a stored value read back; more is garbage, read as none


@dataclass(frozen=True)
class Seat:
    """A seat asked for under a client's session quota: the session `name` of `owner` in
    `namespace`, within `limit`; `owns` tells the owner's sessions (bodies, as stored)
    from others."""

    namespace: str
    owner: str
    name: str
    limit: int
    owns: Callable[[dict[str, Any]], bool]


def reserve(
    reservations: dict[str, float],
    owned: set[str],
    name: str,
    *,
    limit: int,
    now: float,
) -> dict[str, float]:
    """The reservations once `name` is reserved; InvalidRequest if the client already
    holds `limit` sessions (`owned`, listed) and reservations. Lapsed reservations and
    those whose session exists are dropped (so the map holds at most `limit` names)."""
    live = {
        n: t for n, t in reservations.items() if n not in owned and 0 <= now - t < RESERVATION_TTL
    }
    held = owned | set(live)
    if name not in held and len(held) >= limit:
        raise InvalidRequest(
            f"you have {len(held)} sessions, the most a client may have; "
            "close one (close_session) first"
        )
    return {**live, name: now}


def release(reservations: dict[str, float], name: str) -> dict[str, float]:
    return {n: t for n, t in reservations.items() if n != name}


def count_call(
    rates: dict[str, list[list[int]]], server: str, limit: int, *, now: float
) -> dict[str, list[list[int]]] | None:
    """The rates with one more call to `server` counted; None if the last minute holds
    `limit` calls already. `rates` is server -> [[bucket, calls], ...]."""
    current = math.floor(now / RATE_BUCKET)
    first = current - math.ceil(RATE_WINDOW / RATE_BUCKET)  # lapses once all of it is older
    kept = [[b, c] for b, c in rates.get(server, []) if first <= b <= current]
    if sum(c for _, c in kept) >= limit:
        return None
    if kept and kept[-1][0] == current:
        kept[-1][1] += 1
    else:
        kept.append([current, 1])
    return {**rates, server: kept}


def rate_refusal(server: str, limit: int) -> str:
    return f"the rate limit of {limit} calls a minute to {server} is reached"


def load_reservations(raw: Any) -> dict[str, float]:
    """Reservations as stored (JSON text); what is not one is none."""
    value = _json(raw)
    if not isinstance(value, dict):
        return {}
    return {
        str(n): float(t)
        for n, t in value.items()
        if isinstance(t, int | float) and not isinstance(t, bool)
    }


def load_rates(raw: Any) -> dict[str, list[list[int]]]:
    """Call rates as stored (JSON text, or already parsed); what is not one is none."""
    value = _json(raw) if isinstance(raw, str) else raw
    if not isinstance(value, dict):
        return {}
    out: dict[str, list[list[int]]] = {}
    for server, buckets in value.items():
        if isinstance(buckets, list):
            out[str(server)] = [
                [b[0], b[1]]
                for b in buckets
                if isinstance(b, list)
                and len(b) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in b)
            ]
    return out


def _json(raw: Any) -> Any:
    if not isinstance(raw, str) or len(raw) > VALUE_MAX:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
