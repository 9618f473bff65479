"""The egress proxy's feeder (egress/feeder.py) on the real test cluster's API, telling a
real proxy process (cluster mode, tests/egress_proxy.py) the grants of this test's
namespace: as they come and go, and again when the proxy is started anew.

Whether the proxy knows a session is asked the way a kernel would: a plain request with
the session's credential gets the proxy's 403 (known: no rule allows that name) or a 407
(unknown). Each wait is on the feeder's own log record of what it did.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egress_proxy import Process
from mcp_forge.clients.kube import Kube
from mcp_forge.egress import feeder, grant
from mcp_forge.egress.client import default_python

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(not default_python().exists(), reason=".venv-egress missing: .ci/setup"),
]

DEADLINE = 30.0


class Said(logging.Handler):
    """The feeder's log records, waited on."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def wait_for(self, text: str, after: int = 0) -> int:
        """The index past the first line from `after` on that holds `text`."""

        def found() -> int | None:
            return next((i + 1 for i, s in enumerate(self.lines[after:], after) if text in s), None)

        with self.changed:
            if not self.changed.wait_for(lambda: found() is not None, DEADLINE):
                raise AssertionError(f"the feeder never said {text!r}: {self.lines[-10:]}")
            at = found()
            assert at is not None
            return at


@pytest.fixture
def said() -> Iterator[Said]:
    handler = Said()
    logger = logging.getLogger(feeder.__name__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def asks(address: tuple[str, int], token: str) -> int:
    """A plain request through the proxy with `token`: 403 known, 407 not."""
    auth = base64.b64encode(f"session:{token}".encode()).decode()
    conn = http.client.HTTPConnection(*address, timeout=DEADLINE)
    try:
        conn.request(
            "GET", "http://nowhere.test/", headers={"Proxy-Authorization": f"Basic {auth}"}
        )
        return conn.getresponse().status
    finally:
        conn.close()


def grant_secret(ns: str, name: str, token: str) -> dict[str, Any]:
    body = {"session": f"{ns}/{name}", "token": token, "rules": [{"host": "api.test"}],
            "values": [], "ca": None}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": f"{ns}.{name}",
            "namespace": ns,
            "labels": {grant.GRANT_LABEL: "true"},
        },
        "stringData": {grant.GRANT_KEY: json.dumps(body)},
    }


async def test_the_feeder_tells_the_proxy_its_grants_and_tells_a_new_proxy_again(
    kube: Kube, kube_api: Any, tmp_path: Path, said: Said
) -> None:
    ns = kube_api.namespace
    proxy = Process(tmp_path / "proxy")
    ready = tmp_path / "proxy" / "ready"
    stop = threading.Event()
    running = feeder.Feeder(kube, ns, proxy.control_path, ready)
    thread = threading.Thread(target=running.run, args=(stop,), daemon=True)
    thread.start()
    token, other = secrets.token_hex(32), secrets.token_hex(32)
    try:
        at = 0
        await asyncio.to_thread(kube.create, grant_secret(ns, "alpha", token))
        at = await asyncio.to_thread(said.wait_for, f"{ns}/alpha opened", at)
        await asyncio.to_thread(said.wait_for, "has every grant")
        assert ready.exists(), "ready once the proxy had every grant"
        assert await asyncio.to_thread(asks, proxy.address, token) == 403
        assert await asyncio.to_thread(asks, proxy.address, other) == 407
        # A grant that goes: its session goes.
        await asyncio.to_thread(kube.create, grant_secret(ns, "beta", other))
        at = await asyncio.to_thread(said.wait_for, f"{ns}/beta opened", at)
        await asyncio.to_thread(kube.delete, "Secret", ns, f"{ns}.beta")
        at = await asyncio.to_thread(said.wait_for, f"{ns}/beta closed", at)
        assert await asyncio.to_thread(asks, proxy.address, other) == 407
        # The proxy's container starts again, with nothing: the feeder sees it gone (not
        # ready meanwhile) and sends every grant to the new one.
        proxy.stop()
        at = await asyncio.to_thread(said.wait_for, "egress proxy gone", at)
        assert not ready.exists(), "not ready while the proxy may not know the sessions"
        proxy = Process(tmp_path / "proxy")
        at = await asyncio.to_thread(said.wait_for, f"{ns}/alpha opened", at)
        await asyncio.to_thread(said.wait_for, "has every grant", at)
        assert await asyncio.to_thread(asks, proxy.address, token) == 403
        assert ready.exists()
    finally:
        stop.set()
        proxy.stop()
        thread.join(DEADLINE)
