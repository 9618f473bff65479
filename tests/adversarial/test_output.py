"""Output floods: code that prints, displays or raises far more than a call may return.

The safe outcome of every case: the call ends with the code's own status (not a
timeout), returns the first part of the output, says what was cut, and names the
call's spill file, which read_file can open. Honest floods are bounded in the kernel
(kernelside/guard.py); the gateway bounds what it receives on its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import call, gateway, gateway_peak_rss, run, text, value

pytestmark = pytest.mark.podman

CALL = 120  # seconds a call may take before the test gives up (never a speed assertion)
MB = 10**6
# What one flood may add to the gateway's peak memory: the output budget (1 MB returned,
# 16 MB frames, 32 MB messages) with room for the allocator, far below the 174-207 MB
# that 100,000 small displays once cost.
FLOOD_MEMORY = 80 * MB
# Dishonest code: restore the kernel's own send, so the in-kernel output guard is gone.
GUARD_REMOVED = "k = get_ipython().kernel\nk.session.__dict__.pop('send', None)\n"
# What "seconds, not minutes" means for a flood the guard no longer bounds: the gateway
# notices the dropped channel at once; room for a loaded machine.
UNGUARDED_WITHIN = 15.0


async def spill(c: Any, r: dict[str, Any]) -> str:
    """The spill file the result names, read back through read_file."""
    path = r["full_output_path"]
    assert path and re.fullmatch(r"/workspace/\.mcp-forge/outputs/[\w-]+\.txt", path), r
    assert path in r["_text"]
    got = await call(c, "read_file", {"path": path, "session_id": r["session_id"]})
    assert not got.is_error, text(got)
    return text(got)


async def test_a_200_mb_print_returns_its_head_and_spill_file(state_dir: Path) -> None:
    """A 200 MB print in one cell: status ok, the first part of the output, a marker with
    the count cut, and the spill file holding more than was returned."""
    async with gateway(state_dir) as c:
        await run(c, "1")
        before = gateway_peak_rss(state_dir)
        r = await run(c, "print('HEAD' + 'x' * 200_000_000); 'after'", timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        grew = gateway_peak_rss(state_dir) - before
        assert grew < FLOOD_MEMORY, f"the gateway's peak memory grew by {grew / MB:.0f} MB"
        assert r["stdout"].startswith("HEADxxx")
        assert r["truncated"] is True
        assert re.search(r"output truncated: \d{6,} more characters", r["stdout"])
        assert r["result"]["data"]["text/plain"] == "'after'"
        body = await spill(c, r)
        assert body.startswith("HEADxxx") or "HEADxxx" in body[:10_000]
        assert len(r["stdout"]) < 200_000
        # The session goes on, with its variables.
        assert await value(c, "1 + 1") == 2


async def test_a_stderr_flood_in_many_writes_is_cut_and_spilled(state_dir: Path) -> None:
    """A million writes to stderr: the head comes back on stderr, the rest is in the file."""
    async with gateway(state_dir) as c:
        code = "import sys\nfor i in range(1_000_000):\n    sys.stderr.write(f'e{i}\\n')"
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stderr"].startswith("e0\ne1\n")
        assert r["truncated"] is True
        body = await spill(c, r)
        assert "e0\n" in body[:100] and "e200000\n" in body


async def test_a_150_mb_display_is_replaced_by_a_note(state_dir: Path) -> None:
    """display_data of 150 MB: the call ends ok, the display is a note naming its size."""
    async with gateway(state_dir) as c:
        code = (
            "from IPython.display import display\n"
            "display({'image/png': 'A' * 150_000_000, 'text/plain': 'big'}, raw=True)\n"
            "print('done')"
        )
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"].startswith("done")
        shown = r["displays"][0]["data"]
        assert "image/png" not in shown
        assert "150000000 bytes omitted" in shown["text/plain"]
        assert r["truncated"] is True


async def test_a_50_mb_exception_message_is_cut(state_dir: Path) -> None:
    """An exception whose message is 50 MB: status error with the exception's name and the
    start of its message, cut to a bound."""
    async with gateway(state_dir) as c:
        r = await run(c, "raise ValueError('BEGIN' + 'v' * 50_000_000)", timeout=CALL)
        assert r["status"] == "error", r["_text"][:2000]
        assert r["error"]["ename"] == "ValueError"
        assert r["error"]["evalue"].startswith("BEGINvvv")
        assert len(r["error"]["evalue"]) <= 20_000
        assert sum(len(line) for line in r["error"]["traceback"]) <= 200_000
        assert await value(c, "2 + 2") == 4


async def test_a_huge_execute_result_is_cut_and_spilled(state_dir: Path) -> None:
    """The last expression is a 30 MB string: the repr is cut, the rest is in the file."""
    async with gateway(state_dir) as c:
        r = await run(c, "'R' * 30_000_000", timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        shown = r["result"]["data"]["text/plain"]
        assert shown.startswith("'RRR") and len(shown) <= 200_000
        assert r["truncated"] is True
        body = await spill(c, r)
        assert "RRRR" in body


async def test_a_hundred_thousand_small_displays_are_bounded(state_dir: Path) -> None:
    """100,000 display_data messages: the call ends ok, returns a bounded number of them
    and says how many were omitted; the gateway's memory does not grow by hundreds of MB."""
    async with gateway(state_dir) as c:
        await run(c, "1")
        code = (
            "from IPython.display import display\n"
            "for i in range(100_000):\n"
            "    display({'text/plain': f'd{i}'}, raw=True)\n"
            "print('end')"
        )
        before = gateway_peak_rss(state_dir)
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        grew = gateway_peak_rss(state_dir) - before
        assert grew < FLOOD_MEMORY, f"the gateway's peak memory grew by {grew / MB:.0f} MB"
        assert r["displays"][0]["data"]["text/plain"] == "d0"
        assert len(r["displays"]) < 5_000
        assert re.search(r"\d+ displays omitted", r["stdout"]), r["stdout"][-500:]
        assert len(json.dumps(r["displays"])) < 2_000_000


async def test_an_update_display_flood_is_bounded(state_dir: Path) -> None:
    """50,000 updates of one display: bounded, the call ends ok."""
    async with gateway(state_dir) as c:
        code = (
            "from IPython.display import display\n"
            "h = display({'text/plain': 'v0'}, raw=True, display_id=True)\n"
            "for i in range(50_000):\n"
            "    h.update({'text/plain': f'v{i}' * 10}, raw=True)\n"
            "print('end')"
        )
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["stdout"].startswith("end")
        assert len(r["displays"]) < 5_000
        assert r["truncated"] is True


async def test_a_flood_written_to_fd_1_by_a_subprocess_is_cut(state_dir: Path) -> None:
    """A child process writes 50 MB straight to file descriptor 1: cut and spilled."""
    async with gateway(state_dir) as c:
        code = (
            "import subprocess\n"
            "subprocess.run(['python3', '-c', "
            '\'import os; os.write(1, b"SUB" + b"s" * 50_000_000)\'], check=True)\n'
            "print('parent done')"
        )
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        assert "SUBsss" in r["stdout"][:200_000]
        assert r["truncated"] is True
        assert len(r["stdout"]) < 300_000


async def test_a_flood_from_threads_is_cut(state_dir: Path) -> None:
    """Four threads print 10 MB each within the cell: bounded like the cell's own output."""
    async with gateway(state_dir) as c:
        code = (
            "import threading\n"
            "def f(n):\n"
            "    for _ in range(1000):\n"
            "        print(f'T{n}' * 5000)\n"
            "ts = [threading.Thread(target=f, args=(n,)) for n in range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print('joined')"
        )
        r = await run(c, code, timeout=CALL)
        assert r["status"] == "ok", r["_text"][:2000]
        assert r["truncated"] is True
        assert len(r["stdout"]) < 300_000
        await spill(c, r)


async def test_a_thread_s_late_output_never_lands_in_a_later_call(state_dir: Path) -> None:
    """A thread started by one cell prints after that cell ended: the later calls never
    show it (it belongs to the cell that started the thread, and is dropped as late)."""
    async with gateway(state_dir) as c:
        code = (
            "import threading, time\n"
            "go = threading.Event()\n"
            "def late():\n"
            "    go.wait()\n"
            "    for _ in range(50):\n"
            "        print('LATE-OUTPUT', flush=True)\n"
            "        time.sleep(0.01)\n"
            "    done.set()\n"
            "done = threading.Event()\n"
            "threading.Thread(target=late, daemon=True).start()"
        )
        first = await run(c, code)
        assert first["status"] == "ok"
        r = await run(c, "go.set(); done.wait(30); print('mine')")
        assert r["status"] == "ok"
        assert "LATE-OUTPUT" not in r["stdout"], r["stdout"]
        assert r["stdout"] == "mine\n"
        r = await run(c, "print('next')")
        assert "LATE-OUTPUT" not in r["stdout"]


async def test_a_flood_with_the_guard_removed_still_ends_with_an_answer(state_dir: Path) -> None:
    """Dishonest code restores the kernel's own send and prints 100 MB in one message: the
    gateway notices the dropped channel and answers with a clear note, not a timeout; and
    the session's next calls get their output (libzmq never reconnects a connection it
    dropped for an oversized frame: the gateway opens the channel anew)."""
    async with gateway(state_dir) as c:
        code = (
            "k = get_ipython().kernel\n"
            "k.session.__dict__.pop('send', None)\n"
            "print('X' * 100_000_000)"
        )
        r = await run(c, "print('before'); import sys; sys.stdout.flush()\n" + code, timeout=60)
        assert r["status"] == "ok", r["_text"][:2000]  # its reply still came: the code's own
        assert "channel was dropped" in r["message"], r
        assert r["stdout"].startswith("before")
        assert r["state_lost"] is False
        assert await value(c, "3 + 3") == 6
        shown = await run(c, "print('out again'); 7 * 6")
        assert shown["stdout"] == "out again\n" and shown["result"]["data"]["text/plain"] == "42"


async def unguarded(c: Any, state_dir: Path, code: str) -> dict[str, Any]:
    """Run `code` with the guard removed, after a flushed 'before': the call answers in
    seconds with the head that arrived and a note naming the dropped channel, the gateway's
    peak memory grows by less than FLOOD_MEMORY, and the session's next call shows its
    output. The result, for the case's own assertions."""
    await run(c, "1")
    before = gateway_peak_rss(state_dir)
    started = time.monotonic()
    head = "print('before'); import sys; sys.stdout.flush()\n"
    r = await run(c, head + GUARD_REMOVED + code, timeout=60)
    took = time.monotonic() - started
    grew = gateway_peak_rss(state_dir) - before
    print(f"answered in {took:.1f} s; the gateway's peak memory grew by {grew / MB:.0f} MB")
    assert r["status"] != "timeout", r["_text"][:2000]
    assert took < UNGUARDED_WITHIN, f"the call took {took:.1f} s"
    assert "channel was dropped" in r["message"], r
    assert r["stdout"].startswith("before"), r
    assert r["state_lost"] is False
    assert len(r["_text"]) < 2 * MB
    assert grew < FLOOD_MEMORY, f"the gateway's peak memory grew by {grew / MB:.0f} MB"
    shown = await run(c, "print('out again'); 7 * 6")
    assert shown["status"] == "ok", shown["_text"][:2000]
    assert shown["stdout"] == "out again\n" and shown["result"]["data"]["text/plain"] == "42"
    return r


async def test_a_150_mb_display_with_the_guard_removed_ends_with_an_answer(
    state_dir: Path,
) -> None:
    """Dishonest code restores the kernel's own send and displays 150 MB in one message:
    the call ends in seconds with the code's own status, the head that came before, a
    note that the channel was dropped and none of the 150 MB; the next call shows its
    output."""
    async with gateway(state_dir) as c:
        code = (
            "from IPython.display import display\n"
            "display({'image/png': 'A' * 150_000_000, 'text/plain': 'big'}, raw=True)"
        )
        r = await unguarded(c, state_dir, code)
        assert r["status"] == "ok", r["_text"][:2000]
        assert all("image/png" not in d["data"] for d in r["displays"]), r["displays"]


async def test_a_50_mb_exception_with_the_guard_removed_ends_with_an_answer(
    state_dir: Path,
) -> None:
    """Dishonest code restores the kernel's own send and raises an exception whose message
    is 50 MB (its error and its reply are each one oversized message): the call ends in
    seconds as an error, with the head that came before and a note that the channel was
    dropped; the next call shows its output."""
    async with gateway(state_dir) as c:
        r = await unguarded(c, state_dir, "raise ValueError('BEGIN' + 'v' * 50_000_000)")
        assert r["status"] == "error", r["_text"][:2000]
        assert "reply was lost too" in r["message"], r["message"]


async def test_many_concurrent_floods_on_one_session_each_get_their_answer(
    state_dir: Path,
) -> None:
    """Eight calls at once on one session, each printing 5 MB: each answer carries its own
    head and its own spill file."""
    async with gateway(state_dir) as c:
        await run(c, "1")
        code = "print('call-{i}:' + 'z' * 5_000_000)"
        results = await asyncio.gather(*(run(c, code.format(i=i), timeout=CALL) for i in range(8)))
        paths = set()
        for i, r in enumerate(results):
            assert r["status"] == "ok", r["_text"][:2000]
            assert r["stdout"].startswith(f"call-{i}:zzz")
            paths.add(r["full_output_path"])
        assert len(paths) == 8 and None not in paths
