"""The gateway process, wired and run: the runtime (local Podman, or the cluster's
KernelSessions), the session service, code mode's upstream servers, the MCP server over
stdio or HTTP with its tokens, and local housekeeping; until stdin closes or a signal
comes, then a cleanup that leaves declared sessions alone (and, on a cluster, every
session, for another replica or the next gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_forge import cpuweight, heap, metrics, tracing
from mcp_forge.api import kernelsession
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.errors import ForgeError, SessionNotFound, UpstreamError
from mcp_forge.gateway.codemode.upstream import UpstreamPool, load_config
from mcp_forge.gateway.core import Gateway
from mcp_forge.gateway.mcp.http import HttpServer, http_app
from mcp_forge.gateway.mcp.server import build_server, serve_stdio
from mcp_forge.gateway.mcp.tasks_kube import KubeTaskStore
from mcp_forge.gateway.mcp.tasks_store import Store, TaskStore
from mcp_forge.gateway.mcp.tokens import load as load_tokens
from mcp_forge.gateway.sessions import NAMESPACE, SessionService
from mcp_forge.image.kernel import image_ref
from mcp_forge.runtimes.local.runtime import LocalRuntime
from mcp_forge.runtimes.local.supervisor import supervise
from mcp_forge.settings import Settings

if TYPE_CHECKING:
    from mcp_forge.runtimes.base import Runtime
    from mcp_forge.runtimes.cluster import KubernetesRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayOptions:
    """How to run the gateway, as `mcp-forge gateway` was told (its options' names)."""

    http: tuple[str, int] | None  # (host, port) to serve HTTP on; None: stdio
    token: str | None  # the one HTTP bearer token (client "default")
    tokens_file: str | None  # HTTP clients: lines of NAME TOKEN
    allowed_origins: tuple[str, ...]  # extra allowed Origins for HTTP
    allowed_hosts: tuple[str, ...]  # extra allowed Host headers for HTTP
    mcp_config: str | None  # code mode: the upstream MCP servers' config file
    mcp_processes_max: int | None  # code mode: the pool's default if None
    kubernetes: bool  # cluster mode
    cull_interval: float  # seconds between local housekeeping passes
    pool: str | None = None  # new sessions claim kernels of this KernelSessionPool
    pool_size: int = 2  # local, without --pool: the size of the gateway's own pool (0: none)
    metrics: tuple[str, int] | None = None  # (host, port) to serve Prometheus metrics on
    # install_packages' policy; None / empty: the settings' (MCPFORGE_PACKAGES_*)
    packages_allow: tuple[str, ...] = ()
    packages_deny: tuple[str, ...] = ()
    packages_max: int | None = None
    packages_file_max: int | None = None
    packages_allow_sdist: bool = False
    packages_index_url: str | None = None

    def settings(self) -> Settings:
        """The settings of the environment, with the package policy these options give."""
        base = Settings.from_env()
        given: dict[str, object] = {}
        if self.packages_allow:
            given["packages_allow"] = ",".join(self.packages_allow)
        if self.packages_deny:
            given["packages_deny"] = ",".join(self.packages_deny)
        if self.packages_max is not None:
            given["packages_max"] = self.packages_max
        if self.packages_file_max is not None:
            given["packages_file_max"] = self.packages_file_max
        if self.packages_allow_sdist:
            given["packages_allow_sdist"] = True
        if self.packages_index_url:
            given["packages_index_url"] = self.packages_index_url
        return replace(base, **given)  # type: ignore[arg-type]


async def serve(options: GatewayOptions, say: Callable[[str], None]) -> None:
    """Run the gateway until its client goes (stdio) or a signal comes; `say` tells the
    person who started it what happens (a line on stderr)."""
    traces = tracing.Tracing()  # when the OTEL_* variables ask for them
    if traces.enabled:
        say("traces: OpenTelemetry, exported by OTLP (the OTEL_* variables)")
    exporter: metrics.MetricsEndpoint | None = None  # first: a port in use changes nothing
    if options.metrics is not None:
        exporter = await metrics.MetricsEndpoint.start(*options.metrics)  # on this loop
        say(f"Prometheus metrics at http://{options.metrics[0]}:{exporter.port}/metrics")
    where = await _realizer(options, say)
    runtime, service = where.runtime, where.service
    configs = load_config(options.mcp_config) if options.mcp_config is not None else {}
    upstreams = UpstreamPool(configs, per_client_max=runtime.settings.mcp_processes_per_client_max)
    if options.mcp_processes_max is not None:
        upstreams.processes_max = options.mcp_processes_max
    service.mcp_servers = set(configs)
    gw = Gateway(runtime, runtime.settings, upstreams=upstreams)

    upstart = asyncio.ensure_future(_connect_upstreams(upstreams, say))
    gauges: asyncio.Future[Any] = asyncio.ensure_future(_nothing())
    if exporter is not None:
        gauges = asyncio.ensure_future(_keep_gauges(runtime, where.local, options.cull_interval))
    server, tasks = build_server(
        service,
        gw,
        transport="stdio" if options.http is None else "http",
        tasks=_task_store(where, options, say),
    )
    # Everything it serves with loaded: out of the collector's way until it ends.
    with heap.settled():
        stop = asyncio.Event()
        signalled = asyncio.Event()
        serving = _front(options, server, runtime, signalled, say)
        housekeeping = _housekeeping(where, options, stop, say)
        ended = asyncio.ensure_future(signalled.wait())
        try:
            await asyncio.wait({serving, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            upstart.cancel()
            gauges.cancel()
            if exporter is not None:
                await exporter.close()
            stop.set()
            await tasks.aclose()
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping
            await _close(where, gw, say)
            await upstreams.close()
            await asyncio.to_thread(traces.close)
            if not serving.done():  # stdio, ended by a signal: its reader thread never returns
                if where.local is not None:  # again: a call cut short may have used it since
                    where.local.store.close()
                sys.stderr.flush()
                os._exit(0)


def _task_store(where: _Realizer, options: GatewayOptions, say: Callable[[str], None]) -> Store:
    """Where an HTTP gateway keeps its clients' tasks. Local: under the state directory,
    by its address, so that the gateway restarted at that address finds them (and no two
    live gateways share them). A cluster: in the API, in the gateway's own namespace, so
    that every replica answers for every task. Stdio clients' tasks end with their
    gateway: kept in memory, as a cluster gateway's are where it has no namespace."""
    if options.http is None:
        return TaskStore()
    if where.local is not None:
        address = f"{options.http[0]}:{options.http[1]}"
        digest = hashlib.sha256(address.encode()).hexdigest()[:16]
        return TaskStore(where.local.settings.state_dir / "tasks" / digest)
    if where.cluster is None:
        return TaskStore()
    namespace = where.cluster.settings.tasks_namespace or _own_namespace()
    if not namespace:
        say("tasks: kept in this process (no namespace: set MCPFORGE_TASKS_NAMESPACE)")
        return TaskStore()
    say(f"tasks: kept in the API, as Secrets in namespace {namespace}")
    heartbeat = where.cluster.settings.task_heartbeat
    return KubeTaskStore(where.cluster.kube, namespace, heartbeat=heartbeat)


def _own_namespace() -> str:
    """The namespace of the pod the gateway runs in, as its service account says."""
    try:
        return OWN_NAMESPACE.read_text().strip()
    except OSError:
        return ""


@dataclass
class _Realizer:
    """The runtime the gateway runs on, as its protocol and as the one it is."""

    runtime: Runtime  # typed as the protocol the gateway sees: mypy checks each against it
    service: SessionService
    cluster: KubernetesRuntime | None = None
    local: LocalRuntime | None = None
    own_pool: str | None = None  # a local pool the gateway made, deleted when it ends


async def _realizer(options: GatewayOptions, say: Callable[[str], None]) -> _Realizer:
    if options.kubernetes:
        from mcp_forge.runtimes.cluster import KubernetesRuntime

        cluster = KubernetesRuntime(options.settings())
        service = SessionService(cluster, cluster.settings, namespace=cluster.namespace)
        service.pool = options.pool  # the operator says, per session, whether it served it
        if options.pool is None:  # each new session: a pool of the namespace that serves it
            service.find_pools = cluster.pools
        return _Realizer(cluster, service, cluster=cluster)
    say(cpuweight.raise_weight())  # threads and children made later follow it
    local = LocalRuntime(options.settings())
    service = SessionService(local, local.settings)
    service.pool, own_pool = await _local_pool(local, options, service.gateway_id, say)
    return _Realizer(local, service, local=local, own_pool=own_pool)


def _front(
    options: GatewayOptions,
    server: Any,
    runtime: Runtime,
    signalled: asyncio.Event,
    say: Callable[[str], None],
) -> asyncio.Future[Any]:
    """MCP over stdio or HTTP, serving until it ends; a signal ends it."""
    loop = asyncio.get_running_loop()
    if options.http is None:
        # The SDK reads stdin in a thread that a cancellation cannot stop, so a signal
        # ends the gateway by itself (in serve), not by cancelling the reader.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled.set)
        return asyncio.ensure_future(serve_stdio(server))
    host, port = options.http
    tokens, source = load_tokens(runtime.settings.state_dir, options.token, options.tokens_file)
    app = http_app(
        server,
        host=host,
        port=port,
        tokens=tokens,
        allowed_origins=list(options.allowed_origins),
        allowed_hosts=options.allowed_hosts,
    )
    # Bound here: clients may connect as soon as the address is printed.
    listener = HttpServer(app, host=host, port=port, grace=runtime.settings.shutdown_grace)
    serving = asyncio.ensure_future(listener.serve())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, listener.stop)
    say(f"MCP over HTTP at http://{host}:{port}/mcp; bearer token from {source}")
    return serving


def _housekeeping(
    where: _Realizer, options: GatewayOptions, stop: asyncio.Event, say: Callable[[str], None]
) -> asyncio.Future[Any]:
    """Locally, the supervisor and the pools' keeper until `stop`; on a cluster the
    operator keeps sessions."""
    if where.cluster is not None:
        say(f"mcp-forge gateway (cluster mode): sessions in namespace {where.cluster.namespace}")
        return asyncio.ensure_future(stop.wait())
    assert where.local is not None
    return asyncio.gather(
        supervise(where.local, stop, interval=options.cull_interval, say=say),
        where.local.pools.keep(stop, interval=options.cull_interval),
    )


async def _close(where: _Realizer, gw: Gateway, say: Callable[[str], None]) -> None:
    if where.cluster is not None:  # sessions outlive a gateway: another replica, or it again
        await gw.close()
        where.cluster.close()
        say("mcp-forge gateway stopped; its sessions keep running")
        return
    assert where.local is not None
    # At once: a stdio client gives its server about 2 s after closing stdin.
    try:
        deleted, _ = await asyncio.gather(
            where.service.cleanup(),
            _delete_pool(where.local, where.own_pool) if where.own_pool else _nothing(),
        )
        await gw.close()
    finally:
        # Its log folded into the database (and the -wal and -shm files gone, unless a
        # command holds the store open too), however the cleanup went.
        where.local.store.close()
    say(f"mcp-forge gateway stopped; deleted {deleted} session(s) it created")


async def _keep_gauges(runtime: Runtime, local: LocalRuntime | None, interval: float) -> None:
    """Set the sessions and pools gauges from what the runtime holds, every `interval`."""
    while True:
        try:
            sessions = await runtime.list()
            metrics.set_sessions(
                str(s.status.get("phase") or st.PENDING)
                for s in sessions
                if ksp.LABEL_POOL not in (s.body["metadata"].get("labels") or {})  # unclaimed
            )
            for pool in local.pools.all() if local is not None else ():
                status = pool.body.get("status") or {}
                for state in ("ready", "starting", "claimed"):
                    value = status.get(state)
                    if isinstance(value, int):
                        metrics.POOL_KERNELS.labels(pool=pool.name, state=state).set(value)
        except ForgeError as exc:
            log.warning("metrics: could not read the sessions: %s", exc)
        await asyncio.sleep(interval)  # a period, not a wait for an event


async def _connect_upstreams(upstreams: UpstreamPool, say: Callable[[str], None]) -> None:
    """Connect the shared upstream servers now, so their first call is fast; one that
    fails is tried again when used."""
    for name in upstreams.configs:
        upstream = upstreams.shared.get(name)
        if upstream is None:  # isolated: started for a session when it needs it
            say(f"upstream MCP server {name}: one per {upstreams.isolation(name)}")
            continue
        try:
            await upstream.connect()
            say(f"upstream MCP server {name}: {len(upstream.tools)} tools")
        except UpstreamError as exc:
            say(f"upstream MCP server {name}: {exc} (tried again when used)")


# On the pool a local gateway makes for itself: which process it belongs to, so that a
# gateway that died without cleaning up has its pool (and the kernels in it) deleted by
# the next one.
_POOL_PROCESS = "mcpforge.dev/gateway-process"
OWN_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


async def _local_pool(
    local: LocalRuntime, options: GatewayOptions, gateway_id: str, say: Callable[[str], None]
) -> tuple[str | None, str | None]:
    """The pool new sessions claim from, and the gateway's own pool if it made one.

    With --pool, that KernelSessionPool, which must exist. Otherwise a pool of
    --pool-size kernels of the default image and resources, named after this gateway,
    filled in the background and deleted when it stops.
    """
    for pool in local.pools.all():
        tag = (pool.body["metadata"].get("annotations") or {}).get(_POOL_PROCESS)
        if isinstance(tag, str) and not _alive(tag):
            say(f"deleting pool {pool.name}, left by a gateway that is gone")
            await _delete_pool(local, pool.name, pool.namespace)
    if options.pool is not None:
        pool = local.pools.get(options.pool, NAMESPACE)  # SessionNotFound names it
        say(f"new sessions claim kernels of pool {pool.name} (size {pool.size})")
        return pool.name, None
    if options.pool_size <= 0:
        return None, None
    name = f"gateway-{gateway_id[:8]}"
    body = {
        "apiVersion": kernelsession.API_VERSION,
        "kind": ksp.KIND,
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "annotations": {_POOL_PROCESS: _process_tag(os.getpid())},
        },
        "spec": {"size": options.pool_size, "template": {"image": image_ref("default")}},
    }
    await local.pools.apply(body, wait=False)  # the keeper fills it
    say(f"keeping {options.pool_size} kernels ready for new sessions (pool {name})")
    return name, name


async def _nothing() -> None:
    return None


async def _delete_pool(local: LocalRuntime, name: str, namespace: str = NAMESPACE) -> None:
    with contextlib.suppress(SessionNotFound):
        await local.pools.delete(name, namespace)


def _process_tag(pid: int) -> str:
    """pid:start time, which names one process even after its pid is reused."""
    return f"{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, after the command's parentheses


def _alive(tag: str) -> bool:
    pid, _, started = tag.partition(":")
    return pid.isdigit() and bool(started) and _start_time(int(pid)) == started
