"""The `mcp-forge` command line. A thin adapter: it parses, calls the core, and prints."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import yaml

from mcp_forge import __version__
from mcp_forge.api import kernelsession
from mcp_forge.errors import ForgeError
from mcp_forge.logsafe import guard_handlers

if TYPE_CHECKING:
    from mcp_forge.gateway.core import Gateway
    from mcp_forge.runtimes.local.runtime import LocalRuntime

T = TypeVar("T")
log = logging.getLogger("mcp_forge")


def _run(coro: Awaitable[T]) -> T:
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    except ForgeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        click.echo(f"error: cannot read {path}: {exc.strerror}", err=True)
        sys.exit(1)


def _local() -> LocalRuntime:
    from mcp_forge.runtimes.local.runtime import LocalRuntime

    return LocalRuntime()


async def _on_gateway(step: Callable[[Gateway], Awaitable[T]]) -> T:
    """`step` on a gateway core of local mode, closed after."""
    from mcp_forge.gateway.core import Gateway

    gw = Gateway(_local())
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
        bodies = kernelsession.parse_documents(_read(filename))
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
        bodies = ksp.parse_resources(_read(filename))
    except ForgeError as exc:
        click.echo(f"error: {filename}: {exc}", err=True)
        sys.exit(1)

    async def go() -> None:
        rt = _local()
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

    _run(go())


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
        rt = _local()
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

    bodies, pools = _run(go())
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
        rt = _local()
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

    items = _run(go())
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
        deleted = _run(_local().pools.delete(pool, namespace))
        click.echo(f"kernelsessionpool/{pool} deleted ({deleted} unclaimed kernels)")
        return
    if pool and kind in ("secret", "secrets"):

        async def forget() -> None:
            _local().secrets.delete(pool, namespace)

        _run(forget())
        click.echo(f"secret/{pool} deleted")
        return
    if pool and kind in ("ks", "kernelsession", "kernelsessions"):
        name = pool
    _run(_local().delete(name, namespace))
    click.echo(f"kernelsession/{name} deleted")


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
        gw = Gateway(_local())
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

    result = _run(go())
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
    acked = _run(_on_gateway(lambda gw: gw.interrupt(name, namespace=namespace)))
    click.echo(f"kernelsession/{name} interrupted" if acked else f"kernelsession/{name}: no answer")
    sys.exit(0 if acked else 1)


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
def restart(name: str, namespace: str) -> None:
    """Restart a session's kernel: variables are cleared, workspace files kept."""
    _run(_on_gateway(lambda gw: gw.restart(name, namespace=namespace)))
    click.echo(f"kernelsession/{name} restarted")


@main.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default")
@click.option(
    "-o", "--output", default=None, help="The .ipynb file to write (NAME.ipynb); - for stdout."
)
def export(name: str, namespace: str, output: str | None) -> None:
    """Write every cell run in a session so far as a Jupyter notebook (nbformat 4)."""
    nb = _run(_on_gateway(lambda gw: gw.export_notebook(name, namespace=namespace)))
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
    help="Build the operator and gateway images (ghcr.io/mcp-forge/{operator,gateway}) "
    "from this checkout instead of a kernel image.",
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

    _run(go())


@main.command()
def doctor() -> None:
    """Check this host for local mode and print exactly what to fix."""
    from mcp_forge.doctor import run_checks

    ok = _run(run_checks(lambda line: click.echo(line)))
    sys.exit(0 if ok else 1)


def _endpoint(value: str, *, any_port: bool = False) -> tuple[str, int]:
    """[HOST:]PORT as (host, port), host 127.0.0.1 if not given; port 0 (a free port,
    which the command then prints) only if `any_port`."""
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        number = int(port)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not [HOST:]PORT") from None
    if not (0 if any_port else 1) <= number < 65536:
        raise click.BadParameter(f"port {number} is out of range")
    return host or "127.0.0.1", number


# --metrics, of the gateway and of the operator.
_METRICS_OPTION = click.option(
    "--metrics",
    "metrics_at",
    metavar="[HOST:]PORT",
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (host: 127.0.0.1; port 0: "
    "any free one, printed).",
)


@main.command()
@click.option(
    "--http",
    "http",
    metavar="[HOST:]PORT",
    default=None,
    help="Serve MCP over streamable HTTP at /mcp (default: stdio).",
)
@click.option(
    "--token",
    envvar="MCPFORGE_TOKEN",
    default=None,
    help="Bearer token for HTTP; generated and stored 0600 if not given.",
)
@click.option(
    "--tokens-file", default=None, help="HTTP clients: lines of NAME TOKEN, one client each."
)
@click.option(
    "--allow-origin",
    "allowed_origins",
    multiple=True,
    help="Extra allowed Origin for HTTP (repeatable).",
)
@click.option(
    "--allow-host",
    "allowed_hosts",
    multiple=True,
    help="Extra allowed Host header, e.g. gw.example:8765 (repeatable).",
)
@click.option(
    "--mcp-config",
    "mcp_config",
    default=None,
    metavar="FILE",
    help='Code mode: upstream MCP servers ({"mcpServers": {...}}) kernel code may call; '
    'each with "isolation": "client" (stdio default), "session" or "shared" (HTTP default).',
)
@click.option(
    "--mcp-processes-max",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Code mode: most upstream server processes started per client or per session, "
    "all together (default 32).",
)
@click.option(
    "--kubernetes",
    is_flag=True,
    help="Cluster mode: sessions are KernelSessions in the API, realized by the operator.",
)
@click.option(
    "--cull-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between housekeeping passes (status, dead kernels, idle culling).",
)
@click.option(
    "--pool",
    default=None,
    metavar="NAME",
    help="New sessions claim ready kernels of this KernelSessionPool. Local mode: "
    "`mcp-forge apply` one, the gateway keeps it filled. --kubernetes: the operator keeps "
    "it, in the sessions' namespace; without --pool, each new session claims from a pool "
    "of that namespace whose template serves it (most ready kernels first), if any.",
)
@click.option(
    "--pool-size",
    type=click.IntRange(0, 200),
    default=2,
    envvar="MCPFORGE_POOL_SIZE",
    show_default=True,
    help="Local mode, without --pool: kernels of the default image kept ready for new "
    "sessions, in a pool of the gateway's own (deleted when it stops); 0 for none.",
)
@click.option(
    "--packages-allow",
    "packages_allow",
    multiple=True,
    metavar="NAME",
    help="install_packages: only these distributions, dependencies included (repeatable; "
    "default: any not denied). Names are compared PEP 503-normalized.",
)
@click.option(
    "--packages-deny",
    "packages_deny",
    multiple=True,
    metavar="NAME",
    help="install_packages: never these distributions, asked for or needed (repeatable).",
)
@click.option(
    "--packages-max",
    type=click.IntRange(1),
    default=None,
    metavar="BYTES",
    help="install_packages: most bytes one install downloads, all files (default 200 MB).",
)
@click.option(
    "--packages-file-max",
    type=click.IntRange(1),
    default=None,
    metavar="BYTES",
    help="install_packages: most bytes of one downloaded file (default 100 MB).",
)
@click.option(
    "--packages-allow-sdist",
    is_flag=True,
    help="install_packages: source distributions too, each built into a wheel in a "
    "sandbox container with no network (default: wheels only).",
)
@click.option(
    "--packages-index-url",
    "packages_index_url",
    metavar="URL",
    help="install_packages: the only package index used (default https://pypi.org/simple; "
    "the host's pip configuration is never read).",
)
@_METRICS_OPTION
def gateway(http: str | None, metrics_at: str | None, **options: Any) -> None:
    """Run the gateway: MCP for agents.

    Local mode (the default) also keeps sessions true (housekeeping). Over stdio it
    serves one client until stdin closes; on exit (stdin EOF, SIGINT, SIGTERM) it
    deletes the sessions it created for clients; declared sessions are left alone.

    With --kubernetes, sessions are KernelSessions in the cluster (in
    MCPFORGE_SESSION_NAMESPACE, default mcp-forge-sessions) and the operator keeps
    them; the gateway holds no state, so sessions outlive it and any replica serves them.
    """
    from mcp_forge.gateway.serve import GatewayOptions, serve

    endpoint = _endpoint(http) if http is not None else None
    scraped = _endpoint(metrics_at, any_port=True) if metrics_at is not None else None
    # The other options as they are, by name: GatewayOptions's fields are named after them.
    wanted = GatewayOptions(http=endpoint, metrics=scraped, **options)
    _run(serve(wanted, say=lambda message: click.echo(message, err=True)))


@main.command()
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Serve KernelSessions of this namespace only (repeatable). Default: all namespaces.",
)
@click.option(
    "--liveness", default=None, help="Serve a liveness probe, e.g. http://0.0.0.0:8080/healthz."
)
@click.option(
    "--all-namespaces",
    "-A",
    "all_namespaces",
    is_flag=True,
    help="Serve KernelSessions of every namespace (the default without --namespace).",
)
@_METRICS_OPTION
@click.option("--verbose", "-v", is_flag=True, help="Log every handler kopf runs.")
def operator(
    namespaces: tuple[str, ...],
    liveness: str | None,
    all_namespaces: bool,
    metrics_at: str | None,
    verbose: bool,
) -> None:
    """Run the Kubernetes operator (kopf): KernelSessions become kernel pods.

    One replica (standalone: no peering). Also runnable as
    `kopf run --standalone -m mcp_forge.control.handlers`.
    """
    import kopf

    from mcp_forge.control import handlers  # noqa: F401  (registers the handlers)

    if all_namespaces and namespaces:
        raise click.UsageError("--all-namespaces and --namespace exclude each other")

    kopf.configure(verbose=verbose)
    guard_handlers()  # kopf's handler too
    exporter = None
    if metrics_at is not None:
        from mcp_forge.metrics import MetricsServer

        host, port = _endpoint(metrics_at, any_port=True)
        try:
            exporter = MetricsServer(host, port)
        except ForgeError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        click.echo(f"Prometheus metrics at http://{host}:{exporter.port}/metrics", err=True)
    try:
        kopf.run(
            standalone=True,
            namespaces=list(namespaces),
            clusterwide=not namespaces,
            liveness_endpoint=liveness,
        )
    finally:
        if exporter is not None:
            exporter.close()
