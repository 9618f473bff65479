"""A session's kernel: exec, interrupt, restart, suspend, resume, fork, export."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click

from mcp_forge.api import forks
from mcp_forge.cli.common import local, main, on_gateway, run


@main.command("exec")
@click.argument("name")
@click.option("-c", "--code", help="Code to run; without it, read from stdin.")
@click.option("-n", "--namespace", default="default")
@click.option("--timeout", type=float, default=None, help="Seconds before the code is interrupted.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def exec_(
    name: str, code: str | None, namespace: str, timeout: float | None, as_json: bool
) -> None:
    """Run code in a session's kernel; variables persist between calls."""
    from mcp_forge.gateway.core import Gateway

    source = code if code is not None else sys.stdin.read()

    async def go() -> Any:
        gw = Gateway(local())
        task = asyncio.ensure_future(gw.execute(name, source, timeout=timeout, namespace=namespace))
        loop = asyncio.get_running_loop()
        # Going away (Ctrl-C, kill, a closed terminal) interrupts the code first.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            click.echo("error: cancelled; the code was interrupted", err=True)
            sys.exit(130)
        finally:
            await gw.close()

    result = run(go())
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.result is not None:
            click.echo(result.result["data"].get("text/plain", ""))
        for d in result.displays:
            kinds = ", ".join(d["data"])
            click.echo(f"[display: {kinds}]")
        if result.error is not None:
            click.echo("\n".join(result.error.traceback), err=True)
        if result.message:
            click.echo(f"[{result.status}] {result.message}", err=True)
    sys.exit(0 if result.status == "ok" else 1)


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def interrupt(name: str, namespace: str) -> None:
    """Interrupt the code a session's kernel is running; variables are kept."""
    acked = run(on_gateway(lambda gw: gw.interrupt(name, namespace=namespace)))
    click.echo(f"kernelsession/{name} interrupted" if acked else f"kernelsession/{name}: no answer")
    sys.exit(0 if acked else 1)


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def restart(name: str, namespace: str) -> None:
    """Restart a session's kernel: variables are cleared, workspace files kept."""
    run(on_gateway(lambda gw: gw.restart(name, namespace=namespace)))
    click.echo(f"kernelsession/{name} restarted")


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def suspend(name: str, namespace: str) -> None:
    """Suspend a session now, with its kernel's memory; it resumes when used again."""
    session = run(local().nap(name, namespace))
    taken = session.status.get("snapshot") or {}
    kept = f"{taken['size'] / 1e6:.0f} MB kept" if taken else str(session.status.get("message"))
    click.echo(f"kernelsession/{name} suspended ({kept})")


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def resume(name: str, namespace: str) -> None:
    """Resume a session suspended for idleness or by `suspend` (its memory restored)."""
    runtime = local()
    session = run(runtime.get(name, namespace))
    if session.status.get("phase") != "Suspended" or session.status.get("reason") != "Idle":
        click.echo(
            f"error: kernelsession/{name} is {session.status.get('phase')} "
            f"({session.status.get('reason')}); only an idle or `suspend`ed one resumes "
            "(operatingMode Suspended: apply Running)",
            err=True,
        )
        sys.exit(1)
    session = run(runtime.refresh(session))
    click.echo(
        f"kernelsession/{name} {session.status.get('phase')}: {session.status.get('message')}"
    )


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
@click.option(
    "--count", type=click.IntRange(1, forks.FORK_MAX), default=None, help="How many copies (1)."
)
@click.option(
    "--name", "names", multiple=True, help="A copy's name, once per copy (else NAME-fork-XXXXXX)."
)
def fork(name: str, namespace: str, count: int | None, names: tuple[str, ...]) -> None:
    """Copy a Ready session: each copy is a session of its own that starts with its
    kernel's memory (variables, imports, open files) and its files, then goes its own way."""
    from mcp_forge.gateway.sessions import CLIENTS, OWNER  # not at import: the operator's CLI

    if names and count is not None and count != len(names):
        raise click.UsageError(f"--count {count} but {len(names)} --name given")
    runtime = local()
    parent = run(runtime.get(name, namespace))
    kept = {  # whose it is and who may use it; a copy is no gateway's, no default session
        k: v
        for k, v in (parent.body["metadata"].get("annotations") or {}).items()
        if k in (OWNER, CLIENTS)
    }
    wanted = list(names) or forks.names(name, count or 1)
    made = run(
        runtime.fork(name, namespace, [forks.body(parent, n, annotations=kept) for n in wanted])
    )
    failed = False
    for child in made:
        status = child.status
        restore = status.get("lastRestore") or {}
        if restore.get("outcome") == "Restored":
            seconds = restore.get("seconds")
            click.echo(f"kernelsession/{child.name} forked from {name} ({seconds} s)")
        else:
            failed = True
            click.echo(
                f"error: kernelsession/{child.name} is {status.get('phase')}, not a copy: "
                f"{status.get('message')}",
                err=True,
            )
    if failed:
        sys.exit(1)


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
@click.option(
    "-o", "--output", default=None, help="The .ipynb file to write (NAME.ipynb); - for stdout."
)
def export(name: str, namespace: str, output: str | None) -> None:
    """Write every cell run in a session so far as a Jupyter notebook (nbformat 4)."""
    nb = run(on_gateway(lambda gw: gw.export_notebook(name, namespace=namespace)))
    if output == "-":
        sys.stdout.write(nb.text)
        return
    target = Path(output or f"{name}.ipynb")
    try:
        target.write_text(nb.text)
    except OSError as exc:
        click.echo(f"error: cannot write {target}: {exc.strerror}", err=True)
        sys.exit(1)
    skipped = f" ({nb.skipped} malformed record(s) left out)" if nb.skipped else ""
    click.echo(f"kernelsession/{name}: {nb.cells} cell(s) written to {target}{skipped}")
