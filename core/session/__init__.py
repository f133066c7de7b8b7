"""The session store: one SQLite file per session.

A session keeps everything a user (the app, the CLI, a notebook) ran on a
model: the model spec and fingerprint, the images (hash, path, size and,
by default, the pixels as PNG), the painted masks, and every run with its
parameters, its result JSON, a one-line summary and its audit rows (the
audit columns of docs/ARCHITECTURE.md, "Audit rows": :class:`core.results.audit.AuditRecord`). Reopening the file
gives the same state back; :meth:`Session.audit_table` is the table the app's
audit panel shows and :mod:`core.export` writes.

    s = Session.open_or_create("work.vlmr")
    run_id = s.record(result, image=img)     # a Readout; one transaction: autosave
    s.runs(); s.run(run_id).readout; s.audit_table(); s.save_as("copy.vlmr"); s.close()

:meth:`Session.record` stores what the result says about itself
(:class:`core.results.readout.Readout`: its kind, ``to_dict()``, ``summary()``,
``parameters()`` and ``audit_records()``); the session never guesses them
from a result's keys. A document without a result class of its own is
recorded as a :class:`core.results.readout.RecordedResult`. A run read back gives its
result both as stored (``Run.result``, the JSON) and as its kind's class
(``Run.readout``, :func:`core.results.readout.restore_result`).

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
* After each commit the WAL is checkpointed into the main file
  (``PRAGMA wal_checkpoint(TRUNCATE)``, :meth:`Session.checkpoint`): the
  ``.vlmr`` alone is the complete session at every moment, so copying just
  that file (the natural way to share it) while the app has it open gives
  every run. A reader on an old snapshot only delays it (a few short
  retries, then the next record tries again); it never fails a record.
  bench/session_checkpoint.py measures what it costs per record.
* :meth:`Session.save_as` writes one self-contained copy (SQLite's online
  backup into a temporary file beside the target, then ``os.replace``).

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
``-shm`` is made and a session in a read-only folder reads; a ``-wal``
without its ``-shm`` (a killed writer), or a ``-shm`` SQLite cannot use (a
full disk), is read with the file into memory instead
(:func:`core.session.files.replayed_copy`); an older schema is migrated in a
copy in memory; an empty file is refused, not made a session.
:attr:`Session.read_only` says so; recording into it is a one-line
:class:`SessionError` ("the session is open read-only; ...").

A file from elsewhere is untrusted: before anything is written to it, its
tables, columns and indexes must be the ones the migrations make (no views,
triggers or generated columns), its ``schema_version``, ``meta`` and ``model``
rows of the types the session writes; every value read back is checked
(:mod:`core.session.stored`). A run holding a value the session never writes
is :class:`DamagedRunError` (``<file>: run N: <why>``); listings and the audit
table leave it out (their ``damaged`` argument collects ``{run id: why}``).
A full disk is said as such (``the disk is full``), never as corruption.

Reproducing a run: :meth:`Session.run` gives the kind, time, result JSON,
parameters, summary, model (spec, fingerprint, family), the image (hash,
path as given, pixels: :meth:`Run.pixels`) and the mask (:meth:`Run.mask`);
every row of :meth:`Session.audit_table` starts with the run's columns
(:data:`RUN_COLUMNS`: input path and SHA-256, model spec and fingerprint,
question, target, the method's specification, the numeric summary).

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

The package: ``records`` (the rows, the audit columns, a run's columns,
SessionError, DamagedRunError, images, masks and models into row values),
``schema`` (the file format, the frozen v1 statements, the migrations, the
columns each version has), ``files`` (the WAL checkpoint, the backup copy, the
checks before SQLite opens a file, reading a WAL without its -shm),
``stored`` (stored values read back, checked), ``store`` (:class:`Session`,
:func:`check_session_file`, :func:`record_into`); every public name is
importable from ``core.session``.
"""

from core.results.readout import jsonable  # re-exported: the one JSON cleaning, as the session stores it
from core.session.records import (
    AUDIT_COLUMNS,
    KINDS,
    METHOD_COLUMNS,
    RUN_COLUMNS,
    DamagedRunError,
    ImageInfo,
    Run,
    RunInfo,
    SessionError,
)
from core.session.schema import (
    APPLICATION_ID,
    BUSY_TIMEOUT_S,
    MIGRATIONS,
    SCHEMA_VERSION,
    SQLITE_MAGIC,
    SYNCHRONOUS,
)
from core.session.store import Session, check_session_file, record_into

__all__ = [
    "APPLICATION_ID",
    "AUDIT_COLUMNS",
    "BUSY_TIMEOUT_S",
    "KINDS",
    "METHOD_COLUMNS",
    "MIGRATIONS",
    "RUN_COLUMNS",
    "SCHEMA_VERSION",
    "SQLITE_MAGIC",
    "SYNCHRONOUS",
    "DamagedRunError",
    "ImageInfo",
    "Run",
    "RunInfo",
    "Session",
    "SessionError",
    "check_session_file",
    "jsonable",
    "record_into",
]
