"""This host: the kernel image, and the checks of local mode."""

from __future__ import annotations

import sys

import click

from mcp_forge.cli.common import main, run


@main.group()
def image() -> None:
    """The kernel image."""


@image.command("build")
@click.option(
    "--variant",
    type=click.Choice(["minimal", "default", "all"]),
    default="default",
    show_default=True,
)
@click.option("--force", is_flag=True, help="Rebuild even if the image is up to date.")
@click.option(
    "--control-plane",
    is_flag=True,
    help="Build the operator, gateway and egress proxy images "
    "(ghcr.io/mcp-forge/{operator,gateway,egress}) from this checkout instead of a kernel image.",
)
def image_build(variant: str, force: bool, control_plane: bool) -> None:
    """Build localhost/mcp-forge-kernel from Debian packages and wheels (no registry needed)."""
    from mcp_forge.image.control_plane import build_control_plane
    from mcp_forge.image.kernel import VARIANTS, build_image

    def progress(line: str) -> None:
        click.echo(line, err=True)

    async def go() -> None:
        if control_plane:
            results = await build_control_plane(force=force, progress=progress)
        else:
            results = [
                await build_image(v, force=force, progress=progress)
                for v in (VARIANTS if variant == "all" else (variant,))
            ]
        for res in results:
            state = "built" if res.built else "up to date"
            click.echo(f"{res.ref} {state} ({res.seconds:.1f}s)")

    run(go())


@main.command()
def doctor() -> None:
    """Check this host for local mode and print exactly what to fix."""
    from mcp_forge.doctor import run_checks

    ok = run(run_checks(lambda line: click.echo(line)))
    sys.exit(0 if ok else 1)
