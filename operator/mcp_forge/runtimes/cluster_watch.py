"""One KernelSession followed as the API server changes it, on one watch stream.

The gateway waits for the operator to make a session Ready (runtimes/cluster.py). The
operator writes its status more than once on the way (a warm claim: the claim, then
Ready), and each watch request that ends at the first change and starts anew costs a
new TLS connection, where the API server is busiest (5 ms on a quiet host, 15-25 ms right
after a claim: clients/kube.py). So one stream is read until the wait is over, and a new
one is opened only when the API server ends it or its chunk of time passes. A session
just created is watched from the resourceVersion the create answered with, not listed
first.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any

from mcp_forge.clients.kube import Event, Kube
from mcp_forge.errors import ApiError

KIND = "KernelSession"


def listed(kube: Kube, namespace: str, name: str) -> tuple[dict[str, Any] | None, str]:
    """The session as a list of one gives it (None if there is none), and the list's
    resourceVersion: a watch can start there (an object's own may be too old for the
    API server to replay from: 410 Gone)."""
    found = kube.list(KIND, namespace, fields={"metadata.name": name})
    items = found.get("items") or []
    return (items[0] if items else None), str(found["metadata"].get("resourceVersion") or "")


class SessionWatch:
    """The session `name` as it changes from `seen`, read at `rv`.

    `next_change` blocks (run it in a thread); calls may come from different threads, one
    at a time. `close` ends the stream: at once if no call reads it, else when that call's
    read returns (within its timeout).
    """

    def __init__(
        self, kube: Kube, namespace: str, name: str, seen: dict[str, Any], rv: str | None
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.seen = seen
        self.rv = rv  # where the next stream starts; None: list first
        self._stream: Generator[Event, None, None] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def next_change(self, timeout: float) -> dict[str, Any] | None:
        """The session once it changed (what was seen, again, if `timeout` passed first or
        the stream ended; None once it is gone). A stream opened here ends `timeout` after
        it opened, whatever later calls ask: a wait may outlive its deadline by as much."""
        try:
            with self._lock:
                if self._closed:
                    return self.seen
                return self._next(timeout)
        finally:
            self._end_if_closed()  # close() came while this read: it could not end it

    def close(self) -> None:
        self._closed = True
        self._end_if_closed()

    def _end_if_closed(self) -> None:
        """End the stream if closed and no call reads it (else that call ends it: it
        checks again once it has let go of the lock)."""
        if self._closed and self._lock.acquire(blocking=False):
            try:
                self._end()
            finally:
                self._lock.release()

    def _next(self, timeout: float) -> dict[str, Any] | None:
        if self.rv is None:  # the API server could not replay from where we were
            now, self.rv = listed(self.kube, self.namespace, self.name)
            before = self.seen["metadata"].get("resourceVersion")
            if now is None or now["metadata"].get("resourceVersion") != before:
                if now is not None:
                    self.seen = now
                return now
        if self._stream is None:
            self._stream = self.kube.watch(
                KIND, self.namespace, resource_version=self.rv, name=self.name, timeout=timeout
            )
        try:
            event = next(self._stream)
        except StopIteration:  # its time passed, or the API server ended it
            self._stream = None
            return self.seen
        except ApiError as exc:
            self._stream = None
            if exc.status != 410:
                raise
            self.rv = None  # too old to replay from: list, then watch from there
            return self.seen
        if event.type == "DELETED":
            self._end()
            return None
        self.seen = event.object
        self.rv = str(event.object["metadata"].get("resourceVersion") or "") or None
        return self.seen

    def _end(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()  # its connection closed, not given back half read
