"""Which snapshot archives a node's sweeper takes for a session's and which it removes
(control/sweeper.py), over real files. tests/kube/test_snapshots.py runs it as the
DaemonSet of manifests/overlays/snapshots, against the test cluster's kubelet."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mcp_forge.control.sweeper import Archive, archives, sizes, sizes_name, stale

TIME = "2026-12-06T01:02:03Z"
OURS = f"checkpoint-ks-demo_team-kernel-{TIME}.tar"


def test_only_a_sessions_kernel_archives_are_taken_and_never_through_a_link(
    tmp_path: Path,
) -> None:
    names = {
        OURS: True,
        f"checkpoint-ks-a.b_ns-with-kernel-in-it-kernel-{TIME}.tar": True,
        f"checkpoint-web_team-kernel-{TIME}.tar": False,  # not a session's pod
        f"checkpoint-ks-demo_team-sidecar-{TIME}.tar": False,  # not the kernel container
        f"checkpoint-ks-demo_team-kernel-{TIME}.tar.part": False,
        f"checkpoint-ks-demo_Team-kernel-{TIME}.tar": False,
        "notes.txt": False,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 3)
    (tmp_path / "elsewhere").write_bytes(b"precious")
    link = f"checkpoint-ks-link_team-kernel-{TIME}.tar"
    os.symlink(tmp_path / "elsewhere", tmp_path / link)
    (tmp_path / f"checkpoint-ks-dir_team-kernel-{TIME}.tar").mkdir()
    found = archives(tmp_path)
    assert {a.name for a in found} == {n for n, ours in names.items() if ours}
    second = next(a for a in found if a.name != OURS)
    assert (second.pod, second.namespace, second.size) == ("ks-a.b", "ns-with-kernel-in-it", 3)


def _archive(name: str, age: float, now: float) -> Archive:
    return Archive(name, "team", "ks-demo", 10, now - age)


def test_an_archive_no_session_holds_goes_after_its_grace_and_a_held_one_never() -> None:
    now = 1_800_000_000.0
    found = [
        _archive("held-young", 10, now),
        _archive("held-old", 10**7, now),
        _archive("free-young", 10, now),
        _archive("free-old", 1000, now),
        _archive("free-future", -50, now),  # a clock ahead: kept
    ]
    holding = {"held-young", "held-old"}
    assert [a.name for a in stale(found, holding, now, grace=300)] == ["free-old"]
    assert [a.name for a in stale(found, holding, now, grace=0)] == ["free-young", "free-old"]


def test_the_sizes_said_are_those_of_archives_sessions_hold() -> None:
    now = 1_800_000_000.0
    found = [
        Archive("b-held", "team", "ks-b", 2_000_000, now),
        Archive("a-held", "team", "ks-a", 7, now),
        Archive("free", "team", "ks-c", 99, now),
    ]
    said = json.loads(sizes(found, {"a-held", "b-held", "gone-from-the-directory"}))
    assert said == {"a-held": 7, "b-held": 2_000_000}
    assert sizes([], set()) == "{}"


def test_a_nodes_configmap_name_is_a_name_even_for_the_longest_node() -> None:
    assert sizes_name("node-1") == "mcpforge-snapshots-node-1"
    long_a, long_b = "a" * 240 + ".x", "a" * 240 + ".y"
    names = {sizes_name(long_a), sizes_name(long_b)}
    assert len(names) == 2  # cut alike, told apart by the hash
    assert all(len(n) <= 253 and n[-1].isalnum() for n in names)


def test_a_grace_shorter_than_a_batch_of_forks_shares_an_archive_is_refused() -> None:
    """The sweeper's command line (the DaemonSet's args): a grace under GRACE_MIN could
    remove an archive a batch of forks still wakes from (control/forking.py)."""
    from click.testing import CliRunner

    from mcp_forge.cli import main as cli
    from mcp_forge.control.sweeper import GRACE_MIN, SHARED_REUSE

    assert GRACE_MIN >= SHARED_REUSE + 60
    said = CliRunner().invoke(cli, ["snapshot-sweeper", "--node", "n", "--grace", "60"])
    assert said.exit_code == 2 and "--grace must be at least 180" in said.output, said.output
