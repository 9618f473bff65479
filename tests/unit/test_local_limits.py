"""Local mode's limits as plain functions: inode bounds, container lifetimes, id maps."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_forge.doctor import subordinate_ids
from mcp_forge.runtimes.local.containers import lifetime, podman_time
from mcp_forge.runtimes.local.volumes import MIN_INODES, workspace_inodes


def test_the_inode_bound_grows_with_the_workspace_and_has_a_floor() -> None:
    assert workspace_inodes(2**30) == 32768
    assert workspace_inodes(2**20) == MIN_INODES
    assert workspace_inodes(10 * 2**30) == 10 * 32768


def test_a_containers_lifetime_comes_from_its_start_and_finish_times() -> None:
    start = "2026-11-30T20:35:14.250000000Z"
    assert podman_time("2026-11-30T20:35:15.75Z") - podman_time(start) == pytest.approx(1.5)
    assert podman_time("2026-11-30T20:35:14+00:00") == pytest.approx(
        podman_time("2026-11-30T20:35:14Z")
    )
    info = {
        "State": {"Running": False, "StartedAt": start, "FinishedAt": "2026-11-30T20:35:17.25Z"}
    }
    assert lifetime(info) == pytest.approx(3.0)
    assert lifetime({"State": {"Running": True, "StartedAt": start}}) is None
    assert lifetime(None) is None
    assert lifetime({"State": {"StartedAt": "0001-01-01T00:00:00Z", "FinishedAt": "?"}}) is None


def test_subordinate_ids_are_counted_for_one_user(tmp_path: Path) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("sandbox:100000:65536\ncontainers:2147483647:2147483648\nbad line\n")
    assert subordinate_ids(subuid, "containers") == 2147483648
    assert subordinate_ids(subuid, "nobody") == 0
    assert subordinate_ids(tmp_path / "missing", "containers") == 0
