"""A persistent workspace's size: what `spec.workspace.size` asks of the session's
PersistentVolumeClaim once it exists, and what the session's status says about it.

A claim can grow (if its StorageClass allows expansion; the API server refuses it
otherwise) and never shrink. The status has a condition `WorkspaceSized` once a size
other than the claim's first was asked for: False while the claim is smaller than asked
(Resizing, ResizeRefused, CannotShrink), True once it holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp_forge.clients.kube import quantity

WORKSPACE_SIZED = "WorkspaceSized"
SIZED, RESIZING, REFUSED, CANNOT_SHRINK = "Sized", "Resizing", "ResizeRefused", "CannotShrink"


@dataclass(frozen=True)
class Sizing:
    """What to do about a claim's size: `grow_to` (a request to write, or None) and the
    condition (value, reason, message) to show, or None to show none."""

    grow_to: str | None
    condition: tuple[bool, str, str] | None


def sizing(claim: dict[str, Any], want: str, *, shown: bool) -> Sizing:
    """What the claim as read needs so that it holds `want` (spec.workspace.size);
    `shown`: the session's status has the condition already."""
    name = claim["metadata"]["name"]
    asked_text = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get(
        "storage"
    )
    asked, wanted = quantity(asked_text), quantity(want)
    if asked is None or wanted is None:
        return Sizing(None, None)  # not a claim of ours as rendered: nothing to compare
    status = claim.get("status") or {}
    held_text = (status.get("capacity") or {}).get("storage")
    held = quantity(held_text)
    if wanted > asked:
        message = f"the workspace claim {name} is asked to grow from {asked_text} to {want}"
        return Sizing(want, (False, RESIZING, message))
    if wanted < asked:
        message = (
            f"the workspace claim {name} holds {asked_text}; a claim cannot be made smaller "
            f"(spec.workspace.size asks for {want}): ask for {asked_text} or more"
        )
        return Sizing(None, (False, CANNOT_SHRINK, message))
    if held is not None and held < asked:
        steps = [
            str(c.get("type"))
            for c in status.get("conditions") or []
            if isinstance(c, dict) and c.get("status") == "True"
        ]
        how = f" ({', '.join(steps)})" if steps else ""
        message = f"the workspace claim {name} holds {held_text} and grows to {asked_text}{how}"
        return Sizing(None, (False, RESIZING, message))
    if shown:
        return Sizing(None, (True, SIZED, f"the workspace claim {name} holds {asked_text}"))
    return Sizing(None, None)


def refused(name: str, want: str, why: str) -> tuple[bool, str, str]:
    """The condition once the API server refused to grow the claim (its StorageClass
    does not allow expansion, or the claim is not bound yet)."""
    return (False, REFUSED, f"the workspace claim {name} could not grow to {want}: {why}")
