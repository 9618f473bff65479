"""install_packages through a real MCP client: the official SDK client over stdio, the
real gateway (a subprocess) with a package policy on its command line, real kernels in
real Podman pods, and the real package index through this host's proxy. The kernel has
no route before, during or after: only the gateway fetches."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

from mcp_forge.api.kernelsession import requirement
from mcp_forge.errors import PackageTooLarge
from mcp_forge.settings import Settings
from mcp_forge.wheels import fetch, pip

pytestmark = pytest.mark.podman

GATEWAY = str(Path(sys.executable).parent / "mcp-forge")
# Denied: six (a dependency of python-dateutil 2.9); no file over 1 MB (pygments' wheel is
# about 1.2 MB; tabulate's 40 KB and msgpack's 400 KB pass).
POLICY = ("--packages-deny", "Six", "--packages-file-max", "1000000")
NO_ROUTE = (
    "import os, json\n"
    "print(json.dumps({'interfaces': sorted(os.listdir('/sys/class/net')),\n"
    "  'routes': open('/proc/net/route').read().splitlines()[1:]}))"
)


@asynccontextmanager
async def gateway(state_dir: Path) -> AsyncIterator[Client]:
    env = {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}
    params = StdioServerParameters(command=GATEWAY, args=["gateway", *POLICY], env=env)
    async with Client(params) as c:
        yield c


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def run(c: Client, sid: str, code: str) -> str:
    result = await c.call_tool("execute_code", {"session_id": sid, "code": code})
    assert not result.is_error, text(result)
    return str(result.structured_content["stdout"])


async def session(c: Client) -> str:
    made = await c.call_tool("create_session", {"variant": "minimal", "memory": "512Mi"})
    assert not made.is_error, text(made)
    return str(made.structured_content["session_id"])


async def test_a_pure_and_a_binary_package_install_offline_import_at_once_and_after_a_restart(
    state_dir: Path, images: dict[str, str]
) -> None:
    async with gateway(state_dir) as c:
        sid = await session(c)
        assert json.loads(await run(c, sid, NO_ROUTE)) == {"interfaces": ["lo"], "routes": []}
        missing = await c.call_tool("execute_code", {"session_id": sid, "code": "import tabulate"})
        assert missing.structured_content["status"] == "error"  # not in the kernel image

        got = await c.call_tool(
            "install_packages", {"session_id": sid, "packages": ["tabulate", "msgpack==1.0.8"]}
        )
        assert not got.is_error, text(got)
        out = got.structured_content
        versions = {p["name"]: p["version"] for p in out["installed"]}
        assert versions["msgpack"] == "1.0.8" and "tabulate" in versions, out
        assert out["total_bytes"] == sum(p["size"] for p in out["installed"]) > 100_000
        assert out["path"] == "/workspace/.packages"

        use = (
            "import msgpack, tabulate, msgpack._cmsgpack\n"
            "packed = msgpack.packb({'a': [1, 2]})\n"
            "print(msgpack.unpackb(packed), msgpack.version, tabulate.__file__)\n"
            "print(tabulate.tabulate([[1, 'x']], headers=['n', 's'], tablefmt='plain'))"
        )
        printed = await run(c, sid, use)  # the same kernel, straight after
        assert "{'a': [1, 2]} (1, 0, 8) /workspace/.packages/tabulate" in printed, printed
        assert "n  s" in printed, printed

        restarted = await c.call_tool("restart_kernel", {"session_id": sid})
        assert not restarted.is_error, text(restarted)
        again = await run(c, sid, "import msgpack, tabulate; print(msgpack.version)")
        assert again.strip() == "(1, 0, 8)"  # a new kernel of the session finds them
        assert json.loads(await run(c, sid, NO_ROUTE)) == {"interfaces": ["lo"], "routes": []}


async def test_denied_missing_oversized_and_malformed_packages_get_named_errors(
    state_dir: Path, images: dict[str, str]
) -> None:
    async with gateway(state_dir) as c:
        sid = await session(c)
        await run(c, sid, "kept = 41")

        async def refused(packages: list[str]) -> str:
            result = await c.call_tool(
                "install_packages", {"session_id": sid, "packages": packages}
            )
            assert result.is_error, (packages, text(result))
            return text(result)

        # Asked for under another spelling of a denied name: refused before any download.
        denied = await refused(["SIX"])
        assert "PackageDenied: 'SIX' is refused" in denied and "deny list" in denied, denied
        # A dependency is under the policy too.
        dep = await refused(["python-dateutil==2.9.0.post0"])  # needs six
        assert "PackageDenied: 'six' is refused" in dep, dep
        gone = await refused(["mcp-forge-no-such-package-zz"])
        assert "PackageNotFound: no distribution of 'mcp-forge-no-such-package-zz'" in gone, gone
        sdist = await refused(["docopt==0.6.2"])  # published as a source distribution only
        assert "PackageNotFound: no distribution of 'docopt==0.6.2'" in sdist, sdist
        assert "source distributions are not allowed" in sdist, sdist
        big = await refused(["pygments"])
        assert "PackageTooLarge: pygments-" in big and "limit for one file is 1000000" in big, big
        for bad, says in [
            ("-r /etc/passwd", "packages[0] '-r /etc/passwd' is not a requirement"),
            ("x @ https://pypi.invalid/x.whl", "names a URL"),
            ("./local", "packages[0] './local' is not a requirement"),
        ]:
            assert says in await refused([bad]), bad

        # The session is unharmed: same kernel, same variables, nothing installed.
        assert await run(c, sid, "print(kept + 1)") == "42\n"
        listing = await c.call_tool("list_files", {"session_id": sid, "path": ".packages"})
        assert listing.is_error or listing.structured_content["entries"] == [], text(listing)


@pytest.mark.parametrize("limit", ["file_max", "total_max"])
async def test_a_download_past_the_limits_is_stopped_while_it_grows(
    tmp_path: Path, limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's wheel is about 16 MB: with a 2 MB limit pip is stopped as the file grows
    past it (pip's cache is the gateway's own, empty in a new state directory, so the
    file does grow), and nothing is left. Looked at every 5 ms: through a proxy that has
    the wheel cached, 16 MB once came down within one look of 100 ms (the check after
    pip then refused it, as test_a_download_found_too_large_once_complete_... shows)."""
    monkeypatch.setattr(pip, "WATCH_INTERVAL", 0.005)
    base = fetch.PackagePolicy.of(Settings(state_dir=tmp_path))
    policy = (
        replace(base, file_max=2_000_000)
        if limit == "file_max"
        else replace(base, total_max=2_000_000)
    )
    dest = tmp_path / "wheels"
    dest.mkdir()
    with pytest.raises(PackageTooLarge) as raised:
        await fetch.download([requirement("numpy==2.2.6")], policy, dest)
    assert "stopped while downloading" in str(raised.value), raised.value
    assert "2000000" in str(raised.value), raised.value
    assert list(dest.iterdir()) == []


async def test_a_download_found_too_large_once_complete_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog never looks (its interval is an hour), so pip finishes and leaves
    pygments' wheel (about 1.2 MB) in the directory; the check after finds it over the
    limit, and the directory is emptied: a caller's directory never keeps a refused file."""
    monkeypatch.setattr(pip, "WATCH_INTERVAL", 3600.0)
    policy = replace(fetch.PackagePolicy.of(Settings(state_dir=tmp_path)), file_max=1_000_000)
    dest = tmp_path / "wheels"
    dest.mkdir()
    with pytest.raises(PackageTooLarge) as raised:
        await fetch.download([requirement("pygments==2.19.2")], policy, dest)
    assert "the limit for one file is 1000000" in str(raised.value), raised.value
    assert "stopped while downloading" not in str(raised.value), raised.value
    assert list(dest.iterdir()) == []


async def test_pips_cache_is_pruned_to_its_bound_after_an_install(tmp_path: Path) -> None:
    """pip's cache is below the gateway's state directory (this host's proxy sends wheels
    without cache headers, so pip keeps none of them: the cache is filled here by hand,
    oldest first); an install leaves it within its bound, the newest files kept."""
    cache = tmp_path / "cache" / "pip" / "http-v2"
    cache.mkdir(parents=True)
    for i in range(4):
        (cache / f"{i}").write_bytes(b"x" * 1000)
        os.utime(cache / f"{i}", (1000 + i, 1000 + i))
    policy = replace(fetch.PackagePolicy.of(Settings(state_dir=tmp_path)), cache_max=2500)
    dest = tmp_path / "wheels"
    dest.mkdir()
    wheels = await fetch.download([requirement("tabulate==0.9.0")], policy, dest)
    assert [w.name for w in wheels] == ["tabulate"]
    kept = sorted(f.name for f in (tmp_path / "cache" / "pip").rglob("*") if f.is_file())
    assert kept[-2:] == ["2", "3"] and "0" not in kept and "1" not in kept, kept
    assert list((tmp_path / "packages").iterdir()) == []
