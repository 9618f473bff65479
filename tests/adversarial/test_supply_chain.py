"""Supply chain and host execution: what a client names in install_packages never runs on
the host, and the host's pip configuration is never the client's.

A real gateway (stdio, the official SDK client) with a package index of the test's own
on loopback (package_index.py) as its only index, real kernels in real Podman pods, the
real sandbox container for source builds. Each case asserts the safe outcome and its
evidence: what the index was asked for, what the build saw, what the host still has.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from .confinement import confinement, processes
from .conftest import Deadline, call, gateway, text, value
from .package_index import PackageIndex, sdist_bytes, wheel_bytes

pytestmark = pytest.mark.podman

DENIED = "forgetest-backend"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Host paths the attacks aim at: a canary no build may see, where a build would
    leave a marker, the gateway's working directory with a planted archive, and the
    host's own pip configuration (find-links, an index) no install may use."""
    base = tmp_path_factory.mktemp("host")
    canary = base / "canary"
    canary.write_text("host secret")
    cwd = base / "cwd"
    cwd.mkdir()
    marker = base / "built-on-the-host"
    for name in ("evil-1.0.tar.gz", "evil-1.0.zip"):
        (cwd / name).write_bytes(sdist_bytes("evil", "1.0", marker=str(marker)))
    (cwd / "evil-1.0-py3-none-any.whl").write_bytes(
        wheel_bytes("evil", "1.0", {"evil/__init__.py": "PLANTED = True\n"})
    )
    links = base / "find-links"
    links.mkdir()
    (links / "forgetest_lib-99.0-py3-none-any.whl").write_bytes(
        wheel_bytes("forgetest-lib", "99.0", {"forgetest_lib/__init__.py": "V = 'planted'\n"})
    )
    (base / "tmp").mkdir()
    conf = base / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {links}\nindex-url = http://127.0.0.1:9/simple\n")
    return {
        "canary": canary,
        "cwd": cwd,
        "marker": marker,
        "links": links,
        "conf": conf,
        "base": base,
        "tmp": base / "tmp",
    }


@pytest.fixture(scope="module")
def index(host: dict[str, Path]) -> Any:
    idx = PackageIndex(host["base"])
    idx.add_wheel("forgetest-lib", "1.0", "V = 'index'\n")
    idx.add_wheel("forgetest-helper", "1.0", "OK = 1\n")
    idx.add_wheel(DENIED, "1.0", "raise SystemExit\n")
    idx.add_wheel("forgetest-slow", "1.0", "")
    marker, canary = str(host["marker"]), str(host["canary"])
    idx.add_sdist("forgetest-app", "1.0", requires=(DENIED,), marker=marker)
    idx.add_sdist(
        "forgetest-built", "1.0", requires=("forgetest-helper",),
        imports=("forgetest_helper",), canary=canary, marker=marker,
    )  # fmt: skip
    with idx.serving():
        yield idx


@dataclass
class Gateway:
    c: Client
    sid: str
    state: Path


@pytest.fixture(scope="module")
async def client(
    host: dict[str, Path], index: PackageIndex, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Gateway]:
    """One gateway for the module, started as a desktop MCP client would start it: in a
    directory the model can write to, with the host's pip configured elsewhere. Its
    client lives in a task of its own (the SDK's context must end in the task that
    began it; the module's tests run in others)."""
    state = tmp_path_factory.mktemp("state")
    env = {
        "PIP_FIND_LINKS": str(host["links"]),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_CONFIG_FILE": str(host["conf"]),
        "MCPFORGE_PACKAGES_INDEX_URL": index.url,
        "MCPFORGE_PACKAGES_CLIENT_INSTALLS_MAX": "2",
        # A proxy with credentials (unused: the index is on loopback) no build may see.
        "http_proxy": "http://user:proxy-secret@127.0.0.1:9",
        "no_proxy": "127.0.0.1,localhost",
        "TMPDIR": str(host["tmp"]),  # the gateway's own: others' tests share /tmp
    }
    args = ("--packages-allow-sdist", "--packages-deny", DENIED)
    ready: asyncio.Future[Gateway] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def hold() -> None:
        old = Path.cwd()
        os.chdir(host["cwd"])  # the gateway's working directory (a stdio server inherits it)
        try:
            async with gateway(state, args=args, env=env) as c:
                os.chdir(old)
                made = await call(c, "create_session", {"variant": "minimal", "memory": "512Mi"})
                assert not made.is_error, text(made)
                ready.set_result(Gateway(c, made.structured_content["session_id"], state))
                await done.wait()
        finally:
            os.chdir(old)

    holder = asyncio.create_task(hold())
    await asyncio.wait([ready, holder], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
    if not ready.done():
        holder.result()  # raises what stopped it
    try:
        yield ready.result()
    finally:
        done.set()
        await holder


async def install(gw: Gateway, *names: str) -> Any:
    return await call(gw.c, "install_packages", {"packages": list(names), "session_id": gw.sid})


async def kernel(gw: Gateway, expr: str) -> Any:
    return await value(gw.c, expr, session_id=gw.sid)


@pytest.mark.parametrize(
    "name",
    [
        "evil-1.0.tar.gz", "evil-1.0.zip", "evil-1.0-py3-none-any.whl", "EVIL-1.0.TAR.GZ",
        "./evil-1.0.tar.gz", "../cwd/evil-1.0.tar.gz", "/tmp/evil-1.0.tar.gz",
        "evil @ file:///tmp/evil-1.0.tar.gz", "evil @ https://127.0.0.1/evil.whl",
        "--index-url=http://127.0.0.1:9/", "-r requirements.txt", "-e .", ".",
        "evil --no-deps", "evil\n--find-links=/tmp",
    ],
)  # fmt: skip
async def test_a_file_path_url_or_option_is_refused_by_name_and_nothing_is_built(
    client: Gateway, host: dict[str, Path], index: PackageIndex, name: str
) -> None:
    """Names pip would take for a file in its working directory (where this gateway
    runs, holding planted archives), a URL or an option are refused, naming them, before
    pip runs: the planted sdist's build backend never runs on the host, its wheel never
    reaches the kernel."""
    r = await install(client, name)
    assert r.is_error, text(r)
    assert "packages[0]" in text(r), text(r)
    assert not host["marker"].exists(), "a planted archive was built on the host"
    assert not index.asked_for("evil")
    assert await kernel(client, "__import__('importlib.util').util.find_spec('evil') is None")


async def test_the_hosts_pip_configuration_and_environment_are_not_used(client: Gateway) -> None:
    """PIP_FIND_LINKS, PIP_INDEX_URL and a pip.conf (PIP_CONFIG_FILE) in the gateway's
    environment offer forgetest-lib 99.0; only the configured index's 1.0 is installed."""
    r = await install(client, "forgetest-lib")
    assert not r.is_error, text(r)
    assert [(p["name"], p["version"]) for p in r.structured_content["installed"]] == [
        ("forgetest-lib", "1.0")
    ]
    assert await kernel(client, "__import__('forgetest_lib').V") == "index"


async def test_a_denied_build_backend_is_refused_before_it_is_fetched(
    client: Gateway, host: dict[str, Path], index: PackageIndex
) -> None:
    """forgetest-app is an sdist whose build backend is the denied forgetest-backend: the
    install is refused naming it, and its files are never fetched from the index."""
    r = await install(client, "forgetest-app")
    assert r.is_error, text(r)
    assert "PackageDenied" in text(r) and DENIED in text(r), text(r)
    assert "to build it" in text(r), text(r)
    assert not any(f"/files/{DENIED}/" in p for p in index.asked), index.asked
    assert not host["marker"].exists()


async def test_a_source_build_runs_in_the_sandbox_and_its_wheel_reaches_the_kernel(
    client: Gateway, host: dict[str, Path]
) -> None:
    """forgetest-built has only an sdist; its backend imports its build requirement (a
    wheel the host gave it) and records what it saw: an unprivileged uid in a user
    namespace, no network but loopback, none of the gateway's environment, no host
    file. The wheel it built imports in the kernel."""
    r = await install(client, "forgetest-built")
    assert not r.is_error, text(r)
    assert [p["name"] for p in r.structured_content["installed"]] == ["forgetest-built"]
    seen = await kernel(client, "__import__('forgetest_built').EVIDENCE")
    assert seen["uid"] == 1000, seen
    assert seen["uid_map"][:2] == ["0", str(seen["uid_map"][1])] and seen["uid_map"][1] != "0", seen
    assert seen["interfaces"] in (["lo"], []), seen
    assert not seen["canary_seen"] and not seen["marked"], seen
    gateways = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "MCPFORGE_", "SSL_", "REQUESTS_", "HTTP")
    assert not [k for k in seen["env"] if k.upper().startswith(gateways)], seen
    assert not [k for k in seen["env"] if "proxy" in k.lower()], seen
    assert seen["imports"] == ["forgetest_helper"]
    assert not host["marker"].exists()


async def test_installs_past_a_clients_bound_are_refused_at_once(
    client: Gateway, index: PackageIndex
) -> None:
    """Twelve installs at once from one client: two run (the bound), each holding a
    download the index keeps waiting; the other ten are refused at once (PackageBusy),
    no more than two pip processes run, and the client's other calls are answered."""
    index.hold("forgetest-slow")
    try:
        calls = [asyncio.ensure_future(install(client, "forgetest-slow")) for _ in range(12)]
        deadline = Deadline(60)
        refused: list[asyncio.Future[Any]] = []
        while len(refused) < 10 and deadline:
            await asyncio.wait(calls, timeout=deadline.left, return_when=asyncio.FIRST_COMPLETED)
            refused = [c for c in calls if c.done()]
        assert len(refused) == 10, [text(c.result()) for c in refused]
        for c in refused:
            assert c.result().is_error and "PackageBusy" in text(c.result()), text(c.result())
        for _ in range(2):  # both running installs have reached the index
            assert await asyncio.to_thread(index.waiting.acquire, timeout=60)
        assert len(_pip_processes(client.state)) <= 2
        listed = await call(client.c, "list_sessions", {})
        assert not listed.is_error, text(listed)
    finally:
        index.release()
    held = await asyncio.gather(*[c for c in calls if c not in refused])
    for r in held:
        assert not r.is_error, text(r)


async def test_nothing_is_left_on_the_host_after_the_installs(
    client: Gateway, host: dict[str, Path]
) -> None:
    """Every install's scratch directory is gone, the gateway's TMPDIR is empty, and pip's
    cache (below the gateway's state directory) is within its bound (pip caches nothing
    fetched over plain HTTP, as this index is: tests/e2e/test_packages_mcp.py shows the
    cache pruned after an install)."""
    scratch, tmp, size = await asyncio.to_thread(_left, client.state, host["tmp"])
    assert (scratch, tmp) == ([], [])
    assert size <= 1_000_000_000


def _left(state: Path, tmp: Path) -> tuple[list[Path], list[Path], int]:
    cache = state / "cache" / "pip"
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    scratch = list((state / "packages").glob("install-*"))
    return scratch, list(tmp.iterdir()), size


def _pip_processes(state: Path) -> list[int]:
    """pids of pip processes (not their launchers) whose cache is this gateway's."""
    return processes(argv_has=b"pip", environ_has=f"PIP_CACHE_DIR={state}/cache/pip".encode())


async def test_the_hosts_pip_runs_unprivileged_seeing_none_of_the_gateways_files(
    client: Gateway, index: PackageIndex, host: dict[str, Path]
) -> None:
    """Caught while its download is held: the host's pip (it parses what the index
    sends for names a client chose) runs as an unprivileged user with no capabilities
    and no way to gain any, at a low priority, in mount and pid namespaces of its own
    whose root shows none of the gateway's files: its state (tokens, the store), the
    host's secrets, the gateway's working directory. What it writes is its own."""
    # The kernels' directories (their connection keys), a host secret, the gateway's cwd.
    secrets = [client.state / "k", host["canary"], host["cwd"], Path("/etc/shadow")]
    assert all(p.exists() for p in secrets)
    index.hold("forgetest-helper")
    try:
        running = asyncio.ensure_future(install(client, "forgetest-helper"))
        assert await asyncio.to_thread(index.waiting.acquire, timeout=60)
        [pid] = _pip_processes(client.state)
        seen = confinement(pid, secrets)
    finally:
        index.release()
    done = await running
    assert not done.is_error, text(done)
    assert seen.unprivileged(), seen
    assert seen.own_mounts and seen.own_pids, seen
    assert seen.visible == [], seen
    assert seen.nice > 0, seen
    assert seen.limits["Max address space"] != "unlimited", seen
    assert seen.limits["Max cpu time"] != "unlimited", seen
