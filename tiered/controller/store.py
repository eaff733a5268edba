"""The local system's state store: one SQLite file, written in transactions.

Holds what Kubernetes would hold for the cluster backend: each TieredModel's
spec (with a generation that bumps only when the spec changes) and its status
(the same `TieredModelStatus` as on Kubernetes), under a revision that bumps on every write so
that a stale write is refused (`Conflict`) instead of lost, as a
resourceVersion does. A bounded history of rollout snapshots feeds
`tiered rollout status` and the report. Everything a restarted controller
needs is here.

Durability: write-ahead logging with `synchronous=FULL`, so each commit
fsyncs the log before it returns and a committed write survives a power loss
(NORMAL, SQLite's cheaper WAL setting, may lose the last commits; some builds
default to it, so it is set on every connection).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tiered.errors import ConfigError, Conflict, NotFound

HISTORY_LIMIT = 20_000  # snapshots kept per model; older ones are dropped
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name        TEXT PRIMARY KEY,
    spec        TEXT NOT NULL,
    generation  INTEGER NOT NULL,
    status      TEXT,
    revision    INTEGER NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS history (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT NOT NULL,
    t           REAL NOT NULL,
    snapshot    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_by_name ON history (name, id);
"""


@dataclass(frozen=True)
class Record:
    """One TieredModel as stored: plain JSON data, decoded by the caller."""

    name: str
    spec: Mapping[str, Any]
    generation: int
    status: Mapping[str, Any] | None
    revision: int
    updated_at: float


class ModelStore(Protocol):
    """Where the user's verbs keep TieredModels (`controller/verbs.py`, written
    once against it): the local system's SQLite store (`StateStore`) or a
    cluster's TieredModel resources (`kube.cluster.ClusterStore`)."""

    def get(self, name: str) -> Record:
        """The model; NotFound when none of that name is applied."""

    def list(self) -> list[Record]: ...

    def apply(self, name: str, spec: Mapping[str, Any]) -> Record:
        """Create or update a model; its generation moves only when its spec changes."""

    def write_status(self, name: str, revision: Any, *, status: Mapping[str, Any] | None
                     ) -> Any:
        """Replace the status if the model is still at `revision`; Conflict if not."""

    def record(self, name: str, snapshot: Mapping[str, Any], t: float | None = None) -> None:
        """Keep a rollout step's snapshot (its record form)."""

    def history(self, name: str | None = None, after_id: Any = 0
                ) -> list[tuple[Any, float, dict[str, Any]]]:
        """(id, time, snapshot record) in order, those after `after_id`."""


class StateStore:
    """Open (creating when missing) the store at `path`; safe across processes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private when new
        try:
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S,
                                       isolation_level=None)  # explicit transactions
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # per connection; see the docstring
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as error:
            raise ConfigError(f"state store {self.path}: cannot open: {error}") from error

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled back already (disk full)
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as error:  # corrupt file, disk full, locked too long
            raise ConfigError(f"state store {self.path}: {error}; nothing was written") from error

    # -- models ---------------------------------------------------------------

    def apply(self, name: str, spec: Mapping[str, Any]) -> Record:
        """Create or update a model's spec; the generation bumps only on change."""
        text = json.dumps(spec, sort_keys=True)
        with self._transaction() as db:
            row = db.execute("SELECT spec, generation FROM models WHERE name = ?",
                             (name,)).fetchone()
            if row is None:
                db.execute("INSERT INTO models (name, spec, generation, revision, updated_at) "
                           "VALUES (?, ?, 1, 1, ?)", (name, text, time.time()))
            elif row[0] != text:
                db.execute("UPDATE models SET spec = ?, generation = generation + 1, "
                           "revision = revision + 1, updated_at = ? WHERE name = ?",
                           (text, time.time(), name))
        return self.get(name)

    def get(self, name: str) -> Record:
        row = self._query("SELECT * FROM models WHERE name = ?", (name,))
        if not row:
            known = ", ".join(r.name for r in self.list()) or "none"
            raise NotFound(f"model {name!r} is not applied (applied: {known})")
        return _record(row[0])

    def list(self) -> list[Record]:
        return [_record(row) for row in self._query("SELECT * FROM models ORDER BY name")]

    def write_status(self, name: str, revision: int, *, status: Mapping[str, Any] | None
                     ) -> Record:
        """Replace the status if the record is still at `revision`."""
        with self._transaction() as db:
            updated = db.execute(
                "UPDATE models SET status = ?, revision = revision + 1, updated_at = ? "
                "WHERE name = ? AND revision = ?",
                (None if status is None else json.dumps(status, sort_keys=True),
                 time.time(), name, revision))
            if updated.rowcount != 1:
                exists = db.execute("SELECT 1 FROM models WHERE name = ?", (name,)).fetchone()
                if exists is None:
                    raise NotFound(f"model {name!r} is not applied")
                raise Conflict(f"model {name!r} changed since revision {revision}; re-read it")
        return self.get(name)

    def delete(self, name: str) -> None:
        with self._transaction() as db:
            if db.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount != 1:
                raise NotFound(f"model {name!r} is not applied")
            db.execute("DELETE FROM history WHERE name = ?", (name,))

    # -- history --------------------------------------------------------------

    def record(self, name: str, snapshot: Mapping[str, Any], t: float | None = None) -> None:
        """Append one snapshot; the oldest beyond HISTORY_LIMIT are dropped."""
        with self._transaction() as db:
            db.execute("INSERT INTO history (name, t, snapshot) VALUES (?, ?, ?)",
                       (name, time.time() if t is None else t,
                        json.dumps(snapshot, sort_keys=True)))
            db.execute("DELETE FROM history WHERE name = ? AND id <= (SELECT id FROM history "
                       "WHERE name = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                       (name, name, HISTORY_LIMIT))

    def history(self, name: str | None = None, after_id: int = 0
                ) -> list[tuple[int, float, dict[str, Any]]]:
        """(id, time, snapshot) in order; pass the last id seen to get only newer ones."""
        sql, args = "SELECT id, t, snapshot FROM history WHERE id > ?", [after_id]
        if name is not None:
            sql, args = sql + " AND name = ?", [*args, name]
        return [(row["id"], row["t"], json.loads(row["snapshot"]))
                for row in self._query(sql + " ORDER BY id", tuple(args))]

    def _query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        try:
            cursor = self._db.execute(sql, args)
            names = [c[0] for c in cursor.description]
            return [dict(zip(names, row)) for row in cursor.fetchall()]
        except sqlite3.DatabaseError as error:
            raise ConfigError(f"state store {self.path}: {error}") from error


def _record(row: Mapping[str, Any]) -> Record:
    return Record(
        name=row["name"], spec=json.loads(row["spec"]), generation=row["generation"],
        status=None if row["status"] is None else json.loads(row["status"]),
        revision=row["revision"], updated_at=row["updated_at"],
    )
