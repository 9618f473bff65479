"""The KernelSessionPool resource: kernels started ahead of time, claimed by sessions.

A pool keeps `spec.size` kernels started from `spec.template` and answering, each in its
own pod with its own key. A KernelSession that names the pool (`spec.poolRef`) takes one
of them instead of starting a pod: a warm start. The template holds what a running pod
cannot change (image, resources, workspace size, network); a session is served by the
pool when its own values of those fields are the same. The rest of its spec (env,
mcpServers, idleTimeout, ...) is given to the claimed kernel, or needs nothing of the pod.

`unservable` says why a session cannot be served (a cold start, and condition WarmStart
says so); like the CRD (crds/kernelsessionpool.yaml), everything here is pure.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcp_forge.api import kernelsession as ks
from mcp_forge.api import secret
from mcp_forge.errors import InvalidSession
from mcp_forge.kernelside import compiled, run_silently
from mcp_forge.sandbox import SESSION_VARIABLE, WORKSPACE

KIND = "KernelSessionPool"
PLURAL = "kernelsessionpools"
CRD_FILE = "kernelsessionpool.yaml"
NAME_MAX = 31  # its kernels are named <pool>-<8 hex digits>, within KernelSession's 40

# On a pooled kernel (a KernelSession locally, a pod on a cluster): the pool it belongs
# to while unclaimed, and the template it was started with.
LABEL_POOL = "mcpforge.dev/pool"
LABEL_TEMPLATE = "mcpforge.dev/pool-template"
# On a session that claimed one: the pool it came from (kept after the claim).
ANNOTATION_CLAIMED_FROM = "mcpforge.dev/claimed-from"

TEMPLATE_FIELDS = ("image", "resources", "workspace", "network")
# Environment variables read only when the interpreter or the C library starts: set on
# an already running kernel they would change nothing, so they need a cold start.
_STARTUP_ENV = re.compile(r"^(PYTHON|LD_|MALLOC_|GLIBC_|LC_|LANG$|TZ$)")

# Condition WarmStart: True when the session claimed a pooled kernel; else why not.
WARM_START = "WarmStart"
CLAIMED = "Claimed"
POOL_NOT_FOUND = "PoolNotFound"
POOL_MISMATCH = "PoolMismatch"
POOL_EXHAUSTED = "PoolExhausted"
CLAIM_FAILED = "ClaimFailed"
# Condition Ready of a pool holding fewer than `size` ready because of its maxSize.
AT_MAXIMUM = "AtMaximum"


@dataclass(frozen=True)
class KernelSessionPool:
    name: str
    namespace: str
    uid: str
    size: int
    max_starting: int
    max_size: int | None  # ready, starting and claimed together; None: no limit
    template: dict[str, Any]  # image, resources, workspace, network, defaults applied
    body: dict[str, Any]

    def wanted(self, claimed: int) -> int:
        """Kernels to keep ready (or starting) while `claimed` of its kernels are claimed."""
        if self.max_size is None:
            return self.size
        return max(0, min(self.size, self.max_size - claimed))

    def room(self, claimed: int) -> int | None:
        """How many unclaimed kernels it may hold at once, of any template (None: any)."""
        return None if self.max_size is None else max(0, self.max_size - claimed)

    def condition(self, ready: int, claimed: int) -> tuple[bool, str, str]:
        """Its Ready condition (status, reason, message) with `ready` kernels ready and
        `claimed` claimed; not for a pool whose kernels failed to start."""
        wanted = self.wanted(claimed)
        counted = f"{ready} of {self.size} kernels ready"
        if wanted < self.size and ready >= wanted:
            return (
                True,
                AT_MAXIMUM,
                f"{counted}: at its maximum of {self.max_size} ({claimed} claimed)",
            )
        return ready >= self.size, "Filled" if ready >= self.size else "Filling", counted

    @property
    def template_hash(self) -> str:
        text = json.dumps(self.template, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def validate(obj: Any, *, default_namespace: str = "default") -> dict[str, Any]:
    """Validate a KernelSessionPool object; return a copy with defaults applied."""
    if not isinstance(obj, dict):
        raise InvalidSession("a KernelSessionPool must be a mapping", field="(root)")
    if obj.get("apiVersion") != ks.API_VERSION:
        raise InvalidSession(
            f"must be {ks.API_VERSION}, got {obj.get('apiVersion')!r}", field="apiVersion"
        )
    body = copy.deepcopy(obj)
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        raise InvalidSession("required field missing", field="metadata")
    ks.check_name(meta, max_len=NAME_MAX, default_namespace=default_namespace)
    body = ks.check_schema(body, CRD_FILE)
    # The template's values must make a valid KernelSession (quantities, minimums).
    try:
        spec = ks.spec_of(ks.check_schema(_session_draft(body, "x"), "kernelsession.yaml"))
    except InvalidSession as exc:
        field = exc.field or ""
        text = str(exc).removeprefix(f"{field}: ")
        raise InvalidSession(text, field=field.replace("spec.", "spec.template.", 1)) from None
    pool_spec = body["spec"]
    if "maxSize" in pool_spec and int(pool_spec["maxSize"]) < int(pool_spec["size"]):
        raise InvalidSession(
            f"must be at least spec.size ({pool_spec['size']}), got {pool_spec['maxSize']}",
            field="spec.maxSize",
        )
    if spec.persistent:
        raise InvalidSession(
            "a pooled kernel cannot have a persistent workspace (a claim is a session's own): "
            "sessions that ask for one start cold",
            field="spec.template.workspace",
        )
    return body


def load(body: dict[str, Any]) -> KernelSessionPool:
    meta, spec = body["metadata"], body["spec"]
    template = {k: copy.deepcopy(spec["template"][k]) for k in TEMPLATE_FIELDS}
    return KernelSessionPool(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        size=int(spec["size"]),
        max_starting=int(spec.get("maxStarting", 2)),
        max_size=int(spec["maxSize"]) if spec.get("maxSize") is not None else None,
        template=template,
        body=body,
    )


def _session_draft(pool_body: dict[str, Any], name: str) -> dict[str, Any]:
    meta = pool_body["metadata"]
    return {
        "apiVersion": ks.API_VERSION,
        "kind": ks.KIND,
        "metadata": {"name": name, "namespace": meta.get("namespace", "default")},
        "spec": copy.deepcopy(pool_body["spec"].get("template") or {}),
    }


def member_body(pool: KernelSessionPool, name: str) -> dict[str, Any]:
    """The KernelSession a pooled kernel is (local mode): the template, never culled."""
    body = _session_draft(pool.body, name)
    body["metadata"]["labels"] = {LABEL_POOL: pool.name, LABEL_TEMPLATE: pool.template_hash}
    body["spec"].update(idleTimeout="0", maxLifetime="0", restartPolicy="Always")
    return ks.validate(body)


def unservable(pool: KernelSessionPool, spec: dict[str, Any]) -> str:
    """Why the pool cannot serve a session of this (validated) spec; "" if it can.

    Env taken from Secrets is served: whoever gives the claimed kernel its env reads
    them (local mode's claim; on a cluster, the gateway when it connects)."""
    workspace = spec.get("workspace") or {}
    if workspace.get("persistent") or workspace.get("storageClassName"):
        return (
            "spec.workspace is persistent: a pooled kernel was started without the "
            "session's own volume, so it starts cold with its claim"
        )
    for field in TEMPLATE_FIELDS:
        want, have = spec.get(field), pool.template.get(field)
        if field == "workspace":  # its other fields say how it is kept, not the pod
            want = {"size": workspace.get("size")}
            have = {"size": (have or {}).get("size")}
        if want != have:
            return (
                f"spec.{field} is {_show(want)} but pool {pool.name!r} starts its kernels "
                f"with {_show(have)}"
            )
    if spec.get("sharedGroup"):
        return "spec.sharedGroup needs a /shared volume in the pod, which pooled kernels lack"
    for var in spec.get("env") or []:
        if _STARTUP_ENV.match(str(var.get("name", ""))):
            return (
                f"spec.env {var['name']} takes effect only when the interpreter starts, "
                "so it cannot be given to a running kernel"
            )
    if spec.get("operatingMode") == "Suspended":
        return "spec.operatingMode is Suspended: there is no kernel to claim"
    return ""


def choose(pools: Sequence[KernelSessionPool], spec: dict[str, Any]) -> KernelSessionPool | None:
    """The pool a session of this (validated) spec should claim from, when it names none:
    one that serves it, the one with most ready kernels first (by its status; then by
    name, so that two gateways choose alike). None: no pool serves it, it starts cold."""
    serving = [p for p in pools if not unservable(p, spec)]
    if not serving:
        return None
    return min(serving, key=lambda p: (-_ready(p), p.name))


def _ready(pool: KernelSessionPool) -> int:
    ready = (pool.body.get("status") or {}).get("ready")
    return ready if isinstance(ready, int) else 0


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


CLAIM_MARK = "MCPFORGE_CLAIM"


def claim_env(
    session: ks.KernelSession,
    kernel: str = "",
    *,
    secret_values: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What a claimed kernel's environment gains: the session's env, the variables taken
    from Secrets with their values (`secret_values`: `secret.resolve`), and its name;
    with `kernel` (the claimed kernel's id), a mark that it was given (see claim_program)."""
    values = secret_values or {}
    env = {}
    for e in session.spec.env:
        if e.secret is not None and e.name not in values:
            raise InvalidSession(
                f"no value was resolved for {e.name} (Secret {e.secret[0]!r})", field="spec.env"
            )
        env[e.name] = values[e.name] if e.secret is not None else e.value
    env[SESSION_VARIABLE] = session.name
    if kernel:
        env[CLAIM_MARK] = kernel
    return env


def claim_program(
    env: Mapping[str, str], files: Sequence[tuple[str, str]] = (), *, root: str = WORKSPACE
) -> str:
    """Silent code that gives a kernel its session's environment and working files.

    Files are written below `root` where no file of that path exists (a file the code
    changed is kept, across kernel restarts too). With CLAIM_MARK in `env`, all of it is
    done once: a kernel that already has that mark (a gateway connecting again, a
    second replica) keeps its environment and files as its code left them
    (kernelside/claim.py). The values are Python literals made by repr, which
    round-trips every str exactly; nothing the kernel sends back is evaluated.
    """
    names = {"ENV": dict(env), "FILES": [list(f) for f in files], "MARK": CLAIM_MARK, "ROOT": root}
    return run_silently(compiled("claim"), {k: repr(v) for k, v in names.items()})


def parse_resources(text: str) -> list[dict[str, Any]]:
    """The KernelSessions, KernelSessionPools and Secrets (v1) in a YAML stream, each
    validated by its kind; empty documents are skipped."""

    def check(doc: Any) -> dict[str, Any]:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind == secret.KIND:
            return secret.validate(doc)
        return validate(doc) if kind == KIND else ks.validate(doc)

    return ks.parse_stream(text, check, "KernelSession, KernelSessionPool or Secret")


def claimed_a_kernel(status: dict[str, Any]) -> bool:
    """A session's status says its first kernel was claimed from a pool (WarmStart True)."""
    return any(
        c.get("type") == WARM_START and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
