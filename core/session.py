"""The session store: one SQLite file per session.

A session keeps everything a user (the app, the CLI, a notebook) ran on a
model: the model spec and fingerprint, the images (hash, path, size and,
by default, the pixels as PNG), the painted masks, and every run with its
parameters, its result JSON, a one-line summary and its audit rows (the
audit columns of docs/ARCHITECTURE.md, "Audit rows": :class:`core.audit.AuditRecord`). Reopening the file
gives the same state back; :meth:`Session.audit_table` is the table the app's
audit panel shows and :mod:`core.export` writes.

    s = Session.open_or_create("work.vlmr")
    run_id = s.record("analyze", result, image=img)     # one transaction: autosave
    s.runs(); s.run(run_id).result; s.audit_table(); s.close()

Durability:

* WAL journal (``PRAGMA journal_mode=WAL``): a writer appends whole
  transactions to the ``-wal`` file; readers (the app while the CLI records
  into the same file) are not blocked, and a process killed mid-write leaves
  at most an uncommitted tail that the next open ignores.
* ``PRAGMA synchronous=FULL``: every commit is fsynced before
  :meth:`Session.record` returns. ``NORMAL`` is already safe against a
  killed *process* in WAL mode, but can lose the last commits on a power
  cut or OS crash; a recorded run is the user's work and runs come at the
  pace of model forwards, so one fsync per run costs nothing that shows.
* Each :meth:`Session.record` is one ``BEGIN IMMEDIATE`` ... ``COMMIT``: the
  run, its audit rows, its image and mask land together or not at all.

Schema: the ``schema_version`` table lists every version applied; opening an
older file migrates it forward in one transaction (:data:`MIGRATIONS`). v0 is
an empty database (what a crash during the very first create can leave);
v1 had no image pixels, no mask hashes and no run summaries; v2 (current) adds
them (summaries and hashes are backfilled). A file written by a newer version
is refused, never rewritten. The header's ``application_id`` marks the file
as a session, so another program's SQLite file is refused untouched.

Reading only: ``Session.open(path, read_only=True)`` (what ``export`` uses)
never writes to the file or beside it: SQLite's ``mode=ro``, plus
``immutable=1`` when no ``-wal`` file shows another connection, so no
``-shm`` is made and a session in a read-only folder reads; an older schema
is migrated in a copy in memory; an empty file is refused, not made a session.

Events: :meth:`Session.on_recorded` registers a plain callback (no Qt) called
with the new :class:`RunInfo` after each commit, in the thread that
recorded (the app forwards it to its GUI thread); :meth:`Session.poll`
reports runs committed by other processes (a CLI run into the open session).
A Session may be used from several threads: calls are serialised by a lock.

The ``audit`` CLI command records ONE run per invocation (kind ``audit``:
the summary with its distributions, the output folder, one audit row per
method), not one per sample: the per-sample numbers stay in the run's
``samples.jsonl`` / ``samples.csv``, and one row per method keeps the audit
table readable next to single-image runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.errors import ImageLoadError, ReadoutError

SCHEMA_VERSION = 2
APPLICATION_ID = 0x564C4D52  # "VLMR" in the SQLite header: this file is a session
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 10.0
SYNCHRONOUS = "FULL"

KINDS = (
    "analyze",
    "counterfactual",
    "sweep",
    "intervention",
    "audit",
    "nonunique",
    "label",
    "lens",
    "note",
)
_KIND_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,39}$")

# The audit-table columns (docs/ARCHITECTURE.md, "Audit rows") as AuditRecord names them.
METHOD_COLUMNS = ("method", "question", "operation", "controls", "supports", "cannot_support")
# One row of Session.audit_table(): run identity, the audit columns, the audit
# record's own parameters and notes, then the run's parameters and summary.
AUDIT_COLUMNS = (
    "run_id",
    "kind",
    "created",
    "model",
    *METHOD_COLUMNS,
    "parameters",
    "notes",
    "run_parameters",
    "summary",
)


class SessionError(ReadoutError):
    """A session file that cannot be opened or written (missing, corrupt, not
    a session, written by a newer version, busy)."""


@dataclass(frozen=True)
class RunInfo:
    """One run as :meth:`Session.runs` lists it (no result JSON).

    Attributes:
        created: ISO 8601 UTC time of the commit.
        model: the model spec the run used, or None.
        image_sha256: :func:`core.images.image_sha256` of the run's image, or None.
    """

    id: int
    kind: str
    created: str
    summary: str
    model: str | None
    image_sha256: str | None
    mask_id: int | None
    n_audits: int


@dataclass
class Run:
    """One run in full (:meth:`Session.run`).

    Attributes:
        parameters: what the run was called with.
        result: the result JSON as recorded.
        audits: the audit rows (``AuditRecord.to_dict()`` form), in order.
        model: ``{"id", "spec", "fingerprint", "family", "info"}`` or None.
    """

    id: int
    kind: str
    created: str
    summary: str
    parameters: dict
    result: Any
    audits: list[dict]
    model: dict | None
    image_sha256: str | None
    mask_id: int | None

    @property
    def info(self) -> RunInfo:
        return RunInfo(
            self.id,
            self.kind,
            self.created,
            self.summary,
            self.model["spec"] if self.model else None,
            self.image_sha256,
            self.mask_id,
            len(self.audits),
        )


@dataclass
class ImageInfo:
    """A session image: hash, where it came from, size, and the PNG if stored."""

    sha256: str
    path: str | None
    size: tuple[int, int] | None
    png: bytes | None = field(default=None, repr=False)

    def pixels(self):
        """The stored image as an RGB ``PIL.Image`` (None when only the hash was kept).

        Raises:
            SessionError: the stored bytes are not an image PIL can read.
        """
        if self.png is None:
            return None
        from core.images import load_image

        try:  # a shared session is a file from elsewhere: its pictures get every check a user's image gets
            return load_image(self.png)
        except ImageLoadError as e:
            reason = str(e).removeprefix("image bytes: ")
            raise SessionError(f"the stored image {self.sha256[:12]} is unreadable ({reason})") from None


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
        try:
            text = summarize_result(kind, json.loads(result))
        except ValueError:
            text = ""
        conn.execute("UPDATE runs SET summary = ? WHERE id = ?", (text, run_id))
    conn.execute("CREATE INDEX runs_kind ON runs(kind)")
    conn.execute("CREATE INDEX masks_sha ON masks(sha256)")


# MIGRATIONS[v] takes a file from version v to v + 1.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _to_v1, 1: _to_v2}
assert len(MIGRATIONS) == SCHEMA_VERSION


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def jsonable(x):
    """Strict-JSON-ready: numpy values to Python, non-finite floats to None,
    objects with ``to_dict`` to their dict."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "to_dict"):
        return jsonable(x.to_dict())
    if hasattr(x, "tolist"):  # numpy arrays and scalars, torch tensors
        return jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _dumps(x, what: str) -> str:
    try:
        return json.dumps(jsonable(x), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SessionError(f"cannot record the {what}: {e}") from None


def _mask_sha(mask) -> str:
    import numpy as np

    h = hashlib.sha256(f"{mask.shape[1]}x{mask.shape[0]}:".encode())
    h.update(np.packbits(mask.astype(bool)).tobytes())
    return h.hexdigest()


def _mask_array(png: bytes):
    from core.images import load_mask  # imported here: numpy and PIL load only when a mask is read

    return load_mask(png)


def _mask_png(mask) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.where(mask, 255, 0).astype(np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()


def _as_mask(mask, size: tuple[int, int] | None):
    """``(H, W)`` bool from an array, a PIL image, PNG bytes or a PNG path (white = region)."""
    import numpy as np
    from PIL import Image

    if isinstance(mask, (str, Path, bytes)):
        try:
            data = Path(mask).read_bytes() if not isinstance(mask, bytes) else mask
            m = _mask_array(data)
        except (OSError, ValueError) as e:
            raise SessionError(f"cannot read the mask ({type(e).__name__}: {e})") from None
    elif isinstance(mask, Image.Image):
        m = np.asarray(mask.convert("L")) >= 128
    else:
        m = np.asarray(mask)
        if m.ndim != 2:
            raise SessionError(f"a mask is an (H, W) array, got shape {m.shape}")
        m = m.astype(bool) if m.dtype == bool or m.max(initial=0) <= 1 else m >= 128
    if size is not None and (m.shape[1], m.shape[0]) != tuple(size):
        raise SessionError(f"the mask is {m.shape[1]}x{m.shape[0]}, the image {size[0]}x{size[1]}")
    return m


def _exists(p: Path) -> bool:
    """Whether ``p`` exists; a path that cannot even be looked at (a folder
    without search permission) is a :class:`SessionError`."""
    try:
        return p.exists()
    except OSError as e:
        raise SessionError(f"{p}: cannot look at it ({os.strerror(e.errno) if e.errno else e})") from None


def _sqlite_problem(p: Path, e: sqlite3.Error) -> str:
    """One line for an SQLite failure while opening ``p``: not a database,
    cannot be written, busy, or corrupt (SQLite's words in brackets)."""
    text = str(e)
    if "not a database" in text:
        return f"{p}: not a session file (not an SQLite database)"
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return f"{p}: cannot be opened for writing: the file or its folder is read-only ({text})"
    if "locked" in text or "busy" in text:
        return f"{p}: busy (another process holds the session); try again"
    return f"{p}: corrupt session file ({text})"


# ---------------------------------------------------------------- summaries and parameters


def _q(x) -> str:
    return "n/a" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def summarize_result(kind: str, result: Any) -> str:
    """One human line about a run's result (what the audit table shows beside
    the method's columns). Never raises: an unknown shape gives its keys."""
    try:
        return _summarize(kind, result)
    except Exception:  # noqa: BLE001 - a summary must not sink a record
        if isinstance(result, dict):
            return f"{kind}: " + ", ".join(list(result)[:6])
        return kind


def _summarize(kind: str, r: Any) -> str:
    if not isinstance(r, dict):
        return f"{kind}: {json.dumps(r)[:120]}"
    if "summary" in r and isinstance(r["summary"], str):
        return r["summary"]
    if "target" in r and "attention" in r:  # analyze
        t = r["target"]
        line = f"answer {t['answer']!r} p={t['prob']:.3f} (predicted {t['predicted']!r})"
        if t.get("logit_diff") is not None:
            line += f", logit diff vs {t['foil']!r} {t['logit_diff']:+.3f}"
        heads = [h for h in r["attention"] if h.get("visual_mass") is not None]
        if heads:
            h = max(heads, key=lambda h: h["visual_mass"])
            line += f"; most visual head L{h['layer']}.H{h['head']} {h['visual_mass']:.2f}"
        return line
    if "effect" in r and "original" in r and "edited" in r:  # region counterfactual
        o, e = r["original"], r["edited"]
        score, a, b = ("logit diff", o["logit_diff"], e["logit_diff"])
        if a is None:
            score, a, b = "logit", o["logit"], e["logit"]
        flipped = " (flipped)" if r["effect"].get("flipped") else ""
        return (
            f"fill {r.get('fill')}: {o['answer']!r} {score} {a:+.3f} -> {b:+.3f}, p {o['prob']:.3f} -> "
            f"{e['prob']:.3f}; predicted {o['predicted']!r} -> {e['predicted']!r}{flipped}"
        )
    if "sweep" in r:  # occlusion sweep
        s = r["sweep"]
        grid = s["logit_diff_change"] if s.get("logit_diff_change") is not None else s["logit_change"]
        cells = [(v, i, j) for i, row in enumerate(grid) for j, v in enumerate(row) if v is not None]
        n_flip = sum(bool(v) for row in s["flipped"] for v in row)
        line = f"occlusion sweep {s['grid_shape'][0]}x{s['grid_shape'][1]} cells (k={s['k']}, fill {s['fill']})"
        if cells:
            v, i, j = min(cells)
            line += f"; largest drop {-v:.3f} at cell [{i}, {j}]"
        return line + f"; {n_flip} cells flip the answer"
    if "n_samples" in r and "n_ok" in r:  # dataset audit summary
        line = f"{r['n_samples']} samples: {r['n_ok']} ok, {r['n_errors']} errors; accuracy {_q(r.get('accuracy'))}"
        return line + (" (cancelled)" if r.get("cancelled") else "")
    scalars = [(k, v) for k, v in r.items() if isinstance(v, (str, int, float, bool)) and k != "schema_version"]
    if scalars:
        return f"{kind}: " + ", ".join(f"{k}={_q(v)}" for k, v in scalars[:5])
    return f"{kind}: " + ", ".join(list(r)[:6])


def default_parameters(kind: str, result: Any) -> dict:
    """What a run was called with, read back from a result dict that does not
    say it separately (question, answer and foil tokens, fill, sweep size)."""
    if not isinstance(result, dict):
        return {}
    out: dict[str, Any] = {}
    inp = result.get("input")
    if isinstance(inp, dict) and "question" in inp:
        out["question"] = inp["question"]
    t = result.get("target") or result.get("original")
    if isinstance(t, dict):
        out["answer"], out["foil"] = t.get("answer"), t.get("foil")
    if isinstance(result.get("rollout"), dict):
        out["rollout_alpha"] = result["rollout"].get("alpha")
    s = result.get("sweep") if isinstance(result.get("sweep"), dict) else result
    for key in ("fill", "fill_parameters", "mask_area_px", "k"):
        if key in s:
            out[key] = s[key]
    if isinstance(result.get("parameters"), dict):
        out.update(result["parameters"])
    return out


def _model_fields(model) -> dict | None:
    """``{"spec", "fingerprint", "family", "info"}`` from a LoadedModel, a dict
    (an analyze result's ``model``) or a spec string."""
    if model is None:
        return None
    if isinstance(model, str):
        return {"spec": model, "fingerprint": None, "family": None, "info": None}
    if isinstance(model, dict):
        if not model.get("spec"):
            return None
        info = {k: v for k, v in model.items() if k not in ("spec", "fingerprint", "family")}
        return {
            "spec": str(model["spec"]),
            "fingerprint": model.get("fingerprint") or None,
            "family": model.get("family"),
            "info": info or None,
        }
    spec = getattr(model, "spec", None)
    if spec is None:
        raise SessionError(f"model must be a spec, a dict or a LoadedModel, got {type(model).__name__}")
    adapter = getattr(model, "adapter", None)
    info = adapter.describe() if adapter is not None and hasattr(adapter, "describe") else None
    return {
        "spec": str(spec),
        "fingerprint": getattr(model, "fingerprint", None) or None,
        "family": getattr(model, "family", None),
        "info": info,
    }


def _prepare_image(image, image_path, store: bool):
    """``(sha256, path, (w, h), png or None)`` from a path, bytes, PIL image or array."""
    from core.images import image_sha256, load_image

    if isinstance(image, (str, Path)) and image_path is None:
        image_path = str(image)
    img = load_image(image)
    png = None
    if store:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        png = buf.getvalue()
    return image_sha256(img), (str(image_path) if image_path is not None else None), img.size, png


# ---------------------------------------------------------------- the session


class Session:
    """One session file. Open with :meth:`open`, :meth:`create` or
    :meth:`open_or_create`; use as a context manager or call :meth:`close`."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path = path
        self.read_only = False  # set by open(read_only=True)
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
        if not p.is_file():
            raise SessionError(f"{p}: not a file")
        try:
            with open(p, "rb") as fh:
                head = fh.read(len(SQLITE_MAGIC))
        except OSError as e:
            raise SessionError(f"{p}: cannot read ({e.strerror or e})") from None
        if head and head != SQLITE_MAGIC:
            raise SessionError(f"{p}: not a session file (not an SQLite database)")
        if read_only:
            if not head:
                raise SessionError(f"{p}: empty file, not a session")
            return cls._connect_read_only(p)
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
    def _connect_read_only(cls, p: Path) -> Session:
        with open(p, "rb") as fh:
            header = fh.read(100)
        # Header byte 18 is 2 for a WAL database. Without a -wal file no connection has it open, so it
        # can be read as immutable: SQLite then needs no -shm beside it (a read-only folder reads).
        wal_mode = len(header) > 18 and header[18] == 2
        immutable = wal_mode and not p.with_name(p.name + "-wal").exists()
        uri = p.resolve().as_uri() + "?mode=ro" + ("&immutable=1" if immutable else "")
        conn = None
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA query_only=ON")
            version = cls._file_version(conn, p)
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
                cls._migrate(conn, p)
        except (SessionError, sqlite3.Error) as e:
            if conn is not None:
                conn.close()
            if isinstance(e, SessionError):
                raise
            if "unable to open" in str(e):  # a -wal exists (open elsewhere) and no -shm can be made beside it
                raise SessionError(
                    f"{p}: cannot be read here ({e}): another program has it open and its folder is read-only"
                ) from None
            raise SessionError(_sqlite_problem(p, e)) from None
        s = cls(p, conn)
        s.read_only = True
        return s

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
        s = cls._connect(p, new=True)
        try:
            with s._lock, s._transaction():
                s._conn.execute("INSERT OR IGNORE INTO meta VALUES ('created', ?)", (_now(),))
                s._conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('store_images', ?)", ("1" if store_images else "0",)
                )
                if model_spec is not None:
                    s._upsert_model(_model_fields(model_spec))
        except BaseException:
            s.close()
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
            raise SessionError(_sqlite_problem(p, e)) from None
        try:
            if not new:
                version = cls._file_version(conn, p)  # read-only checks first: never touch a foreign file
                if version > SCHEMA_VERSION:
                    raise SessionError(
                        f"{p}: written by a newer VLM Readout (session schema {version}; this version reads up to "
                        f"{SCHEMA_VERSION}); upgrade to open it"
                    )
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                warnings.warn(f"{p}: WAL journal not available here; using {mode}", stacklevel=3)
            conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
            conn.execute("PRAGMA foreign_keys=ON")
            cls._migrate(conn, p)
        except SessionError:
            conn.close()
            raise
        except sqlite3.DatabaseError as e:
            conn.close()
            raise SessionError(_sqlite_problem(p, e)) from None
        return cls(p, conn)

    @staticmethod
    def _file_version(conn: sqlite3.Connection, p: Path, *, check: bool = True) -> int:
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            raise SessionError(_sqlite_problem(p, e)) from None
        if not tables and app_id in (0, APPLICATION_ID):
            return 0
        if app_id != APPLICATION_ID:
            raise SessionError(f"{p}: not a session file (an SQLite database of another program)")
        if check:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise SessionError(f"{p}: corrupt session file (integrity check: {problems[0]})")
        if "schema_version" not in tables:
            raise SessionError(f"{p}: corrupt session file (no schema_version table)")
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        if row is None or row[0] is None:
            raise SessionError(f"{p}: corrupt session file (empty schema_version table)")
        return int(row[0])

    @staticmethod
    def _migrate(conn: sqlite3.Connection, p: Path) -> None:
        """Bring the file to :data:`SCHEMA_VERSION` in one transaction (the
        version is re-read under the write lock: two openers migrate once)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = Session._file_version(conn, p, check=False)
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

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SessionError(f"{self.path}: the session is closed")
        return self._conn

    @contextmanager
    def _transaction(self):
        """``BEGIN IMMEDIATE`` (take the write lock up front) ... ``COMMIT``;
        ``ROLLBACK`` on any error (if SQLite has not already rolled back)."""
        conn = self._db()
        if self.read_only:
            raise SessionError(f"{self.path}: opened read-only; nothing can be recorded")
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def _guard(self, what: str):
        """Map SQLite failures inside the block to a one-line SessionError."""
        try:
            yield
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SessionError(f"{self.path}: corrupt session file ({what}: stored JSON unreadable: {e})") from None
        except sqlite3.Error as e:
            text = str(e)
            if "locked" in text or "busy" in text:
                msg = f"{self.path}: busy (another process holds the session) while {what}; try again"
            else:
                msg = f"{self.path}: {what} failed ({text})"
            raise SessionError(msg) from None

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
        with self._lock:
            return dict(self._db().execute("SELECT key, value FROM meta").fetchall())

    def check(self) -> str:
        """``PRAGMA integrity_check``: ``"ok"`` or the first problem."""
        with self._lock:
            return self._db().execute("PRAGMA integrity_check").fetchone()[0]

    def models(self) -> list[dict]:
        """Every model the session's runs used, oldest first."""
        with self._lock:
            rows = self._db().execute("SELECT id, spec, fingerprint, family, info, added FROM model ORDER BY id")
            return [self._model_dict(r) for r in rows.fetchall()]

    @property
    def model(self) -> dict | None:
        """The model most recently set or used (``{"id", "spec", "fingerprint", "family", "info", "added"}``)."""
        with self._lock:
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

    @staticmethod
    def _model_dict(row) -> dict:
        mid, spec, fp, family, info, added = row
        return {
            "id": mid,
            "spec": spec,
            "fingerprint": fp,
            "family": family,
            "info": json.loads(info) if info else None,
            "added": added,
        }

    def set_model(self, model, fingerprint: str | None = None, family: str | None = None) -> int:
        """Record a model (a spec string, LoadedModel or model dict); returns its id."""
        fields = _model_fields(model)
        if fields is None:
            raise SessionError("a model needs a spec")
        if fingerprint is not None:
            fields["fingerprint"] = fingerprint
        if family is not None:
            fields["family"] = family
        with self._lock, self._guard("recording the model"), self._transaction():
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
        kind: str,
        result: Any,
        audits: Iterable | None = None,
        image=None,
        mask=None,
        parameters: dict | None = None,
        *,
        summary: str | None = None,
        model=None,
        image_path: str | Path | None = None,
        store_image: bool | None = None,
    ) -> int:
        """Record one run in one transaction (autosave) and return its id.

        Args:
            kind: ``analyze``, ``counterfactual``, ``sweep``, ``intervention``,
                ``audit``, ``nonunique``, ``label``, ... (:data:`KINDS`; any
                lower-case identifier is accepted).
            result: the run's JSON-able result (numpy values are converted;
                non-finite floats are stored as null, as in every JSON the
                engine writes).
            audits: AuditRecords or their dicts; default: ``result["audit"]``.
            image: path, bytes, PIL image or ``(H, W, 3)`` uint8 array.
            mask: ``(H, W)`` bool array, PIL image, PNG bytes or PNG path
                (white = region); the image's size when an image is given.
            parameters: what the run was called with; default: read from the
                result (:func:`default_parameters`).
            summary: one line; default :func:`summarize_result`.
            model: LoadedModel, model dict or spec; default: ``result["model"]``.
            image_path: where a PIL/array image came from.
            store_image: keep the pixels; default: the session's setting.

        Raises:
            SessionError: unserialisable result, bad mask, busy or closed file.
        """
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            raise SessionError(f"run kind must be a short lower-case name like {', '.join(KINDS[:4])}; got {kind!r}")
        result_json = _dumps(result, "result")
        if audits is None:
            audits = result.get("audit", []) if isinstance(result, dict) else []
        audit_dicts = []
        for a in audits or []:
            d = a.to_dict() if hasattr(a, "to_dict") else dict(a)
            audit_dicts.append(d)
        if parameters is None:
            parameters = default_parameters(kind, result)
        params_json = _dumps(parameters, "parameters")
        if summary is None:
            summary = summarize_result(kind, result)
        summary = " ".join(str(summary).split())
        if model is None and isinstance(result, dict):
            model = result.get("model")
        model_fields = _model_fields(model)
        if store_image is None:
            store_image = self.meta().get("store_images", "1") == "1"
        img = _prepare_image(image, image_path, store_image) if image is not None else None
        m = _as_mask(mask, img[2] if img else None) if mask is not None else None
        mask_sha = _mask_sha(m) if m is not None else None
        mask_png = _mask_png(m) if m is not None else None

        with self._lock, self._guard("recording the run"):
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

    def _run_infos(self, where: str = "", args: tuple = ()) -> list[RunInfo]:
        rows = self._db().execute(
            "SELECT r.id, r.kind, r.created, r.summary, m.spec, r.image_sha256, r.mask_id, "
            "(SELECT COUNT(*) FROM audit_rows a WHERE a.run_id = r.id) "
            f"FROM runs r LEFT JOIN model m ON m.id = r.model_id {where} ORDER BY r.id",
            args,
        )
        return [RunInfo(*r) for r in rows.fetchall()]

    def runs(self, kind: str | None = None) -> list[RunInfo]:
        """Every run, oldest first (``kind``: only that kind)."""
        with self._lock, self._guard("reading the runs"):
            if kind is None:
                return self._run_infos()
            return self._run_infos("WHERE r.kind = ?", (kind,))

    def run(self, run_id: int) -> Run:
        """One run with its result, parameters, audit rows and model."""
        with self._lock, self._guard("reading a run"):
            conn = self._db()
            row = conn.execute(
                "SELECT id, kind, created, summary, parameters, result, model_id, image_sha256, mask_id "
                "FROM runs WHERE id = ?",
                (int(run_id),),
            ).fetchone()
            if row is None:
                raise SessionError(f"{self.path}: no run {run_id}")
            rid, kind, created, summary, params, result, model_id, sha, mask_id = row
            model = None
            if model_id is not None:
                m = conn.execute(
                    "SELECT id, spec, fingerprint, family, info, added FROM model WHERE id = ?", (model_id,)
                ).fetchone()
                model = self._model_dict(m) if m else None
            audits = [
                {
                    "method": a[0],
                    "question": a[1],
                    "operation": a[2],
                    "controls": json.loads(a[3]) if a[3] else [],
                    "supports": a[4],
                    "cannot_support": a[5],
                    "parameters": json.loads(a[6]) if a[6] else {},
                    "notes": json.loads(a[7]) if a[7] else [],
                }
                for a in conn.execute(
                    "SELECT method, question, operation, controls, supports, cannot_support, parameters, notes "
                    "FROM audit_rows WHERE run_id = ? ORDER BY ord",
                    (rid,),
                )
            ]
            return Run(rid, kind, created, summary, json.loads(params), json.loads(result), audits, model, sha, mask_id)

    def image(self, sha256: str) -> ImageInfo | None:
        """A session image by hash (None when the session has none such)."""
        with self._lock, self._guard("reading an image"):
            row = (
                self._db()
                .execute("SELECT sha256, path, width, height, png FROM images WHERE sha256 = ?", (sha256,))
                .fetchone()
            )
        if row is None:
            return None
        sha, path, w, h, png = row
        return ImageInfo(sha, path, (w, h) if w is not None else None, png)

    def images(self) -> list[ImageInfo]:
        """Every image, without pixels (see :meth:`image`)."""
        with self._lock, self._guard("reading the images"):
            rows = self._db().execute("SELECT sha256, path, width, height FROM images ORDER BY added").fetchall()
        return [ImageInfo(s, p, (w, h) if w is not None else None) for s, p, w, h in rows]

    def mask(self, mask_id: int):
        """A mask as an ``(H, W)`` bool array (True = region), or None."""
        with self._lock, self._guard("reading a mask"):
            row = self._db().execute("SELECT png FROM masks WHERE id = ?", (int(mask_id),)).fetchone()
        if row is None:
            return None
        try:
            return _mask_array(row[0])
        except ImageLoadError as e:
            reason = str(e).removeprefix("image bytes: ")
            raise SessionError(f"{self.path}: the stored mask {mask_id} is unreadable ({reason})") from None

    def audit_table(self, kinds: Iterable[str] | None = None) -> list[dict]:
        """The session's audit table: one row per audit record of each run
        (a run without audit records gets one row with empty method columns),
        oldest run first. Columns: :data:`AUDIT_COLUMNS` (``controls`` and
        ``notes`` are lists, ``parameters`` and ``run_parameters`` dicts)."""
        kinds = list(kinds) if kinds is not None else None
        where = ""
        if kinds is not None:
            where = f"WHERE r.kind IN ({', '.join('?' * len(kinds))})" if kinds else "WHERE 0"
        with self._lock, self._guard("reading the audit table"):
            rows = (
                self._db()
                .execute(
                    "SELECT r.id, r.kind, r.created, m.spec, a.method, a.question, a.operation, a.controls, "
                    "a.supports, a.cannot_support, a.parameters, a.notes, r.parameters, r.summary "
                    "FROM runs r LEFT JOIN model m ON m.id = r.model_id "
                    f"LEFT JOIN audit_rows a ON a.run_id = r.id {where} ORDER BY r.id, a.ord",
                    kinds or (),
                )
                .fetchall()
            )
            out = []
            for r in rows:
                d = dict(zip(AUDIT_COLUMNS, r))
                d["controls"] = json.loads(d["controls"]) if d["controls"] else []
                d["notes"] = json.loads(d["notes"]) if d["notes"] else []
                d["parameters"] = json.loads(d["parameters"]) if d["parameters"] else {}
                d["run_parameters"] = json.loads(d["run_parameters"]) if d["run_parameters"] else {}
                out.append(d)
        return out


# ---------------------------------------------------------------- command-line helpers


def check_session_file(path: str | Path) -> None:
    """Fail fast, before a long run: an existing file must open as a session
    (this migrates it), a new one needs an existing folder."""
    p = Path(path)
    if _exists(p):
        Session.open(p).close()
    elif not p.parent.is_dir():
        raise SessionError(f"{p.parent}: no such folder for the session file")
    elif not os.access(p.parent, os.W_OK | os.X_OK):
        raise SessionError(f"{p}: cannot create the session file (its folder is not writable)")


def record_into(path: str | Path, kind: str, result: Any, **kwargs) -> int:
    """Open (or create) the session at ``path``, :meth:`Session.record` one
    run, close. For ``--session FILE`` on the CLI commands."""
    with Session.open_or_create(path) as s:
        return s.record(kind, result, **kwargs)
