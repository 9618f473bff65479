"""The test cluster's processes: starting and stopping each component, and waiting for them.

Each component is a process of its own, started in a session of its own (it outlives
`cluster up`) and stopped by the PID in ROOT/run; its output goes to ROOT/logs. What it is
ready for is polled under a deadline, failing early, with the end of its log, when a component
started so far has died.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .cluster_common import (
    API_PORT,
    ETCD_PORT,
    NODE,
    ROOT,
    START_TIMEOUT,
    STOP_TIMEOUT,
    ClusterError,
    log,
    run,
)


def pidfile(name: str) -> Path:
    return ROOT / "run" / f"{name}.pid"


def running(name: str) -> int | None:
    """The PID of our `name` process, if one runs (checked by its executable, not just the PID)."""
    try:
        pid = int(pidfile(name).read_text())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    return pid if Path(exe).name == name else None


def start(name: str, argv: list[str], env: dict[str, str]) -> None:
    (ROOT / "logs").mkdir(parents=True, exist_ok=True)
    (ROOT / "run").mkdir(parents=True, exist_ok=True)
    with open(ROOT / "logs" / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # outlives `cluster up`; stopped by PID
        )
    pidfile(name).write_text(str(proc.pid))


def stop(name: str) -> None:
    pid = running(name)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not wait_gone(pid, STOP_TIMEOUT):
            # One API server SIGTERM hung past 40 s here: a deadline, then SIGKILL.
            log(f"{name} ({pid}) ignored SIGTERM for {STOP_TIMEOUT:.0f}s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_gone(pid, STOP_TIMEOUT)
    pidfile(name).unlink(missing_ok=True)


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited. Our children are reaped; others are polled in /proc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return True
        except ChildProcessError:
            pass  # not our child: look at /proc
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)  # polling a PID that is not ours: nothing to wait on
    return False


# --- readiness -------------------------------------------------------------------------------


def api_get(path: str, timeout: float = 5.0) -> Any:
    """GET on the API server as the admin (client certificate), decoded."""
    pki = ROOT / "pki"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    ip = (ROOT / "node-ip").read_text().strip()
    url = f"https://{ip}:{API_PORT}{path}"
    with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def wait_until(what: str, check: Any, timeout: float = START_TIMEOUT) -> None:
    """Poll `check()` (a process we do not control) until true, or fail naming the last error."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
            last = e
        dead = [n for n in started_so_far if running(n) is None]
        if dead:
            raise ClusterError(
                f"{dead[0]} exited while waiting for {what}; the end of {logfile(dead[0])}:\n"
                + log_tail(dead[0])
            )
        time.sleep(0.2)  # processes and an API we do not control: polled, under a deadline
    raise ClusterError(f"{what} not reached within {timeout:.0f}s (last error: {last})")


started_so_far: list[str] = []


def logfile(name: str) -> Path:
    return ROOT / "logs" / f"{name}.log"


def log_tail(name: str, lines: int = 25) -> str:
    """The last lines of a component's log (bounded: a log may be large), for an error."""
    try:
        with open(logfile(name), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def node_ready() -> bool:
    node = api_get(f"/api/v1/nodes/{NODE}")
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def etcd_healthy() -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{ETCD_PORT}/health", timeout=2) as r:
        return bool(json.loads(r.read()).get("health") == "true")


def kubectl(bins: Path, *args: str, input: str | None = None) -> str:
    return run(
        f"{bins}/kubectl", f"--kubeconfig={ROOT}/conf/admin.kubeconfig", *args, input=input
    ).stdout
