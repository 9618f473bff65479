"""Shared fixtures. Integration tests run real kernels in real Podman pods."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.clients import podman_stall
from mcp_forge.errors import SessionNotFound
from mcp_forge.settings import Settings
from support import scratch_state_dir

# Gateways the tests start keep no pool of their own unless a test asks (--pool-size N,
# as tests/e2e/test_pools_mcp.py does): other tests then count only their own pods.
os.environ.setdefault("MCPFORGE_POOL_SIZE", "0")

MINIMAL_IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"
DEFAULT_IMAGE = "localhost/mcp-forge-kernel:0.1.0"


EXIT_DEADLINE = float(
    os.environ.get("MCPFORGE_TEST_EXIT_DEADLINE", "120")
)  # seconds the interpreter may take to exit once pytest is done
_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


# A test step this slow shows, after the run, the end of what it captured (its gateways'
# stderr, its log records): a stall that a test survives (it passed, 60 s late) is named
# by what was logged while it waited, in a run whose passing output is otherwise dropped.
SLOW_SHOWN = float(os.environ.get("MCPFORGE_TEST_SLOW_SHOWN", "45"))
_slow: list[tuple[str, float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call") and report.passed and report.duration > SLOW_SHOWN:
        said = "\n".join(part for part in (report.capstderr, report.caplog) if part)
        _slow.append((f"{report.nodeid} ({report.when})", report.duration, said[-6000:]))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for step, seconds, said in _slow:
        terminalreporter.write_sep("-", f"slow: {step}, {seconds:.0f}s; the end of its stderr")
        terminalreporter.write_line(said or "(nothing captured)")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit, with pytest's status, even if a thread a test left behind would hold exit.

    Interpreter exit joins every executor thread; one stuck in a call (an operator thread
    that did not stop, a socket that never answers) would hold CI until its time limit and
    lose the results. Past the deadline the stacks of all threads are printed, so the
    culprit is named, and the process exits with the status pytest reported.
    """

    def watchdog() -> None:
        # Never set: a normal exit ends this daemon thread long before the deadline.
        if not threading.Event().wait(EXIT_DEADLINE):
            print(
                f"\nthe interpreter did not exit {EXIT_DEADLINE:.0f}s after the tests: "
                "every thread's stack follows",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(_exit_status)

    threading.Thread(target=watchdog, name="exit watchdog", daemon=True).start()


def _image_exists(ref: str) -> bool:
    podman = shutil.which("podman")
    return podman is not None and subprocess.run([podman, "image", "exists", ref]).returncode == 0


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    with scratch_state_dir() as path:
        yield path


@pytest.fixture(scope="session")
def settings(state_dir: Path) -> Settings:
    return Settings(state_dir=state_dir, execute_timeout=60, kernel_ready_timeout=60)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    missing = [ref for ref in (MINIMAL_IMAGE, DEFAULT_IMAGE) if not _image_exists(ref)]
    if missing:
        pytest.fail(
            f"kernel images missing: {missing}; "
            "build them with: mcp-forge image build --variant all"
        )
    return {"minimal": MINIMAL_IMAGE, "default": DEFAULT_IMAGE}


@pytest.fixture(scope="session")
def runtime(settings: Settings, images: dict[str, str]) -> Any:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    return LocalRuntime(settings)


SessionFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def make_session(runtime: Any, images: dict[str, str]) -> AsyncIterator[SessionFactory]:
    """Create sessions (minimal image unless told) and delete them after the test."""
    created: list[str] = []

    async def make(variant: str = "minimal", **spec: Any) -> str:
        name = f"t-{uuid.uuid4().hex[:10]}"
        spec.setdefault("image", images[variant])
        spec.setdefault("resources", {"memory": "512Mi", "cpu": "1"})
        body = {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": name},
            "spec": spec,
        }
        await runtime.apply(body)
        created.append(name)
        return name

    yield make
    for name in created:
        with contextlib.suppress(SessionNotFound):  # the test deleted it itself
            await runtime.delete(name)


@pytest.fixture
async def names(runtime: Any) -> AsyncIterator[list[str]]:
    """Names of the sessions a test applies itself, deleted after it."""
    made: list[str] = []
    yield made
    for name in made:
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)


@pytest.fixture
async def minimal_pool(runtime: Any, images: dict[str, str]) -> AsyncIterator[str]:
    """A local KernelSessionPool keeping one minimal kernel (512Mi) ready; its name."""
    name = f"p{uuid.uuid4().hex[:8]}"
    template = {"image": images["minimal"], "resources": {"memory": "512Mi"}}
    pool = {"apiVersion": "mcpforge.dev/v1alpha1", "kind": "KernelSessionPool"}
    await runtime.pools.apply(
        {**pool, "metadata": {"name": name}, "spec": {"size": 1, "template": template}}
    )
    yield name
    await runtime.pools.delete(name)


@pytest.fixture
async def gateway(runtime: Any, settings: Settings) -> AsyncIterator[Any]:
    from mcp_forge.gateway.core import Gateway

    gw = Gateway(runtime, settings)
    yield gw
    await gw.close()


@pytest.fixture(scope="session")
def cli_env(state_dir: Path) -> dict[str, str]:
    return {**os.environ, "MCPFORGE_STATE_DIR": str(state_dir)}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (it appends them); killed at its end, with their children
    (tests/unit/test_podman_locks.py, test_podman_stall.py)."""
    made: list[subprocess.Popen[str]] = []
    yield made
    for proc in made:
        if proc.poll() is None:
            for member in podman_stall.family(proc.pid) - {proc.pid}:
                subprocess.run(["kill", "-9", str(member)], check=False)
            proc.kill()
        proc.wait()
