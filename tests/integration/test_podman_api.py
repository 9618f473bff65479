"""Podman through its API (clients/podman_api.py), and deaths heard from its event stream.

Real Podman, real kernel pods; every wait is on an event under a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.clients import podman, podman_api, podman_service
from mcp_forge.clients.podman_api import PodmanApi
from mcp_forge.clients.podman_stream import Event
from mcp_forge.errors import PodmanError
from mcp_forge.runtimes.local.containers import LABEL_SELECTOR
from mcp_forge.runtimes.local.supervisor import supervise

pytestmark = pytest.mark.podman

# The periodic pass of these tests' supervisor: far longer than any deadline below, so
# only the event stream can be what noticed a death in time.
POLL_INTERVAL = 600.0
NOTICE_DEADLINE = 30.0  # death → restarted kernel Ready (a cold start is ~1 s here)


@pytest.fixture
async def api(settings) -> PodmanApi:
    return await podman_api.connect(settings)


def kill_kernel(info: dict[str, Any]) -> None:
    """SIGKILL the kernel's process from the host, as the OOM killer or a crash would."""
    os.kill(int(info["State"]["Pid"]), signal.SIGKILL)


async def test_the_api_sees_what_the_cli_sees(runtime, make_session, api, images) -> None:
    session = await runtime.get(await make_session())
    name = runtime.container_name(session)
    by_cli = json.loads((await podman.run("container", "inspect", name)).stdout)[0]
    by_api = await api.inspect_container(name)
    assert by_api is not None
    assert by_api["Id"] == by_cli["Id"]
    assert by_api["State"]["Running"] is True
    assert by_api["State"]["CgroupPath"] == by_cli["State"]["CgroupPath"]
    assert name in {n for row in await api.containers(LABEL_SELECTOR) for n in row["Names"]}
    assert name in await runtime.running_containers()
    assert await api.image_exists(images["minimal"])
    assert not await api.image_exists(f"localhost/no-such-image:{uuid.uuid4().hex[:8]}")
    assert await api.inspect_container(f"no-such-{uuid.uuid4().hex[:8]}") is None
    assert await api.remove_pod(f"no-such-{uuid.uuid4().hex[:8]}") is False
    logs = await api.logs(name, tail=50)
    assert logs is not None
    by_cli_logs = (await podman.run("logs", "--tail", "50", name)).stdout.decode()
    by_cli_logs += (await podman.run("logs", "--tail", "50", name)).stderr
    assert set(logs.split()) <= set(by_cli_logs.split())


async def _first(
    api: PodmanApi, match: Any, *, subscribed: asyncio.Event, deadline: float
) -> Event:
    async with asyncio.timeout(deadline):
        async for event in api.events(label=LABEL_SELECTOR, on_connect=subscribed.set):
            if match(event):
                return event
    raise AssertionError("the event stream ended")


async def test_a_killed_kernel_is_reported_died_with_its_exit_code_and_labels(
    runtime, make_session, api
) -> None:
    session = await runtime.get(await make_session())
    name = runtime.container_name(session)
    info = await api.inspect_container(name)
    assert info is not None
    subscribed = asyncio.Event()
    heard = asyncio.ensure_future(
        _first(api, lambda e: e.name == name, subscribed=subscribed, deadline=NOTICE_DEADLINE)
    )
    async with asyncio.timeout(10):
        await subscribed.wait()
    kill_kernel(info)
    event = await heard
    assert event.status == "died"
    assert event.exit_code == 137
    assert event.labels["mcpforge.dev/session"] == session.name
    assert event.labels["mcpforge.dev/namespace"] == session.namespace


async def test_a_pod_removed_through_the_api_is_gone_and_reported(
    runtime, make_session, api
) -> None:
    session = await runtime.get(await make_session())
    name = runtime.container_name(session)
    subscribed = asyncio.Event()
    heard = asyncio.ensure_future(
        _first(
            api,
            lambda e: e.name == name and e.status == "remove",
            subscribed=subscribed,
            deadline=NOTICE_DEADLINE,
        )
    )
    async with asyncio.timeout(10):
        await subscribed.wait()
    assert await api.remove_pod(runtime.pod_name(session)) is True
    await heard
    assert await api.inspect_container(name) is None
    done = await podman.run("pod", "exists", runtime.pod_name(session), check=False)
    assert done.returncode == 1


async def _supervised_until(runtime, session_name: str, act) -> KernelSession:
    """Run the gateway's supervisor, do `act` once it hears Podman's events, and return
    the session as the first event-driven refresh of it left it."""
    stop = asyncio.Event()
    subscribed = asyncio.Event()
    refreshed: asyncio.Queue[KernelSession] = asyncio.Queue()

    def on_refresh(session: KernelSession) -> None:
        if session.name == session_name:
            refreshed.put_nowait(session)

    task = asyncio.ensure_future(
        supervise(
            runtime,
            stop,
            interval=POLL_INTERVAL,
            say=lambda _: None,
            subscribed=subscribed.set,
            refreshed=on_refresh,
        )
    )
    try:
        async with asyncio.timeout(10):
            await subscribed.wait()
        await act()
        async with asyncio.timeout(NOTICE_DEADLINE):
            while True:
                session = await refreshed.get()
                if session.status.get("phase") != st.READY or session.status.get("restarts"):
                    return session
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


async def test_the_gateway_restarts_a_killed_kernel_without_waiting_for_its_next_pass(
    runtime, make_session, api
) -> None:
    name = await make_session()
    session = await runtime.get(name)
    info = await api.inspect_container(runtime.container_name(session))
    assert info is not None

    async def kill() -> None:
        kill_kernel(info)

    after = await _supervised_until(runtime, name, kill)
    assert after.status["phase"] == st.READY
    assert after.status["restarts"] == 1
    assert after.status["lastTermination"]["reason"] == "Error"
    again = await api.inspect_container(runtime.container_name(session))
    assert again is not None and again["Id"] != info["Id"] and again["State"]["Running"]


async def test_a_pod_removed_behind_the_gateway_s_back_is_started_again_at_once(
    runtime, make_session, api
) -> None:
    name = await make_session()
    session = await runtime.get(name)

    async def remove() -> None:
        # As a person would, with Podman 4.3's EBUSY on a dying pod's /dev/shm retried.
        assert await podman.remove_pod(runtime.pod_name(session))

    after = await _supervised_until(runtime, name, remove)
    assert after.status["phase"] == st.READY
    assert after.status["restarts"] == 1
    # Heard while the pod is going: its kernel exited (Error), or it is gone already.
    assert after.status["lastTermination"]["reason"] in ("PodMissing", "Error")
    assert runtime.container_name(session) in await runtime.running_containers()


async def test_a_service_of_our_own_starts_answers_and_stops(tmp_path: Path) -> None:
    binary = podman.podman_binary()
    assert binary is not None
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    service = await podman_service.start_service(path, binary=binary, timeout=120)
    try:
        api = PodmanApi(path, timeout=30, owned=service)
        assert await api.inspect_container(f"no-such-{uuid.uuid4().hex[:8]}") is None
    finally:
        api.close()
    assert service.proc.poll() is not None
    assert not path.exists()


async def test_a_service_of_our_own_lives_through_what_it_says_on_stderr(
    tmp_path: Path, caplog
) -> None:
    """Podman (Go) dies of SIGPIPE if its stderr is a closed pipe when it writes there:
    at debug level it writes for every request."""
    binary = podman.podman_binary()
    assert binary is not None
    chatty = tmp_path / "podman"
    chatty.write_text(f'#!/bin/sh\nexec {binary} --log-level=debug "$@"\n')
    chatty.chmod(0o755)
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    caplog.set_level("DEBUG", logger="mcp_forge.clients.podman_service")
    service = await podman_service.start_service(path, binary=str(chatty), timeout=120)
    api = PodmanApi(path, timeout=30, owned=service)
    try:
        for _ in range(20):
            assert await api.inspect_container(f"no-such-{uuid.uuid4().hex[:8]}") is None
        assert service.proc.poll() is None
        assert any("podman service:" in r.getMessage() for r in caplog.records)
        assert service.last_lines()
    finally:
        api.close()


async def test_a_service_of_our_own_that_dies_is_started_again_by_a_call_then_by_events() -> None:
    binary = podman.podman_binary()
    assert binary is not None
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    first = await podman_service.start_service(path, binary=binary, timeout=120)
    api = PodmanApi(path, timeout=30, owned=first, binary=binary)
    heard: asyncio.Future[Event] | None = None
    try:
        # A call, with nothing else running: it finds the service dead and starts another.
        first.proc.kill()
        await asyncio.to_thread(first.proc.wait, 30)
        assert await api.inspect_container(f"no-such-{uuid.uuid4().hex[:8]}") is None
        second = api.service
        assert second is not None and second is not first and second.proc.poll() is None

        # The event stream, alone: it reconnects to a service it starts, and says resync.
        connects = 0
        subscribed = asyncio.Event()

        def on_connect() -> None:
            nonlocal connects
            connects += 1
            subscribed.set()

        async def resync() -> Event:
            async for event in api.events(on_connect=on_connect):
                if event.resync:
                    return event
            raise AssertionError("the event stream ended")

        heard = asyncio.ensure_future(resync())
        async with asyncio.timeout(30):
            await subscribed.wait()
        second.proc.kill()
        async with asyncio.timeout(30):
            await heard
        assert connects == 2
        third = api.service
        assert third is not None and third is not second and third.proc.poll() is None
    finally:
        if heard is not None:
            heard.cancel()
        api.close()
    assert api.service is not None and api.service.proc.poll() is not None


async def test_a_service_of_our_own_that_held_a_stalled_store_is_killed_and_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command that stalled names who held Podman's store (PodmanTimeout.holding): our
    own service among them is killed, and the next call starts another; a service not
    named, or someone else's, is left alone."""
    binary = podman.podman_binary()
    assert binary is not None
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    first = await podman_service.start_service(path, binary=binary, timeout=120)
    api = PodmanApi(path, timeout=30, owned=first, binary=binary)
    monkeypatch.setattr(podman_api, "_shared", api)
    try:
        assert podman_api.release(frozenset({os.getpid()})) is False
        assert first.proc.poll() is None
        assert podman_api.release(frozenset({first.proc.pid})) is True
        await asyncio.to_thread(first.proc.wait, 30)
        assert await api.inspect_container(f"no-such-{uuid.uuid4().hex[:8]}") is None
        second = api.service
        assert second is not None and second is not first and second.proc.poll() is None
        theirs = PodmanApi(path, timeout=5, owned=None)
        monkeypatch.setattr(podman_api, "_shared", theirs)
        assert podman_api.release(frozenset({second.proc.pid})) is False
        assert second.proc.poll() is None
        theirs.close()
    finally:
        api.close()


async def test_a_service_someone_else_runs_is_not_started_again() -> None:
    path = Path("/run/mcp-forge") / f"test-{uuid.uuid4().hex[:8]}.sock"
    api = PodmanApi(path, timeout=5, owned=None, binary=podman.podman_binary())
    try:
        with pytest.raises(PodmanError) as failed:
            await api.inspect_container("anything")
        # The socket is named for the operator (detail, logged), never to a client (str).
        assert str(path) in failed.value.detail and str(path) not in str(failed.value)
        assert not path.exists()
    finally:
        api.close()


async def test_a_service_that_cannot_start_says_why(tmp_path: Path) -> None:
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\necho 'no API service here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(PodmanError, match=r"did not start.*no API service here"):
        await podman_service.start_service(tmp_path / "p.sock", binary=str(fake), timeout=120)


async def test_the_runtime_s_image_check_and_logs_through_the_api(
    runtime, make_session, images
) -> None:
    session = await runtime.get(await make_session())
    name = runtime.container_name(session)
    assert await runtime.containers.image_exists(images["minimal"])
    assert not await runtime.containers.image_exists(f"localhost/none:{uuid.uuid4().hex[:8]}")
    # The kernel writes to its log as it starts; both ways read the same lines.
    by_api = await runtime.containers.logs(name, 200)
    done = await podman.run("logs", "--tail", "200", name)
    by_cli = (done.stdout.decode(errors="replace") + done.stderr).split()
    assert set(by_api.split()) <= set(by_cli)
    assert "no container" in await runtime.containers.logs(f"none-{uuid.uuid4().hex[:8]}")
