"""Forks on the cluster (issue 27; control/forking.py): a KernelSession made with the
annotation mcpforge.dev/forked-from starts from its parent's running kernel, checkpointed
by the kubelet, and answers with its variables under a key and environment of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mcp_forge.api import forks
from mcp_forge.api.forks import FORKED_FROM
from mcp_forge.api.keys import BRIDGE_CERT, CURVE_PUBLIC, CURVE_SECRET
from mcp_forge.clients.kube import Kube, connection_file_of
from mcp_forge.control.forking import FORK_DATA, FORK_DROP, FORK_KEY
from mcp_forge.errors import ForgeError
from mcp_forge.gateway.core import Gateway
from mcp_forge.kernelside import probe
from mcp_forge.runtimes.cluster import KubernetesRuntime
from mcp_forge.settings import Settings

from .conftest import ClusterUnderTest
from .harness import (
    KS,
    SMALL,
    bridge_takes,
    connection_of,
    eventually,
    kernel,
    ready,
    run_in_kernel,
    running_operator,
    session_body,
    start_bridge,
)
from .test_checkpoint import IMAGE
from .test_snapshots import CHECKPOINTS, OPEN_FILE, PERSISTENT, STATE, snapshot_operator


@pytest.fixture
async def forking(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    """The operator with snapshots on, so forks."""
    async with snapshot_operator(kube, ns, test_cluster, monkeypatch) as op:
        yield op


@pytest.fixture
async def forking_briefly(
    kube: Kube, ns: str, test_cluster: ClusterUnderTest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    """`forking`, with a progress deadline of 2 s."""
    monkeypatch.setenv("MCPFORGE_PROGRESS_DEADLINE", "2")
    async with snapshot_operator(kube, ns, test_cluster, monkeypatch) as op:
        yield op


# The parent's files: a file its kernel holds open, a link out of the workspace, a FIFO.
FILES = """
import os
open('notes.txt', 'w').write('parent notes')
os.symlink('/etc/hostname', 'link')
os.mkfifo('pipe')
log = open('log.txt', 'a')
log.write('a')
log.flush()
print('ok')
"""
FILES_SEEN = """
import os, stat
print(open('notes.txt').read(), os.readlink('link'), stat.S_ISFIFO(os.lstat('pipe').st_mode),
      stat.S_ISREG(os.lstat('link').st_mode))
"""


def _fork_body(name: str, ns: str, parent: str, **spec: Any) -> dict[str, Any]:
    body = session_body(name, ns, **{"image": IMAGE, "resources": SMALL, **spec})
    body["metadata"]["annotations"] = {FORKED_FROM: parent}
    return body


async def _connection(kube: Kube, ns: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    secret = await asyncio.to_thread(kube.get, "Secret", ns, f"ks-{name}-conn")
    info = connection_file_of(secret)
    assert secret is not None and info is not None, secret
    return info, secret


async def test_a_fork_answers_with_its_parents_variables_under_a_key_and_env_of_its_own(
    kube: Kube, ns: str, forking: Any
) -> None:
    """A fork answers with its parent's variables and running thread, under a key and
    env of its own, on a copy of its parent's persistent workspace (control/forkfiles.py)
    made before it woke: the file its memory holds open is there for the restore, links are copied
    as links and FIFOs as FIFOs (neither followed nor opened), and what either writes
    from then on is its own."""
    parent_env = [{"name": "WHO", "value": "parent"}, {"name": "ONLY_PARENT", "value": "1"}]
    body = session_body(
        "elder", ns, image=IMAGE, resources=SMALL, env=parent_env, workspace=PERSISTENT
    )
    await asyncio.to_thread(kube.create, body)
    await ready(kube, ns, "elder")
    async with kernel(kube, ns, "elder") as conn:
        assert await run_in_kernel(conn, STATE) == "41\n"
        assert await run_in_kernel(conn, FILES) == "ok\n"
        parents = await connection_of(kube, ns, "elder")
        await start_bridge(conn, parents)
        fork = _fork_body(
            "younger", ns, "elder", env=[{"name": "WHO", "value": "fork"}], workspace=PERSISTENT
        )
        await asyncio.to_thread(kube.create, fork)
        obj = await ready(kube, ns, "younger")
        status = obj["status"]
        assert (status.get("fork") or {}).get("outcome") == "Forked", status
        assert status["fork"]["workspace"]["outcome"] == "Copied", status["fork"]
        assert await asyncio.to_thread(kube.get, "Pod", ns, "ks-younger-fork-files") is None
        assert status["fork"]["from"] == "elder", status
        assert (status.get("lastRestore") or {}).get("outcome") == "Restored", status
        assert not status.get("snapshot"), status
        assert not list(CHECKPOINTS.glob(f"checkpoint-ks-elder_{ns}-*")), "its archive is spent"
        async with kernel(kube, ns, "younger") as child:
            said = await run_in_kernel(
                child,
                "import os\nprint(x + 1, t.is_alive(), os.environ['WHO'],"
                " os.environ.get('ONLY_PARENT'), os.environ['MCPFORGE_SESSION'])",
            )
            assert said == "42 True fork None younger\n", said
            assert await run_in_kernel(child, "x = 1; print(x)") == "1\n"
            said = await run_in_kernel(child, FILES_SEEN + "log.write('b'); log.flush()\n"
                                       "open('mine.txt', 'w').close()\n"
                                       "print(open('log.txt').read())")  # fmt: skip
            assert said == "parent notes /etc/hostname True False\nab\n", said
        said = await run_in_kernel(conn, "import os; print(x, os.environ['WHO'])")
        assert said == "41 parent\n"
        said = await run_in_kernel(
            conn, "print(open('log.txt').read(), os.path.exists('mine.txt'))"
        )
        assert said == "a False\n", said

    theirs, _ = await _connection(kube, ns, "elder")
    mine, secret = await _connection(kube, ns, "younger")
    assert mine["key"] != theirs["key"]
    assert not set(FORK_DATA) & set(secret.get("data") or {}), "the fork's keys promoted"
    # Its woken kernel was given transport keys of its own (kernelside/rebind.py): it
    # answers in all of its own keys, and in none of its parent's.
    assert mine[CURVE_PUBLIC] != theirs[CURVE_PUBLIC] and mine[BRIDGE_CERT] != theirs[BRIDGE_CERT]
    pod_ip = obj["status"]["podIP"]
    stale_key = {**mine, "key": theirs["key"]}
    stale_pair = {**mine, CURVE_PUBLIC: theirs[CURVE_PUBLIC], CURVE_SECRET: theirs[CURVE_SECRET]}
    for label, stale in (("its parent's key", stale_key), ("its parent's pair", stale_pair)):
        assert not await asyncio.to_thread(probe.answers, stale, pod_ip, 1500), label
    assert await asyncio.to_thread(probe.answers, mine, pod_ip, 5000)
    # Its bridge (its parent's, woken) takes the fork's certificate, not its parent's.
    own = await connection_of(kube, ns, "younger")
    async with kernel(kube, ns, "younger") as child:
        assert parents.bridge is not None and own.bridge is not None
        assert not await bridge_takes(child, own, parents.bridge)
        assert await bridge_takes(child, own, own.bridge)
    # Its next kernel, which does not wake from a snapshot, starts on the same keys.
    await asyncio.to_thread(kube.delete, "Pod", ns, obj["status"]["podName"])
    await ready(kube, ns, "younger", other_than=obj["status"]["kernelId"])
    again, secret = await _connection(kube, ns, "younger")
    assert again == mine
    assert not set(FORK_DATA) & set(secret.get("data") or {}), secret
    async with kernel(kube, ns, "younger") as child:
        assert await run_in_kernel(child, "print('x' in globals())") == "False\n"


async def test_a_parents_calls_wait_while_its_forks_workspace_is_copied(
    kube: Kube, ns: str, forking: Any
) -> None:
    """A fork made with kubectl (no gateway holds its parent's queue for it): the operator
    holds the parent (status.forkHolds) from before the checkpoint until the fork's copy
    of the workspace has ended, and a gateway's call on the parent waits for that, so the
    fork's files are those of the memory it wakes with; then the hold is let go."""
    # A call waits for a hold as long as for the call before it (lock_wait): long enough
    # here for a checkpoint and a copy on a busy host. Pod IPs: Service names resolve in
    # the cluster only.
    settings = Settings(session_namespace=ns, lock_wait=120.0, kube_connect="pod-ip")
    runtime = KubernetesRuntime(settings, Kube(kube.client.configuration))
    gateway = Gateway(runtime, settings)
    try:
        body = session_body("held", ns, image=IMAGE, resources=SMALL, workspace=PERSISTENT)
        await asyncio.to_thread(kube.create, body)
        await ready(kube, ns, "held")
        first = await gateway.execute("held", STATE + OPEN_FILE, namespace=ns)
        assert first.stdout == "41\n", first
        fork = _fork_body("held-copy", ns, "held", workspace=PERSISTENT)
        await asyncio.to_thread(kube.create, fork)
        await eventually(
            kube, KS, ns, "held",
            lambda o: "held-copy" in forks.live_holds((o or {}).get("status") or {}, time.time()),
            timeout=60, what="held for its fork",
        )  # fmt: skip
        # An interrupt is not held (a fork waits for its parent's code, never the reverse).
        await asyncio.wait_for(gateway.interrupt("held", namespace=ns), 10)
        after = await gateway.execute(
            "held", "log.write('b'); log.flush(); open('after.txt', 'w').close(); x", namespace=ns
        )
        assert after.status == "ok", after
        copy = await asyncio.to_thread(kube.get, KS, ns, "held-copy")
        said = ((copy or {}).get("status") or {}).get("fork") or {}
        assert (said.get("workspace") or {}).get("outcome") == "Copied", said
        await eventually(
            kube, KS, ns, "held",
            lambda o: not forks.live_holds((o or {}).get("status") or {}, time.time()),
            what="the hold let go",
        )  # fmt: skip
        await ready(kube, ns, "held-copy")
        async with kernel(kube, ns, "held-copy") as child:
            said = await run_in_kernel(
                child, "import os; print(x, open('log.txt').read(), os.path.exists('after.txt'))"
            )
            assert said == "41 a False\n", said
    finally:
        await gateway.close()
        runtime.close()


async def test_a_fork_of_a_session_that_is_not_there_starts_afresh_and_says_why(
    kube: Kube, ns: str, forking: Any
) -> None:
    await asyncio.to_thread(kube.create, _fork_body("orphan", ns, "nobody"))
    obj = await ready(kube, ns, "orphan")
    fork = obj["status"].get("fork") or {}
    assert fork.get("outcome") == "Failed" and "no session 'nobody'" in fork["message"], fork
    assert fork["workspace"]["outcome"] == "NotCopied", fork  # and says so
    assert "not forked" in fork["workspace"]["message"], fork
    _, secret = await _connection(kube, ns, "orphan")
    assert not {FORK_KEY, FORK_DROP} & set(secret.get("data") or {}), secret
    async with kernel(kube, ns, "orphan") as conn:
        assert await run_in_kernel(conn, "print('x' in globals())") == "False\n"


async def test_a_fork_that_cannot_wake_gets_keys_of_its_own_and_says_why(
    kube: Kube, ns: str, forking_briefly: Any
) -> None:
    """Its pod cannot be placed (more CPU than the node has) past the progress deadline
    (2 s, set before the operator starts): the archive is given up, and the Secret, a
    copy of its parent's until then, gets keys of its own."""
    await asyncio.to_thread(kube.create, session_body("holder", ns, image=IMAGE, resources=SMALL))
    await ready(kube, ns, "holder")
    huge = {**SMALL, "cpu": "64"}
    await asyncio.to_thread(kube.create, _fork_body("stuck", ns, "holder", resources=huge))
    obj = await eventually(
        kube, KS, ns, "stuck",
        lambda o: ((o or {}).get("status", {}).get("fork") or {}).get("outcome") == "Failed",
        timeout=60, what="the fork Failed",
    )  # fmt: skip
    assert obj is not None
    assert "was not restored" in obj["status"]["fork"]["message"], obj["status"]
    theirs, _ = await _connection(kube, ns, "holder")
    mine, secret = await _connection(kube, ns, "stuck")
    assert mine["key"] != theirs["key"]
    assert mine["curve_publickey"] != theirs["curve_publickey"]
    assert not {FORK_KEY, FORK_DROP} & set(secret.get("data") or {}), secret


async def test_a_gateway_forks_a_session_into_copies_each_answering_under_its_own_key(
    kube: Kube, ns: str, forking: Any
) -> None:
    runtime = KubernetesRuntime(Settings(session_namespace=ns), Kube(kube.client.configuration))
    try:
        body = session_body("source", ns, image=IMAGE, resources=SMALL)
        await asyncio.to_thread(kube.create, body)
        await ready(kube, ns, "source")
        async with kernel(kube, ns, "source") as conn:
            # Its workspace is its writable layer (no volume): each copy gets it back,
            # a file held open too, as its own (images/node/runc-restore/rootfs.go).
            assert await run_in_kernel(conn, STATE + OPEN_FILE) == "41\n"
            parent = await runtime.get("source", ns)
            bodies = [forks.body(parent, n, annotations={}) for n in ("copy-a", "copy-b")]
            made = await runtime.fork("source", ns, bodies)
        assert [s.name for s in made] == ["copy-a", "copy-b"]
        keys = {(await _connection(kube, ns, "source"))[0]["key"]}
        for copy in made:
            assert (copy.status.get("fork") or {}).get("outcome") == "Forked", copy.status
            async with kernel(kube, ns, copy.name) as child:
                mine = copy.name[-1]
                said = await run_in_kernel(
                    child,
                    f"log.write({mine!r}); log.flush()\n"
                    "print(x, t.is_alive(), open('log.txt').read())",
                )
                assert said == f"41 True a{mine}\n", said
            keys.add((await _connection(kube, ns, copy.name))[0]["key"])
        assert len(keys) == 3, "each copy signs with a key of its own"
        # One checkpoint for both, which the handler left for the node's sweeper.
        (shared,) = CHECKPOINTS.glob(f"checkpoint-ks-source_{ns}-*")
        await asyncio.to_thread(shared.unlink)
    finally:
        runtime.close()


async def test_a_gateway_refuses_a_fork_the_operator_cannot_checkpoint_and_leaves_no_copy(
    kube: Kube, ns: str
) -> None:
    """Snapshots off: the copy the gateway made to ask is deleted, and the error says why."""
    runtime = KubernetesRuntime(Settings(session_namespace=ns), Kube(kube.client.configuration))
    try:
        async with running_operator(kube):
            await asyncio.to_thread(kube.create, session_body("plain", ns, resources=SMALL))
            await ready(kube, ns, "plain")
            parent = await runtime.get("plain", ns)
            with pytest.raises(ForgeError, match=r"cannot be forked: .*snapshots are off"):
                await runtime.fork("plain", ns, [forks.body(parent, "copy", annotations={})])
            await eventually(kube, KS, ns, "copy", lambda o: o is None, what="the copy gone")
    finally:
        runtime.close()
