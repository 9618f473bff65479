"""Fault drills: kill the parts of a local MCP-Forge mid-call and report what survives.

    sudo .venv/bin/python tests/drills/faults.py [--rounds 20] [--image REF]

Each drill runs against a fresh state directory and a declared session (`mcp-forge apply`),
through the real gateway over stdio (JSON-RPC lines, no SDK to hide what happens):

* gateway: SIGKILL the gateway while a cell runs, `--rounds` times; after each, a new
  gateway must find the session Ready with its variables intact (a counter each round
  increments, a value set once). Then once more while it creates kernels (its default
  pool's, or a session's: killed as soon as a `podman kube play` of its state directory
  runs; that play ends after its gateway). Nothing may be left behind: no pod of the
  state directory's store that no session owns, no mount and no Unix socket more than
  before the first round.
* kernel: SIGKILL the kernel's container mid-call: the call answers "died", names it,
  and the next call runs in a restarted kernel.
* infra: kill the pod's infra container mid-call: the call answers (died or ok), and the
  session serves the next call.
* conmon: kill the kernel container's conmon (Podman's monitor; Podman has no daemon
  here) mid-call: the call answers and the session serves the next call.

Prints one line per drill with its outcome, exits 1 if any drill failed. The adversarial
suite runs a short form (tests/adversarial/test_drills.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, this file has tests/drills on sys.path, not tests/ (pytest puts it there).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcp_forge.clients import podman
from mcp_forge.control.render import podman_pod_name
from mcp_forge.runtimes.local.orphans import STORE_LABEL, orphans, store_tag
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.settings import Settings
from support import CALL_DEADLINE, GATEWAY, StdioGateway

MINIMAL_IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"
RUNNING = "drill-cell-running"  # printed by each drill's cell as it starts
CELL = f"import time\nprint({RUNNING!r}, flush=True)\ntime.sleep({{seconds}})\n"


@dataclass
class Outcome:
    drill: str
    ok: bool
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        mark = "PASS" if self.ok else "FAIL"
        return f"{mark} {self.drill}: {self.detail}"


class Gateway(StdioGateway):
    """The gateway over stdio, with what the drills ask of it: tool calls whose cells say
    when they run."""

    async def start_call(self, tool: str, arguments: dict[str, Any]) -> int:
        return await self.start("tools/call", {"name": tool, "arguments": arguments}, progress=True)

    async def answer(self, request_id: int, *, running: asyncio.Event | None = None) -> Any:
        """The response to `request_id`; `running` is set when its cell says it runs."""

        def notice(msg: dict[str, Any]) -> None:
            said = msg.get("method") == "notifications/message"
            if said and RUNNING in str(msg.get("params", {}).get("data")) and running:
                running.set()  # the cell printed it: the kernel is in the cell

        return await self.response(request_id, on_message=notice)

    async def call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        msg = await self.answer(await self.start_call(tool, arguments))
        result = msg.get("result") or {}
        return {
            "error": result.get("isError", "error" in msg),
            "structured": result.get("structuredContent") or {},
            "text": " ".join(c.get("text", "") for c in result.get("content", [])),
        }

    async def run(self, session: str, code: str) -> dict[str, Any]:
        return await self.call("execute_code", {"session_id": session, "code": code})


async def runs(running: asyncio.Event, waiter: asyncio.Task[Any]) -> bool:
    """True once the call runs (its cell said so); False if it was answered before."""
    seen = asyncio.create_task(running.wait())
    await asyncio.wait({seen, waiter}, timeout=CALL_DEADLINE, return_when=asyncio.FIRST_COMPLETED)
    seen.cancel()
    if running.is_set():
        return True
    if waiter.done():
        return False
    raise TimeoutError(f"the call neither ran nor ended within {CALL_DEADLINE:.0f}s")


@asynccontextmanager
async def gateway(state_dir: Path) -> AsyncIterator[Gateway]:
    async with Gateway.open(state_dir, client="drill") as gw:
        # The cells' output comes as log messages: how we see one run.
        await gw.request("logging/setLevel", {"level": "info"})
        yield gw


def sh(*args: str, check: bool = True) -> str:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def cli(state_dir: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [GATEWAY, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"mcp-forge {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def mounts(state_dir: Path) -> list[str]:
    return [
        line for line in Path("/proc/mounts").read_text().splitlines() if str(state_dir) in line
    ]


def unix_sockets(state_dir: Path) -> int:
    """Unix sockets bound or connected under the state directory, host-wide."""
    return sum(str(state_dir) in line for line in Path("/proc/net/unix").read_text().splitlines())


def session_phase(state_dir: Path, name: str) -> str:
    body = json.loads(cli(state_dir, "get", name, "-o", "json"))
    return str(body.get("status", {}).get("phase"))


def declare(state_dir: Path, image: str) -> str:
    name = f"drill-{uuid.uuid4().hex[:8]}"
    manifest = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {"image": image, "resources": {"memory": "512Mi", "cpu": "1"}},
    }
    path = state_dir / f"{name}.json"
    path.write_text(json.dumps(manifest))
    cli(state_dir, "apply", "-f", str(path))
    return name


async def unowned_pods(state_dir: Path) -> list[str]:
    """Pods of the state directory's store that no session of it owns."""
    listed = await podman.run_json(
        "pod", "ps", "--filter", f"label={STORE_LABEL}={store_tag(state_dir)}", "--format", "json"
    )
    owned = {
        str(s.status.get("podName") or podman_pod_name(s.namespace, s.name))
        for s in await LocalRuntime(Settings(state_dir=state_dir)).list()
    }
    return sorted(name for _, name in orphans(listed or [], owned))


def plays(state_dir: Path) -> list[int]:
    """pids of `podman kube play` processes of the state directory's pods."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if b"play" in argv and any(str(state_dir).encode() in a for a in argv):
            found.append(int(proc.name))
    return found


async def kill_gateway_mid_create(state_dir: Path) -> bool:
    """SIGKILL a gateway as soon as it plays a pod (its pool's, or the session it was
    asked for), then wait for that play to end; True if one was caught mid-way."""
    async with gateway(state_dir) as gw:
        call = await gw.start_call("create_session", {"variant": "minimal", "memory": "512Mi"})
        waiter = asyncio.create_task(gw.answer(call))
        deadline = time.monotonic() + CALL_DEADLINE
        while not plays(state_dir) and not waiter.done() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # a sample of /proc: no event says a process started
        caught = bool(plays(state_dir))
        gw.process.send_signal(signal.SIGKILL)
        await gw.process.wait()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    while plays(state_dir) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # the orphaned play runs on; nothing to wait on but it
    return caught


async def kill_gateway_mid_call(state_dir: Path, session: str, rounds: int) -> Outcome:
    """SIGKILL the gateway while a cell increments the counter; a new gateway takes over."""
    async with gateway(state_dir) as gw:
        r = await gw.run(session, "kept = 'intact'\ncounter = 0")
        if r["error"]:
            return Outcome("gateway", False, f"could not set up: {r['text']}")
    before_mounts, before_sockets = len(mounts(state_dir)), unix_sockets(state_dir)
    completed = 0
    for _ in range(rounds):
        async with gateway(state_dir) as gw:
            running = asyncio.Event()
            call = await gw.start_call(
                "execute_code",
                {"session_id": session, "code": CELL.format(seconds=1.5) + "counter += 1"},
            )
            waiter = asyncio.create_task(gw.answer(call, running=running))
            if not await runs(running, waiter):
                msg = waiter.result()
                return Outcome("gateway", False, f"a call ended before it ran: {str(msg)[:300]}")
            gw.process.send_signal(signal.SIGKILL)
            await gw.process.wait()
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        completed += 1
    caught_creating = await kill_gateway_mid_create(state_dir)
    async with gateway(state_dir) as gw:  # its first pass removes what no session owns
        r = await gw.run(session, "import json; print(json.dumps([kept, counter]))")
    # The session the killed gateway was creating, if its row was stored: a session like
    # any other, that `mcp-forge delete` removes with its pod and mounts.
    left = [s.name for s in await LocalRuntime(Settings(state_dir=state_dir)).list()]
    for name in left:
        if name != session:
            cli(state_dir, "delete", name)
    facts: dict[str, Any] = {
        "rounds": completed,
        "caught_creating": caught_creating,
        "phase": session_phase(state_dir, session),
        "orphan_pods": await unowned_pods(state_dir),
        "mounts_added": len(mounts(state_dir)) - before_mounts,
        "sockets_added": unix_sockets(state_dir) - before_sockets,
    }
    try:
        kept, counter = json.loads(r["structured"].get("stdout", "").strip())
    except (ValueError, TypeError):
        return Outcome("gateway", False, f"variables lost: {r['text'][:300]}", facts)
    facts["counter"] = counter
    ok = (
        kept == "intact"
        and caught_creating
        and counter == completed  # every cell the killed gateways started ran to its end
        and facts["phase"] == "Ready"
        and not facts["orphan_pods"]
        and facts["mounts_added"] <= 0
        and facts["sockets_added"] <= 0
    )
    detail = (
        f"{completed} SIGKILLs mid-call and one mid-create "
        f"({'caught' if caught_creating else 'NOT caught'} playing a pod); "
        f"session {facts['phase']}, variables "
        f"{'intact' if kept == 'intact' else 'LOST'}, counter {counter}/{completed}, "
        f"{len(facts['orphan_pods'])} orphan pods, {facts['mounts_added']:+d} mounts, "
        f"{facts['sockets_added']:+d} sockets"
    )
    return Outcome("gateway", ok, detail, facts)


async def kill_mid_call(
    state_dir: Path, session: str, drill: str, target: str, seconds: float = 30
) -> Outcome:
    """Kill `target` (a container, or a process by pid) while a cell of `seconds` runs;
    see what is said."""
    async with gateway(state_dir) as gw:
        running = asyncio.Event()
        call = await gw.start_call(
            "execute_code", {"session_id": session, "code": CELL.format(seconds=seconds)}
        )
        waiter = asyncio.create_task(gw.answer(call, running=running))
        if not await runs(running, waiter):
            msg = waiter.result()
            return Outcome(drill, False, f"the call ended before it ran: {str(msg)[:300]}")
        started = time.monotonic()
        if target.isdigit():
            os.kill(int(target), signal.SIGKILL)
        else:
            sh("podman", "kill", target)
        msg = await waiter
        answered = time.monotonic() - started
        result = msg.get("result") or {}
        status = (result.get("structuredContent") or {}).get("status", "?")
        said = (result.get("structuredContent") or {}).get("message", "")
        after = await gw.run(session, "'alive'")
    ok = after["structured"].get("status") == "ok" and status in ("died", "ok")
    detail = (
        f"the call answered {status!r} in {answered:.1f}s ({said[:160]!r}); "
        f"the next call: {after['structured'].get('status')!r}"
    )
    return Outcome(drill, ok, detail, {"status": status, "seconds": answered})


def container_of(session: str) -> str:
    return f"mcpforge-default-{session}-kernel"


def conmon_pid(container: str) -> str:
    return sh("podman", "inspect", "--format", "{{.State.ConmonPid}}", container).strip()


def infra_of(session: str) -> str:
    return sh("podman", "pod", "inspect", "--format", "{{.InfraContainerID}}",
              f"mcpforge-default-{session}").strip()  # fmt: skip


async def drills(rounds: int, image: str, only: set[str] | None = None) -> list[Outcome]:
    state_dir = Path(tempfile.mkdtemp(prefix="mfd-", dir="/tmp"))
    os.chmod(state_dir, 0o700)
    outcomes: list[Outcome] = []
    session = declare(state_dir, image)
    try:
        if not only or "gateway" in only:
            outcomes.append(await kill_gateway_mid_call(state_dir, session, rounds))
            print(outcomes[-1].line(), flush=True)
        if not only or "kernel" in only:
            outcomes.append(
                await kill_mid_call(state_dir, session, "kernel", container_of(session))
            )
            print(outcomes[-1].line(), flush=True)
        if not only or "infra" in only:
            outcomes.append(await kill_mid_call(state_dir, session, "infra", infra_of(session)))
            print(outcomes[-1].line(), flush=True)
        if not only or "conmon" in only:
            # The kernel outlives its monitor: the call ends with its cell, kept short.
            target = conmon_pid(container_of(session))
            outcomes.append(await kill_mid_call(state_dir, session, "conmon", target, seconds=4))
            print(outcomes[-1].line(), flush=True)
    finally:
        cli(state_dir, "delete", session)
        shutil.rmtree(state_dir, ignore_errors=True)
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="gateway SIGKILLs (default 20)")
    parser.add_argument("--image", default=MINIMAL_IMAGE)
    parser.add_argument("--only", action="append", choices=["gateway", "kernel", "infra", "conmon"])
    args = parser.parse_args()
    outcomes = asyncio.run(drills(args.rounds, args.image, set(args.only or ())))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
