"""The cluster's egress proxy is told its sessions by this feeder, in the proxy's pod.

    mcp-forge egress-feeder --namespace mcp-forge-egress \\
        --control-socket /run/mcp-forge-egress/control.sock \\
        --audit-socket /run/mcp-forge-egress/audit.sock --metrics 0.0.0.0:9090

The operator writes a grant per session with an allow-list (egress/grant.py: a Secret
labelled mcpforge.dev/egress-grant in the proxy's namespace). The feeder lists and
watches them and sends each to the proxy over its control socket (an emptyDir the two
containers share): `open` for a new or changed grant, `close` for a deleted one, and,
after every list, `sync` naming them all, so a grant deleted while the watch was down,
or a session the proxy kept from an earlier feeder, is closed too. The proxy's container
holds no API credential: only this one reads the grants.

The proxy's verdicts come back on its audit socket and are counted here
(egress/audit.py), served as Prometheus metrics, as a local gateway counts its own.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from mcp_forge.clients.kube import Event, Kube
from mcp_forge.egress import audit, grant, protocol
from mcp_forge.errors import ApiError

log = logging.getLogger(__name__)
WATCH_SECONDS = 300.0  # a watch is opened again (after a list) at least this often
PAGE = 50  # grants a list asks for at once (each up to grant.GRANT_MAX)
RETRY_MAX = 30.0  # the longest wait before trying the proxy or the API again
CALL_TIMEOUT = 30.0  # the proxy's answer to one request
AUDIT_LINE_MAX = 64 << 10


class ProxyGone(Exception):
    """The control socket failed: connect again, and send every grant again."""


class Control:
    """The proxy's control socket: one request, one answer."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_TIMEOUT)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self.reader = protocol.Reader(self.sock)

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            protocol.send(self.sock, message)
            got = self.reader.read()
        except (OSError, ValueError) as exc:
            raise ProxyGone(str(exc)) from None
        if got is None:
            raise ProxyGone("the proxy closed its control socket")
        return got[0]

    def check(self) -> None:
        """ProxyGone if the proxy closed the socket (between requests nothing else comes)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable and not self.sock.recv(1, socket.MSG_PEEK):
                raise ProxyGone("the proxy closed its control socket")
        except OSError as exc:
            raise ProxyGone(str(exc)) from None

    def close(self) -> None:
        self.sock.close()


class Feeder:
    def __init__(
        self, kube: Kube, namespace: str, control: Path, ready: Path | None = None
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.control_path = control
        # Made once the proxy has every grant, removed when it may not: the pod's
        # readiness (a new proxy takes no kernel's request before it knows the sessions).
        self.ready = ready
        self.sent: dict[str, str] = {}  # grant Secret name -> its resourceVersion, as sent
        self.sessions: dict[str, str] = {}  # grant Secret name -> its session

    def run(self, stop: threading.Event) -> None:
        """Keep the proxy told, until `stop`: connect, send every grant, follow changes.
        The proxy gone (its container restarted): unready, connect again, send them all.
        The API failing: the proxy keeps what it has (still ready); list again after a
        wait (1 s doubling to RETRY_MAX, as long as watches end early or fail)."""
        delay = 1.0
        while not stop.is_set():
            try:
                control = Control(self.control_path)
            except OSError as exc:
                self._unready()
                log.info("egress proxy not reachable yet (%s): again in %.0f s", exc, delay)
                stop.wait(delay)
                delay = min(2 * delay, RETRY_MAX)
                continue
            try:
                self.sent.clear()  # a new connection may be a new proxy: send them all
                while not stop.is_set():
                    try:
                        began = time.monotonic()
                        self.follow(control, self.resync(control), stop)
                        if time.monotonic() - began > WATCH_SECONDS / 2:
                            delay = 1.0  # a watch that lasted: no backoff
                            continue
                        why = "the watch ended early"
                    except ApiError as exc:
                        why = str(exc)
                    log.warning("egress feeder: %s: listing again in %.0f s", why, delay)
                    stop.wait(delay)
                    delay = min(2 * delay, RETRY_MAX)
            except ProxyGone as exc:
                self._unready()
                log.warning("egress proxy gone (%s): connecting again", exc)
                stop.wait(1.0)
            finally:
                control.close()

    def resync(self, control: Control) -> str:
        """Send every grant that changed, then `sync` with them all; the list's version."""
        names: set[str] = set()
        after: str | None = None
        while True:  # in pages: grants may be large (up to grant.GRANT_MAX each)
            listed = self.kube.list("Secret", self.namespace, labels={grant.GRANT_LABEL: "true"},
                                    limit=PAGE, after=after)  # fmt: skip
            for secret in listed.get("items") or []:
                names.add(secret["metadata"]["name"])
                self.apply(control, secret)
            after = listed["metadata"].get("continue")
            if not after:
                break
        for gone in set(self.sessions) - names:
            self.sessions.pop(gone, None)
            self.sent.pop(gone, None)
        answer = control.call({"op": "sync", "sessions": sorted(set(self.sessions.values()))})
        if answer.get("closed"):
            log.info("egress sessions closed by sync: %s", answer["closed"])
        if answer.get("ok"):
            if self.ready is not None:
                self.ready.touch()
            log.info("egress proxy has every grant (%d)", len(self.sessions))
        return str(listed["metadata"]["resourceVersion"])

    def _unready(self) -> None:
        if self.ready is not None:
            self.ready.unlink(missing_ok=True)

    def follow(self, control: Control, version: str, stop: threading.Event) -> None:
        """Apply the grants' changes until the watch ends (then the caller lists again),
        checking every second that the proxy is still there (ProxyGone if not)."""
        events: queue.Queue[Event | ApiError | None] = queue.Queue()
        done = threading.Event()

        def watch() -> None:
            try:
                for event in self.kube.watch("Secret", self.namespace, resource_version=version,
                                             labels={grant.GRANT_LABEL: "true"},
                                             timeout=WATCH_SECONDS):  # fmt: skip
                    if done.is_set():
                        return
                    events.put(event)
            except ApiError as exc:
                events.put(exc)
            finally:
                events.put(None)

        threading.Thread(target=watch, name="grants", daemon=True).start()
        try:
            while not stop.is_set():
                try:
                    item = events.get(timeout=1.0)
                except queue.Empty:
                    control.check()
                    continue
                if item is None:
                    return
                if isinstance(item, ApiError):
                    raise item
                if item.type == "DELETED":
                    self.forget(control, item.object["metadata"]["name"])
                elif item.type in ("ADDED", "MODIFIED"):
                    self.apply(control, item.object)
        finally:
            done.set()

    def apply(self, control: Control, secret: dict[str, Any]) -> None:
        """Open (or open again, changed) the session of one grant Secret."""
        meta = secret["metadata"]
        name, version = meta["name"], str(meta.get("resourceVersion"))
        if self.sent.get(name) == version:
            return
        try:
            raw = base64.b64decode((secret.get("data") or {}).get(grant.GRANT_KEY, ""))
            body = grant.parse_grant(raw)
        except ValueError as exc:  # binascii.Error and JSONDecodeError are ValueErrors
            log.warning("egress grant %s is not one: %s", name, exc)
            self.forget(control, name)
            return
        old = self.sessions.get(name)
        if old is not None and old != body["session"]:
            control.call({"op": "close", "session": old})
        answer = control.call({"op": "open", **body})
        if not answer.get("ok"):
            log.warning("egress proxy refused grant %s: %s", name, answer.get("error"))
            self.forget(control, name)
            return
        self.sent[name], self.sessions[name] = version, body["session"]
        log.info("egress session %s opened (grant %s)", body["session"], name)

    def forget(self, control: Control, name: str) -> None:
        self.sent.pop(name, None)
        session = self.sessions.pop(name, None)
        if session is not None:
            control.call({"op": "close", "session": session})
            log.info("egress session %s closed (grant %s)", session, name)


def read_audit(path: Path, stop: threading.Event) -> None:
    """The proxy's verdicts, counted (egress/audit.py), for as long as it writes them."""
    while not stop.is_set():
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
                with sock.makefile("rb") as lines:
                    for line in lines:
                        _count(line)
        except OSError:
            pass
        stop.wait(1.0)  # the proxy is starting, or went: connect again


def _count(line: bytes) -> None:
    if len(line) > AUDIT_LINE_MAX:
        return
    try:
        record = json.loads(line)
    except ValueError:
        return
    if isinstance(record, dict) and record.get("event") != "audit":  # the stream's own news
        audit.record(record)


def run(
    kube: Kube, namespace: str, control: Path, audit_path: Path | None, ready: Path | None = None
) -> None:
    """The feeder until SIGTERM or SIGINT: it ends where it is (a watch may be waiting
    minutes for its next event); the proxy keeps its sessions for the next feeder."""
    stop = threading.Event()
    if audit_path is not None:
        threading.Thread(
            target=read_audit, args=(audit_path, stop), name="audit", daemon=True
        ).start()

    def stopped(number: int, _: Any) -> None:
        stop.set()
        raise SystemExit(0)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stopped)
    started = time.monotonic()
    try:
        Feeder(kube, namespace, control, ready).run(stop)
    finally:
        stop.set()
        log.info("egress feeder stopped after %.0f s", time.monotonic() - started)
