"""CRIU as `mcp-forge doctor` finds it: the one runc would run, new enough, and working."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mcp_forge.runtimes.local import criu

BUILT = Path("/usr/local/sbin/criu")  # images/criu/build installs it here (.ci/setup runs it)
BUILT_HERE = BUILT.exists()
DEBIAN = Path("/usr/sbin/criu")
DEBIAN_HERE = DEBIAN.exists()


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("Version: 4.1.1\n", (4, 1, 1)),
        ("Version: 3.17.1\nGitID: v3.17.1\n", (3, 17, 1)),
        ("Version: 4.0\n", (4, 0)),
        ("criu: command not found", None),
    ],
)
def test_the_version_is_read_from_criu_version(text: str, version: tuple[int, ...] | None) -> None:
    assert criu.version_of(text) == version


@pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root")
async def test_the_criu_setup_builds_is_found_first_and_checks_out() -> None:
    if not BUILT_HERE and not os.environ.get("CI"):
        pytest.skip("images/criu/build has not run here")
    assert shutil.which("criu") == str(BUILT)  # ahead of Debian's 3.17 in /usr/sbin
    ok, detail = await criu.probe()
    assert ok, detail
    assert "CRIU 4.2.1" in detail and "looks good" in detail
    version = await asyncio.to_thread(
        subprocess.run, [str(BUILT), "--version"], capture_output=True, text=True
    )
    assert criu.PATCHED in version.stdout, version.stdout  # restore-into-userns.patch


@pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root")
async def test_an_old_criu_is_named_with_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not DEBIAN_HERE:
        pytest.skip("Debian's criu is not installed here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "criu").symlink_to(DEBIAN)
    monkeypatch.setenv("PATH", str(bin_dir))
    ok, detail = await criu.probe()
    assert not ok
    assert "CRIU 3.17" in detail and "4.2 or later" in detail, detail
