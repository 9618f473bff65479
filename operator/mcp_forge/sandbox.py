"""What every kernel pod is, whoever renders it, builds its image or talks to it: the
uid the kernel runs as, where its workspace is mounted, and its image's name. One
definition each; render.py, image.py, the gateway and local mode read them here."""

from __future__ import annotations

from . import __version__

KERNEL_UID = 1000  # the kernel's uid and gid inside its pod (the image's `sandbox` user)
WORKSPACE = "/workspace"  # the session's workspace, the kernel's home and working directory
IMAGE_REPOSITORY = "localhost/mcp-forge-kernel"


def kernel_image(variant: str = "default") -> str:
    """The tag of a variant's kernel image: `localhost/mcp-forge-kernel:0.1.0[-minimal]`."""
    suffix = "" if variant == "default" else f"-{variant}"
    return f"{IMAGE_REPOSITORY}:{__version__}{suffix}"
