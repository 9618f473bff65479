"""A local session's pod across a suspend and a resume (runtimes/local/naps.py), as its
kernel and its image would attack it.

The keeper, which holds a suspended kernel's pod up, stays beside the kernel after a
resume: the kernel must not be able to signal it, write its memory through /proc (and
so run code under a seccomp profile wider than its own), or take its CPU. And CRIU, run
as root at every checkpoint and restore, takes its options from the file a container's
annotation `org.criu.config` names: an image that names its own must not be heard."""

from __future__ import annotations

import errno
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.clients import podman
from mcp_forge.control.render import CRIU_ANNOTATION, CRIU_CONFIG
from mcp_forge.gateway.core import Gateway

pytestmark = [pytest.mark.podman, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

KIND = {"apiVersion": "mcpforge.dev/v1alpha1", "kind": "KernelSession"}
REACH = """
import json, os
found = {}
for d in os.listdir("/proc"):
    if not d.isdigit():
        continue
    try:
        cmd = open(f"/proc/{d}/cmdline", "rb").read()
        status = open(f"/proc/{d}/status").read().splitlines()
    except OSError:
        continue
    if cmd != b"sleep\\0infinity\\0":
        continue
    seen = dict(line.split(":", 1) for line in status if ":" in line)
    tried = {"uid": int(seen["Uid"].split()[0]), "seccomp": int(seen["Seccomp"])}
    try:
        os.kill(int(d), 0); tried["kill"] = 0
    except OSError as e:
        tried["kill"] = e.errno
    try:
        open(f"/proc/{d}/mem", "r+b").close(); tried["mem"] = 0
    except OSError as e:
        tried["mem"] = e.errno
    found[d] = tried
print(json.dumps(found))
"""


async def nap_and_wake(runtime: Any, name: str, image: str, **more: Any) -> None:
    for mode in ("Suspended", "Running"):
        spec = {"image": image, "resources": {"memory": "512Mi", "cpu": "1"}, **more}
        body = {**KIND, "metadata": {"name": name}, "spec": {**spec, "operatingMode": mode}}
        await runtime.apply(body)
    status = (await runtime.get(name)).status
    assert status["lastRestore"]["outcome"] == "Restored", status


async def test_a_resumed_kernel_cannot_reach_the_keeper_beside_it(
    runtime: Any, make_session: Any, images: dict[str, str]
) -> None:
    gateway = Gateway(runtime, runtime.settings)
    try:
        name = await make_session()
        await nap_and_wake(runtime, name, images["minimal"])
        # One an older gateway left, as the kernel's user: the next suspend replaces it.
        session = await runtime.get(name)
        await podman.run(
            "run", "-d", "--replace", f"--pod={runtime.pod_name(session)}",
            f"--name={runtime.pod_name(session)}-keeper", "--user=1000:1000",
            images["minimal"], "sleep", "infinity",
        )  # fmt: skip
        await nap_and_wake(runtime, name, images["minimal"])
        result = await gateway.execute(name, REACH)
        assert result.status == "ok", (result.error, result.stderr)
        found = json.loads(result.stdout)
    finally:
        await gateway.close()
    assert len(found) == 1, f"one keeper beside the kernel: {found}"
    (keeper,) = found.values()
    assert keeper["uid"] != 1000 and keeper["seccomp"] == 2, keeper
    assert keeper["kill"] == errno.EPERM, keeper
    assert keeper["mem"] in (errno.EACCES, errno.EPERM), keeper
    session = await runtime.get(name)
    (held,) = await podman.run_json("container", "inspect", f"{runtime.pod_name(session)}-keeper")
    assert held["HostConfig"]["CpuQuota"] > 0, "a sliver of a CPU, not the kernel's"
    assert held["Config"]["Annotations"][CRIU_ANNOTATION] == CRIU_CONFIG


async def test_an_image_that_names_its_own_criu_options_is_not_heard(
    runtime: Any, make_session: Any, images: dict[str, str], tmp_path: Path
) -> None:
    """An image annotated org.criu.config (Podman copies an image's annotations to its
    containers): its kernel and its keeper name the package's options all the same."""
    theirs = tmp_path / "theirs.conf"
    theirs.write_text("action-script /bin/false\n")
    image = f"localhost/mcpforge-test-annotated:{uuid.uuid4().hex[:8]}"
    (tmp_path / "Containerfile").write_text(f"FROM {images['minimal']}\n")
    await podman.run(
        "build", "-q", f"--annotation={CRIU_ANNOTATION}={theirs}", "-t", image, str(tmp_path),
        timeout=300,
    )  # fmt: skip
    try:
        name = await make_session(image=image)
        await nap_and_wake(runtime, name, image)
        session = await runtime.get(name)
        for container in (runtime.container_name(session), f"{runtime.pod_name(session)}-keeper"):
            (held,) = await podman.run_json("container", "inspect", container)
            assert held["Config"]["Annotations"][CRIU_ANNOTATION] == CRIU_CONFIG, container
        await runtime.delete(name)
    finally:
        await podman.run("rmi", "-f", image, check=False)


async def test_a_resumed_kernel_that_dies_for_good_takes_its_keeper_with_it(
    runtime: Any, make_session: Any, images: dict[str, str]
) -> None:
    """No new kernel follows (restartPolicy Never): the pod is left to stop, as a pod
    without a keeper does, rather than kept up by it."""
    name = await make_session(restartPolicy="Never")
    await nap_and_wake(runtime, name, images["minimal"], restartPolicy="Never")
    session = await runtime.get(name)
    keeper = f"{runtime.pod_name(session)}-keeper"
    assert await runtime.containers.inspect(keeper) is not None, "it stays after a resume"
    await podman.run("kill", runtime.container_name(session))
    failed = (await runtime.refresh(await runtime.get(name))).status
    assert failed["phase"] == "Failed", failed
    assert await runtime.containers.inspect(keeper) is None
