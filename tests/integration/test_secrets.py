"""Env from Secrets in local mode: real kernels in real Podman pods. The value reaches
the kernel's os.environ at every start (cold, claimed from a pool, restarted) and
nowhere else: not the pod (podman inspect), its file, the status, the logs or errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.errors import SecretError, SessionNotFound
from mcp_forge.gateway.core import Gateway
from mcp_forge.runtimes.local.runtime import LocalRuntime

pytestmark = pytest.mark.podman

CLI = str(Path(sys.executable).parent / "mcp-forge")


@pytest.fixture
def value() -> str:
    """A secret value no test shares, with characters that need quoting."""
    return f"s3cr3t-{secrets.token_hex(8)}-🔑-'q' \"and\" \\back"


@pytest.fixture
def secret_name(runtime: Any) -> Any:
    name = f"api-{uuid.uuid4().hex[:8]}"
    yield name
    with contextlib.suppress(SecretError):
        runtime.secrets.delete(name)


def secret_body(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}


def env(secret: str, key: str = "token") -> list[dict[str, Any]]:
    ref = {"secretKeyRef": {"name": secret, "key": key}}
    return [{"name": "PLAIN", "value": "plain"}, {"name": "API_TOKEN", "valueFrom": ref}]


def session_body(image: str, **spec: Any) -> dict[str, Any]:
    spec.setdefault("resources", {"memory": "512Mi"})
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": f"s-{uuid.uuid4().hex[:10]}"},
        "spec": {"image": image, **spec},
    }


@pytest.fixture
async def sessions(runtime: Any) -> AsyncIterator[Callable[[dict[str, Any]], Any]]:
    """Apply session bodies (errors propagate); every one is deleted afterwards."""
    names: list[str] = []

    async def apply(body: dict[str, Any]) -> Any:
        names.append(body["metadata"]["name"])
        return (await runtime.apply(body)).session

    yield apply
    for name in names:
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)


async def seen(gw: Gateway, name: str) -> list[Any]:
    """The kernel's API_TOKEN and PLAIN, and how many cells its history holds."""
    r = await gw.execute(
        name,
        "import os, json; print(json.dumps([os.environ.get('API_TOKEN'), os.environ.get("
        "'PLAIN'), len(get_ipython().history_manager.input_hist_raw)]))",
    )
    assert r.status == "ok", (r.error, r.stderr)
    return list(json.loads(r.stdout))


async def podman_text(*args: str) -> str:
    done = await asyncio.to_thread(
        subprocess.run, ["podman", *args], capture_output=True, text=True, check=False
    )
    return done.stdout + done.stderr


async def assert_nowhere_but_the_kernel(
    runtime: Any, name: str, value: str, logs: str, *, plain_in_pod: bool = True
) -> None:
    """The value (or its base64) is not in the pod, its file, the status or the logs.
    The plain variable is in the pod as before, unless the pod is a pool's (claimed)."""
    encoded = base64.b64encode(value.encode()).decode()
    session = await runtime.get(name)
    pod = runtime.pod_name(session)
    places = {
        "pod inspect": await podman_text("pod", "inspect", pod),
        "container inspect": await podman_text(
            "container", "inspect", runtime.container_name(session)
        ),
        "container logs": await podman_text("logs", runtime.container_name(session)),
        "pod.yaml": (runtime._dir(session) / "pod.yaml").read_text(),
        "status": json.dumps(session.body),
        "logs": logs,
    }
    assert '"API_TOKEN"' not in places["container inspect"]  # not even its name
    assert ("PLAIN=plain" in places["container inspect"]) == plain_in_pod
    for where, text in places.items():
        assert value not in text and encoded not in text, where
        assert "s3cr3t" not in text, where


async def test_a_cold_session_gets_its_secret_at_every_start_and_nowhere_else(
    runtime: Any,
    sessions: Any,
    gateway: Gateway,
    images: dict[str, str],
    value: str,
    secret_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    runtime.secrets.apply(secret_body(secret_name, token=value))
    session = await sessions(session_body(images["minimal"], env=env(secret_name)))
    assert session.status["phase"] == st.READY
    # The value, exactly; and giving it left no cell in the history (entry 0 is
    # IPython's empty one, entry 1 this cell).
    assert await seen(gateway, session.name) == [value, "plain", 2]
    await assert_nowhere_but_the_kernel(runtime, session.name, value, caplog.text)

    # A restart is a new kernel in a new pod: it is given the value again.
    await gateway.restart(session.name)
    restarted = await runtime.get(session.name)
    assert restarted.status["kernelId"] != session.status["kernelId"]
    assert restarted.status["phase"] == st.READY
    assert await seen(gateway, session.name) == [value, "plain", 2]

    # A crash (the kernel killed): the refresh that sees it restarts it, with the value.
    await podman_text("kill", runtime.container_name(restarted))
    await podman_text("wait", runtime.container_name(restarted))
    crashed = await runtime.refresh(restarted)
    assert (crashed.status["phase"], crashed.status["restarts"]) == (st.READY, 1)
    assert crashed.status["kernelId"] != restarted.status["kernelId"]
    assert await seen(gateway, session.name) == [value, "plain", 2]

    # Suspended and resumed: the same kernel, its memory restored (naps.py), the value in
    # it still; the snapshot that held it is gone once restored.
    suspended = session_body(images["minimal"], env=env(secret_name), operatingMode="Suspended")
    suspended["metadata"]["name"] = session.name
    await runtime.apply(suspended)
    assert (await runtime.get(session.name)).status["phase"] == st.SUSPENDED
    suspended["spec"]["operatingMode"] = "Running"
    resumed = (await runtime.apply(suspended)).session
    assert resumed.status["phase"] == st.READY
    assert resumed.status["kernelId"] == crashed.status["kernelId"]
    assert await seen(gateway, session.name) == [value, "plain", 3]
    assert not runtime._snapshot(resumed).exists()
    await assert_nowhere_but_the_kernel(runtime, session.name, value, caplog.text)

    # Without live snapshots, resumed is a new kernel, given the value before it is Ready.
    plain = LocalRuntime(dataclasses.replace(runtime.settings, snapshots=False))
    await plain.apply(suspended | {"spec": {**suspended["spec"], "operatingMode": "Suspended"}})
    resumed = (await plain.apply(suspended)).session
    assert resumed.status["kernelId"] != crashed.status["kernelId"]
    assert await seen(gateway, session.name) == [value, "plain", 2]
    await assert_nowhere_but_the_kernel(runtime, session.name, value, caplog.text)


async def test_a_claimed_pool_kernel_gets_its_secret_and_keeps_it_across_a_restart(
    runtime: Any,
    sessions: Any,
    gateway: Gateway,
    images: dict[str, str],
    value: str,
    secret_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    runtime.secrets.apply(secret_body(secret_name, token=value))
    pool = f"p{uuid.uuid4().hex[:8]}"
    spec = {"image": images["minimal"], "resources": {"memory": "512Mi"}}
    await runtime.pools.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSessionPool",
            "metadata": {"name": pool},
            "spec": {"size": 1, "template": spec},
        }
    )
    try:
        session = await sessions(
            session_body(images["minimal"], env=env(secret_name), poolRef={"name": pool})
        )
        warm = [c for c in session.status["conditions"] if c["type"] == ksp.WARM_START]
        assert [(c["status"], c["reason"]) for c in warm] == [("True", ksp.CLAIMED)]
        assert await seen(gateway, session.name) == [value, "plain", 2]
        await assert_nowhere_but_the_kernel(
            runtime, session.name, value, caplog.text, plain_in_pod=False
        )

        # A restart plays the session's own pod: plain env in it, the Secret's given.
        await runtime.restart_kernel(session, reason="Requested", crashed=False)
        assert await seen(gateway, session.name) == [value, "plain", 2]
        await assert_nowhere_but_the_kernel(runtime, session.name, value, caplog.text)
    finally:
        await runtime.pools.delete(pool)


@pytest.mark.parametrize("missing", ["secret", "key"])
async def test_a_missing_secret_or_key_fails_the_session_naming_them_and_no_pod_starts(
    runtime: Any,
    sessions: Any,
    images: dict[str, str],
    value: str,
    secret_name: str,
    missing: str,
) -> None:
    if missing == "key":
        runtime.secrets.apply(secret_body(secret_name, other=value))
    body = session_body(images["minimal"], env=env(secret_name))
    with pytest.raises(SecretError) as err:
        await sessions(body)
    failed = await runtime.get(body["metadata"]["name"])
    assert (failed.status["phase"], failed.status["reason"]) == (st.FAILED, st.SECRET_NOT_FOUND)
    words = "has no key 'token'" if missing == "key" else "not found in namespace 'default'"
    for text in (str(err.value), failed.status["message"]):
        assert f"Secret {secret_name!r}" in text and words in text and "API_TOKEN" in text
        assert value not in text
    assert runtime.pod_name(failed) not in await podman_text("pod", "ls", "--format", "{{.Name}}")

    # With the Secret there, applying the session again starts it.
    runtime.secrets.apply(secret_body(secret_name, token=value))
    started = (await runtime.apply(body)).session
    assert started.status["phase"] == st.READY


async def test_a_claim_without_its_secret_takes_no_pool_kernel_and_fails_naming_it(
    runtime: Any, sessions: Any, images: dict[str, str], secret_name: str
) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    spec = {"image": images["minimal"], "resources": {"memory": "512Mi"}}
    await runtime.pools.apply(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSessionPool",
            "metadata": {"name": pool},
            "spec": {"size": 1, "template": spec},
        }
    )
    try:
        before = runtime.pools.members(runtime.pools.get(pool))
        body = session_body(images["minimal"], env=env(secret_name), poolRef={"name": pool})
        with pytest.raises(SecretError, match=f"Secret {secret_name!r} not found"):
            await sessions(body)
        failed = await runtime.get(body["metadata"]["name"])
        assert (failed.status["phase"], failed.status["reason"]) == (
            st.FAILED,
            st.SECRET_NOT_FOUND,
        )
        warm = [c for c in failed.status["conditions"] if c["type"] == ksp.WARM_START]
        assert [(c["status"], c["reason"]) for c in warm] == [("False", ksp.CLAIM_FAILED)]
        assert secret_name in warm[0]["message"]
        # The pool's kernel was not taken: it still waits, Ready, for a claim.
        after = runtime.pools.members(runtime.pools.get(pool))
        assert [m.name for m in after] == [m.name for m in before]
        assert {m.status["phase"] for m in after} == {st.READY}
    finally:
        await runtime.pools.delete(pool)


async def test_the_cli_applies_lists_and_deletes_secrets_and_never_prints_a_value(
    runtime: Any,
    sessions: Any,
    cli_env: dict[str, str],
    images: dict[str, str],
    value: str,
    secret_name: str,
    tmp_path: Path,
) -> None:
    encoded = base64.b64encode(value.encode()).decode()
    body = session_body(images["minimal"], env=env(secret_name))
    name = body["metadata"]["name"]
    secret = secret_body(secret_name, token=value)
    secret["data"] = {"extra": base64.b64encode(b"more").decode()}
    (tmp_path / "all.yaml").write_text(yaml.safe_dump_all([secret, body]))
    outputs: list[str] = []

    async def cli(*args: str) -> str:
        done = await asyncio.to_thread(
            subprocess.run,
            [CLI, "--log-level", "debug", *args],
            env=cli_env,
            capture_output=True,
            text=True,
            check=False,
        )
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        applied = await cli("apply", "-f", str(tmp_path / "all.yaml"))
        assert f"secret/{secret_name} created (2 keys)" in applied
        assert f"kernelsession/{name} created (Ready" in applied
        assert f"secret/{secret_name} unchanged" in await cli(
            "apply", "-f", str(tmp_path / "all.yaml")
        )
        table = await cli("get", "secrets")
        assert secret_name in table and "extra,token" in table
        shown = yaml.safe_load(await cli("get", f"secret/{secret_name}", "-o", "yaml"))
        assert shown["keys"] == ["extra", "token"] and "data" not in shown
        assert json.loads(await cli("get", "secrets", "-o", "json"))["items"]
        # (The code names no value: the CLI's own debug log may show its arguments.)
        digest = hashlib.sha256(value.encode()).hexdigest()
        code = (
            "import os, hashlib as h; print(h.sha256(os.environ['API_TOKEN'].encode()).hexdigest())"
        )
        assert await cli("exec", name, "-c", code) == f"{digest}\n"
        assert f"secret/{secret_name} deleted" in await cli("delete", f"secret/{secret_name}")
        assert secret_name not in await cli("get", "secrets")
        # A running kernel keeps what it was given.
        out = await cli("exec", name, "-c", "import os; print(len(os.environ['API_TOKEN']))")
        assert out == f"{len(value)}\n"
        stored = await cli("get", name, "-o", "json")
        assert json.loads(stored)["status"]["phase"] == st.READY
    finally:
        with contextlib.suppress(SessionNotFound):
            await runtime.delete(name)
    for text in outputs:
        assert value not in text and encoded not in text and "s3cr3t" not in text
