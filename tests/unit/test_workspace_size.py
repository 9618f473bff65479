"""A persistent workspace's size (control/workspace.py): what a claim as the API server
returns it needs for spec.workspace.size, and what the session's status says."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.control import workspace as ws


def claim(asked: str | None, held: str | None = None, *steps: str) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "ks-a-workspace"}, "spec": {}}
    if asked is not None:
        body["spec"]["resources"] = {"requests": {"storage": asked}}
    status: dict[str, Any] = {"conditions": [{"type": s, "status": "True"} for s in steps]}
    if held is not None:
        status["capacity"] = {"storage": held}
    body["status"] = status
    return body


def test_a_claim_of_the_size_asked_shows_nothing_until_a_resize_was_asked() -> None:
    assert ws.sizing(claim("64Mi", "64Mi"), "64Mi", shown=False) == ws.Sizing(None, None)
    # Not bound yet (no capacity): nothing to say either.
    assert ws.sizing(claim("64Mi"), "64Mi", shown=False) == ws.Sizing(None, None)
    # A provisioner that gave more than asked is not a resize.
    assert ws.sizing(claim("64Mi", "1Gi"), "64Mi", shown=False) == ws.Sizing(None, None)


@pytest.mark.parametrize(("want", "asked"), [("128Mi", "64Mi"), ("1Gi", "1000Mi"), ("2G", "1Gi")])
def test_more_than_the_claim_asks_for_grows_it(want: str, asked: str) -> None:
    got = ws.sizing(claim(asked, asked), want, shown=False)
    assert got.grow_to == want
    assert got.condition is not None
    value, reason, message = got.condition
    assert (value, reason) == (False, ws.RESIZING)
    assert asked in message and want in message and "ks-a-workspace" in message


@pytest.mark.parametrize(("want", "asked"), [("32Mi", "64Mi"), ("1G", "1Gi"), ("1023Mi", "1Gi")])
def test_less_than_the_claim_is_never_asked_for_and_says_why(want: str, asked: str) -> None:
    got = ws.sizing(claim(asked, asked), want, shown=True)
    assert got.grow_to is None
    assert got.condition is not None
    value, reason, message = got.condition
    assert (value, reason) == (False, ws.CANNOT_SHRINK)
    assert f"holds {asked}" in message and want in message


def test_the_same_quantity_written_otherwise_is_the_same_size() -> None:
    assert ws.sizing(claim("1Gi", "1Gi"), "1024Mi", shown=False) == ws.Sizing(None, None)
    assert ws.sizing(claim("1073741824", "1Gi"), "1Gi", shown=False) == ws.Sizing(None, None)


def test_a_claim_growing_names_its_own_steps_then_is_sized() -> None:
    got = ws.sizing(claim("128Mi", "64Mi", "FileSystemResizePending"), "128Mi", shown=True)
    assert got.grow_to is None
    assert got.condition == (
        False,
        ws.RESIZING,
        "the workspace claim ks-a-workspace holds 64Mi and grows to 128Mi "
        "(FileSystemResizePending)",
    )
    done = ws.sizing(claim("128Mi", "128Mi"), "128Mi", shown=True)
    assert done.condition == (True, ws.SIZED, "the workspace claim ks-a-workspace holds 128Mi")


@pytest.mark.parametrize("asked", [None, "lots", ""])
def test_a_claim_without_a_readable_request_is_left_alone(asked: str | None) -> None:
    assert ws.sizing(claim(asked, "1Gi"), "2Gi", shown=True) == ws.Sizing(None, None)


def test_a_refusal_carries_the_api_servers_reason() -> None:
    value, reason, message = ws.refused("ks-a-workspace", "2Gi", "forbidden: no resize")
    assert (value, reason) == (False, ws.REFUSED)
    assert message.endswith("could not grow to 2Gi: forbidden: no resize")
