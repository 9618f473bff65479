"""Work done inside the kernel on the gateway's behalf: namespace listing, variable
inspection, files in the workspace.

Each operation runs the stdlib-only module kernelside/helpers.py silently (no history,
no execution count, no new names in the user's namespace). It prints one line: a random
marker and JSON. The host parses that JSON with a size bound and checks its shape; it
never evaluates anything the kernel sends. Paths are checked twice: here
(`workspace_path`: relative, normalized, never above the workspace) and in the kernel,
which opens them beneath a descriptor of the workspace one component at a time and
never follows a symbolic link (see kernelside/helpers.py), so a link or a rename race
made by user code cannot lead a file tool anywhere else; it only ever touches its own
pod's filesystem.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import secrets
from typing import Any

from mcp_forge.errors import InvalidRequest, KernelProtocolError
from mcp_forge.kernelside import run_silently, source
from mcp_forge.sandbox import WORKSPACE


def program(op: str, **args: Any) -> tuple[str, str]:
    """The code to run for `op`, and the marker its reply line starts with."""
    marker = "\x1e" + secrets.token_hex(8) + ":"
    payload = json.dumps({"op": op, "root": WORKSPACE, **args})
    env = {"ARGS": payload, "MARKER": marker}
    # Nothing of ours lands in the user's namespace: the program runs in its own globals.
    # Its compiled code is kept on the kernel's `sys` under a name holding the source's
    # hash (compiling it costs more than the rest of a call); kernel code could swap it,
    # but could fake any answer anyway: nothing the kernel sends is trusted.
    text, key = _helpers_source()
    compiled = (
        f"(lambda d: d.get({key!r}) or d.setdefault({key!r}, "
        f"compile({text!r}, '<mcp-forge>', 'exec')))(__import__('sys').__dict__)"
    )
    names = {"get_ipython": "get_ipython", "ARGS": repr(env["ARGS"]), "MARKER": repr(marker)}
    return run_silently(compiled, names), marker


@functools.cache
def _helpers_source() -> tuple[str, str]:
    """kernelside/helpers.py as sent, and the key its compiled code is kept under."""
    text = source("helpers")
    return text, "_mcp_forge_helpers_" + hashlib.sha256(text.encode()).hexdigest()[:16]


# A reply's bytes bound its parse only so far: 16 MB of `[{},{},...]` is 5 million
# objects, 0.5-1.7 s on the gateway's loop and 420 MB. Large replies are files (one
# base64 string) or tool stubs (text): past SMALL_REPLY, one with more separators and
# brackets (outside strings or in them: counted, not parsed) than these is refused.
SMALL_REPLY = 2_000_000
LARGE_REPLY_VALUES = 100_000


def _structure(line: str) -> int:
    return line.count(",") + line.count("[") + line.count("{")


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
    if len(line) > SMALL_REPLY and _structure(line) > LARGE_REPLY_VALUES:
        raise KernelProtocolError(
            f"the kernel's reply is {len(line)} bytes of over {LARGE_REPLY_VALUES} values"
        )
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
    """The silent code that starts code mode's bridge in a kernel, listening at `address`
    (kernelside/bridge_boot.py, given the sources of mcp_tools.py and its modules); like
    the helpers, it leaves no name in the user's namespace, and run again it finds the
    running bridge."""
    boot, sources = _bridge_literals()
    code = f"compile({boot}, '<mcp-forge-bridge>', 'exec')"
    return run_silently(code, {"BRIDGE_ADDRESS": repr(tuple(address)), "SOURCES": sources})


@functools.cache
def _bridge_literals() -> tuple[str, str]:
    """kernelside/bridge_boot.py's source, and the sources it builds the bridge from (a
    dict by module name: bridge_boot.MODULES and mcp_tools), as Python literals."""
    names = ("framing", "mcp_stubs", "mcp_channel", "mcp_tools")
    sources = {name: source(name) for name in names}
    return repr(source("bridge_boot")), repr(sources)
