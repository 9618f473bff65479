"""The nodes' snapshot key placed from a Secret by the overlay's DaemonSet
(manifests/overlays/snapshots/snapshot-key.yaml, control/nodekey.py), on the test node:
a key the restore handler would refuse leaves the node's as it is; a good one is written
as the handler takes it (root's, 0600), and so is the key a rotation replaced, beside
it. Its hostPath is a directory of this test's, not the node's /etc/mcp-forge (the test
node's handler has a key of its own)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from .cluster_common import ROOT
from .conftest import ClusterUnderTest
from .test_install import kubectl
from .test_snapshots import operator_image_on_node

ROOT_REPO = Path(__file__).resolve().parents[2]
PLACER = "mcp-forge-snapshot-key"


def _secret(ns: str, key: str, previous: str | None = None) -> str:
    data = {"snapshot.key": key} | ({"previous.key": previous} if previous else {})
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": PLACER, "namespace": ns},
            "stringData": data,
        }
    )


async def _logged(cluster: ClusterUnderTest, ns: str, text: str) -> str:
    """The placer's log once it says `text` (under a deadline)."""
    deadline = time.monotonic() + 60
    said: subprocess.CompletedProcess[str] | None = None
    while time.monotonic() < deadline:
        said = await asyncio.to_thread(
            subprocess.run,
            [cluster.bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", ns,
             "logs", f"ds/{PLACER}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if text in said.stdout:
            return str(said.stdout)
        await asyncio.sleep(0.5)  # the log has no event to wait on: read again
    raise AssertionError(f"the placer never said {text!r}: {said}")


async def test_the_daemonset_places_the_secrets_key_and_refuses_a_short_one(
    test_cluster: ClusterUnderTest, ns: str
) -> None:
    await operator_image_on_node()
    built = kubectl(test_cluster, "kustomize", str(ROOT_REPO / "manifests/overlays/snapshots"))
    (ds,) = [o for o in yaml.safe_load_all(built) if o and o["metadata"]["name"] == PLACER]
    ds["metadata"]["namespace"] = ns
    pod = ds["spec"]["template"]["spec"]
    host = ROOT / "test-keys" / ns
    (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
    volume["hostPath"]["path"] = str(host)
    args = pod["containers"][0]["args"]
    args[args.index("--every") + 1] = "1"
    node_key = host / "snapshot.key"
    host.mkdir(parents=True, mode=0o700)
    old = secrets.token_hex(32)
    node_key.write_text(old)
    node_key.chmod(0o600)
    # A hostPath and uid 0: more than this test's namespace's "restricted" allows, as the
    # overlay's own namespace for node pods (mcp-forge-node) allows.
    kubectl(test_cluster, "label", "namespace", ns, "--overwrite",
            "pod-security.kubernetes.io/enforce=privileged")  # fmt: skip
    try:
        kubectl(test_cluster, "apply", "-f", "-", input=_secret(ns, "too short"))
        kubectl(test_cluster, "apply", "-f", "-", input=yaml.safe_dump(ds))
        kubectl(test_cluster, "-n", ns, "rollout", "status", f"ds/{PLACER}", "--timeout=60s")
        said = await _logged(test_cluster, ns, "fewer than 32 bytes")
        assert "the node's keys are left as they are" in said, said
        assert node_key.read_text() == old, "a refused key leaves the node's"
        new = secrets.token_hex(32)  # a rotation: the old key kept as the previous
        kubectl(test_cluster, "apply", "-f", "-", input=_secret(ns, new, previous=old))
        # A new pod mounts the Secret as it is now (a running one sees it within the
        # kubelet's sync period).
        kubectl(test_cluster, "-n", ns, "delete", "pod", "-l",
                "app.kubernetes.io/component=snapshot-key", "--wait=false")  # fmt: skip
        said = await _logged(test_cluster, ns, "placed the snapshot key")
        assert new not in said and old not in said, "the key is never logged"
        assert "placed the previous snapshot key" in said, said
        previous = host / "snapshot.key.previous"
        assert node_key.read_text() == new and previous.read_text() == old
        for placed in (node_key, previous):
            st = os.stat(placed)
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), placed
    finally:
        kubectl(test_cluster, "-n", ns, "delete", "daemonset", PLACER, "--ignore-not-found")
        await asyncio.to_thread(shutil.rmtree, host, True)
