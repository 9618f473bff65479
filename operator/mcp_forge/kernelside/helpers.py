"""The gateway's helpers in the kernel: namespace listing, variable inspection, files.

Run silently by the gateway (introspection.program) in a namespace of its own holding
`ARGS` (a JSON object: the operation and its arguments), `MARKER` and `get_ipython`. It
prints one line, the marker then a JSON object, and leaves nothing behind.

Files are reached beneath the workspace one component at a time, from a descriptor of
the workspace's root, never through a link: every directory is opened with
O_DIRECTORY|O_NOFOLLOW relative to its parent's descriptor, and the last component with
O_NOFOLLOW|O_NONBLOCK, then checked with fstat on the descriptor itself. A symbolic link
anywhere on the path is refused (even one that points inside the workspace), so code that
swaps a path between a file and a link while a tool runs cannot make it read, write,
list or delete anything else; a FIFO or device is refused without blocking; a mount
point under the workspace (another filesystem) is refused. Writes never go through a
name with other hard links. Names are returned as text: bytes that are not UTF-8 are
shown as ``\\xNN`` escapes.

Variables are described under a time budget per variable (in a thread of its own, see
`within`), so a `__repr__`, `__len__` or property that hangs is cut with a clear note,
even one that catches every exception; what user code returns is bounded (names, types,
reprs) and only plain values reach JSON.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import re
import reprlib
import stat
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

NAME_MAX = 200  # characters of a variable's name or type returned
SCAN_MAX = 100_000  # directory entries read to list or prune one directory
DESCRIBE_SECONDS = 2.0  # time for one variable's description (repr, len, shape, ...)
ALL_SECONDS = 10.0  # time for a whole namespace listing (the gateway waits longer)
INT_MAX = 2**63 - 1  # integers past this from user code are left out
SPILL_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}\.txt")  # the spill files prune may delete

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """An operation refused, with the error name the gateway shows (`kind`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Timeout(BaseException):
    """Raised in a describing thread that ran out of time; a BaseException, so `except
    Exception` in a `__repr__` does not swallow it."""


# ---- paths ------------------------------------------------------------------------------


def shown(name: str) -> str:
    """A name as text: bytes that are not UTF-8 (surrogate-escaped by os) as \\xNN."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise Refused("PermissionError", f"path leaves the workspace: {shown(rel)}")
    return parts


def _open_step(name: str, dir_fd: int, rel: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(exc, name, dir_fd, rel) from None


def _refusal(exc: OSError, name: str, dir_fd: int, rel: str) -> Refused:
    """What an open that failed means, said for the model. ELOOP under O_NOFOLLOW is a
    link even if the name has been swapped back since; other kinds are looked up with
    fstatat (no follow), which may be newer than the open: it only picks the message."""
    if exc.errno == errno.ELOOP:
        return Refused(
            "SymlinkRefused",
            f"{shown(rel)}: {shown(name)} is a symbolic link; file tools do not follow links",
        )
    if isinstance(exc, FileNotFoundError):
        return Refused("FileNotFound", f"no such file or directory: {shown(rel)}")
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return Refused(
            "SymlinkRefused",
            f"{shown(rel)}: {shown(name)} is a symbolic link; file tools do not follow links",
        )
    if mode and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return Refused("NotARegularFile", f"{shown(rel)}: {shown(name)} is not a regular file")
    if isinstance(exc, NotADirectoryError):
        return Refused("NotADirectory", f"not a directory: {shown(rel)}")
    if isinstance(exc, IsADirectoryError):
        return Refused("IsADirectory", f"{shown(rel)} is a directory")
    return Refused(type(exc).__name__, f"{shown(rel)}: {exc.strerror}")


class Tree:
    """The workspace, reached by descriptor; `dev` is its filesystem."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fd = os.open(root, _DIR_FLAGS)
        self.dev = os.fstat(self.fd).st_dev

    def close(self) -> None:
        os.close(self.fd)

    def _same_fs(self, fd: int, rel: str) -> os.stat_result:
        st = os.fstat(fd)
        if st.st_dev != self.dev:
            raise Refused("PermissionError", f"{shown(rel)} is on another filesystem")
        return st

    def open_dir(self, parts: list[str], rel: str, *, create: bool = False) -> int:
        """A descriptor of the directory `parts` beneath the root, never through a link;
        with `create`, missing directories are made one at a time (mkdirat)."""
        fd = os.dup(self.fd)
        try:
            for name in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                nfd = _open_step(name, fd, rel)
                os.close(fd)
                fd = nfd
                self._same_fs(fd, rel)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open_file(self, rel: str, flags: int, *, create: bool = False) -> tuple[int, int]:
        """(directory fd, file fd) of `rel`, its last component opened with O_NOFOLLOW
        and O_NONBLOCK (a FIFO does not block) and checked to be a regular file."""
        parts = _parts(rel)
        if not parts:
            raise Refused("IsADirectory", "the path names the workspace itself, not a file")
        dfd = self.open_dir(parts[:-1], rel, create=create)
        try:
            name = parts[-1]
            try:
                fd = os.open(
                    name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                    0o644, dir_fd=dfd,
                )  # fmt: skip
            except OSError as exc:
                raise _refusal(exc, name, dfd, rel) from None
            try:
                st = self._same_fs(fd, rel)
                if not stat.S_ISREG(st.st_mode):
                    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                    raise Refused("NotARegularFile", f"{shown(rel)} is {kind}")
            except BaseException:
                os.close(fd)
                raise
            return dfd, fd
        except BaseException:
            os.close(dfd)
            raise


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "file" if stat.S_ISREG(mode) else "other"


def _scan(fd: int) -> tuple[list[os.DirEntry[str]], bool]:
    """Up to SCAN_MAX entries of the directory `fd` (a copy of it: scandir closes its
    own), and whether there were more."""
    out: list[os.DirEntry[str]] = []
    with os.scandir(os.dup(fd)) as it:
        for entry in it:
            if len(out) >= SCAN_MAX:
                return out, True
            out.append(entry)
    return out, False


def list_dir(tree: Tree, rel: str, limit: int) -> dict[str, Any]:
    fd = tree.open_dir(_parts(rel), rel)
    try:
        found, more = _scan(fd)
        found.sort(key=lambda e: e.name)
        out = []
        for entry in found[:limit]:
            try:
                st = entry.stat(follow_symlinks=False)  # fstatat on the directory's fd
            except OSError:
                continue  # gone since it was listed
            out.append(
                {
                    "name": shown(entry.name),
                    "type": _kind(st.st_mode),
                    "size": st.st_size,
                    "mtime": st.st_mtime,
                }
            )
        return {"path": rel, "entries": out, "truncated": more or len(found) > limit}
    finally:
        os.close(fd)


def read(tree: Tree, rel: str, limit: int, offset: int | None = None) -> dict[str, Any]:
    """The file whole (TooLarge past `limit`), or with `offset` at most `limit` bytes of it
    from there, and its size: a window, for files read in parts."""
    dfd, fd = tree.open_file(rel, os.O_RDONLY)
    os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if offset is not None:
            f.seek(max(offset, 0))
            data = f.read(limit)
            return {"path": rel, "size": size, "base64": base64.b64encode(data).decode()}
        if size > limit:
            raise Refused("TooLarge", f"file is {size} bytes; the limit is {limit}")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since fstat
        raise Refused("TooLarge", f"file is over the limit of {limit} bytes")
    return {"path": rel, "size": len(data), "base64": base64.b64encode(data).decode()}


def write(tree: Tree, rel: str, data: bytes, append: bool) -> dict[str, Any]:
    # No O_TRUNC here: nothing is changed before fstat has shown a regular file.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0)
    dfd, fd = tree.open_file(rel, flags, create=True)
    os.close(dfd)
    with os.fdopen(fd, "wb") as f:
        if os.fstat(fd).st_nlink != 1:
            raise Refused(
                "HardLinkRefused", f"{shown(rel)} has other hard links; it is not written"
            )
        if not append:
            os.ftruncate(fd, 0)
        f.write(data)
        f.flush()
        size = os.fstat(fd).st_size
    return {"path": rel, "size": size}


def prune(tree: Tree, rel: str, keep: int) -> dict[str, Any]:
    """Delete all but the newest `keep` spill files in `rel`: regular files whose names
    match SPILL_NAME, unlinked relative to the directory's descriptor. A link on the
    way is refused; nothing is deleted through it."""
    try:
        fd = tree.open_dir(_parts(rel), rel)
    except Refused as exc:
        if exc.kind == "FileNotFound":
            return {"removed": 0}
        raise
    try:
        found, _ = _scan(fd)
        files: list[tuple[float, str]] = []
        for entry in found:
            if not SPILL_NAME.fullmatch(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((st.st_mtime, entry.name))
        files.sort()
        removed = 0
        for _, name in files[: max(len(files) - keep, 0)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
                removed += 1
        return {"removed": removed}
    finally:
        os.close(fd)


# ---- variables --------------------------------------------------------------------------


def within(fn: Callable[[], None], seconds: float) -> bool:
    """Run `fn` (user code: a repr, a len) in a thread of its own for at most `seconds`;
    whether it finished. One that did not is asked to stop (_Timeout raised in it at its
    next bytecode, again while it lasts, for a moment); one that swallows even that, or
    hangs in C, is left behind as a daemon thread: the helper answers on time and the
    session keeps working. A thread, not SIGALRM, because the main thread cannot be
    taken back from code that catches everything."""
    worker = threading.Thread(target=_quietly, args=(fn,), name="mcp-forge-describe")
    worker.daemon = True
    worker.start()
    worker.join(seconds)
    if not worker.is_alive():
        return True
    ident = worker.ident
    for _ in range(10):
        if ident is None or not worker.is_alive():
            break
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(_Timeout)
        )
        worker.join(0.05)
    return False


def _quietly(fn: Callable[[], None]) -> None:
    with contextlib.suppress(BaseException):  # user code raises anything, _Timeout too
        fn()


def _plain_int(x: Any) -> int | None:
    return x if type(x) is int and 0 <= x <= INT_MAX else None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _module_of(t: type) -> str | None:
    # Read through `type`'s own descriptors: a metaclass may override attributes.
    module = type.__dict__["__module__"].__get__(t)
    return module if type(module) is str else None


def _type_name(t: type) -> str:
    module = _module_of(t)
    qualname = type.__dict__["__qualname__"].__get__(t)
    prefix = module + "." if module is not None and module != "builtins" else ""
    return _cut(prefix + str(qualname), NAME_MAX)


def _attempt(fn: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # user code; _Timeout and the like end the run
        fn()


def describe(name: str, v: Any, limit: int, seconds: float) -> dict[str, Any]:
    """What list_variables shows of one value, within `seconds` of user code."""
    t = type(v)  # the real type: `__class__` may lie
    d: dict[str, Any] = {"name": _cut(name, NAME_MAX), "type": _type_name(t)}

    def shape() -> None:
        s = getattr(v, "shape", None)
        if type(s) is tuple and len(s) <= 64 and all(_plain_int(x) is not None for x in s):
            d["shape"] = list(s)

    def dtype() -> None:
        dt = getattr(v, "dtype", None)
        if dt is not None and not callable(dt):
            text = str(dt)
            if type(text) is str:
                d["dtype"] = text[:100]
        elif hasattr(v, "dtypes"):
            d["dtype"] = "mixed"

    def length() -> None:
        if hasattr(t, "__len__") and not isinstance(v, type):
            n = _plain_int(len(v))
            if n is not None:
                d["length"] = n

    def size() -> None:
        nb = getattr(v, "nbytes", None)
        if nb is not None:
            n = _plain_int(nb)
        elif hasattr(v, "memory_usage") and callable(v.memory_usage):
            n = _plain_int(int(v.memory_usage(index=True, deep=False).sum()))
        else:
            n = _plain_int(sys.getsizeof(v))
        if n is not None:
            d["size"] = n

    def text() -> None:
        r = reprlib.Repr()
        r.maxstring = r.maxother = limit
        r.maxlist = r.maxtuple = r.maxdict = r.maxset = 20
        r.maxlevel = 3
        out = r.repr(v) if _module_of(t) == "builtins" else repr(v)
        d["repr"] = _cut(out, limit) if type(out) is str else "<repr is not a str>"

    def everything() -> None:
        for part in (shape, dtype, length, size):
            _attempt(part)
        try:
            text()
        except Exception as exc:
            d["repr"] = "<repr failed: " + _type_name(type(exc)) + ">"

    if within(everything, seconds):
        return d
    out = dict(d)  # a copy: the thread left behind may still write to `d`
    out["repr"] = f"<repr not available: describing it took over {seconds:g}s>"
    return out


def _user_ns(ip: Any) -> Iterator[tuple[str, Any]]:
    hidden = getattr(ip, "user_ns_hidden", {})
    for k, v in list(ip.user_ns.items()):
        if type(k) is not str or k.startswith("_"):
            continue
        if k in hidden or k in ("In", "Out", "exit", "quit", "get_ipython"):
            continue
        if issubclass(type(v), types.ModuleType):
            continue
        yield k, v


def variables(ip: Any, limit: int, repr_max: int) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    end = time.monotonic() + ALL_SECONDS
    for k, v in _user_ns(ip):
        if len(out) >= limit:
            return {"variables": out, "truncated": True}
        left = end - time.monotonic()
        if left <= 0:
            out.append({"name": _cut(k, NAME_MAX), "type": _type_name(type(v))})
            continue
        out.append(describe(k, v, repr_max, min(DESCRIBE_SECONDS, left)))
    return {"variables": out, "truncated": False}


def inspect(ip: Any, var: str, repr_max: int) -> dict[str, Any]:
    ns = ip.user_ns
    if var not in ns:
        raise Refused("NameError", "no variable named " + var[:NAME_MAX])
    return {"variable": describe(var, ns[var], repr_max, DESCRIBE_SECONDS * 2)}


# ---- packages ---------------------------------------------------------------------------


def install(root: str, a: dict[str, Any]) -> dict[str, Any]:
    """Install the wheels the gateway wrote to `a["wheels"]` (beneath the workspace)
    into `a["target"]`, offline and exactly those (no index, no dependency resolution:
    the gateway resolved them), by the kernel's own pip in a subprocess, within
    `a["seconds"]`; the wheels are deleted after, installed or not."""
    import shutil
    import subprocess

    src = os.path.join(root, str(a["wheels"]))
    files = [os.path.join(src, os.path.basename(str(f))) for f in a["files"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PYTHONNOUSERSITE"] = "1"
    command = [
        sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--upgrade", "--no-warn-script-location",
        "--no-compile",
        "--target", os.path.join(root, str(a["target"])), *files,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=float(a["seconds"]),
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Refused("Timeout", f"pip install took longer than {a['seconds']}s") from None
    finally:
        shutil.rmtree(src, ignore_errors=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).decode(errors="replace").strip()[-400:]
        raise Refused("InstallFailed", f"pip install exited {done.returncode}: {tail}")
    return {"installed": len(files)}


# ---- entry point ------------------------------------------------------------------------


def tools(limit: int) -> dict[str, Any]:
    m = sys.modules.get("mcp_tools")
    if m is None:
        return {"servers": [], "stubs": ""}
    got: dict[str, Any] = {}

    def listing() -> None:  # code may have replaced the module
        got["servers"] = [str(n)[:NAME_MAX] for n in list(m.servers())[:1000]]
        got["stubs"] = str(m.describe())[:limit]

    if not within(listing, DESCRIBE_SECONDS * 2) or len(got) != 2:
        raise Refused("Timeout", "mcp_tools did not describe its tools in time")
    return dict(got)


def run(a: dict[str, Any], get_ipython: Callable[[], Any] | None) -> dict[str, Any]:
    """One operation's reply (an error reply for a refused one)."""
    op = a.get("op")
    try:
        if op in ("variables", "inspect", "tools"):
            if op == "tools":
                return tools(int(a["max"]))
            if get_ipython is None:
                raise Refused("UnknownOp", "no IPython here")
            if op == "variables":
                return variables(get_ipython(), int(a["max"]), int(a["repr_max"]))
            return inspect(get_ipython(), str(a["var"]), int(a["repr_max"]))
        if op == "install":
            return install(str(a["root"]), a)
        if op not in ("list", "read", "write", "prune"):
            raise Refused("UnknownOp", str(op)[:100])
        tree = Tree(str(a["root"]))  # the workspace: the gateway names it (sandbox.py)
        try:
            path = str(a["path"])
            if op == "list":
                return list_dir(tree, path, int(a["max"]))
            if op == "read":
                offset = a.get("offset")
                return read(tree, path, int(a["max"]), None if offset is None else int(offset))
            if op == "write":
                return write(tree, path, base64.b64decode(a["base64"]), bool(a.get("append")))
            return prune(tree, path, int(a["keep"]))
        finally:
            tree.close()
    except Refused as exc:
        return {"error": exc.kind, "message": str(exc)[:500]}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:500]}


def main(g: dict[str, Any]) -> None:
    reply = run(json.loads(g["ARGS"]), g.get("get_ipython"))
    print(g["MARKER"] + json.dumps(reply, ensure_ascii=True, default=str))


if "ARGS" in globals() and "MARKER" in globals():
    main(globals())
