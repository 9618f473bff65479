"""The gateway's side of a cluster: KernelSessions through the Kubernetes API.

The operator realizes sessions; this only reads them, creates and deletes them for
agents, and reports activity on each session's Lease. Everything it needs is in the API
(status.connection plus the Secret it names), so a gateway holds no store: a restarted
replica, or a second one, reaches every running kernel as the first did.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from mcp_forge.api import kernelsession, quota
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.api.connection import (
    BRIDGE_PORT,
    Address,
    ConnectionInfo,
    connection_from_file,
)
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.secret import load as load_secret
from mcp_forge.api.status import Termination
from mcp_forge.clients.kube import (
    BUSY_PREFIX,
    RESTART,
    Kube,
    connection_file_of,
    key_of,
    secret_env,
)
from mcp_forge.control import render_egress
from mcp_forge.control.render import child_name, secret_name
from mcp_forge.egress.kernel import proxy_program
from mcp_forge.egress.protocol import token_for
from mcp_forge.errors import (
    ApiError,
    InvalidSession,
    KernelProtocolError,
    SecretError,
    SessionNotFound,
    SessionNotReady,
)
from mcp_forge.jupyter.client import KernelConnection
from mcp_forge.runtimes import cluster_forks, cluster_watch, spec_packages
from mcp_forge.settings import Settings

log = logging.getLogger(__name__)

KIND = "KernelSession"
DEFAULT_NAMESPACE = "mcp-forge-sessions"
WATCH_CHUNK = 5.0  # a watch thread outlives a cancelled wait by at most this
WATCHERS = 16  # waits at once
BUSY_LEASE = 3  # a busy mark lasts this many renew intervals unless renewed
# Shared by replicas (api/quota.py): a client's reservations, on a Lease of its own
# (QUOTA_LEASE + a hash of the owner); a session's call rates, on its activity Lease.
QUOTA_LEASE = "mcpforge-quota-"
RESERVATIONS = "mcpforge.dev/reservations"
RATES = "mcpforge.dev/call-rates"
CAS_TRIES = 20  # writes that lost a race to another writer, then the error is raised
RATE_LEASES_MAX = 1024  # sessions' Leases remembered for code mode's rates


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubernetesRuntime:
    """The Runtime protocol (runtimes/base.py) on a cluster run by `mcp-forge operator`."""

    def __init__(self, settings: Settings | None = None, kube: Kube | None = None) -> None:
        self.settings = settings or Settings.from_env()
        if self.settings.kube_connect not in ("service", "pod-ip"):
            raise InvalidSession(
                f"MCPFORGE_KUBE_CONNECT must be service or pod-ip, got "
                f"{self.settings.kube_connect!r}"
            )
        self.kube = kube or Kube(manager="mcp-forge-gateway")
        self.namespace = self.settings.session_namespace or DEFAULT_NAMESPACE
        # Who marks a session busy: this process (two replicas, or two gateways on one host,
        # must not clear each other's marks). An annotation name: <= 63 of [A-Za-z0-9-_.].
        who = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        self.identity = re.sub(r"[^A-Za-z0-9_.-]", "-", who)[:63].strip("-_.") or "gateway"
        self._renewed: dict[tuple[str, str], tuple[float, bool]] = {}
        # Code mode's rates: each session's Lease as this gateway last wrote it.
        self._rate_leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._lease_delete_refused = False  # then kept, and not asked again
        # Waits block a thread on a watch: their own threads, so a burst of creates never
        # starves the other API calls (which use the default executor).
        self._watchers = concurrent.futures.ThreadPoolExecutor(WATCHERS, "mcp-forge-watch")

    def close(self) -> None:
        self._watchers.shutdown(wait=False, cancel_futures=True)
        self.kube.close()

    # ---- reading -------------------------------------------------------------------------

    @staticmethod
    def _load(body: dict[str, Any], namespace: str) -> KernelSession:
        body.setdefault("apiVersion", kernelsession.API_VERSION)
        body.setdefault("kind", KIND)
        return kernelsession.load(kernelsession.validate(body, default_namespace=namespace))

    async def get(self, name: str, namespace: str = "default") -> KernelSession:
        body = await asyncio.to_thread(self.kube.get, KIND, namespace, name)
        if body is None:
            self._renewed.pop((namespace, name), None)
            self._rate_leases.pop((namespace, name), None)
            raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
        return self._load(body, namespace)

    async def list(self, namespace: str | None = None) -> builtins.list[KernelSession]:
        ns = namespace or self.namespace
        listed = await asyncio.to_thread(self.kube.list, KIND, ns)
        out = []
        for body in listed.get("items") or []:
            try:
                out.append(self._load(body, ns))
            except InvalidSession as exc:  # shown by the operator in its status
                log.debug("skipping an invalid KernelSession: %s", exc)
        return out

    async def pools(self, namespace: str | None = None) -> builtins.list[ksp.KernelSessionPool]:
        """The namespace's KernelSessionPools (one list), but those being deleted; none if
        the gateway may not list them (an install from before it could): cold starts."""
        ns = namespace or self.namespace
        try:
            listed = await asyncio.to_thread(self.kube.list, ksp.KIND, ns)
        except ApiError as exc:
            if exc.status not in (403, 404):
                raise
            log.warning("cannot list KernelSessionPools in %s (%s): sessions start cold", ns, exc)
            return []
        out = []
        for body in listed.get("items") or []:
            if body["metadata"].get("deletionTimestamp"):
                continue
            body.setdefault("apiVersion", kernelsession.API_VERSION)
            body.setdefault("kind", ksp.KIND)
            spec_only = {k: v for k, v in body.items() if k != "status"}
            try:
                valid = ksp.validate(spec_only, default_namespace=ns)
            except InvalidSession as exc:  # the operator says so in its status
                log.debug("skipping an invalid KernelSessionPool: %s", exc)
                continue
            valid["status"] = body.get("status") or {}  # how many are ready
            out.append(ksp.load(valid))
        return out

    # ---- create / delete -----------------------------------------------------------------

    async def create(self, body: dict[str, Any]) -> KernelSession:
        """Create the KernelSession and wait until the operator has made it Ready."""
        made = await self.make(body)
        meta = made["metadata"]
        try:
            return await self.wait_ready(
                meta["namespace"], meta["name"], uid=meta["uid"], made=made
            )
        except BaseException:
            # The caller gets the error and no session: do not leave a half-made one
            # counting against its quota.
            with contextlib.suppress(ApiError):
                await asyncio.to_thread(
                    self.kube.delete, KIND, meta["namespace"], meta["name"], uid=meta["uid"]
                )
            raise

    async def make(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create the KernelSession (validated first), not waiting for it: the object made."""
        body = kernelsession.validate(body, default_namespace=self.namespace)
        body.pop("status", None)
        meta = body["metadata"]
        try:
            made: dict[str, Any] = await asyncio.to_thread(self.kube.create, body)
        except ApiError as exc:
            if exc.conflict:
                raise InvalidSession(
                    f"a session named {meta['name']!r} exists already", field="metadata.name"
                ) from None
            if exc.status in (400, 422):
                raise InvalidSession(f"the API server refused it: {exc}") from None
            raise
        made["metadata"].setdefault("uid", "")
        return made

    async def wait_ready(
        self, namespace: str, name: str, *, uid: str, made: dict[str, Any] | None = None
    ) -> KernelSession:
        """The session once the operator has made it Ready (SessionNotReady if it failed
        or took too long; SessionNotFound if it went, or another of its name is there).
        `made`: the object its create answered with, watched from (not listed first)."""
        return await self._wait_ready(namespace, name, lambda s: True, uid=uid, made=made)

    async def fork(
        self, name: str, namespace: str, bodies: builtins.list[dict[str, Any]]
    ) -> builtins.list[KernelSession]:
        """New sessions the operator starts from `name`'s memory (cluster_forks.py)."""
        return await cluster_forks.fork(self, name, namespace, bodies)

    async def delete(self, name: str, namespace: str = "default") -> None:
        """Delete it; the API server's garbage collector removes the pod and the rest."""
        if not await asyncio.to_thread(self.kube.delete, KIND, namespace, name):
            raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
        self._renewed.pop((namespace, name), None)
        self._rate_leases.pop((namespace, name), None)

    # ---- what replicas share: quota reservations, call rates ------------------------------

    async def reserve(self, claim: quota.Seat) -> None:
        def change(reservations: dict[str, float]) -> dict[str, float]:
            listed = self.kube.list(KIND, claim.namespace).get("items") or []
            owned = {b["metadata"]["name"] for b in listed if claim.owns(b)}
            return quota.reserve(
                reservations, owned, claim.name, limit=claim.limit, now=time.time()
            )

        await asyncio.to_thread(self._swap_reservations, claim, change)

    async def release(self, claim: quota.Seat) -> None:
        await asyncio.to_thread(
            self._swap_reservations, claim, lambda r: quota.release(r, claim.name), make=False
        )

    def _swap_reservations(
        self,
        claim: quota.Seat,
        change: Callable[[dict[str, float]], dict[str, float]],
        *,
        make: bool = True,
    ) -> None:
        """Compare-and-swap the owner's reservations on its Lease: read (made if absent,
        with `make`), `change` (which may raise, and reads whatever else it decides from
        after this read), write only if the Lease is unchanged since, else again. A Lease
        left with no reservation is deleted, on the same condition: a client leaves no
        object behind once its creates are done."""
        namespace = claim.namespace
        lease = QUOTA_LEASE + hashlib.sha256(claim.owner.encode()).hexdigest()[:16]
        for _ in range(CAS_TRIES):
            if make:
                try:
                    body, _made = self.kube.ensure(
                        {
                            "apiVersion": "coordination.k8s.io/v1",
                            "kind": "Lease",
                            "metadata": {"name": lease, "namespace": namespace},
                            "spec": {},
                        }
                    )
                except ApiError as exc:
                    if not exc.conflict:
                        raise
                    continue  # made and deleted by others meanwhile: again
            else:
                found = self.kube.get("Lease", namespace, lease)
                if found is None:
                    return
                body = found
            meta = body["metadata"]
            before = quota.load_reservations((meta.get("annotations") or {}).get(RESERVATIONS))
            after = change(before)
            if after == before:
                return
            if not after:
                gone = self._delete_lease(namespace, lease, meta)
                if gone:
                    return
                if gone is not None:
                    continue  # changed since read: again
            try:
                self._write_annotation(namespace, lease, meta, RESERVATIONS, json.dumps(after))
            except ApiError as exc:
                if not (exc.conflict or exc.not_found):  # changed, or deleted, since read
                    raise
                continue
            return
        raise ApiError(409, "Conflict", f"Lease {lease}: {CAS_TRIES} writes lost to others")

    def _delete_lease(self, namespace: str, lease: str, meta: dict[str, Any]) -> bool | None:
        """Delete the Lease `meta` was read from if it is unchanged since: True if it is
        gone, False if it changed, None if this gateway may not delete Leases (a Role from
        before it did: the Lease is then kept, and written as any other)."""
        if self._lease_delete_refused:
            return None
        try:
            if self.kube.delete(
                "Lease", namespace, lease, resource_version=meta["resourceVersion"]
            ):
                return True
        except ApiError as exc:
            if exc.status != 403:
                raise
            log.warning("may not delete Lease %s (RBAC: leases delete): quota Leases kept", lease)
            self._lease_delete_refused = True
            return None
        # Not deleted: gone already (another replica), or written since it was read.
        return self.kube.get("Lease", namespace, lease) is None

    async def count_call(self, session: KernelSession, server: str, per_minute: int) -> bool:
        return await asyncio.to_thread(self._count_call, session, server, per_minute)

    def _count_call(self, session: KernelSession, server: str, per_minute: int) -> bool:
        # The write is tried on the Lease as this gateway last wrote it (one API call
        # when no one else wrote since), and on the Lease read afresh after a conflict.
        ns, lease = session.namespace, child_name(session)
        body, fresh = self._rate_leases.get((ns, session.name)), False
        for _ in range(CAS_TRIES):
            if body is None:
                body, fresh = self.kube.get("Lease", ns, lease), True
                if body is None:  # made by the operator with the pod: not started yet
                    log.warning("no Lease %s: a call of %s is not counted", lease, session.name)
                    return True
            meta = body["metadata"]
            rates = quota.load_rates((meta.get("annotations") or {}).get(RATES))
            counted = quota.count_call(rates, server, per_minute, now=time.time())
            if counted is None:
                if fresh:
                    return False
                body = None  # refused by what this gateway saw last: read it again
                continue
            try:
                body = self._write_annotation(ns, lease, meta, RATES, json.dumps(counted))
            except ApiError as exc:
                if not exc.conflict:
                    raise
                body = None
                continue
            if len(self._rate_leases) >= RATE_LEASES_MAX:
                self._rate_leases.pop(next(iter(self._rate_leases)))
            self._rate_leases[(ns, session.name)] = body
            return True
        raise ApiError(409, "Conflict", f"Lease {lease}: {CAS_TRIES} writes lost to others")

    def _write_annotation(
        self, namespace: str, lease: str, meta: dict[str, Any], key: str, value: str
    ) -> dict[str, Any]:
        """Set one annotation of the Lease `meta` was read from, if it is unchanged since
        (the resourceVersion in a patch is a precondition: 409 Conflict otherwise)."""
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "annotations": {key: value},
            }
        }
        return self.kube.patch("Lease", namespace, lease, patch)

    # ---- the kernel ----------------------------------------------------------------------

    async def connection(self, session: KernelSession) -> ConnectionInfo:
        """The kernel's address, key and (when its Secret has them) Curve pair and bridge
        certificate; a Secret without them is a session from an older operator."""
        conn = session.status.get("connection") or {}
        name = conn.get("secretName") or secret_name(session)
        secret = await asyncio.to_thread(self.kube.get, "Secret", session.namespace, name)
        info = connection_file_of(secret)
        if info is None or key_of(secret) is None:
            raise SessionNotReady(f"session {session.name!r} has no readable key in {name}")
        if self.settings.kube_connect == "pod-ip":
            host = session.status.get("podIP")
        else:
            host = conn.get("host") or f"{child_name(session)}.{session.namespace}.svc"
        if not host:
            raise SessionNotReady(f"session {session.name!r} has no address yet")
        try:
            return connection_from_file(info, str(host), f"Secret {session.namespace}/{name}")
        except KernelProtocolError as exc:
            raise SessionNotReady(f"session {session.name!r} cannot be reached: {exc}") from None

    async def refresh(self, session: KernelSession, *, restart: bool = True) -> KernelSession:
        """The session now; with `restart`, wait while the operator (re)starts its kernel,
        and wake a session suspended for idleness (that is what a use does)."""
        fresh = await self.get(session.name, session.namespace)
        phase, reason = fresh.status.get("phase"), fresh.status.get("reason")
        if phase == st.READY or not restart:
            return fresh
        if phase == st.SUSPENDED and reason == st.IDLE:
            self._renewed.pop((fresh.namespace, fresh.name), None)  # renew now, whatever
            await self.record_activity(fresh)
        elif phase not in (st.PENDING, st.STARTING, st.RESTARTING):
            return fresh
        return await self._wait_ready(fresh.namespace, fresh.name, lambda s: True, uid=fresh.uid)

    async def termination(self, session: KernelSession) -> Termination | None:
        """Why the kernel stopped, once the operator has seen it (None until then)."""
        fresh = await self.get(session.name, session.namespace)
        last = fresh.status.get("lastTermination") or {}
        kernel = session.status.get("kernelId")
        if kernel and last.get("podUID") == kernel:
            code = last.get("exitCode")
            return Termination(
                str(last.get("reason") or "Error"),
                code if isinstance(code, int) else None,
                str(last.get("message") or "the kernel stopped"),
            )
        if fresh.status.get("kernelId") != kernel:
            return Termination(st.POD_MISSING, None, "the kernel's pod was replaced")
        return None

    async def restart_kernel(
        self, session: KernelSession, *, reason: str, crashed: bool, message: str = ""
    ) -> None:
        """Ask the operator (through the Lease) for a new kernel pod; wait until it runs."""
        fresh = await self.get(session.name, session.namespace)
        kernel = fresh.status.get("kernelId")
        log.info("restarting the kernel of %s (%s) %s", session.name, reason, message)
        if kernel:
            await self._patch_lease(fresh, {"metadata": {"annotations": {RESTART: kernel}}})
        await self._wait_ready(
            fresh.namespace, fresh.name, lambda s: s.status.get("kernelId") != kernel, uid=fresh.uid
        )

    async def record_activity(self, session: KernelSession, *, busy: bool = False) -> None:
        key = (session.namespace, session.name)
        now = time.monotonic()
        last = self._renewed.get(key)
        if last is not None and last[1] == busy and now - last[0] < self.settings.lease_renew:
            return
        self._renewed[key] = (now, busy)
        until = None
        if busy:  # renewed while the code runs; lapses by itself if this gateway goes away
            expiry = time.time() + self.settings.lease_renew * BUSY_LEASE
            until = dt.datetime.fromtimestamp(expiry, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        patch = {
            "metadata": {"annotations": {BUSY_PREFIX + self.identity: until}},
            "spec": {
                "holderIdentity": self.identity,
                "renewTime": _micro_now(),
                "leaseDurationSeconds": max(1, int(self.settings.lease_renew * BUSY_LEASE)),
            },
        }
        await self._patch_lease(session, patch)

    async def bridge_address(self, session: KernelSession) -> tuple[tuple[str | int, ...], Address]:
        """TCP 5560 of the kernel's pod, reached as the Jupyter channels are; TLS with the
        session's certificate if it has one, handed to the kernel over its channel (a kernel
        woken from a snapshot has no connection file: its launcher wrote it in the old pod)."""
        info = await self.connection(session)
        address = Address("tcp", host=info.host, port=BRIDGE_PORT, tls=info.bridge)
        if info.bridge is None:
            return ("tcp", "0.0.0.0", BRIDGE_PORT), address
        return ("tls", "0.0.0.0", BRIDGE_PORT, info.bridge.cert, info.bridge.key), address

    async def kernel_setup(self, session: KernelSession) -> str | None:
        """A kernel claimed from a pool runs as the pool started it: the operator moved
        its pod, and the session's env is given here; so are working files, to every
        kernel. Once per kernel (claim_program's mark, the pod's uid)."""
        status = session.status
        pod, kernel = status.get("podName"), status.get("kernelId")
        if not pod or not kernel:
            return None
        env = {ksp.CLAIM_MARK: str(kernel)}
        if pod == child_name(session):  # its own pod: env and egress from the start
            return ksp.claim_program(env, session.spec.files) if session.spec.files else None
        try:  # claimed: it runs as the pool started it
            values = await asyncio.to_thread(secret_env, self.kube, session)
        except SecretError as exc:  # named, never a value; the operator checked
            raise SessionNotReady(f"session {session.name!r}: {exc}") from None
        env = ksp.claim_env(session, kernel=str(kernel), secret_values=values)
        program = ksp.claim_program(env, session.spec.files)
        if session.spec.egress_rules:
            program += "\n" + await self._claimed_egress(session)
        return program

    async def _claimed_egress(self, session: KernelSession) -> str:
        """The proxy settings of a kernel claimed from a pool (it was started with no way
        out): the operator put them in its Secret with the claim (control/egress.py)."""
        name = (session.status.get("connection") or {}).get("secretName") or ""
        secret = await asyncio.to_thread(self.kube.get, "Secret", session.namespace, name)
        key = key_of(secret)
        data = {k: v.decode() for k, v in load_secret(secret).data.items()} if secret else {}
        address = data.get(render_egress.PROXY_KEY)
        if key is None or not address:
            raise SessionNotReady(
                f"session {session.name!r}: its egress settings are not in Secret {name} yet"
            )
        return proxy_program(token_for(key), address, data.get(render_egress.CA_KEY))

    async def kernel_packages(self, session: KernelSession, conn: KernelConnection) -> None:
        """The operator does not speak to kernels: the gateway that first connects to a
        new one installs spec.packages (one round trip once they are there)."""
        if session.spec.packages:
            await spec_packages.give_packages(session, conn, self.settings)

    async def memory_usage(self, sessions: builtins.list[KernelSession]) -> dict[str, int]:
        return {}  # the metrics API is not asked: the gateway may not read pods

    # ---- helpers -------------------------------------------------------------------------

    async def _patch_lease(self, session: KernelSession, patch: dict[str, Any]) -> None:
        try:
            await asyncio.to_thread(
                self.kube.patch, "Lease", session.namespace, child_name(session), patch
            )
        except ApiError as exc:
            if not exc.not_found:
                raise
            log.info("no Lease for %s yet: the operator makes it", session.name)

    async def _wait_ready(
        self,
        namespace: str,
        name: str,
        also: Callable[[KernelSession], bool],
        *,
        uid: str,
        made: dict[str, Any] | None = None,
    ) -> KernelSession:
        """Wait until the session is Ready (and `also` holds); raise if it fails or goes.

        Each state is looked at as the watch brings it (cluster_watch.py: one stream for
        the whole wait, from `made`, the object a create answered with, when given): the
        status that says Ready is acted on at once, not read again (a round trip, with the
        API server at its busiest then, on what the operator does after a claim)."""
        deadline = time.monotonic() + self.settings.kernel_ready_timeout
        loop = asyncio.get_running_loop()
        if made is not None:
            body: dict[str, Any] | None = made
            rv: str | None = str(made["metadata"].get("resourceVersion") or "") or None
        else:
            body, rv = await loop.run_in_executor(
                self._watchers, cluster_watch.listed, self.kube, namespace, name
            )
        watch = None
        try:
            while True:
                if body is None or (uid and body["metadata"].get("uid") != uid):
                    raise SessionNotFound(f"session {name!r} was deleted")
                session = self._load(body, namespace)
                status = session.status
                generation = body["metadata"].get("generation")
                current = status.get("observedGeneration") == generation
                if current and status.get("phase") == st.READY and also(session):
                    return session
                if (current and status.get("phase") in (st.FAILED, st.EXPIRED)) or (
                    status.get("phase") == st.SUSPENDED and status.get("reason") != st.IDLE
                ):
                    raise SessionNotReady(
                        f"session {name!r} is {status.get('phase')}: {status.get('message', '')}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionNotReady(
                        f"session {name!r} was not Ready within "
                        f"{self.settings.kernel_ready_timeout:.0f}s: {status.get('phase')}, "
                        f"{status.get('message', '')}"
                    )
                watch = watch or cluster_watch.SessionWatch(self.kube, namespace, name, body, rv)
                body = await loop.run_in_executor(
                    self._watchers, watch.next_change, min(left, WATCH_CHUNK)
                )
        finally:
            if watch is not None:
                watch.close()
