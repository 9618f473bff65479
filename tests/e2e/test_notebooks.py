"""Notebooks out (issue 13): cells run through a real MCP client (and the CLI) in a real
kernel pod come out as a valid nbformat 4 notebook, across a gateway restart and a
kernel restart, through export_notebook and `mcp-forge export`."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
from pathlib import Path

import nbformat
import pytest
from test_stdio import gateway, text

pytestmark = pytest.mark.podman

MCP_FORGE = str(Path(sys.executable).parent / "mcp-forge")
PNG = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
CELLS = [
    "x = 21\nprint('hello')",
    "x * 2",
    f"from IPython.display import Image, display\nimport base64\n"
    f"display(Image(data=base64.b64decode({PNG!r})))",
    "1/0",
]


async def test_cells_survive_a_gateway_restart_and_export_as_a_valid_notebook(
    state_dir: Path, images: dict[str, str], tmp_path: Path
) -> None:
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    runtime = LocalRuntime(Settings(state_dir=state_dir))
    await runtime.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "notebook"},
            "spec": {"image": images["minimal"], "resources": {"memory": "256Mi"}},
        }
    )
    try:
        async with gateway(state_dir) as c:
            for code in CELLS:
                await c.call_tool("execute_code", {"session_id": "notebook", "code": code})
            silent = await c.call_tool("list_variables", {"session_id": "notebook"})
            assert not silent.is_error  # the gateway's own helpers are no cells
        async with gateway(state_dir) as c:  # a new gateway process: the cells are kept
            restarted = await c.call_tool("restart_kernel", {"session_id": "notebook"})
            assert not restarted.is_error, text(restarted)
            await c.call_tool("execute_code", {"session_id": "notebook", "code": "'after'"})
            r = await c.call_tool(
                "export_notebook", {"session_id": "notebook", "path": "out/nb.ipynb"}
            )
            assert not r.is_error, text(r)
            assert r.structured_content["cells"] == len(CELLS) + 1
            assert r.structured_content["skipped"] == 0
            saved = await c.call_tool(
                "read_file", {"session_id": "notebook", "path": "out/nb.ipynb"}
            )
            assert saved.structured_content["size"] == r.structured_content["size"]
            nb = nbformat.reads(text(saved), as_version=4)

        # The CLI writes the same notebook to a host file.
        out = tmp_path / "cli.ipynb"
        proc = await asyncio.create_subprocess_exec(
            MCP_FORGE, "export", "notebook", "-o", str(out),
            env={**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, stderr.decode()
        assert b"5 cell(s) written" in stdout
        from_cli = nbformat.read(out, as_version=4)
    finally:
        await runtime.delete("notebook")

    for book in (nb, from_cli):
        nbformat.validate(book)
        kinds = [c.cell_type for c in book.cells]
        assert kinds == ["code"] * len(CELLS) + ["markdown", "code"], kinds
        cells = [c for c in book.cells if c.cell_type == "code"]
        assert [c.source for c in cells] == [*CELLS, "'after'"]
        assert [c.execution_count for c in cells] == [1, 2, 3, 4, 1]
        assert cells[0].outputs[0].text == "hello\n"
        assert cells[1].outputs[0].data["text/plain"] == "42"
        png = cells[2].outputs[0].data["image/png"]
        assert base64.b64decode(png).startswith(b"\x89PNG")
        assert cells[3].outputs[0].ename == "ZeroDivisionError"
        assert "restarted" in book.cells[len(CELLS)].source
        timing = cells[0].metadata["execution"]
        assert timing["iopub.execute_input"] <= timing["shell.execute_reply"]


async def test_a_session_with_no_cells_exports_an_empty_notebook(state_dir: Path) -> None:
    async with gateway(state_dir) as c:
        made = await c.call_tool("create_session", {"variant": "minimal"})
        sid = made.structured_content["session_id"]
        r = await c.call_tool("export_notebook", {"session_id": sid})
        assert not r.is_error, text(r)
        assert (r.structured_content["cells"], r.structured_content["path"]) == (
            0,
            "notebook.ipynb",
        )
        refused = await c.call_tool("export_notebook", {"session_id": sid, "path": "../x"})
        assert refused.is_error and "workspace" in text(refused)
