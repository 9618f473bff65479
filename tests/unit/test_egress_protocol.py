"""The gateway's and the egress proxy's shared words (egress/protocol.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest

from mcp_forge.egress import protocol


def test_a_credential_is_the_keys_alone() -> None:
    a, b = protocol.token_for("key-a"), protocol.token_for("key-b")
    assert a == protocol.token_for(b"key-a") and a != b
    assert len(a) == 64 and "key-a" not in a


def test_the_kernels_proxy_settings_name_the_relay_in_both_cases() -> None:
    env = protocol.proxy_env("t0k")
    url = f"http://{protocol.PROXY_USER}:t0k@127.0.0.1:{protocol.RELAY_PORT}"
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["HTTP_PROXY"] == url
    assert "127.0.0.1" in env["no_proxy"].split(",")


def test_messages_carry_a_descriptor_and_keep_their_order() -> None:
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        protocol.send(ours, {"op": "open", "n": 1}, [r])
        protocol.send(ours, {"op": "close", "n": 2})
        reader = protocol.Reader(theirs)
        first, fds = reader.read() or ({}, [])
        assert first == {"op": "open", "n": 1} and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the same pipe, through the socket
        os.close(fds[0])
        assert reader.read() == ({"op": "close", "n": 2}, [])
        ours.close()
        assert reader.read() is None
    finally:
        for fd in (r, w):
            os.close(fd)
        theirs.close()


def test_a_message_past_the_bound_is_refused() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        with pytest.raises(ValueError, match="over"):
            protocol.send(ours, {"rules": "x" * protocol.MESSAGE_MAX})
        sender = threading.Thread(target=_send_all, args=(ours, b"x" * (protocol.MESSAGE_MAX * 2)))
        sender.start()
        with pytest.raises(ValueError, match="over"):
            protocol.Reader(theirs).read()
        theirs.shutdown(socket.SHUT_RDWR)
        sender.join(10)
        assert not sender.is_alive()


def _send_all(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)
