"""The package policy and what the kernel runs, without a network: requirement strings
checked before pip sees them, names compared PEP 503-normalized, the kernel's wheel tags,
and the sys.path program (run in a real interpreter)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from mcp_forge.errors import InvalidRequest, PackageDenied
from mcp_forge.image import packages
from mcp_forge.settings import Settings


@pytest.mark.parametrize(
    ("items", "says"),
    [
        ([], "non-empty list"),
        ("tabulate", "non-empty list"),
        (["tabulate", "--index-url=https://x"], "packages[1] '--index-url=https://x' is not a"),
        (["-e ."], "packages[0] '-e .' is not a requirement"),
        (["/etc/passwd"], "packages[0] '/etc/passwd' is not a requirement"),
        (["x @ file:///tmp/x.whl"], "packages[0] 'x @ file:///tmp/x.whl' names a URL"),
        (["ok", 3], "packages[1] must be a requirement string, got 3"),
        (["a" * 300], "packages[0] is over 200 characters"),
    ],
)
def test_a_bad_requirement_is_refused_by_its_index_before_pip_runs(items, says) -> None:
    with pytest.raises(InvalidRequest, match=None) as caught:
        packages.parse_requirements(items)
    assert says in str(caught.value)


def test_names_extras_specifiers_and_markers_are_requirements() -> None:
    reqs = packages.parse_requirements(["msgpack==1.0.8", "Rich[jupyter]>=13; python_version>'3'"])
    assert [r.name for r in reqs] == ["msgpack", "Rich"]


def test_the_policy_compares_normalized_names_and_applies_its_allow_list() -> None:
    policy = packages.PackagePolicy.of(
        replace(Settings(), packages_deny="Foo_Bar, six", packages_allow="")
    )
    with pytest.raises(PackageDenied, match=r"PackageDenied: 'foo.BAR' is refused: .*deny"):
        policy.check_name("foo.BAR")
    policy.check_name("tabulate")
    only = packages.PackagePolicy.of(replace(Settings(), packages_allow="tabulate"))
    only.check_name("Tabulate")
    with pytest.raises(PackageDenied, match="not on the gateway's allow list"):
        only.check_name("wcwidth")


def test_the_kernels_tags_take_its_wheels_and_no_others() -> None:
    accepted = packages.kernel_tags()

    def fits(name: str) -> bool:
        return bool(parse_wheel_filename(name)[3] & accepted)

    assert fits("msgpack-1.0.8-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert fits("tabulate-0.9.0-py3-none-any.whl")
    assert fits("x-1-cp37-abi3-manylinux_2_28_x86_64.whl")
    assert not fits("msgpack-1.0.8-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert not fits("x-1-cp311-cp311-macosx_11_0_arm64.whl")
    assert not fits("x-1-cp311-cp311-musllinux_1_1_x86_64.whl")


def test_the_path_program_puts_packages_after_the_stdlib_and_imports_at_once(
    tmp_path: Path,
) -> None:
    program = packages.path_program(str(tmp_path))
    script = (
        "import os, sys, json\n"
        f"exec({program!r})\n"  # before the directory exists (a fresh session)
        f"os.makedirs({str(tmp_path / '.packages')!r})\n"
        f"open({str(tmp_path / '.packages' / 'pkg_probe.py')!r}, 'w').write('X = 1')\n"
        f"exec({program!r})\n"  # after an install: once on the path, caches dropped
        "import pkg_probe\n"
        f"at = sys.path.index({str(tmp_path / '.packages')!r})\n"
        "site = [i for i, e in enumerate(sys.path) if e.endswith('site-packages')]\n"
        "stdlib = sys.path.index(os.path.dirname(os.__file__))\n"
        "print(json.dumps([pkg_probe.X, sys.path.count(sys.path[at]), stdlib < at, "
        "not site or at < site[0]]))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[1, 1, true, true]", out.stderr


def test_the_sdist_switch_reads_true_or_false_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MCPFORGE_PACKAGES_ALLOW_SDIST", "true")
    assert Settings.from_env().packages_allow_sdist is True
    monkeypatch.setenv("MCPFORGE_PACKAGES_ALLOW_SDIST", "0")
    assert Settings.from_env().packages_allow_sdist is False
    monkeypatch.setenv("MCPFORGE_PACKAGES_ALLOW_SDIST", "maybe")
    with pytest.raises(InvalidRequest, match="'maybe' is not a boolean"):
        Settings.from_env()
