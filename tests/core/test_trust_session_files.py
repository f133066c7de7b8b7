"""Session files from elsewhere, read by ``export`` and ``--session``: SQLite
keeps any type in any column, so every table, column and stored value is
checked as it is read. A file-level problem (a table missing, a schema_version
that is not a version, SQL of its own: a view, a trigger, a generated column;
meta or model rows of the wrong type) is one ``error:`` line naming the file,
and the file is left as it was. A damaged run (a blob where its time belongs,
parameters that are not a JSON object, a result nested thousands deep) is one
``warning: run N: ...`` line and every other run is exported; recording into
such a session still works and leaves the damaged run as it was."""

import csv
import io
import json
import re
import sqlite3
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import core.cli
from core.cli import main
from core.results.readout import RecordedResult
from core.session import Session, SessionError, check_session_file, record_into
from tests.core.test_trust_sessions import IMAGE, PAINTED, SWEEP

FORMATS = ("csv", "md", "json", "html", "png")
NOTE_AUDIT = {
    "method": "note",
    "question": "what was seen?",
    "operation": "none",
    "controls": ["a control"],
    "supports": "nothing",
    "cannot_support": "anything",
    "parameters": {"k": 1},
    "notes": ["a note"],
}


def _session(path: Path) -> Path:
    """Three runs: 1 a sweep on the stored image, 2 a counterfactual on the same
    image with a painted mask, 3 a note with an audit row and no image."""
    mask = np.zeros((128, 128), bool)
    mask[10:40, 20:60] = True
    with Session.create(path, "shapes-llava") as s:
        s.record(RecordedResult("sweep", SWEEP, "a 2x2 sweep"), image=IMAGE)
        s.record(RecordedResult("counterfactual", PAINTED, "painted"), image=IMAGE, mask=mask)
        s.record(RecordedResult("note", {"text": "hi"}, "a note", {"question": "q?"}, [NOTE_AUDIT]))
    return path


def _sql(path: Path, *statements: str) -> None:
    with closing(sqlite3.connect(path)) as c:
        for statement in statements:
            c.execute(statement)
        c.commit()
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _loosen_runs(path: Path) -> None:
    """Redeclare the runs table with the same columns, types and key but no
    NOT NULL: what a file from another program may hold (SQL NULL anywhere)."""
    with closing(sqlite3.connect(path)) as c:
        info = c.execute("PRAGMA table_info(runs)").fetchall()
        cols = ", ".join(f"{r[1]} {r[2]}{' PRIMARY KEY' if r[5] else ''}" for r in info)
        names = ", ".join(r[1] for r in info)
        c.executescript(
            f"CREATE TABLE loose ({cols}); INSERT INTO loose ({names}) SELECT {names} FROM runs; "
            "DROP TABLE runs; ALTER TABLE loose RENAME TO runs; CREATE INDEX runs_kind ON runs(kind);"
        )
        c.commit()


def _folder_state(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _export(capsys, session: Path, fmt: str, out: Path) -> tuple[int, list[str]]:
    code = main(["export", "--session", str(session), "--format", fmt, "--out", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def _exported_run_ids(fmt: str, out: Path) -> set[int]:
    if fmt == "csv":
        return {int(row["run_id"]) for row in csv.DictReader(io.StringIO(out.read_text()))}
    if fmt == "json":
        doc = json.loads(out.read_text())
        assert {r["run_id"] for r in doc["audit_table"]} <= {r["id"] for r in doc["runs"]}
        return {r["id"] for r in doc["runs"]}
    if fmt == "html":
        return {int(n) for n in re.findall(r'<section class="run" id="run-(\d+)">', out.read_text())}
    if fmt == "md":
        return {int(line.split("|")[1]) for line in out.read_text().splitlines() if re.match(r"\| \d+ \|", line)}
    return {int(p.name[3:7]) for p in out.iterdir()} if out.exists() else set()


@pytest.fixture
def home(tmp_path) -> Path:
    folder = tmp_path / "sessions"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------- damaged runs: a warning each, the rest exported

_DEEP = "[" * 100_000 + "]" * 100_000
# A number stored in a TEXT column becomes text (column affinity), so the wrong types a file can hold
# there are blobs; INTEGER columns keep text and blobs.
# (name, statements, runs damaged for every format, runs damaged where results and pictures are read,
#  what the first warning says). csv and md read no result; json, html and png read every run in full.
RUN_CASES = [
    (
        "parameters JSON null",
        ["UPDATE runs SET parameters = 'null' WHERE id = 3"],
        {3},
        set(),
        "parameters holds JSON null",
    ),
    ("parameters a list", ["UPDATE runs SET parameters = '[1, 2]' WHERE id = 3"], {3}, set(), "a JSON array"),
    ("parameters a string", ["UPDATE runs SET parameters = '\"text\"' WHERE id = 3"], {3}, set(), "a JSON string"),
    ("parameters not JSON", ["UPDATE runs SET parameters = '{\"q\": ' WHERE id = 3"], {3}, set(), "not valid JSON"),
    ("parameters a blob", ["UPDATE runs SET parameters = x'7b7d' WHERE id = 3"], {3}, set(), "parameters holds a blob"),
    ("parameters nested deep", [f"UPDATE runs SET parameters = '{_DEEP}' WHERE id = 3"], {3}, set(), "nested deeper"),
    ("created a blob", ["UPDATE runs SET created = x'00ff' WHERE id = 2"], {2}, set(), "created holds a blob"),
    ("kind a blob", ["UPDATE runs SET kind = x'01' WHERE id = 1"], {1}, set(), "kind holds a blob"),
    ("kind not a kind", ["UPDATE runs SET kind = 'Not a\nkind' WHERE id = 1"], {1}, set(), "not a run kind"),
    ("summary a blob", ["UPDATE runs SET summary = x'00' WHERE id = 3"], {3}, set(), "summary holds a blob"),
    ("result nested deep", [f"UPDATE runs SET result = '{_DEEP}' WHERE id = 2"], set(), {2}, "nested deeper than 64"),
    ("result not JSON", ["UPDATE runs SET result = '{not json' WHERE id = 2"], set(), {2}, "stored JSON unreadable"),
    ("result a blob", ["UPDATE runs SET result = x'7b7d' WHERE id = 1"], set(), {1}, "result holds a blob"),
    ("audit controls", ["UPDATE audit_rows SET controls = '{\"a\": 1}'"], {3}, set(), "audit row 0: controls"),
    ("audit notes blob", ["UPDATE audit_rows SET notes = x'00'"], {3}, set(), "audit row 0: notes holds a blob"),
    ("audit method blob", ["UPDATE audit_rows SET method = x'07'"], {3}, set(), "audit row 0: method holds a blob"),
    ("image path a blob", ["UPDATE images SET path = x'2f'"], {1, 2}, set(), "path holds a blob"),
    ("image width text", ["UPDATE images SET width = 'wide'"], set(), {1, 2}, "width holds text"),
    (
        "image sha a blob",
        ["UPDATE runs SET image_sha256 = x'00' WHERE id = 1"],
        {1},
        set(),
        "image_sha256 holds a blob",
    ),
    ("mask png text", ["UPDATE masks SET png = 'not a png'"], set(), {2}, "the stored mask 1's png holds text"),
    ("mask id text", ["UPDATE runs SET mask_id = 'first' WHERE id = 2"], {2}, set(), "mask_id holds text"),
    ("model id text", ["UPDATE runs SET model_id = 'm' WHERE id = 1"], set(), {1}, "model_id holds text"),
]


@pytest.mark.parametrize(
    ("statements", "in_table", "in_full", "needle"),
    [case[1:] for case in RUN_CASES],
    ids=[case[0] for case in RUN_CASES],
)
def test_a_damaged_run_is_a_warning_and_the_rest_is_exported(
    capsys, home, tmp_path, statements, in_table, in_full, needle
):
    session = _session(home / "s.vlmr")
    _sql(session, *statements)
    before = _folder_state(home)
    for fmt in FORMATS:
        out = tmp_path / ("png" if fmt == "png" else f"audit.{fmt}")
        code, err = _export(capsys, session, fmt, out)
        damaged = in_table | (in_full if fmt in ("json", "html", "png") else set())
        assert code == 0, (fmt, err)
        warned = [line for line in err if line.startswith("warning: run ") and line.endswith("left out of the export")]
        assert [int(line.split()[2].rstrip(":")) for line in warned] == sorted(damaged), (fmt, err)
        assert all("\n" not in line for line in err)
        if damaged:
            assert needle in warned[0], (fmt, warned)
        exported = _exported_run_ids(fmt, out)
        assert exported <= {1, 2, 3} - damaged, (fmt, exported)
        if fmt != "png":  # every run not damaged is there (png: only runs with pictures)
            assert exported == {1, 2, 3} - damaged, (fmt, exported)
        if fmt == "json":
            listed = json.loads(out.read_text())["session"]["damaged_runs"]
            assert [d["run_id"] for d in listed] == sorted(damaged)
    assert _folder_state(home) == before, "an export changed the session's folder"


def test_parameters_sql_null_and_summary_null_are_damaged_runs(capsys, home, tmp_path):
    """A file from another program may hold SQL NULL where the session declares NOT NULL."""
    session = _session(home / "s.vlmr")
    _loosen_runs(session)
    _sql(session, "UPDATE runs SET parameters = NULL WHERE id = 1", "UPDATE runs SET summary = NULL WHERE id = 3")
    code, err = _export(capsys, session, "json", tmp_path / "a.json")
    assert code == 0 and len(err) == 2, err
    assert err[0] == "warning: run 1: parameters holds null, expected JSON text; left out of the export"
    assert err[1] == "warning: run 3: summary holds null, expected text; left out of the export"
    assert [r["id"] for r in json.loads((tmp_path / "a.json").read_text())["runs"]] == [2]


def test_every_run_damaged_is_an_error_and_writes_nothing(capsys, home, tmp_path):
    session = _session(home / "s.vlmr")
    _sql(session, "UPDATE runs SET parameters = 'null'")
    for fmt in FORMATS:
        out = tmp_path / f"out-{fmt}"
        code, err = _export(capsys, session, fmt, out)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: {session}: none of its runs can be read (3 damaged; run 1: parameters ")
        assert not out.exists() or list(out.iterdir()) == []


def test_recording_into_a_session_with_a_damaged_run_keeps_it_as_it_was(home):
    session = _session(home / "s.vlmr")
    deep = "[" * 5000 + "]" * 5000
    _sql(session, f"UPDATE runs SET result = '{deep}' WHERE id = 2", "UPDATE runs SET created = x'00' WHERE id = 3")
    check_session_file(session)  # what --session runs before the model loads
    assert record_into(session, RecordedResult("note", {"n": 4}, "recorded after")) == 4
    with closing(sqlite3.connect(session)) as c:
        assert c.execute("SELECT result FROM runs WHERE id = 2").fetchone()[0] == deep
        assert c.execute("SELECT created FROM runs WHERE id = 3").fetchone()[0] == b"\x00"
    with Session.open(session, read_only=True) as s:
        damaged: dict[int, str] = {}
        assert [r.id for r in s.runs(damaged=damaged)] == [1, 2, 4] and list(damaged) == [3]
        with pytest.raises(SessionError, match=r"s\.vlmr: run 2: result: stored JSON unreadable: JSON nested") as e:
            s.run(2)
        assert "\n" not in str(e.value) and e.value.run_id == 2
        assert s.run(4).summary == "recorded after"


# ---------------------------------------------------------------- file-level problems: one error, the file untouched


def _recreate_runs_untyped(path: Path) -> None:
    with closing(sqlite3.connect(path)) as c:
        names = ", ".join(r[1] for r in c.execute("PRAGMA table_info(runs)"))
        c.executescript(
            f"CREATE TABLE loose ({names}); INSERT INTO loose SELECT {names} FROM runs; "
            "DROP TABLE runs; ALTER TABLE loose RENAME TO runs;"
        )
        c.commit()


FILE_CASES = [
    ("no meta table", ["DROP TABLE meta"], "damaged session file (no meta table)"),
    ("no runs table", ["DROP TABLE runs"], "damaged session file (no runs table)"),
    ("no model table", ["DROP TABLE model"], "damaged session file (no model table)"),
    ("version negative", ["UPDATE schema_version SET version = -1 WHERE version = 1"], "a whole number (-1)"),
    ("version text", ["UPDATE schema_version SET version = 'two' WHERE version = 2"], "holds the text 'two'"),
    ("version blob", ["UPDATE schema_version SET version = x'02' WHERE version = 2"], "holds a blob of 1 bytes"),
    ("version real", ["UPDATE schema_version SET version = 1.5 WHERE version = 1"], "a real number (1.5)"),
    ("version zero", ["UPDATE schema_version SET version = 0 WHERE version = 1"], "a whole number (0)"),
    ("versions none", ["DELETE FROM schema_version"], "damaged session file (empty schema_version table)"),
    ("version newer", ["INSERT INTO schema_version VALUES (99, 'later')"], "written by a newer VLM Readout"),
    ("a view", ["CREATE VIEW v AS SELECT 1"], "it holds the view 'v', which a session never has"),
    ("a trigger", ["CREATE TRIGGER t AFTER INSERT ON runs BEGIN DELETE FROM runs; END"], "the trigger 't'"),
    ("generated column", ["ALTER TABLE runs ADD COLUMN g TEXT GENERATED ALWAYS AS (kind) VIRTUAL"], "generated"),
    ("column dropped", ["DROP INDEX runs_kind", "ALTER TABLE runs DROP COLUMN kind"], "table runs has no column kind"),
    ("meta created blob", ["UPDATE meta SET value = x'00ff' WHERE key = 'created'"], "meta 'created' holds a blob"),
    ("meta key blob", ["INSERT INTO meta VALUES (x'07', 'x')"], "meta the key a blob of 1 bytes"),
    ("model info not JSON", ["UPDATE model SET info = '{'"], "model 1: info: stored JSON unreadable"),
    ("model info a list", ["UPDATE model SET info = '[]'"], "model 1: info holds a JSON array"),
    ("model spec blob", ["UPDATE model SET spec = x'00'"], "model 1: spec holds a blob"),
    ("run id untyped", [], "table runs declares id as untyped"),
]


@pytest.mark.parametrize(("statements", "needle"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_a_damaged_file_is_one_error_and_left_as_it_was(capsys, home, tmp_path, monkeypatch, statements, needle):
    session = _session(home / "s.vlmr")
    if statements:
        _sql(session, *statements)
    else:
        _recreate_runs_untyped(session)
    before = _folder_state(home)
    for fmt in ("csv", "json", "png"):
        out = tmp_path / f"out-{fmt}"
        code, err = _export(capsys, session, fmt, out)
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {session}: ") and needle in err[0], err
        assert not out.exists()
    with pytest.raises(SessionError) as e:  # --session checks the file before the model loads
        check_session_file(session)
    assert str(e.value).startswith(f"{session}: ") and needle in str(e.value) and "\n" not in str(e.value)

    def no_model(args):
        raise AssertionError("the model was loaded before the session was checked")

    monkeypatch.setattr(core.cli, "_load", no_model)
    argv = ["analyze", "--image", str(IMAGE), "--question", "q?", "--json", str(tmp_path / "a.json")]
    assert main([*argv, "--session", str(session)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {session}: ") and needle in err[0], err
    assert _folder_state(home) == before and not (tmp_path / "a.json").exists()


def test_sidecar_files_that_are_not_regular_files_are_refused(capsys, home, tmp_path):
    """SQLite opens the -wal, -shm and -journal beside a session: a FIFO there would hang the read."""
    import os

    session = _session(home / "s.vlmr")
    for suffix, make in (("-wal", os.mkfifo), ("-shm", os.mkdir), ("-journal", lambda p: os.symlink("/dev/zero", p))):
        sidecar = home / f"s.vlmr{suffix}"
        make(sidecar)
        code, err = _export(capsys, session, "csv", tmp_path / "a.csv")
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {sidecar}: not a regular file"), err
        with pytest.raises(SessionError, match="not a regular file"):
            check_session_file(session)
        sidecar.unlink() if suffix != "-shm" else sidecar.rmdir()


def test_a_fifo_as_the_session_is_refused_without_waiting(capsys, home, tmp_path):
    import os

    fifo = home / "s.vlmr"
    os.mkfifo(fifo)
    code, err = _export(capsys, fifo, "csv", tmp_path / "a.csv")
    assert code == 2 and err == [f"error: {fifo}: not a regular file (a FIFO, socket or device)"]
    with pytest.raises(SessionError, match="not a regular file"):
        check_session_file(fifo)


def test_a_stale_wal_beside_a_missing_session_is_not_taken_for_its_own(home):
    (home / "new.vlmr-wal").write_bytes(b"\x37\x7f\x06\x82" + b"\x00" * 60)
    with pytest.raises(SessionError, match=r"new\.vlmr: its -wal file exists without the session"):
        Session.create(home / "new.vlmr")
    assert sorted(p.name for p in home.iterdir()) == ["new.vlmr-wal"]


# ---------------------------------------------------------------- --session and the command's own output


def test_a_failed_record_leaves_the_earlier_json_output_as_it_was(capsys, home, tmp_path, monkeypatch):
    """analyze writes its --json beside the target and puts it in place only once
    the --session run is recorded: a failed record changes no output."""
    import core.analyze
    import core.session

    session = _session(home / "s.vlmr")
    out = tmp_path / "a.json"
    out.write_text("the earlier run\n")
    monkeypatch.setattr(
        core.cli, "_load", lambda args: SimpleNamespace(adapter=None, spec="shapes-llava")
    )  # analyze is faked
    monkeypatch.setattr(core.analyze, "analyze", lambda *a, **k: RecordedResult("analyze", {"x": 1}, "one analysis"))

    def disk_full(path, readout, **kwargs):
        raise SessionError(f"{path}: cannot record the run: the disk is full")

    monkeypatch.setattr(core.session, "record_into", disk_full)
    argv = ["analyze", "--image", str(IMAGE), "--question", "q?", "--json", str(out), "--session", str(session)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {session}: cannot record the run: the disk is full"]
    assert out.read_text() == "the earlier run\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "a.json",
        "sessions",
    ]
    monkeypatch.setattr(core.session, "record_into", record_into)
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(out.read_text()) == {"x": 1}
    with Session.open(session, read_only=True) as s:
        assert [r.summary for r in s.runs()][-1] == "one analysis"


def test_a_session_through_a_link_to_nothing_is_refused_before_the_model_loads(capsys, home, tmp_path, monkeypatch):
    link = home / "s.vlmr"
    link.symlink_to(tmp_path / "elsewhere.vlmr")
    out = tmp_path / "a.json"
    out.write_text("the earlier run\n")

    def no_model(args):
        raise AssertionError("the model was loaded before the session was checked")

    monkeypatch.setattr(core.cli, "_load", no_model)
    argv = ["analyze", "--image", str(IMAGE), "--question", "q?", "--json", str(out), "--session", str(link)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {link}: a symbolic link to "), err
    assert "refusing to create a session through it" in err[0]
    assert out.read_text() == "the earlier run\n" and not (tmp_path / "elsewhere.vlmr").exists()
    code, err = _export(capsys, link, "csv", tmp_path / "a.csv")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {link}: a symbolic link to "), err
    with pytest.raises(SessionError, match="a symbolic link to"):
        Session.create(link)


def test_qk_ov_json_is_put_in_place_only_once_its_run_is_recorded(capsys, home, tmp_path, monkeypatch):
    """qk-ov wrote its --json before recording (a failed record changed it); it
    now ends as every command does (core/cli/outputs.py write_and_record)."""
    import core.session

    session = _session(home / "s.vlmr")
    out = tmp_path / "qk.json"
    out.write_text("the earlier run\n")

    def disk_full(path, readout, **kwargs):
        raise SessionError(f"{path}: cannot record the run: the disk is full")

    monkeypatch.setattr(core.session, "record_into", disk_full)
    argv = ["qk-ov", "--model", "shapes-llava", "--head", "L1.H2", "--json", str(out), "--session", str(session)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {session}: cannot record the run: the disk is full"
    ]
    assert out.read_text() == "the earlier run\n" and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(core.session, "record_into", record_into)
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["head"]
