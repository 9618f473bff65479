"""The images the test cluster's node runs, all imported into its containerd.

Pods pull nothing: images are imported (`cluster import`, from Podman) and the node never
collects them. The images of one static binary (the sandbox's pause image from Debian's
catatonit, CoreDNS, local-path-provisioner's volume-helper) are made with Podman, tagged with
the binary's hash.

Only the standard library: it runs before any virtualenv exists (tests/kube/cluster).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .cluster_common import ROOT, ClusterError, run


def ctr(bins: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    sock = ROOT / "containerd" / "containerd.sock"
    return run(f"{bins}/ctr", f"--address={sock}", "--namespace=k8s.io", *args, **kw)


def catatonit() -> Path:
    return Path(shutil.which("catatonit") or "/usr/libexec/podman/catatonit")


def ensure_pause_image(bins: Path) -> None:
    """The sandbox image: Debian's static catatonit, as Podman's own pause image is made."""
    static_image(bins, static_ref("pause", catatonit()), catatonit(), ["/catatonit", "-P"])


def static_ref(name: str, binary: Path) -> str:
    """The image of one static binary, tagged with the binary's hash (a new build, a new tag)."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:12]
    return f"localhost/mcp-forge-{name}:{digest}"


def static_image(bins: Path, image: str, binary: Path, entrypoint: list[str]) -> None:
    """An image of one static binary, made with Podman (once) and imported into the node."""
    if image in ctr(bins, "images", "ls", "-q").stdout.split():
        return
    if run("podman", "image", "exists", image, check=False).returncode != 0:
        work = ROOT / "image-build"
        shutil.rmtree(work, ignore_errors=True)
        (work / "rootfs").mkdir(parents=True)
        shutil.copy(binary, work / "rootfs" / entrypoint[0].lstrip("/"))
        tar = work / "rootfs.tar"
        run("tar", "-C", str(work / "rootfs"), "--owner=0", "--group=0", "-cf", str(tar), ".")
        change = f"ENTRYPOINT {json.dumps(entrypoint)}"
        run("podman", "import", "--change", change, str(tar), image)
        shutil.rmtree(work, ignore_errors=True)
    import_images(bins, [image])


def volume_helper(bins: Path) -> str:
    """The image of local-path-provisioner's helper pods: volume-helper alone."""
    return static_ref("volume-helper", bins / "volume-helper")


def import_images(bins: Path, images: list[str]) -> None:
    """`podman save` the images into the node's containerd (k8s.io namespace), in one
    archive: the control plane's three share their one layer, saved and unpacked once.

    An image the node already has, imported from the same Podman image ID, is not saved
    and imported again (tens of seconds each for the control plane's). The IDs imported
    are kept under ROOT, which `down` removes with the node's containerd.
    """
    done = ROOT / "imported"
    done.mkdir(parents=True, exist_ok=True)
    listed = ctr(bins, "images", "ls", "-q").stdout.split()
    wanted: dict[str, tuple[Path, str]] = {}
    for image in dict.fromkeys(images):
        image_id = run("podman", "image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
        marker = done / hashlib.sha256(image.encode()).hexdigest()
        if image in listed and marker.is_file() and marker.read_text() == image_id:
            continue
        marker.unlink(missing_ok=True)
        wanted[image] = (marker, image_id)
    if not wanted:
        return
    archive = ROOT / "image.tar"
    # podman refuses to save over a file: one left by an `up` that was killed midway
    # would fail every later one.
    archive.unlink(missing_ok=True)
    try:
        run("podman", "save", "--multi-image-archive", "--format", "docker-archive",
            "-o", str(archive), *wanted)  # fmt: skip
        ctr(bins, "images", "import", "--no-unpack=false", str(archive))
    finally:
        archive.unlink(missing_ok=True)
    listed = ctr(bins, "images", "ls", "-q").stdout.split()
    for image, (marker, image_id) in wanted.items():
        if image not in listed:
            raise ClusterError(f"{image} is not in the node's containerd after import")
        marker.write_text(image_id)
