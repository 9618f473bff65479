"""A new connection to a kernel, made ready for the session's calls.

Once the kernel answers (gateway/connections.py `_connect`), `KernelSetup.prepare` does, in
order: say at once if the kernel still runs a call of a gateway gone since (busy.py);
give it the session's claim-time environment and working files; install the output guard
(kernelside/guard.py) with this gateway's limits, unless the kernel holds it already
(runtimes/guard.py: local mode gives it to every kernel as it starts); put the session's
packages in; start code mode's `mcp_tools` and dial its bridge. Each runs silently (no
output, nothing left in the user's namespace), within the helper timeout. A failure is
raised to the caller, which drops the connection: the next call starts over and names
what failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import SessionNotReady
from mcp_forge.gateway import busy, introspection
from mcp_forge.gateway.codemode.bridge import Bridge
from mcp_forge.gateway.codemode.policy import policies_of
from mcp_forge.gateway.codemode.upstream import UpstreamPool
from mcp_forge.gateway.sessions import owner_of
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import Collector
from mcp_forge.logsafe import shown
from mcp_forge.runtimes.base import KernelExtras
from mcp_forge.runtimes.guard import STATE, GuardProgram, guard_program
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Handle:
    """What the gateway holds for one session: its queue, its connection and bridge."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conn: KernelConnection | None = None
    kernel: tuple[Any, Any] = (None, None)  # (connection generation, kernel id) of conn
    activity_recorded: float = float("-inf")  # monotonic time of the last record_activity
    busy: bool = False  # as last recorded
    bridge: Bridge | None = None  # code mode: this kernel's bridge, if the session has one
    execution_count: int | None = None  # the kernel's, after this gateway's last call


async def silently(conn: KernelConnection, code: str, failure: str, timeout: float) -> None:
    """Run `code` in the kernel without output or history; SessionNotReady, saying
    `failure` and why, unless it ran without an error within `timeout` seconds."""
    collector = Collector("", budget=10_000, spool_max=0, data_budget=0)
    await conn.before_request()
    collector.msg_id = conn.send_execute(code, silent=True, store_history=False)
    if not await conn.pump(collector, timeout):
        raise SessionNotReady(f"{failure} (no answer in {timeout:.0f}s)")
    result = collector.finish(duration=0)
    if result.status != "ok":
        err = result.error
        why = result.message or (f"{err.ename}: {err.evalue}" if err else result.status)
        raise SessionNotReady(f"{failure}: {why}")


@dataclass
class KernelSetup:
    runtime: KernelExtras
    settings: Settings
    upstreams: UpstreamPool
    guard: GuardProgram = field(init=False)

    def __post_init__(self) -> None:
        self.guard = guard_program(self.settings)

    async def _silently(self, conn: KernelConnection, code: str, failure: str) -> None:
        await silently(conn, code, failure, self.settings.helper_timeout)

    @staticmethod
    def probe(conn: KernelConnection) -> str:
        """Send the idle probe (busy.py) on a new connection, asking which guard the
        kernel holds; `prepare` takes its answer."""
        return busy.send_probe(conn, {"guard": STATE})

    async def prepare(
        self, handle: Handle, session: KernelSession, conn: KernelConnection, probe: str
    ) -> None:
        """Make `conn`, a kernel that answers, ready for calls (the module docstring);
        `probe` is what `probe` sent on it."""
        held = await busy.check_idle(conn, probe, session, self.settings.busy_probe)
        setup = await self.runtime.kernel_setup(session)
        if setup:
            failure = "the kernel did not take its environment and working files"
            await self._silently(conn, setup, failure)
        if not self.guard.held(held):
            await self._install_guard(session, conn)
        if session.spec.packages:
            await self.runtime.kernel_packages(session, conn)
        if session.spec.mcp_servers:
            await self._bridge(handle, session, conn)

    async def _install_guard(self, session: KernelSession, conn: KernelConnection) -> None:
        try:
            await self._silently(conn, self.guard.code, "the kernel's output guard failed")
        except SessionNotReady as exc:
            # Code may have broken what the guard wraps; the gateway's own bounds still hold.
            # Why is the kernel's exception, its words: at debug only.
            log.warning("session %s runs without its output guard", session.name)
            log.debug("session %s: %s", session.name, shown(exc, 500))

    async def _bridge(self, handle: Handle, session: KernelSession, conn: KernelConnection) -> None:
        """Start `mcp_tools` in the kernel (silently) and dial its bridge (docs/bridge.md)."""
        policies = policies_of(session.spec.mcp_servers)
        missing = sorted(n for n in policies if n not in self.upstreams)
        if missing:
            log.warning(
                "session %s names MCP servers this gateway does not have: %s",
                session.name,
                ", ".join(missing),
            )
        inside, address = await self.runtime.bridge_address(session)
        await self._silently(
            conn, introspection.bridge_program(inside), "the kernel could not start its MCP bridge"
        )
        # Per-session state outlives this bridge (a restart, a dropped connection): the
        # upstreams of isolated servers, and the meter of budgets and rates.
        lease = self.upstreams.lease(
            [n for n in policies if n in self.upstreams],
            session=f"{session.namespace}/{session.name}/{session.uid}",
            client=owner_of(session),
        )
        bridge = Bridge(
            session.name,
            lease.upstreams,
            policies,
            call_timeout=self.settings.bridge_call_timeout,
            meter=lease.meter,
            refused=lease.refused,
            on_close=lease.release,
            rate=functools.partial(self.runtime.count_call, session),  # shared by replicas
        )
        handle.bridge = bridge  # dropped with the handle, which releases the lease
        try:
            await bridge.open(address)
        except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
            raise SessionNotReady(f"the kernel's MCP bridge cannot be reached: {exc}") from exc
        # The user's next cell must find the tools: wait until the kernel applied the hello.
        await self._silently(
            conn,
            "assert __import__('sys').modules['mcp_tools'].wait_connected(10), "
            "'the MCP bridge did not connect'",
            "the kernel's MCP bridge did not take the gateway's connection",
        )
