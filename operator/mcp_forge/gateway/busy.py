"""A kernel still running an earlier call, told on connecting, within seconds.

A gateway that died (or a client that went) while a cell ran leaves the kernel busy
with it: its shell channel takes requests in order, so anything this gateway sends
next (its output guard, then the caller's code) waits behind that cell, and a caller
would only be told, after the guard's timeout, that the guard failed. On connecting,
a silent `pass` on the shell channel is answered at once by an idle kernel; one that
has not answered within `patience` is busy, and the caller is told so, and what to do
about it. (Its later reply is dropped: replies are taken by their request.) The probe
carries user expressions, so one round trip also says what the kernel holds (the
guard's fingerprint, runtimes/guard.py).
"""

from __future__ import annotations

import time
from typing import Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.status import parse_time
from mcp_forge.errors import SessionNotReady
from mcp_forge.jupyter.client import KernelConnection


def send_probe(conn: KernelConnection, expressions: dict[str, str] | None = None) -> str:
    """Send the idle probe, carrying `expressions`; its msg_id, for check_idle. Sent as
    a connection is made, its answer comes while the connection waits for kernel_info
    on the control channel (gateway/connections.py `_dial`)."""
    return conn.send_execute("pass", silent=True, store_history=False, user_expressions=expressions)


async def check_idle(
    conn: KernelConnection, probe: str, session: KernelSession, patience: float
) -> dict[str, Any]:
    """The values of the probe's expressions (user expressions, as the kernel reports
    them) if the kernel's shell answers it within `patience` seconds; SessionNotReady
    saying it is busy with an earlier call (and for how long, as far as known) if not."""
    reply = await conn.reply(conn.shell, probe, patience)
    if reply is None:
        raise SessionNotReady(busy_message(session, now=time.time()))
    values = reply["content"].get("user_expressions")
    return values if isinstance(values, dict) else {}


def busy_message(session: KernelSession, *, now: float) -> str:
    """What a caller is told of a kernel busy with an earlier call."""
    since = parse_time(session.status.get("lastActivity"))
    running = f" (running for {max(now - since, 0):.0f} s)" if since is not None else ""
    return (
        f"the kernel of session {session.name!r} is busy with an earlier call{running}; "
        f"wait, or interrupt it with interrupt_kernel / mcp-forge interrupt {session.name}"
    )
