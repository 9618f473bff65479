"""Local mode: the pod's sandbox, isolation between sessions, status, culling, deletion."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcp_forge.clients import podman
from mcp_forge.control.render import SECCOMP_PROFILE_ROOT
from mcp_forge.errors import ImageError, InvalidRequest, SessionNotFound, SessionNotReady
from mcp_forge.runtimes.local import volumes
from mcp_forge.runtimes.local.kernelpods import userns_flag
from mcp_forge.runtimes.local.orphans import STORE_LABEL, store_tag
from mcp_forge.runtimes.local.supervisor import supervise_once

pytestmark = pytest.mark.podman

CLI = [str(Path(sys.executable).parent / "mcp-forge")]


async def run_cli(*args: str, env: dict[str, str], stdin: str | None = None):
    return await asyncio.to_thread(
        subprocess.run, [*CLI, *args], env=env, input=stdin, capture_output=True, text=True
    )


async def value(gateway, name: str, code: str):
    r = await gateway.execute(name, code)
    assert r.status == "ok", (r.error, r.stderr)
    return json.loads(r.stdout)


async def test_the_kernel_runs_as_uid_1000_without_capabilities_on_a_read_only_root(
    gateway, make_session
) -> None:
    name = await make_session()
    facts = await value(
        gateway,
        name,
        "import os, json, errno\n"
        "caps = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') "
        "if l.startswith(('Cap', 'NoNewPrivs', 'Seccomp:'))}\n"
        "try:\n"
        "    open('/usr/evil', 'w'); ro = False\n"
        "except OSError as e:\n"
        "    ro = e.errno == errno.EROFS\n"
        "open('/workspace/w', 'w').write('ok'); open('/tmp/t', 'w').write('ok')\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'caps': caps, 'ro': ro,\n"
        "  'token': os.path.exists('/var/run/secrets/kubernetes.io'),\n"
        "  'pids': open('/sys/fs/cgroup/pids/pids.max').read().strip()}))",
    )
    assert facts["uid"] == 1000 and facts["gid"] == 1000
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(facts["caps"][cap], 16) == 0, cap
    assert facts["caps"]["NoNewPrivs"] == "1"
    assert facts["caps"]["Seccomp"] == "2"  # a seccomp filter is in force
    assert facts["ro"] is True
    assert facts["token"] is False
    assert facts["pids"] == "256"


async def test_the_pod_has_no_network_but_loopback_and_no_route_out(gateway, make_session) -> None:
    name = await make_session()
    facts = await value(
        gateway,
        name,
        "import json\n"
        "dev = open('/proc/net/dev').read().splitlines()[2:]\n"
        "ifaces = [l.split(':')[0].strip() for l in dev]\n"
        "routes = [l for l in open('/proc/net/route').read().splitlines()[1:] if l.strip()]\n"
        "routes6 = [l for l in open('/proc/net/ipv6_route').read().splitlines() if 'lo' not in l]\n"
        "print(json.dumps({'ifaces': ifaces, 'routes': routes, 'routes6': routes6}))",
    )
    assert facts == {"ifaces": ["lo"], "routes": [], "routes6": []}


async def test_two_sessions_cannot_see_each_others_files_or_reach_each_others_ports(
    gateway, runtime, make_session
) -> None:
    a, b = await make_session(), await make_session()
    # A writes a file and listens on a TCP port inside its pod.
    await gateway.execute(
        a,
        "import socket\nopen('/workspace/secret.txt', 'w').write('a only')\n"
        "open('/tmp/secret.txt', 'w').write('a only')\n"
        "srv = socket.socket(); srv.bind(('0.0.0.0', 8765)); srv.listen()",
    )
    a_paths = runtime.host_paths(await runtime.get(a))
    facts = await value(
        gateway,
        b,
        "import os, json, socket\n"
        f"paths = {[a_paths.run, a_paths.workspace]!r}\n"
        "s = socket.socket(); s.settimeout(2)\n"
        "try:\n"
        "    s.connect(('127.0.0.1', 8765)); reached = True\n"
        "except OSError:\n"
        "    reached = False\n"
        "print(json.dumps({'files': os.listdir('/workspace') + os.listdir('/tmp'),\n"
        "  'a_dirs': [os.path.exists(p) for p in paths], 'reached': reached}))",
    )
    assert "secret.txt" not in facts["files"]
    assert facts["a_dirs"] == [False, False]
    assert facts["reached"] is False
    # A's kernel channels are Unix sockets in a directory only root on the host can enter.
    state = Path(a_paths.run).parent.parent
    assert oct(state.stat().st_mode & 0o777) == "0o700"
    assert Path(a_paths.run, "kernel-5555").is_socket()  # noqa: ASYNC240


async def test_files_round_trip_and_stay_inside_the_workspace(gateway, make_session) -> None:
    name = await make_session()
    data = bytes(range(256)) * 10
    assert await gateway.write_file(name, "dir/sub/blob.bin", data) == len(data)
    assert await gateway.read_file(name, "/workspace/dir/sub/blob.bin") == data
    listing = await gateway.list_files(name, "dir/sub")
    assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [
        ("blob.bin", "file", len(data))
    ]
    for bad in ("../etc/passwd", "/etc/passwd", "a/../../x"):
        with pytest.raises(InvalidRequest):
            await gateway.read_file(name, bad)
    # A symlink made by user code does not lead out either (refused, or checked by realpath).
    await gateway.execute(name, "import os; os.symlink('/etc', '/workspace/etc-link')")
    with pytest.raises(InvalidRequest, match=r"leaves the workspace|symbolic link"):
        await gateway.read_file(name, "etc-link/passwd")
    with pytest.raises(InvalidRequest, match=r"leaves the workspace|symbolic link"):
        await gateway.write_file(name, "etc-link/evil", b"x")
    with pytest.raises(InvalidRequest, match="no such file"):
        await gateway.read_file(name, "missing.txt")
    with pytest.raises(InvalidRequest, match="limit"):
        await gateway.write_file(name, "big", b"x" * (gateway.settings.file_max + 1))


async def test_variables_are_listed_and_inspected_as_json_from_the_kernel(
    gateway, make_session
) -> None:
    name = await make_session("default")
    await gateway.execute(
        name,
        "import numpy as np, pandas as pd\n"
        "arr = np.zeros((3, 4), dtype='float32')\n"
        "df = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\n"
        "words = ['w'] * 1000\n"
        "def f(): pass\n"
        "_hidden = 1",
    )
    listed = {v["name"]: v for v in await gateway.variables(name)}
    assert set(listed) == {"arr", "df", "words", "f"}
    assert listed["arr"]["shape"] == [3, 4]
    assert listed["arr"]["dtype"] == "float32"
    assert listed["arr"]["size"] == 48
    assert listed["df"]["type"] == "pandas.DataFrame"
    assert listed["df"]["shape"] == [2, 2]
    assert listed["words"]["length"] == 1000
    assert len(listed["words"]["repr"]) < 300
    one = await gateway.inspect_variable(name, "arr")
    assert one["type"] == "numpy.ndarray" and "0." in one["repr"]
    with pytest.raises(InvalidRequest, match="no variable named nope"):
        await gateway.inspect_variable(name, "nope")
    with pytest.raises(InvalidRequest, match="identifier"):
        await gateway.inspect_variable(name, "__import__('os')")
    # Listing is silent: no execution count, nothing added to the namespace.
    r = await gateway.execute(name, "sorted(k for k in globals() if not k.startswith('_'))")
    assert r.execution_count == 2
    assert "arr" in r.result["data"]["text/plain"]
    assert "mcp" not in r.result["data"]["text/plain"].lower()


async def test_a_pod_that_dies_is_noticed_and_restarted_per_policy(runtime, make_session) -> None:
    always = await make_session()
    never = await make_session(restartPolicy="Never")
    for name in (always, never):
        session = await runtime.get(name)
        await podman.run("kill", runtime.container_name(session))
    assert (await runtime.refresh(await runtime.get(always))).status["phase"] == "Ready"
    status = (await runtime.get(always)).status
    assert status["restarts"] == 1
    assert status["lastTermination"]["reason"] == "Error"
    failed = (await runtime.refresh(await runtime.get(never))).status
    assert failed["phase"] == "Failed"
    assert failed["reason"] == "Error"
    assert failed["restarts"] == 0, "no restart follows that death: none is counted"
    assert failed["lastTermination"]["reason"] == "Error"


async def test_idle_sessions_are_culled_and_active_ones_kept(runtime, make_session) -> None:
    idle = await make_session(idleTimeout="60s")
    busy = await make_session(idleTimeout="60s")
    # Backdate the idle one's last activity instead of waiting a minute.
    runtime.store.patch_status("default", idle, {"lastActivity": "2000-01-01T00:00:00Z"})
    culled = await supervise_once(runtime)
    assert culled == [idle]
    with pytest.raises(SessionNotFound):
        await runtime.get(idle)
    assert (await runtime.get(busy)).status["phase"] == "Ready"


async def test_a_session_running_code_is_not_culled_however_old_its_last_activity(
    runtime, settings, make_session
) -> None:
    # A gateway that writes lastActivity only once per hour: during the call only its busy
    # mark says the session is in use (without it, the backdated session would be culled).
    from mcp_forge.gateway.core import Gateway

    gateway = Gateway(runtime, dataclasses.replace(settings, activity_interval=3600.0))
    name = await make_session(idleTimeout="60s")
    try:
        running = asyncio.Event()
        call = asyncio.create_task(
            gateway.execute(
                name,
                "import time; print('running', flush=True); time.sleep(6); print('done')",
                on_stream=lambda _name, _text: running.set(),
            )
        )
        async with asyncio.timeout(30):
            await running.wait()  # the call marked the session busy before it sent the code
        assert runtime.store.private("default", name).get("busyUntil")
        runtime.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
        assert await supervise_once(runtime) == [], "a session running code was culled"
        assert (await runtime.get(name)).status["phase"] == "Ready"
        result = await call
        assert (result.status, result.stdout) == ("ok", "running\ndone\n")
    finally:
        await gateway.close()
    assert runtime.store.private("default", name).get("busyUntil") is None
    runtime.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
    assert await supervise_once(runtime) == [name], "done and idle: culled"


async def test_a_local_session_carries_the_operator_s_four_conditions(
    runtime, make_session
) -> None:
    status = (await runtime.get(await make_session())).status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert list(conditions) == ["Ready", "UpdatePending", "Reconciling", "Stalled"]
    ready = conditions["Ready"]
    assert (ready["status"], ready["reason"], status["reason"]) == (
        "True",
        "KernelReady",
        "KernelReady",
    )
    assert [conditions[t]["status"] for t in ("UpdatePending", "Reconciling", "Stalled")] == [
        "False",
        "False",
        "False",
    ]
    assert ready["observedGeneration"] == status["observedGeneration"] == 1


async def pod_exists(runtime, name: str) -> bool:
    session = await runtime.get(name)
    done = await podman.run("pod", "exists", runtime.pod_name(session), check=False)
    return done.returncode == 0


async def kernel_running(runtime, name: str) -> bool:
    """Whether the session's kernel process runs (suspended, its memory is free: none)."""
    session = await runtime.get(name)
    found = await podman.run(
        "container", "inspect", "--format", "{{.State.Running}}", runtime.container_name(session),
        check=False,
    )  # fmt: skip
    return found.returncode == 0 and found.stdout.decode().strip() == "true"


async def test_idle_suspend_keeps_the_session_and_a_use_resumes_it(
    runtime, gateway, make_session
) -> None:
    name = await make_session(idleTimeout="60s", idleAction="Suspend")
    assert (
        await gateway.execute(name, "x = 1\nopen('kept.txt', 'w').write('kept')")
    ).status == "ok"
    runtime.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
    assert await supervise_once(runtime) == [name]
    session = await runtime.get(name)
    assert (session.status["phase"], session.status["reason"]) == ("Suspended", "Idle")
    assert not await kernel_running(runtime, name)
    assert await supervise_once(runtime) == [], "a suspended session is left alone"
    assert not await kernel_running(runtime, name), "housekeeping does not resume it"
    assert (await runtime.get(name)).status["phase"] == "Suspended"
    # Used again: the kernel as it was, its memory restored (naps.py), the workspace kept.
    assert session.status["snapshot"]["size"] > 0, session.status
    result = await gateway.execute(name, "print('x' in dir(), open('kept.txt').read())")
    assert (result.status, result.stdout) == ("ok", "True kept\n")
    resumed = (await runtime.get(name)).status
    assert resumed["phase"] == "Ready" and resumed["lastRestore"]["outcome"] == "Restored"
    assert resumed.get("snapshot") is None, resumed


async def test_without_snapshots_an_idle_suspend_loses_the_variables_and_says_so(
    runtime, settings, make_session
) -> None:
    """MCPFORGE_SNAPSHOTS=false: a suspended kernel starts afresh when used again."""
    from mcp_forge.gateway.core import Gateway
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    plain = LocalRuntime(dataclasses.replace(settings, snapshots=False))
    gateway = Gateway(plain, plain.settings)
    try:
        name = await make_session(idleTimeout="60s", idleAction="Suspend")
        assert (await gateway.execute(name, "x = 1")).status == "ok"
        plain.store.patch_status("default", name, {"lastActivity": "2000-01-01T00:00:00Z"})
        assert await plain.cull_idle() == [name]
        session = await plain.get(name)
        assert (session.status["phase"], session.status["reason"]) == ("Suspended", "Idle")
        assert "variables lost: live snapshots are off" in str(session.status["message"])
        result = await gateway.execute(name, "print('x' in dir())")
        assert (result.status, result.stdout) == ("ok", "False\n")
    finally:
        await gateway.close()


async def test_operating_mode_suspended_stops_the_kernel_until_running_again(
    runtime, gateway, make_session, images
) -> None:
    name = await make_session()
    body: dict[str, Any] = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": name},
        "spec": {
            "image": images["minimal"],
            "resources": {"memory": "512Mi", "cpu": "1"},
            "operatingMode": "Suspended",
        },
    }
    await runtime.apply(body)
    session = await runtime.get(name)
    assert (session.status["phase"], session.status["reason"]) == ("Suspended", "UserRequested")
    assert not await kernel_running(runtime, name)
    with pytest.raises(SessionNotReady, match="Suspended"):
        await gateway.execute(name, "1")
    body["spec"]["operatingMode"] = "Running"
    await runtime.apply(body)
    assert (await gateway.execute(name, "print(6 * 7)")).stdout == "42\n"


async def test_max_lifetime_expires_a_session(runtime, gateway, make_session) -> None:
    name = await make_session(maxLifetime="1h")
    stored = runtime.store.get("default", name)
    stored["metadata"]["creationTimestamp"] = "2000-01-01T00:00:00Z"  # not waiting an hour
    runtime.store.replace(stored)
    assert await supervise_once(runtime) == [name]
    session = await runtime.get(name)
    assert session.status["phase"] == "Expired"
    assert "maxLifetime of 1h" in session.status["message"]
    assert not await pod_exists(runtime, name)
    with pytest.raises(SessionNotReady, match="Expired"):
        await gateway.execute(name, "1")
    # A longer lifetime brings it back.
    body = {k: stored[k] for k in ("apiVersion", "kind", "metadata", "spec")}
    body["spec"] = {**body["spec"], "maxLifetime": "999999h"}
    await runtime.apply(body)
    assert (await gateway.execute(name, "print(6 * 7)")).stdout == "42\n"


async def test_delete_leaves_nothing_behind(runtime, make_session) -> None:
    name = await make_session()
    session = await runtime.get(name)
    base = Path(runtime.host_paths(session).run).parent
    assert base.is_dir()
    await runtime.delete(name)
    pods = await podman.run("pod", "exists", runtime.pod_name(session), check=False)
    ctrs = await podman.run("container", "exists", runtime.container_name(session), check=False)
    assert pods.returncode == 1 and ctrs.returncode == 1
    assert not base.exists()
    with pytest.raises(SessionNotFound):
        await runtime.get(name)


def _fstype(path: str) -> str | None:
    return volumes.mounted(Path(path))


async def test_the_workspace_is_mounted_again_after_a_host_reboot(
    runtime, gateway, make_session
) -> None:
    name = await make_session()
    session = await runtime.get(name)
    paths = runtime.host_paths(session)
    await gateway.execute(name, "open('/workspace/kept', 'w').write('yes')")
    # A reboot: the kernel is gone and nothing of the session is mounted any more.
    await podman.run("pod", "stop", "-t", "0", runtime.pod_name(session))
    for target in (paths.workspace, paths.tmp):
        await volumes.unmount(Path(target))
    assert _fstype(paths.workspace) is None and _fstype(paths.tmp) is None
    r = await gateway.execute(name, "print(open('/workspace/kept').read())")
    if r.status != "ok":  # the call that found the kernel dead restarted it
        r = await gateway.execute(name, "print(open('/workspace/kept').read())")
    assert r.status == "ok" and r.stdout.strip() == "yes", (r.error, r.stdout)
    assert _fstype(paths.workspace) == "ext4" and _fstype(paths.tmp) == "tmpfs"


async def test_a_plain_workspace_from_before_volumes_is_moved_into_one(
    runtime, gateway, make_session
) -> None:
    name = await make_session()
    session = await runtime.get(name)
    workspace = Path(runtime.host_paths(session).workspace)
    # A session from before this change: a pod without a user namespace, and a plain
    # workspace directory of files owned by host uid 1000.
    await runtime._remove_pod(session)  # retries Podman's EBUSY on a dying pod's /dev/shm
    await volumes.unmount(workspace)
    (workspace.parent / "workspace.img").unlink()
    private = runtime.store.private(session.namespace, name)
    del private["idmap"]
    runtime.store.set_private(session.namespace, name, private)
    (workspace / "data").mkdir()
    (workspace / "data" / "notes.txt").write_text("kept")
    (workspace / "link").symlink_to("data/notes.txt")
    for path in (workspace, workspace / "data", workspace / "data" / "notes.txt"):
        os.chown(path, 1000, 1000)
    os.lchown(workspace / "link", 1000, 1000)
    r = await gateway.execute(name, "print(open('/workspace/link').read())")
    if r.status != "ok":
        r = await gateway.execute(name, "print(open('/workspace/link').read())")
    assert r.status == "ok" and r.stdout.strip() == "kept", (r.error, r.stdout)
    assert _fstype(str(workspace)) == "ext4"
    uid = runtime.kernel_ids(await runtime.get(name))[0]
    assert uid not in (0, 1000)
    assert (workspace / "data" / "notes.txt").stat().st_uid == uid
    assert os.lstat(workspace / "link").st_uid == uid
    assert not (workspace.parent / "workspace.migrating").exists()
    w = await gateway.execute(name, "open('/workspace/data/more.txt', 'w').write('x')")
    assert w.status == "ok", w.error


async def test_a_missing_image_says_how_to_build_it(runtime) -> None:
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "no-image"},
        "spec": {"image": "localhost/mcp-forge-kernel:0.0.0-missing"},
    }
    with pytest.raises(ImageError, match="mcp-forge image build"):
        await runtime.apply(body)
    with pytest.raises(SessionNotFound):
        await runtime.get("no-image")


async def test_the_cli_applies_gets_and_deletes_and_rejects_invalid_yaml(
    cli_env, tmp_path, images
) -> None:
    good = tmp_path / "ks.yaml"
    good.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "mcpforge.dev/v1alpha1",
                "kind": "KernelSession",
                "metadata": {"name": "cli-demo"},
                "spec": {"image": images["minimal"], "resources": {"memory": "256Mi"}},
            }
        )
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("256Mi", "lots"))
    refused = await run_cli("apply", "-f", str(bad), env=cli_env)
    assert refused.returncode == 1
    assert "spec.resources.memory" in refused.stderr and "'lots'" in refused.stderr
    created = await run_cli("apply", "-f", str(good), env=cli_env)
    assert created.returncode == 0, created.stderr
    assert "kernelsession/cli-demo created (Ready" in created.stdout
    again = await run_cli("apply", "-f", str(good), env=cli_env)
    assert "kernelsession/cli-demo unchanged" in again.stdout
    shown = await run_cli("get", "cli-demo", "-o", "yaml", env=cli_env)
    status = yaml.safe_load(shown.stdout)["status"]
    assert status["phase"] == "Ready"
    assert "key" not in json.dumps(status["connection"])
    table = await run_cli("get", env=cli_env)
    assert table.stdout.splitlines()[0].split()[:2] == ["NAME", "PHASE"]
    assert any(
        line.startswith("cli-demo ") and "Ready" in line for line in table.stdout.splitlines()
    )
    updated = await run_cli(
        "apply", "-f", "-", env=cli_env, stdin=good.read_text().replace("256Mi", "300Mi")
    )
    assert "kernelsession/cli-demo configured" in updated.stdout, updated.stderr
    deleted = await run_cli("delete", "cli-demo", env=cli_env)
    assert deleted.returncode == 0
    missing = await run_cli("exec", "cli-demo", "-c", "1", env=cli_env)
    assert missing.returncode == 1 and "no KernelSession 'cli-demo'" in missing.stderr


async def test_the_rendered_podman_pod_is_what_local_mode_plays_and_plays_by_hand(
    runtime, gateway, make_session, cli_env, tmp_path
) -> None:
    name = await make_session()
    session = await runtime.get(name)
    rendered = await run_cli(
        "render", "-f", "-", "--target", "podman", env=cli_env, stdin=yaml.safe_dump(session.body)
    )
    assert rendered.returncode == 0, rendered.stderr
    played = list(yaml.safe_load_all((runtime._dir(session) / "pod.yaml").read_text()))
    # Played, the pod says which store it belongs to (runtimes/local/orphans.py).
    assert played[0]["metadata"]["labels"].pop(STORE_LABEL) == store_tag(runtime.settings.state_dir)
    assert list(yaml.safe_load_all(rendered.stdout)) == played
    # The same YAML, played by hand with plain podman, gives a kernel the gateway uses.
    await runtime._remove_pod(session)  # it retries what Podman 4.3.1 fails at times
    runtime._unseal(session)  # what local mode does before every start
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(rendered.stdout)
    by_hand = await asyncio.to_thread(
        subprocess.run,
        [
            "podman",
            "kube",
            "play",
            "--network=none",
            f"--seccomp-profile-root={SECCOMP_PROFILE_ROOT}",
            userns_flag(runtime.idmap(session)),
            str(manifest),
        ],
        capture_output=True,
        text=True,
    )
    assert by_hand.returncode == 0, by_hand.stderr
    await runtime.wait_ready(session)
    assert (await gateway.execute(name, "'played by hand'")).status == "ok"


async def test_doctor_checks_the_host(cli_env) -> None:
    # A kernel pod as a gateway before the store label made it: named, with what to do.
    old = f"mcpforge-default-old-{uuid.uuid4().hex[:8]}"
    await podman.run("pod", "create", "--name", old,
                     "--label", "app.kubernetes.io/managed-by=mcp-forge")  # fmt: skip
    try:
        done = await run_cli("doctor", env=cli_env)
    finally:
        await podman.run("pod", "rm", "-f", old, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   a session starts and runs code" in done.stdout
    assert "ok   host-side work on untrusted data runs confined (uid 65534)" in done.stdout
    assert "older than the store label" in done.stdout and old in done.stdout, done.stdout


async def test_a_kernel_cannot_change_its_connection_file_or_swap_its_sockets(
    gateway, runtime, make_session
) -> None:
    name = await make_session()
    facts = await value(
        gateway,
        name,
        "import os, json\n"
        "def attempt(f):\n"
        "    try:\n"
        "        f(); return 'done'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        "print(json.dumps({\n"
        "  'write': attempt(lambda: open('/etc/mcp-forge/connection.json', 'w')),\n"
        "  'remove': attempt(lambda: os.remove('/etc/mcp-forge/connection.json')),\n"
        "  'swap': attempt(lambda: os.remove('/run/mcp-forge/kernel-5555')),\n"
        "  'plant': attempt(lambda: os.symlink('/run/podman', '/run/mcp-forge/x')),\n"
        "  'readable': len(open('/etc/mcp-forge/connection.json').read()) > 0}))",
    )
    assert facts == {
        "write": "OSError",  # read-only file system
        "remove": "OSError",
        "swap": "PermissionError",  # run/ is sealed once the kernel is up
        "plant": "PermissionError",
        "readable": True,
    }
    session = await runtime.get(name)
    conf = Path(runtime.host_paths(session).conf) / "connection.json"
    assert (conf.stat().st_uid, oct(conf.stat().st_mode & 0o777)) == (0, "0o440")
    await gateway.restart(name)
    assert (await gateway.execute(name, "'after restart'")).status == "ok"
