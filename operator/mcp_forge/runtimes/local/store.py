"""The local store: KernelSessions kept on disk in SQLite, as a cluster would keep them.

One row per session: the whole object (metadata, spec, status) as JSON, plus its
connection key, which never appears in the object. KernelSessionPools have a table of
their own; their kernels are sessions labelled with the pool until one is claimed.
Secrets (the values sessions' env may take) have one too.
Writes are transactions, so a crash never leaves half an object; SQLite's locking lets
the CLI and a running gateway share the file.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from mcp_forge.errors import InvalidSession, SessionNotFound

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    key TEXT NOT NULL,
    private TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (namespace, name)
)
"""
_POOLS = """
CREATE TABLE IF NOT EXISTS pools (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (namespace, name)
)
"""

# Secrets (core/v1) that sessions' env takes values from: the body with `data` in base64,
# as the API server keeps them. The file is 0600 in a 0700 directory, like the keys; no
# method here logs or puts a value in an error.
_SECRETS = """
CREATE TABLE IF NOT EXISTS secrets (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (namespace, name)
)
"""

# What gateways share (api/quota.py): each client's reservations of sessions being made.
_RESERVATIONS = """
CREATE TABLE IF NOT EXISTS reservations (
    namespace TEXT NOT NULL,
    owner TEXT NOT NULL,
    names TEXT NOT NULL,
    PRIMARY KEY (namespace, owner)
)
"""


class Claimed(NamedTuple):
    """Another stored session, as `Store.claim` shows it to its `choose`."""

    namespace: str
    body: dict[str, Any]
    value: Any  # its value of the field claimed; None if it holds none


class Store:
    """KernelSession objects and their keys, in one SQLite file (mode 0600)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Made 0600 if new. Never open and close an existing one here: closing any
        # descriptor of the file drops every POSIX lock this process holds on it,
        # those of a connection of ours included, and another process could then write
        # under its feet (https://sqlite.org/howtocorrupt.html, 2.2).
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        # WAL: readers never wait for a writer, and a commit is one fsync of the log.
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
        finally:
            db.close()
        with self._db() as tx:
            tx.execute(_SCHEMA)
            tx.execute(_POOLS)
            tx.execute(_SECRETS)
            tx.execute(_RESERVATIONS)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One writing transaction on the process's connection, taken for writing at its
        start (BEGIN IMMEDIATE), so a read-modify-write such as patch_status is atomic
        across processes.

        The connection is kept (opening and closing one cost about a millisecond a
        transaction, a claim makes a dozen); the lock serializes threads on it.
        """
        with self._lock:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:
                self._drop()
                raise
            try:
                yield db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _rows(self, sql: str, *params: Any) -> builtins.list[tuple[Any, ...]]:
        """The rows of one SELECT. One statement reads one snapshot by itself: no
        BEGIN/COMMIT around it, which in WAL mode cost more than the read (about 0.1 ms,
        on each execute_code's session lookup)."""
        with self._lock:
            try:
                return self._connection().execute(sql, params).fetchall()
            except sqlite3.OperationalError:
                self._drop()  # a broken connection is opened anew by the next call
                raise

    def _one(self, sql: str, *params: Any) -> tuple[Any, ...] | None:
        rows = self._rows(sql, *params)
        return rows[0] if rows else None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            self._conn = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._pid = os.getpid()
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        row = self._one("SELECT body FROM sessions WHERE namespace=? AND name=?", namespace, name)
        if row is None:
            raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
        body: dict[str, Any] = json.loads(row[0])
        return body

    def key(self, namespace: str, name: str) -> str:
        row = self._one("SELECT key FROM sessions WHERE namespace=? AND name=?", namespace, name)
        if row is None:
            raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
        return str(row[0])

    def private(self, namespace: str, name: str) -> dict[str, Any]:
        """Bookkeeping of local mode that is not part of the object."""
        row = self._one(
            "SELECT private FROM sessions WHERE namespace=? AND name=?", namespace, name
        )
        value: dict[str, Any] = json.loads(row[0]) if row else {}
        return value

    def set_private(self, namespace: str, name: str, value: dict[str, Any]) -> None:
        with self._db() as db:
            db.execute(
                "UPDATE sessions SET private=? WHERE namespace=? AND name=?",
                (json.dumps(value), namespace, name),
            )

    def claim(
        self,
        namespace: str,
        name: str,
        field: str,
        choose: Callable[[list[Claimed]], Any],
    ) -> Any:
        """Set the session's private `field` to what `choose` makes of every other stored
        session's value of it (with its body), in one transaction: what `choose` decides
        from cannot change before the value is written."""
        with self._db() as db:
            rows = db.execute("SELECT namespace, name, body, private FROM sessions").fetchall()
            others = [
                Claimed(ns, json.loads(b), json.loads(p).get(field))
                for ns, n, b, p in rows
                if (ns, n) != (namespace, name)
            ]
            mine = [json.loads(p) for ns, n, _, p in rows if (ns, n) == (namespace, name)]
            if not mine:
                raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
            value = choose(others)
            db.execute(
                "UPDATE sessions SET private=? WHERE namespace=? AND name=?",
                (json.dumps({**mine[0], field: value}), namespace, name),
            )
        return value

    def update_private(
        self, namespace: str, name: str, field: str, change: Callable[[Any], Any]
    ) -> Any:
        """Set the session's private `field` to `change(its value)` in one transaction;
        return the new value (SessionNotFound if there is no session)."""
        with self._db() as db:
            row = db.execute(
                "SELECT private FROM sessions WHERE namespace=? AND name=?", (namespace, name)
            ).fetchone()
            if row is None:
                raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
            kept: dict[str, Any] = json.loads(row[0]) if row[0] else {}
            value = change(kept.get(field))
            db.execute(
                "UPDATE sessions SET private=? WHERE namespace=? AND name=?",
                (json.dumps({**kept, field: value}), namespace, name),
            )
        return value

    def swap_reservations(
        self,
        namespace: str,
        owner: str,
        change: Callable[[builtins.list[dict[str, Any]], str], str],
    ) -> None:
        """Set `owner`'s reservations (JSON text) to what `change` makes of the namespace's
        session bodies and the reservations held, in one transaction (it may raise: then
        nothing changes)."""
        with self._db() as db:
            rows = db.execute("SELECT body FROM sessions WHERE namespace=?", (namespace,))
            bodies = [json.loads(r[0]) for r in rows.fetchall()]
            row = db.execute(
                "SELECT names FROM reservations WHERE namespace=? AND owner=?", (namespace, owner)
            ).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO reservations (namespace, owner, names) VALUES (?, ?, ?)",
                (namespace, owner, change(bodies, row[0] if row else "{}")),
            )

    def list(self, namespace: str | None = None) -> list[dict[str, Any]]:
        if namespace is None:
            rows = self._rows("SELECT body FROM sessions ORDER BY namespace, name")
        else:
            rows = self._rows(
                "SELECT body FROM sessions WHERE namespace=? ORDER BY name", namespace
            )
        return [json.loads(r[0]) for r in rows]

    def create(self, body: dict[str, Any], key: str) -> None:
        meta = body["metadata"]
        try:
            with self._db() as db:
                db.execute(
                    "INSERT INTO sessions (namespace, name, body, key) VALUES (?, ?, ?, ?)",
                    (meta["namespace"], meta["name"], json.dumps(body), key),
                )
        except sqlite3.IntegrityError:
            raise InvalidSession(
                f"a KernelSession named {meta['name']!r} exists already", field="metadata.name"
            ) from None

    def replace(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        with self._db() as db:
            cur = db.execute(
                "UPDATE sessions SET body=? WHERE namespace=? AND name=?",
                (json.dumps(body), meta["namespace"], meta["name"]),
            )
            if cur.rowcount == 0:
                raise SessionNotFound(f"no KernelSession {meta['name']!r}")

    def patch_status(
        self,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        private: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Merge `patch` into status and `private` into the bookkeeping (None deletes a
        key) in one transaction; return the body."""
        with self._db() as db:
            row = db.execute(
                "SELECT body, private FROM sessions WHERE namespace=? AND name=?",
                (namespace, name),
            ).fetchone()
            if row is None:
                raise SessionNotFound(f"no KernelSession {name!r} in namespace {namespace!r}")
            body: dict[str, Any] = json.loads(row[0])
            _merge(body.setdefault("status", {}), patch)
            db.execute(
                "UPDATE sessions SET body=? WHERE namespace=? AND name=?",
                (json.dumps(body), namespace, name),
            )
            if private:
                kept: dict[str, Any] = json.loads(row[1]) if row[1] else {}
                _merge(kept, private)
                db.execute(
                    "UPDATE sessions SET private=? WHERE namespace=? AND name=?",
                    (json.dumps(kept), namespace, name),
                )
        return body

    def delete(self, namespace: str, name: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM sessions WHERE namespace=? AND name=?", (namespace, name))

    def take(
        self,
        namespace: str,
        name: str,
        claimable: Callable[[dict[str, Any]], bool],
        make: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any] | None:
        """A pool's kernel becomes a session: if the stored `name` is still `claimable`,
        its row takes the body `make` builds from it (a new name; the key and the
        bookkeeping stay), in one transaction. None if it was claimable no longer;
        InvalidSession if the new name is taken."""
        with self._db() as db:
            row = db.execute(
                "SELECT body FROM sessions WHERE namespace=? AND name=?", (namespace, name)
            ).fetchone()
            if row is None or not claimable(json.loads(row[0])):
                return None
            body = make(json.loads(row[0]))
            new = body["metadata"]["name"]
            try:
                db.execute(
                    "UPDATE sessions SET name=?, body=? WHERE namespace=? AND name=?",
                    (new, json.dumps(body), namespace, name),
                )
            except sqlite3.IntegrityError:
                raise InvalidSession(
                    f"a KernelSession named {new!r} exists already", field="metadata.name"
                ) from None
        return body

    # ---- KernelSessionPools ----------------------------------------------------------------

    def put_pool(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO pools (namespace, name, body) VALUES (?, ?, ?)",
                (meta["namespace"], meta["name"], json.dumps(body)),
            )

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        row = self._one("SELECT body FROM pools WHERE namespace=? AND name=?", namespace, name)
        return json.loads(row[0]) if row else None

    def list_pools(self, namespace: str | None = None) -> builtins.list[dict[str, Any]]:
        rows = self._rows(
            "SELECT body FROM pools WHERE ? IS NULL OR namespace=? ORDER BY namespace, name",
            namespace,
            namespace,
        )
        return [json.loads(r[0]) for r in rows]

    def patch_pool_status(
        self,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        add: dict[str, int] | None = None,
    ) -> None:
        """Merge `patch` into the pool's status and add `add` to its counters, at once."""
        with self._db() as db:
            row = db.execute(
                "SELECT body FROM pools WHERE namespace=? AND name=?", (namespace, name)
            ).fetchone()
            if row is None:
                return
            body = json.loads(row[0])
            status = body.setdefault("status", {})
            _merge(status, patch)
            for k, n in (add or {}).items():
                status[k] = int(status.get(k) or 0) + n
            db.execute(
                "UPDATE pools SET body=? WHERE namespace=? AND name=?",
                (json.dumps(body), namespace, name),
            )

    def delete_pool(self, namespace: str, name: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM pools WHERE namespace=? AND name=?", (namespace, name))

    # ---- Secrets -----------------------------------------------------------------------------

    def put_secret(self, body: dict[str, Any]) -> str:
        """Store a (validated) Secret; "created", "configured" or "unchanged"."""
        meta = body["metadata"]
        with self._db() as db:
            row = db.execute(
                "SELECT body FROM secrets WHERE namespace=? AND name=?",
                (meta["namespace"], meta["name"]),
            ).fetchone()
            if row is not None and json.loads(row[0]) == body:
                return "unchanged"
            db.execute(
                "INSERT OR REPLACE INTO secrets (namespace, name, body) VALUES (?, ?, ?)",
                (meta["namespace"], meta["name"], json.dumps(body)),
            )
        return "created" if row is None else "configured"

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        row = self._one("SELECT body FROM secrets WHERE namespace=? AND name=?", namespace, name)
        return json.loads(row[0]) if row else None

    def list_secrets(self, namespace: str | None = None) -> builtins.list[dict[str, Any]]:
        rows = self._rows(
            "SELECT body FROM secrets WHERE ? IS NULL OR namespace=? ORDER BY namespace, name",
            namespace,
            namespace,
        )
        return [json.loads(r[0]) for r in rows]

    def delete_secret(self, namespace: str, name: str) -> bool:
        with self._db() as db:
            cur = db.execute("DELETE FROM secrets WHERE namespace=? AND name=?", (namespace, name))
        return cur.rowcount > 0


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        else:
            into[k] = v
