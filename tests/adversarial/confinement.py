"""What a running host process can do, read from /proc: its ids, capabilities, limits,
namespaces, network interfaces, and which host files its root directory shows.

The tests that use it catch a process of the gateway's mid-way (its input held back) and
assert that it is confined: host-side work on a client's or a kernel's data (the host's
pip, the notebook export worker) runs as an unprivileged user with no capabilities, in
namespaces of its own, seeing none of the gateway's files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Confinement:
    pid: int
    uids: set[int]  # real, effective, saved, filesystem
    gids: set[int]
    groups: set[int]
    cap_effective: int
    cap_bounding: int
    no_new_privs: bool
    nice: int
    limits: dict[str, str]  # /proc/PID/limits: name -> soft limit
    own_mounts: bool  # a mount namespace other than this process's
    own_pids: bool
    own_network: bool
    interfaces: list[str]  # in its network namespace
    visible: list[str]  # the host paths asked about that its root directory shows

    def unprivileged(self) -> bool:
        return (
            0 not in self.uids | self.gids | self.groups
            and self.cap_effective == 0
            and self.cap_bounding == 0
            and self.no_new_privs
        )


def confinement(pid: int, host_paths: Iterable[Path]) -> Confinement:
    proc = Path(f"/proc/{pid}")
    status = dict(
        line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
    )
    ids: Callable[[str], set[int]] = lambda key: {int(v) for v in status[key].split()}  # noqa: E731
    limits = {}
    for line in (proc / "limits").read_text().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        limits[name] = soft
    same = lambda ns: os.readlink(proc / "ns" / ns) == os.readlink(f"/proc/self/ns/{ns}")  # noqa: E731
    dev = (proc / "net" / "dev").read_text().splitlines()[2:]
    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    return Confinement(
        pid=pid,
        uids=ids("Uid"),
        gids=ids("Gid"),
        groups=ids("Groups"),
        cap_effective=int(status["CapEff"], 16),
        cap_bounding=int(status["CapBnd"], 16),
        no_new_privs=status.get("NoNewPrivs", "0").strip() == "1",
        nice=int(stat[16]),
        limits=limits,
        own_mounts=not same("mnt"),
        own_pids=not same("pid_for_children") or not same("pid"),
        own_network=not same("net"),
        interfaces=[line.split(":", 1)[0].strip() for line in dev],
        visible=[str(p) for p in host_paths if os.path.lexists(f"{proc}/root{p}")],
    )


def processes(*, argv_has: bytes, environ_has: bytes | None = None) -> list[int]:
    """pids of Python processes (not their launchers) whose argv holds `argv_has` (and
    whose environment holds `environ_has`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not os.path.basename(argv[0]).startswith(b"python") or argv_has not in argv:
                continue
            if environ_has is not None and environ_has not in (proc / "environ").read_bytes():
                continue
            found.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return found
