"""The egress proxy in cluster mode as a process of this test run (not confined: in its
pod it is the container's one process), for the tests of its cluster mode and of the
feeder.

tests/ is on sys.path: `from egress_proxy import Process`.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from mcp_forge.egress.client import default_python

DEADLINE = 5.0


class Process:
    """The proxy in cluster mode; its stderr drained (it blocks on a full pipe)."""

    def __init__(self, directory: Path, *flags: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.control_path = directory / "control.sock"
        self.audit_path = directory / "audit.sock"
        argv = [
            str(default_python()), "-I", "-m", "mcp_forge.egress.server",
            "--listen", "127.0.0.1:0", "--confdir", str(directory / "conf"),
            "--control-socket", str(self.control_path),
            "--audit-socket", str(self.audit_path), *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.listening = threading.Event()
        self.address = ("", 0)
        threading.Thread(target=self._drain, daemon=True).start()
        if not self.listening.wait(15):
            self.proc.kill()
            raise AssertionError(f"the proxy did not listen: {self.lines[-20:]}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if not self.listening.is_set() and '"listening"' in line:
                host, _, port = json.loads(line)["address"].rpartition(":")
                self.address = (host, int(port))
                self.listening.set()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(DEADLINE)
