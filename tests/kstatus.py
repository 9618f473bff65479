"""What kstatus (sigs.k8s.io/cli-utils, the library Flux and kpt read health with) makes
of objects: tests/kube/kstatus, a small Go program pinned and built once (its build
script caches it)."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

BUILD = Path(__file__).parent / "kube" / "kstatus" / "build"


@functools.cache
def _program() -> str:
    built = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"tests/kube/kstatus/build failed:\n{built.stderr}"
    return built.stdout.strip()


def kstatus(*objs: dict[str, Any]) -> list[str]:
    """kstatus's status of each object: InProgress, Current, Failed, Terminating..."""
    done = subprocess.run(
        [_program()], input=json.dumps(objs), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [v["status"] for v in json.loads(done.stdout)]
