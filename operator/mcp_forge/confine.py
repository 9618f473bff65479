"""Host-side work on untrusted data, confined: an unprivileged user in a bubblewrap
sandbox, with limits and a low priority.

Two host processes parse what a client or a kernel chose: the host's pip (requirement
names, and whatever the index answers for them) and the notebook worker (a journal kernel
code wrote). Neither runs package or kernel code, but both run parsers over hostile
input, and the gateway runs as root for rootful Podman. So `command` wraps them:

    prlimit (address space, CPU time, file size, open files, no core)
      nice -n 10 (below the gateway and the kernels; where coreutils' nice is)
        bwrap (mount, pid, ipc, uts and cgroup namespaces; network only if asked)
          setpriv (uid and gid 65534, no groups, no capabilities, no new privileges)
            the program

The sandbox's root is a fresh tmpfs holding, read-only, /usr, the few files of /etc a
program needs to resolve and trust a host (none when it has no network), this Python's
installation (the interpreter, the venv, our package: nothing else of their parents),
and, read-write, the directories the caller names (owned by the unprivileged user for
the run). The state directory, the kernels' keys, the gateway's working directory, /root
and /home are not in it. /tmp is its own, /proc shows only its own processes.

bubblewrap rather than our own namespace code: Flatpak's sandbox, small, audited, and a
Debian package; `setpriv` and `prlimit` are util-linux's. A gateway that does not run as
root needs no sandbox to be no-root (its work runs as its user, under the same limits);
one that does run as root and has no bwrap refuses the work (ConfinementUnavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import site
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mcp_forge
from mcp_forge import cpuweight
from mcp_forge.errors import ForgeError

log = logging.getLogger(__name__)

KILL_WAIT = 5.0  # seconds: a killed program's exit (and its pipes' close) waited for
UID = 65534  # "nobody": owns nothing on the host but the directories given to a run
NICE = 10
# What a networked program needs of /etc to resolve a name and trust a certificate.
ETC_NETWORK = (
    "resolv.conf", "hosts", "nsswitch.conf", "gai.conf", "host.conf",
    "ssl", "ca-certificates", "pki", "passwd", "group",
)  # fmt: skip
LIB_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class ConfinementUnavailable(ForgeError):
    """The gateway runs as root and cannot confine host-side work (no bubblewrap)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of a confined program (None: the host's)."""

    memory: int | None = None  # bytes of address space
    cpu_seconds: int | None = None
    file_size: int | None = None  # bytes of one file it writes
    open_files: int = 256


def needed() -> bool:
    """Whether host-side work must be confined: the gateway runs as root."""
    return os.geteuid() == 0


def available() -> str | None:
    """Why confinement cannot work here (None if it can): for `mcp-forge doctor`."""
    tools = ("prlimit", "bwrap", "setpriv") if needed() else ("prlimit",)
    missing = [c for c in tools if not shutil.which(c)]
    if missing:
        return f"{', '.join(missing)} not found: apt-get install bubblewrap util-linux"
    return None


def command(
    argv: Sequence[str],
    *,
    writable: Sequence[Path] = (),
    cwd: Path | None = None,
    network: bool = False,
    limits: Limits = Limits(),
    what: str = "this",
    readable: Sequence[Path] = (),
    user: tuple[int, int] = (UID, UID),
) -> list[str]:
    """`argv` wrapped as the module docstring says, to run in `cwd` (one of `writable`
    or below it; the sandbox's / if None), with `readable` bound read-only, as `user`
    (uid, gid: "nobody" unless a kernel's own ids are the ones its files need).
    ConfinementUnavailable if it cannot be."""
    why = available()
    if why:
        raise ConfinementUnavailable(
            f"{what} must run unprivileged and the gateway runs as root: {why}"
        )
    outer = [*cpuweight.prefix(), *_prlimit(limits)]
    if shutil.which("nice"):  # coreutils': not in every image (the gateway's has none)
        outer += [_tool("nice"), "-n", str(NICE)]
    if not needed():
        return [*outer, *argv]
    return [*outer, *_bwrap(writable, cwd, network, readable), *_setpriv(*user), *argv]


async def reap(proc: asyncio.subprocess.Process, what: str) -> None:
    """Kill `proc` if it still runs and wait, at most KILL_WAIT, for it to be gone.

    asyncio (3.11) wakes a wait for a process only once its pipes have closed too, and
    a child that bwrap, killed as it started it, left behind holds them open: its stdin
    is closed first (it reads to its end and exits), and the wait is bounded all the
    same (seen once in CI: a test that waited 300 s on a notebook worker). Shielded, so
    that a cancelled caller still reaps its child."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        async with asyncio.timeout(KILL_WAIT):
            await asyncio.shield(proc.wait())
    except TimeoutError:
        log.warning("%s: a killed program kept its pipes open", what)


async def probe() -> tuple[bool, str]:
    """Run a confined Python here: (whether it ran unprivileged, what to fix or who)."""
    why = available()
    if why:
        return False, why
    argv = command([sys.executable, "-I", "-c", "import os; print(os.geteuid())"], what="a probe")
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    uid = out.decode().strip()
    if proc.returncode != 0 or (needed() and uid != str(UID)):
        return False, f"exit {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"
    return True, f"uid {uid}"


def _tool(name: str) -> str:
    return shutil.which(name) or name


def give(path: Path, *, recursive: bool = False) -> None:
    """Make `path` the confined user's to write (a no-op when not running as root)."""
    if not needed():
        return
    paths: Iterable[Path] = [path]
    if recursive:
        paths = [path, *path.rglob("*")]
    for p in paths:
        st = p.lstat()
        if (st.st_uid, st.st_gid) != (UID, UID):
            os.lchown(p, UID, UID)


def _prlimit(limits: Limits) -> list[str]:
    args = [_tool("prlimit"), f"--nofile={limits.open_files}", "--core=0"]
    if limits.memory is not None:
        args.append(f"--as={limits.memory}")
    if limits.cpu_seconds is not None:
        args.append(f"--cpu={limits.cpu_seconds}")
    if limits.file_size is not None:
        args.append(f"--fsize={limits.file_size}")
    return [*args, "--"]


def _setpriv(uid: int = UID, gid: int = UID) -> list[str]:
    return [
        _tool("setpriv"), f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
        "--inh-caps=-all", "--bounding-set=-all", "--",
    ]  # fmt: skip


def _bwrap(
    writable: Sequence[Path], cwd: Path | None, network: bool, readable: Sequence[Path] = ()
) -> list[str]:
    args = [
        _tool("bwrap"), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
        "--unshare-uts", "--unshare-cgroup-try", "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    if not network:
        args.append("--unshare-net")
    for name in LIB_DIRS:
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    binds = [(p, p, "--ro-bind") for p in _python_roots()]
    if network:
        etc = (Path("/etc") / name for name in ETC_NETWORK)
        binds += [(p.resolve(), p, "--ro-bind") for p in etc if p.exists()]
    binds += [(p, p, "--ro-bind") for p in readable]
    binds += [(p, p, "--bind") for p in writable]
    made: set[Path] = {Path("/"), Path("/tmp"), Path("/usr")}
    bound: list[Path] = []
    for source, path, mode in binds:
        args += _parents(path, made, bound)
        args += [mode, str(source), str(path)]
        bound.append(path)
    if cwd is not None:
        args += ["--chdir", str(cwd)]
    return [*args, "--"]


def _parents(path: Path, made: set[Path], bound: list[Path]) -> list[str]:
    """Directories above `path` in the sandbox's root, searchable by all (bwrap would
    make them 0700, root's: the unprivileged user could not reach what is bound there);
    none inside what is bound already (they are there, as the host has them)."""
    args = []
    for parent in reversed(path.parents):
        if parent not in made and not any(parent.is_relative_to(b) for b in bound):
            args += ["--perms", "0755", "--dir", str(parent)]
            made.add(parent)
    return args


def _python_roots() -> list[Path]:
    """This Python's installation: its prefixes, its site-packages and our package's
    directory (an editable install's is the checkout's operator/), each as named and as
    resolved (a venv's interpreter is a link into its base), the outermost of each nest
    only, none under /usr (bound whole). Not the rest of sys.path: its first entry may
    be the gateway's working directory."""
    named = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    named += [p for p in site.getsitepackages() if os.path.isdir(p)]
    named.append(str(Path(mcp_forge.__file__).parent.parent))
    roots: list[Path] = []
    for text in named:
        for path in {Path(os.path.abspath(text)), Path(os.path.realpath(text))}:
            if path == Path("/") or path.is_relative_to("/usr"):
                continue
            if any(path.is_relative_to(r) for r in roots):
                continue
            roots = [r for r in roots if not r.is_relative_to(path)] + [path]
    return sorted(roots)
