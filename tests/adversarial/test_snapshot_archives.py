"""Snapshot archives read on the host (runtimes/local/snapshots.py `retarget`, as root).

A snapshot holds what the kernel made: its memory in CRIU's images and the files it wrote
outside its volumes. Retargeting one for another pod reads it on the host as root, so each
case here hands `retarget` an archive shaped as an attacker would shape it, and checks
that it is refused with a reason, that nothing is written, and that nothing outside the
output is touched. (The archives live where no kernel can write, root's, 0600; these are
the second line.)
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from mcp_forge.runtimes.local import snapshots

TO = snapshots.Target("p" * 64, "i" * 64, 1, 3_000_000_000, 3_000_000_000, 65536)
CONFIG = {"pod": "a" * 64, "userNsCtr": "b" * 64, "idMappingsOptions": {}}
SPEC: dict[str, object] = {"linux": {"namespaces": [{"type": "user", "path": "/proc/9/ns/user"}]}}


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def archive(path: Path, extra: Callable[[tarfile.TarFile], None], **dumps: bytes) -> Path:
    with tarfile.open(path, "w:") as tar:
        add(tar, "config.dump", dumps.get("config", json.dumps(CONFIG).encode()))
        add(tar, "spec.dump", dumps.get("spec", json.dumps(SPEC).encode()))
        add(tar, "checkpoint/core-1.img", b"\0" * 100)
        extra(tar)
    return path


def listing(path: Path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*"))


def nothing(tar: tarfile.TarFile) -> None:
    pass


CASES = {
    "an entry that climbs out": (lambda t: add(t, "../../etc/cron.d/x", b"* * * * * root id"), {}),
    "an absolute entry": (lambda t: add(t, "/etc/passwd", b"x"), {}),
    "a link to the host's files": (
        lambda t: add(t, "checkpoint/pages-1.img", type=tarfile.SYMTYPE, linkname="/etc/shadow"),
        {},
    ),
    "a hard link": (
        lambda t: add(t, "checkpoint/x", type=tarfile.LNKTYPE, linkname="config.dump"),
        {},
    ),
    "a device": (lambda t: add(t, "checkpoint/mem", type=tarfile.CHRTYPE, devmajor=1), {}),
    "a config.dump past its bound": (nothing, {"config": b" " * (snapshots.DUMP_LIMIT + 1)}),
    "a config.dump that is not JSON": (nothing, {"config": b"{not json"}),
    "a config.dump of no pod": (nothing, {"config": json.dumps({"pod": ""}).encode()}),
}


@pytest.mark.parametrize("case", CASES)
async def test_a_shaped_archive_is_refused_and_nothing_is_written(
    case: str, tmp_path: Path
) -> None:
    extra, dumps = CASES[case]
    src = archive(tmp_path / "in.tar", extra, **dumps)
    dst = tmp_path / "out" / "copy.tar"
    dst.parent.mkdir()
    before, content = listing(tmp_path), src.read_bytes()
    with pytest.raises(snapshots.SnapshotError) as refused:
        await snapshots.retarget(src, dst, TO, limit=1 << 20)
    assert str(refused.value), case
    assert list(dst.parent.iterdir()) == [], f"{case}: {list(dst.parent.iterdir())}"
    assert listing(tmp_path) == before
    # Retargeted in place (a resume's archive): refused the same, the archive unchanged.
    with pytest.raises(snapshots.SnapshotError):
        snapshots.retarget_in_place(src, TO, 1 << 20)
    assert src.read_bytes() == content, case


async def test_an_archive_over_its_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    src = archive(tmp_path / "in.tar", lambda t: add(t, "checkpoint/pages-1.img", b"x" * 4096))
    with pytest.raises(snapshots.SnapshotError, match="over its 1024 limit"):
        await snapshots.retarget(src, tmp_path / "copy.tar", TO, limit=1024)
    assert not (tmp_path / "copy.tar").exists()


async def test_a_plain_archive_is_retargeted_and_its_images_given_to_the_namespace_root(
    tmp_path: Path,
) -> None:
    """The case the refusals stand beside: it goes through, rewritten."""
    src = archive(tmp_path / "in.tar", nothing)
    dst = tmp_path / "copy.tar"
    await snapshots.retarget(src, dst, TO, limit=1 << 20)
    with tarfile.open(dst) as tar:
        image = tar.getmember("checkpoint/core-1.img")
        assert (image.uid, image.gid) == (TO.uid, TO.gid)
        spec = json.loads(tar.extractfile("spec.dump").read())  # type: ignore[union-attr]
        config = json.loads(tar.extractfile("config.dump").read())  # type: ignore[union-attr]
    assert spec["linux"]["namespaces"][0]["path"] == "/proc/1/ns/user"
    assert spec["linux"]["uidMappings"] == [{"containerID": 0, "hostID": TO.uid, "size": 65536}]
    assert config["pod"] == TO.pod_id and config["userNsCtr"] == TO.infra_id
    assert oct(dst.stat().st_mode)[-3:] == "600"


def test_in_place_the_dumps_are_rewritten_padded_and_the_images_folder_opened(
    tmp_path: Path,
) -> None:
    """A resume's archive is retargeted in itself: same size, still a valid archive."""
    src = tmp_path / "in.tar"
    ids = {"container_id": 0, "host_id": TO.uid, "size": TO.size}  # a resume: the same map
    config = {**CONFIG, "idMappingsOptions": {"UIDMap": [ids], "GIDMap": [ids]}}
    mapped = [{"containerID": 0, "hostID": TO.uid, "size": TO.size}]
    spec = {"linux": {**SPEC["linux"], "uidMappings": mapped, "gidMappings": mapped}}  # type: ignore[dict-item]
    with tarfile.open(src, "w:") as tar:  # as Podman writes them: compact JSON
        add(tar, "config.dump", json.dumps(config, separators=(",", ":")).encode())
        add(tar, "spec.dump", json.dumps(spec, separators=(",", ":")).encode())
        add(tar, "checkpoint", type=tarfile.DIRTYPE, mode=0o600)
        add(tar, "checkpoint/core-1.img", b"\0" * 100, mode=0o644)
        add(tar, "checkpoint/descriptors.json", b"[]", mode=0o600)  # runc's: read as root
    size = src.stat().st_size
    assert snapshots.retarget_in_place(src, TO, 1 << 20)
    assert src.stat().st_size == size
    with tarfile.open(src) as tar:  # the checksums hold: tarfile reads every header
        assert tar.getmember("checkpoint").mode == 0o755
        image = tar.getmember("checkpoint/core-1.img")
        assert (image.uid, image.mode) == (0, 0o644)  # root's, readable by the namespace
        got = json.loads(tar.extractfile("config.dump").read())  # type: ignore[union-attr]
        spec = json.loads(tar.extractfile("spec.dump").read())  # type: ignore[union-attr]
    assert got["pod"] == TO.pod_id and got["userNsCtr"] == TO.infra_id
    assert spec["linux"]["namespaces"][0]["path"] == "/proc/1/ns/user"


def test_in_place_gives_way_to_a_copy_when_an_image_is_not_readable(tmp_path: Path) -> None:
    src = tmp_path / "in.tar"
    with tarfile.open(src, "w:") as tar:
        add(tar, "config.dump", json.dumps(CONFIG, separators=(",", ":")).encode())
        add(tar, "spec.dump", json.dumps(SPEC, separators=(",", ":")).encode())
        add(tar, "checkpoint/pages-1.img", b"\0" * 100, mode=0o600)
    content = src.read_bytes()
    assert not snapshots.retarget_in_place(src, TO, 1 << 20)
    assert src.read_bytes() == content
