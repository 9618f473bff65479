"""A persistent workspace's claim (`Claims`: made, owned as its reclaimPolicy says, grown)
and its size: what `spec.workspace.size` asks of the session's PersistentVolumeClaim once
it exists, and what the session's status says about it.

A claim can grow (if its StorageClass allows expansion; the API server refuses it
otherwise) and never shrink. The status has a condition `WorkspaceSized` once a size
other than the claim's first was asked for: False while the claim is smaller than asked
(Resizing, ResizeRefused, CannotShrink), True once it holds it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients.kube import Kube, quantity
from mcp_forge.control.render import render_workspace_claim
from mcp_forge.errors import ApiError

log = logging.getLogger(__name__)

RESIZE_RETRY = 300.0  # a claim the API server refused to grow is asked again after this

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


class Claims:
    """The sessions' persistent workspace claims, made, owned and grown (the operator's
    reconciles, control/reconciler.py)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        # Claims the API server refused to grow: (namespace, session) -> (size asked,
        # when, the condition said), so a refusal is asked again only now and then.
        self._refused: dict[tuple[str, str], tuple[str, float, tuple[bool, str, str]]] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._refused.pop((namespace, name), None)

    def ensure(
        self, session: KernelSession, old: dict[str, Any], *, fresh: bool
    ) -> tuple[bool, str, str] | None:
        """A persistent workspace's claim: made if absent, owned as its reclaimPolicy says
        (Delete: by the session, so the garbage collector deletes it with the session),
        grown when spec.workspace.size asks for more (`sizing`); the
        WorkspaceSized condition to show, if any.

        A claim left by an earlier session of that name is taken over if it was retained
        (it has no owner); one the earlier session still owns is being deleted with it:
        this session's pod waits (the reconcile is retried) rather than mount old files.
        """
        want = render_workspace_claim(session)
        if want is None:
            return None
        ns, name = session.namespace, want["metadata"]["name"]
        current, made = self.kube.ensure(want, likely_new=fresh)
        if not made:
            meta = current["metadata"]
            refs = meta.get("ownerReferences") or []
            if meta.get("deletionTimestamp") or any(r.get("uid") != session.uid for r in refs):
                raise ApiError(
                    409,
                    "Conflict",
                    f"the workspace claim {name} of an earlier session of that name is being "
                    "deleted",
                )
            owners = want["metadata"].get("ownerReferences") or []
            if refs != owners:  # reclaimPolicy changed, or a retained claim taken over
                log.info("workspace claim %s/%s: owners now %s", ns, name, owners)
                patch = {"metadata": {"ownerReferences": owners or None}}
                self.kube.patch("PersistentVolumeClaim", ns, name, patch)
        shown = any(c.get("type") == WORKSPACE_SIZED for c in old.get("conditions") or [])
        size = sizing(current, session.spec.workspace_size, shown=shown)
        if size.grow_to is None:
            self._refused.pop((ns, session.name), None)
            return size.condition
        asked, at, said = self._refused.get((ns, session.name), ("", 0.0, size.condition))
        if asked == size.grow_to and time.monotonic() - at < RESIZE_RETRY:
            return said  # refused lately: not asked again on every event
        log.info("workspace claim %s/%s: growing to %s", ns, name, size.grow_to)
        grow = {"spec": {"resources": {"requests": {"storage": size.grow_to}}}}
        try:
            self.kube.patch("PersistentVolumeClaim", ns, name, grow)
        except ApiError as exc:
            if exc.status not in (403, 422):  # refused, not failed: said in the status
                raise
            said = refused(name, size.grow_to, str(exc))
            self._refused[(ns, session.name)] = (size.grow_to, time.monotonic(), said)
            return said
        self._refused.pop((ns, session.name), None)
        return size.condition
