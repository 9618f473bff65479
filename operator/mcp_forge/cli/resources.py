"""KernelSessions, KernelSessionPools and Secrets as resources: render, apply, get, delete."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import click
import yaml

from mcp_forge.api import kernelsession
from mcp_forge.cli.common import local, main, read, run
from mcp_forge.errors import ForgeError


def _host_paths(session: kernelsession.KernelSession) -> Any:
    """The host directories of an applied session; placeholders (with a note) otherwise."""
    from mcp_forge.control.render import HostPaths
    from mcp_forge.errors import SessionNotFound
    from mcp_forge.runtimes.local.runtime import LocalRuntime
    from mcp_forge.settings import Settings

    settings = Settings.from_env()
    if settings.store_path.exists():
        rt = LocalRuntime(settings)
        try:
            return rt.host_paths(kernelsession.load(rt.store.get(session.namespace, session.name)))
        except SessionNotFound:
            pass
    click.echo(
        f"note: {session.name} is not applied here, so its host paths are placeholders; "
        "`mcp-forge apply` prepares them (connection file, workspace)",
        err=True,
    )
    base = settings.state_dir / "k" / f"not-applied-{session.name}"
    group = session.spec.shared_group or "none"
    shared = settings.state_dir / "shared" / session.namespace / group
    return HostPaths(str(base / "conf"), str(base / "run"), str(base / "workspace"), str(shared))


@main.command()
@click.option("-f", "--filename", required=True, help="KernelSession YAML file, or - for stdin.")
@click.option(
    "--target", type=click.Choice(["kubernetes", "podman"]), default="kubernetes", show_default=True
)
def render(filename: str, target: str) -> None:
    """Print the manifests a KernelSession becomes."""
    from mcp_forge.api.connection import ConnectionInfo, new_key
    from mcp_forge.api.keys import new_bridge_cert, new_curve_keys
    from mcp_forge.control.render import (
        render_kubernetes,
        render_podman,
        render_workspace_claim,
    )

    try:
        bodies = kernelsession.parse_documents(read(filename))
    except ForgeError as exc:
        click.echo(f"error: {filename}: {exc}", err=True)
        sys.exit(1)
    out: list[dict[str, Any]] = []
    for body in bodies:
        session = kernelsession.load(body)
        if target == "kubernetes":
            keys = new_curve_keys(), new_bridge_cert(f"{session.namespace}/{session.name}")
            out += render_kubernetes(session, ConnectionInfo("tcp", "", new_key(), *keys))
            claim = render_workspace_claim(session)
            out += [claim] if claim is not None else []
        else:
            out += render_podman(session, _host_paths(session))
    click.echo(yaml.safe_dump_all(out, sort_keys=False), nl=False)


@main.command()
@click.option("-f", "--filename", required=True, help="KernelSession YAML file, or - for stdin.")
@click.option(
    "--wait/--no-wait", default=True, show_default=True, help="Wait until the kernel answers."
)
def apply(filename: str, wait: bool) -> None:
    """Create or update KernelSessions, KernelSessionPools and Secrets (v1) (local mode).

    A pool is filled before the command returns (with --wait); a running gateway keeps
    refilling it as its kernels are claimed. A Secret's values are read by sessions
    whose env names them (valueFrom.secretKeyRef) when their kernels start.
    """
    from mcp_forge.api import kernelsessionpool as ksp
    from mcp_forge.api import secret

    try:
        bodies = ksp.parse_resources(read(filename))
    except ForgeError as exc:
        click.echo(f"error: {filename}: {exc}", err=True)
        sys.exit(1)

    async def go() -> None:
        rt = local()
        for body in bodies:
            if body["kind"] == secret.KIND:
                stored, action = rt.secrets.apply(body)
                n = len(stored.keys)
                click.echo(f"secret/{stored.name} {action} ({n} key{'' if n == 1 else 's'})")
                continue
            if body["kind"] == ksp.KIND:
                filled = await rt.pools.apply(body, wait=wait)
                status = filled.pool.body.get("status") or {}
                click.echo(
                    f"kernelsessionpool/{filled.pool.name} {filled.action} "
                    f"({status.get('ready', 0)}/{filled.pool.size} ready, {filled.seconds:.1f}s)"
                )
                continue
            done = await rt.apply(body, wait=wait)
            phase = done.session.status.get("phase", "")
            click.echo(
                f"kernelsession/{done.session.name} {done.action} ({phase}, {done.seconds:.1f}s)"
            )

    run(go())


def _age(ts: str | None) -> str:
    if not ts:
        return "-"
    from mcp_forge.api.status import parse_time

    s = int(time.time() - (parse_time(ts) or time.time()))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


@main.command()
@click.argument("name", required=False)
@click.option("-n", "--namespace", default=None)
@click.option("-o", "--output", type=click.Choice(["table", "yaml", "json"]), default="table")
def get(name: str | None, namespace: str | None, output: str) -> None:
    """Show KernelSessions, with their status checked against Podman (`ks/NAME` for a
    session named like a kind); `secrets` or `secret/NAME`: Secrets, their keys only."""

    from mcp_forge.api import kernelsessionpool as ksp

    kind, _, named = (name or "").rpartition("/")
    if kind in ("secret", "secrets") or (not kind and named in ("secret", "secrets")):
        _get_secrets(named if kind else None, namespace, output)
        return
    if kind in ("ks", "kernelsession", "kernelsessions"):
        name = named

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rt = local()
        if name:
            sessions = [await rt.get(name, namespace or "default")]
        else:  # a pool's unclaimed kernels are counted in its row, not listed
            sessions = [
                s
                for s in await rt.list(namespace)
                if ksp.LABEL_POOL not in (s.body["metadata"].get("labels") or {})
            ]
        # Observe only: a dead kernel is recorded, and restarted by its next use or the gateway.
        found = [(await rt.refresh(s, restart=False)).body for s in sessions]
        return found, [] if name else [p.body for p in rt.pools.all(namespace)]

    bodies, pools = run(go())
    if output == "yaml":
        click.echo(
            yaml.safe_dump(bodies[0] if name else {"items": bodies}, sort_keys=False), nl=False
        )
    elif output == "json":
        click.echo(json.dumps(bodies[0] if name else {"items": bodies}, indent=2))
    else:
        rows = [("NAME", "PHASE", "RESTARTS", "LAST ACTIVITY", "AGE")]
        for b in bodies:
            st = b.get("status", {})
            rows.append(
                (
                    b["metadata"]["name"],
                    st.get("phase", "-"),
                    str(st.get("restarts", 0)),
                    _age(st.get("lastActivity")),
                    _age(b["metadata"].get("creationTimestamp")),
                )
            )
        _table(rows)
        if pools:
            rows = [("POOL", "DESIRED", "READY", "CLAIMED", "AGE")]
            for b in pools:
                st = b.get("status", {})
                rows.append(
                    (
                        b["metadata"]["name"],
                        str(b["spec"]["size"]),
                        str(st.get("ready", 0)),
                        str(st.get("claimed", 0)),
                        _age(b["metadata"].get("creationTimestamp")),
                    )
                )
            click.echo("")
            _table(rows)


def _get_secrets(name: str | None, namespace: str | None, output: str) -> None:
    """Secrets: names, keys and types. Their values are never printed."""

    async def go() -> list[dict[str, Any]]:
        rt = local()
        found = (
            [rt.secrets.get(name, namespace or "default")] if name else rt.secrets.all(namespace)
        )
        return [
            {
                "apiVersion": s.body["apiVersion"],
                "kind": s.body["kind"],
                "metadata": s.body["metadata"],
                "type": s.body.get("type", "Opaque"),
                "keys": s.keys,
            }
            for s in found
        ]

    items = run(go())
    shown: Any = items[0] if name else {"items": items}
    if output == "yaml":
        click.echo(yaml.safe_dump(shown, sort_keys=False), nl=False)
    elif output == "json":
        click.echo(json.dumps(shown, indent=2))
    else:
        rows = [("NAME", "TYPE", "KEYS", "AGE")]
        rows += [
            (
                i["metadata"]["name"],
                i["type"],
                ",".join(i["keys"]) or "-",
                _age(i["metadata"].get("creationTimestamp")),
            )
            for i in items
        ]
        _table(rows)


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def delete(name: str, namespace: str) -> None:
    """Delete a KernelSession, its pod and its files; or, as pool/NAME, a
    KernelSessionPool and its unclaimed kernels (claimed ones stay); or, as secret/NAME,
    a Secret (kernels keep the values they were given) (local mode)."""
    kind, _, pool = name.partition("/")
    if pool and kind in ("pool", "ksp", "kernelsessionpool"):
        deleted = run(local().pools.delete(pool, namespace))
        click.echo(f"kernelsessionpool/{pool} deleted ({deleted} unclaimed kernels)")
        return
    if pool and kind in ("secret", "secrets"):

        async def forget() -> None:
            local().secrets.delete(pool, namespace)

        run(forget())
        click.echo(f"secret/{pool} deleted")
        return
    if pool and kind in ("ks", "kernelsession", "kernelsessions"):
        name = pool
    run(local().delete(name, namespace))
    click.echo(f"kernelsession/{name} deleted")
