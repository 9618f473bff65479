"""Local pods' user namespaces: each session's range is its own, suspended ones included."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_forge.errors import ForgeError
from mcp_forge.runtimes.local.store import Claimed, Store
from mcp_forge.runtimes.local.userns import SIZE, choose, free_start

BASE = 2147483647


def test_the_lowest_free_range_is_taken_and_no_two_overlap() -> None:
    ranges = [(BASE, 4 * SIZE)]
    assert free_start(ranges, []) == BASE
    assert free_start(ranges, [(BASE, SIZE)]) == BASE + SIZE
    # A gap too small for a range is skipped; one freed by a deleted session is reused.
    assert free_start(ranges, [(BASE, SIZE), (BASE + SIZE + 10, SIZE)]) == BASE + 2 * SIZE + 10
    assert free_start(ranges, [(BASE + SIZE, SIZE)]) == BASE
    # Ranges Podman picked (other sizes, anywhere) are avoided too.
    assert free_start(ranges, [(BASE + 5, 1024)]) == BASE + 5 + 1024


def test_no_free_range_is_a_clear_error() -> None:
    with pytest.raises(ForgeError, match="no 65536 free subordinate ids of 'containers'"):
        free_start([(BASE, 2 * SIZE)], [(BASE, SIZE), (BASE + SIZE, SIZE)])
    with pytest.raises(ForgeError, match="mcp-forge doctor"):
        free_start([], [])


def test_claims_in_the_store_never_share_a_range(tmp_path: Path) -> None:
    """Each session claims in the store's transaction, against every stored session's range
    (a suspended session keeps its range: it keeps its row); a deleted one frees it."""
    ids = tmp_path / "subid"
    ids.write_text(f"containers:{BASE}:{3 * SIZE}\n")
    store = Store(tmp_path / "state.db")
    for name in ("a", "b", "c", "d"):
        store.create({"metadata": {"name": name, "namespace": "default"}}, key="k" * 64)

    def pick(others: list[Claimed]) -> dict[str, int]:
        return choose((o.value for o in others if o.value), subuid=ids, subgid=ids)

    got = [store.claim("default", n, "idmap", pick)["uid"] for n in ("a", "b", "c")]
    assert got == [BASE, BASE + SIZE, BASE + 2 * SIZE]
    with pytest.raises(ForgeError, match="no 65536 free"):
        store.claim("default", "d", "idmap", pick)
    store.delete("default", "b")
    assert store.claim("default", "d", "idmap", pick)["uid"] == BASE + SIZE
    assert store.private("default", "d")["idmap"] == {
        "uid": BASE + SIZE,
        "gid": BASE + SIZE,
        "size": SIZE,
    }
