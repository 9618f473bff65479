"""The node's restore handler's own tests (images/node/runc-restore/*_test.go): what a pod of
a namespace can put in its snapshot claim (links, FIFOs, changed or foreign copies, an
archive that unpacks past its size), against store.go; what a kernel can leave in its
writable layer for a wake to put back (links out of its rootfs, `../` names, hard links
to the node's files, owners outside its pod, devices, set-id bits), against rootfs.go.
Go's, run here so that CI runs them; as root, as the handler runs (its key must be
root's)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HANDLER = Path(__file__).parents[2] / "images" / "node" / "runc-restore"


def go() -> str:
    found = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if found is None:
        pytest.fail("no Go on this machine: images/node/build needs it too (1.25 or later)")
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="the handler runs as root, its key root's")
def test_the_handlers_claim_half_holds_against_what_a_namespace_can_write() -> None:
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    done = subprocess.run(
        [go(), "test", "-count=1", "./..."],
        cwd=HANDLER,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout and "no test files" not in done.stdout, done.stdout
