"""The shared limits' decisions (api/quota.py), given what was read."""

from __future__ import annotations

import pytest

from mcp_forge.api import quota
from mcp_forge.errors import InvalidRequest


def test_a_reservation_counts_with_the_sessions_listed_and_the_last_place_goes_once() -> None:
    held = quota.reserve({}, {"a"}, "b", limit=3, now=100.0)
    held = quota.reserve(held, {"a"}, "c", limit=3, now=101.0)
    assert set(held) == {"b", "c"}
    with pytest.raises(InvalidRequest, match="you have 3 sessions"):
        quota.reserve(held, {"a"}, "d", limit=3, now=102.0)
    # Once "b" exists, its reservation is its session: counted once.
    assert set(quota.reserve(held, {"a", "b"}, "c", limit=3, now=103.0)) == {"c"}


def test_a_released_or_lapsed_reservation_frees_its_place() -> None:
    held = quota.reserve({}, set(), "a", limit=1, now=0.0)
    assert quota.reserve(quota.release(held, "a"), set(), "b", limit=1, now=1.0) == {"b": 1.0}
    later = quota.RESERVATION_TTL + 1
    assert quota.reserve(held, set(), "b", limit=1, now=later) == {"b": later}


def test_the_same_name_reserved_twice_takes_one_place() -> None:
    held = quota.reserve({}, set(), "default-x", limit=1, now=0.0)
    assert set(quota.reserve(held, set(), "default-x", limit=1, now=1.0)) == {"default-x"}


def test_a_rate_refuses_the_call_past_the_limit_within_a_minute_and_not_after() -> None:
    rates: dict[str, list[list[int]]] = {}
    for t in (0.0, 1.0, 30.0):
        counted = quota.count_call(rates, "edge", 3, now=t)
        assert counted is not None
        rates = counted
    assert quota.count_call(rates, "edge", 3, now=59.0) is None
    assert quota.count_call(rates, "other", 3, now=59.0) is not None
    # A bucket lapses whole: the calls of 0-5 s count until 65 s, never less than a minute.
    assert quota.count_call(rates, "edge", 3, now=61.0) is None
    assert quota.count_call(rates, "edge", 3, now=65.0) is not None


def test_rates_stay_bounded_whatever_the_limit() -> None:
    rates: dict[str, list[list[int]]] = {}
    for i in range(10_000):
        counted = quota.count_call(rates, "edge", 1_000_000, now=i * 0.1)
        assert counted is not None
        rates = counted
    assert len(rates["edge"]) <= quota.RATE_WINDOW / quota.RATE_BUCKET + 1


def test_stored_values_that_are_not_ours_read_as_none() -> None:
    assert quota.load_reservations("not json") == {}
    assert quota.load_reservations('{"a": "x", "b": 1}') == {"b": 1.0}
    assert quota.load_rates('{"e": [[1, 2], ["x", 1], [1]]}') == {"e": [[1, 2]]}
    assert quota.load_rates("x" * (quota.VALUE_MAX + 1)) == {}
