"""The kernel container's startup probe on a cluster: does the kernel answer?

The kubelet runs this program in the kernel's container (`python -I -S -c <source>`)
until it exits 0: it sends a signed kernel_info_request on the kernel's shell channel
(127.0.0.1, Curve when the connection file has keys) and succeeds when a reply to it,
signed with the session's key, comes back within TIMEOUT. Until then the pod is not
started, and the operator shows the session Starting; so on a cluster as locally, Ready
means the kernel answered. Needs only the standard library and pyzmq, which the kernel
image has for ipykernel; reads nothing but the connection the kernel itself reads (the
variable the kubelet sets from the session's Secret, see launch.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import time
import uuid
from typing import Any

import zmq

# The connection the kubelet sets from the session's Secret (launch.ENV: this program
# runs alone and imports nothing of ours); the kernel's launcher removes it from its own
# environment only, and the kubelet gives every exec the container's.
CONNECTION_ENV = "MCPFORGE_CONNECTION"
TIMEOUT_MS = 2000
REPLY_MAX = 64 << 10  # a kernel_info_reply is a few KiB
QUEUED = 8  # messages held unread: a kernel's flood is dropped, not buffered
RECONNECT_MS = 20  # connection refused (the kernel not listening yet): tried again this soon


def _sign(key: bytes, parts: list[bytes]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest().encode("ascii")


def answers(info: dict[str, Any], host: str = "127.0.0.1", timeout_ms: int = TIMEOUT_MS) -> bool:
    """True if the kernel described by `info` (a connection file) replies to kernel_info."""
    return ask(info, host, "kernel_info_request", {}, timeout_ms) is not None


def ask(
    info: dict[str, Any],
    host: str,
    msg_type: str,
    content: dict[str, Any],
    timeout_ms: int = TIMEOUT_MS,
    reply_key: str | None = None,
) -> dict[str, Any] | None:
    """Send one request of `msg_type` on the shell channel of the kernel `info` describes,
    signed with its key; the content of its reply, signed with `reply_key` (the same key
    if None), or None if none came within `timeout_ms`. (The operator asks a fork's
    kernel to take a key of its own this way: the reply is signed with the new one.)"""
    key = str(info["key"]).encode()
    answer_key = key if reply_key is None else reply_key.encode()
    msg_id, frames = _request(key, msg_type, content)
    # The socket closes unlingering (LINGER 0), then its context ends.
    with zmq.Context() as context, _dealer(context, info, host) as sock:
        sock.send_multipart(frames)
        deadline = time.monotonic() + timeout_ms / 1000
        want = msg_type.replace("_request", "_reply")
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
            frames = sock.recv_multipart()
            if b"<IDS|MSG>" not in frames:
                continue
            rest = frames[frames.index(b"<IDS|MSG>") + 1 :]
            if len(rest) < 5 or not hmac.compare_digest(rest[0], _sign(answer_key, rest[1:5])):
                continue
            try:  # signed, but by whatever holds the key (a fork's kernel holds the new one)
                reply, parent, said = (json.loads(rest[i]) for i in (1, 2, 4))
            except (ValueError, RecursionError):
                continue
            if not (isinstance(reply, dict) and isinstance(parent, dict)):
                continue
            if reply.get("msg_type") == want and parent.get("msg_id") == msg_id:
                return said if isinstance(said, dict) else {}
        return None


def tell(
    info: dict[str, Any],
    host: str,
    msg_type: str,
    content: dict[str, Any],
    timeout_ms: int = TIMEOUT_MS,
) -> None:
    """Send one request as `ask` does, and wait only until it has left (at most
    `timeout_ms`), not for a reply: for a request whose reply cannot come back on the
    connection it came on (kernelside/rebind.py closes it)."""
    _, frames = _request(str(info["key"]).encode(), msg_type, content)
    with zmq.Context() as context, _dealer(context, info, host) as sock:
        sock.send_multipart(frames)
        sock.setsockopt(zmq.LINGER, timeout_ms)  # the context's end waits for it to leave


def _request(key: bytes, msg_type: str, content: dict[str, Any]) -> tuple[str, list[bytes]]:
    """A new request's id and its frames, signed with `key`."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": uuid.uuid4().hex,
        "username": "probe",
        "version": "5.3",
        "date": "1970-01-01T00:00:00Z",
    }
    parts = [json.dumps(p).encode() for p in (header, {}, {}, content)]
    return msg_id, [b"<IDS|MSG>", _sign(key, parts), *parts]


def _dealer(context: zmq.Context[Any], info: dict[str, Any], host: str) -> zmq.Socket[Any]:
    """A socket connected to the shell channel of the kernel `info` describes."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_MAX)
        sock.setsockopt(zmq.RCVHWM, QUEUED)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)  # a kernel binding its port now
        if info.get("curve_publickey"):
            public = str(info["curve_publickey"]).encode("ascii")
            sock.setsockopt(zmq.CURVE_SERVERKEY, public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, str(info["curve_secretkey"]).encode("ascii"))
        sock.connect(f"tcp://{host}:{int(info['shell_port'])}")
    except BaseException:
        sock.close(0)
        raise
    return sock


def main() -> int:
    return 0 if answers(json.loads(os.environ[CONNECTION_ENV])) else 1


if __name__ == "__main__":
    sys.exit(main())
