"""spec.packages: every new kernel of a session has them before it runs the agent's code.

Local mode installs them before the session is Ready; on a cluster the gateway does,
when it connects to a new kernel (the operator does not speak to kernels, and the
kernel has no network), before the first call goes on.

The host resolves and downloads the wheels under the package policy of its settings
(wheels/fetch.py: the gateway's --packages-* flags or MCPFORGE_PACKAGES_*), and the
kernel installs them offline, as install_packages does, over its shell channel only:
each silent execute's reply says how it went (an exception in the kernel is the error).
The wheels are written in chunks beneath the workspace, installed by the kernel's pip
(kernelside/helpers.py `install`), then deleted; a mark in the package directory holds
a digest of spec.packages, so a kernel restarted on the same workspace, which finds
them installed, costs one round trip and no download.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import tempfile
from pathlib import Path

from mcp_forge.api.kernelsession import KernelSession, requirement
from mcp_forge.errors import PackageError, SessionNotReady
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.kernelside import source
from mcp_forge.sandbox import WORKSPACE
from mcp_forge.settings import Settings
from mcp_forge.wheels import fetch

MARK = ".mcp-forge-spec"  # in the package directory: the digest of what was installed
WHEELS = ".mcp-forge/wheels"  # beneath the workspace, emptied by the install
CHUNK = 1_000_000  # bytes of a wheel per execute
STEP_TIMEOUT = 30.0  # one chunk, or the check

# Raises unless the mark holds the digest: the reply's status is the answer.
_CHECK = "assert open(P).read() == K, 'not installed'"
_WRITE = (
    "import base64, os\n"
    "os.makedirs(os.path.dirname(P), exist_ok=True)\n"
    "open(P, 'ab' if A else 'wb').write(base64.b64decode(B))"
)
_INSTALL = (
    "\ninstall(ROOT, A)\n"
    "__import__('os').makedirs(ROOT + '/' + A['target'], exist_ok=True)\n"
    "open(ROOT + '/' + A['target'] + '/' + MARK, 'w').write(K)\n"
)


def digest(session: KernelSession) -> str:
    """What the mark holds for this spec: its requirements, in order."""
    return hashlib.sha256(json.dumps(list(session.spec.packages)).encode()).hexdigest()


async def give_packages(session: KernelSession, conn: KernelConnection, settings: Settings) -> None:
    """Install spec.packages in the session's new kernel, unless its workspace has
    them. PackageError (named, with the policy's reason) if the host cannot get them;
    SessionNotReady if the kernel does not take them."""
    key = digest(session)
    target = f"{WORKSPACE}/{fetch.PACKAGES_DIR}"
    if await _run(conn, _CHECK, {"P": f"{target}/{MARK}", "K": key}, STEP_TIMEOUT) is None:
        return
    policy = fetch.PackagePolicy.of(settings)
    reqs = [requirement(text) for text in session.spec.packages]
    with tempfile.TemporaryDirectory(prefix="mcp-forge-packages-") as tmp:
        wheels = await fetch.download(reqs, policy, Path(tmp))
        for wheel in wheels:
            data = await asyncio.to_thread(wheel.path.read_bytes)
            path = f"{WORKSPACE}/{WHEELS}/{wheel.path.name}"
            for at in range(0, len(data), CHUNK):
                chunk = base64.b64encode(data[at : at + CHUNK]).decode()
                names = {"P": path, "A": at > 0, "B": chunk}
                failed = await _run(conn, _WRITE, names, STEP_TIMEOUT)
                if failed:
                    raise SessionNotReady(f"the kernel could not take {wheel.path.name}: {failed}")
    args = {
        "wheels": WHEELS,
        "target": fetch.PACKAGES_DIR,
        "files": [w.path.name for w in wheels],
        "seconds": policy.timeout,
    }
    program = source("helpers") + _INSTALL + fetch.path_program()
    names = {"ROOT": WORKSPACE, "A": args, "MARK": MARK, "K": key}
    failed = await _run(conn, program, names, policy.timeout + STEP_TIMEOUT)
    if failed:
        raise PackageError(f"the kernel could not install spec.packages: {failed}")


async def _run(
    conn: KernelConnection, code: str, names: dict[str, object], timeout: float
) -> str | None:
    """Run `code` silently in globals of its own holding `names` (Python literals);
    None if it ran, else what it raised. No answer in `timeout` is SessionNotReady."""
    wrapped = f"exec({code!r}, {{'__builtins__': __builtins__, **{names!r}}})"
    msg_id = conn.send_execute(wrapped, silent=True, store_history=False)
    reply = await conn.reply(conn.shell, msg_id, timeout)
    if reply is None:
        raise SessionNotReady(f"the kernel did not answer within {timeout:.0f}s")
    content = reply["content"]
    if content.get("status") == "ok":
        return None
    return f"{str(content.get('ename'))[:100]}: {str(content.get('evalue'))[:500]}"
