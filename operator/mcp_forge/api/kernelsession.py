"""The KernelSession resource: schema validation, defaults, and a typed view of the spec.

The CRD's openAPIV3Schema (crds/kernelsession.yaml) is the one source of truth. Local
mode validates with it the way the API server would: structural defaults are applied,
unknown fields are rejected (kubectl's strict field validation), and the rules that
CEL expresses in the CRD are checked here too. Every error names the field.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import jsonschema
import yaml
from packaging.requirements import InvalidRequirement, Requirement

from mcp_forge.api.egress import Rule, parse_rules
from mcp_forge.api.status import Status
from mcp_forge.errors import InvalidSession
from mcp_forge.sandbox import kernel_image

GROUP = "mcpforge.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KernelSession"
PLURAL = "kernelsessions"

NAME_MAX = 40
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY_RE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?$")
_CPU_RE = re.compile(r"^(?:([0-9]+(?:\.[0-9]{1,3})?)|([0-9]+)m)$")
_DURATION_RE = re.compile(r"^(?:0|(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?)$")
_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

MEMORY_MIN = 64 * 2**20
CPU_MIN_MILLI = 50
# The CRD's CEL rule on spec.network says the same.
ALLOW_WITH_ALL = "egress All already opens every destination; an allow-list needs egress None"


def _crd_text(file: str) -> str:
    source = Path(__file__).resolve().parents[3] / "crds" / file
    if source.is_file():
        return source.read_text()
    return resources.files("mcp_forge").joinpath(f"data/{file}").read_text()


@functools.cache
def crd(file: str = "kernelsession.yaml") -> dict[str, Any]:
    """A CustomResourceDefinition as shipped in crds/ (KernelSession's by default)."""
    loaded: dict[str, Any] = yaml.safe_load(_crd_text(file))
    return loaded


@functools.cache
def _schema(file: str = "kernelsession.yaml") -> dict[str, Any]:
    schema: dict[str, Any] = copy.deepcopy(
        crd(file)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    )
    _make_strict(schema)
    return schema


def check_schema(body: dict[str, Any], file: str) -> dict[str, Any]:
    """Apply the CRD's structural defaults to `body` and validate it as the API server
    would (unknown fields rejected); InvalidSession names the first offending field."""
    check_no_nul(body)
    schema = _schema(file)
    body = _apply_defaults(body, schema)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        field, message = _describe(errors[0])
        raise InvalidSession(message, field=field)
    return body


def check_no_nul(value: Any, field: str = "") -> None:
    """Refuse a NUL byte in any string of `value`, keys included, naming the field.

    No name, label, variable, path or text given to Podman or the kernel can hold one:
    it would fail there, after a pooled kernel was claimed, not here before anything is
    stored.
    """
    if isinstance(value, str):
        if "\0" in value:
            raise InvalidSession("a NUL byte is never valid here", field=field or "(root)")
    elif isinstance(value, dict):
        for key, item in value.items():
            inner = f"{field}.{key}" if field else str(key)
            check_no_nul(key, inner)
            check_no_nul(item, inner)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_no_nul(item, f"{field}[{i}]")


def check_name(meta: dict[str, Any], *, max_len: int, default_namespace: str) -> None:
    """metadata.name and metadata.namespace of a resource (the namespace defaulted)."""
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidSession("required field missing", field="metadata.name")
    if len(name) > max_len or not _NAME_RE.match(name):
        raise InvalidSession(
            f"{name!r} must be at most {max_len} characters of a-z, 0-9 and '-', "
            "starting with a letter and ending with a letter or digit",
            field="metadata.name",
        )
    namespace = meta.setdefault("namespace", default_namespace)
    if not isinstance(namespace, str) or len(namespace) > 63 or not _NAME_RE.match(namespace):
        raise InvalidSession(f"{namespace!r} is not a valid namespace", field="metadata.namespace")


def _make_strict(node: dict[str, Any]) -> None:
    """Reject unknown fields where the schema lists properties, as strict validation does."""
    props = node.get("properties")
    if isinstance(props, dict):
        if not node.get("x-kubernetes-preserve-unknown-fields") and node is not props.get(
            "metadata"
        ):
            node.setdefault("additionalProperties", False)
        for key, child in props.items():
            if key != "metadata":
                _make_strict(child)
    items = node.get("items")
    if isinstance(items, dict):
        _make_strict(items)


def _apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(item, schema["items"]) for item in value]
    return value


def _path(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def _describe(error: jsonschema.ValidationError) -> tuple[str, str]:
    field = _path(error)
    v = error.validator
    if v == "additionalProperties":
        schema = error.schema if isinstance(error.schema, dict) else {}
        instance = error.instance if isinstance(error.instance, dict) else {}
        extra = sorted(set(instance) - set(schema.get("properties", {})))
        name = extra[0] if extra else "?"
        return (f"{field}.{name}" if field != "(root)" else name), "unknown field"
    if v == "required":
        missing = str(error.message).split("'")[1]
        return (f"{field}.{missing}" if field != "(root)" else missing), "required field missing"
    if v == "enum":
        allowed = error.validator_value if isinstance(error.validator_value, list) else []
        return field, f"must be one of {', '.join(map(str, allowed))}"
    if v == "pattern":
        return field, f"{error.instance!r} is not valid (expected pattern {error.validator_value})"
    if v == "type":
        return (
            field,
            f"must be of type {error.validator_value}, not {type(error.instance).__name__}",
        )
    return field, str(error.message)


def parse_quantity(text: str, *, field: str) -> int:
    """Bytes in a binary quantity such as "512Mi"."""
    m = _QUANTITY_RE.match(text)
    if not m:
        raise InvalidSession(f"{text!r} is not a quantity like 512Mi or 2Gi", field=field)
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_cpu_milli(text: str, *, field: str) -> int:
    m = _CPU_RE.match(text)
    if not m:
        raise InvalidSession(f"{text!r} is not a CPU amount like 1, 0.5 or 500m", field=field)
    return round(float(m.group(1)) * 1000) if m.group(1) else int(m.group(2))


def parse_duration(text: str, *, field: str) -> float:
    """Seconds in a duration such as "1h30m" or "90s"; "0" is 0."""
    m = _DURATION_RE.match(text)
    if not m or text == "":
        raise InvalidSession(f"{text!r} is not a duration like 90s, 30m or 1h30m", field=field)
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(h * 3600 + mi * 60 + s)


@dataclass(frozen=True)
class EnvVar:
    """A variable of spec.env: a value, or a key of a Secret (`secret`: its name and key),
    read where the session runs; `value` is then "" and never holds the Secret's."""

    name: str
    value: str = ""
    secret: tuple[str, str] | None = None  # valueFrom.secretKeyRef: (name, key)


def _env_var(item: dict[str, Any]) -> EnvVar:
    ref = (item.get("valueFrom") or {}).get("secretKeyRef")
    if ref is not None:
        return EnvVar(item["name"], secret=(ref["name"], ref["key"]))
    return EnvVar(item["name"], item.get("value", ""))


@dataclass(frozen=True)
class SessionSpec:
    """The typed, validated spec of a KernelSession."""

    image: str
    memory_bytes: int
    memory: str
    cpu: str
    cpu_milli: int
    pids: int
    idle_timeout: float
    env: tuple[EnvVar, ...]
    workspace_size: str
    shared_group: str | None
    egress: str
    restart_policy: str
    mcp_servers: tuple[dict[str, Any], ...]
    operating_mode: str = "Running"
    idle_action: str = "Delete"
    max_lifetime: float = 0.0
    update_strategy: str = "OnRestart"
    pool: str | None = None  # spec.poolRef.name: claim a ready kernel of this pool
    files: tuple[tuple[str, str], ...] = ()  # spec.files: (path in the workspace, text)
    packages: tuple[str, ...] = ()  # spec.packages: requirement strings
    # spec.workspace: a claim of its own on a cluster (always a volume of its own locally)
    persistent: bool = False
    storage_class: str | None = None
    retain_workspace: bool = False  # reclaimPolicy Retain: kept after the session
    egress_rules: tuple[Rule, ...] = ()  # spec.network.allow: destinations by name


@dataclass(frozen=True)
class KernelSession:
    """A validated KernelSession: its identity, typed spec, and the whole object."""

    name: str
    namespace: str
    uid: str
    spec: SessionSpec
    body: dict[str, Any]

    @property
    def status(self) -> Status:
        """The status as stored (read-only here: writers patch the store or the API)."""
        return cast(Status, self.body.get("status") or {})


def validate(obj: Any, *, default_namespace: str = "default") -> dict[str, Any]:
    """Validate a KernelSession object; return a copy with defaults applied.

    Raises InvalidSession naming the first offending field.
    """
    if not isinstance(obj, dict):
        raise InvalidSession("a KernelSession must be a mapping", field="(root)")
    if obj.get("apiVersion") != API_VERSION:
        raise InvalidSession(
            f"must be {API_VERSION}, got {obj.get('apiVersion')!r}", field="apiVersion"
        )
    if obj.get("kind") != KIND:
        raise InvalidSession(f"must be {KIND}, got {obj.get('kind')!r}", field="kind")
    body = copy.deepcopy(obj)
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        raise InvalidSession("required field missing", field="metadata")
    check_name(meta, max_len=NAME_MAX, default_namespace=default_namespace)
    if body.get("spec") is None:
        body["spec"] = {}
    body = check_schema(body, "kernelsession.yaml")
    spec_of(body)  # the semantic rules
    validated: dict[str, Any] = body
    return validated


def spec_of(body: dict[str, Any]) -> SessionSpec:
    """The typed spec of an already schema-valid KernelSession body."""
    spec = body["spec"]
    res = spec["resources"]
    memory_bytes = parse_quantity(res["memory"], field="spec.resources.memory")
    if memory_bytes < MEMORY_MIN:
        raise InvalidSession("must be at least 64Mi", field="spec.resources.memory")
    cpu_milli = parse_cpu_milli(res["cpu"], field="spec.resources.cpu")
    if cpu_milli < CPU_MIN_MILLI:
        raise InvalidSession("must be at least 50m", field="spec.resources.cpu")
    workspace = spec["workspace"]
    parse_quantity(workspace["size"], field="spec.workspace.size")
    persistent = _persistent(workspace)
    names = [e["name"] for e in spec.get("env", [])]
    for i, item in enumerate(spec.get("env", [])):
        if "value" in item and "valueFrom" in item:
            raise InvalidSession(
                "value and valueFrom exclude each other: give one", field=f"spec.env[{i}].valueFrom"
            )
    for i, n in enumerate(names):
        if n in names[:i]:
            raise InvalidSession(f"duplicate variable {n!r}", field=f"spec.env[{i}].name")
        if n.startswith(("MCPFORGE_", "JPY_")):
            raise InvalidSession(
                f"{n!r}: the MCPFORGE_ and JPY_ prefixes are reserved", field=f"spec.env[{i}].name"
            )
    servers = [s["name"] for s in spec.get("mcpServers", [])]
    for i, n in enumerate(servers):
        if n in servers[:i]:
            raise InvalidSession(f"duplicate server {n!r}", field=f"spec.mcpServers[{i}].name")
    paths = [f["path"] for f in spec.get("files", [])]
    for i, p in enumerate(paths):
        if p in paths[:i]:
            raise InvalidSession(f"duplicate path {p!r}", field=f"spec.files[{i}].path")
    for i, text in enumerate(spec.get("packages", [])):
        try:
            requirement(text)
        except ValueError as exc:
            raise InvalidSession(str(exc), field=f"spec.packages[{i}]") from None
    return SessionSpec(
        image=spec["image"],
        memory_bytes=memory_bytes,
        memory=res["memory"],
        cpu=res["cpu"],
        cpu_milli=cpu_milli,
        pids=res["pids"],
        idle_timeout=parse_duration(spec["idleTimeout"], field="spec.idleTimeout"),
        env=tuple(_env_var(e) for e in spec.get("env", [])),
        workspace_size=spec["workspace"]["size"],
        shared_group=spec.get("sharedGroup"),
        egress=spec["network"]["egress"],
        egress_rules=egress_rules(spec["network"]),
        restart_policy=spec["restartPolicy"],
        mcp_servers=tuple(spec.get("mcpServers", [])),
        operating_mode=spec["operatingMode"],
        idle_action=spec["idleAction"],
        max_lifetime=parse_duration(spec["maxLifetime"], field="spec.maxLifetime"),
        update_strategy=spec["updateStrategy"],
        pool=(spec.get("poolRef") or {}).get("name"),
        files=tuple((f["path"], f["content"]) for f in spec.get("files", [])),
        packages=tuple(spec.get("packages", [])),
        persistent=persistent,
        storage_class=workspace.get("storageClassName"),
        retain_workspace=workspace.get("reclaimPolicy") == "Retain",
    )


def egress_rules(network: dict[str, Any], field: str = "spec.network.allow") -> tuple[Rule, ...]:
    """spec.network.allow as rules (api/egress.py). A list beside egress All is refused,
    as the CRD's CEL rule refuses it: All opens everything, so the list would only seem
    to narrow it."""
    if network.get("egress") == "All" and network.get("allow"):
        raise InvalidSession(ALLOW_WITH_ALL, field=field)
    return parse_rules(network.get("allow", []), field=field)


def _persistent(workspace: dict[str, Any]) -> bool:
    """spec.workspace.persistent, which a storageClassName implies (the CRD's CEL rules)."""
    asked = workspace.get("persistent")
    if "storageClassName" in workspace and asked is False:
        raise InvalidSession(
            "false contradicts spec.workspace.storageClassName, which asks for a persistent "
            "workspace: remove persistent: false",
            field="spec.workspace.persistent",
        )
    persistent = bool(asked) or "storageClassName" in workspace
    if workspace.get("reclaimPolicy") == "Retain" and not persistent:
        raise InvalidSession(
            "Retain keeps a persistent workspace after the session: "
            "set spec.workspace.persistent: true",
            field="spec.workspace.reclaimPolicy",
        )
    return persistent


# pip's archive extensions (pip._internal.utils.filetypes), and a wheel's.
ARCHIVE_SUFFIXES = (
    ".whl", ".zip", ".tar", ".tgz", ".tar.gz", ".tbz", ".tar.bz2", ".txz", ".tar.xz",
    ".tlz", ".tar.lz", ".tar.lzma", ".egg",
)  # fmt: skip


def requirement(text: str) -> Requirement:
    """A package requirement (spec.packages, install_packages): a name with optional
    extras, version specifiers and a marker; never a URL (`name @ https://...`), a path
    or a pip option, so nothing but requirements reaches pip's command line. ValueError
    says what is wrong."""
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(
            f"{text!r} is not a requirement such as 'tabulate' or 'msgpack==1.0.8': {first}"
        ) from None
    if req.url is not None:
        raise ValueError(f"{text!r} names a URL; only index packages can be installed")
    if req.name.lower().endswith(ARCHIVE_SUFFIXES):
        # pip takes such a name for a file in its working directory, if one is there.
        raise ValueError(
            f"{text!r} looks like a file name; only packages on the index can be installed, "
            "by name (without .whl, .zip, .tar.gz, ...)"
        )
    return req


def load(body: dict[str, Any]) -> KernelSession:
    """A KernelSession from a validated body (as stored)."""
    meta = body["metadata"]
    return KernelSession(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        spec=spec_of(body),
        body=body,
    )


def parse_documents(text: str) -> list[dict[str, Any]]:
    """The KernelSessions in a YAML stream, each validated; empty documents are skipped."""
    return parse_stream(text, validate, "KernelSession")


def parse_stream(
    text: str, check: Callable[[Any], dict[str, Any]], what: str
) -> list[dict[str, Any]]:
    """The documents of a YAML stream, each made valid by `check` (empty ones skipped);
    an error names the document when there are several."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidSession(f"not valid YAML: {_yaml_problem(exc)}") from None
    if not docs:
        raise InvalidSession(f"no {what} in the input")
    out = []
    for i, doc in enumerate(docs):
        try:
            out.append(check(doc))
        except InvalidSession as exc:
            if len(docs) > 1:
                raise InvalidSession(f"document {i + 1}: {exc}") from exc
            raise
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without PyYAML's snippet of the text: the line may hold
    a Secret's value."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{exc.problem or exc.context or 'malformed'}{where}"
    return type(exc).__name__


def default_image() -> str:
    return kernel_image()
