"""What every kernel pod is, whoever renders it, builds its image or talks to it: the
uid the kernel runs as, where its workspace is mounted, its image's name and the command
that starts it. One definition each; the renderer, the image builder, the gateway and
local mode read them here."""

from __future__ import annotations

from mcp_forge import __version__

KERNEL_UID = 1000  # the kernel's uid and gid inside its pod (the image's `sandbox` user)
WORKSPACE = "/workspace"  # the session's workspace, the kernel's home and working directory
SESSION_VARIABLE = "MCPFORGE_SESSION"  # the kernel's environment names its session
IMAGE_REPOSITORY = "localhost/mcp-forge-kernel"

# ipykernel_launcher, except that the connection file is never written: it is a
# read-only mount (a Secret on clusters), every port in it is fixed, and ipykernel 7.4
# rewrites it whenever it holds Curve keys (it compares its keys, bytes, with the file's
# text, finds them changed, and dies on the read-only file).
KERNEL_LAUNCH = (
    "from ipykernel.kernelapp import IPKernelApp as App; "
    "App.write_connection_file = lambda self, **kw: None; "
    "App.launch_instance()"
)
# -P: the working directory (/workspace, the user's) is not put first on sys.path while
# the launcher starts, so files left there cannot replace ipykernel at the next restart.
KERNEL_CMD = ("python", "-P", "-c", KERNEL_LAUNCH, "-f", "/etc/mcp-forge/connection.json")


def kernel_image(variant: str = "default") -> str:
    """The tag of a variant's kernel image: `localhost/mcp-forge-kernel:0.1.0[-minimal]`."""
    suffix = "" if variant == "default" else f"-{variant}"
    return f"{IMAGE_REPOSITORY}:{__version__}{suffix}"
