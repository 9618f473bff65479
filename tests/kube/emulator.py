"""A Kubernetes API server emulator for operator tests: kmock's emulator made more realistic.

Built on, and relying on the private internals of, **kmock 0.8** (``KubernetesEmulator``'s
``_objects``, ``_resources``, ``_get_resources()``, ``_serve_*`` fallbacks, ``_render_error``;
``kmock._internal.parsing.parse_path``, ``dicts.patch_dict``). Upgrade kmock only with this file.

Emulated, on top of stock kmock (discovery, objects in memory, list/watch/get/post/patch/delete):

* server-set ``metadata.uid``, ``creationTimestamp``, ``generation`` (1, then +1 when anything
  but ``metadata``/``status`` changes) and ``resourceVersion`` (one global counter, bumped on
  every write, incl. setting ``deletionTimestamp`` and the removal); no-op writes change nothing;
* ``apiVersion``, ``kind``, ``metadata.namespace`` set from the URL (another namespace in the
  body: 400); ``generateName``; creating in a missing Namespace: 404; creates answer 201;
  a Secret's ``stringData`` is folded into ``data`` (base64);
* errors as ``kind: Status`` bodies: 404 NotFound, 409 AlreadyExists, 409 Conflict (a stale
  ``metadata.resourceVersion`` in a PATCH/PUT body, or DELETE ``preconditions``), 422 Invalid (a
  failed JSON-patch ``test`` op, a bad patch, ownerReferences without ``uid``, new finalizers on
  a deleted object), 400 (bad selectors), 415 (server-side apply); a create body with a
  ``resourceVersion`` is a 500, as on a real server. They are not counted in ``.errors``;
* PUT (replace) and DELETE of a collection;
* the status subresource, for resources declaring ``status``: a ``/status`` write changes only
  ``status``; a main write or a create ignores ``status``; writes to other subresources are 404;
* lists carry the current ``resourceVersion``; a watch with ``?resourceVersion=N`` replays the
  recorded events newer than N (without it: ADDED for each current object), then live events,
  with nothing lost or repeated; ``timeoutSeconds`` ends the stream;
* ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a)``)
  and ``fieldSelector`` (``=``, ``==``, ``!=`` on any dotted path, e.g. ``metadata.name``) in
  list, watch and delete-collection;
* finalizers: DELETE sets ``deletionTimestamp``; removing the last finalizer removes the object
  (one DELETED event); DELETE without finalizers removes it at once;
* background garbage collection, after every write: objects whose ``ownerReferences`` uids all
  belong to no existing object are deleted as above (finalizers respected), transitively;
* ``/api/v1/namespaces[/name[/status]]`` works (stock kmock 0.8 answers 500).

Not emulated: schema validation, defaulting, pruning, CEL rules, admission (webhooks, quotas),
RBAC, authentication (any token; plain HTTP), strategic merge (done as a JSON merge patch: lists
are replaced, not merged by key), server-side apply, dry-run, CRD objects becoming resources
(declare them in ``.resources``), controllers (no kubelet: pods never run; no namespace
controller: a deleted Namespace leaves its contents), foreground/orphan propagation, grace
periods, BOOKMARKs, 410 Gone (the event log is never compacted), ADDED/DELETED when an object
enters/leaves a watch's selector (it is filtered on its new state), ``resourceVersion`` on
GET/LIST (always the latest), managedFields, field-selector validation per resource.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import re
import secrets
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, enums, parsing, rendering

Obj = dict[str, Any]
Key = tuple[kmock.resource, str | None, str]
NAMESPACES, SECRETS = kmock.resource("", "v1", "namespaces"), kmock.resource("", "v1", "secrets")
SERVER_FIELDS: tuple[str, ...] = ("name", "namespace", "uid", "creationTimestamp", "generation")
SERVER_FIELDS += ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds")
PATCH_ERRORS = (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, ValueError, TypeError)
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # generateName suffixes, as Kubernetes makes them
_stock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """Fix kmock 0.8: ``/api/v1/namespaces[/x[/status]]`` is the Namespace resource itself."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) < 5 or parts[4] == "status"):
        name = parts[3] if len(parts) > 3 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, "/".join(parts[4:]) or None)
    return _stock_parse_path(path)


parsing.parse_path = _parse_path  # a fix only: every other path parses as before


def error(code: int, reason: str, message: str, key: Key | None = None) -> kmock.KubernetesError:
    details: dict[str, Any] = {"name": key[2], "kind": key[0].plural} if key else {"causes": []}
    return kmock.KubernetesError(code, reason, message, details)


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec(obj: Obj) -> Obj:
    """What changes the generation: all but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """See the module docstring. Use like ``kmock.KubernetesEmulator`` (with ``kmock.Server``)."""

    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, Key, str, Obj]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _gc_pending: bool = attrs.field(default=False, init=False)
    _results: dict[rendering.Request, Obj] = attrs.field(factory=dict, init=False)
    _watches: Counter[kmock.resource] = attrs.field(factory=Counter, init=False)
    # kmock matches each request against every recorded one: O(history). A long run (the
    # benchmark) keeps only the last requests; tests keep all, to assert on them.
    keep_requests: int | None = attrs.field(default=None, kw_only=True)

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
        if self.keep_requests is not None and len(self._requests) > self.keep_requests:
            del self._requests[: -max(1, self.keep_requests)]  # this request is the last
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
                response.set_status(201)  # the kubernetes client returns None on a 200
            return response
        except kmock.KubernetesError as e:  # an API answer, not an emulator failure
            return await self._render_error(e)
        finally:
            self._results.pop(request, None)

    # Writes: synchronous (so atomic in the event loop), on deep copies, a new version each.

    def _write(self, request: rendering.Request) -> Obj:
        res, ns, data = self._info(request.resource)[0], request.namespace, request.data
        if request.subresource not in (None, *({"status"} & self._resources[res].subresources)):
            raise error(404, "NotFound", f"no such subresource: {request.subresource}")
        if request.action == enums.action.CREATE:
            return self._create(res, ns, data)
        if request.method == enums.method.DELETE:
            pre = data.get("preconditions") or {} if isinstance(data, dict) else {}
            if request.name is not None:
                return self._delete((res, ns, request.name), pre)
            keys = [k for k, o in self._select(request) if "deletionTimestamp" not in o["metadata"]]
            return {"kind": "List", "items": [self._delete(key, pre) for key in keys]}
        key = (res, ns, request.name or "")
        old, ctype = self._get(key), request.headers.get("Content-Type", "")
        if request.method == enums.method.PUT:
            new = data
        elif "apply-patch" in ctype:
            raise error(415, "UnsupportedMediaType", "server-side apply is not emulated")
        else:
            try:
                new = dicts.patch_dict(old, data)  # a merge patch (dict) or a JSON patch (list)
            except PATCH_ERRORS as e:
                raise error(422, "Invalid", f"the patch cannot be applied: {e}") from None
        return self._update(key, old, new, status=request.subresource == "status")

    def _create(self, res: kmock.resource, ns: str | None, data: Any) -> Obj:
        obj, info = self._typed(res, data), self._resources[res]
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise error(500, "InternalError", "resourceVersion should not be set on create")
        if ns is not None and meta.get("namespace") not in (None, "", ns):
            raise error(400, "BadRequest", "the namespace of the object differs from the URL's")
        ns = (ns or meta.get("namespace")) if info.namespaced is not False else None
        if ns is not None and NAMESPACES in self._get_resources():
            if (space := self._find((NAMESPACES, None, ns))) is None:
                raise error(404, "NotFound", f'namespaces "{ns}" not found', (NAMESPACES, None, ns))
            if space.get("metadata", {}).get("deletionTimestamp"):
                raise error(403, "Forbidden", f"namespace {ns} is being terminated")
        while not meta.get("name") and meta.get("generateName"):
            name = meta["generateName"] + "".join(secrets.choice(_ALPHABET) for _ in range(5))
            meta["name"] = None if self._find((res, ns, name)) else name
        if not meta.get("name"):
            raise error(422, "Invalid", "metadata.name or metadata.generateName is required")
        if self._find(key := (res, ns, meta["name"])) is not None:
            raise error(409, "AlreadyExists", f'{res.plural} "{key[2]}" already exists', key)
        for field in ("namespace", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        meta.update({"namespace": ns} if ns else {}, uid=str(uuid.uuid4()), generation=1)
        meta["creationTimestamp"] = _now()
        if "status" in info.subresources:
            obj.pop("status", None)
        return self._commit(key, "ADDED", obj)

    def _update(self, key: Key, old: Obj, new: Any, *, status: bool) -> Obj:
        new = self._typed(key[0], new)  # a merge patch shares the unchanged parts with the old one
        rv, old_rv = new["metadata"].get("resourceVersion"), old["metadata"]["resourceVersion"]
        if rv and rv != old_rv:
            msg = "the object has been modified; please apply your changes to the latest version"
            raise error(409, "Conflict", msg, key)
        if status:  # the /status subresource: only the status changes
            new = dict(copy.deepcopy(old), status=new.get("status"))
        elif "status" in self._resources[key[0]].subresources:  # the main resource: status kept
            new["status"] = copy.deepcopy(old.get("status"))
        new = {k: v for k, v in new.items() if v is not None or k != "status"}
        meta, old_meta = new["metadata"], old["metadata"]
        for field in SERVER_FIELDS:
            meta.pop(field, None)
            meta.update({field: old_meta[field]} if field in old_meta else {})
        added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
        if meta.get("deletionTimestamp") and added:
            raise error(422, "Invalid", "no new finalizers can be added to a deleted object", key)
        if new == old:
            return old
        meta["generation"] = meta.get("generation", 0) + (_spec(new) != _spec(old))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._commit(key, "DELETED", new)  # one DELETED event, as on a real server
        return self._commit(key, "MODIFIED", new)

    def _delete(self, key: Key, preconditions: dict[str, Any]) -> Obj:
        obj = self._get(key)
        meta = obj["metadata"]
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) not in (None, meta.get(field)):
                raise error(409, "Conflict", f"precondition failed: {field}", key)
        if meta.get("deletionTimestamp"):
            return obj
        if not meta.get("finalizers"):
            return self._commit(key, "DELETED", obj)
        meta["deletionTimestamp"] = _now()
        meta["deletionGracePeriodSeconds"] = 0
        return self._commit(key, "MODIFIED", obj)

    def _collect_garbage(self) -> None:
        """Delete the dependents whose owners (by uid) are all gone; repeat for their dependents."""
        self._gc_pending = False
        while True:
            live = {o.get("metadata", {}).get("uid") for o in self._objects.values() if o}
            orphans = [
                key
                for key, o in self._objects.items()
                if o and (refs := o.get("metadata", {}).get("ownerReferences"))
                if not o["metadata"].get("deletionTimestamp")
                if not any(ref.get("uid") in live for ref in refs)
            ]
            if not orphans:
                return
            for key in orphans:
                self._delete(key, {})

    def _typed(self, res: kmock.resource, data: Any) -> Obj:
        """A copy of a body, checked, with apiVersion and kind as the URL says."""
        obj = copy.deepcopy(data)
        if not isinstance(obj, dict) or not isinstance(obj.setdefault("metadata", {}), dict):
            raise error(400, "BadRequest", "the body must be an object with a metadata object")
        for ref in obj["metadata"].get("ownerReferences") or []:
            if not all(ref.get(f) for f in ("apiVersion", "kind", "name", "uid")):
                raise error(422, "Invalid", f"ownerReferences need apiVersion/kind/name/uid: {ref}")
        if res == SECRETS and (string_data := obj.pop("stringData", None)):  # folded into data
            b64 = {k: base64.b64encode(str(v).encode()).decode() for k, v in string_data.items()}
            obj["data"] = {**(obj.get("data") or {}), **b64}
        obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        obj["kind"] = self._resources[res].kind or obj.get("kind") or res.plural
        return obj

    def _find(self, key: Key) -> Obj | None:
        if key not in self._objects or not self._objects[key]:
            return None  # absent or soft-deleted
        return copy.deepcopy(self._objects[key].raw)

    def _get(self, key: Key) -> Obj:
        if (obj := self._find(key)) is None:
            raise error(404, "NotFound", f'{key[0].plural} "{key[2]}" not found', key)
        obj.setdefault("metadata", {}).setdefault("resourceVersion", "0")  # if seeded by a test
        return obj

    def _commit(self, key: Key, kind: str, obj: Obj) -> Obj:
        """Store a new version (or the removal) with a new resourceVersion, and announce it."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if key in self._objects:
            self._objects[key].history.append(obj)
        else:
            self._objects[key] = obj
        if kind == "DELETED":
            self._objects[key].delete()
        self._log.append((self._rv, key, kind, copy.deepcopy(obj)))
        self._notify()
        if not self._gc_pending:  # after this request: the owner may be gone, or never existed
            self._gc_pending = True
            asyncio.get_running_loop().call_soon(self._collect_garbage)
        return obj

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # Reads.

    def _info(self, res: kmock.resource | None) -> tuple[kmock.resource, kmock.ResourceInfo]:
        if res is None or res not in self._get_resources():
            raise error(404, "NotFound", "the server could not find the requested resource")
        return res, self._resources[res]

    def _matcher(self, request: rendering.Request) -> Callable[[Key, Obj], bool]:
        labels = _label_selector(request.params.get("labelSelector", ""))
        fields = _field_selector(request.params.get("fieldSelector", ""))

        def match(key: Key, obj: Obj) -> bool:
            meta = obj.get("metadata", {})
            return (
                (key[0], key[1] if request.namespace else None, key[2] if request.name else None)
                == (request.resource, request.namespace, request.name)
                and all(p(meta.get("labels") or {}) for p in labels)
                and all(p(obj) for p in fields)
            )

        return match

    def _select(self, request: rendering.Request) -> list[tuple[Key, Obj]]:
        match = self._matcher(request)
        return [(key, o.raw) for key, o in self._objects.items() if o and match(key, o.raw)]

    async def _serve_result(self, request: rendering.Request) -> rendering.Payload:
        return self._results[request]

    _serve_create = _serve_update = _serve_delete = _serve_result

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        return self._get((self._info(request.resource)[0], request.namespace, request.name or ""))

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        kind, items = self._info(request.resource)[1].kind, [o for _, o in self._select(request)]
        meta = {"resourceVersion": str(self._rv)}
        return {"kind": f"{kind}List", "metadata": meta, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        res = self._info(request.resource)[0]  # errors before streaming: 404, 400
        match, since = self._matcher(request), request.params.get("resourceVersion") or "0"
        if not since.isdigit():
            raise error(400, "BadRequest", f"invalid resourceVersion: {since!r}")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        yield b""  # send the headers now
        # The snapshot and the log position are taken at once: nothing is lost or repeated.
        if int(since):
            events = [(t, o) for rv, k, t, o in self._log if rv > int(since) and match(k, o)]
        else:
            events = [("ADDED", obj) for _, obj in self._select(request)]
        pos = len(self._log)
        self._watches[res] += 1
        self._notify()
        for kind, obj in events:
            yield {"type": kind, "object": obj}
        while True:
            while pos < len(self._log):
                _, key, kind, obj = self._log[pos]
                pos += 1
                if match(key, obj):
                    yield {"type": kind, "object": obj}
            changed = self._changed
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return
