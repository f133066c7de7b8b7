"""Coverage-guided fuzzing of "session open and export" with atheris: what
``vlm-readout export`` and every ``--session`` read of a session file.

Run (see tests/fuzz/README.md)::

    .venv/bin/python tests/fuzz/fuzz_session.py /tmp/fuzz-session tests/fuzz/corpus/session \\
        -max_total_time=600 -rss_limit_mb=3072 -timeout=20 -artifact_prefix=/tmp/fuzz-session/
    .venv/bin/python tests/fuzz/fuzz_session.py --write-corpus   # rewrite the seed corpus

An input is one of:

* ``SQLite format 3\\0...``: the bytes are the session file itself;
* ``RAW\\0...``: the rest is the session file (an empty file, text, anything);
* ``WAL\\0...``: the rest is the ``-wal`` beside the base session (WAL mode,
  no ``-shm``: what a killed writer leaves), read by
  :func:`core.session.files.replayed_copy`;
* anything else: SQL statements (``;``-separated, UTF-8) run on a copy of the
  base session (four runs with pictures, a mask, an audit row) before it is
  read: the hostile values the issue names (a table dropped, a
  ``schema_version`` of text, ``parameters`` of ``null``, a result nested
  thousands deep) and what the fuzzer makes of them. The SQL runs with a
  length limit, a step limit, and never ``ATTACH`` or ``VACUUM``: it only
  changes that copy.

Each input is then exported as csv, json and one of html or png (read-only:
the session's folder must not change) and recorded into (``check_session_file``,
``record_into``; a run recorded must read back). A **finding** is any
exception other than :class:`core.errors.ReadoutError`, an error or a
warning that is not one line naming the file or the run, a change to the
session's folder by an export, a hang (``-timeout``) or memory over
``-rss_limit_mb``. The suite replays the corpus through the same
:func:`TestOneInput` without atheris (tests/fuzz/test_fuzz_session.py).
"""

from __future__ import annotations

import io
import re
import sqlite3
import sys
import tempfile
import zlib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CORPUS = Path(__file__).parent / "corpus" / "session"
SQLITE_MAGIC = b"SQLite format 3\x00"
RAW, WAL = b"RAW\x00", b"WAL\x00"
FORMATS = ("csv", "json", "html", "png")
MAX_STATEMENTS = 32
_REFUSED_SQL = re.compile(r"\b(ATTACH|DETACH|VACUUM|load_extension)\b", re.IGNORECASE)
_base: dict[str, bytes] = {}


# ---------------------------------------------------------------- the base session


def _tiny_png() -> bytes:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:16, 0:16]
    pixels = np.stack([x * 16, y * 16, (x + y) * 8], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _analyze_doc() -> dict:
    boxes = [[c * 8, r * 8, c * 8 + 8, r * 8 + 8] for r in range(2) for c in range(2)]
    tokens = [{"image": 0, "row": i // 2, "col": i % 2, "box": b} for i, b in enumerate(boxes)]
    grid = [[0.1, 0.2], [0.3, 0.4]]
    return {
        "target": {"position": 7, "answer": "red"},
        "input": {"visual_tokens": tokens},
        "rollout": {"visual_patch_mass": grid, "alpha": 0.5, "primary_image": 0},
        "attention": [
            {"layer": 0, "head": 1, "visual_patch_mass": grid, "visual_mass": 0.7},
            {"block": "L1", "layer": 1, "head": 0, "visual_patch_mass": grid, "visual_mass": 0.2},
        ],
        "residual_decomposition": {"components": [{"name": "L1.H0", "dla_frozen": -0.4}]},
        "text_patterns": {
            "blocks": [0],
            "patterns": [[[[1.0, 0.0], [0.4, 0.6]], [[1.0, 0.0], [0.5, 0.5]]]],
            "allowed": [[[True, False], [True, True]]],
            "other_mass": [{"image": [[0.0, 0.1], [0.0, 0.2]]}],
            "tokens": ["is", "red"],
            "positions": [6, 7],
            "answer_position": 7,
        },
    }


def build_base(folder: Path) -> Path:
    """The base session (deterministic: fixed times): an analyze-like run with
    rollout, heads and text patterns, an occlusion sweep, a counterfactual with
    its painted mask (all on one stored 16x16 image) and a note with an audit
    row; 512-byte pages in WAL mode, so it and a WAL of it stay small."""
    import numpy as np

    import core.session.records as records
    import core.session.store as store
    from core.results.readout import RecordedResult
    from core.session import Session

    saved = records._now, store._now
    records._now = store._now = lambda: "2026-01-02T03:04:05.678+00:00"
    try:
        path = folder / "base.vlmr"
        image = _tiny_png()
        mask = np.zeros((16, 16), bool)
        mask[2:9, 3:12] = True
        audit = {
            "method": "note",
            "question": "q",
            "operation": "none",
            "controls": ["c"],
            "supports": "s",
            "cannot_support": "n",
            "parameters": {"k": 1},
            "notes": ["n"],
        }
        sweep = {
            "sweep": {
                "k": 1,
                "fill": "mean",
                "logit_change": [[0.1, -0.5], [0.2, 0.0]],
                "logit_diff_change": None,
                "cells": [
                    {"row": r, "col": c, "box": [c * 8, r * 8, c * 8 + 8, r * 8 + 8]} for r in (0, 1) for c in (0, 1)
                ],
            }
        }
        with Session.create(path, "shapes-llava") as s:
            s.record(RecordedResult("analyze", _analyze_doc(), "an analysis", {"question": "q?"}), image=image)
            s.record(RecordedResult("sweep", sweep, "a sweep"), image=image)
            s.record(RecordedResult("counterfactual", {"fill": "mean"}, "painted"), image=image, mask=mask)
            s.record(RecordedResult("note", {"text": "hi"}, "a note", {"dataset": "d.jsonl"}, [audit]))
    finally:
        records._now, store._now = saved
    with sqlite3.connect(path, isolation_level=None) as c:
        c.execute("PRAGMA journal_mode=DELETE")
        c.execute("PRAGMA page_size=512")
        c.execute("VACUUM")
        c.execute("PRAGMA journal_mode=WAL")
    c.close()
    return path


def _base_bytes() -> bytes:
    if "session" not in _base:
        with tempfile.TemporaryDirectory() as d:
            _base["session"] = build_base(Path(d)).read_bytes()
    return _base["session"]


# ---------------------------------------------------------------- one input


def _apply_sql(path: Path, text: str) -> None:
    """Run the input's statements on ``path`` (errors ignored: a statement that
    does not parse or apply just changes nothing), bounded in size and steps."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1 << 22)  # no blob or text over 4 MB from the SQL itself
        conn.set_progress_handler(lambda: 1, 2_000_000)  # a statement that runs too long is stopped
        conn.execute("PRAGMA writable_schema = OFF")
        for statement in _statements(text)[:MAX_STATEMENTS]:
            if _REFUSED_SQL.search(statement):
                continue
            try:
                conn.execute(statement)
            except (sqlite3.Error, ValueError, OverflowError):
                continue
        if conn.in_transaction:
            conn.execute("COMMIT")
    finally:
        conn.close()


def _statements(text: str) -> list[str]:
    """``text`` cut into whole statements (a trigger's body keeps its own ``;``)."""
    out, pending = [], ""
    for part in text.split(";"):
        pending += part + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                out.append(pending)
            pending = ""
    if pending.strip(" \t\r\n;"):
        out.append(pending)
    return out


def _folder(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _check_message(message: str, names: tuple[str, ...]) -> None:
    assert "\n" not in message, f"a message of several lines: {message!r}"
    assert message.startswith(names), f"a message that does not start with the file: {message!r}"


def TestOneInput(data: bytes) -> None:
    """Write ``data`` where a session file is read, export it in every format
    and record into it; raise AssertionError (or let any other exception
    through) on a finding."""
    from core.errors import ReadoutError
    from core.export import export_session
    from core.results.readout import RecordedResult
    from core.session import Session, check_session_file, record_into

    with tempfile.TemporaryDirectory() as d:
        home, out = Path(d) / "home", Path(d) / "out"
        home.mkdir()
        path = home / "s.vlmr"
        if data.startswith(SQLITE_MAGIC):
            path.write_bytes(data)
        elif data.startswith(RAW):
            path.write_bytes(data[len(RAW) :])
        elif data.startswith(WAL):
            path.write_bytes(_base_bytes())
            path.with_name("s.vlmr-wal").write_bytes(data[len(WAL) :])
        else:
            path.write_bytes(_base_bytes())
            _apply_sql(path, data.decode("utf-8", "replace").replace("\0", " "))  # sqlite3 takes no NUL in SQL
        names = (str(path),)
        before = _folder(home)
        # csv and json read every table and run; html and png draw the pictures from the same reads:
        # one of them per input (by its hash, so a replay does what the fuzzer did) keeps inputs fast
        for fmt in ("csv", "json", FORMATS[2 + zlib.crc32(data) % 2]):
            notes: list[str] = []
            try:
                export_session(path, fmt, out / fmt, notes=notes)
            except ReadoutError as e:
                _check_message(str(e), names)
            for note in notes:
                _check_message(note, ("run ",))
            assert _folder(home) == before, f"export --format {fmt} changed the session's folder"
        try:
            check_session_file(path)
            run_id = record_into(path, RecordedResult("note", {"fuzz": True}, "recorded by the fuzzer"))
        except ReadoutError as e:
            _check_message(str(e), names)
            return
        with Session.open(path, read_only=True) as s:
            assert s.run(run_id).summary == "recorded by the fuzzer"


# ---------------------------------------------------------------- the seed corpus

_DEEP = "[" * 3000 + "]" * 3000
SQL_SEEDS = {
    "base.sql": "-- the base session as it is",
    "no-meta.sql": "DROP TABLE meta",
    "no-runs.sql": "DROP TABLE runs",
    "version-negative.sql": "UPDATE schema_version SET version = -1 WHERE version = 1",
    "version-text.sql": "UPDATE schema_version SET version = 'two' WHERE version = 2",
    "version-blob.sql": "UPDATE schema_version SET version = x'02' WHERE version = 2",
    "version-none.sql": "DELETE FROM schema_version",
    "version-newer.sql": "INSERT INTO schema_version VALUES (3, 'later')",
    "parameters-null.sql": "UPDATE runs SET parameters = 'null' WHERE id = 1",
    "parameters-list.sql": "UPDATE runs SET parameters = '[1, 2]' WHERE id = 2",
    "parameters-string.sql": "UPDATE runs SET parameters = '\"text\"' WHERE id = 3",
    "parameters-invalid.sql": "UPDATE runs SET parameters = '{\"q\": ' WHERE id = 4",
    "parameters-all-null.sql": "UPDATE runs SET parameters = 'null'",
    "created-blob.sql": "UPDATE runs SET created = x'00ff' WHERE id = 2",
    "result-deep.sql": f"UPDATE runs SET result = '{_DEEP}' WHERE id = 1",
    "result-not-json.sql": "UPDATE runs SET result = '{not json' WHERE id = 2",
    "result-block-path.sql": "UPDATE runs SET result = json_set(result, '$.attention[1].block', '../x/y') WHERE id = 1",
    "result-mass-text.sql": "UPDATE runs SET result = json_set(result, '$.attention[0].visual_mass', 'lots') WHERE id = 1",
    "result-box-huge.sql": (
        "UPDATE runs SET result = replace(result, '[0,0,8,8]', '[1e999,0,8,8]') WHERE id = 1; "
        "UPDATE runs SET result = replace(result, '\"alpha\":0.5', '\"alpha\":1e999') WHERE id = 1"
    ),
    "result-cell-row.sql": "UPDATE runs SET result = json_set(result, '$.sweep.cells[0].row', 'x') WHERE id = 2",
    "result-text-pattern.sql": (
        "UPDATE runs SET result = json_set(result, '$.text_patterns.patterns[0][1]', json('[[1, \"x\"], [2]]')) WHERE id = 1"
    ),
    "result-huge-grid.sql": (
        "UPDATE runs SET result = json_set(result, '$.rollout.visual_patch_mass', "
        "json('[[' || replace(hex(zeroblob(70000)), '00', '0,') || '0]]')) WHERE id = 1"
    ),
    "a-view.sql": "CREATE VIEW v AS SELECT 1",
    "a-trigger.sql": "CREATE TRIGGER t AFTER INSERT ON runs BEGIN DELETE FROM runs; END",
    "generated-column.sql": "ALTER TABLE runs ADD COLUMN g TEXT GENERATED ALWAYS AS (kind) VIRTUAL",
    "meta-blob.sql": "UPDATE meta SET value = x'00' WHERE key = 'created'",
    "model-info.sql": "UPDATE model SET info = '{'",
    "audit-controls.sql": "UPDATE audit_rows SET controls = '{\"a\": 1}'",
    "image-width.sql": "UPDATE images SET width = 'wide'",
    "image-png-junk.sql": "UPDATE images SET png = x'89504e470d0a1a0a00'",
    "mask-text.sql": "UPDATE masks SET png = 'not a png'",
    "app-id.sql": "PRAGMA application_id = 7",
    "sql-with-nul.sql": "DROP TABLE\x00meta",  # run 0's harness finding: sqlite3 takes no NUL in SQL
}


def _killed_writer_wal(folder: Path) -> bytes:
    """The -wal of the base session as a writer killed before its checkpoint leaves it (one run)."""
    from core.results.readout import RecordedResult
    from core.session import Session

    path = folder / "wal.vlmr"
    path.write_bytes(_base_bytes())
    writer = Session.open(path)
    writer.checkpoint_each_run = False
    writer._conn.execute("PRAGMA wal_autocheckpoint = 0")
    writer.record(RecordedResult("note", {"only": "in the wal"}, "only in the wal"))
    wal = path.with_name("wal.vlmr-wal").read_bytes()
    writer.close()
    return wal


def seeds() -> dict[str, bytes]:
    """Every seed: the SQL ones, raw files (the base, cut short, empty, text)
    and WALs (a killed writer's, one cut mid-frame, one of another page size)."""
    out = {name: text.encode() for name, text in SQL_SEEDS.items()}
    base = _base_bytes()
    with tempfile.TemporaryDirectory() as d:
        wal = _killed_writer_wal(Path(d))
    out.update(
        {
            "raw-base.vlmr": base,
            "raw-cut.vlmr": base[:1500],
            "raw-empty.bin": RAW,
            "raw-text.bin": RAW + b"just some notes\n",
            "wal-killed-writer.bin": WAL + wal,
            "wal-torn.bin": WAL + wal[: len(wal) - 200],
            "wal-header-only.bin": WAL + wal[:32],
        }
    )
    return out


def write_corpus() -> None:
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (CORPUS / name).write_bytes(data)
    total = sum(p.stat().st_size for p in CORPUS.iterdir())
    print(f"{len(seeds())} seeds written to {CORPUS} ({total:,} bytes in the folder)")


def main() -> None:
    import warnings

    import atheris

    warnings.simplefilter("ignore")
    with atheris.instrument_imports(
        include=[
            "core.session",
            "core.export",
            "core.files.input_files",
            "core.files.atomic",
            "core.results.audit_tables",
        ]
    ):
        import core.export  # noqa: F401
        import core.files.atomic  # noqa: F401
        import core.session  # noqa: F401
    _base_bytes()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-corpus"]:
        write_corpus()
    else:
        main()
