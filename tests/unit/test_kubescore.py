"""kube-score (tests/kube/kubescore: pinned, built from source by its build script, as
.ci/setup-tests does) over every kustomization of the install: its default checks, but
those tests/kube/kubescore/accepted.yaml ignores by design, each with its reason. It
stands in for kube-linter, which the Go module proxy here does not serve."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from manifests_support import INSTALLS, build

HERE = Path(__file__).parents[1] / "kube" / "kubescore"
ACCEPTED = yaml.safe_load((HERE / "accepted.yaml").read_text())


@functools.cache
def _program() -> str:
    built = subprocess.run([str(HERE / "build")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"tests/kube/kubescore/build failed:\n{built.stderr}"
    return built.stdout.strip()


def score(text: str, *, ignored: list[str]) -> tuple[int, list[str]]:
    """kube-score's exit code and its findings (no OK, no skipped) over `text`."""
    args = [f"--ignore-test={check}" for check in ignored]
    done = subprocess.run(
        [_program(), "score", "-", "--output-format", "ci", *args, *ACCEPTED["flags"]],
        input=text, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("[") and not line.startswith(("[OK]", "[SKIPPED]"))
    ]
    return done.returncode, found


def manifest_of(name: str) -> str:
    return "\n---\n".join(json.dumps(o) for o in build(name))


@pytest.mark.parametrize("name", INSTALLS)
def test_every_install_passes_kube_score_but_what_is_accepted_with_a_reason(name: str) -> None:
    code, found = score(manifest_of(name), ignored=list(ACCEPTED["ignored"]))
    critical = [f for f in found if f.startswith("[CRITICAL]")]
    assert code == 0 and not critical, "\n".join(found)
    assert all(str(why).strip() for why in ACCEPTED["ignored"].values())


def test_each_accepted_check_is_still_needed() -> None:
    """An accepted check no manifest fails any more comes off the list: run without it."""
    objs = manifest_of("base")
    for check in ACCEPTED["ignored"]:
        rest = [c for c in ACCEPTED["ignored"] if c != check]
        code, found = score(objs, ignored=rest)
        assert code != 0, f"{check} no longer fails: take it off accepted.yaml ({found})"
