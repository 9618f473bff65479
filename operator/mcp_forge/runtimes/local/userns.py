"""User namespaces of local pods: each session gets its own range of host ids.

Podman's `--userns=auto` only avoids the ranges of containers that exist, so a suspended
session (no pod) or one between two pods of a restart could see its range handed to
another session. Local mode therefore picks the ranges itself, from the subordinate ids
of USERNS_USER, avoiding every range a stored session holds, in the store's transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mcp_forge.errors import ForgeError

USERNS_USER = "containers"  # whose subordinate ids (/etc/subuid, /etc/subgid) pods use
SIZE = 65536  # ids per session: every uid an image may hold files as (nobody is 65534)


def subordinate_ranges(path: Path, user: str) -> list[tuple[int, int]]:
    """The (first id, count) ranges `path` (/etc/subuid or /etc/subgid) gives `user`."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.strip().split(":")
        if len(fields) == 3 and fields[0] == user and fields[1].isdigit() and fields[2].isdigit():
            ranges.append((int(fields[1]), int(fields[2])))
    return ranges


def free_start(ranges: Iterable[tuple[int, int]], taken: Iterable[tuple[int, int]]) -> int:
    """The lowest first id of SIZE ids inside one of `ranges` that overlap none of `taken`
    (each a (first id, count)); ForgeError if there is none."""
    busy = sorted(taken)
    for first, count in sorted(ranges):
        start, end = first, first + count
        for t_first, t_count in busy:
            if t_first + t_count <= start or t_first >= start + SIZE:
                continue  # wholly before the candidate, or after it: no overlap
            start = max(start, t_first + t_count)
        if start + SIZE <= end:
            return start
    raise ForgeError(
        f"no {SIZE} free subordinate ids of {USERNS_USER!r} for a new session's user "
        "namespace (see `mcp-forge doctor`; delete sessions, or give it more ids)"
    )


def choose(
    taken: Iterable[dict[str, int]],
    *,
    subuid: Path = Path("/etc/subuid"),
    subgid: Path = Path("/etc/subgid"),
) -> dict[str, int]:
    """A user namespace ({uid, gid, size}) disjoint from every one in `taken`."""
    maps = list(taken)
    uid = free_start(subordinate_ranges(subuid, USERNS_USER), [(m["uid"], m["size"]) for m in maps])
    gid = free_start(subordinate_ranges(subgid, USERNS_USER), [(m["gid"], m["size"]) for m in maps])
    return {"uid": uid, "gid": gid, "size": SIZE}
