"""A source distribution built into a wheel, inside a sandbox container (wheels/sdist.py).

Runs with the kernel image's Python, as its unprivileged user, in a user namespace, with
no network, a read-only root and a bounded /tmp: the sdist and the wheels of its build
requirements are mounted read-only at /in, nothing else of the host is there. Only the
standard library and the image's pip are used.

`python -I -c SOURCE requires /in/NAME.tar.gz` prints {"requires": [...]}: the build
requirements its pyproject.toml names (setuptools for one without). `... build
/in/NAME.tar.gz` builds it with pip, offline, its build requirements taken from /in/deps
only, and writes one JSON line {"wheel": filename, "size": bytes} then the wheel's bytes
to stdout. A failure is one JSON line {"error": message} and exit status 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from typing import Any

SRC = "/tmp/src"
OUT = "/tmp/out"
DEPS = "/in/deps"
LEGACY = ["setuptools>=40.8.0"]  # what pip assumes of a project without pyproject.toml
SECONDS = float(os.environ.get("BUILD_SECONDS", "600"))


class Refused(Exception):
    """The build cannot go on; the message says why."""


def unpack(sdist: str) -> str:
    """The sdist's project directory, unpacked into SRC."""
    os.makedirs(SRC, exist_ok=True)
    if sdist.endswith(".zip"):
        with zipfile.ZipFile(sdist) as z:
            z.extractall(SRC)
    else:
        with tarfile.open(sdist) as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(SRC, filter="data")
            else:  # an older 3.11: no links out of SRC, no special files
                t.extractall(SRC, members=[m for m in t if m.isfile() or m.isdir()])
    tops = [e for e in os.listdir(SRC) if os.path.isdir(os.path.join(SRC, e))]
    if len(tops) != 1:
        raise Refused("the source distribution does not hold exactly one project directory")
    return os.path.join(SRC, tops[0])


def requires(project: str) -> list[str]:
    path = os.path.join(project, "pyproject.toml")
    if not os.path.exists(path):
        return list(LEGACY)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    system = data.get("build-system")
    if not isinstance(system, dict):
        return list(LEGACY)
    found = system.get("requires", [])
    if not isinstance(found, list) or not all(isinstance(r, str) for r in found):
        raise Refused("pyproject.toml's build-system.requires is not a list of strings")
    return [str(r) for r in found]


def build(project: str) -> str:
    """The wheel pip built from `project`, offline, as a path in OUT."""
    os.makedirs(OUT, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--find-links", DEPS,
        "--wheel-dir", OUT, project,
    ]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "PIP_CONFIG_FILE": os.devnull}
    try:
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
            env=env, timeout=SECONDS, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise Refused(f"the build took longer than {SECONDS:.0f}s") from None
    if done.returncode != 0:
        raise Refused(f"pip could not build it (exit {done.returncode}); its output is above")
    wheels = [w for w in os.listdir(OUT) if w.endswith(".whl")]
    if len(wheels) != 1:
        raise Refused(f"the build made {len(wheels)} wheels, not one")
    return os.path.join(OUT, wheels[0])


def main(argv: list[str]) -> int:
    out = sys.stdout.buffer
    try:
        if len(argv) != 2 or argv[0] not in ("requires", "build"):
            raise Refused("usage: requires|build SDIST")
        project = unpack(argv[1])
        if argv[0] == "requires":
            answer: dict[str, Any] = {"requires": requires(project)}
            out.write(json.dumps(answer).encode() + b"\n")
        else:
            wheel = build(project)
            size = os.path.getsize(wheel)
            out.write(json.dumps({"wheel": os.path.basename(wheel), "size": size}).encode() + b"\n")
            with open(wheel, "rb") as f:
                while chunk := f.read(1 << 20):
                    out.write(chunk)
    except (Refused, OSError, ValueError, tarfile.TarError, zipfile.BadZipFile) as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}).encode() + b"\n")
        return 1
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
