"""The kernel-side file helpers (kernelside/helpers.py) against a real directory tree.

The helpers are plain stdlib code; here they run in this process (or, for the program
as the gateway sends it, in a child Python) against a temporary workspace, with links,
FIFOs, rename races and odd names made for real.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from mcp_forge.gateway import introspection
from mcp_forge.kernelside import helpers


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_text("OUTSIDE-SECRET")
    return path


def op(ws: Path, name: str, **args: Any) -> dict[str, Any]:
    return helpers.run({"op": name, "root": str(ws), **args}, None)


def read(ws: Path, path: str) -> dict[str, Any]:
    return op(ws, "read", path=path, max=1_000_000)


def test_a_plain_file_is_read(ws: Path) -> None:
    (ws / "d").mkdir()
    (ws / "d" / "a.txt").write_bytes(b"hello")
    got = read(ws, "d/a.txt")
    assert base64.b64decode(got["base64"]) == b"hello"


def test_a_symlink_as_the_last_component_is_refused(ws: Path, secret: Path) -> None:
    (ws / "link").symlink_to(secret)
    got = read(ws, "link")
    assert got["error"] == "SymlinkRefused", got
    assert "OUTSIDE" not in json.dumps(got)


def test_a_symlink_pointing_inside_the_workspace_is_refused_too(ws: Path) -> None:
    (ws / "real.txt").write_text("inside")
    (ws / "alias").symlink_to("real.txt")
    assert read(ws, "alias")["error"] == "SymlinkRefused"


def test_a_symlinked_directory_on_the_way_is_refused(ws: Path, secret: Path) -> None:
    (ws / "d").symlink_to(secret.parent)
    got = read(ws, f"d/{secret.name}")
    assert got["error"] == "SymlinkRefused", got
    listed = op(ws, "list", path="d", max=100)
    assert listed["error"] == "SymlinkRefused", listed


def test_a_fifo_is_refused_without_blocking(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    got = read(ws, "pipe")
    assert got["error"] == "NotARegularFile", got
    wrote = op(ws, "write", path="pipe", base64="eA==", append=False)
    assert "error" in wrote, wrote


def test_a_file_flipped_with_a_symlink_is_never_read_through_the_link(
    ws: Path, secret: Path
) -> None:
    """A thread swaps `flip` between a file and a link to a secret (rename, atomic)."""
    (ws / "file.tmp").write_text("benign")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            (ws / "file.tmp").write_text("benign")
            os.replace(ws / "file.tmp", ws / "flip")
            with_link = ws / "link.tmp"
            with_link.unlink(missing_ok=True)
            with_link.symlink_to(secret)
            os.replace(with_link, ws / "flip")

    t = threading.Thread(target=flip)
    t.start()
    try:
        results = [read(ws, "flip") for _ in range(2000)]
    finally:
        stop.set()
        t.join()
    leaks = [r for r in results if "base64" in r and b"OUTSIDE" in base64.b64decode(r["base64"])]
    assert leaks == []
    assert any("base64" in r for r in results)  # the race was real: some reads hit the file
    assert any(r.get("error") == "SymlinkRefused" for r in results)


def test_write_never_goes_through_a_link_and_creates_parents(ws: Path, secret: Path) -> None:
    (ws / "out").symlink_to(secret)
    got = op(ws, "write", path="out", base64=base64.b64encode(b"x").decode(), append=False)
    assert got["error"] == "SymlinkRefused", got
    assert secret.read_text() == "OUTSIDE-SECRET"
    (ws / "via").symlink_to(secret.parent)
    got = op(ws, "write", path="via/new.txt", base64="eA==", append=False)
    assert got["error"] == "SymlinkRefused", got
    assert not (secret.parent / "new.txt").exists()
    ok = op(ws, "write", path="a/b/c.txt", base64="eHk=", append=False)
    assert ok["size"] == 2 and (ws / "a/b/c.txt").read_bytes() == b"xy"
    more = op(ws, "write", path="a/b/c.txt", base64="eg==", append=True)
    assert more["size"] == 3 and (ws / "a/b/c.txt").read_bytes() == b"xyz"


def test_write_refuses_a_name_with_other_hard_links(ws: Path) -> None:
    (ws / "orig").write_text("keep me")
    os.link(ws / "orig", ws / "hard")
    got = op(ws, "write", path="hard", base64="eA==", append=False)
    assert got["error"] == "HardLinkRefused", got
    assert (ws / "orig").read_text() == "keep me"


def test_prune_through_a_linked_outputs_dir_deletes_nothing(ws: Path) -> None:
    user = ws / "project"
    user.mkdir()
    for i in range(30):
        (user / f"notes{i}.txt").write_text("mine")
        (user / f"{i:032x}_1_{i}.txt").write_text("mine too, named like a spill file")
    (ws / ".mcp-forge").mkdir()
    (ws / ".mcp-forge" / "outputs").symlink_to("../project")
    got = op(ws, "prune", path=".mcp-forge/outputs", keep=2)
    assert got["error"] == "SymlinkRefused", got
    assert len(list(user.iterdir())) == 60
    (ws / ".mcp-forge" / "outputs").unlink()
    (ws / ".mcp-forge").rmdir()
    (ws / ".mcp-forge").symlink_to("project")
    got = op(ws, "prune", path=".mcp-forge/outputs", keep=2)
    assert got["error"] == "SymlinkRefused", got
    assert len(list(user.iterdir())) == 60


def test_prune_deletes_only_old_spill_files(ws: Path) -> None:
    out = ws / ".mcp-forge" / "outputs"
    out.mkdir(parents=True)
    for i in range(5):
        f = out / f"{i:032x}_1_{i}.txt"
        f.write_text("spill")
        os.utime(f, (1000 + i, 1000 + i))
    (out / "keep-me.md").write_text("a user's file")
    (out / "linked.txt").symlink_to("../../somewhere")
    got = op(ws, "prune", path=".mcp-forge/outputs", keep=2)
    assert got == {"removed": 3}
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{3:032x}_1_3.txt", f"{4:032x}_1_4.txt", "keep-me.md", "linked.txt"]


def test_names_with_newlines_and_invalid_utf8_are_listed_as_text(ws: Path) -> None:
    os.close(os.open(os.fsencode(ws) + b"/bad\xff\xfe", os.O_CREAT | os.O_WRONLY, 0o644))
    (ws / "new\nline").write_text("x")
    got = op(ws, "list", path=".", max=100)
    names = {e["name"] for e in got["entries"]}
    assert names == {"bad\\xff\\xfe", "new\nline"}
    json.dumps(got, ensure_ascii=False).encode("utf-8")  # no lone surrogates


def test_a_huge_directory_is_listed_within_bounds(ws: Path) -> None:
    for i in range(300):
        (ws / f"f{i:04}").touch()
    got = op(ws, "list", path=".", max=100)
    assert len(got["entries"]) == 100 and got["truncated"] is True
    assert got["entries"][0]["name"] == "f0000"


def test_a_fifo_and_a_link_are_listed_by_their_kind(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    (ws / "ln").symlink_to("/etc/passwd")
    kinds = {e["name"]: e["type"] for e in op(ws, "list", path=".", max=10)["entries"]}
    assert kinds == {"pipe": "other", "ln": "symlink"}


def test_dotdot_is_refused_in_the_kernel_too(ws: Path) -> None:
    assert read(ws, "../outside.txt")["error"] == "PermissionError"


def test_the_program_the_gateway_sends_runs_in_a_fresh_interpreter(ws: Path) -> None:
    (ws / "a.txt").write_text("via the program")
    code, marker = introspection.program("read", path="a.txt", max=100)
    code = code.replace("'root': '/workspace'", f"'root': {str(ws)!r}")
    code = code.replace('"root": "/workspace"', f'"root": "{ws}"')
    proc = subprocess.run(
        [sys.executable, "-c", "get_ipython = None\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    reply = introspection.parse_reply(proc.stdout, marker, limit=10_000)
    assert base64.b64decode(reply["base64"]) == b"via the program", proc.stdout


# ---- variables, with a real IPython shell -------------------------------------------------


@pytest.fixture(scope="module")
def shell() -> InteractiveShell:
    return InteractiveShell.instance()


def test_a_hanging_repr_is_cut_with_a_note(shell: InteractiveShell) -> None:
    shell.run_cell(
        "class Hang:\n"
        "    def __repr__(self):\n"
        "        while True:\n"
        "            try:\n"
        "                import time; time.sleep(10)\n"
        "            except Exception:\n"
        "                pass\n"
        "hang = Hang()\n"
    )
    got = helpers.run({"op": "inspect", "var": "hang", "repr_max": 100}, lambda: shell)
    assert "took over" in got["variable"]["repr"], got
    del shell.user_ns["hang"]


def test_lying_class_raising_len_and_huge_names_are_bounded(shell: InteractiveShell) -> None:
    shell.run_cell(
        "class Liar:\n"
        "    __class__ = property(lambda self: 1/0)\n"
        "    def __len__(self): raise RuntimeError('no')\n"
        "    def __repr__(self): return 'L' * 10_000_000\n"
        "liar = Liar()\n"
        "globals()['n' * 100_000] = 1\n"
        "globals()[42] = 'not a str key'\n"
    )
    got = helpers.run({"op": "variables", "max": 500, "repr_max": 200}, lambda: shell)
    by_name = {v["name"][:10]: v for v in got["variables"]}
    liar = by_name["liar"]
    assert liar["type"].endswith("Liar") and "length" not in liar
    assert len(liar["repr"]) < 300
    assert all(len(v["name"]) < helpers.NAME_MAX + 20 for v in got["variables"])
    json.dumps(got)
    for k in ("liar", "n" * 100_000, 42):
        shell.user_ns.pop(k, None)


def test_a_repr_that_swallows_every_exception_is_left_behind_on_time(
    shell: InteractiveShell,
) -> None:
    shell.run_cell(
        "STOP = []\n"
        "class Swallow:\n"
        "    def __repr__(self):\n"
        "        while not STOP:\n"
        "            try:\n"
        "                sum(range(10_000))\n"
        "            except BaseException:\n"
        "                pass\n"
        "        return 'stopped'\n"
        "swallow = Swallow(); after = 1\n"
    )
    try:
        got = helpers.run({"op": "variables", "max": 500, "repr_max": 100}, lambda: shell)
        by_name = {v["name"]: v for v in got["variables"]}
        assert "took over" in by_name["swallow"]["repr"], by_name["swallow"]
        assert by_name["after"]["repr"] == "1"
    finally:
        shell.user_ns["STOP"].append(True)
        for k in ("swallow", "after", "STOP", "Swallow"):
            shell.user_ns.pop(k, None)
