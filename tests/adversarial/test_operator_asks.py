"""The operator asks a starting kernel whether it answers (control/answers.py, running
kernelside/probe.py in the operator). Kernel code holds the session's key and its shell
socket, so it can answer that question any way it likes: a flood of other messages, a
reply signed with another key, one too large. The ask ends within its own deadline and
says no to each; only a reply signed with the session's key says yes. The worst a kernel
can do is to be shown Ready as soon as it chooses, which is its own session's business.

The hostile kernel here is a ZMQ ROUTER on loopback doing what such code would do.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from mcp_forge.kernelside import probe

KEY = secrets.token_hex(16)
Reply = Callable[[zmq.Socket[bytes], list[bytes]], object]  # (socket, request frames)


def _signed(key: str, parts: list[bytes]) -> bytes:
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest().encode()


def reply_to(request: list[bytes], key: str, content: bytes = b"{}") -> list[bytes]:
    """A kernel_info_reply to `request` (identity first, as a ROUTER receives it)."""
    identity, rest = request[0], request[request.index(b"<IDS|MSG>") + 1 :]
    parent = json.loads(rest[1])
    header = {"msg_id": "r", "msg_type": "kernel_info_reply", "session": "k"}
    parts = [json.dumps(header).encode(), json.dumps(parent).encode(), b"{}", content]
    return [identity, b"<IDS|MSG>", _signed(key, parts), *parts]


@contextmanager
def hostile_kernel(behave: Reply) -> Iterator[dict[str, object]]:
    """A shell socket on loopback that answers the first request with `behave`; the
    connection info the operator would read from the session's Secret."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                behave(sock, sock.recv_multipart())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield {"key": KEY, "shell_port": port, "signature_scheme": "hmac-sha256"}
    finally:
        stop.set()
        thread.join(5)
        sock.close(0)
        context.term()


def asked(info: dict[str, object], timeout_ms: int = 500) -> tuple[bool, float]:
    t = time.monotonic()
    said = probe.answers(info, "127.0.0.1", timeout_ms)
    return said, time.monotonic() - t


def test_a_signed_reply_is_an_answer() -> None:
    """The control: the ask can say yes, so the refusals below mean something."""
    with hostile_kernel(lambda s, req: s.send_multipart(reply_to(req, KEY))) as info:
        said, _ = asked(info)
    assert said


def test_a_flood_of_other_messages_does_not_hold_the_ask_past_its_deadline() -> None:
    def flood(sock: zmq.Socket[bytes], request: list[bytes]) -> None:
        end = time.monotonic() + 3
        while time.monotonic() < end:  # junk, and replies to requests never sent
            sock.send_multipart([request[0], b"junk"])
            wrong = reply_to(request, KEY)
            wrong[4] = json.dumps({"msg_id": "not-yours"}).encode()
            wrong[2] = _signed(KEY, wrong[3:7])
            sock.send_multipart(wrong)

    with hostile_kernel(flood) as info:
        said, took = asked(info, timeout_ms=500)
    assert not said
    assert took < 1.5, f"the ask ran {took:.2f} s past its 0.5 s deadline"


def test_a_reply_signed_with_another_key_is_no_answer() -> None:
    other = secrets.token_hex(16)
    with hostile_kernel(lambda s, req: s.send_multipart(reply_to(req, other))) as info:
        said, _ = asked(info)
    assert not said


def test_a_reply_past_the_size_bound_is_no_answer() -> None:
    """Over REPLY_MAX (1 MiB): ZMQ drops the connection before anything is parsed."""
    big = b'"' + b"x" * (probe.REPLY_MAX + 1) + b'"'
    with hostile_kernel(lambda s, req: s.send_multipart(reply_to(req, KEY, big))) as info:
        said, took = asked(info)
    assert not said and took < 1.5


def test_a_signed_reply_that_does_not_parse_is_no_answer_and_raises_nothing() -> None:
    """A fork's kernel holds the key its reply is checked with (control/forking.py), so
    its signed frames may be anything: bytes that are not UTF-8 or JSON, a list where a
    header goes, JSON nested past the parser's recursion. Each is passed over, and a
    good reply after them is still taken."""
    deep = b"[" * 30_000 + b"]" * 30_000  # within REPLY_MAX, past the recursion limit
    bad: list[tuple[bytes, bytes]] = [(b"\xff\xfe", b"{}"), (b"[1, 2]", b"{}"), (deep, b"{}")]

    def junk(sock: zmq.Socket[bytes], request: list[bytes], then_answer: bool) -> None:
        for header, content in bad:
            frames = reply_to(request, KEY)
            frames[3], frames[6] = header, content
            frames[2] = _signed(KEY, frames[3:7])
            sock.send_multipart(frames)
        if then_answer:
            sock.send_multipart(reply_to(request, KEY, b'{"status": "ok"}'))

    with hostile_kernel(lambda s, req: junk(s, req, True)) as info:
        said = probe.ask(info, "127.0.0.1", "kernel_info_request", {}, 2000)
    assert said == {"status": "ok"}
    with hostile_kernel(lambda s, req: junk(s, req, False)) as info:
        answered, took = asked(info)
    assert not answered and took < 1.5
