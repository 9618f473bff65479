"""The nodes' snapshot key placed from a Secret (control/nodekey.py), on real files: what
the restore handler would refuse is never written, the node's key is never lost, and a
key is written whole or not at all."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from mcp_forge.control import nodekey

KEY = b"a" * 64 + b"\n"


def secret(tmp_path: Path, value: bytes, previous: bytes | None = None) -> Path:
    """A key as the kubelet mounts a Secret: a link through ..data (and the previous key
    beside it, if given)."""
    data = tmp_path / "secret" / "..2026_12_07"
    data.mkdir(parents=True)
    (data / "snapshot.key").write_bytes(value)
    (tmp_path / "secret" / "..data").symlink_to("..2026_12_07")
    source = tmp_path / "secret" / "snapshot.key"
    source.symlink_to("..data/snapshot.key")
    if previous is not None:
        (data / "previous.key").write_bytes(previous)
        (tmp_path / "secret" / "previous.key").symlink_to("..data/previous.key")
    return source


def test_the_key_is_placed_as_the_handler_takes_it_and_only_once(tmp_path: Path) -> None:
    source, target = secret(tmp_path, KEY), tmp_path / "etc" / "mcp-forge" / "snapshot.key"
    said = nodekey.place(source, target)
    assert said.startswith("placed the snapshot key ") and KEY.decode().strip() not in said
    st = os.stat(target)
    assert target.read_bytes() == KEY and st.st_mode & 0o777 == 0o600 and st.st_uid == 0
    assert os.stat(target.parent).st_mode & 0o777 == 0o700
    assert nodekey.place(source, target) == "", "a key the node has is not written again"
    assert os.stat(target).st_ino == st.st_ino
    assert [p.name for p in target.parent.iterdir()] == ["snapshot.key"], "no scratch left"


@pytest.mark.parametrize(
    ("value", "why"),
    [(b"short\n", "fewer than 32 bytes"), (b" " * 40, "fewer than 32 bytes"),
     (b"k" * 5000, "larger than 4096 bytes"),
     (b"x" * 31 + "\u00a0".encode(), "not ASCII")],
)  # fmt: skip
def test_a_key_the_handler_would_refuse_leaves_the_nodes_key_as_it_is(
    tmp_path: Path, value: bytes, why: str
) -> None:
    source, target = secret(tmp_path, value), tmp_path / "snapshot.key"
    target.write_bytes(KEY)
    target.chmod(0o600)
    with pytest.raises(nodekey.KeyRefused, match=why):
        nodekey.place(source, target)
    assert target.read_bytes() == KEY


def test_no_key_in_the_secret_leaves_the_nodes_key(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.key"
    target.write_bytes(KEY)
    said = nodekey.place(tmp_path / "absent" / "snapshot.key", target)
    assert "left as they are" in said and target.read_bytes() == KEY


def test_a_link_planted_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"the node's")
    target = tmp_path / "etc" / "snapshot.key"
    target.parent.mkdir()
    target.symlink_to(victim)
    nodekey.place(secret(tmp_path, KEY), target)
    assert victim.read_bytes() == b"the node's"
    assert not target.is_symlink() and target.read_bytes() == KEY


def test_a_key_of_the_wrong_mode_is_written_again(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.key"
    target.write_bytes(KEY)
    target.chmod(0o644)  # the handler refuses it
    assert nodekey.place(secret(tmp_path, KEY), target).startswith("placed")
    assert os.stat(target).st_mode & 0o777 == 0o600


def test_the_loop_places_a_changed_key_and_stops_when_told(tmp_path: Path) -> None:
    source, target = secret(tmp_path, KEY), tmp_path / "snapshot.key"
    stop = threading.Event()
    loop = threading.Thread(
        target=nodekey.run, args=(source, target), kwargs={"every": 0.05, "stop": stop}
    )
    loop.start()
    try:
        new = b"b" * 64
        (tmp_path / "secret" / "..2026_12_07" / "snapshot.key").write_bytes(new)
        for _ in range(200):  # the loop's own rounds, 50 ms apart: up to 10 s
            if target.is_file() and target.read_bytes() == new:
                break
            stop.wait(0.05)
        assert target.read_bytes() == new
    finally:
        stop.set()
        loop.join(timeout=5)
    assert not loop.is_alive()


def test_a_scratch_file_a_killed_placer_left_stops_nothing_and_goes(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.key"
    left = tmp_path / ".snapshot.key.1.new"
    left.write_bytes(b"half")
    os.utime(left, (1, 1))  # long ago
    assert nodekey.place(secret(tmp_path, KEY), target).startswith("placed")
    assert target.read_bytes() == KEY and not left.exists()


OLD = b"o" * 64 + b"\n"


def test_a_rotation_places_the_previous_key_beside_and_removes_it_when_over(
    tmp_path: Path,
) -> None:
    source, target = secret(tmp_path, KEY, previous=OLD), tmp_path / "etc" / "snapshot.key"
    previous = tmp_path / "etc" / "snapshot.key.previous"
    said = nodekey.place(source, target)
    assert "placed the snapshot key" in said and "placed the previous snapshot key" in said
    assert OLD.decode().strip() not in said
    assert target.read_bytes() == KEY and previous.read_bytes() == OLD
    assert os.stat(previous).st_mode & 0o777 == 0o600
    assert nodekey.place(source, target) == "", "keys the node has are not written again"
    for gone in ("previous.key", "..2026_12_07/previous.key"):  # the rotation is over
        (tmp_path / "secret" / gone).unlink()
    said = nodekey.place(source, target)
    assert said.startswith("removed the previous snapshot key ") and not previous.exists()
    assert target.read_bytes() == KEY
    assert nodekey.place(source, target) == ""


def test_a_previous_key_is_never_removed_unless_the_secret_has_a_good_key(
    tmp_path: Path,
) -> None:
    target, previous = tmp_path / "snapshot.key", tmp_path / "snapshot.key.previous"
    for path, value in ((target, KEY), (previous, OLD)):
        path.write_bytes(value)
        path.chmod(0o600)
    nodekey.place(tmp_path / "absent" / "snapshot.key", target)  # no Secret
    with pytest.raises(nodekey.KeyRefused):
        nodekey.place(secret(tmp_path, b"short"), target)
    assert target.read_bytes() == KEY and previous.read_bytes() == OLD


def test_a_refused_previous_key_leaves_the_nodes_and_still_places_the_key(
    tmp_path: Path,
) -> None:
    """A step typed wrong (an empty or short previous.key) loses no stored copy."""
    target, previous = tmp_path / "snapshot.key", tmp_path / "snapshot.key.previous"
    previous.write_bytes(OLD)
    previous.chmod(0o600)
    said = nodekey.place(secret(tmp_path, KEY, previous=b"short"), target)
    assert "placed the snapshot key" in said
    assert "the node's previous key is left as it is" in said and "fewer than 32" in said
    assert target.read_bytes() == KEY and previous.read_bytes() == OLD


def test_both_keys_are_read_from_one_version_of_the_secret(tmp_path: Path) -> None:
    """The kubelet swaps ..data to a new version at an update: the keys placed are one
    version's, even if the link moves between the two reads."""
    source, target = secret(tmp_path, KEY, previous=OLD), tmp_path / "etc" / "snapshot.key"
    pinned = nodekey.one_version(source)
    assert pinned.parent.name == "..2026_12_07"
    newer = tmp_path / "secret" / "..2026_12_08"
    newer.mkdir()
    (newer / "snapshot.key").write_bytes(b"n" * 64)  # a later step: a new key, no previous
    (tmp_path / "secret" / "..data").unlink()
    (tmp_path / "secret" / "..data").symlink_to("..2026_12_08")
    assert nodekey.read_source(pinned) == KEY
    assert nodekey.read_source(nodekey.previous_paths(pinned, target)[0]) == OLD
    said = nodekey.place(source, target)  # now: the newer version, both files of it
    assert target.read_bytes() == b"n" * 64 and "previous" not in said


def test_the_placer_says_what_the_node_holds_at_its_start(tmp_path: Path) -> None:
    source, target = secret(tmp_path, KEY, previous=OLD), tmp_path / "etc" / "snapshot.key"
    assert nodekey.holds(target).startswith("the node holds no snapshot key")
    nodekey.place(source, target)
    said = nodekey.holds(target)
    assert said.startswith(f"the node holds key {nodekey.fingerprint(KEY)}, previous ")
    assert KEY.decode().strip() not in said and OLD.decode().strip() not in said


def test_the_previous_key_is_placed_before_the_key(tmp_path: Path) -> None:
    source, target = secret(tmp_path, KEY, previous=OLD), tmp_path / "snapshot.key"
    said = nodekey.place(source, target)
    assert said.index("placed the previous snapshot key") < said.index("placed the snapshot key")
