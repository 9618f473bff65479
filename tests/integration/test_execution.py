"""Executing code in real kernels in real Podman pods, through the gateway core."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_forge.errors import InvalidRequest, SessionNotFound

pytestmark = pytest.mark.podman


async def test_state_persists_across_executes(gateway, make_session) -> None:
    name = await make_session()
    assert (await gateway.execute(name, "x = 41")).status == "ok"
    result = await gateway.execute(name, "x + 1")
    assert result.status == "ok"
    assert result.result is not None
    assert result.result["data"]["text/plain"] == "42"


async def test_state_persists_across_separate_cli_processes(make_session, cli_env) -> None:
    name = await make_session()
    cli = [str(Path(sys.executable).parent / "mcp-forge")]
    first = await asyncio.to_thread(
        subprocess.run,
        [*cli, "exec", name, "-c", "x = 41"],
        env=cli_env,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr
    second = await asyncio.to_thread(
        subprocess.run,
        [*cli, "exec", name, "-c", "print(x + 1)"],
        env=cli_env,
        capture_output=True,
        text=True,
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout == "42\n"


async def test_a_new_gateway_reattaches_with_variables_intact(
    runtime, settings, make_session
) -> None:
    from mcp_forge.gateway.core import Gateway

    name = await make_session()
    first = Gateway(runtime, settings)
    await first.execute(name, "kept = {'a': 1}")
    await first.close()
    second = Gateway(runtime, settings)
    try:
        result = await second.execute(name, "kept['a']")
    finally:
        await second.close()
    assert result.result is not None
    assert result.result["data"]["text/plain"] == "1"


async def test_stdout_stderr_result_displays_and_count_are_captured(gateway, make_session) -> None:
    name = await make_session()
    code = (
        "import sys\n"
        "from IPython.display import display, HTML, Markdown\n"
        "print('to out')\n"
        "print('to err', file=sys.stderr)\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('*md*'))\n"
        "6 * 7"
    )
    r = await gateway.execute(name, code)
    assert r.status == "ok"
    assert r.stdout == "to out\n"
    assert r.stderr == "to err\n"
    assert r.result is not None and r.result["data"]["text/plain"] == "42"
    assert r.displays[0]["data"]["text/html"] == "<b>bold</b>"
    assert r.displays[1]["data"]["text/markdown"] == "*md*"
    assert r.execution_count == 1
    assert r.duration > 0


async def test_an_exception_is_an_error_result_with_a_clean_traceback(
    gateway, make_session
) -> None:
    name = await make_session()
    r = await gateway.execute(name, "def f():\n    return 1/0\nf()")
    assert r.status == "error"
    assert r.error is not None
    assert r.error.ename == "ZeroDivisionError"
    assert r.error.evalue == "division by zero"
    text = "\n".join(r.error.traceback)
    assert "\x1b[" not in text
    assert "return 1/0" in text


async def test_a_matplotlib_figure_arrives_as_png(gateway, make_session) -> None:
    name = await make_session("default")
    r = await gateway.execute(
        name, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert r.status == "ok", r.error
    pngs = [d["data"]["image/png"] for d in r.displays if "image/png" in d["data"]]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


async def test_a_busy_loop_times_out_and_keeps_earlier_variables(gateway, make_session) -> None:
    name = await make_session()
    await gateway.execute(name, "before = 'kept'")
    r = await gateway.execute(name, "while True: pass", timeout=2)
    assert r.status == "timeout"
    assert not r.state_lost
    assert "interrupted" in r.message
    assert r.duration < 2 + gateway.settings.interrupt_grace
    after = await gateway.execute(name, "before")
    assert after.result is not None and after.result["data"]["text/plain"] == "'kept'"


async def test_code_that_ignores_interrupts_is_restarted_and_reported_as_state_lost(
    gateway, make_session
) -> None:
    name = await make_session()
    await gateway.execute(name, "before = 1")
    stubborn = (
        "import time\n"
        "while True:\n"
        "    try:\n"
        "        time.sleep(10)\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
    )
    r = await gateway.execute(name, stubborn, timeout=2)
    assert r.status == "timeout"
    assert r.state_lost
    assert "restarted" in r.message and "variables are lost" in r.message
    after = await gateway.execute(name, "before")
    assert after.status == "error" and after.error is not None and after.error.ename == "NameError"
    assert (await gateway.execute(name, "1 + 1")).status == "ok"


async def test_os_exit_is_detected_named_and_the_session_recovers(
    gateway, runtime, make_session
) -> None:
    name = await make_session()
    r = await gateway.execute(name, "import os\nos._exit(3)")
    assert r.status == "died"
    assert r.state_lost
    assert "exited with code 3" in r.message
    status = (await runtime.get(name)).status
    assert status["restarts"] == 1
    assert status["lastTermination"]["reason"] == "Error"
    assert (await gateway.execute(name, "'alive'")).status == "ok"


async def test_a_call_waits_out_a_short_crash_loop_backoff_and_runs(
    gateway, runtime, make_session
) -> None:
    """Two deaths in a row within seconds of starting: the session backs off (5 s), and the
    next call waits for the restart instead of failing on a session that is Restarting."""
    name = await make_session()
    for _ in range(2):
        assert (await gateway.execute(name, "import os\nos._exit(3)")).status == "died"
    status = (await runtime.get(name)).status
    assert (status["phase"], status["reason"]) == ("Restarting", "CrashLoopBackOff"), status
    assert status["lastTermination"]["quickDeaths"] == 2, status
    r = await gateway.execute(name, "'alive'")
    assert (r.status, (r.result or {}).get("data")) == ("ok", {"text/plain": "'alive'"}), r
    assert (await runtime.get(name)).status["phase"] == "Ready"


async def test_a_memory_bomb_is_named_as_oom_and_the_session_recovers(
    gateway, runtime, make_session
) -> None:
    name = await make_session(resources={"memory": "256Mi", "cpu": "1"})
    r = await gateway.execute(
        name, "chunks = []\nwhile True:\n    chunks.append(bytearray(50_000_000))"
    )
    assert r.status == "died"
    assert "out of memory" in r.message and "OOM" in r.message
    status = (await runtime.get(name)).status
    assert status["lastTermination"]["reason"] == "OOMKilled"
    assert (await gateway.execute(name, "'alive'")).status == "ok"


async def test_interrupt_stops_a_running_cell_and_keeps_variables(gateway, make_session) -> None:
    name = await make_session()
    await gateway.execute(name, "kept = 5")
    started = asyncio.Event()

    def on_stream(stream: str, text: str) -> None:
        if "started" in text:
            started.set()

    running = asyncio.create_task(
        gateway.execute(
            name, "import time\nprint('started', flush=True)\ntime.sleep(60)", on_stream=on_stream
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    assert await gateway.interrupt(name)
    r = await asyncio.wait_for(running, 30)
    assert r.status == "interrupted"
    assert r.stdout == "started\n"
    kept = await gateway.execute(name, "kept")
    assert kept.result is not None and kept.result["data"]["text/plain"] == "5"


async def test_restart_clears_variables_and_keeps_workspace_files(gateway, make_session) -> None:
    name = await make_session()
    await gateway.execute(name, "x = 1\nopen('/workspace/note.txt', 'w').write('hello')")
    await gateway.restart(name)
    gone = await gateway.execute(name, "x")
    assert gone.error is not None and gone.error.ename == "NameError"
    assert (await gateway.read_file(name, "note.txt")) == b"hello"
    pid_check = await gateway.execute(name, "import os; os.getpid()")
    assert pid_check.status == "ok"


async def test_calls_on_one_session_are_queued_and_sessions_run_in_parallel(
    gateway, make_session
) -> None:
    a, b = await make_session(), await make_session()
    code = "import time\nt0 = time.time()\ntime.sleep(1)\n(t0, time.time())"

    def span(r) -> tuple[float, float]:
        start, end = r.result["data"]["text/plain"].strip("()").split(", ")
        return float(start), float(end)

    a1, a2, b1 = await asyncio.gather(
        gateway.execute(a, code), gateway.execute(a, code), gateway.execute(b, code)
    )
    (s1, e1), (s2, e2), (s3, e3) = span(a1), span(a2), span(b1)
    assert e1 <= s2 or e2 <= s1, "two calls on one session overlapped"
    assert s3 < max(e1, e2) and min(s1, s2) < e3, "two sessions did not run at the same time"


async def test_output_over_the_budget_is_truncated_and_saved_in_full(gateway, make_session) -> None:
    name = await make_session()
    budget = gateway.settings.output_budget
    r = await gateway.execute(name, f"print('x' * {budget * 3})")
    assert r.status == "ok"
    assert r.truncated
    assert len(r.stdout) < budget + 500
    assert "output truncated" in r.stdout
    assert r.full_output_path is not None and r.full_output_path in r.stdout
    saved = await gateway.read_file(name, r.full_output_path)
    assert saved == b"x" * (budget * 3) + b"\n"


async def test_output_of_another_request_is_never_given_to_this_one(
    gateway, runtime, make_session
) -> None:
    from mcp_forge.jupyter.client import KernelConnection

    name = await make_session()
    await gateway.execute(name, "1")  # the gateway is connected
    # Another client (another gateway process, say) sends a request first: its output
    # reaches every IOPub subscriber while the gateway waits for its own.
    other = KernelConnection(
        await runtime.connection(await runtime.get(name)), max_frame=10**6, max_message=10**6
    )
    try:
        await other.wait_ready(30)
        other.send_execute(
            "import time\nfor i in range(10):\n    print('other', i, flush=True)\n"
            "    time.sleep(0.05)",
            silent=False,
            store_history=True,
        )
        mine = await gateway.execute(name, "print('mine')")
    finally:
        other.close()
    assert mine.status == "ok"
    assert mine.stdout == "mine\n"


async def test_a_timed_out_cell_s_output_stays_with_it(gateway, make_session) -> None:
    name = await make_session()
    r1 = await gateway.execute(
        name,
        "import time\n"
        "for i in range(100):\n"
        "    print('first', i, flush=True)\n"
        "    time.sleep(0.05)",
        timeout=1,
    )
    assert r1.status == "timeout"
    assert "first 0" in r1.stdout
    r2 = await gateway.execute(name, "print('second')")
    assert r2.stdout == "second\n"


async def test_bad_input_gets_a_clear_error(gateway, make_session) -> None:
    name = await make_session()
    with pytest.raises(InvalidRequest, match="code is empty"):
        await gateway.execute(name, "   \n")
    with pytest.raises(InvalidRequest, match="limit"):
        await gateway.execute(name, "x" * (gateway.settings.code_max + 1))
    with pytest.raises(InvalidRequest, match="timeout"):
        await gateway.execute(name, "1", timeout=-1)
    with pytest.raises(SessionNotFound, match="no-such"):
        await gateway.execute("no-such", "1")
    assert (await gateway.execute(name, "'still fine'")).status == "ok"


async def test_a_segfault_is_detected_and_named_by_its_signal(gateway, make_session) -> None:
    name = await make_session()
    r = await gateway.execute(name, "import ctypes\nctypes.string_at(0)")
    assert r.status == "died"
    assert "SIGSEGV" in r.message
    assert (await gateway.execute(name, "'alive'")).status == "ok"


async def test_a_cancelled_call_interrupts_its_code_and_keeps_variables(
    gateway, make_session
) -> None:
    name = await make_session()
    started = asyncio.Event()
    task = asyncio.create_task(
        gateway.execute(
            name,
            "import time\nkept = 7\nprint('started', flush=True)\ntime.sleep(60)",
            on_stream=lambda _, text: started.set(),
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    await asyncio.sleep(0)  # a second cancellation while the first is being handled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await asyncio.wait_for(gateway.execute(name, "kept"), 30)
    assert after.result is not None and after.result["data"]["text/plain"] == "7"


@pytest.mark.parametrize("moment", ["before_request", "send_execute"])
async def test_a_call_cancelled_as_its_code_is_sent_stops_it_and_keeps_variables(
    gateway, make_session, monkeypatch, moment
) -> None:
    """Cancelled just before its code is sent (nothing to stop), or just after, when the
    interrupt reaches the kernel before it began the cell and ipykernel ignores SIGINT:
    either way the next call runs at once, on the same variables, with no restart."""
    from mcp_forge.jupyter.client import KernelConnection

    name = await make_session()
    await gateway.execute(name, "kept = 7")
    original = getattr(KernelConnection, moment)

    def then_cancel(self, *args, **kwargs):
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # delivered at the call's next await
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KernelConnection, moment, then_cancel)
    task = asyncio.create_task(gateway.execute(name, "import time\ntime.sleep(60)\nafter = 1"))
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(KernelConnection, moment, original)
    after = await asyncio.wait_for(gateway.execute(name, "('after' in globals(), kept)"), 30)
    assert after.state_lost is False and after.result is not None, after
    assert after.result["data"]["text/plain"] == "(False, 7)"


async def test_a_long_call_counts_as_activity_and_is_not_culled(
    gateway, runtime, make_session
) -> None:
    from mcp_forge.runtimes.local.supervisor import supervise_once

    name = await make_session(idleTimeout="60s")
    runtime.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
    started = asyncio.Event()
    task = asyncio.create_task(
        gateway.execute(
            name,
            "import time\nprint('started', flush=True)\ntime.sleep(2)",
            on_stream=lambda _, text: started.set(),
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    assert name not in await supervise_once(runtime)
    assert (await task).status == "ok"


# Code that runs after the kernel announced a cell (its execute_input) and before the
# cell's own code: an input transformer, as IPython extensions install. A KeyboardInterrupt
# there escapes ipykernel's handler, which then publishes idle and sends no reply.
SLOW_START = """
import time
def _slow_start(lines):
    if lines and lines[0].startswith("# slow start"):
        print("begun", flush=True)
        time.sleep(30)
    return lines
get_ipython().input_transformers_post.append(_slow_start)
kept = 7
"""


async def _slow_cell_begun(gateway, make_session, **kw) -> tuple[str, asyncio.Task]:
    """A session with SLOW_START, running a slow-start cell that has begun (its input
    transformer printed): the window where an interrupt gets no reply."""
    name = await make_session()
    await gateway.execute(name, SLOW_START)
    begun = asyncio.Event()
    task = asyncio.create_task(
        gateway.execute(
            name,
            "# slow start\nafter = 1",
            on_stream=lambda _, text: begun.set() if "begun" in text else None,
            **kw,
        )
    )
    await asyncio.wait_for(begun.wait(), 30)
    return name, task


async def _assert_kept(gateway, name: str) -> None:
    after = await asyncio.wait_for(gateway.execute(name, "('after' in globals(), kept)"), 30)
    assert after.state_lost is False and after.result is not None, after
    assert after.result["data"]["text/plain"] == "(False, 7)"


async def test_an_interrupt_as_a_cell_begins_ends_the_call_at_once_with_variables_kept(
    gateway, make_session
) -> None:
    """ipykernel answers such an interrupt with no execute_reply: the call is not left
    waiting for one until its timeout, and the kernel is not restarted."""
    name, running = await _slow_cell_begun(gateway, make_session, timeout=120)
    assert await gateway.interrupt(name)
    r = await asyncio.wait_for(running, 20)
    assert r.status == "interrupted" and not r.state_lost, r
    assert "no reply" in r.message, r
    await _assert_kept(gateway, name)


async def test_a_call_cancelled_as_its_cell_begins_keeps_the_kernel_and_its_variables(
    gateway, make_session
) -> None:
    """The cancel's interrupt lands before the cell's code: no reply comes, and the
    cancel is settled at once rather than by a restart once its grace ran out."""
    name, task = await _slow_cell_begun(gateway, make_session)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_kept(gateway, name)
