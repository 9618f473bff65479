"""Code mode's bridge, kernel side (kernelside/mcp_tools.py, started by bridge_boot.py).

Most tests run the program the gateway sends (introspection.bridge_program, with a
Unix-socket address) in a real, separate Python process: the child (stdlib only, no
mcp_forge: `python -I -S`) executes it, then runs the cells this test writes on its
stdin, one JSON line back for each. The test is the gateway: it dials the socket, says
hello and answers calls with framing's encode/FrameReader. The pure parts of the module
(names, results, requests) are also tested imported. Every wait has a deadline: socket
timeouts, queue timeouts, no sleeps.
"""

from __future__ import annotations

import ast
import json
import math
import os
import queue
import random
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.gateway.introspection import bridge_program
from mcp_forge.kernelside import mcp_tools
from mcp_forge.kernelside.framing import GATEWAY_FRAME_MAX, KERNEL_FRAME_MAX, FrameReader, encode

DEADLINE = 10.0  # seconds, for any one wait

# The kernel stand-in. Cells run on its main thread, as in a kernel, so SIGINT lands there.
DRIVER = r"""
import json, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
PROGRAM = open(sys.argv[1]).read()
namespace = {"__builtins__": __builtins__}
exec(compile(PROGRAM, "<bridge>", "exec"), namespace)
print(json.dumps({"ok": True, "result": sorted(namespace)}), flush=True)
user = {"__name__": "__cell__", "PROGRAM": PROGRAM}
while True:
    line = sys.stdin.readline()
    if not line:
        break
    user.pop("result", None)
    try:
        exec(compile(json.loads(line), "<cell>", "exec"), user)
        reply = {"ok": True, "result": user.get("result")}
    except BaseException as exc:
        reply = {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "server": getattr(exc, "server", None),
            "tool": getattr(exc, "tool", None),
            "kind": getattr(exc, "kind", None),
        }
    print(json.dumps(reply, default=repr), flush=True)
"""


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


SEARCH = {
    "name": "search-files",
    "description": "Search the workspace's files.\nBest matches first.",
    "inputSchema": _schema(
        {
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"type": "integer", "default": 10, "description": "At most this many."},
            "from": {"type": "number", "description": "Only files newer than this."},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"type": "string", "enum": ["fast", "full"]},
            "options": {"type": ["object", "null"]},
        },
        ["query"],
    ),
    "annotations": {"readOnlyHint": True},
}
ECHO = {
    "name": "echo",
    "description": "Echo n back.",
    "inputSchema": _schema({"n": {"type": "integer"}, "blob": {"type": "string"}}, ["n"]),
}
ODD_TOOLS = [
    ECHO,
    {"name": "class", "description": 'Ends in a quote: """x"', "inputSchema": _schema({}, [])},
    {"name": "3d-render", "inputSchema": _schema({}, [])},
    {"name": "__init__"},
]
SERVERS = {
    "files": {"tools": [SEARCH, ECHO]},
    "my-server": {"tools": [ECHO]},
    "my_server": {"tools": [ECHO]},
    "describe": {"tools": ODD_TOOLS},
}


class Kernel:
    """A separate Python process that executed the bridge's program and runs cells sent on
    its stdin."""

    def __init__(self, workdir: Path, socket_path: Path) -> None:
        self.socket_path = socket_path
        program, driver = workdir / "bridge.py", workdir / "driver.py"
        program.write_text(bridge_program(("unix", str(socket_path))))
        driver.write_text(DRIVER)
        self._stderr = (workdir / "stderr.txt").open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(driver), str(program)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.namespace_after_program = self.reply()["result"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def start(self, code: str) -> None:
        """Send a cell; its reply comes later (reply())."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=DEADLINE)
        except queue.Empty:
            pytest.fail(f"the kernel did not answer within {DEADLINE}s; stderr: {self.stderr()}")
        if not line:
            pytest.fail(f"the kernel exited; stderr: {self.stderr()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, code: str) -> Any:
        """Run a cell; return its `result`."""
        self.start(code)
        reply = self.reply()
        assert reply["ok"], reply
        return reply["result"]

    def fails(self, code: str) -> dict[str, Any]:
        """Run a cell that raises; return what it raised."""
        self.start(code)
        reply = self.reply()
        assert not reply["ok"], reply
        return reply

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE)
        self._stderr.close()


class Gateway:
    """The test's side of one bridge connection."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(DEADLINE)
        self.sock.connect(str(path))
        self.reader = FrameReader(KERNEL_FRAME_MAX)
        self.frames: deque[dict[str, Any]] = deque()

    def send(self, frame: dict[str, Any]) -> None:
        self.sock.sendall(encode(frame))

    def hello(self, servers: dict[str, Any] = SERVERS) -> None:
        self.send({"v": 1, "type": "hello", "servers": servers})

    def receive(self) -> dict[str, Any]:
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the kernel closed the bridge connection")
            self.frames.extend(self.reader.feed(data))
        return self.frames.popleft()

    def calls(self, count: int) -> list[dict[str, Any]]:
        calls = [self.receive() for _ in range(count)]
        assert all(call["type"] == "call" for call in calls), calls
        return calls

    def answer(self, call: dict[str, Any], **fields: Any) -> None:
        self.send({"v": 1, "type": "result", "id": call["id"], **fields})

    def ok(self, call: dict[str, Any], structured: Any = None, content: Any = ()) -> None:
        self.answer(call, ok=True, structured=structured, content=list(content), isError=False)

    def wait_closed(self) -> None:
        """Read until the kernel closes the connection (frames on the way are dropped)."""
        while self.sock.recv(1 << 16):
            pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def rundir() -> Iterator[Path]:
    # Short: a Unix socket's path is at most 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="mfb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kernel(rundir: Path) -> Iterator[Kernel]:
    k = Kernel(rundir, rundir / "run" / "bridge" / "bridge.sock")
    yield k
    k.close()


@pytest.fixture
def gateway(kernel: Kernel) -> Iterator[Gateway]:
    """A gateway connected to `kernel`, its hello applied."""
    gw = Gateway(kernel.socket_path)
    gw.hello()
    assert kernel.run("import mcp_tools\nresult = mcp_tools.wait_connected(10)") is True
    yield gw
    gw.close()


# -- the listener --------------------------------------------------------------------


def test_the_program_leaves_no_names_and_listens_on_a_private_socket(kernel: Kernel) -> None:
    assert kernel.namespace_after_program == ["__builtins__"]
    mode = kernel.socket_path.lstat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(kernel.socket_path.parent.stat().st_mode) == 0o700  # made by the kernel
    assert kernel.run("import mcp_tools\nresult = mcp_tools.wait_connected(0)") is False
    # It needs nothing but the standard library: the kernel has no mcp_forge.
    assert (
        kernel.run("import importlib.util\nresult = importlib.util.find_spec('mcp_forge')") is None
    )


def test_a_stale_socket_of_an_earlier_kernel_is_replaced(rundir: Path) -> None:
    path = rundir / "bridge.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # its file stays, nobody listens
    kernel = Kernel(rundir, path)
    try:
        gw = Gateway(path)
        gw.hello()
        assert kernel.run("import mcp_tools\nresult = mcp_tools.wait_connected(10)") is True
        gw.close()
    finally:
        kernel.close()


def test_executing_the_program_again_keeps_one_listener_and_its_state(
    kernel: Kernel, gateway: Gateway
) -> None:
    again = kernel.run(
        """
        import sys, threading
        before = sys.modules["mcp_tools"]
        again = {"__builtins__": __builtins__}
        exec(compile(PROGRAM, "<bridge>", "exec"), again)
        del sys.modules["mcp_tools"]  # user code may drop it: the listener thread still knows it
        exec(compile(PROGRAM, "<bridge>", "exec"), dict(again))
        result = {
            "same": sys.modules["mcp_tools"] is before,
            "listeners": [t.name for t in threading.enumerate()].count("mcp-forge-bridge"),
            "names": sorted(again),
            "connected": before.wait_connected(0),
            "servers": sorted(before.servers()),
        }
        """
    )
    assert again == {
        "same": True,
        "listeners": 1,
        "names": ["__builtins__"],
        "connected": True,
        "servers": ["describe_", "files", "my_server", "my_server_"],
    }
    kernel.start("result = mcp_tools.files.echo(n=7)")  # the same connection still serves
    gateway.ok(gateway.receive(), structured={"n": 7})
    assert kernel.reply()["result"] == {"n": 7}


# -- the module ----------------------------------------------------------------------


def test_a_tool_is_a_function_with_the_schemas_signature_and_docstring(
    kernel: Kernel, gateway: Gateway
) -> None:
    stub = kernel.run(
        """
        import inspect
        f = mcp_tools.files.search_files
        sig = inspect.signature(f)
        result = {
            "signature": str(sig),
            "kinds": sorted({p.kind.name for p in sig.parameters.values()}),
            "limit": sig.parameters["limit"].default,
            "name": f.__name__,
            "qualname": f.__qualname__,
            "module": f.__module__,
            "doc": f.__doc__,
            "aio": str(inspect.signature(f.aio)),
            "aio_is_async": inspect.iscoroutinefunction(f.aio),
            "aio_path": mcp_tools.aio.files.search_files is f.aio,
            "aio_qualname": f.aio.__qualname__,
        }
        """
    )
    signature = (
        "(*, query: str, limit: int = 10, from_: float | None = None,"
        " tags: list[str] | None = None, mode: str | None = None, options: dict | None = None)"
    )
    assert stub["signature"] == signature
    assert stub["aio"] == signature
    assert stub["kinds"] == ["KEYWORD_ONLY"]
    assert stub["limit"] == 10
    assert (stub["name"], stub["qualname"], stub["module"]) == (
        "search_files",
        "files.search_files",
        "mcp_tools",
    )
    assert stub["aio_is_async"] and stub["aio_path"]
    assert stub["aio_qualname"] == "files.search_files.aio"
    doc = stub["doc"]
    assert doc.startswith("Search the workspace's files.\nBest matches first.\n")
    assert "    query (str, required): What to look for." in doc
    assert "    limit (int, default 10): At most this many." in doc
    assert "    from_ (float, optional, sent as 'from'): Only files newer than this." in doc
    assert "    mode (str, optional): One of: 'fast', 'full'." in doc
    assert "Hints: read-only." in doc
    assert "MCP tool 'search-files' of server 'files'." in doc


def test_names_become_distinct_identifiers_clear_of_keywords_and_mcp_tools_own(
    kernel: Kernel, gateway: Gateway
) -> None:
    assert kernel.run("result = mcp_tools.servers()") == {
        "describe_": ["_3d_render", "__init___", "class_", "echo"],
        "files": ["echo", "search_files"],
        "my_server": ["echo"],
        "my_server_": ["echo"],
    }
    assert kernel.run("result = callable(mcp_tools.describe)") is True
    # "my_server" keeps its exact name; "my-server" gets the next free one.
    kernel.start("result = mcp_tools.my_server_.echo(n=1)")
    call = gateway.receive()
    assert (call["server"], call["tool"]) == ("my-server", "echo")
    gateway.ok(call, structured={})
    assert kernel.reply()["ok"]


def test_describe_returns_the_stubs_as_python_source(kernel: Kernel, gateway: Gateway) -> None:
    text = kernel.run("result = mcp_tools.describe()")
    tree = ast.parse(text)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert sorted(classes) == ["describe_", "files", "my_server", "my_server_"]
    functions = [node for node in classes["files"].body if isinstance(node, ast.FunctionDef)]
    assert [f.name for f in functions] == ["search_files", "echo"]
    search = functions[0]
    assert [a.arg for a in search.args.kwonlyargs][:2] == ["query", "limit"]
    assert ast.get_docstring(search, clean=False) is not None
    odd = {n.name: n for n in classes["describe_"].body if isinstance(n, ast.FunctionDef)}
    assert ast.get_docstring(odd["class_"]) == 'Ends in a quote: """x"' + (
        "\n\nMCP tool 'class' of server 'describe'."
    )
    only = kernel.run("result = mcp_tools.describe('my-server')")
    assert "class my_server_:" in only and "class files:" not in only
    assert kernel.fails("mcp_tools.describe('nope')")["type"] == "ValueError"


def test_a_call_returns_structured_content_else_text_else_content_items(
    kernel: Kernel, gateway: Gateway
) -> None:
    image = {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}
    answers: list[tuple[dict[str, Any], Any]] = [
        ({"structured": {"total": 3}, "content": [{"type": "text", "text": "{}"}]}, {"total": 3}),
        ({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, "a\nb"),
        (
            {"content": [{"type": "text", "text": "see"}, image]},
            [{"type": "text", "text": "see"}, image],
        ),
        ({"content": []}, None),
    ]
    for fields, expected in answers:
        kernel.start("result = mcp_tools.files.echo(n=1)")
        gateway.ok(gateway.receive(), **fields)
        assert kernel.reply() == {"ok": True, "result": expected}


def test_a_call_sends_only_the_given_arguments_under_their_json_names(
    kernel: Kernel, gateway: Gateway
) -> None:
    kernel.start("result = mcp_tools.files.search_files(query='x', from_=1.5, mode=None)")
    call = gateway.receive()
    assert call == {
        "v": 1,
        "type": "call",
        "id": call["id"],
        "server": "files",
        "tool": "search-files",
        "arguments": {"query": "x", "from": 1.5},
    }
    assert type(call["id"]) is int and call["id"] > 0
    gateway.ok(call, content=[{"type": "text", "text": "done"}])
    assert kernel.reply()["result"] == "done"


@pytest.mark.parametrize(
    ("kind", "raised"),
    [
        ("denied", "PermissionError"),
        ("tool", "ToolError"),
        ("unavailable", "ToolError"),
        ("invalid", "ValueError"),
    ],
)
def test_an_error_result_raises_the_error_of_its_kind_with_its_message(
    kernel: Kernel, gateway: Gateway, kind: str, raised: str
) -> None:
    kernel.start("mcp_tools.files.echo(n=1)")
    message = f"echo said no ({kind})"
    gateway.answer(gateway.receive(), ok=False, error={"kind": kind, "message": message})
    error = kernel.reply()
    assert (error["type"], error["message"]) == (raised, message)
    assert (error["server"], error["tool"], error["kind"]) == ("files", "echo", kind)


def test_tool_error_is_an_exception_of_mcp_tools(kernel: Kernel, gateway: Gateway) -> None:
    kernel.start(
        """
        try:
            mcp_tools.files.echo(n=1)
        except mcp_tools.ToolError as exc:
            result = [type(exc).__module__, isinstance(exc, Exception), str(exc)]
        """
    )
    call = gateway.receive()
    gateway.answer(call, ok=True, isError=True, content=[{"type": "text", "text": "boom"}])
    assert kernel.reply()["result"] == ["mcp_tools", True, "boom"]


def test_missing_unknown_or_positional_arguments_raise_type_error_before_sending(
    kernel: Kernel, gateway: Gateway
) -> None:
    for cell, says in [
        ("mcp_tools.files.search_files(limit=1)", "missing a required argument: 'query'"),
        ("mcp_tools.files.echo(n=1, m=2)", "unexpected keyword argument 'm'"),
        ("mcp_tools.files.echo(1)", "too many positional arguments"),
    ]:
        error = kernel.fails(cell)
        assert error["type"] == "TypeError"
        assert says in error["message"] and error["message"].startswith("mcp_tools.files.")
    kernel.start("result = mcp_tools.files.echo(n=2)")
    call = gateway.receive()  # the first frame the gateway sees
    assert call["arguments"] == {"n": 2}
    gateway.ok(call, structured={"n": 2})
    assert kernel.reply()["result"] == {"n": 2}


def test_fifty_calls_from_threads_are_answered_out_of_order(
    kernel: Kernel, gateway: Gateway
) -> None:
    kernel.start(
        """
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(50) as pool:
            futures = [pool.submit(mcp_tools.files.echo, n=n) for n in range(50)]
            result = [f.result(timeout=30) for f in futures]
        """
    )
    calls = gateway.calls(50)  # all fifty wait at once
    assert len({call["id"] for call in calls}) == 50
    random.Random(1).shuffle(calls)
    for call in calls:
        gateway.ok(call, structured={"n": call["arguments"]["n"]})
    assert kernel.reply()["result"] == [{"n": n} for n in range(50)]


def test_fifty_asyncio_calls_are_answered_out_of_order(kernel: Kernel, gateway: Gateway) -> None:
    kernel.start(
        """
        import asyncio
        async def main():
            calls = [
                mcp_tools.files.echo.aio(n=n) if n % 2 else mcp_tools.aio.files.echo(n=n)
                for n in range(50)
            ]
            return await asyncio.wait_for(asyncio.gather(*calls), 30)
        result = asyncio.run(main())
        """
    )
    calls = gateway.calls(50)
    random.Random(2).shuffle(calls)
    for call in calls:
        gateway.ok(call, content=[{"type": "text", "text": str(call["arguments"]["n"])}])
    assert kernel.reply()["result"] == [str(n) for n in range(50)]


def test_an_oversized_request_raises_value_error_and_later_calls_work(
    kernel: Kernel, gateway: Gateway
) -> None:
    error = kernel.fails("mcp_tools.files.echo(n=1, blob='x' * (1 << 20))")
    assert error["type"] == "ValueError"
    assert "over the MCP bridge's limit of 1048576 (1 MiB)" in error["message"]
    kernel.start("result = mcp_tools.files.echo(n=1, blob='x' * 1000)")
    call = gateway.receive()
    assert call["arguments"]["blob"] == "x" * 1000
    gateway.ok(call, structured={"ok": True})
    assert kernel.reply()["result"] == {"ok": True}


def test_keyboard_interrupt_while_waiting_sends_a_cancel_frame(
    kernel: Kernel, gateway: Gateway
) -> None:
    kernel.start("mcp_tools.files.echo(n=1)")
    call = gateway.receive()
    os.kill(kernel.proc.pid, signal.SIGINT)
    assert gateway.receive() == {"v": 1, "type": "cancel", "id": call["id"]}
    assert kernel.reply()["type"] == "KeyboardInterrupt"
    gateway.ok(call, structured={"late": True})  # an answer it could not stop: ignored
    kernel.start("result = mcp_tools.files.echo(n=2)")
    second = gateway.receive()
    gateway.ok(second, structured={"n": 2})
    assert kernel.reply()["result"] == {"n": 2}


def test_cancelling_an_asyncio_call_sends_a_cancel_frame(kernel: Kernel, gateway: Gateway) -> None:
    kernel.start(
        """
        import asyncio
        async def main():
            try:
                await asyncio.wait_for(mcp_tools.files.echo.aio(n=1), 0.2)
            except TimeoutError:
                return "timed out"
        result = asyncio.run(main())
        """
    )
    call = gateway.receive()
    assert gateway.receive() == {"v": 1, "type": "cancel", "id": call["id"]}
    assert kernel.reply()["result"] == "timed out"


def test_a_newer_connection_replaces_the_older_and_fails_its_calls(
    kernel: Kernel, gateway: Gateway
) -> None:
    kernel.start("mcp_tools.files.echo(n=1)")
    gateway.receive()
    newer = Gateway(kernel.socket_path)
    newer.hello({"files": {"tools": [ECHO]}})
    error = kernel.reply()
    assert (error["type"], error["message"]) == (
        "ToolError",
        "the MCP bridge connection was replaced",
    )
    gateway.wait_closed()
    assert kernel.run("result = mcp_tools.wait_connected(10)") is True
    assert kernel.run("result = mcp_tools.servers()") == {"files": ["echo"]}  # its hello
    kernel.start("result = mcp_tools.files.echo(n=2)")
    newer.ok(newer.receive(), structured={"n": 2})
    assert kernel.reply()["result"] == {"n": 2}
    newer.close()


def impatient(kernel: Kernel) -> None:
    """A call made after the gateway closed waits RECONNECT_WAIT (5 s) for its next dial;
    the tests of a connection that stays closed wait 0.2 s."""
    kernel.run(
        "import sys\n"
        "bridge = sys.modules['mcp_tools'].__mcp_forge_bridge__\n"
        "type(bridge).__init__.__globals__['RECONNECT_WAIT'] = 0.2"
    )


def test_a_closed_connection_fails_its_calls_and_later_calls_say_not_connected(
    kernel: Kernel, gateway: Gateway
) -> None:
    impatient(kernel)
    kernel.start("mcp_tools.files.echo(n=1)")
    gateway.receive()
    gateway.close()
    error = kernel.reply()
    assert (error["type"], error["message"]) == (
        "ToolError",
        "the MCP bridge connection was closed",
    )
    error = kernel.fails("mcp_tools.files.echo(n=2)")
    assert (error["type"], error["message"], error["kind"]) == (
        "ToolError",
        "the MCP bridge is not connected",
        "unavailable",
    )
    assert kernel.run("result = mcp_tools.wait_connected(0)") is False


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (struct.pack(">I", GATEWAY_FRAME_MAX + 1), "over the limit"),
        (struct.pack(">I", 5) + b"{nope", "not JSON"),
        (encode({"v": 1, "type": "hello", "servers": []}), "servers object"),
        (encode({"v": 1, "type": "result", "id": "one", "ok": True}), "positive integer id"),
    ],
)
def test_a_bad_frame_from_the_gateway_closes_the_connection(
    kernel: Kernel, gateway: Gateway, data: bytes, says: str
) -> None:
    impatient(kernel)
    kernel.start("mcp_tools.files.echo(n=1)")
    gateway.receive()
    gateway.sock.sendall(data)
    gateway.wait_closed()
    error = kernel.reply()
    assert error["type"] == "ToolError"
    assert error["message"].startswith("the MCP bridge connection was closed: the gateway sent")
    assert says in error["message"]
    later = kernel.fails("mcp_tools.files.echo(n=2)")
    assert later["message"].startswith("the MCP bridge is not connected (")  # and why


def test_a_first_frame_that_is_not_a_hello_closes_the_connection(kernel: Kernel) -> None:
    gw = Gateway(kernel.socket_path)
    gw.send({"v": 1, "type": "result", "id": 1, "ok": True})
    gw.wait_closed()
    assert kernel.run("import mcp_tools\nresult = mcp_tools.wait_connected(0)") is False
    gw.close()


# -- the module, imported ------------------------------------------------------------


def test_names_follow_the_rule_the_module_docstring_states() -> None:
    names = ["my-server", "my_server", "3d-render", "class", "__init__", "servers", "é", ""]
    assert mcp_tools.identifiers(names, mcp_tools.OWN_NAMES) == {
        "my_server": "my_server",  # needs no change: claims its name first
        "my-server": "my_server_",
        "3d-render": "_3d_render",
        "class": "class_",
        "__init__": "__init___",
        "servers": "servers_",  # one of mcp_tools' own
        "": "_",
        "é": "__",  # after "" in sorted order: "_" is taken by then
    }
    assert "my_server, unless a server is named my_server: then it is my_server_" in " ".join(
        (mcp_tools.__doc__ or "").split()
    )


def test_a_request_that_cannot_be_sent_as_json_names_the_tool_and_the_reason() -> None:
    bridge = mcp_tools.Bridge(types.ModuleType("mcp_tools"))
    tool = mcp_tools.Tool("files", "files", ECHO, "echo")
    with pytest.raises(TypeError, match=r"^mcp_tools\.files\.echo\(\): an argument is not JSON: "):
        bridge.request(tool, {"n": {1, 2}})
    with pytest.raises(ValueError, match="the arguments cannot be sent as JSON: Out of range"):
        bridge.request(tool, {"n": math.nan})
    with pytest.raises(ValueError, match="the arguments cannot be sent as JSON: 'utf-8' codec"):
        bridge.request(tool, {"n": "\ud800"})
    with pytest.raises(ValueError, match=r"over the MCP bridge's limit of 1048576 \(1 MiB\)$"):
        bridge.request(tool, {"n": 1, "blob": "x" * KERNEL_FRAME_MAX})
    call_id, data = bridge.request(tool, {"n": 1})
    assert list(FrameReader().feed(data)) == [
        {
            "v": 1,
            "type": "call",
            "id": call_id,
            "server": "files",
            "tool": "echo",
            "arguments": {"n": 1},
        }
    ]


@pytest.mark.parametrize(
    ("frame", "value"),
    [
        ({"ok": True, "structured": {"a": 1}, "content": []}, {"a": 1}),
        (
            {"ok": True, "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            "a\nb",
        ),
        (
            {"ok": True, "content": [{"type": "image", "data": "", "mimeType": "image/png"}]},
            [{"type": "image", "data": "", "mimeType": "image/png"}],
        ),
        ({"ok": True, "content": None}, None),
    ],
)
def test_a_result_frame_gives_structured_content_else_text_else_items(
    frame: dict[str, Any], value: Any
) -> None:
    assert mcp_tools.outcome(frame, "files", "echo") == (value, None)


@pytest.mark.parametrize(
    ("frame", "raised", "message", "kind"),
    [
        (
            {"ok": False, "error": {"kind": "denied", "message": "no"}},
            PermissionError,
            "no",
            "denied",
        ),
        (
            {"ok": False, "error": {"kind": "invalid", "message": "bad"}},
            ValueError,
            "bad",
            "invalid",
        ),
        (
            {"ok": False, "error": {"kind": "unavailable"}},
            mcp_tools.ToolError,
            "the call failed (unavailable)",
            "unavailable",
        ),
        ({"ok": False}, mcp_tools.ToolError, "the call failed (tool)", "tool"),
        (
            {"ok": True, "isError": True, "content": []},
            mcp_tools.ToolError,
            "the tool reported an error",
            "tool",
        ),
        (
            {"ok": True, "content": "text"},
            mcp_tools.ToolError,
            "the gateway sent a malformed result",
            "unavailable",
        ),
        (
            {"ok": "yes", "content": []},
            mcp_tools.ToolError,
            "the gateway sent a malformed result",
            "unavailable",
        ),
        (
            {"ok": True, "content": [1]},
            mcp_tools.ToolError,
            "the gateway sent a malformed result",
            "unavailable",
        ),
    ],
)
def test_an_error_or_malformed_result_frame_gives_the_exception_of_its_kind(
    frame: dict[str, Any], raised: type[Exception], message: str, kind: str
) -> None:
    value, error = mcp_tools.outcome(frame, "files", "echo")
    assert value is None and type(error) is raised
    assert str(error) == message
    # PermissionError and ValueError carry them too, as instance attributes (`failure`).
    carried = {name: vars(error).get(name) for name in ("server", "tool", "kind")}
    assert carried == {"server": "files", "tool": "echo", "kind": kind}
