"""Privileges: the kernel tries to gain what an unprivileged process in its pod must not
have (namespaces, keyrings, its init's memory, capabilities, setuid, mounts, the root
filesystem, files past the workspace's size), through the real gateway into a real pod.

Every probe runs in the kernel and reports errno values, never eval'd: the host reads
them as JSON. The syscall numbers are x86_64's.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import platform
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from support import release_state_dir

from .conftest import gateway, run, value

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 syscall numbers"),
]

# A probe the kernel runs first: a libc handle and a way to call with errno kept.
PRELUDE = """
import ctypes as _c, errno as _e, os as _o, json as _j
_libc = _c.CDLL(None, use_errno=True)
_libc.syscall.restype = _c.c_long
def _errno(rc):
    return 0 if rc >= 0 else _c.get_errno()
def _sys(n, *a):
    return _errno(_libc.syscall(n, *[_c.c_long(x) for x in a]))
def _in_child(fn):
    # A forked, single-threaded child: unshare(CLONE_NEWUSER) refuses threaded callers
    # with EINVAL, so an attacker forks first; the probe does the same.
    r, w = _o.pipe()
    pid = _o.fork()
    if pid == 0:
        try:
            _o.write(w, _j.dumps(fn()).encode())
        finally:
            _o._exit(0)
    _o.close(w)
    out = b""
    while chunk := _o.read(r, 65536):
        out += chunk
    _o.close(r); _o.waitpid(pid, 0)
    return _j.loads(out)
"""

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIGCHLD = 17
SYS_CLONE, SYS_CLONE3, SYS_KEYCTL, SYS_ADD_KEY, SYS_REQUEST_KEY = 56, 435, 250, 248, 249
SYS_PTRACE, SYS_PROCESS_VM_READV = 101, 310
KEY_SPEC_USER_KEYRING = -4
KEYCTL_GET_KEYRING_ID, KEYCTL_SEARCH = 0, 10


@pytest.fixture(scope="module")
def module_state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))
    yield path
    release_state_dir(path)


@asynccontextmanager
async def held_gateway(state: Path, **options: Any) -> AsyncIterator[Client]:
    """A gateway for a whole module. The MCP client's task group must be left by the task
    that entered it, and a module fixture is torn down in another: one task holds it."""
    ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def hold() -> None:
        async with gateway(state, **options) as c:
            ready.set_result(c)
            await done.wait()

    holder = asyncio.ensure_future(hold())
    try:
        async with asyncio.timeout(120):
            first: set[asyncio.Future[Any]] = {holder, ready}
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if holder.done():
            holder.result()  # the gateway failed to start: raise its error
        yield ready.result()
    finally:
        done.set()
        async with asyncio.timeout(120):
            await holder


@pytest.fixture(scope="module")
async def kernel(module_state: Path) -> AsyncIterator[Client]:
    """One gateway and its default session for the module's probes (none changes it)."""
    async with held_gateway(module_state) as c:
        yield c


async def probe(c: Client, code: str) -> Any:
    """Run `code` (after PRELUDE) in the kernel; it ends by printing one JSON line."""
    r = await run(c, PRELUDE + code)
    assert r["status"] == "ok", r["_text"]
    return json.loads(r["stdout"].strip().splitlines()[-1])


def status(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


async def test_unshare_of_user_and_network_namespaces_is_refused(kernel: Client) -> None:
    """unshare(CLONE_NEWUSER|CLONE_NEWNET), and each flag alone: EPERM every time, and the
    kernel's user and network namespaces are the ones it started in."""
    got = await probe(
        kernel,
        f"""
def _try():
    before = [_o.readlink(f"/proc/self/ns/{{n}}") for n in ("user", "net", "mnt")]
    rcs = []
    for f in ({CLONE_NEWUSER | CLONE_NEWNET}, {CLONE_NEWUSER}, {CLONE_NEWNET}, {CLONE_NEWNS}):
        rcs.append(_errno(_libc.unshare(f)))
    after = [_o.readlink(f"/proc/self/ns/{{n}}") for n in ("user", "net", "mnt")]
    return [rcs, before == after]
print(_j.dumps(_in_child(_try)))
""",
    )
    assert got == [[errno.EPERM] * 4, True]


async def test_a_mount_in_a_new_user_namespace_is_out_of_reach(kernel: Client) -> None:
    """The two-step escape: a child in a new user+mount namespace (where it would be root)
    mounts a tmpfs. The child never comes to be: unshare fails, so the mount runs as the
    kernel's uid and fails too, and nothing is mounted at the target."""
    got = await probe(
        kernel,
        f"""
def _try():
    u = _errno(_libc.unshare({CLONE_NEWUSER | CLONE_NEWNS}))
    _o.makedirs("/workspace/.mnt-probe", exist_ok=True)
    m = _errno(_libc.mount(b"none", b"/workspace/.mnt-probe", b"tmpfs", 0, None))
    return [u, m]
_r = _in_child(_try)
mounted = any(" /workspace/.mnt-probe " in l for l in open("/proc/self/mounts"))
print(_j.dumps([_r, mounted]))
""",
    )
    assert got == [[errno.EPERM, errno.EPERM], False]


async def test_clone_with_namespace_flags_is_refused_and_clone3_falls_back(kernel: Client) -> None:
    """clone(CLONE_NEWUSER) straight through syscall(2), past libc: EPERM. clone3, whose
    flags seccomp cannot read: ENOSYS, so libc uses clone (which is filtered by flags)."""
    got = await probe(
        kernel,
        f"""
rc = _libc.syscall(_c.c_long({SYS_CLONE}), _c.c_long({CLONE_NEWUSER | SIGCHLD}),
                   _c.c_long(0), _c.c_long(0), _c.c_long(0), _c.c_long(0))
if rc == 0:
    _o._exit(0)  # the child of a clone that should not have been
clone = 0 if rc >= 0 else _c.get_errno()
if rc > 0:
    _o.waitpid(rc, 0)
args = (_c.c_uint64 * 11)(); args[0] = {CLONE_NEWUSER}; args[4] = {SIGCHLD}
rc3 = _libc.syscall(_c.c_long({SYS_CLONE3}), args, _c.c_long(88))
if rc3 == 0:
    _o._exit(0)
clone3 = 0 if rc3 >= 0 else _c.get_errno()
print(_j.dumps([clone, clone3]))
""",
    )
    assert got == [errno.EPERM, errno.ENOSYS]


async def test_keyrings_are_out_of_reach(kernel: Client) -> None:
    """keyctl, add_key and request_key: EPERM, so no key can be made, found or read; and
    a key host uid 1000 (the kernel's uid) adds to its own user keyring has no payload the
    kernel can reach (its secret is not in anything the kernel can read of keys)."""
    secret = f"host-key-{uuid.uuid4().hex}"
    desc = f"mcpforge-canary-{uuid.uuid4().hex[:8]}"
    serial = _add_host_key(desc, secret)
    try:
        got = await probe(
            kernel,
            f"""
kc = _sys({SYS_KEYCTL}, {KEYCTL_GET_KEYRING_ID}, {KEY_SPEC_USER_KEYRING}, 0)
ak = _errno(_libc.syscall(_c.c_long({SYS_ADD_KEY}), b"user", b"mine", b"x", _c.c_long(1),
                          _c.c_long({KEY_SPEC_USER_KEYRING})))
rk = _errno(_libc.syscall(_c.c_long({SYS_REQUEST_KEY}), b"user", {desc.encode()!r},
                          None, _c.c_long(0)))
ks = _errno(_libc.syscall(_c.c_long({SYS_KEYCTL}), _c.c_long({KEYCTL_SEARCH}),
                          _c.c_long({KEY_SPEC_USER_KEYRING}), b"user", {desc.encode()!r},
                          _c.c_long(0)))
seen = ""
for p in ("/proc/keys", "/proc/key-users"):
    try:
        seen += open(p).read()
    except OSError:
        pass
print(_j.dumps([[kc, ak, rk, ks], {secret!r} in seen]))
""",
        )
    finally:
        _drop_host_key(serial)
    assert got == [[errno.EPERM] * 4, False]


SETPRIV_1000 = ("setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--")
HOST_PYTHON = "/usr/bin/python3"  # one uid 1000 can run (not a venv under /root)


# Runs on the host as uid 1000: a key in its user keyring, its serial printed.
_ADD_KEY = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
desc, secret = sys.argv[1].encode(), sys.argv[2].encode()
n = libc.syscall(248, b"user", desc, secret, ctypes.c_long(len(secret)), ctypes.c_long(-4))
print(n if n > 0 else -ctypes.get_errno())
"""


def _add_host_key(desc: str, secret: str) -> int:
    out = subprocess.run(
        [*SETPRIV_1000, HOST_PYTHON, "-c", _ADD_KEY, desc, secret],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    serial = int(out.stdout.strip())
    assert serial > 0, f"the host could not add its canary key: errno {-serial}"
    return serial


def _drop_host_key(serial: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(21), ctypes.c_long(serial))  # INVALIDATE


async def test_setns_into_init_or_own_namespaces_is_refused(kernel: Client) -> None:
    """setns on every namespace file the kernel can open (its own, and PID 1's where
    readable): EPERM each time."""
    got = await probe(
        kernel,
        """
joined = {}
for n in sorted(_o.listdir("/proc/self/ns")):
    for pid in ("self", "1"):
        try:
            fd = _o.open(f"/proc/{pid}/ns/{n}", _o.O_RDONLY)
        except OSError:
            continue
        joined[f"{pid}/{n}"] = _errno(_libc.setns(fd, 0)); _o.close(fd)
print(_j.dumps(joined))
""",
    )
    assert {"self/user", "self/net", "self/mnt", "self/pid"} <= set(got)
    assert set(got.values()) == {errno.EPERM}, got


async def test_pid_1_memory_is_unreadable(kernel: Client) -> None:
    """The kernel against its pod's init: process_vm_readv, ptrace(PTRACE_SEIZE), open
    /proc/1/mem, /proc/1/environ, /proc/1/maps and /proc/1/ns/* all fail; PID 1 is
    another uid (the pod's infra process), and the kernel itself is not PID 1."""
    got = await probe(
        kernel,
        f"""
class _Iov(_c.Structure):
    _fields_ = [("base", _c.c_void_p), ("len", _c.c_size_t)]
buf = _c.create_string_buffer(64)
local = _Iov(_c.cast(buf, _c.c_void_p), 64)
try:
    addr = int(open("/proc/1/maps").read().split("-", 1)[0], 16)
except OSError:
    addr = 0x400000  # a usual text address: the read must fail whatever the address
remote = _Iov(addr, 64)
vm = _errno(_libc.syscall(_c.c_long({SYS_PROCESS_VM_READV}), _c.c_long(1), _c.byref(local),
                          _c.c_long(1), _c.byref(remote), _c.c_long(1), _c.c_long(0)))
pt = _sys({SYS_PTRACE}, 0x4206, 1, 0, 0)
opened = {{}}
for f in ("mem", "environ", "maps"):
    try:
        _o.close(_o.open(f"/proc/1/{{f}}", _o.O_RDONLY)); opened[f] = 0
    except OSError as e:
        opened[f] = e.errno
init = [l.split() for l in open("/proc/1/status") if l.startswith("Uid:")][0][1:]
ns = {{}}
for n in sorted(_o.listdir("/proc/self/ns")):
    try:
        _o.close(_o.open(f"/proc/1/ns/{{n}}", _o.O_RDONLY)); ns[n] = 0
    except OSError as e:
        ns[n] = e.errno
print(_j.dumps([vm, pt, opened, init, _o.getpid(), _o.getuid(), ns]))
""",
    )
    vm, pt, opened, init_uids, pid, uid, ns = got
    assert vm == errno.EPERM and pt == errno.EPERM
    assert opened == {"mem": errno.EACCES, "environ": errno.EACCES, "maps": errno.EACCES}
    assert pid != 1
    assert str(uid) not in init_uids  # PID 1 runs as another uid
    assert ns and set(ns.values()) == {errno.EACCES}, ns  # nor can its namespaces be opened


async def test_the_kernel_cannot_signal_the_other_processes_of_its_pod(kernel: Client) -> None:
    """Every process the kernel sees that is not its own (the pod's init): kill(pid, 0) is
    EPERM, so it can neither stop them nor make its pod stop."""
    got = await probe(
        kernel,
        """
mine = _o.getuid()
res = {}
for d in _o.listdir("/proc"):
    if not d.isdigit():
        continue
    try:
        uid = int([l.split()[1] for l in open(f"/proc/{d}/status") if l.startswith("Uid:")][0])
    except (OSError, IndexError):
        continue
    if uid != mine:
        try:
            _o.kill(int(d), 0); res[d] = 0
        except OSError as e:
            res[d] = e.errno
print(_j.dumps(res))
""",
    )
    assert "1" in got, got
    assert set(got.values()) == {errno.EPERM}, got


async def test_restarts_in_a_row_each_give_a_working_kernel(kernel: Client) -> None:
    """Five restart_kernel calls in a row (locally each plays the pod again, in the same
    user namespace): each ends with a fresh kernel that answers, and the workspace keeps
    its files."""
    sid = (await run(kernel, "open('restart-note', 'w').write('kept')"))["session_id"]
    pids = []
    for _ in range(5):
        r = await kernel.call_tool("restart_kernel", {"session_id": sid})
        assert not r.is_error, r
        pids.append(await value(kernel, "[__import__('os').getpid(), open('restart-note').read()]"))
    assert all(note == "kept" for _, note in pids)
    assert all(pid != 1 for pid, _ in pids)


async def test_the_kernel_has_no_capabilities_and_no_new_privileges(kernel: Client) -> None:
    """Every capability set is empty (bounding set included, so no exec can regain any),
    no_new_privs is set, and a seccomp filter is in force."""
    st = status(await value(kernel, "open('/proc/self/status').read()"))
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, (cap, st[cap])
    assert st["NoNewPrivs"].strip() == "1"
    assert st["Seccomp"].strip() == "2"


async def test_setuid_binaries_do_not_raise_privilege(kernel: Client) -> None:
    """Every setuid-root program in the image, started by the kernel: none runs with another
    effective uid (no_new_privs ignores the bit). The evidence is each process's own
    /proc/<pid>/status, read while it waits on its stdin."""
    got = await probe(
        kernel,
        """
import subprocess as _s, stat as _st, time as _t
found = []
for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/lib"):
    for root, _, files in _o.walk(d) if hasattr(_o, "walk") else _o.walk(d):
        for f in files:
            p = _o.path.join(root, f)
            try:
                m = _o.lstat(p).st_mode
            except OSError:
                continue
            if _st.S_ISREG(m) and m & _st.S_ISUID:
                found.append(p)
uids = {}
for p in sorted(set(found)):
    proc = _s.Popen([p], stdin=_s.PIPE, stdout=_s.DEVNULL, stderr=_s.DEVNULL)
    try:
        st = open(f"/proc/{proc.pid}/status").read().splitlines()
        uids[p] = [l.split()[1:] for l in st if l.startswith("Uid:")][0]
    except (OSError, IndexError):
        uids[p] = None
    proc.kill(); proc.wait()
print(_j.dumps([_o.getuid(), uids]))
""",
    )
    uid, uids = got
    assert uids, "the image has no setuid programs to try"
    for path, ids in uids.items():
        assert ids is None or set(ids) == {str(uid)}, (path, ids)


async def test_the_root_filesystem_and_config_are_read_only(kernel: Client) -> None:
    """Writes to the image (a site-packages module, /etc/passwd, /usr/bin) and to the
    connection file's directory: all refused; the files are unchanged."""
    got = await probe(
        kernel,
        """
import sys as _sys
targets = ["/etc/passwd", "/usr/bin/mcpforge-probe", _sys.prefix + "/lib/sitecustomize.py",
           "/etc/mcp-forge/connection.json", "/etc/mcp-forge/new"]
res = {}
for t in targets:
    try:
        with open(t, "a") as f:
            f.write("x")
        res[t] = 0
    except OSError as e:
        res[t] = e.errno
print(_j.dumps(res))
""",
    )
    for target, code in got.items():
        assert code in (errno.EROFS, errno.EACCES, errno.EPERM), (target, code)


async def test_mounts_and_device_nodes_are_refused(kernel: Client) -> None:
    """mount(2) of a tmpfs and of proc, umount2 of /workspace, mknod of a block device:
    EPERM each, and the mount table is what it was."""
    got = await probe(
        kernel,
        """
before = open("/proc/self/mounts").read()
_o.makedirs("/workspace/.mnt-probe", exist_ok=True)
res = [
    _errno(_libc.mount(b"none", b"/workspace/.mnt-probe", b"tmpfs", 0, None)),
    _errno(_libc.mount(b"proc", b"/workspace/.mnt-probe", b"proc", 0, None)),
    _errno(_libc.umount2(b"/workspace", 2)),
]
try:
    _o.mknod("/workspace/.sda", 0o600 | 0o060000, _o.makedev(8, 0)); res.append(0)
except OSError as e:
    res.append(e.errno)
_o.rmdir("/workspace/.mnt-probe")
print(_j.dumps([res, open("/proc/self/mounts").read() == before]))
""",
    )
    assert got == [[errno.EPERM] * 4, True]


async def test_files_cannot_outgrow_the_workspace_size(kernel: Client) -> None:
    """RLIMIT_FSIZE is the session's workspace size (default 1Gi here): a sparse write
    one byte past it fails with EFBIG (SIGXFSZ is ignored by Python), so no single file,
    in the workspace or /tmp, can claim more than the workspace holds."""
    got = await probe(
        kernel,
        """
import resource as _r
limit = _r.getrlimit(_r.RLIMIT_FSIZE)
res = {}
for d in ("/workspace", "/tmp"):
    p = d + "/.fsize-probe"
    fd = _o.open(p, _o.O_WRONLY | _o.O_CREAT | _o.O_TRUNC, 0o600)
    try:
        _o.pwrite(fd, b"x", limit[0]); res[d] = 0
    except OSError as e:
        res[d] = e.errno
    try:
        _o.pwrite(fd, b"x", limit[0] - 1); ok = True
    except OSError:
        ok = False
    _o.close(fd); _o.unlink(p)
    res[d] = [res[d], ok]
print(_j.dumps([list(limit), res]))
""",
    )
    limit, res = got
    assert limit == [2**30, 2**30]
    assert res == {"/workspace": [errno.EFBIG, True], "/tmp": [errno.EFBIG, True]}


async def test_threads_subprocesses_and_multiprocessing_still_work(kernel: Client) -> None:
    """The profile denies namespaces, not ordinary work: threads (clone3 falls back to
    clone), subprocess (posix_spawn), multiprocessing with fork and spawn, all produce
    their results."""
    got = await probe(
        kernel,
        """
import threading as _t, subprocess as _s, multiprocessing as _mp, concurrent.futures as _f
box = []
th = [_t.Thread(target=box.append, args=(i,)) for i in range(8)]
[t.start() for t in th]; [t.join() for t in th]
sp = _s.run(["python", "-c", "print(6*7)"], capture_output=True, text=True).stdout.strip()
out = {"threads": sorted(box), "subprocess": sp}
for method in ("fork", "spawn"):
    with _f.ProcessPoolExecutor(2, mp_context=_mp.get_context(method)) as ex:
        out[method] = sorted(ex.map(abs, [-1, -2, -3]))
print(_j.dumps(out))
""",
    )
    assert got == {
        "threads": list(range(8)),
        "subprocess": "42",
        "fork": [1, 2, 3],
        "spawn": [1, 2, 3],
    }


async def test_an_orphan_of_the_kernel_is_reaped(kernel: Client) -> None:
    """A grandchild the kernel orphans (its parent exits at once) is adopted by the pod's
    init and reaped when it exits: the kernel sees it exit (its pidfd) and then its pid
    go away, never a zombie left behind."""
    got = await probe(
        kernel,
        """
import subprocess as _s, select as _sel, time as _t
out = _s.run(["python", "-c",
              "import subprocess as s; print(s.Popen(['sleep', '3'], stdout=s.DEVNULL,"
              " stderr=s.DEVNULL).pid)"],
             capture_output=True, text=True).stdout
pid = int(out)
ppid = [l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("PPid:")][0]
fd = _o.pidfd_open(pid)
p = _sel.poll(); p.register(fd, _sel.POLLIN)
exited = bool(p.poll(30_000))
# Reaping follows the exit: the pid's /proc entry is polled (a non-child has no wait).
end = _t.monotonic() + 30
while _o.path.exists(f"/proc/{pid}") and _t.monotonic() < end:
    _t.sleep(0.05)
print(_j.dumps([ppid, exited, _o.path.exists(f"/proc/{pid}")]))
""",
    )
    assert got == ["1", True, False]


def _workspace(state: Path) -> Path:
    """The host directory of the module's one session's workspace."""
    (found,) = state.glob("**/workspace")
    return found


async def test_an_interrupt_still_stops_a_busy_cell(kernel: Client, module_state: Path) -> None:
    """Without tini in front of it, the kernel still takes SIGINT from interrupt_request:
    a cell looping forever ends in KeyboardInterrupt, and the namespace survives (no
    restart stood in for the interrupt)."""
    sid = (await run(kernel, "kept = 42"))["session_id"]
    workspace = _workspace(module_state)
    started = asyncio.Event()
    server = await asyncio.start_unix_server(
        lambda r, w: started.set(), path=str(workspace / ".started")
    )
    (workspace / ".started").chmod(0o777)
    cell = (
        "import socket, time\n"
        "socket.socket(socket.AF_UNIX).connect('.started')\n"
        "while True: time.sleep(0.1)"
    )
    task = asyncio.ensure_future(run(kernel, cell))
    try:
        async with asyncio.timeout(60):
            await started.wait()  # the cell runs
        r = await kernel.call_tool("interrupt_kernel", {"session_id": sid})
        assert not r.is_error, r
        async with asyncio.timeout(60):
            done = await task
    finally:
        server.close()
        task.cancel()
    assert done["status"] in ("error", "interrupted"), done["_text"]
    assert "KeyboardInterrupt" in done["_text"], done["_text"]
    assert await value(kernel, "kept") == 42
