"""Host resources: a kernel tries to take the host's disk, memory, processes or identity.

Sessions are declared in the test's state dir through the local runtime (so each can
have its own workspace size, memory and env), and attacked through the real gateway
over stdio, as a model would. Each case asserts the safe outcome and its evidence: the
error the kernel got, what the host still has, the session's status.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.errors import SessionNotFound
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.runtimes.local.volumes import TMP_INODES, TMP_SIZE, workspace_inodes
from mcp_forge.sandbox import KERNEL_UID
from mcp_forge.settings import Settings
from support import scratch_state_dir

from .conftest import gateway, run, text, value

pytestmark = pytest.mark.podman

MINIMAL = "localhost/mcp-forge-kernel:0.1.0-minimal"
MiB = 2**20


@pytest.fixture(scope="module")
def host_dir() -> Iterator[Path]:
    with scratch_state_dir("mfh-") as path:
        yield path


@pytest.fixture(scope="module")
def runtime(host_dir: Path) -> LocalRuntime:
    return LocalRuntime(Settings(state_dir=host_dir, kernel_ready_timeout=60))


@pytest.fixture
async def declare(runtime: LocalRuntime) -> AsyncIterator[Any]:
    """Declare sessions with the spec a case needs; delete them after the case."""
    made: list[str] = []

    async def make(*, workspace: str = "32Mi", memory: str = "512Mi", **spec: Any) -> KernelSession:
        name = f"h-{uuid.uuid4().hex[:8]}"
        body = {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": name},
            "spec": {
                "image": MINIMAL,
                "resources": {"memory": memory, "cpu": "1"},
                "workspace": {"size": workspace},
                **spec,
            },
        }
        made.append(name)
        return (await runtime.apply(body)).session

    yield make
    for name in made:
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)


def allocated(path: Path) -> int:
    """Bytes of the host's disk a file really takes (a sparse file takes less than its size)."""
    return path.stat().st_blocks * 512


def host_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def kernel_pids(runtime: LocalRuntime, session: KernelSession) -> list[int]:
    cgroup = runtime.store.private(session.namespace, session.name)["cgroup"]
    for root in (
        Path("/sys/fs/cgroup/pids"),
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup"),
    ):
        procs = root / cgroup / "cgroup.procs"
        if procs.is_file():
            return [int(p) for p in procs.read_text().split()]
    raise AssertionError(f"no cgroup.procs for {cgroup}")


def host_uids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(u) for u in line.split()[1:]]
    raise AssertionError("no Uid line")


def mounts() -> str:
    return Path("/proc/mounts").read_text()


def loop_devices() -> str:
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout


def session_dir(runtime: LocalRuntime, session: KernelSession) -> Path:
    return Path(runtime.host_paths(session).workspace).parent


# ---- the workspace ----------------------------------------------------------------------


async def test_a_one_tib_sparse_file_in_the_workspace_is_refused(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: a 1 TiB sparse file (truncate) in a 32Mi workspace, then writes at its end."""
    async with gateway(host_dir) as client:
        session = await declare(workspace="32Mi")
        r = await run(
            client,
            "err = None\n"
            "try:\n"
            "    with open('/workspace/big', 'wb') as f:\n"
            "        f.truncate(2**40); f.seek(2**40 - 1); f.write(b'x')\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "print('ERR', err)",
            session_id=session.name,
        )
        got = r["stdout"].strip()
        assert got.startswith("ERR"), got
        assert got.split()[1] in ("27", "28"), got  # EFBIG or ENOSPC
        size = os.stat(Path(runtime.host_paths(session).workspace) / "big").st_size
        assert size <= 32 * MiB, f"the kernel made a {size}-byte file in a 32Mi workspace"
        image = session_dir(runtime, session) / "workspace.img"
        assert allocated(image) <= 32 * MiB


async def test_filling_the_workspace_ends_in_enospc_and_the_host_keeps_its_disk(
    declare: Any, runtime: LocalRuntime, host_dir: Path
) -> None:
    """Attack: write 96 MB of real data into a 32Mi workspace, to eat the host's disk."""
    async with gateway(host_dir) as client:
        session = await declare(workspace="32Mi")
        before = host_free(host_dir)
        r = await run(
            client,
            "import os\nwritten = 0\nerr = None\n"
            "try:\n"
            "    with open('/workspace/fill', 'wb') as f:\n"
            "        for _ in range(96):\n"
            "            f.write(os.urandom(2**20)); written += 2**20\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "print(written, err)",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        written, err = r["stdout"].split()
        assert err in ("28", "27"), r["stdout"]  # ENOSPC (or EFBIG at the file-size bound)
        assert int(written) <= 32 * MiB
        image = session_dir(runtime, session) / "workspace.img"
        assert allocated(image) <= 32 * MiB
        # Others share this disk: allow them some, but never the 96 MB the kernel asked for.
        assert before - host_free(host_dir) < 64 * MiB


async def test_many_small_files_stop_at_the_inode_bound(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: empty files until the filesystem says no (inodes, not bytes)."""
    async with gateway(host_dir) as client:
        session = await declare(workspace="32Mi")
        bound = workspace_inodes(32 * MiB)
        r = await run(
            client,
            "import os\nn = 0\nerr = None\nos.makedirs('/workspace/many', exist_ok=True)\n"
            f"while n < {bound * 3}:\n"
            "    try:\n"
            "        open(f'/workspace/many/{n}', 'w').close(); n += 1\n"
            "    except OSError as e:\n"
            "        err = e.errno; break\n"
            "print(n, err)",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        n, err = r["stdout"].split()
        assert err == "28", r["stdout"]  # ENOSPC: out of inodes
        assert int(n) <= bound
        assert os.statvfs(runtime.host_paths(session).workspace).f_files <= bound


async def test_one_sessions_workspace_is_not_visible_from_another(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: find another session's files (through /workspace, mounts, the host path)."""
    async with gateway(host_dir) as client:
        a = await declare()
        b = await declare()
        secret = uuid.uuid4().hex
        await run(client, f"open('/workspace/note', 'w').write({secret!r})", session_id=a.name)
        host_path = str(Path(runtime.host_paths(a).workspace) / "note")
        await run(client, "import os", session_id=b.name)
        seen = await value(
            client,
            "{'ls': os.listdir('/workspace'), 'mounts': open('/proc/mounts').read(),"
            f" 'host': os.path.exists({host_path!r})}}",
            session_id=b.name,
        )
        assert "note" not in seen["ls"]
        assert (
            secret not in seen["mounts"] and runtime.host_paths(a).workspace not in seen["mounts"]
        )
        assert seen["host"] is False
        assert (Path(runtime.host_paths(a).workspace) / "note").read_text() == secret


async def test_the_workspace_keeps_its_files_across_a_kernel_restart(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Robustness: the bounded workspace is the same filesystem after a restart."""
    async with gateway(host_dir) as client:
        session = await declare()
        await run(client, "open('/workspace/kept', 'w').write('yes')", session_id=session.name)
        r = await client.call_tool("restart_kernel", {"session_id": session.name})
        assert not r.is_error, text(r)
        assert (
            await value(client, "open('/workspace/kept').read()", session_id=session.name) == "yes"
        )
        fstype = await value(
            client,
            "[l.split()[2] for l in open('/proc/mounts') if l.split()[1] == '/workspace']",
            session_id=session.name,
        )
        assert fstype == ["ext4"]


# ---- /tmp and /dev/shm ------------------------------------------------------------------


async def test_tmp_is_a_bounded_tmpfs_charged_to_the_kernels_memory(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: fill /tmp (in docs/security.md, memory) to reach the host's disk or memory."""
    async with gateway(host_dir) as client:
        # RLIMIT_FSIZE is the workspace size: a big one, so that only /tmp's bound is met.
        session = await declare(memory="1Gi", workspace="1Gi")
        tmp = Path(runtime.host_paths(session).tmp or "")
        before = (await runtime.memory_usage([session]))[session.name]
        r = await run(
            client,
            "import os\nwritten = 0\nerr = None\n"
            "try:\n"
            "    with open('/tmp/fill', 'wb') as f:\n"
            "        for _ in range(400):\n"
            "            f.write(b'x' * 2**20); written += 2**20\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "print(written, err, [m.split()[2] for m in open('/proc/mounts')"
            " if m.split()[1] == '/tmp'])",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        written, err, fstype = r["stdout"].split(maxsplit=2)
        assert err == "28" and int(written) <= TMP_SIZE, r["stdout"]
        assert "tmpfs" in fstype
        assert (
            allocated(tmp / "fill") == 0
            or os.statvfs(tmp).f_blocks * os.statvfs(tmp).f_frsize <= TMP_SIZE
        )
        after = (await runtime.memory_usage([session]))[session.name]
        # The tmpfs pages are the kernel's memory: its cgroup holds most of the 256Mi now.
        assert after - before > 200 * MiB, (before, after)


async def test_dev_shm_is_bounded(declare: Any, host_dir: Path) -> None:
    """Attack: fill /dev/shm (another tmpfs) past any bound."""
    async with gateway(host_dir) as client:
        session = await declare(memory="1Gi", workspace="1Gi")
        r = await run(
            client,
            "written = 0\nerr = None\n"
            "try:\n"
            "    with open('/dev/shm/fill', 'wb') as f:\n"
            "        for _ in range(400):\n"
            "            f.write(b'x' * 2**20); written += 2**20\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "print(written, err)",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        written, err = r["stdout"].split()
        assert err == "28" and int(written) <= 64 * MiB, r["stdout"]


# ---- processes and memory ---------------------------------------------------------------


async def test_a_fork_bomb_stops_at_the_pids_limit(declare: Any, host_dir: Path) -> None:
    """Attack: fork until the host runs out of processes."""
    async with gateway(host_dir) as client:
        session = await declare(resources={"memory": "512Mi", "cpu": "1", "pids": 64})
        r = await run(
            client,
            "import os, signal, time\nkids = []\nerr = None\n"
            "try:\n"
            "    for _ in range(1000):\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            time.sleep(30); os._exit(0)\n"
            "        kids.append(pid)\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "for k in kids:\n"
            "    os.kill(k, signal.SIGKILL); os.waitpid(k, 0)\n"
            "print(len(kids), err)",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        n, err = r["stdout"].split()
        assert err == "11" and int(n) < 64, r["stdout"]  # EAGAIN at the pids limit
        assert await value(client, "1 + 1", session_id=session.name) == 2


async def test_a_memory_bomb_is_oom_killed_and_named_with_its_limit(
    declare: Any, host_dir: Path
) -> None:
    """Attack: allocate past the memory limit, to push the host into swap or its OOM killer."""
    async with gateway(host_dir) as client:
        session = await declare(memory="256Mi")
        r = await run(client, "x = bytearray(1024 * 2**20)", session_id=session.name)
        assert r["status"] == "died", r["_text"]
        assert "out of memory" in r["_text"] and "256Mi" in r["_text"], r["_text"]
        assert await value(client, "1 + 1", session_id=session.name) == 2


# ---- identity ---------------------------------------------------------------------------


async def test_the_kernel_runs_in_a_user_namespace(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: be host uid 1000 (a real account) or, as container root, host root."""
    async with gateway(host_dir) as client:
        session = await declare()
        await run(client, "import os", session_id=session.name)
        inside = await value(
            client,
            "{'uid': os.getuid(), 'map': open('/proc/self/uid_map').read().split(),"
            " 'gmap': open('/proc/self/gid_map').read().split()}",
            session_id=session.name,
        )
        assert inside["uid"] == KERNEL_UID
        first, host, count = (int(x) for x in inside["map"][:3])
        assert first == 0 and host not in (0, KERNEL_UID), inside  # root inside is not host root
        assert count < 2**32 - 1, inside  # not the identity map "0 0 4294967295"
        assert int(inside["gmap"][1]) not in (0, KERNEL_UID), inside
        pids = kernel_pids(runtime, session)
        assert pids
        for pid in pids:
            assert all(u == host + KERNEL_UID for u in host_uids(pid)), (pid, host_uids(pid))


async def test_files_the_kernel_writes_are_owned_on_the_host_by_its_mapped_uid(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: leave files owned by host uid 1000 (a real user) in the host's state dir."""
    async with gateway(host_dir) as client:
        session = await declare()
        await run(client, "open('/workspace/mine', 'w').write('x')", session_id=session.name)
        host = Path(runtime.host_paths(session).workspace) / "mine"
        uid = host.stat().st_uid
        assert uid not in (0, KERNEL_UID), uid
        mapped = await value(
            client, "int(open('/proc/self/uid_map').read().split()[1])", session_id=session.name
        )
        assert uid == mapped + KERNEL_UID


# ---- lifecycle --------------------------------------------------------------------------


async def test_a_kernel_that_dies_at_every_start_backs_off_and_says_why(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: a sitecustomize on the kernel's PYTHONPATH that kills every new kernel."""
    async with gateway(host_dir) as client:
        session = await declare(env=[{"name": "PYTHONPATH", "value": "/workspace"}])
        r = await run(
            client,
            "open('/workspace/sitecustomize.py', 'w').write('import os\\nos._exit(3)\\n')\n"
            "import os; os._exit(1)",
            session_id=session.name,
        )
        assert r["status"] == "died", r["_text"]
        # Restarted at once; that kernel died starting: a crash loop, held back and named.
        status = (await runtime.get(session.name)).status
        assert status["phase"] == "Restarting", status
        assert status["reason"] == "CrashLoopBackOff", status
        assert int(status["restarts"]) >= 2, status
        message = status.get("message") or ""
        assert "exited while starting" in message, status
        assert "next start in" in message, status
        assert "no cgroup path" not in message, status
        # The next call waits out the short backoff, sees that kernel die too, and is
        # answered with why, not with a podman error.
        first = int(status["restarts"])
        again = await client.call_tool("execute_code", {"code": "1", "session_id": session.name})
        said = text(again)
        assert again.is_error, said
        assert "no cgroup path" not in said and "in a row within 10s of starting" in said, said
        status = (await runtime.get(session.name)).status
        assert int(status["restarts"]) == first + 1, status
        assert status["lastTermination"]["quickDeaths"] >= 3, status
        assert status["reason"] == "CrashLoopBackOff"
        assert "next start in" in (status.get("message") or ""), status


async def test_delete_leaves_no_mount_loop_device_or_directory(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Cleanup: a deleted session leaves nothing mounted, no loop device, no files."""
    async with gateway(host_dir) as client:
        session = await declare()
        await run(client, "open('/workspace/f', 'w').write('x' * 4096)", session_id=session.name)
        base = session_dir(runtime, session)
        assert str(base) in mounts()
        await runtime.delete(session.name)
        assert str(base) not in mounts()
        assert str(base) not in loop_devices()
        assert not base.exists()


async def test_many_small_files_in_tmp_stop_at_its_inode_bound(
    declare: Any, host_dir: Path, runtime: LocalRuntime
) -> None:
    """Attack: empty files in /tmp (memory, with no byte to count) until it says no."""
    async with gateway(host_dir) as client:
        session = await declare()
        r = await run(
            client,
            "n = 0\nerr = None\n"
            f"while n < {TMP_INODES * 3}:\n"
            "    try:\n"
            "        open(f'/tmp/f{n}', 'w').close(); n += 1\n"
            "    except OSError as e:\n"
            "        err = e.errno; break\n"
            "print(n, err)",
            session_id=session.name,
        )
        assert r["status"] == "ok", r["_text"]
        n, err = r["stdout"].split()
        assert err == "28" and int(n) <= TMP_INODES, r["stdout"]
        assert os.statvfs(runtime.host_paths(session).tmp or "").f_files <= TMP_INODES


async def test_a_full_workspace_leaves_a_neighbours_workspace_writable(
    declare: Any, host_dir: Path
) -> None:
    """Attack: fill one session's workspace to starve the sessions next to it."""
    async with gateway(host_dir) as client:
        a = await declare()
        b = await declare()
        r = await run(
            client,
            "import os\nerr = None\n"
            "try:\n"
            "    with open('/workspace/fill', 'wb') as f:\n"
            "        for _ in range(256):  # bounded: without a volume it is the host's disk\n"
            "            f.write(b'x' * 2**20)\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "print(err)",
            session_id=a.name,
        )
        assert r["stdout"].strip() == "28", r["_text"]
        n = await value(
            client,
            "open('/workspace/room', 'wb').write(b'y' * 8 * 2**20)",
            session_id=b.name,
        )
        assert n == 8 * MiB
