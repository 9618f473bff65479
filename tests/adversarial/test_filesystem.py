"""Paths the file tools touch: links, rename races, odd files, odd names, hostile objects.

Kernel code plants links, FIFOs, hard links, deep trees and hostile objects in its own
workspace and namespace; the model then calls read_file, write_file, list_files,
list_variables and inspect_variable through the real gateway. The safe outcome: no tool
follows a link (even one pointing inside the workspace: refused, `SymlinkRefused`), none
blocks, every answer is bounded and the session keeps working. The evidence: what the
tool returned, what is still on disk (asked of the kernel), and that the secrets (the
kernel's connection file, a host canary) never appear in any answer.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from .conftest import Deadline, call, gateway, run, text, value

pytestmark = pytest.mark.podman

CONNECTION = "/etc/mcp-forge/connection.json"
KEY_PROBE = '"key"'  # in the connection file (the kernel's HMAC key), never in an answer


@asynccontextmanager
async def session(state_dir: Path) -> AsyncIterator[tuple[Client, str]]:
    """A gateway and one minimal session (the gateway deletes it on exit)."""
    async with gateway(state_dir) as c:
        r = await c.call_tool("create_session", {"variant": "minimal"})
        assert not r.is_error, text(r)
        assert r.structured_content is not None
        yield c, r.structured_content["session_id"]


async def ok(c: Client, sid: str, code: str) -> dict[str, Any]:
    r = await run(c, code, session_id=sid)
    assert r["status"] == "ok", r["_text"]
    return r


async def tool(c: Client, sid: str, which: str, /, **args: Any) -> Any:
    return await call(c, which, {"session_id": sid, **args})


def no_secret(result: Any, *secrets: str) -> None:
    body = text(result) + repr(result.structured_content)
    for s in (KEY_PROBE, *secrets):
        assert s not in body, body[:2000]


async def test_a_path_flipped_between_file_and_symlink_never_reads_the_target(
    state_dir: Path, canary: Path
) -> None:
    """Rename race: a kernel thread swaps /workspace/flip between a regular file and a link
    to the kernel's connection file while read_file is called hundreds of times; no read
    returns the link's target, some return the file (the race ran)."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os, threading\n"
            "_stop = threading.Event()\n"
            "def _flip():\n"
            "    while not _stop.is_set():\n"
            "        open('/workspace/f.tmp', 'w').write('benign')\n"
            "        os.replace('/workspace/f.tmp', '/workspace/flip')\n"
            "        try: os.unlink('/workspace/l.tmp')\n"
            "        except FileNotFoundError: pass\n"
            f"        os.symlink({CONNECTION!r}, '/workspace/l.tmp')\n"
            "        os.replace('/workspace/l.tmp', '/workspace/flip')\n"
            "threading.Thread(target=_flip, daemon=True).start()\n",
        )
        host_secret = canary.read_text()  # noqa: ASYNC240 (a small local file, once)
        deadline = Deadline(240)
        reads = refused = 0
        for _ in range(400):
            if not deadline:
                break
            r = await tool(c, sid, "read_file", path="flip")
            no_secret(r, host_secret)
            if r.is_error:
                refused += 1
                assert "SymlinkRefused" in text(r) or "FileNotFound" in text(r), text(r)
            else:
                reads += 1
                assert text(r) == "benign"
        await ok(c, sid, "_stop.set()")
        assert reads > 0 and refused > 0, (reads, refused)


async def test_a_symlink_to_the_connection_file_is_refused(state_dir: Path) -> None:
    """A link in the workspace to /etc/mcp-forge/connection.json (and one through
    /proc/self/root): read_file refuses both and says links are not followed; the kernel
    itself can read the file (the secret was there to leak)."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            f"import os; os.symlink({CONNECTION!r}, '/workspace/conn')\n"
            f"os.symlink('/proc/self/root' + {CONNECTION!r}, '/workspace/proc')\n",
        )
        assert KEY_PROBE in await value(c, f"open({CONNECTION!r}).read()", session_id=sid)
        for path in ("conn", "/workspace/proc"):
            r = await tool(c, sid, "read_file", path=path)
            assert r.is_error and "SymlinkRefused" in text(r), text(r)
            no_secret(r)


async def test_a_symlinked_directory_on_the_path_is_refused_for_read_and_list(
    state_dir: Path,
) -> None:
    """/workspace/etc -> /etc/mcp-forge: read_file('etc/connection.json') and
    list_files('etc') are refused, not served from /etc."""
    async with session(state_dir) as (c, sid):
        await ok(c, sid, "import os; os.symlink('/etc/mcp-forge', '/workspace/etc')")
        r = await tool(c, sid, "read_file", path="etc/connection.json")
        assert r.is_error and "SymlinkRefused" in text(r), text(r)
        no_secret(r)
        listed = await tool(c, sid, "list_files", path="etc")
        assert listed.is_error and "SymlinkRefused" in text(listed), text(listed)
        assert "connection.json" not in text(listed)


async def test_absolute_and_proc_paths_outside_the_workspace_are_refused(
    state_dir: Path,
) -> None:
    """read_file('/proc/self/environ'), '/etc/mcp-forge/connection.json' and
    '/workspace/../etc/passwd' are refused before the kernel is asked."""
    async with session(state_dir) as (c, sid):
        for path in ("/proc/self/environ", CONNECTION, "/workspace/../etc/passwd"):
            r = await tool(c, sid, "read_file", path=path)
            assert r.is_error, (path, text(r))
            assert "workspace" in text(r)
            no_secret(r, "PATH=")


async def test_write_file_through_a_symlink_changes_nothing(state_dir: Path) -> None:
    """A link named like the file the model will write points at another workspace file;
    write_file refuses, and the target keeps its content."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os; open('/workspace/precious.txt', 'w').write('original')\n"
            "os.symlink('/workspace/precious.txt', '/workspace/report.md')",
        )
        r = await tool(c, sid, "write_file", path="report.md", content="overwritten")
        assert r.is_error and "SymlinkRefused" in text(r), text(r)
        assert await value(c, "open('/workspace/precious.txt').read()", session_id=sid) == (
            "original"
        )


async def test_write_file_never_creates_through_a_linked_parent(state_dir: Path) -> None:
    """/workspace/out -> /tmp/elsewhere: write_file('out/new.txt') is refused and nothing
    appears in /tmp/elsewhere; a fresh nested path is still created, one directory at a
    time."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os; os.mkdir('/tmp/elsewhere'); os.symlink('/tmp/elsewhere', '/workspace/out')",
        )
        r = await tool(c, sid, "write_file", path="out/new.txt", content="x")
        assert r.is_error and "SymlinkRefused" in text(r), text(r)
        assert await value(c, "os.listdir('/tmp/elsewhere')", session_id=sid) == []
        r = await tool(c, sid, "write_file", path="a/b/c/new.txt", content="fresh")
        assert not r.is_error, text(r)
        assert await value(c, "open('/workspace/a/b/c/new.txt').read()", session_id=sid) == (
            "fresh"
        )


async def test_write_file_refuses_a_hard_link_and_cross_device_links_fail(
    state_dir: Path,
) -> None:
    """A hard link in the workspace to another workspace file: write_file refuses it (it
    would change both); a hard link to the connection file cannot even be made (the
    workspace is a filesystem of its own)."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os, errno; open('/workspace/orig', 'w').write('keep')\n"
            "os.link('/workspace/orig', '/workspace/alias')\n"
            "try:\n"
            f"    os.link({CONNECTION!r}, '/workspace/hl'); _e = 0\n"
            "except OSError as e:\n"
            "    _e = e.errno",
        )
        r = await tool(c, sid, "write_file", path="alias", content="changed")
        assert r.is_error and "HardLinkRefused" in text(r), text(r)
        assert await value(c, "open('/workspace/orig').read()", session_id=sid) == "keep"
        assert await value(c, "_e", session_id=sid) != 0
        assert await value(c, "os.path.exists('/workspace/hl')", session_id=sid) is False


async def test_a_fifo_given_to_read_and_write_file_does_not_hang(state_dir: Path) -> None:
    """A FIFO with no writer: read_file answers at once that it is not a regular file
    (no open() that blocks for the helper's 30 s); write_file likewise; the session goes on."""
    async with session(state_dir) as (c, sid):
        await ok(c, sid, "import os; os.mkfifo('/workspace/pipe')")
        r = await asyncio.wait_for(tool(c, sid, "read_file", path="pipe"), 25)
        assert r.is_error and "NotARegularFile" in text(r), text(r)
        w = await asyncio.wait_for(tool(c, sid, "write_file", path="pipe", content="x"), 25)
        assert w.is_error, text(w)
        assert await value(c, "1 + 1", session_id=sid) == 2


async def test_a_unix_socket_and_a_directory_are_not_read(state_dir: Path) -> None:
    """A Unix socket bound in the workspace and a directory: read_file refuses both
    as not regular files."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import socket, os; _s = socket.socket(socket.AF_UNIX)\n"
            "_s.bind('/workspace/sock'); _s.listen(); os.mkdir('/workspace/dir')",
        )
        r = await tool(c, sid, "read_file", path="sock")
        assert r.is_error and "NotARegularFile" in text(r), text(r)
        d = await tool(c, sid, "read_file", path="dir")
        assert d.is_error and "directory" in text(d), text(d)
        listed = await tool(c, sid, "list_files")
        kinds = {e["name"]: e["type"] for e in listed.structured_content["entries"]}
        assert kinds["sock"] == "other" and kinds["dir"] == "dir"


async def test_a_sparse_huge_file_is_refused_by_size_without_reading(state_dir: Path) -> None:
    """A 1 GiB sparse file: read_file says it is over the limit (fstat on the open file),
    quickly, without reading it."""
    async with session(state_dir) as (c, sid):
        await ok(c, sid, "open('/workspace/big', 'wb').truncate(1 << 30)")
        r = await tool(c, sid, "read_file", path="big")
        assert r.is_error and "TooLarge" in text(r) and str(1 << 30) in text(r), text(r)


async def test_a_linked_spill_directory_is_never_written_or_pruned_through(
    state_dir: Path,
) -> None:
    """.mcp-forge/outputs is a link to the user's project holding 30 files named like spill
    files: a flood whose output the gateway must save (the kernel's guard removed) writes
    nothing there and deletes nothing there (the old prune deleted all but 20)."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os, types\n"
            "os.makedirs('/workspace/project'); os.makedirs('/workspace/.mcp-forge')\n"
            "for i in range(30):\n"
            "    open(f'/workspace/project/{i:032x}_1_{i}.txt', 'w').write('mine')\n"
            "os.symlink('/workspace/project', '/workspace/.mcp-forge/outputs')\n"
            "_k = get_ipython().kernel\n"
            "_k.session.send = types.MethodType(type(_k.session).send, _k.session)\n",
        )
        r = await run(c, "print('z' * 300_000)", session_id=sid)
        assert r["status"] == "ok" and r["truncated"] is True, r["_text"][:500]
        assert not r.get("full_output_path"), r["_text"][:500]
        left = await value(c, "sorted(os.listdir('/workspace/project'))", session_id=sid)
        assert len(left) == 30 and all(name.endswith(".txt") for name in left)


async def test_a_linked_mcp_forge_directory_is_not_pruned_through(state_dir: Path) -> None:
    """.mcp-forge itself is a link to the user's data (with an outputs/ holding files
    named like spill files): after a flood the gateway saves, every user file is there."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os, types\n"
            "os.makedirs('/workspace/data/outputs')\n"
            "for i in range(25):\n"
            "    open(f'/workspace/data/outputs/{i:032x}_2_{i}.txt', 'w').write('mine')\n"
            "os.symlink('/workspace/data', '/workspace/.mcp-forge')\n"
            "_k = get_ipython().kernel\n"
            "_k.session.send = types.MethodType(type(_k.session).send, _k.session)\n",
        )
        r = await run(c, "print('q' * 300_000)", session_id=sid)
        assert r["status"] == "ok", r["_text"][:500]
        left = await value(c, "os.listdir('/workspace/data/outputs')", session_id=sid)
        assert len(left) == 25


async def test_odd_names_are_listed_as_safe_text(state_dir: Path) -> None:
    """Names with a newline, invalid UTF-8 bytes and 255 bytes: list_files returns them as
    text (invalid bytes as \\xNN), the answer stays one valid JSON result."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os\n"
            "os.close(os.open(b'/workspace/bad\\xff\\xfe', os.O_CREAT | os.O_WRONLY))\n"
            "open('/workspace/new\\nline', 'w').close()\n"
            "open('/workspace/' + 'L' * 255, 'w').close()",
        )
        r = await tool(c, sid, "list_files")
        assert not r.is_error, text(r)
        names = {e["name"] for e in r.structured_content["entries"]}
        assert {"bad\\xff\\xfe", "new\nline", "L" * 255} <= names


async def test_a_huge_directory_and_a_deep_tree_are_listed_within_bounds(
    state_dir: Path,
) -> None:
    """5,000 files in one directory: list_files returns at most 1,000, sorted, marked
    truncated. A tree 1,000 directories deep: its bottom is listed (one open per level);
    a path over 4,096 characters is refused."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os\n"
            "os.makedirs('/workspace/many')\n"
            "for i in range(5000):\n"
            "    open(f'/workspace/many/f{i:05}', 'w').close()\n"
            "_p = '/workspace'\n"
            "for _ in range(1000):\n"
            "    _p += '/d'; os.mkdir(_p)\n"
            "open('/workspace/' + '/'.join(['d'] * 1000) + '/bottom', 'w').close()",
        )
        r = await tool(c, sid, "list_files", path="many")
        assert not r.is_error, text(r)
        entries = r.structured_content["entries"]
        assert len(entries) == 1000 and r.structured_content["truncated"] is True
        assert entries[0]["name"] == "f00000"
        deep = await tool(c, sid, "list_files", path="/".join(["d"] * 1000))
        assert not deep.is_error, text(deep)
        assert [e["name"] for e in deep.structured_content["entries"]] == ["bottom"]
        long = await tool(c, sid, "list_files", path="/".join(["d"] * 2100))
        assert long.is_error and "4096" in text(long), text(long)


async def test_a_hanging_repr_is_cut_and_the_session_keeps_working(state_dir: Path) -> None:
    """A __repr__ that loops forever (catching Exception): list_variables and
    inspect_variable answer within the helper's time with a note, other variables are
    still described, and the next execute works with the variable intact."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "class Hang:\n"
            "    def __repr__(self):\n"
            "        while True:\n"
            "            try:\n"
            "                sum(range(10**6))\n"
            "            except Exception:\n"
            "                pass\n"
            "hang = Hang(); plain = 41",
        )
        r = await asyncio.wait_for(tool(c, sid, "list_variables"), 60)
        assert not r.is_error, text(r)
        by_name = {v["name"]: v for v in r.structured_content["variables"]}
        assert "took over" in by_name["hang"]["repr"]
        assert by_name["plain"]["repr"] == "41"
        one = await asyncio.wait_for(tool(c, sid, "inspect_variable", name="hang"), 60)
        assert not one.is_error and "took over" in one.structured_content["repr"], text(one)
        assert await value(c, "plain + 1", session_id=sid) == 42


async def test_a_repr_that_swallows_every_exception_does_not_take_the_session(
    state_dir: Path,
) -> None:
    """A __repr__ looping under a bare `except BaseException` (it swallows interrupts and
    any timeout raised in it): list_variables still answers with a note, and the session
    runs code and keeps its variables afterwards (the loop is left behind in a thread,
    then stopped by the test through the session itself)."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "STOP = []\n"
            "class Swallow:\n"
            "    def __repr__(self):\n"
            "        while not STOP:\n"
            "            try:\n"
            "                sum(range(10_000))\n"
            "            except BaseException:\n"
            "                pass\n"
            "        return 'stopped'\n"
            "swallow = Swallow(); kept = 'still here'",
        )
        r = await asyncio.wait_for(tool(c, sid, "list_variables"), 60)
        assert not r.is_error, text(r)
        by_name = {v["name"]: v for v in r.structured_content["variables"]}
        assert "took over" in by_name["swallow"]["repr"], by_name["swallow"]
        assert await value(c, "kept", session_id=sid) == "still here"
        await ok(c, sid, "STOP.append(1)")


async def test_huge_names_reprs_and_lying_objects_are_bounded(state_dir: Path) -> None:
    """A 1 MB name, a 50 MB repr, a __class__ that lies (claims int), a __len__ that raises,
    a repr returning a non-str, a non-str key in the namespace: list_variables answers, each
    field bounded, the real type shown."""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "class Liar:\n"
            "    __class__ = int\n"
            "    def __len__(self): raise RuntimeError('no len')\n"
            "class Big:\n"
            "    def __repr__(self): return 'B' * 50_000_000\n"
            "class NotStr:\n"
            "    def __repr__(self): return 42\n"
            "liar, big, notstr = Liar(), Big(), NotStr()\n"
            "globals()['n' * 1_000_000] = 1\n"
            "globals()[7] = 'int key'",
        )
        r = await tool(c, sid, "list_variables")
        assert not r.is_error, text(r)
        by_name = {v["name"][:20]: v for v in r.structured_content["variables"]}
        assert by_name["liar"]["type"].endswith("Liar") and by_name["liar"].get("length") is None
        assert len(by_name["big"]["repr"]) < 300
        assert by_name["notstr"]["repr"].startswith("<repr")
        assert all(len(v["name"]) < 300 for v in r.structured_content["variables"])
        big = await tool(c, sid, "inspect_variable", name="big")
        assert not big.is_error and len(big.structured_content["repr"]) < 2100, text(big)
        assert await value(c, "len(repr(big))", session_id=sid) == 50_000_000


PLANT_EVERYWHERE = """
import os, site
for d in ('/workspace/.ipython/profile_default/startup',
          '/workspace/.config/ipython/profile_default/startup'):
    os.makedirs(d, exist_ok=True)
    open(d + '/00-planted.py', 'w').write('PLANTED_IPYTHON = 1\\n')
os.makedirs('/workspace/.jupyter', exist_ok=True)
open('/workspace/.jupyter/ipython_kernel_config.py', 'w').write(
    'c.IPKernelApp.exec_lines = ["PLANTED_JUPYTER = 1"]\\n')
_us = site.getusersitepackages()
os.makedirs(_us, exist_ok=True)
open(_us + '/usercustomize.py', 'w').write('import builtins; builtins.PLANTED_USER = 1\\n')
before = 1
"""
PLANTED = (
    "[n for n in ('PLANTED_IPYTHON', 'PLANTED_JUPYTER', 'PLANTED_TMP', 'before')"
    " if n in globals()] + (['PLANTED_USER'] if hasattr(__import__('builtins'),"
    " 'PLANTED_USER') else [])"
)


async def test_startup_code_planted_in_the_workspace_does_not_run_after_a_restart(
    state_dir: Path,
) -> None:
    """Code planted where a kernel start would look in the workspace (kept across
    restarts): IPython startup files under ~/.ipython and ~/.config/ipython, a kernel
    config with exec_lines in ~/.jupyter, a usercustomize in the user site. After
    restart_kernel none of it ran and the namespace is empty (the files are still there)."""
    async with session(state_dir) as (c, sid):
        await ok(c, sid, PLANT_EVERYWHERE)
        assert await value(c, PLANTED, session_id=sid) == ["before"]
        r = await tool(c, sid, "restart_kernel")
        assert not r.is_error, text(r)
        assert await value(c, PLANTED, session_id=sid) == []
        planted = "'/workspace/.jupyter/ipython_kernel_config.py'"
        assert await value(c, f"__import__('os').path.exists({planted})", session_id=sid)


async def test_a_startup_file_planted_in_ipythondir_does_not_survive_a_restart(
    state_dir: Path,
) -> None:
    """A startup file in the startup directory this kernel's IPython uses: restart_kernel
    promises a fresh interpreter, so it must not run there. ($IPYTHONDIR itself cannot be
    made: the kernel's IPython works in a new temporary directory at every start.)"""
    async with session(state_dir) as (c, sid):
        await ok(
            c,
            sid,
            "import os; _d = get_ipython().profile_dir.startup_dir\n"
            "assert _d.startswith('/tmp/'), _d\n"
            "assert not os.path.exists(os.environ['IPYTHONDIR'])\n"
            "open(_d + '/00-planted.py', 'w').write('PLANTED_TMP = 1\\n')",
        )
        r = await tool(c, sid, "restart_kernel")
        assert not r.is_error, text(r)
        found = await value(c, PLANTED, session_id=sid)
    assert found == []  # outside the client's task group: a plain AssertionError


async def test_binary_round_trip_and_append_write_chunks_stay_in_place(
    state_dir: Path,
) -> None:
    """A 3 MB binary write (several chunks, appended by the helper) lands whole at its path
    and reads back identical; the chunks never leave the file."""
    async with session(state_dir) as (c, sid):
        blob = bytes(range(256)) * (3 * 4096)
        payload = base64.b64encode(blob).decode()
        w = await tool(c, sid, "write_file", path="bin/x.dat", content=payload, encoding="base64")
        assert not w.is_error and w.structured_content["size"] == len(blob), text(w)
        code = "__import__('hashlib').sha256(open('/workspace/bin/x.dat','rb').read()).hexdigest()"
        got = await value(c, code, session_id=sid)
        assert got == hashlib.sha256(blob).hexdigest()
