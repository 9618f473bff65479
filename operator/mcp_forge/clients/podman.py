"""The Podman CLI, called asynchronously: for what Podman's API cannot do as well.

Local mode reaches Podman two ways. clients/podman_api.py (podman-py against the API
service) answers the small questions, and its event stream tells deaths; this module
runs `podman` for the rest. Measured side by side (tests/bench/bench_podman.py, 10 runs,
shared 2-core host, medians; a second run gave 17-32x, 1.2x, 0.6x and 215 ms):

    operation                 CLI       API      CLI/API
    inspect                   119 ms    7.0 ms   17x
    ps by label                96 ms    5.7 ms   17x
    image exists               71 ms    4.5 ms   16x
    logs --tail 20             76 ms    3.4 ms   22x
    kube play (same YAML)     484 ms    451 ms   1.1x   (Podman's own work dominates)
    pod rm -f -t 0            217 ms    480 ms   0.5x   (API: kill + DELETE; before the
                                                      stop that remove_pod now makes first)
    death noticed            ~5 s    192 ms           (the supervisor's `podman ps` every
                                                      10 s; back to back 152 ms, at a
                                                      process per 0.1 s; `podman events`
                                                      262 ms: the same file-event stream)

So the CLI stays for:
- `kube play` of a kernel pod: Podman 4.3.1's POST /play/kube has no replace, userns or
  seccomp-profile-root parameter, and the pod needs --userns=auto:uidmapping=… and our
  seccomp profile root. (Its create time would not move anyway: 1.1x.)
- `pod rm -f -t 0`: 4.3.1's DELETE /pods has no stop timeout; kill + forced delete was
  slower (0.5x and 0.6x of the CLI's median in two runs; both ways have multi-second
  outliers, Podman's own), and POST /pods/NAME/stop?t=0 made the service drop the
  connection.
- `podman wait` while a kernel starts: a cancellable process; the API's wait would hold
  a pool thread that nothing can cancel.
- image import and tagging (image/), and `podman info` in doctor: once per build.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_forge.clients import podman_locks
from mcp_forge.errors import PodmanError, PodmanTimeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: bytes
    stderr: str


def podman_binary() -> str | None:
    return os.environ.get("MCPFORGE_PODMAN") or shutil.which("podman")


@functools.cache
def workdir() -> str:
    """Where podman (and the conmon it starts for each container) runs: a directory of
    ours, never the caller's. conmon writes files to its working directory (an `oom`
    file after an OOM kill): they landed in whatever directory the gateway was started
    from, a checkout or an MCP client's project."""
    if os.geteuid() == 0:
        path = Path("/run/mcp-forge/podman")
    else:
        path = Path(tempfile.gettempdir()) / f"mcp-forge-podman-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(path)


STOP_PATIENCE = 5.0  # seconds remove_pod's `pod stop -t 0` may take (0.2 s when it works)


async def remove_pod(ref: str) -> bool:
    """`podman pod stop -t 0 REF` then `podman pod rm -f -t 0 REF`: True once it is
    removed, False if there was no such pod; PodmanError if it cannot be.

    Stopped first: a forced `pod rm` of a running pod kills its containers, whose conmons
    then run their exit command (`podman container cleanup`), which waits on the lock
    the `pod rm` holds while the `pod rm` waits for the pod's conmon cgroup to empty; on
    cgroup v1 it breaks the deadlock by killing them after ~3.4 s, on every removal
    (strace showed 300 EBUSY rmdirs of `<pod cgroup>/conmon`). `pod stop` cleans the
    containers up itself: stop plus rm took 0.25-0.4 s here against 3.4-3.5 s. But a
    stop waits for the exit status a container's conmon writes, and one whose conmon was
    killed never gets it: past STOP_PATIENCE the stop is given up and `pod rm -f` (which
    does not wait for it) removes the pod as before.

    Podman 4.3.1 sometimes panics (nil Volume in removePod) when pods are removed at the
    same time, or finds a container's /dev/shm still busy while its processes die (EBUSY,
    in a user namespace): either leaves the pod half removed, and a second `pod rm`
    finishes it. Tried three times."""
    try:
        stopped = await run("pod", "stop", "-t", "0", ref, check=False, timeout=STOP_PATIENCE)
    except PodmanError as exc:
        log.warning("podman did not stop pod %s (%s); removing it all the same", ref, exc)
    else:
        if stopped.returncode != 0 and "no pod with" in stopped.stderr.lower():
            return False
    for attempt in (1, 2, 3):
        done = await run("pod", "rm", "-f", "-t", "0", ref, check=False)
        if done.returncode == 0:
            return True
        if "no pod with" in done.stderr.lower():
            return False
        again = "panic:" in done.stderr or "resource busy" in done.stderr
        if not again or attempt == 3:
            raise PodmanError(["pod", "rm", ref], done.returncode, done.stderr)
        said = " ".join(done.stderr.split())[-200:]  # Podman's lines, blank ones too: one line
        log.info("podman left pod %s half removed (%s); removing it again", ref, said)
    raise AssertionError("unreachable")


async def run(
    *args: str,
    input: bytes | None = None,
    check: bool = True,
    timeout: float = 120.0,
    interruptible: bool = False,
) -> Completed:
    """Run `podman ARGS...`; raise PodmanError on a non-zero exit when `check`.

    Cancelled, it waits for podman to finish (see below), unless `interruptible`: a
    command that only waits or reads (`podman wait`), killed at once.
    """
    binary = podman_binary()
    if binary is None:
        raise PodmanError(list(args), 127, "podman is not installed (apt-get install podman runc)")
    proc = await asyncio.create_subprocess_exec(
        binary,
        *args,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir(),
        # Its own session: a Ctrl-C or SIGTERM aimed at our process group must not kill
        # podman halfway through removing a pod; we stop it ourselves if we must.
        start_new_session=True,
    )
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(input)
    except TimeoutError:
        try:
            found = podman_locks.holders()  # before ours is killed: who it waited for
        except (OSError, RuntimeError, ValueError):  # no home to find a user's store in
            found = []
        log.warning(
            "podman %s (pid %d): no answer in %gs; %s",
            " ".join(args[:2]),
            proc.pid,
            timeout,
            podman_locks.describe(found),
        )
        await _reap(proc)
        holding = frozenset(h.pid for h in found if not h.waiting and h.pid != proc.pid)
        raise PodmanTimeout(list(args), timeout, holding) from None
    except BaseException:
        if interruptible:
            await _reap(proc)
            raise
        # Cancelled while podman works: it is left to finish, within its timeout, and
        # waited for. Killed halfway, podman can leave one of its locks held, and every
        # later command needing that lock hangs (seen here as `kube play` timing out
        # after 120 s, once gateways stopped mid-play when their pool refilled).
        finishing = asyncio.ensure_future(_finish(proc, deadline))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(finishing)  # cancelled again: it still finishes
        raise
    assert proc.returncode is not None
    done = Completed(proc.returncode, out, err.decode(errors="replace"))
    if check and done.returncode != 0:
        error = PodmanError(list(args), done.returncode, done.stderr)
        log.warning("%s", error.detail)  # the client is told less (errors.PodmanError)
        raise error
    return done


async def _finish(proc: asyncio.subprocess.Process, deadline: float) -> None:
    """Wait for podman to end by itself until `deadline`; kill it only past that."""
    left = deadline - asyncio.get_running_loop().time()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(left, 0.0)):
            await proc.wait()
    await _reap(proc)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await asyncio.shield(proc.wait())


async def run_json(*args: str, timeout: float = 60.0) -> Any:
    done = await run(*args, timeout=timeout)
    text = done.stdout.decode().strip()
    return json.loads(text) if text else None
