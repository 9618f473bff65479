"""The errors MCP-Forge raises, as one small tree.

    ForgeError                  every error of ours; str() is a message for a person
    ├── InvalidSession          a KernelSession that breaks the schema or a rule (names the field)
    ├── InvalidRequest          bad input to an operation: empty code, negative timeout, bad path
    ├── SessionNotFound         no KernelSession of that name
    ├── SessionNotReady         it exists, but its kernel cannot take work now
    ├── SecretError             a Secret a session's env names is missing or unusable
    ├── KernelProtocolError     the kernel sent something we refuse (too large, malformed)
    ├── ImageError              the kernel image is missing or could not be built
    ├── PodmanError             a podman command failed (carries its stderr)
    │   └── PodmanTimeout       one that did not end in time (who held the store's locks)
    ├── ApiError                the Kubernetes API refused a request or was not reached
    ├── UpstreamError           an upstream MCP server was not reached or did not answer
    └── PackageError            install_packages could not give the kernel a package
        ├── PackageNotFound     no distribution of it for the kernel's Python (named)
        ├── PackageDenied       the gateway's package policy refuses it (named)
        ├── PackageTooLarge     over a size limit (the limit and the size)
        └── PackageBusy         too many installs in flight, the client's or the gateway's

Code mode's framing raises kernelside.framing.FrameError, a plain ValueError: that module
runs inside the kernel too, where nothing of ours is installed; bridge.py catches it
where it reads a kernel's frames.

Errors of the *user's code* are never exceptions: they are data in the execution
result (status "error", "timeout", "died", ...).
"""

from __future__ import annotations

import re


class ForgeError(Exception):
    """Base of every MCP-Forge error."""


class InvalidSession(ForgeError):
    """A KernelSession that does not validate; the message names the field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidRequest(ForgeError):
    """Bad input to an operation."""


class SessionNotFound(ForgeError):
    """No KernelSession with that name."""


class SessionNotReady(ForgeError):
    """The session exists but its kernel is not available."""


class SecretError(ForgeError):
    """A Secret (or a key of it) that a session's env takes a value from is missing or
    holds no usable value. The message names the Secret and key, never a value;
    `reason` is the session's status reason (SecretNotFound, InvalidSecret)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KernelProtocolError(ForgeError):
    """The kernel sent something we refuse to accept."""


class ImageError(ForgeError):
    """The kernel image is missing or could not be built."""


class PodmanError(ForgeError):
    """A podman command failed.

    str() reaches clients: it names the command by its first words and says why, with
    host paths left out (`redact`). `detail`, the whole command line and stderr, is for
    the gateway's log only.
    """

    def __init__(self, args: list[str], returncode: int, stderr: str) -> None:
        verb = " ".join(a for a in args[:2] if not a.startswith("-"))
        said = redact(stderr.strip())[-500:]
        super().__init__(f"podman {redact(verb)} failed ({returncode}): {said}")
        self.detail = f"podman {' '.join(args)} failed ({returncode}): {stderr.strip()[-2000:]}"
        self.returncode = returncode
        self.stderr = stderr


class PodmanTimeout(PodmanError):
    """A podman command that did not end in time, killed. `holding`: the processes that
    held a lock of Podman's store when it was (clients/podman_locks.py)."""

    def __init__(self, args: list[str], timeout: float, holding: frozenset[int]) -> None:
        super().__init__(args, -1, f"timed out after {timeout:g}s")
        self.holding = holding


_HOST_PATH = re.compile(r"(?<![\w.~-])/[^\s'\"(),;:]+")


def redact(text: str) -> str:
    """`text` with every absolute path in it replaced by <path>: a client is told what
    went wrong, never where on the host."""
    return _HOST_PATH.sub("<path>", text)


class ApiError(ForgeError):
    """The Kubernetes API refused a request or could not be reached."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API: {status} {reason}: {message}"[:2000])
        self.status = status
        self.reason = reason

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


class UpstreamError(ForgeError):
    """An upstream server could not be reached or did not answer in time."""


class PackageError(ForgeError):
    """A package could not be given to a kernel; the message starts with the kind
    (PackageNotFound: ...), so a model reading only the text knows it."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{type(self).__name__}: {message}")


class PackageNotFound(PackageError):
    """No distribution of a requirement that the kernel's Python can install."""


class PackageDenied(PackageError):
    """The gateway's package policy refuses a distribution (asked for or a dependency)."""


class PackageTooLarge(PackageError):
    """A distribution, or all of them together, is over the policy's size limit."""


class PackageBusy(PackageError):
    """Too many installs in flight: the client's own, or all of the gateway's."""
