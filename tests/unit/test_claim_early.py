"""When a fresh session's claim is made beside its children (control/realize.py
`early_claim`), and which kernel a session with no status yet is taken to have claimed
(`adopted`). On the cluster: tests/kube/test_claims.py."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api.status import parse_time
from mcp_forge.control.poolplan import LABEL_CLAIMED_FROM
from mcp_forge.control.realize import adopted, early_claim

CREATED = "2026-12-05T10:00:00Z"
T0 = parse_time(CREATED) or 0.0


def session(**spec: Any) -> kernelsession.KernelSession:
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s", "namespace": "ns", "creationTimestamp": CREATED},
        "spec": {"image": "img", "poolRef": {"name": "warm"}, **spec},
    }
    return kernelsession.load(kernelsession.validate(body, default_namespace="ns"))


@pytest.mark.parametrize(
    ("spec", "later", "beside"),
    [
        ({}, 1.0, True),
        ({"operatingMode": "Suspended"}, 1.0, False),
        ({"network": {"allow": [{"host": "pypi.org"}]}}, 1.0, False),
        ({"maxLifetime": "1h"}, 60.0, True),
        ({"maxLifetime": "1h"}, 3600.0, False),  # made while no operator ran: it expires
        ({"idleTimeout": "10m"}, 599.0, True),
        ({"idleTimeout": "10m"}, 600.0, False),  # idle already: it stops, takes nothing
    ],
)
def test_a_claim_is_made_beside_only_for_a_session_that_will_run_and_needs_no_grant(
    spec: dict[str, Any], later: float, beside: bool
) -> None:
    assert early_claim(session(**spec), T0 + later) is beside


def test_no_pool_no_claim() -> None:
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s", "namespace": "ns", "creationTimestamp": CREATED},
        "spec": {"image": "img"},
    }
    cold = kernelsession.load(kernelsession.validate(body, default_namespace="ns"))
    assert early_claim(cold, T0 + 1) is False


def pod(labels: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "ksp-warm-1", "labels": labels, **meta}}


def test_a_claimed_kernel_is_adopted_as_a_claim_and_an_own_or_deleted_one_is_not() -> None:
    claim = adopted(pod({LABEL_CLAIMED_FROM: "warm"}))
    assert claim is not None and claim.reason == ksp.CLAIMED
    assert claim.message == "claimed kernel ksp-warm-1 of pool warm"
    assert adopted(pod({})) is None, "its own pod (ks-<name>): no claim"
    undone = pod({LABEL_CLAIMED_FROM: "warm"}, deletionTimestamp=CREATED)
    assert adopted(undone) is None, "a claim undone (its grant failed) is not said as one"
