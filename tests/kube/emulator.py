"""A Kubernetes API server emulator for operator tests: kmock's emulator made more realistic.

Built on (and relying on the private internals of) **kmock 0.8** — ``KubernetesEmulator``'s
``_objects``, ``_resources``, ``_get_resources()``, the ``_serve_*`` fallbacks, ``_render_error``
and ``kmock._internal.parsing.parse_path``. Upgrade kmock only together with this file.

Emulated, on top of stock kmock (discovery, objects in memory, list/watch/get/post/patch/delete):

* server-set ``metadata.uid``, ``creationTimestamp``, ``generation`` (1, then +1 when anything
  but ``metadata``/``status`` changes) and ``resourceVersion`` (one global counter, bumped on
  every write, incl. setting ``deletionTimestamp`` and the final removal); no-op writes do nothing;
* ``apiVersion``, ``kind`` and ``metadata.namespace`` filled in from the URL (a different
  namespace in the body is a 400); ``generateName``; creating in a missing namespace is a 404;
* errors as ``kind: Status`` bodies: 404 NotFound, 409 AlreadyExists, 409 Conflict (stale
  ``metadata.resourceVersion`` in a PATCH/PUT body or in DELETE ``preconditions``), 422 Invalid (a
  failed JSON-patch ``test`` op, a bad patch, ownerReferences without ``uid``, new finalizers on a
  deleted object), 400 BadRequest, 415 for server-side apply; a ``resourceVersion`` in a create
  body is a 500, as on a real server. These do not go to ``kmock.errors`` (only real failures do);
* PUT (replace) and DELETE of a collection (with selectors);
* the status subresource, for resources declaring ``status``: a ``/status`` write changes only
  ``status``, a main write (and a create) ignores ``status``; other subresource writes are a 404;
* lists carry the current ``resourceVersion``; a watch from ``?resourceVersion=N`` replays the
  recorded events newer than N (without it: ADDED for every current object), then follows live
  events without loss or duplicates; ``timeoutSeconds`` ends the stream;
* ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (..)``, ``k notin (..)``)
  and ``fieldSelector`` (``path=v``, ``path!=v`` on any dotted path, e.g. ``metadata.name``) in
  list, watch and delete-collection; watches filter on an object's new state only;
* finalizers: DELETE sets ``deletionTimestamp``; the object is removed (DELETED event) when its
  last finalizer goes; without finalizers, DELETE removes it at once;
* background garbage collection: after a removal, objects whose ``ownerReferences`` uids are all
  gone are deleted (as above, so their finalizers are respected), transitively;
* ``/api/v1/namespaces[/name[/status|/finalize]]`` works (stock kmock answers 500).

Not emulated: schema validation, defaulting, pruning, CEL rules, admission (webhooks, quotas,
limits), RBAC and authentication (any token, plain HTTP), strategic merge (treated as a JSON merge
patch: lists are replaced, not merged by key), server-side apply, dry-run, CRD -> resource
(declare resources with ``emulator.resources``), controllers (kubelet: pods never run; endpoints,
replicasets, the namespace controller: deleting a Namespace leaves its contents), foreground or
orphan deletion, grace periods, BOOKMARK events, 410 Gone (the event log is never compacted),
watch ADDED/DELETED on selector transitions, managedFields, ``resourceVersion`` on lists/gets.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, enums, parsing, rendering

Obj = dict[str, Any]
Key = tuple[kmock.resource, str | None, str]
NAMESPACES = kmock.resource("", "v1", "namespaces")
SERVER_FIELDS = ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion")
SERVER_FIELDS += ("deletionTimestamp", "deletionGracePeriodSeconds")

_stock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """Fix kmock 0.8: ``/api/v1/namespaces[/x[/status]]`` is the Namespace resource itself."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) < 5 or parts[4] in ("status", "finalize")
    ):
        name = parts[3] if len(parts) > 3 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, "/".join(parts[4:]) or None)
    return _stock_parse_path(path)


parsing.parse_path = _parse_path  # a bug fix only; every other path parses as before


def error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(code, reason, message, details or {"causes": []})


def _label_selector(text: str) -> list[Callable[[dict[str, str]], bool]]:
    preds: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in re.split(r",(?![^(]*\))", text))):
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s*\(([^)]*)\)", term):
            vals = {v.strip() for v in m[3].split(",")}
            preds.append(lambda ls, k=m[1], o=m[2], v=vals: (ls.get(k) in v) == (o == "in"))
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", term):
            preds.append(lambda ls, k=m[1], o=m[2], v=m[3]: (ls.get(k) == v) != (o == "!="))
        elif m := re.fullmatch(r"(!?)\s*([\w./-]+)", term):
            preds.append(lambda ls, k=m[2], neg=bool(m[1]): (k in ls) != neg)
        else:
            raise error(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return preds


def _field_selector(text: str) -> list[Callable[[Obj], bool]]:
    def get(obj: Any, path: str) -> str:
        for part in path.split("."):
            obj = obj.get(part) if isinstance(obj, dict) else None
        return "" if obj is None else str(obj)

    preds: list[Callable[[Obj], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if not (m := re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)):
            raise error(400, "BadRequest", f"invalid field selector: {term!r}")
        preds.append(lambda o, p=m[1], op=m[2], v=m[3]: (get(o, p) == v) != (op == "!="))
    return preds


def _spec(obj: Obj) -> Obj:
    """What changes the generation: all but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _rv_param(request: rendering.Request) -> int:
    value = request.params.get("resourceVersion") or "0"
    if not value.isdigit():
        raise error(400, "BadRequest", f"invalid resourceVersion: {value!r}")
    return int(value)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """See the module docstring. Use like ``kmock.KubernetesEmulator`` (+ ``kmock.Server``)."""

    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, kmock.resource, str | None, str, Obj]] = attrs.field(
        factory=list, init=False
    )
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _gc_pending: bool = attrs.field(default=False, init=False)
    _results: dict[rendering.Request, Obj] = attrs.field(factory=dict, init=False)
    _watches: collections.Counter[kmock.resource] = attrs.field(
        factory=collections.Counter, init=False
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.fallback[enums.method.PUT] << self._serve_result
        self.fallback[enums.method.DELETE] << self._serve_result  # collections

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion given out (0 before the first write)."""
        return self._rv

    def watches(self, resource: str | kmock.resource) -> int:
        """How many watches of this resource have started streaming (ever)."""
        return self._watches[kmock.resource(resource)]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10) -> None:
        """Wait until ``predicate()`` is true; it is checked after every write and watch start."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self._changed.wait()

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        try:
            if request.resource is not None and (
                request.action in (enums.action.CREATE, enums.action.UPDATE)
                or request.method == enums.method.DELETE
                or (request.method == enums.method.PUT and request.name is not None)
            ):
                self._results[request] = self._write(request)
            # Skip the stock emulator's own state changes; keep the reactions & fallbacks.
            response = await super(kmock.KubernetesEmulator, self)._handle(request)
            if request.action == enums.action.CREATE and response.status == 200:
                response.set_status(201)  # the kubernetes client wants it (or returns None)
            return response
        except kmock.KubernetesError as e:  # an API answer, not an emulator failure
            return await self._render_error(e)
        finally:
            self._results.pop(request, None)

    # Writes: synchronous (so atomic in the event loop), on deep copies, one version per write.

    def _write(self, request: rendering.Request) -> Obj:
        assert request.resource is not None
        res, ns, name, data = request.resource, request.namespace, request.name, request.data
        info = self._info(res)
        if request.subresource not in (None, *({"status"} & info.subresources)):
            raise error(404, "NotFound", f"no such subresource: {request.subresource}")
        if request.action == enums.action.CREATE:
            return self._create(res, ns, data)
        if request.method == enums.method.DELETE:
            pre = data.get("preconditions") or {} if isinstance(data, dict) else {}
            if name is not None:
                return self._delete((res, ns, name), pre)
            keys = [k for k, o in self._select(request) if "deletionTimestamp" not in o["metadata"]]
            return {"kind": f"{info.kind}List", "items": [self._delete(k, pre) for k in keys]}
        key = (res, ns, name or "")
        old = self._get(key)
        if request.method == enums.method.PUT:
            new = copy.deepcopy(data)
        elif "apply-patch" in next(
            (v for k, v in request.headers.items() if k.lower() == "content-type"), ""
        ):
            raise error(415, "UnsupportedMediaType", "server-side apply is not emulated")
        else:
            try:
                new = dicts.patch_dict(old, data)  # a merge patch (dict) or a JSON patch (list)
            except (
                jsonpatch.JsonPatchException,
                jsonpatch.JsonPointerException,
                ValueError,
                TypeError,
            ) as e:
                raise error(422, "Invalid", f"the patch cannot be applied: {e}") from None
        return self._update(key, old, new, status=request.subresource == "status")

    def _create(self, res: kmock.resource, ns: str | None, data: Any) -> Obj:
        obj, info = copy.deepcopy(data), self._resources[res]
        if not isinstance(obj, dict) or not isinstance(obj.setdefault("metadata", {}), dict):
            raise error(400, "BadRequest", "the body must be a JSON object with a metadata object")
        meta, plural = obj["metadata"], res.plural
        if meta.get("resourceVersion"):
            raise error(
                500, "InternalError", "resourceVersion should not be set on objects to be created"
            )
        if ns is not None and meta.get("namespace") not in (None, "", ns):
            raise error(400, "BadRequest", "the namespace of the object does not match the request")
        ns = (ns or meta.get("namespace")) if info.namespaced is not False else None
        if ns is not None and NAMESPACES in self._get_resources():
            if (space := self._find((NAMESPACES, None, ns))) is None:
                raise error(
                    404, "NotFound", f'namespaces "{ns}" not found', name=ns, kind="namespaces"
                )
            if space.get("metadata", {}).get("deletionTimestamp"):
                raise error(403, "Forbidden", f"namespace {ns} is being terminated")
        while not meta.get("name") and meta.get("generateName"):
            name = meta["generateName"] + "".join(
                secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5)
            )
            meta["name"] = None if self._find((res, ns, name)) else name
        if not meta.get("name"):
            raise error(422, "Invalid", "metadata.name or metadata.generateName is required")
        key = (res, ns, meta["name"])
        if self._find(key) is not None:
            raise error(
                409,
                "AlreadyExists",
                f'{plural} "{key[2]}" already exists',
                name=key[2],
                kind=plural,
            )
        self._check_owners(obj)
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        if "status" in info.subresources:
            obj.pop("status", None)
        obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        obj["kind"] = info.kind or obj.get("kind") or (plural or "").capitalize()
        meta.update(
            namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=self._now(), generation=1
        )
        if ns is None:
            meta.pop("namespace")
        self._stamp(obj)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        return self._emit(key, "ADDED", obj)

    def _update(self, key: Key, old: Obj, new: Any, *, status: bool) -> Obj:
        new = copy.deepcopy(new)  # a merge patch shares the unchanged parts with the old object
        if not isinstance(new, dict) or not isinstance(new.setdefault("metadata", {}), dict):
            raise error(400, "BadRequest", "the body must be a JSON object with a metadata object")
        if new["metadata"].get("resourceVersion") not in (
            None,
            "",
            old["metadata"]["resourceVersion"],
        ):
            msg = "the object has been modified; please apply your changes to the latest version"
            raise error(409, "Conflict", msg, name=key[2], kind=key[0].plural)
        if status:  # the /status subresource: only the status changes
            new = dict(copy.deepcopy(old), status=new.get("status"))
        elif "status" in self._resources[key[0]].subresources:  # the main resource: status kept
            new["status"] = copy.deepcopy(old.get("status"))
        new = {k: v for k, v in new.items() if v is not None or k != "status"}
        new["apiVersion"], new["kind"], meta = old["apiVersion"], old["kind"], new["metadata"]
        for field in SERVER_FIELDS:
            meta.pop(field, None)
            meta.update({field: old["metadata"][field]} if field in old["metadata"] else {})
        self._check_owners(new)
        added = set(meta.get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
        if meta.get("deletionTimestamp") and added:
            raise error(
                422, "Invalid", "no new finalizers can be added if the object is being deleted"
            )
        if new == old:
            return new
        meta["generation"] = meta.get("generation", 0) + (_spec(new) != _spec(old))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(key, new)  # one DELETED event, as on a real server
        self._stamp(new)
        self._objects[key].history.append(new)
        return self._emit(key, "MODIFIED", new)

    def _delete(self, key: Key, preconditions: dict[str, Any]) -> Obj:
        obj = self._get(key)
        meta = obj["metadata"]
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) not in (None, meta.get(field)):
                raise error(
                    409,
                    "Conflict",
                    f"precondition failed: {field}",
                    name=key[2],
                    kind=key[0].plural,
                )
        if meta.get("deletionTimestamp"):
            return obj
        if not meta.get("finalizers"):
            return self._remove(key, obj)
        meta.update(deletionTimestamp=self._now(), deletionGracePeriodSeconds=0)
        self._stamp(obj)
        self._objects[key].history.append(obj)
        return self._emit(key, "MODIFIED", obj)

    def _remove(self, key: Key, obj: Obj) -> Obj:
        self._stamp(obj)
        self._objects[key].history.append(obj)
        self._objects[key].delete()
        return self._emit(key, "DELETED", obj)

    def _collect_garbage(self) -> None:
        """Delete the dependents whose owners (by uid) are all gone; repeat for their dependents."""
        self._gc_pending = False
        while True:
            live = {
                o.get("metadata", {}).get("uid") for o in self._objects.values() if not o.deleted
            }
            orphans = [
                key
                for key, o in self._objects.items()
                if not o.deleted and (meta := o.get("metadata", {})).get("ownerReferences")
                if not meta.get("deletionTimestamp")
                if not any(ref.get("uid") in live for ref in meta["ownerReferences"])
            ]
            if not orphans:
                return
            for key in orphans:
                self._delete(key, {})

    def _check_owners(self, obj: Obj) -> None:
        for ref in obj["metadata"].get("ownerReferences") or []:
            if not all(
                isinstance(ref, dict) and ref.get(f) for f in ("apiVersion", "kind", "name", "uid")
            ):
                raise error(
                    422, "Invalid", f"ownerReferences need apiVersion, kind, name, uid: {ref}"
                )

    def _find(self, key: Key) -> Obj | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _get(self, key: Key) -> Obj:
        if (obj := self._find(key)) is None:
            plural = key[0].plural
            raise error(404, "NotFound", f'{plural} "{key[2]}" not found', name=key[2], kind=plural)
        obj.setdefault("metadata", {}).setdefault("resourceVersion", "0")  # if seeded by a test
        obj.setdefault("apiVersion", "")
        obj.setdefault("kind", "")
        return obj

    def _stamp(self, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def _emit(self, key: Key, kind: str, obj: Obj) -> Obj:
        self._log.append((self._rv, key[0], key[1], kind, copy.deepcopy(obj)))
        self._notify()
        if not self._gc_pending:  # after this request: the owner may be gone, or never existed
            self._gc_pending = True
            asyncio.get_running_loop().call_soon(self._collect_garbage)
        return obj

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @staticmethod
    def _now() -> str:
        return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    # Reads.

    def _matcher(self, request: rendering.Request) -> Callable[[str | None, Obj], bool]:
        labels = _label_selector(request.params.get("labelSelector", ""))
        fields = _field_selector(request.params.get("fieldSelector", ""))

        def match(ns: str | None, obj: Obj) -> bool:
            meta = obj.get("metadata", {})
            return (
                request.namespace in (None, ns)
                and request.name in (None, meta.get("name"))
                and all(p(meta.get("labels") or {}) for p in labels)
                and all(p(obj) for p in fields)
            )

        return match

    def _select(self, request: rendering.Request) -> list[tuple[Key, Obj]]:
        match = self._matcher(request)
        return [
            (key, o.raw)
            for key, o in self._objects.items()
            if key[0] == request.resource and not o.deleted and match(key[1], o.raw)
        ]

    async def _serve_result(self, request: rendering.Request) -> rendering.Payload:
        return self._results[request]

    _serve_create = _serve_update = _serve_delete = _serve_result

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        assert request.resource is not None
        return self._get((request.resource, request.namespace, request.name or ""))

    def _info(self, res: kmock.resource | None) -> kmock.ResourceInfo:
        if res is None or res not in self._get_resources():
            raise error(404, "NotFound", "the server could not find the requested resource")
        return self._resources[res]

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        info = self._info(request.resource)
        items = [obj for _, obj in self._select(request)]
        return {
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        self._info(request.resource)  # errors before streaming: 404, 400
        match, since = self._matcher(request), _rv_param(request)
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        yield b""  # send the headers now
        # The snapshot and the log position are taken at once: nothing is lost or duplicated.
        if since:
            events = [
                (t, o)
                for rv, r, ns, t, o in self._log
                if r == request.resource and rv > since and match(ns, o)
            ]
        else:
            events = [("ADDED", obj) for _, obj in self._select(request)]
        pos = len(self._log)
        self._watches[request.resource] += 1
        self._notify()
        for kind, obj in events:
            yield {"type": kind, "object": obj}
        while True:
            while pos < len(self._log):
                _, res, ns, kind, obj = self._log[pos]
                pos += 1
                if res == request.resource and match(ns, obj):
                    yield {"type": kind, "object": obj}
            changed = self._changed
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return
