"""confine.py: what the wrapper does when it cannot confine, and what it binds."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_forge import confine

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="confinement is for a root gateway")


def test_a_root_gateway_without_bubblewrap_refuses_and_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, setpriv or prlimit on it
    with pytest.raises(confine.ConfinementUnavailable) as refused:
        confine.command(["python", "-c", "1"], what="pip")
    message = str(refused.value)
    assert "pip must run unprivileged" in message and "bwrap" in message, message
    assert "apt-get install bubblewrap" in message, message


def test_the_working_directory_is_not_bound_though_it_is_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m` puts the working directory first on sys.path: a desktop client's
    project directory must not be in the sandbox."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "secret").write_text("x")
    program = f"import os; print(os.path.exists({str(tmp_path / 'secret')!r}))"
    argv = confine.command([sys.executable, "-I", "-c", program])
    assert str(tmp_path) not in argv
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == "False", done


def test_a_writable_directory_is_the_only_place_it_can_write(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir(mode=0o777)
    confine.give(mine)
    program = (
        "import sys\n"
        "for d in sys.argv[1:]:\n"
        "    try:\n"
        "        open(d + '/f', 'w').write('x'); print('wrote', d)\n"
        "    except OSError as e:\n"
        "        print('refused', d, type(e).__name__)\n"
    )
    argv = confine.command([sys.executable, "-I", "-c", program, str(mine), str(other), "/usr"],
                           writable=[mine], cwd=mine)  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.splitlines() == [
        f"wrote {mine}",
        f"refused {other} FileNotFoundError",  # not even there
        "refused /usr OSError",  # read-only
    ], done
    assert (mine / "f").stat().st_uid == confine.UID


def test_reap_is_bounded_when_a_left_behind_child_holds_the_pipes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A killed program whose child (as bwrap's, left behind) keeps its stdout open: a
    plain wait would last as long as that child; reap gives up after KILL_WAIT."""
    monkeypatch.setattr(confine, "KILL_WAIT", 0.5)

    async def run() -> int | None:
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", "sleep 60 & echo $!; exec sleep 60",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        child = int(await proc.stdout.readline())
        try:
            async with asyncio.timeout(10):
                await confine.reap(proc, "a test's program")
            return proc.returncode
        finally:
            os.kill(child, signal.SIGKILL)

    assert asyncio.run(run()) == -signal.SIGKILL  # the program itself was killed, reaped
