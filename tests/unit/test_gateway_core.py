"""The gateway's core (gateway/core.py, its connections in gateway/connections.py)
against real ipykernels in local processes (tests/process_runtime.py: no pod, no store),
so its logic is tested in seconds: state kept between calls, output and errors collected,
bounds, a timeout and an interrupt that leave the kernel usable, a kernel's death named
and a fresh one started, a restart that clears variables, queued calls in order, bad
input refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from mcp_forge.api.status import termination_of
from mcp_forge.errors import InvalidRequest, SessionNotFound
from mcp_forge.gateway import busy
from mcp_forge.gateway.attach import silently
from mcp_forge.gateway.core import Gateway
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.jupyter.execution import ExecutionResult
from mcp_forge.runtimes.guard import STATE, guard_program
from mcp_forge.settings import Settings
from process_runtime import ProcessRuntime, process_runtime

DEADLINE = 30.0


def body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {},
    }


@pytest.fixture
async def core() -> AsyncIterator[tuple[Gateway, ProcessRuntime]]:
    settings = replace(Settings(), output_budget=20_000, interrupt_grace=5.0)
    async with process_runtime(settings) as runtime:
        gateway = Gateway(runtime, settings)
        await runtime.create(body("s"))
        try:
            yield gateway, runtime
        finally:
            await gateway.close()


async def test_state_is_kept_between_calls_and_output_is_collected(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, runtime = core
    first = await gateway.execute("s", "x = 41\nprint('set')")
    assert (first.status, first.stdout) == ("ok", "set\n")
    second = await gateway.execute("s", "import sys\nprint('e', file=sys.stderr)\nx + 1")
    assert second.status == "ok"
    assert second.stderr == "e\n"
    assert second.result is not None and second.result["data"] == {"text/plain": "42"}
    assert second.execution_count == first.execution_count + 1  # type: ignore[operator]
    assert ("s", False) in runtime.activity  # calls are activity


async def test_an_error_is_data_with_its_name_and_traceback(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, _ = core
    result = await gateway.execute("s", "def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    assert result.error is not None and result.error.ename == "ZeroDivisionError"
    assert any("f()" in line for line in result.error.traceback)
    assert (await gateway.execute("s", "print('after')")).stdout == "after\n"


async def test_output_over_the_budget_is_cut_and_says_so(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, _ = core
    result = await gateway.execute("s", "for i in range(20_000):\n    print('line', i)")
    assert result.status == "ok" and result.truncated
    assert len(result.stdout) < 40_000
    assert result.stdout.startswith("line 0\n")


async def test_a_timeout_interrupts_the_cell_and_the_kernel_keeps_its_state(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, _ = core
    await gateway.execute("s", "kept = 'yes'")
    result = await gateway.execute("s", "import time\ntime.sleep(60)", timeout=1)
    assert result.status == "timeout", result
    assert not result.state_lost
    assert (await gateway.execute("s", "print(kept)")).stdout == "yes\n"


async def sleeping_cell(gateway: Gateway) -> asyncio.Task[ExecutionResult]:
    """A call to session "s" whose cell sleeps a minute, once the cell has begun."""
    started = asyncio.Event()

    def seen(stream: str, text: str) -> None:
        if "sleeping" in text:
            started.set()

    call = asyncio.create_task(
        gateway.execute("s", "import time\nprint('sleeping', flush=True)\ntime.sleep(60)",
                        on_stream=seen)
    )  # fmt: skip
    await started.wait()
    return call


async def test_an_interrupt_stops_the_running_cell(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, _ = core
    async with asyncio.timeout(DEADLINE):
        call = await sleeping_cell(gateway)
        assert await gateway.interrupt("s")
        result = await call
    assert result.status in ("error", "interrupted"), result
    assert result.error is not None and result.error.ename == "KeyboardInterrupt", result
    assert (await gateway.execute("s", "print('next')")).stdout == "next\n"


async def test_a_dead_kernel_is_named_and_the_next_call_gets_a_fresh_one(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, runtime = core
    await gateway.execute("s", "x = 1")
    died = await gateway.execute("s", "import os\nos._exit(3)")
    assert died.status == "died", died
    assert died.state_lost
    after = await gateway.execute("s", "print('x' in dir())")
    assert after.stdout == "False\n"  # a new kernel: its variables are gone
    assert (await runtime.get("s")).status["restarts"] >= 1


@pytest.mark.parametrize("whose", ["its own", "another kernel's"])
async def test_a_death_is_named_from_the_record_of_whoever_is_replacing_the_pod(
    core: tuple[Gateway, ProcessRuntime], whose: str
) -> None:
    """The supervisor found the kernel OOM-killed, recorded why and removed its pod, and
    the new pod is not up when the call looks: the call names the recorded cause, not only
    a pod gone (once seen in CI under load); a record of another kernel's death is not
    taken for this one's."""
    gateway, runtime = core
    async with asyncio.timeout(DEADLINE):
        call = await sleeping_cell(gateway)
        oom = termination_of(137, oom=True, memory_limit="256Mi")
        runtime.replace_pod("s", oom, kernel="" if whose == "its own" else "another")
        died = await call
    assert died.status == "died" and died.message is not None, died
    if whose == "its own":
        assert "ran out of memory (limit 256Mi)" in died.message, died
    else:
        assert "out of memory" not in died.message and "pod is gone" in died.message, died
    after = await gateway.execute("s", "print('x' in dir())")
    assert (after.status, after.stdout) == ("ok", "False\n")


async def test_a_kernel_that_died_unwatched_is_restarted_before_the_first_call_runs(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    """The first connection dials a session read Ready while the runtime refreshes it
    (gateway/connections.py _connect); a refresh that finds the kernel dead starts another,
    and the call runs there, not on the connection to the dead one."""
    gateway, runtime = core
    await gateway.execute("s", "x = 1")
    await gateway.close()  # no connection is open when it dies
    runtime.kill("s")
    assert (await runtime.get("s")).status["phase"] == "Ready"  # as read: not yet refreshed
    async with asyncio.timeout(DEADLINE):
        after = await gateway.execute("s", "print('x' in dir())")
    assert (after.status, after.stdout) == ("ok", "False\n")  # a new kernel
    assert (await runtime.get("s")).status["restarts"] == 1


async def test_a_restart_clears_variables(core: tuple[Gateway, ProcessRuntime]) -> None:
    gateway, _ = core
    await gateway.execute("s", "y = 2")
    await gateway.restart("s")
    result = await gateway.execute("s", "y")
    assert result.status == "error" and result.error is not None
    assert result.error.ename == "NameError"


async def test_calls_to_one_session_run_one_after_another_in_order(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    gateway, _ = core
    await gateway.execute("s", "seen = []")
    calls = [
        gateway.execute("s", f"import time\ntime.sleep(0.05)\nseen.append({i})") for i in range(5)
    ]
    results = await asyncio.gather(*calls)
    assert [r.status for r in results] == ["ok"] * 5
    assert (await gateway.execute("s", "print(seen)")).stdout == "[0, 1, 2, 3, 4]\n"


@pytest.mark.parametrize(
    ("code", "timeout", "says"),
    [
        ("", None, "code is empty"),
        ("   \n", None, "code is empty"),
        (b"1", None, "code must be a string"),
        ("1", 0, "timeout must be more than 0"),
        ("1", True, "timeout must be a number"),
        ("1", "5", "timeout must be a number"),
    ],
)
async def test_bad_input_is_refused_and_names_what_was_wrong(
    core: tuple[Gateway, ProcessRuntime], code: Any, timeout: Any, says: str
) -> None:
    gateway, _ = core
    with pytest.raises(InvalidRequest, match=says):
        await gateway.execute("s", code, timeout=timeout)


async def test_a_session_that_is_not_there_is_named(core: tuple[Gateway, ProcessRuntime]) -> None:
    gateway, _ = core
    with pytest.raises(SessionNotFound, match="nope"):
        await gateway.execute("nope", "1")


async def test_a_kernel_keeps_the_guard_it_holds_until_code_runs_or_the_limits_differ(
    core: tuple[Gateway, ProcessRuntime],
) -> None:
    """runtimes/guard.py: the first connection's idle probe asks what guard the kernel
    holds; one it was given as it started, with the same limits, is kept (local mode gives
    it to every new kernel), and is installed again once a user cell has run."""
    gateway, runtime = core
    session = await runtime.get("s")
    conn = KernelConnection(
        await runtime.connection(session), max_frame=1_000_000, max_message=1_000_000
    )
    ask = {"guard": STATE, "begin": "id(get_ipython().kernel._mcp_forge_begin)"}
    try:
        await conn.wait_ready(DEADLINE)
        program = guard_program(gateway.settings)
        assert not program.held(
            await busy.check_idle(conn, busy.send_probe(conn, ask), session, DEADLINE)
        )
        await silently(conn, program.code, "the guard failed", DEADLINE)  # as local mode does
        given = await busy.check_idle(conn, busy.send_probe(conn, ask), session, DEADLINE)
        assert program.held(given)
        other = guard_program(replace(gateway.settings, output_budget=1234))
        assert not other.held(given)

        assert (await gateway.execute("s", "1 + 1")).status == "ok"  # the first connection
        kept = await busy.check_idle(conn, busy.send_probe(conn, ask), session, DEADLINE)
        assert kept["begin"] == given["begin"]  # not installed again
        assert not program.held(kept)  # a user cell ran: the next connection installs it

        await gateway.close()  # the next call connects anew
        assert (await gateway.execute("s", "2 + 2")).status == "ok"
        again = await busy.check_idle(conn, busy.send_probe(conn, ask), session, DEADLINE)
        assert again["begin"] != given["begin"]
    finally:
        conn.close()
