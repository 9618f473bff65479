"""Work done inside the kernel on the gateway's behalf: namespace listing, variable
inspection, files in the workspace.

Each operation is a small stdlib-only program run silently (no history, no execution
count, no new names in the user's namespace). It prints one line: a random marker and
JSON. The host parses that JSON with a size bound and checks its shape; it never
evaluates anything the kernel sends. The kernel re-checks path containment with
realpath, so a symlink made by user code cannot lead outside the workspace, and it
only ever touches its own pod's filesystem.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from typing import Any

from .errors import InvalidRequest, KernelProtocolError

WORKSPACE = "/workspace"

_PROGRAM = r"""
import json as _json, os as _os, sys as _sys, base64 as _b64, reprlib as _reprlib, stat as _stat
A = _json.loads(ARGS)
ROOT = _os.path.realpath(A.get("root", "/workspace"))

def _contained(rel):
    p = _os.path.realpath(_os.path.join(ROOT, rel))
    if p != ROOT and not p.startswith(ROOT + "/"):
        raise PermissionError("path leaves the workspace: " + rel)
    return p

def _describe(name, v, limit):
    t = type(v)
    d = {"name": name, "type": (t.__module__ + "." if t.__module__ not in ("builtins", None) else "") + t.__qualname__}
    try:
        shape = getattr(v, "shape", None)
        if isinstance(shape, tuple) and all(isinstance(x, int) for x in shape):
            d["shape"] = list(shape)
    except Exception:
        pass
    try:
        dt = getattr(v, "dtype", None)
        if dt is not None and not callable(dt):
            d["dtype"] = str(dt)[:100]
        elif hasattr(v, "dtypes"):
            d["dtype"] = "mixed"
    except Exception:
        pass
    try:
        if hasattr(t, "__len__") and not isinstance(v, type):
            d["length"] = len(v)
    except Exception:
        pass
    try:
        nb = getattr(v, "nbytes", None)
        if isinstance(nb, int):
            d["size"] = nb
        elif hasattr(v, "memory_usage") and callable(v.memory_usage):
            d["size"] = int(v.memory_usage(index=True, deep=False).sum())
        else:
            d["size"] = _sys.getsizeof(v)
    except Exception:
        pass
    try:
        r = _reprlib.Repr()
        r.maxstring = r.maxother = limit
        r.maxlist = r.maxtuple = r.maxdict = r.maxset = 20
        text = r.repr(v) if t.__module__ == "builtins" else repr(v)
        if len(text) > limit:
            text = text[:limit] + "...[truncated]"
        d["repr"] = text
    except Exception as e:
        d["repr"] = "<repr failed: " + type(e).__name__ + ">"
    return d

def _user_ns():
    ip = get_ipython()
    hidden = getattr(ip, "user_ns_hidden", {})
    for k, v in list(ip.user_ns.items()):
        if k.startswith("_") or k in hidden or k in ("In", "Out", "exit", "quit", "get_ipython"):
            continue
        if type(v).__name__ == "module":
            continue
        yield k, v

def _run():
    op = A["op"]
    if op == "variables":
        out = []
        for k, v in _user_ns():
            if len(out) >= A["max"]:
                return {"variables": out, "truncated": True}
            out.append(_describe(k, v, A["repr_max"]))
        return {"variables": out, "truncated": False}
    if op == "inspect":
        ns = get_ipython().user_ns
        if A["var"] not in ns:
            return {"error": "NameError", "message": "no variable named " + A["var"]}
        return {"variable": _describe(A["var"], ns[A["var"]], A["repr_max"])}
    if op == "list":
        p = _contained(A["path"])
        if not _os.path.isdir(p):
            return {"error": "NotADirectory", "message": "not a directory: " + A["path"]}
        out = []
        names = sorted(_os.listdir(p))
        for n in names[: A["max"]]:
            st = _os.lstat(_os.path.join(p, n))
            kind = "dir" if _stat.S_ISDIR(st.st_mode) else "symlink" if _stat.S_ISLNK(st.st_mode) else "file"
            out.append({"name": n, "type": kind, "size": st.st_size, "mtime": st.st_mtime})
        return {"path": A["path"], "entries": out, "truncated": len(names) > A["max"]}
    if op == "read":
        p = _contained(A["path"])
        if not _os.path.isfile(p):
            return {"error": "FileNotFound", "message": "no such file: " + A["path"]}
        size = _os.path.getsize(p)
        if size > A["max"]:
            return {"error": "TooLarge", "message": "file is %d bytes; the limit is %d" % (size, A["max"])}
        with open(p, "rb") as f:
            data = f.read(A["max"] + 1)
        return {"path": A["path"], "size": len(data), "base64": _b64.b64encode(data).decode()}
    if op == "write":
        p = _contained(A["path"])
        _os.makedirs(_os.path.dirname(p), exist_ok=True)
        _contained(A["path"])  # again, after making directories
        data = _b64.b64decode(A["base64"])
        flags = _os.O_WRONLY | _os.O_CREAT | _os.O_NOFOLLOW | (_os.O_APPEND if A.get("append") else _os.O_TRUNC)
        fd = _os.open(p, flags, 0o644)
        with _os.fdopen(fd, "wb") as f:
            f.write(data)
        return {"path": A["path"], "size": _os.path.getsize(p)}
    if op == "prune":
        p = _contained(A["path"])
        if not _os.path.isdir(p):
            return {"removed": 0}
        files = [_os.path.join(p, n) for n in _os.listdir(p)]
        files = sorted((f for f in files if _os.path.isfile(f) and not _os.path.islink(f)), key=_os.path.getmtime)
        old = files[: max(len(files) - A["keep"], 0)]
        for f in old:
            _os.remove(f)
        return {"removed": len(old)}
    if op == "tools":
        m = _sys.modules.get("mcp_tools")
        if m is None:
            return {"servers": [], "stubs": ""}
        return {"servers": [str(n) for n in m.servers()], "stubs": str(m.describe())[: A["max"]]}
    return {"error": "UnknownOp", "message": op}

try:
    _r = _run()
except Exception as _e:
    _r = {"error": type(_e).__name__, "message": str(_e)[:500]}
print(MARKER + _json.dumps(_r, default=str))
"""


def program(op: str, **args: Any) -> tuple[str, str]:
    """The code to run for `op`, and the marker its reply line starts with."""
    marker = "\x1e" + secrets.token_hex(8) + ":"
    payload = json.dumps({"op": op, "root": WORKSPACE, **args})
    env = {"ARGS": payload, "MARKER": marker}
    # Nothing of ours lands in the user's namespace: the program runs in its own globals.
    code = (
        f"exec(compile({_PROGRAM!r}, '<mcp-forge>', 'exec'), "
        f"{{'__builtins__': __builtins__, 'get_ipython': get_ipython, "
        f"'ARGS': {env['ARGS']!r}, 'MARKER': {env['MARKER']!r}}})"
    )
    return code, marker


def parse_reply(stdout: str, marker: str, *, limit: int) -> dict[str, Any]:
    """The JSON object after `marker` in the helper's stdout; refuse anything else."""
    if len(stdout) > limit:
        raise KernelProtocolError(
            f"the kernel's reply is {len(stdout)} bytes, over the {limit} limit"
        )
    at = stdout.rfind(marker)
    if at < 0:
        raise KernelProtocolError("the kernel did not answer the request (no reply line)")
    line = stdout[at + len(marker) :].split("\n", 1)[0]
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise KernelProtocolError(f"the kernel's reply is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise KernelProtocolError("the kernel's reply is not a JSON object")
    return value


def workspace_path(path: str) -> str:
    """A path relative to the workspace, or InvalidRequest if it could leave it."""
    if not isinstance(path, str) or "\x00" in path:
        raise InvalidRequest("path must be a string without NUL bytes")
    if len(path) > 4096:
        raise InvalidRequest("path is longer than 4096 characters")
    p = path.strip()
    if p in ("", ".", WORKSPACE, WORKSPACE + "/"):
        return "."
    if p.startswith(WORKSPACE + "/"):
        p = p[len(WORKSPACE) + 1 :]
    elif p.startswith("/"):
        raise InvalidRequest(f"{path!r}: absolute paths must be under {WORKSPACE}")
    norm = posixpath.normpath(p)
    if norm == ".." or norm.startswith("../"):
        raise InvalidRequest(f"{path!r} leaves the workspace")
    return norm


def bridge_program(address: tuple[str | int, ...]) -> str:
    """The silent code that starts code mode's bridge in a kernel (kernel_bridge.SOURCE),
    listening at `address`; like the helpers, it leaves no name in the user's namespace."""
    from .kernel_bridge import SOURCE

    return (
        f"exec(compile({SOURCE!r}, '<mcp_tools>', 'exec'), "
        f"{{'__builtins__': __builtins__, 'BRIDGE_ADDRESS': {tuple(address)!r}}})"
    )
