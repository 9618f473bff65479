"""The kernel image: its recipe's constants, and real builds with Podman.

The `podman` tests build the images when they are missing or stale (about two
minutes as root the first time; later runs find them up to date in well under a
second) and run real containers from them.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from mcp_forge import __version__
from mcp_forge.clients import podman
from mcp_forge.image.kernel import (
    KERNEL_ENTRYPOINT,
    KERNEL_ENV,
    REQUIREMENTS,
    VARIANTS,
    build_image,
    image_ref,
    image_status,
    inputs_hash,
    missing_image_message,
)
from mcp_forge.sandbox import KERNEL_CMD, KERNEL_UID, WORKSPACE

CONTAINERFILE = Path(__file__).parents[2] / "images" / "Containerfile"


def _containerfile() -> str:
    return CONTAINERFILE.read_text()


# --- the recipe, without containers ---------------------------------------------------


def test_the_containerfile_pins_the_same_requirements_as_the_registry_free_build() -> None:
    cases = re.findall(r'^\s*(\w+)\) reqs="([^"]*)"', _containerfile(), re.MULTILINE)
    pins = {variant: tuple(reqs.split()) for variant, reqs in cases}
    assert pins == REQUIREMENTS


def test_the_containerfile_sets_the_same_env_entrypoint_cmd_user_and_workdir() -> None:
    text = _containerfile()
    env = dict(
        line.removeprefix("ENV ").split("=", 1)
        for line in text.splitlines()
        if line.startswith("ENV ")
    )
    assert env == KERNEL_ENV
    instruction = {
        match[0]: match[1]
        for match in re.findall(r"^(ENTRYPOINT|CMD|USER|WORKDIR) (.*)$", text, re.MULTILINE)
    }
    assert json.loads(instruction["ENTRYPOINT"]) == list(KERNEL_ENTRYPOINT)
    assert json.loads(instruction["CMD"]) == list(KERNEL_CMD)
    assert instruction["USER"] == str(KERNEL_UID)
    assert instruction["WORKDIR"] == WORKSPACE
    assert f"org.opencontainers.image.version={__version__}" in text


def test_each_variant_has_its_own_tag_and_inputs_hash() -> None:
    assert image_ref("default") == f"localhost/mcp-forge-kernel:{__version__}"
    assert image_ref("minimal") == f"localhost/mcp-forge-kernel:{__version__}-minimal"
    assert len({inputs_hash(variant) for variant in VARIANTS}) == len(VARIANTS)


def test_the_missing_image_message_names_the_command_that_builds_it() -> None:
    for variant in VARIANTS:
        assert f"mcp-forge image build --variant {variant}" in missing_image_message(
            image_ref(variant)
        )
    assert "podman pull example.org/kernel:1" in missing_image_message("example.org/kernel:1")


# --- real builds and containers -------------------------------------------------------


async def _run_in(ref: str, *argv: str) -> str:
    """Run a command in a container the way pods run kernels: read-only root, uid 1000."""
    done = await podman.run(
        "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", ref, *argv
    )
    return done.stdout.decode().strip()


@pytest.fixture(scope="module")
async def minimal_image() -> str:
    result = await build_image("minimal", progress=lambda line: None)
    return result.ref


@pytest.mark.podman
async def test_a_build_whose_inputs_are_unchanged_is_skipped(minimal_image: str) -> None:
    lines: list[str] = []
    again = await build_image("minimal", progress=lines.append)
    assert again.ref == minimal_image
    assert not again.built
    assert again.seconds < 5
    assert lines == [f"{minimal_image} is up to date (inputs {inputs_hash('minimal')[:12]})"]
    assert await image_status(minimal_image) == inputs_hash("minimal")


@pytest.mark.podman
async def test_the_status_of_an_image_that_does_not_exist_is_none() -> None:
    assert await image_status("localhost/mcp-forge-kernel:no-such-version") is None


@pytest.mark.podman
async def test_the_minimal_image_runs_as_uid_1000_with_a_python_311_venv(
    minimal_image: str,
) -> None:
    assert await _run_in(minimal_image, "id", "-u") == "1000"
    code = "import ipykernel, os, sys; print(sys.executable, sys.version_info[:2], os.getcwd())"
    out = await _run_in(minimal_image, "python", "-c", code)
    assert out == "/opt/kernel/bin/python (3, 11) /workspace"
    version = await _run_in(minimal_image, "/opt/kernel/bin/python", "--version")
    assert version.startswith("Python 3.11.")


@pytest.mark.podman
async def test_the_minimal_image_starts_its_kernel_under_tini_by_default(
    minimal_image: str,
) -> None:
    done = await podman.run("image", "inspect", minimal_image)
    config = json.loads(done.stdout)[0]["Config"]
    assert config["Entrypoint"] == list(KERNEL_ENTRYPOINT)
    assert config["Cmd"] == list(KERNEL_CMD)
    # The pod renderer passes the same args; tini is PID 1 and the kernel its child.
    ps = "import os; print(open('/proc/1/cmdline').read().split(chr(0))[0])"
    assert await _run_in(minimal_image, "python", "-c", ps) == "/usr/bin/tini"


@pytest.mark.podman
async def test_a_kernel_in_the_default_image_returns_an_inline_figure_as_png() -> None:
    ref = (await build_image("default", progress=lambda line: None)).ref
    script = textwrap.dedent(
        """
        from jupyter_client.manager import start_new_kernel
        km, kc = start_new_kernel(kernel_name="python3")
        outputs = []
        code = "import numpy, pandas, PIL, matplotlib.pyplot as plt; plt.plot([1, 2, 3])"
        reply = kc.execute_interactive(code, output_hook=outputs.append, timeout=60)
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        shown = [m["content"]["data"] for m in outputs if m["msg_type"] == "display_data"]
        print(reply["content"]["status"], *sorted(mime for data in shown for mime in data))
        """
    )
    done = await podman.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--env",
        "JUPYTER_RUNTIME_DIR=/tmp/jupyter",
        ref,
        "python",
        "-c",
        script,
    )
    assert done.stdout.decode().split() == ["ok", "image/png", "text/plain"]
