"""The `mcp-forge` group and what its commands share: running a coroutine, reading a
file or stdin, local mode's runtime and a gateway core on it."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from mcp_forge import __version__
from mcp_forge.errors import ForgeError
from mcp_forge.logsafe import guard_handlers

if TYPE_CHECKING:
    from mcp_forge.gateway.core import Gateway
    from mcp_forge.runtimes.local.runtime import LocalRuntime

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    except ForgeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


def read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        click.echo(f"error: cannot read {path}: {exc.strerror}", err=True)
        sys.exit(1)


def local() -> LocalRuntime:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    return LocalRuntime()


async def on_gateway(step: Callable[[Gateway], Awaitable[T]]) -> T:
    """`step` on a gateway core of local mode, closed after."""
    from mcp_forge.gateway.core import Gateway

    gw = Gateway(local())
    try:
        return await step(gw)
    finally:
        await gw.close()


@click.group()
@click.version_option(__version__, prog_name="mcp-forge")
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    envvar="MCPFORGE_LOG_LEVEL",
    show_envvar=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def main(log_level: str) -> None:
    """Safe, stateful Python sessions for AI agents."""
    logging.basicConfig(
        stream=sys.stderr,
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    guard_handlers()  # every line one line, bounded (logsafe.py)
