"""The session file's schema: the frozen v1 statements, the migrations that
bring an older file forward (:data:`MIGRATIONS`) and the constants of the file
format (see :mod:`core.session`, "Schema").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from functools import cache

from core.session.records import _mask_array, _mask_sha
from core.session.stored import StoredValueError, json_value

SCHEMA_VERSION = 2
APPLICATION_ID = 0x564C4D52  # "VLMR" in the SQLite header: this file is a session
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 10.0
SYNCHRONOUS = "FULL"

# ---------------------------------------------------------------- schema and migrations

# Frozen: the statements that made a v1 file. Never edit; add a migration.
_V1 = [
    "CREATE TABLE schema_version (version INTEGER NOT NULL, applied TEXT NOT NULL)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE model (id INTEGER PRIMARY KEY, spec TEXT NOT NULL, fingerprint TEXT, family TEXT, "
    "added TEXT NOT NULL)",
    "CREATE TABLE images (sha256 TEXT PRIMARY KEY, path TEXT, width INTEGER, height INTEGER, added TEXT NOT NULL)",
    "CREATE TABLE masks (id INTEGER PRIMARY KEY, image_sha256 TEXT REFERENCES images(sha256), png BLOB NOT NULL, "
    "added TEXT NOT NULL)",
    "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, created TEXT NOT NULL, "
    "model_id INTEGER REFERENCES model(id), image_sha256 TEXT REFERENCES images(sha256), "
    "mask_id INTEGER REFERENCES masks(id), parameters TEXT NOT NULL, result TEXT NOT NULL)",
    "CREATE TABLE audit_rows (run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE, ord INTEGER NOT NULL, "
    "method TEXT, question TEXT, operation TEXT, controls TEXT, supports TEXT, cannot_support TEXT, "
    "parameters TEXT, notes TEXT, PRIMARY KEY (run_id, ord))",
    f"PRAGMA application_id = {APPLICATION_ID}",
]


def _to_v1(conn: sqlite3.Connection) -> None:
    for stmt in _V1:
        conn.execute(stmt)


def _to_v2(conn: sqlite3.Connection) -> None:
    """Image pixels, mask hashes and sizes, model info, run summaries (backfilled)."""
    conn.execute("ALTER TABLE images ADD COLUMN png BLOB")
    conn.execute("ALTER TABLE masks ADD COLUMN sha256 TEXT")
    conn.execute("ALTER TABLE masks ADD COLUMN width INTEGER")
    conn.execute("ALTER TABLE masks ADD COLUMN height INTEGER")
    conn.execute("ALTER TABLE model ADD COLUMN info TEXT")
    conn.execute("ALTER TABLE runs ADD COLUMN summary TEXT NOT NULL DEFAULT ''")
    for mask_id, png in conn.execute("SELECT id, png FROM masks").fetchall():
        try:
            m = _mask_array(png)
        except Exception:  # noqa: BLE001 - a mask v1 kept that PIL cannot read stays without a hash
            continue
        conn.execute(
            "UPDATE masks SET sha256 = ?, width = ?, height = ? WHERE id = ?",
            (_mask_sha(m), int(m.shape[1]), int(m.shape[0]), mask_id),
        )
    for run_id, kind, result in conn.execute("SELECT id, kind, result FROM runs").fetchall():
        conn.execute("UPDATE runs SET summary = ? WHERE id = ?", (_stored_summary(kind, result), run_id))
    conn.execute("CREATE INDEX runs_kind ON runs(kind)")
    conn.execute("CREATE INDEX masks_sha ON masks(sha256)")


def _stored_summary(kind: str, result_json: str) -> str:
    """A v1 run's one line, read from its stored JSON by the result class of its
    kind (the class's own ``summary_of``); ``""`` for a kind without one or a
    document it cannot read."""
    # Imported here: the result modules load torch, needed only when a v1 file with runs is migrated.
    from core.analyze import AnalyzeResult
    from core.methods.counterfactual.effect import RegionCounterfactual
    from core.methods.counterfactual.sweep import OcclusionMap

    summary_of = {
        "analyze": lambda doc: AnalyzeResult.from_dict(doc).summary(),
        "counterfactual": RegionCounterfactual.summary_of,
        "sweep": OcclusionMap.summary_of,
    }.get(kind)
    if summary_of is None:
        return ""
    try:  # the stored JSON read with its size and nesting bounded (a file from elsewhere)
        return " ".join(summary_of(json_value(result_json, "result")).split())
    except (StoredValueError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError):
        return ""  # a v1 document of another shape: no summary


# MIGRATIONS[v] takes a file from version v to v + 1.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _to_v1, 1: _to_v2}
assert len(MIGRATIONS) == SCHEMA_VERSION


@cache
def expected_columns(version: int) -> dict[str, dict[str, tuple[str, int]]]:
    """``{table: {column: (declared type, primary-key position)}}`` of a session
    file at schema ``version`` (1 .. :data:`SCHEMA_VERSION`), read from a
    database the migrations build in memory: the one description of the
    format, so the checks on opening a file never drift from what the
    migrations make. (A run's ``id`` is ``INTEGER PRIMARY KEY``: always a whole number.)"""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        for v in range(version):
            MIGRATIONS[v](conn)
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: {r[1]: (r[2].upper(), r[5]) for r in conn.execute(f'PRAGMA table_info("{t}")')} for t in tables}
    finally:
        conn.close()
