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

from mcp_forge.errors import InvalidRequest, PackageBusy, PackageDenied, PackageNotFound
from mcp_forge.settings import Settings
from mcp_forge.wheels import fetch, index, pip


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
        (["x.tar.gz"], "packages[0] 'x.tar.gz' looks like a file name"),
        (["x-1.0-py3-none-any.whl"], "packages[0] 'x-1.0-py3-none-any.whl' looks like a file"),
        (["X.ZIP"], "packages[0] 'X.ZIP' looks like a file name"),
        (["x.tgz>=1"], "packages[0] 'x.tgz>=1' looks like a file name"),
        (["evil.egg"], "looks like a file name"),
        (["x\n--find-links=/tmp"], "is not a requirement"),
        (["x --no-deps"], "is not a requirement"),
    ],
)
def test_a_bad_requirement_is_refused_by_its_index_before_pip_runs(items, says) -> None:
    with pytest.raises(InvalidRequest, match=None) as caught:
        fetch.parse_requirements(items)
    assert says in str(caught.value)


def test_names_extras_specifiers_and_markers_are_requirements() -> None:
    reqs = fetch.parse_requirements(["msgpack==1.0.8", "Rich[jupyter]>=13; python_version>'3'"])
    assert [r.name for r in reqs] == ["msgpack", "Rich"]


def test_the_policy_compares_normalized_names_and_applies_its_allow_list() -> None:
    policy = fetch.PackagePolicy.of(
        replace(Settings(), packages_deny="Foo_Bar, six", packages_allow="")
    )
    with pytest.raises(PackageDenied, match=r"PackageDenied: 'foo.BAR' is refused: .*deny"):
        policy.check_name("foo.BAR")
    policy.check_name("tabulate")
    only = fetch.PackagePolicy.of(replace(Settings(), packages_allow="tabulate"))
    only.check_name("Tabulate")
    with pytest.raises(PackageDenied, match="not on the gateway's allow list"):
        only.check_name("wcwidth")


def test_the_kernels_tags_take_its_wheels_and_no_others() -> None:
    accepted = fetch.kernel_tags()

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
    program = fetch.path_program(str(tmp_path))
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


def test_pips_environment_holds_none_of_the_hosts_pip_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "PIP_FIND_LINKS": "/opt/wheels", "PIP_INDEX_URL": "http://x", "PIP_CONFIG_FILE": "/x",
        "PYTHONPATH": "/x", "HTTPS_PROXY": "http://proxy:3128", "SSL_CERT_FILE": "/ca.pem",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    env = pip.environment(tmp_path / "h", tmp_path / "t", tmp_path / "c")
    assert env["PIP_CONFIG_FILE"] == "/dev/null"
    assert env["PIP_CACHE_DIR"] == str(tmp_path / "c") and env["HOME"] == str(tmp_path / "h")
    assert "PIP_FIND_LINKS" not in env and "PIP_INDEX_URL" not in env and "PYTHONPATH" not in env
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["SSL_CERT_FILE"] == "/ca.pem"


def test_pip_is_asked_for_wheels_from_the_configured_index_only(tmp_path: Path) -> None:
    policy = fetch.PackagePolicy.of(
        replace(Settings(state_dir=tmp_path), packages_index_url="https://idx.example/simple")
    )
    reqs = fetch.parse_requirements(["tabulate"])
    args = fetch._pip_args(reqs, policy, tmp_path)
    # Not --isolated: it would skip PIP_CONFIG_FILE=/dev/null (and PIP_CACHE_DIR) and
    # still read the global and site pip.conf; the environment is ours instead.
    assert args[0] == "download" and "--isolated" not in args
    assert "--only-binary=:all:" in args
    assert args[args.index("--index-url") + 1] == "https://idx.example/simple"
    assert args[-2:] == ["--", "tabulate"]
    assert "--find-links" not in args
    built = fetch._pip_args(reqs, policy, tmp_path, tmp_path / "built")
    assert built[built.index("--find-links") + 1] == str(tmp_path / "built")
    assert "--only-binary=:all:" in built


def test_an_index_url_that_is_not_http_is_refused(tmp_path: Path) -> None:
    for url in ("file:///srv/wheels", "/srv/wheels", "https://"):
        with pytest.raises(InvalidRequest, match="is not an http"):
            fetch.PackagePolicy.of(replace(Settings(), packages_index_url=url))


def test_installs_past_a_clients_or_the_gateways_bound_are_refused(tmp_path: Path) -> None:
    policy = replace(
        fetch.PackagePolicy.of(Settings(state_dir=tmp_path)),
        installs_max=3,
        client_installs_max=2,
    )
    slots = fetch.Installs()
    with slots.slot(policy, "a"), slots.slot(policy, "a"):
        with (
            pytest.raises(PackageBusy, match="you have 2 installs running"),
            slots.slot(policy, "a"),
        ):
            pass
        with (
            slots.slot(policy, "b"),
            pytest.raises(PackageBusy, match="the gateway is running 3 installs"),
            slots.slot(policy, None),
        ):
            pass
    assert slots.running == 0 and not slots.by_client


def test_the_cache_is_pruned_oldest_first_to_its_bound(tmp_path: Path) -> None:
    import os

    for i in range(5):
        f = tmp_path / "http" / f"{i}.bin"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 1000)
        os.utime(f, (1000 + i, 1000 + i))
    assert pip.prune_cache(tmp_path, 2500) == 2000
    assert sorted(p.name for p in (tmp_path / "http").iterdir()) == ["3.bin", "4.bin"]


def _entry(filename: str, **kw: object) -> dict[str, object]:
    return {"filename": filename, "url": f"/f/{filename}", "hashes": {"sha256": "a" * 64}, **kw}


def test_the_newest_allowed_sdist_is_chosen_from_the_index() -> None:
    files = [
        _entry("pkg-1.0.tar.gz"),
        _entry("pkg-2.0.tar.gz"),
        _entry("pkg-3.0.tar.gz", yanked=True),
        _entry("pkg-2.5.tar.gz", **{"requires-python": ">=3.12"}),
        _entry("pkg-2.1.tar.gz", hashes={}),
        _entry("pkg-2.2-py3-none-any.whl"),
        _entry("other-9.0.tar.gz"),
    ]
    req = fetch.parse_requirements(["pkg"])[0]
    assert index.choose(req, files).filename == "pkg-2.0.tar.gz"
    old = fetch.parse_requirements(["pkg<2"])[0]
    assert index.choose(old, files).filename == "pkg-1.0.tar.gz"
    with pytest.raises(PackageNotFound, match="no wheel and no source distribution"):
        index.choose(fetch.parse_requirements(["pkg>5"])[0], files)


def test_an_html_index_page_is_read_with_hashes_and_yanked_marks() -> None:
    page = (
        '<a href="../../f/pkg-1.0.tar.gz#sha256=' + "b" * 64 + '" data-requires-python="&gt;=3.8">'
        'pkg-1.0.tar.gz</a><a href="pkg-2.0.tar.gz#sha256=' + "c" * 64 + '" data-yanked="">x</a>'
    )
    files = index._html_files(page)
    assert files[0]["filename"] == "pkg-1.0.tar.gz" and files[0]["requires-python"] == ">=3.8"
    assert files[0]["hashes"] == {"sha256": "b" * 64} and not files[0]["yanked"]
    assert files[1]["yanked"]


def test_pips_no_wheel_message_names_the_requirement_to_build() -> None:
    out = "ERROR: No matching distribution found for forgetest-built==1.0\n"
    missing = fetch._missing(out)
    assert missing is not None and str(missing) == "forgetest-built==1.0"
    assert fetch._missing("ERROR: No matching distribution found for x.tar.gz") is None


def test_pips_errors_reach_the_client_without_host_paths() -> None:
    policy = fetch.PackagePolicy.of(Settings())
    output = (
        "Collecting x\nERROR: Could not install packages due to an OSError: [Errno 28] "
        "No space left on device: '/var/lib/mcp-forge/packages/install-ab12/tmp/x.whl'\n"
    )
    message = str(fetch._failure(output, policy))
    assert "/var/lib" not in message and "install-ab12" not in message, message
    assert "No space left on device" in message, message
