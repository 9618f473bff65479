"""Code mode, locally: kernel code calls real upstream MCP servers through the bridge.

The servers are real: `mcp-server-time` (PyPI), `@modelcontextprotocol/server-filesystem`
(npm) and tests/mcp_servers/edge_server.py, started by the gateway's SDK client from the
`mcpServers` config; the kernel runs in a real Podman pod with no network at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.errors import SessionNotFound
from mcp_forge.gateway.codemode.upstream import Upstream, UpstreamPool, parse_config
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.sessions import OWNER
from mcp_servers.config import missing_servers, upstream_config

pytestmark = pytest.mark.podman


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("files")
    for i in range(50):
        (d / f"note-{i:02d}.txt").write_text(f"note {i}\n" + "word " * i)
    return d


@pytest.fixture(scope="module")
async def upstreams(files_dir: Path) -> AsyncIterator[dict[str, Upstream]]:
    config = upstream_config(files_dir)
    missing = missing_servers(config)
    if missing:
        pytest.fail("; ".join(missing.values()))
    ups = {n: Upstream(c) for n, c in parse_config(config).items()}
    yield ups
    for u in ups.values():
        await u.close()


@pytest.fixture
async def coder(
    runtime: Any, settings: Any, upstreams: dict[str, Upstream]
) -> AsyncIterator[Gateway]:
    gw = Gateway(runtime, settings, upstreams=upstreams)
    yield gw
    await gw.close()


async def value(gw: Gateway, session: str, code: str) -> Any:
    r = await gw.execute(session, code + "\nprint(__import__('json').dumps(_out))")
    assert r.status == "ok", (r.error, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


async def test_kernel_code_calls_real_upstream_servers(make_session, coder: Gateway) -> None:
    name = await make_session(mcpServers=[{"name": "time"}, {"name": "files"}, {"name": "edge"}])
    out = await value(
        coder,
        name,
        "import mcp_tools\n"
        "_out = {'sum': mcp_tools.edge.add(a=40),\n"
        "        'tz': mcp_tools.time.get_current_time(timezone='UTC')['timezone'],\n"
        "        'servers': sorted(mcp_tools.servers())}",
    )
    assert out == {"sum": {"sum": 42}, "tz": "UTC", "servers": ["edge", "files", "time"]}


async def test_a_cell_reads_50_files_and_returns_only_a_summary(
    make_session, coder: Gateway, files_dir: Path
) -> None:
    name = await make_session(mcpServers=[{"name": "files", "readOnly": True}])
    out = await value(
        coder,
        name,
        "import mcp_tools, re\n"
        f"root = {str(files_dir)!r}\n"
        "listing = mcp_tools.files.list_directory(path=root)\n"
        "text = listing['content'] if isinstance(listing, dict) else listing\n"
        "names = re.findall(r'\\[FILE\\] (\\S+)', text)\n"
        "words = 0\n"
        "for n in names:\n"
        "    body = mcp_tools.files.read_text_file(path=root + '/' + n)\n"
        "    body = body['content'] if isinstance(body, dict) else body\n"
        "    words += body.count('word')\n"
        "_out = {'files': len(names), 'words': words}",
    )
    assert out == {"files": 50, "words": sum(range(50))}


async def test_denied_and_read_only_tools_raise_permission_errors(
    make_session, coder: Gateway
) -> None:
    name = await make_session(mcpServers=[{"name": "edge", "deny": ["add"], "readOnly": True}])
    out = await value(
        coder,
        name,
        "import mcp_tools\n"
        "_out = {}\n"
        "calls = (lambda: mcp_tools.edge.add(a=1), lambda: mcp_tools.edge.write_note(text='x'))\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except PermissionError as e:\n"
        "        _out[len(_out)] = str(e)\n"
        "_out['echo'] = mcp_tools.edge.echo(text='hi')",
    )
    assert "denied" in out["0"]
    assert "read-only" in out["1"]
    assert out["echo"] == {"text": "hi"}


async def test_the_kernel_never_sees_the_servers_secrets(make_session, coder: Gateway) -> None:
    name = await make_session(mcpServers=[{"name": "edge"}])
    out = await value(
        coder,
        name,
        "import mcp_tools, os\n"
        "_out = {'server_has_it': mcp_tools.edge.env_has_secret()['present'],\n"
        "        'kernel_has_it': 'EDGE_SECRET' in os.environ}",
    )
    assert out == {"server_has_it": True, "kernel_has_it": False}


async def test_a_session_without_mcp_servers_has_no_bridge(make_session, coder: Gateway) -> None:
    name = await make_session()
    out = await value(coder, name, "import sys\n_out = 'mcp_tools' in sys.modules")
    assert out is False


async def test_50_concurrent_calls_from_threads_and_from_asyncio(
    make_session, coder: Gateway
) -> None:
    name = await make_session(mcpServers=[{"name": "edge"}])
    out = await value(
        coder,
        name,
        "import mcp_tools, asyncio\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(50) as pool:\n"
        "    threaded = list(pool.map(lambda i: mcp_tools.edge.add(a=i, b=i)['sum'], range(50)))\n"
        "async def burst():\n"
        "    got = await asyncio.gather(*(mcp_tools.edge.add.aio(a=i) for i in range(50)))\n"
        "    return [g['sum'] for g in got]\n"
        "_out = {'threads': threaded, 'aio': await burst()}",
    )
    assert out == {"threads": [2 * i for i in range(50)], "aio": [i + 2 for i in range(50)]}


async def test_an_interrupt_stops_a_slow_tool_call_and_the_session_goes_on(
    make_session, coder: Gateway
) -> None:
    name = await make_session(mcpServers=[{"name": "edge"}])
    result = await coder.execute(
        name, "import mcp_tools\nmcp_tools.edge.slow(seconds=120)", timeout=3
    )
    assert result.status == "timeout", (result.status, result.message)
    assert not result.state_lost, "interrupted, not restarted: the variables are kept"
    out = await value(coder, name, "_out = mcp_tools.edge.echo(text='after')")
    assert out == {"text": "after"}


async def test_a_restart_injects_the_module_again(make_session, coder: Gateway) -> None:
    name = await make_session(mcpServers=[{"name": "edge"}])
    await coder.execute(name, "import mcp_tools\nx = 1")
    await coder.restart(name)
    out = await value(
        coder,
        name,
        "import mcp_tools\n_out = {'x': 'x' in dir(), 'sum': mcp_tools.edge.add(a=1)['sum']}",
    )
    assert out == {"x": False, "sum": 3}


async def test_code_mode_goes_on_after_a_suspend_with_memory(
    runtime: Any, make_session, coder: Gateway
) -> None:
    """Suspended with its memory (naps.py), the gateway's bridge to the kernel is closed
    first (CRIU cannot take it along) and made again at the next call."""
    name = await make_session(
        mcpServers=[{"name": "edge"}], idleTimeout="60s", idleAction="Suspend"
    )
    assert (
        await coder.execute(name, "import mcp_tools\nx = mcp_tools.edge.add(a=40)['sum']")
    ).status == "ok"
    runtime.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
    assert await runtime.cull_idle() == [name]
    assert "its memory is kept" in str((await runtime.get(name)).status["message"])
    out = await value(coder, name, "_out = {'x': x, 'sum': mcp_tools.edge.add(a=1)['sum']}")
    assert out == {"x": 42, "sum": 3}


async def test_a_code_mode_kernel_still_has_no_network(make_session, coder: Gateway) -> None:
    name = await make_session(mcpServers=[{"name": "edge"}])
    out = await value(
        coder,
        name,
        "import os, mcp_tools\n"
        "mcp_tools.edge.echo(text='bridge up')\n"
        "_out = {'interfaces': sorted(os.listdir('/sys/class/net')),\n"
        "        'routes': open('/proc/net/route').read().splitlines()[1:]}",
    )
    assert out == {"interfaces": ["lo"], "routes": []}


async def test_budgets_sizes_and_a_dead_server_in_a_real_session(
    make_session, coder: Gateway
) -> None:
    name = await make_session(mcpServers=[{"name": "edge", "callsPerExecution": 2}])
    out = await value(
        coder,
        name,
        "import mcp_tools\n"
        "_out = {}\n"
        "mcp_tools.edge.echo(text='1'); mcp_tools.edge.echo(text='2')\n"
        "try:\n"
        "    mcp_tools.edge.echo(text='3')\n"
        "except mcp_tools.ToolError as e:\n"
        "    _out['budget'] = str(e)\n",
    )
    assert "budget of 2 calls" in out["budget"]
    out = await value(
        coder,
        name,
        "_out = {}\n"
        "try:\n"
        "    mcp_tools.edge.echo(text='x' * (2 << 20))\n"
        "except ValueError as e:\n"
        "    _out['big'] = str(e)\n"
        "try:\n"
        "    mcp_tools.edge.crash()\n"
        "except mcp_tools.ToolError as e:\n"
        "    _out['dead'] = str(e)\n",
    )
    assert out["big"] and "edge.crash failed" in out["dead"], out
    # A new execution, a new budget; the server comes back on the next call.
    out = await value(coder, name, "_out = mcp_tools.edge.count()['calls']")
    assert out == 1


async def test_per_client_upstreams_keep_clients_apart_and_end_with_their_sessions(
    runtime: Any, settings: Any, images: dict[str, str], files_dir: Path
) -> None:
    """With `client` isolation two sessions of one client share the server's process (a
    note one writes, the other reads), another client's session has its own; when the
    client's sessions are deleted, its process ends (linger 0 here)."""
    entry = upstream_config(files_dir)["mcpServers"]["edge"]
    pool = UpstreamPool(parse_config({"mcpServers": {"edge": entry}}), linger=0)
    gw = Gateway(runtime, settings, upstreams=pool)
    names: list[str] = []

    async def session_of(owner: str) -> str:
        name = f"t-{uuid.uuid4().hex[:10]}"
        await runtime.apply(
            {
                "apiVersion": "mcpforge.dev/v1alpha1",
                "kind": "KernelSession",
                "metadata": {"name": name, "annotations": {OWNER: owner}},
                "spec": {
                    "image": images["minimal"],
                    "resources": {"memory": "512Mi", "cpu": "1"},
                    "mcpServers": [{"name": "edge"}],
                },
            }
        )
        names.append(name)
        return name

    write = "_out = [mcp_tools.edge.write_note(text={!r})['previous'], mcp_tools.edge.pid()['pid']]"
    try:
        alice1, alice2, bob = (
            await session_of("http:alice"),
            await session_of("http:alice"),
            await session_of("http:bob"),
        )
        first = await value(gw, alice1, "import mcp_tools\n" + write.format("alice's"))
        second = await value(gw, alice2, "import mcp_tools\n" + write.format("alice again"))
        other = await value(gw, bob, "import mcp_tools\n" + write.format("bob's"))
        assert first[0] is None and second == ["alice's", first[1]], (first, second)
        assert other[0] is None and other[1] != first[1], other
        assert pool.isolated == 2
        fd = os.pidfd_open(first[1])
        try:
            for name in (alice1, alice2):
                await runtime.delete(name)
                with pytest.raises(SessionNotFound):  # the gateway learns it is gone
                    await gw.execute(name, "1")
            ended = asyncio.Event()
            asyncio.get_running_loop().add_reader(fd, ended.set)
            await asyncio.wait_for(ended.wait(), 30)
        finally:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        assert pool.isolated == 1  # bob's
    finally:
        for name in names:
            with contextlib.suppress(SessionNotFound):
                await runtime.delete(name)
        await gw.close()
        await pool.close()
