"""What the noisy-neighbour drill checks is left on the host once every session is closed
and the gateway stopped (tests/drills/neighbours.py): processes, pods, scratch, files."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from pathlib import Path

from mcp_forge.runtimes.local.orphans import STORE_LABEL, store_tag


def gateway_family(root: int) -> dict[int, tuple[int, str]]:
    """`root`'s descendants now: pid → (start time, command line)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid = int(proc.name)
        children.setdefault(int(stat[1]), []).append(pid)
        info[pid] = (int(stat[19]), cmd.strip())
    found: dict[int, tuple[int, str]] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in info:
            found[pid] = info[pid]
            todo.extend(children.get(pid, []))
    return found


async def watch_family(root: int, seen: dict[int, tuple[int, str]], stop: asyncio.Event) -> None:
    """Record every process the gateway starts while it runs (pip, podman, upstreams)."""
    while not stop.is_set():
        seen.update(await asyncio.to_thread(gateway_family, root))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)  # a sample interval, not an event


def still_running(seen: dict[int, tuple[int, str]]) -> list[str]:
    """Those of `seen` still alive (same pid, same start time)."""
    left = []
    for pid, (started, cmd) in seen.items():
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[19]) == started:
                left.append(f"pid {pid}: {cmd[:160]}")
    return left


def naming(paths: list[Path]) -> list[str]:
    """Processes whose command line, working directory or environment names one of `paths`."""
    needles = [str(p).encode() for p in paths]
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd").encode()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if any(n in cmd or cwd.startswith(n) or n in env for n in needles):
            shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:160]
            left.append(f"pid {proc.name}: {shown}")
    return left


async def store_pods(state_dir: Path) -> list[str]:
    done = await asyncio.to_thread(
        subprocess.run,
        ["podman", "pod", "ps", "--filter", f"label={STORE_LABEL}={store_tag(state_dir)}",
         "--format", "{{.Name}}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return [f"podman pod ps failed: {done.stderr.strip()}"]
    return sorted(done.stdout.split())


def tmp_entries(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("mcp-forge-*")}


# What a state directory holds once its gateway stopped cleanly with no session left: the
# store, and the directories of kernels (k/) and of package installs' scratch (packages/),
# empty. pip's cache (cache/) may hold what installs downloaded: it is bounded
# (packages_cache_max) and kept on purpose. Anything else is a leftover, named.
STATE_FILES = ("store.db",)
STATE_EMPTY_DIRS = ("k", "packages")
STATE_KEPT_TREES = ("cache",)


def leftover_state(state_dir: Path) -> list[str]:
    """Entries of `state_dir` beyond those of a clean stop (see above), lock files named
    as such."""
    left = []
    for path in sorted(state_dir.rglob("*")):
        rel = path.relative_to(state_dir).as_posix()
        top = rel.split("/", 1)[0]
        if rel in STATE_FILES or rel in STATE_EMPTY_DIRS or top in STATE_KEPT_TREES:
            continue
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                left.append(f"directory {rel}/ (empty)")
            continue  # a directory's files are named one by one
        kind = "lock file" if "lock" in path.name else "file"
        left.append(f"{kind} {rel} ({path.lstat().st_size} bytes)")
    return left


def host_leftovers(
    state_dir: Path, work: Path, seen: dict[int, tuple[int, str]], tmp_before: set[str]
) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """What the run left, by kind (besides pods); the state directory's listing; the
    /tmp/mcp-forge-* entries that appeared on the host meanwhile."""
    left = {
        "processes": sorted(set(still_running(seen)) | set(naming([state_dir, work]))),
        # The gateway's TMPDIR (see running_gateway): everything in it is its leftover.
        "tmp": sorted(p.name for p in (work / "tmp").iterdir()),
        "packages_scratch": sorted(
            p.relative_to(state_dir).as_posix() for p in (state_dir / "packages").rglob("*")
        ),
        "state_files": leftover_state(state_dir),
    }
    listing = sorted(p.relative_to(state_dir).as_posix() for p in state_dir.rglob("*"))
    # Host-wide: other users of the host (tests running at once) make these too, so they
    # are reported, not held against the gateway.
    listing_tmp = sorted(tmp_entries(Path("/tmp")) - tmp_before)
    return left, listing, listing_tmp
