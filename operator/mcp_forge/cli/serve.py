"""The long-running processes: the gateway (MCP for agents) and the operator (kopf)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from mcp_forge import heap
from mcp_forge.cli.common import main, run
from mcp_forge.errors import ForgeError
from mcp_forge.logsafe import guard_handlers

F = TypeVar("F", bound=Callable[..., Any])


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


# The gateway's options, in the order --help lists them.
_GATEWAY_OPTIONS = (
    click.option(
        "--http",
        "http",
        metavar="[HOST:]PORT",
        default=None,
        help="Serve MCP over streamable HTTP at /mcp (default: stdio).",
    ),
    click.option(
        "--token",
        envvar="MCPFORGE_TOKEN",
        default=None,
        help="Bearer token for HTTP; generated and stored 0600 if not given.",
    ),
    click.option(
        "--tokens-file", default=None, help="HTTP clients: lines of NAME TOKEN, one client each."
    ),
    click.option(
        "--allow-origin",
        "allowed_origins",
        multiple=True,
        help="Extra allowed Origin for HTTP (repeatable).",
    ),
    click.option(
        "--allow-host",
        "allowed_hosts",
        multiple=True,
        help="Extra allowed Host header, e.g. gw.example:8765 (repeatable).",
    ),
    click.option(
        "--mcp-config",
        "mcp_config",
        default=None,
        metavar="FILE",
        help='Code mode: upstream MCP servers ({"mcpServers": {...}}) kernel code may call; '
        'each with "isolation": "client" (stdio default), "session" or "shared" (HTTP default).',
    ),
    click.option(
        "--mcp-processes-max",
        type=click.IntRange(1, 10_000),
        default=None,
        help="Code mode: most upstream server processes started per client or per session, "
        "all together (default 32).",
    ),
    click.option(
        "--kubernetes",
        is_flag=True,
        help="Cluster mode: sessions are KernelSessions in the API, realized by the operator.",
    ),
    click.option(
        "--cull-interval",
        type=float,
        default=10.0,
        show_default=True,
        help="Seconds between housekeeping passes (status, dead kernels, idle culling).",
    ),
    click.option(
        "--pool",
        default=None,
        metavar="NAME",
        help="New sessions claim ready kernels of this KernelSessionPool. Local mode: "
        "`mcp-forge apply` one, the gateway keeps it filled. --kubernetes: the operator keeps "
        "it, in the sessions' namespace; without --pool, each new session claims from a pool "
        "of that namespace whose template serves it (most ready kernels first), if any.",
    ),
    click.option(
        "--pool-size",
        type=click.IntRange(0, 200),
        default=2,
        envvar="MCPFORGE_POOL_SIZE",
        show_default=True,
        help="Local mode, without --pool: kernels of the default image kept ready for new "
        "sessions, in a pool of the gateway's own (deleted when it stops); 0 for none.",
    ),
    click.option(
        "--packages-allow",
        "packages_allow",
        multiple=True,
        metavar="NAME",
        help="install_packages: only these distributions, dependencies included (repeatable; "
        "default: any not denied). Names are compared PEP 503-normalized.",
    ),
    click.option(
        "--packages-deny",
        "packages_deny",
        multiple=True,
        metavar="NAME",
        help="install_packages: never these distributions, asked for or needed (repeatable).",
    ),
    click.option(
        "--packages-max",
        type=click.IntRange(1),
        default=None,
        metavar="BYTES",
        help="install_packages: most bytes one install downloads, all files (default 200 MB).",
    ),
    click.option(
        "--packages-file-max",
        type=click.IntRange(1),
        default=None,
        metavar="BYTES",
        help="install_packages: most bytes of one downloaded file (default 100 MB).",
    ),
    click.option(
        "--packages-allow-sdist",
        is_flag=True,
        help="install_packages: source distributions too, each built into a wheel in a "
        "sandbox container with no network (default: wheels only).",
    ),
    click.option(
        "--packages-index-url",
        "packages_index_url",
        metavar="URL",
        help="install_packages: the only package index used (default https://pypi.org/simple; "
        "the host's pip configuration is never read).",
    ),
    _METRICS_OPTION,
)


def _with(options: tuple[Callable[[F], F], ...]) -> Callable[[F], F]:
    """`options` as decorators, the first one outermost (as if written above each other)."""

    def apply(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


@main.command()
@_with(_GATEWAY_OPTIONS)
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
    run(serve(wanted, say=lambda message: click.echo(message, err=True)))


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
    # Served namespaces named: kopf is told not to list namespaces and CRDs cluster-wide
    # to follow them, which a namespaced Role forbids (overlays/namespace-scoped). Left
    # on, it tried nine times, 55 s, before it served anything.
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = bool(namespaces)
    try:
        # Its handlers and libraries loaded: out of the collector's way until it ends.
        with heap.settled():
            kopf.run(
                settings=settings,
                standalone=True,
                namespaces=list(namespaces),
                clusterwide=not namespaces,
                liveness_endpoint=liveness,
            )
    finally:
        if exporter is not None:
            exporter.close()


@main.command("egress-feeder")
@click.option(
    "--namespace",
    default="mcp-forge-egress",
    show_default=True,
    help="Where the operator writes the sessions' grants (the proxy's own namespace).",
)
@click.option(
    "--control-socket", required=True, help="The egress proxy's control socket (a Unix path)."
)
@click.option("--audit-socket", default=None, help="The proxy's audit socket, to count verdicts.")
@click.option(
    "--ready-file",
    default=None,
    help="Made once the proxy has every grant, removed while it may not (a readiness probe).",
)
@_METRICS_OPTION
def egress_feeder(
    namespace: str,
    control_socket: str,
    audit_socket: str | None,
    ready_file: str | None,
    metrics_at: str | None,
) -> None:
    """Tell a cluster's egress proxy its sessions (run beside it, in its pod).

    Lists and watches the grants (Secrets labelled mcpforge.dev/egress-grant) that the
    operator writes in NAMESPACE and sends each to the proxy (egress/feeder.py).
    """
    from pathlib import Path

    from mcp_forge.clients.kube import Kube
    from mcp_forge.egress import feeder

    exporter = None
    if metrics_at is not None:
        from mcp_forge.metrics import MetricsServer

        host, port = _endpoint(metrics_at, any_port=True)
        exporter = MetricsServer(host, port)
        click.echo(f"Prometheus metrics at http://{host}:{exporter.port}/metrics", err=True)
    try:
        feeder.run(
            Kube(),
            namespace,
            Path(control_socket),
            Path(audit_socket) if audit_socket else None,
            Path(ready_file) if ready_file else None,
        )
    except ForgeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        if exporter is not None:
            exporter.close()


@main.command("snapshot-sweeper")
@click.option(
    "--node",
    envvar="NODE_NAME",
    required=True,
    help="The node this runs on (its archives are the ones swept) [env NODE_NAME].",
)
@click.option(
    "--checkpoints",
    default="/var/lib/kubelet/checkpoints",
    show_default=True,
    help="The kubelet's checkpoints directory, as mounted here.",
)
@click.option("--every", default=60.0, show_default=True, help="Seconds between two rounds.")
@click.option(
    "--grace",
    default=300.0,
    show_default=True,
    help="Seconds an archive no session holds is kept (at least 180: forks made together "
    "share one for 120 s).",
)
@click.option(
    "--namespace",
    envvar="POD_NAMESPACE",
    default="",
    help="Where the node's ConfigMap of snapshot sizes goes ('' = none) [env POD_NAMESPACE].",
)
def snapshot_sweeper(
    node: str, checkpoints: str, every: float, grace: float, namespace: str
) -> None:
    """Remove a node's snapshot archives that no KernelSession holds (run on each node).

    Archives of sessions' kernels in the kubelet's checkpoints directory (control/sweeper.py)
    that no session's status names, once GRACE seconds old. Each removal is logged at
    `--log-level info`. The sizes of the archives sessions hold go to a ConfigMap of
    NAMESPACE, where the operator reads them.
    """
    from pathlib import Path

    from mcp_forge.clients.kube import Kube
    from mcp_forge.control import sweeper

    if every <= 0:
        raise click.BadParameter("--every must be positive")
    if grace < sweeper.GRACE_MIN:
        raise click.BadParameter(
            f"--grace must be at least {sweeper.GRACE_MIN:g} (forks made together share an "
            f"archive for {sweeper.SHARED_REUSE:g} s), got {grace:g}"
        )
    try:
        kube = Kube(manager="mcp-forge-snapshot-sweeper")
        sweeper.run(kube, node, Path(checkpoints), every=every, grace=grace, namespace=namespace)
    except (ForgeError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@main.command("snapshot-key")
@click.option(
    "--source",
    default="/key/snapshot.key",
    show_default=True,
    help="The key as the Secret mcp-forge-snapshot-key is mounted here.",
)
@click.option(
    "--target",
    default="/etc/mcp-forge/snapshot.key",
    show_default=True,
    help="Where the node's restore handler reads it, as mounted here.",
)
@click.option("--every", default=30.0, show_default=True, help="Seconds between two looks.")
def snapshot_key(source: str, target: str, every: float) -> None:
    """Place the nodes' snapshot key from a Secret on this node (run on each node).

    The key that signs snapshots stored in claims (control/nodekey.py): checked as the
    restore handler checks it, written whole (a new file of root's, 0600, renamed over
    the old) when the node lacks it, looked at again every EVERY seconds. A Secret
    without a key, or with one the handler would refuse, leaves the node's key as it is.
    """
    from pathlib import Path

    from mcp_forge.control import nodekey

    if every <= 0:
        raise click.BadParameter("--every must be positive")
    nodekey.run(Path(source), Path(target), every=every)
