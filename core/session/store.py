"""The :class:`Session` object: opening, creating and migrating a session file,
recording a run in one transaction, the recorded-run events and the queries
(see :mod:`core.session`); :func:`check_session_file` and :func:`record_into`
for the command lines' ``--session FILE``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from core.files.atomic import no_space_reason
from core.results.readout import Readout, jsonable
from core.session import stored
from core.session.files import (
    BESIDE,
    backup_to,
    beside,
    check_beside,
    checkpoint_wal,
    read_header,
    replayed_copy,
)
from core.session.records import (
    _KIND_RE,
    AUDIT_COLUMNS,
    KINDS,
    RUN_COLUMNS,
    DamagedRunError,
    ImageInfo,
    Run,
    RunInfo,
    SessionError,
    _as_mask,
    _dumps,
    _exists,
    _mask_png,
    _mask_sha,
    _model_fields,
    _now,
    _prepare_image,
    _sqlite_problem,
    dataset_sha256,
    dtype_and_device,
    run_columns,
    stored_mask,
)
from core.session.schema import (
    APPLICATION_ID,
    BUSY_TIMEOUT_S,
    MIGRATIONS,
    SCHEMA_VERSION,
    SQLITE_MAGIC,
    SYNCHRONOUS,
    expected_columns,
)
from core.session.stored import StoredValueError

# Set on every connection to a file: a session from elsewhere is untrusted input (SQLite's advice for
# such files: no functions with side effects in its schema, cells checked as they are read).
# Sorts and temporary tables stay in memory: reading needs no temporary file (a full disk reads).
_FILE_PRAGMAS = ("PRAGMA trusted_schema = OFF", "PRAGMA cell_size_check = ON", "PRAGMA temp_store = MEMORY")

# ---------------------------------------------------------------- the session


class Session:
    """One session file. Open with :meth:`open`, :meth:`create` or
    :meth:`open_or_create`; use as a context manager or call :meth:`close`."""

    # Checkpoint the WAL into the main file after each recorded run (bench/session_checkpoint.py measures
    # the cost); False only to measure without it.
    checkpoint_each_run = True

    def __init__(self, path: Path, conn: sqlite3.Connection, *, read_only: bool = False):
        self.path = path
        self._read_only = read_only
        self._conn = conn
        self._lock = threading.RLock()
        self._callbacks: list[Callable[[RunInfo], None]] = []
        self.journal_mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        self._last_id = self._max_id()

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | Path, *, read_only: bool = False) -> Session:
        """Open an existing session, migrating an older schema forward.

        Args:
            read_only: never write to the file or beside it (what export
                does): the database is opened with SQLite's ``mode=ro`` (and
                ``immutable=1`` when no other connection has it open, so no
                ``-shm`` is made and a read-only folder reads); an older
                schema is migrated in a copy in memory; an empty file is
                refused; recording raises :class:`SessionError`.

        Raises:
            SessionError: no such file; not an SQLite database; another
                program's database; a corrupt file; a newer schema.
        """
        p = Path(path)
        if not _exists(p):
            raise SessionError(f"{p}: no such session file")
        header = read_header(p)  # a regular file only (a FIFO is refused, not waited on)
        if header and header[: len(SQLITE_MAGIC)] != SQLITE_MAGIC:
            raise SessionError(f"{p}: not a session file (not an SQLite database)")
        found = check_beside(p)  # SQLite's -wal / -shm / -journal beside it: regular files or none
        if read_only:
            if not header:
                raise SessionError(f"{p}: empty file, not a session")
            return cls._connect_read_only(p, header, found)
        return cls._connect(p, new=False)

    @classmethod
    def temporary(cls) -> Session:
        """A session in memory, saved nowhere (what the app records into when
        no session file can be opened; it says so)."""
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        p = Path(":memory:")
        cls._migrate(conn, p)
        s = cls(p, conn)
        with s._lock, s._transaction():
            s._conn.execute("INSERT INTO meta VALUES ('created', ?)", (_now(),))
            s._conn.execute("INSERT INTO meta VALUES ('store_images', '1')")
        return s

    @classmethod
    def _connect_read_only(cls, p: Path, header: bytes, found: dict[str, bool]) -> Session:
        """Open ``p`` for reading without writing to it or beside it.

        Header byte 18 is 2 for a WAL database. Without a -wal file no
        connection has it open, so it is read as immutable: SQLite then needs no
        -shm beside it. With a -wal and no -shm nobody has it open either, but
        SQLite would have to create the -shm to read the -wal: the file and its
        committed WAL transactions are read into memory instead
        (:func:`core.session.files.replayed_copy`), as they are when a -shm
        exists and SQLite still cannot use it (a full disk, a read-only folder).
        """
        wal_mode = len(header) > 18 and header[18] == 2
        if wal_mode and found["-wal"] and not found["-shm"]:
            conn = replayed_copy(p, "its -wal file could only be read by writing a -shm file beside it")
        else:
            immutable = wal_mode and not found["-wal"]
            uri = p.resolve().as_uri() + "?mode=ro" + ("&immutable=1" if immutable else "")
            conn = _sqlite_read_only(p, uri, wal_mode)
            if conn is None:  # SQLite could not use the -shm beside it: read the -wal without it
                conn = replayed_copy(p, "SQLite could not use its -shm file (a full disk or a read-only folder)")
        try:
            for pragma in _FILE_PRAGMAS:
                conn.execute(pragma)
            conn.execute("PRAGMA query_only=ON")
            version = cls._version(conn, p)
            if version > SCHEMA_VERSION:
                raise SessionError(
                    f"{p}: written by a newer VLM Readout (session schema {version}; this version reads up to "
                    f"{SCHEMA_VERSION}); upgrade to open it"
                )
            if version == 0:
                raise SessionError(f"{p}: an empty database, not a session (no runs to read)")
            if version < SCHEMA_VERSION:  # read an older file through a migrated copy; the file stays as it is
                copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
                conn.backup(copy)
                conn.close()
                conn = copy
                conn.execute("PRAGMA trusted_schema = OFF")
                cls._migrate(conn, p)
            cls._check_rows(conn, p)
        except (SessionError, sqlite3.Error) as e:
            conn.close()
            if isinstance(e, SessionError):
                raise
            raise SessionError(_sqlite_problem(p, e)) from None
        return cls(p, conn, read_only=True)

    @classmethod
    def create(cls, path: str | Path, model_spec=None, *, store_images: bool = True) -> Session:
        """Create a new session file (refused if ``path`` exists).

        Args:
            model_spec: a spec string, a LoadedModel or a model dict, recorded
                as the session's model (runs add theirs as they come).
            store_images: keep the pixels of each image (PNG) so the session
                reopens without the original files; else hash, path and size only.
        """
        p = Path(path)
        if _exists(p):
            raise SessionError(f"{p}: already exists (open it instead)")
        if not p.parent.is_dir():
            raise SessionError(f"{p.parent}: no such folder")
        stale = [suffix for suffix, there in check_beside(p).items() if there]
        if stale:  # SQLite would take a stale -wal or -journal as this new file's own
            raise SessionError(
                f"{p}: its {stale[0]} file exists without the session; remove {p.name}{stale[0]} or choose another name"
            )
        s = None
        try:
            s = cls._connect(p, new=True)
            with s._lock, s._guard("create it"), s._transaction():
                s._conn.execute("INSERT OR IGNORE INTO meta VALUES ('created', ?)", (_now(),))
                s._conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('store_images', ?)", ("1" if store_images else "0",)
                )
                if model_spec is not None:
                    s._upsert_model(_model_fields(model_spec))
        except BaseException:
            if s is not None:
                s.close()
            _remove_new_file(p)  # a half-made session (a full disk) is not left to be taken for one
            raise
        return s

    @classmethod
    def open_or_create(cls, path: str | Path, model_spec=None) -> Session:
        """:meth:`open` the file if it exists, else :meth:`create` it."""
        p = Path(path)
        return cls.open(p) if _exists(p) else cls.create(p, model_spec)

    @classmethod
    def _connect(cls, p: Path, *, new: bool) -> Session:
        try:
            conn = sqlite3.connect(p, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise SessionError(_sqlite_problem(p, e, "create it" if new else "open it")) from None
        try:
            for pragma in _FILE_PRAGMAS:
                conn.execute(pragma)
            if not new:
                version = cls._version(conn, p)  # read-only checks first: never touch a foreign or damaged file
                if version > SCHEMA_VERSION:
                    raise SessionError(
                        f"{p}: written by a newer VLM Readout (session schema {version}; this version reads up to "
                        f"{SCHEMA_VERSION}); upgrade to open it"
                    )
                if version > 0:
                    cls._check_rows(conn, p)
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                warnings.warn(f"{p}: WAL journal not available here; using {mode}", stacklevel=3)
            conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
            conn.execute("PRAGMA foreign_keys=ON")
            cls._migrate(conn, p)
        except SessionError:
            conn.close()
            raise
        except sqlite3.Error as e:
            conn.close()
            raise SessionError(_sqlite_problem(p, e, "create it" if new else "open it")) from None
        return cls(p, conn)

    @staticmethod
    def _version(conn: sqlite3.Connection, p: Path, *, check: bool = True) -> int:
        """The file's schema version, after the checks that need no rows read:
        a session's ``application_id``; SQLite's ``quick_check`` (``check``);
        only the tables, indexes and columns the migrations make for that
        version (no views, triggers or generated columns: a file from elsewhere
        must not run SQL of its own); every ``schema_version`` a whole number
        from 1. 0 for an empty database; a version over :data:`SCHEMA_VERSION`
        is returned unchecked (the caller refuses it as newer)."""
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            objects = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
        except sqlite3.Error as e:
            raise SessionError(_sqlite_problem(p, e)) from None
        tables = {name for kind, name in objects if kind == "table"}
        if not objects and app_id in (0, APPLICATION_ID):
            return 0
        if app_id != APPLICATION_ID:
            raise SessionError(f"{p}: not a session file (an SQLite database of another program)")
        if check:
            rows = [r[0] for r in conn.execute(f"PRAGMA quick_check({_COUNTED_PROBLEMS})").fetchall()]
            if rows != ["ok"]:
                raise SessionError(f"{p}: corrupt session file ({_integrity_summary(rows)})")
        for kind, name in objects:
            if kind not in ("table", "index"):
                raise SessionError(
                    f"{p}: not a session file as VLM Readout writes it (it holds the {kind} {str(name)[:60]!r}, "
                    "which a session never has); refusing to use it"
                )
        if "schema_version" not in tables:
            raise SessionError(f"{p}: damaged session file (no schema_version table)")
        bad = conn.execute(
            "SELECT version FROM schema_version WHERE typeof(version) != 'integer' OR version < 1 LIMIT 1"
        ).fetchone()
        if bad is not None:
            raise SessionError(
                f"{p}: damaged session file (schema_version holds {_shown_value(bad[0])}; a version is a whole "
                "number from 1)"
            )
        version = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
        if version is None:
            raise SessionError(f"{p}: damaged session file (empty schema_version table)")
        if version > SCHEMA_VERSION:
            return version
        for table, columns in expected_columns(version).items():
            if table not in tables:
                raise SessionError(f"{p}: damaged session file (no {table} table)")
            have = conn.execute(f'PRAGMA table_xinfo("{table}")').fetchall()  # (cid, name, type, _, _, pk, hidden)
            declared = {c[1]: (str(c[2]).upper(), c[5]) for c in have}
            for column, (kind, pk) in columns.items():
                if column not in declared:
                    raise SessionError(f"{p}: damaged session file (table {table} has no column {column})")
                if declared[column] != (kind, pk):
                    raise SessionError(
                        f"{p}: damaged session file (table {table} declares {column} as {declared[column][0] or 'untyped'}"
                        f"{' (primary key)' if declared[column][1] else ''}; a session declares it {kind}"
                        f"{' (primary key)' if pk else ''})"
                    )
            generated = [c[1] for c in have if c[6]]
            if generated:
                raise SessionError(
                    f"{p}: not a session file as VLM Readout writes it (table {table} has the generated column "
                    f"{str(generated[0])[:60]!r}); refusing to use it"
                )
        return version

    @staticmethod
    def _check_rows(conn: sqlite3.Connection, p: Path) -> None:
        """The rows the whole file depends on (checked before anything is written
        to it): every ``meta`` key and value text, every ``model`` row of the
        types the session writes (its ``info``, from schema 2, a JSON object). A
        run's own values are checked when it is read (a damaged run is
        :class:`DamagedRunError`; the others read)."""
        bad = conn.execute(
            "SELECT key, value FROM meta WHERE typeof(key) != 'text' OR typeof(value) NOT IN ('text', 'null') LIMIT 1"
        ).fetchone()
        if bad is not None:
            key, value = bad
            what = (
                f"the key {_shown_value(key)}" if not isinstance(key, str) else f"{key!r} holds {_shown_value(value)}"
            )
            raise SessionError(f"{p}: damaged session file (meta {what}; expected text)")
        info = "info" if "info" in {c[1] for c in conn.execute("PRAGMA table_info(model)")} else "NULL"
        for row in conn.execute(f"SELECT id, spec, fingerprint, family, {info}, added FROM model"):
            try:
                _model_row(row)
            except StoredValueError as e:
                raise SessionError(f"{p}: damaged session file (model {row[0]!r}: {e})") from None

    @staticmethod
    def _migrate(conn: sqlite3.Connection, p: Path) -> None:
        """Bring the file to :data:`SCHEMA_VERSION` in one transaction (the
        version is re-read under the write lock: two openers migrate once)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = Session._version(conn, p, check=False)
            if version > SCHEMA_VERSION:
                raise SessionError(f"{p}: written by a newer VLM Readout (session schema {version})")
            for v in range(version, SCHEMA_VERSION):
                MIGRATIONS[v](conn)
                conn.execute("INSERT INTO schema_version VALUES (?, ?)", (v + 1, _now()))
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        """Close the file (the WAL is checkpointed into it by SQLite)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._conn is None

    @property
    def read_only(self) -> bool:
        """Opened with ``read_only=True``: the runs can be read, shown and exported
        (or saved as a new file, :meth:`save_as`), never recorded into."""
        return self._read_only

    def _refuse_if_read_only(self) -> None:
        if self._read_only:
            raise SessionError(
                f"{self.path}: the session is open read-only; nothing can be recorded into it (it was opened "
                "read-only: reopen it to continue it, or save it as a new file)"
            )

    def checkpoint(self) -> bool:
        """Copy the WAL into the main file now, so the ``.vlmr`` alone holds every
        committed run (:func:`core.session.files.checkpoint_wal`; :meth:`record`
        does it after each run). True when complete or nothing to do (a
        read-only or in-memory session); False when readers kept it busy."""
        with self._lock:
            if self._read_only or self.journal_mode.lower() != "wal":
                return True
            return checkpoint_wal(self._db())

    def save_as(self, path: str | Path) -> Path:
        """Write one self-contained copy of this session to ``path`` (SQLite's
        online backup into a temporary file beside it, then an atomic
        ``os.replace``) and return ``path`` as a Path. The copy holds every
        committed run, image and mask and opens on its own; this session stays
        open on its own file (open the copy to record into it). Works for a
        read-only or in-memory session too.

        Raises:
            SessionError: ``path`` is this session's own file, exists and is not
                a session file (or is a folder, link or device), is a session
                open elsewhere, or cannot be written (one line each).
        """
        with self._lock, self._guard("save a copy"):
            return backup_to(self._db(), self.path, path)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SessionError(f"{self.path}: the session is closed")
        return self._conn

    @contextmanager
    def _transaction(self):
        """``BEGIN IMMEDIATE`` (take the write lock up front) ... ``COMMIT``;
        ``ROLLBACK`` on any error (if SQLite has not already rolled back)."""
        conn = self._db()
        self._refuse_if_read_only()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def _guard(self, doing: str):
        """Map SQLite failures inside the block (while ``doing``, a verb phrase:
        "record the run") to one true line (:func:`core.session.records._sqlite_problem`)."""
        try:
            yield
        except sqlite3.Error as e:
            raise SessionError(_sqlite_problem(self.path, e, doing)) from None

    # ------------------------------------------------------------ facts about the file

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db().execute("SELECT MAX(version) FROM schema_version").fetchone()[0])

    def schema_history(self) -> list[tuple[int, str]]:
        """Every schema version applied to this file, with when."""
        with self._lock:
            return [tuple(r) for r in self._db().execute("SELECT version, applied FROM schema_version ORDER BY rowid")]

    def meta(self) -> dict[str, str]:
        """The ``meta`` table (its keys and values were checked as text on opening)."""
        with self._lock:
            return dict(self._db().execute("SELECT key, value FROM meta").fetchall())

    def check(self) -> str:
        """``PRAGMA integrity_check``: ``"ok"`` or the first problem."""
        with self._lock:
            return self._db().execute("PRAGMA integrity_check").fetchone()[0]

    def models(self) -> list[dict]:
        """Every model the session's runs used, oldest first."""
        with self._lock, self._guard("read the models"):
            rows = self._db().execute("SELECT id, spec, fingerprint, family, info, added FROM model ORDER BY id")
            return [self._model_dict(r) for r in rows.fetchall()]

    @property
    def model(self) -> dict | None:
        """The model most recently set or used (``{"id", "spec", "fingerprint", "family", "info", "added"}``)."""
        with self._lock, self._guard("read the model"):
            row = (
                self._db()
                .execute(
                    "SELECT m.id, m.spec, m.fingerprint, m.family, m.info, m.added FROM model m "
                    "LEFT JOIN runs r ON r.model_id = m.id GROUP BY m.id "
                    "ORDER BY MAX(COALESCE(r.id, 0)) DESC, m.id DESC LIMIT 1"
                )
                .fetchone()
            )
        return self._model_dict(row) if row else None

    def _model_dict(self, row) -> dict:
        try:
            return _model_row(row)
        except StoredValueError as e:  # checked on opening; a row written since by another program
            raise SessionError(f"{self.path}: damaged session file (model {row[0]!r}: {e})") from None

    def set_model(self, model, fingerprint: str | None = None, family: str | None = None) -> int:
        """Record a model (a spec string, LoadedModel or model dict); returns its id."""
        fields = _model_fields(model)
        if fields is None:
            raise SessionError("a model needs a spec")
        if fingerprint is not None:
            fields["fingerprint"] = fingerprint
        if family is not None:
            fields["family"] = family
        with self._lock, self._guard("record the model"), self._transaction():
            return self._upsert_model(fields)

    def _upsert_model(self, f: dict) -> int:
        conn = self._db()
        info = json.dumps(jsonable(f["info"])) if f.get("info") else None
        if f["fingerprint"]:
            row = conn.execute(
                "SELECT id FROM model WHERE spec = ? AND fingerprint = ?", (f["spec"], f["fingerprint"])
            ).fetchone()
            if row is None:  # a spec recorded before its weights were known takes the fingerprint
                row = conn.execute(
                    "SELECT id FROM model WHERE spec = ? AND fingerprint IS NULL ORDER BY id LIMIT 1", (f["spec"],)
                ).fetchone()
                if row is not None:
                    conn.execute("UPDATE model SET fingerprint = ? WHERE id = ?", (f["fingerprint"], row[0]))
        else:
            row = conn.execute(
                "SELECT id FROM model WHERE spec = ? ORDER BY fingerprint IS NOT NULL, id DESC LIMIT 1", (f["spec"],)
            ).fetchone()
        if row is None:
            cur = conn.execute(
                "INSERT INTO model (spec, fingerprint, family, info, added) VALUES (?, ?, ?, ?, ?)",
                (f["spec"], f["fingerprint"], f["family"], info, _now()),
            )
            return int(cur.lastrowid)
        if f.get("family") or info:
            conn.execute(
                "UPDATE model SET family = COALESCE(?, family), info = COALESCE(?, info) WHERE id = ?",
                (f.get("family"), info, row[0]),
            )
        return int(row[0])

    # ------------------------------------------------------------ recording

    def record(
        self,
        readout: Readout,
        *,
        image=None,
        mask=None,
        model=None,
        image_path: str | Path | None = None,
        store_image: bool | None = None,
        parameters: dict | None = None,
    ) -> int:
        """Record one run in one transaction (autosave) and return its id.

        The run is what ``readout`` says about itself (:class:`core.results.readout.Readout`):
        its ``kind``, its ``to_dict()`` as the result JSON (numpy values are
        converted; non-finite floats are stored as null, as in every JSON the
        engine writes), its ``summary()``, ``parameters()`` and ``audit_records()``.
        After the commit the WAL is checkpointed into the main file
        (:meth:`checkpoint`), so a copy of the ``.vlmr`` alone holds the run.

        A run without an image whose parameters name a ``dataset`` file (the
        dataset audit) gets ``dataset_sha256``, the SHA-256 of that file's
        bytes as they are now, in its stored parameters (unless given): the
        dataset is its input, as an image is another run's.

        The stored parameters also hold ``dtype`` and ``device``, what the numbers
        were computed in (unless given): from the model (a LoadedModel's adapter,
        or the result's ``model`` block), else the result's ``input`` block
        (:func:`core.session.records.dtype_and_device`). They reach the audit rows'
        ``specification`` and ``run_parameters`` and every export.

        Args:
            readout: a method's result, or :class:`core.results.readout.RecordedResult`
                for a document without a class of its own (a plain dict is refused).
            image: path, bytes, PIL image or ``(H, W, 3)`` uint8 array.
            mask: ``(H, W)`` bool array, PIL image, PNG bytes or PNG path
                (white = region); the image's size when an image is given.
            model: LoadedModel, model dict or spec; default: the result's ``"model"``.
            image_path: where a PIL/array image came from (a path ``image`` is its own).
            store_image: keep the pixels; default: the session's setting.
            parameters: added to the readout's own (e.g. the CLI's ``paste_from``).

        Raises:
            SessionError: not a Readout, a bad kind, an unserialisable result, a
                bad mask, a busy or closed file, a session open read-only.
        """
        self._refuse_if_read_only()
        if not isinstance(readout, Readout):
            raise SessionError(
                "Session.record takes a Readout (a method's result, or core.results.readout.RecordedResult(kind, doc, "
                f"summary=...) for a plain document), not a {type(readout).__name__}"
            )
        kind = readout.kind
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            raise SessionError(f"run kind must be a short lower-case name like {', '.join(KINDS[:4])}; got {kind!r}")
        result = readout.to_dict()
        result_json = _dumps(result, "result")
        audit_dicts = [a.to_dict() if hasattr(a, "to_dict") else dict(a) for a in readout.audit_records() or []]
        params = {**readout.parameters(), **(parameters or {})}
        if image is None and params.get("dataset") is not None and "dataset_sha256" not in params:
            params["dataset_sha256"] = dataset_sha256(params["dataset"])
        if model is None and isinstance(result, dict):
            model = result.get("model")
        model_fields = _model_fields(model)
        for key, value in dtype_and_device(model_fields, result).items():  # what the numbers were computed in
            params.setdefault(key, value)
        params_json = _dumps(params, "parameters")
        summary = " ".join(str(readout.summary()).split())
        if store_image is None:
            store_image = self.meta().get("store_images", "1") == "1"
        img = _prepare_image(image, image_path, store_image) if image is not None else None
        m = _as_mask(mask, img[2] if img else None) if mask is not None else None
        mask_sha = _mask_sha(m) if m is not None else None
        mask_png = _mask_png(m) if m is not None else None

        with self._lock, self._guard("record the run"):
            conn = self._db()
            with self._transaction():
                model_id = self._upsert_model(model_fields) if model_fields else None
                sha = None
                if img is not None:
                    sha, path, (w, h), png = img
                    conn.execute(
                        "INSERT OR IGNORE INTO images (sha256, path, width, height, added, png) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (sha, path, w, h, _now(), png),
                    )
                    conn.execute(
                        "UPDATE images SET path = COALESCE(path, ?), png = COALESCE(png, ?) WHERE sha256 = ?",
                        (path, png, sha),
                    )
                mask_id = None
                if m is not None:
                    row = conn.execute(
                        "SELECT id FROM masks WHERE sha256 = ? AND image_sha256 IS ?", (mask_sha, sha)
                    ).fetchone()
                    if row is None:
                        cur = conn.execute(
                            "INSERT INTO masks (image_sha256, png, added, sha256, width, height) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (sha, mask_png, _now(), mask_sha, int(m.shape[1]), int(m.shape[0])),
                        )
                        mask_id = int(cur.lastrowid)
                    else:
                        mask_id = int(row[0])
                created = _now()
                cur = conn.execute(
                    "INSERT INTO runs (kind, created, model_id, image_sha256, mask_id, parameters, result, summary) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (kind, created, model_id, sha, mask_id, params_json, result_json, summary),
                )
                run_id = int(cur.lastrowid)
                for i, d in enumerate(audit_dicts):
                    conn.execute(
                        "INSERT INTO audit_rows VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            run_id,
                            i,
                            d.get("method"),
                            d.get("question"),
                            d.get("operation"),
                            _dumps(list(d.get("controls") or []), "audit controls"),
                            d.get("supports"),
                            d.get("cannot_support"),
                            _dumps(d.get("parameters") or {}, "audit parameters"),
                            _dumps(list(d.get("notes") or []), "audit notes"),
                        ),
                    )
            self._last_id = max(self._last_id, run_id)
            if self.checkpoint_each_run:
                self.checkpoint()
        info = RunInfo(
            run_id,
            kind,
            created,
            summary,
            model_fields["spec"] if model_fields else None,
            sha,
            mask_id,
            len(audit_dicts),
        )
        self._emit([info])
        return run_id

    # ------------------------------------------------------------ events

    def on_recorded(self, callback: Callable[[RunInfo], None]) -> Callable[[], None]:
        """Call ``callback(run_info)`` after each run is committed (by this
        object, or by another process once :meth:`poll` sees it). Returns a
        function that unsubscribes. Called in the recording thread; an
        exception in a callback is turned into a warning (the run is saved)."""
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def _emit(self, infos: list[RunInfo]) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for info in infos:
            for cb in callbacks:
                try:
                    cb(info)
                except Exception as e:  # noqa: BLE001 - a listener's bug must not undo a saved run
                    warnings.warn(f"session on_recorded callback failed: {type(e).__name__}: {e}", stacklevel=2)

    def poll(self) -> list[RunInfo]:
        """Runs committed since this object last looked (e.g. by a CLI
        ``--session`` run into the same file); fires :meth:`on_recorded` for each."""
        with self._lock:
            new = self._run_infos("WHERE r.id > ?", (self._last_id,))
            if new:
                self._last_id = max(i.id for i in new)
        self._emit(new)
        return new

    def _max_id(self) -> int:
        return int(self._db().execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0])

    # ------------------------------------------------------------ reading

    def _run_infos(self, where: str = "", args: tuple = (), damaged: dict[int, str] | None = None) -> list[RunInfo]:
        rows = self._db().execute(
            "SELECT r.id, r.kind, r.created, r.summary, m.spec, r.image_sha256, r.mask_id, "
            "(SELECT COUNT(*) FROM audit_rows a WHERE a.run_id = r.id) "
            f"FROM runs r LEFT JOIN model m ON m.id = r.model_id {where} ORDER BY r.id",
            args,
        )
        infos = []
        for row in rows.fetchall():
            try:
                infos.append(_run_info(row))
            except StoredValueError as e:
                if damaged is not None:
                    damaged.setdefault(row[0], str(e))
        return infos

    def runs(self, kind: str | None = None, *, damaged: dict[int, str] | None = None) -> list[RunInfo]:
        """Every run, oldest first (``kind``: only that kind). A run whose listed
        values are not what the session writes (a blob where its time belongs)
        is left out; ``damaged``, when given, gets ``{run id: why}`` for each."""
        with self._lock, self._guard("read the runs"):
            if kind is None:
                return self._run_infos(damaged=damaged)
            return self._run_infos("WHERE r.kind = ?", (kind,), damaged)

    def run(self, run_id: int) -> Run:
        """One run with its result, parameters, audit rows and model, every value
        checked as it is read (:mod:`core.session.stored`). Its result as its kind's
        class is :attr:`Run.readout` (restored when first read: a result that does not
        fit its class is a :class:`DamagedRunError` there).

        Raises:
            DamagedRunError: a value of the run is not what the session writes
                (text where a number belongs, parameters that are not a JSON
                object, a result that is not JSON or is nested too deep, a
                damaged image or mask row): one line naming the run.
            SessionError: no such run.
        """
        with self._lock, self._guard("read a run"):
            conn = self._db()
            row = conn.execute(
                "SELECT id, kind, created, summary, parameters, model_id, image_sha256, mask_id, "
                "length(CAST(result AS BLOB)) FROM runs WHERE id = ?",
                (int(run_id),),
            ).fetchone()
            if row is None:
                raise SessionError(f"{self.path}: no run {run_id}")
            rid, kind, created, summary, params, model_id, sha, mask_id, result_bytes = row
            try:
                kind = _run_kind(kind)
                created = stored.text(created, "created")
                summary = stored.text(summary, "summary")
                params = stored.json_value(params, "parameters", expect=dict)
                model_id = stored.whole(model_id, "model_id", null=True)
                sha = stored.text(sha, "image_sha256", null=True)
                mask_id = stored.whole(mask_id, "mask_id", null=True)
                if result_bytes is not None and result_bytes > stored.MAX_STORED_JSON_BYTES:
                    raise StoredValueError(
                        f"result is {result_bytes:,} bytes, over the {stored.MAX_STORED_JSON_BYTES:,}-byte limit"
                    )
                result = stored.json_value(
                    conn.execute("SELECT result FROM runs WHERE id = ?", (rid,)).fetchone()[0], "result"
                )
                model = None
                if model_id is not None:
                    m = conn.execute(
                        "SELECT id, spec, fingerprint, family, info, added FROM model WHERE id = ?", (model_id,)
                    ).fetchone()
                    model = _model_row(m) if m else None
                audits = [
                    _audit_dict(a)
                    for a in conn.execute(
                        "SELECT ord, method, question, operation, controls, supports, cannot_support, parameters, "
                        "notes FROM audit_rows WHERE run_id = ? ORDER BY ord",
                        (rid,),
                    )
                ]
                image = self._image_row(sha) if sha is not None else None
                mask_png = None
                if mask_id is not None:
                    found = conn.execute("SELECT png FROM masks WHERE id = ?", (mask_id,)).fetchone()
                    mask_png = stored.blob(found[0], f"the stored mask {mask_id}'s png") if found else None
            except StoredValueError as e:
                raise DamagedRunError(self.path, rid, str(e)) from None
            return Run(
                rid, kind, created, summary, params, result, audits, model, sha, mask_id, image, mask_png, self.path
            )

    def _image_row(self, sha256: str) -> ImageInfo | None:
        """The image row ``sha256``, checked; :class:`StoredValueError` names what is wrong."""
        row = (
            self._db()
            .execute("SELECT sha256, path, width, height, png FROM images WHERE sha256 = ?", (sha256,))
            .fetchone()
        )
        if row is None:
            return None
        sha, path, w, h, png = row
        where = f"its image {sha256[:12]}:"
        path = stored.text(path, f"{where} path", null=True)
        w = stored.whole(w, f"{where} width", null=True)
        h = stored.whole(h, f"{where} height", null=True)
        png = stored.blob(png, f"{where} png", null=True)
        return ImageInfo(sha, path, (w, h) if w is not None and h is not None else None, png)

    def image(self, sha256: str) -> ImageInfo | None:
        """A session image by hash (None when the session has none such).

        Raises:
            SessionError: its row holds values the session never writes."""
        with self._lock, self._guard("read an image"):
            try:
                return self._image_row(sha256)
            except StoredValueError as e:
                raise SessionError(f"{self.path}: {str(e).removeprefix('its ')}") from None

    def images(self) -> list[ImageInfo]:
        """Every image, without pixels (see :meth:`image`)."""
        with self._lock, self._guard("read the images"):
            rows = self._db().execute("SELECT sha256, path, width, height FROM images ORDER BY added").fetchall()
        out = []
        for sha, path, w, h in rows:
            try:
                what = f"image {str(sha)[:12]}:"
                sha, path = stored.text(sha, f"{what} sha256"), stored.text(path, f"{what} path", null=True)
                w, h = stored.whole(w, f"{what} width", null=True), stored.whole(h, f"{what} height", null=True)
            except StoredValueError as e:
                raise SessionError(f"{self.path}: damaged session file ({e})") from None
            out.append(ImageInfo(sha, path, (w, h) if w is not None and h is not None else None))
        return out

    def mask(self, mask_id: int):
        """A mask as an ``(H, W)`` bool array (True = region), or None."""
        with self._lock, self._guard("read a mask"):
            row = self._db().execute("SELECT png FROM masks WHERE id = ?", (int(mask_id),)).fetchone()
        if row is None:
            return None
        try:
            return stored_mask(stored.blob(row[0], "png"), mask_id)
        except StoredValueError as e:
            raise SessionError(f"{self.path}: the stored mask {mask_id} is unreadable ({e})") from None
        except SessionError as e:
            raise SessionError(f"{self.path}: {e}") from None

    def audit_table(self, kinds: Iterable[str] | None = None, *, damaged: dict[int, str] | None = None) -> list[dict]:
        """The session's audit table: one row per audit record of each run
        (a run without audit records gets one row with empty method columns),
        oldest run first. Columns: :data:`AUDIT_COLUMNS`: the run's own
        (:meth:`Run.columns`: input path and hash, model, question, target,
        specification, summary), then the audit record's (``controls`` and
        ``notes`` are lists, ``parameters`` a dict), then ``run_parameters``.
        A run holding values the session never writes is left out; ``damaged``,
        when given, gets ``{run id: why}`` for each."""
        kinds = list(kinds) if kinds is not None else None
        where = ""
        if kinds is not None:
            where = f"WHERE r.kind IN ({', '.join('?' * len(kinds))})" if kinds else "WHERE 0"
        with self._lock, self._guard("read the audit table"):
            conn = self._db()
            # the target position is read in SQL: an analyze result's JSON is large, and only this number is needed
            runs = conn.execute(
                "SELECT r.id, r.kind, r.created, r.summary, r.parameters, "
                "CASE WHEN json_valid(r.result) THEN json_extract(r.result, '$.target.position') END, "
                "m.spec, m.fingerprint, r.image_sha256, i.path, r.mask_id "
                "FROM runs r LEFT JOIN model m ON m.id = r.model_id LEFT JOIN images i ON i.sha256 = r.image_sha256 "
                f"{where} ORDER BY r.id",
                kinds or (),
            ).fetchall()
            audits = conn.execute(
                "SELECT run_id, ord, method, question, operation, controls, supports, cannot_support, parameters, "
                "notes FROM audit_rows ORDER BY run_id, ord"
            ).fetchall()
        by_run: dict[int, list] = {}
        for a in audits:
            by_run.setdefault(a[0], []).append(a[1:])
        out = []
        for rid, kind, created, summary, params, position, spec, fingerprint, sha, path, mask_id in runs:
            try:
                params = stored.json_value(params, "parameters", expect=dict)
                model = {"spec": spec, "fingerprint": fingerprint} if spec is not None else None
                result = {"target": {"position": position}}
                run = run_columns(
                    rid,
                    _run_kind(kind),
                    stored.text(created, "created"),
                    stored.text(summary, "summary"),
                    params,
                    result,
                    model,
                    stored.text(sha, "image_sha256", null=True),
                    stored.text(path, "its image's path", null=True),
                    stored.whole(mask_id, "mask_id", null=True),
                )
                records = [_audit_dict(a) for a in by_run.get(rid) or []] or [
                    dict.fromkeys(AUDIT_COLUMNS[len(RUN_COLUMNS) : -1])
                ]
            except StoredValueError as e:
                if damaged is not None:
                    damaged.setdefault(rid, str(e))
                continue
            for record in records:
                row = {**run, **{c: record[c] for c in AUDIT_COLUMNS[len(RUN_COLUMNS) : -1]}, "run_parameters": params}
                row["controls"] = row["controls"] or []
                row["notes"] = row["notes"] or []
                row["parameters"] = row["parameters"] or {}
                out.append(row)
        return out


# ---------------------------------------------------------------- checked rows

_COUNTED_PROBLEMS = 100  # SQLite's integrity check stops there (a corrupt file may have thousands)


def _integrity_summary(rows: list) -> str:
    """SQLite's integrity-check rows as one line: how many problems and the first. A row can hold
    several problems, one a line, under a "*** in database main ***" heading ("Page 15 is never
    used" for each lost page): listed, they made the message a screenful."""
    problems = [line.strip() for row in rows for line in str(row).splitlines()]
    problems = [line for line in problems if line and not (line.startswith("***") and line.endswith("***"))]
    if not problems:
        return "SQLite integrity check failed"
    if len(problems) == 1:
        return f"SQLite integrity check: {problems[0]}"
    count = f"{_COUNTED_PROBLEMS} or more" if len(problems) >= _COUNTED_PROBLEMS else str(len(problems))
    return f"SQLite integrity check: {count} problems, first: {problems[0]}"


def _shown_value(value) -> str:
    """A stored value for a message: short, one line."""
    if isinstance(value, bytes):
        return f"a blob of {len(value):,} bytes"
    if isinstance(value, str):
        return f"the text {' '.join(value[:200].split())[:40]!r}"
    return stored.kind_of(value) if value is None else f"{stored.kind_of(value)} ({value!r})"


def _run_kind(value) -> str:
    kind = stored.text(value, "kind")
    if not _KIND_RE.match(kind):
        raise StoredValueError(f"kind holds {_shown_value(kind)}, not a run kind (a short lower-case name)")
    return kind


def _run_info(row) -> RunInfo:
    """A :class:`RunInfo` from ``(id, kind, created, summary, model spec, image sha256, mask id, n audits)``, checked."""
    rid, kind, created, summary, spec, sha, mask_id, n_audits = row
    return RunInfo(
        rid,
        _run_kind(kind),
        stored.text(created, "created"),
        stored.text(summary, "summary"),
        stored.text(spec, "its model's spec", null=True),
        stored.text(sha, "image_sha256", null=True),
        stored.whole(mask_id, "mask_id", null=True),
        n_audits,
    )


def _model_row(row) -> dict:
    """A model row ``(id, spec, fingerprint, family, info, added)`` as a dict, checked."""
    mid, spec, fp, family, info, added = row
    return {
        "id": stored.whole(mid, "id"),
        "spec": stored.text(spec, "spec"),
        "fingerprint": stored.text(fp, "fingerprint", null=True),
        "family": stored.text(family, "family", null=True),
        "info": stored.json_value(info, "info", expect=dict) if info not in (None, "") else None,
        "added": stored.text(added, "added"),
    }


def _audit_dict(row) -> dict:
    """An audit row ``(ord, method, question, operation, controls, supports,
    cannot_support, parameters, notes)`` in ``AuditRecord.to_dict()`` form, checked."""
    order, method, question, operation, controls, supports, cannot_support, parameters, notes = row
    where = f"audit row {order!r}:"
    return {
        "method": stored.text(method, f"{where} method", null=True),
        "question": stored.text(question, f"{where} question", null=True),
        "operation": stored.text(operation, f"{where} operation", null=True),
        "controls": stored.json_value(controls, f"{where} controls", expect=list, empty=[]),
        "supports": stored.text(supports, f"{where} supports", null=True),
        "cannot_support": stored.text(cannot_support, f"{where} cannot_support", null=True),
        "parameters": stored.json_value(parameters, f"{where} parameters", expect=dict, empty={}),
        "notes": stored.json_value(notes, f"{where} notes", expect=list, empty=[]),
    }


# ---------------------------------------------------------------- opening helpers


def _remove_new_file(p: Path) -> None:
    """Remove the session file :meth:`Session.create` was making (it did not
    exist before) and what SQLite made beside it."""
    for path in (p, *(beside(p, suffix) for suffix in BESIDE)):
        try:
            path.unlink()
        except OSError:
            pass


def _needs_writing(e: sqlite3.Error) -> bool:
    """Whether SQLite failed because reading needed a write beside the file
    (creating or growing the -shm: a full disk, a read-only folder)."""
    name = getattr(e, "sqlite_errorname", "") or ""
    return name.startswith(("SQLITE_IOERR", "SQLITE_FULL", "SQLITE_CANTOPEN", "SQLITE_READONLY")) or (
        "unable to open" in str(e) or "disk I/O error" in str(e)
    )


def _sqlite_read_only(p: Path, uri: str, wal_mode: bool) -> sqlite3.Connection | None:
    """A read-only SQLite connection to ``uri`` that has read the schema (the
    first read, where SQLite opens the -wal and -shm); None when a WAL file
    could only be read by writing beside it (:func:`_needs_writing`)."""
    conn = None
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        for pragma in _FILE_PRAGMAS:  # before the file's schema is read
            conn.execute(pragma)
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.Error as e:
        if conn is not None:
            conn.close()
        if wal_mode and _needs_writing(e):
            return None
        raise SessionError(_sqlite_problem(p, e)) from None


# ---------------------------------------------------------------- command-line helpers


def check_session_file(path: str | Path) -> None:
    """Fail fast, before a long run: an existing file must open as a session
    (this migrates it; a damaged, foreign or newer file, a full disk are one
    line here), a new one needs an existing writable folder (not through a
    symbolic link to nothing)."""
    p = Path(path)
    if _exists(p):
        Session.open(p).close()
    elif not p.parent.is_dir():
        raise SessionError(f"{p.parent}: no such folder for the session file")
    elif not os.access(p.parent, os.W_OK | os.X_OK):
        raise SessionError(f"{p}: cannot create the session file (its folder is not writable)")
    elif (full := no_space_reason(p)) is not None:
        raise SessionError(f"{p}: cannot create the session file: {full}")


def record_into(path: str | Path, readout: Readout, **kwargs) -> int:
    """Open (or create) the session at ``path``, :meth:`Session.record` one
    readout, close. For ``--session FILE`` on the CLI commands: a command that
    also writes an output file records first and puts the file in place only
    once the run is recorded (:func:`core.files.atomic.staged_writes`), so a failed
    record leaves the earlier output as it was."""
    with Session.open_or_create(path) as s:
        return s.record(readout, **kwargs)
