"""Sessions on hostile or awkward files: export opens the database read-only
and never creates or alters a file (an empty, missing or foreign file is a
one-line error that leaves it as it was; an older schema is read through a
copy; a session in a read-only folder exports); a corrupt stored image or
mask does not stop an export: the rest is written and a warning names the run."""

import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

import core.cli
from core.cli import main
from core.methods.counterfactual import Fill, OcclusionMap, RegionCounterfactual
from core.models.loading import resources_dir
from core.results.readout import AnswerEffect, RecordedResult, Target
from core.session import Session, SessionError, check_session_file
from tests.core.test_session import _v1_session
from tests.core.test_trust_cli import BITS_DENY

IMAGE = resources_dir() / "samples" / "sample_00.png"  # 128 x 128
# Stored results of a sweep and a counterfactual, made without a model (a sweep's JSON as
# OcclusionMap writes it, a counterfactual's as RegionCounterfactual does: Run.readout restores them)
_BEFORE = Target("square", 5, None, None, 2.0, None, 0.9, "square", 5)
_AFTER = Target("square", 5, None, None, 1.5, None, 0.6, "circle", 6)
SWEEP = OcclusionMap(
    1,
    Fill("mean"),
    (128, 128),
    _BEFORE,
    None,
    np.array([[0.1, -0.5], [0.2, 0.0]]),
    np.zeros((2, 2)),
    np.array([[False, True], [False, False]]),
    [],
).to_dict()
PAINTED = RegionCounterfactual(
    Fill("mean"), 1200, _BEFORE, _AFTER, AnswerEffect.between(_BEFORE, _AFTER), None
).to_dict()


def _session_with_pictures(path: Path) -> Path:
    """Two runs with pictures and no model needed: an occlusion sweep on the
    stored image, and a counterfactual with its painted mask."""
    mask = np.zeros((128, 128), bool)
    mask[10:40, 20:60] = True
    with Session.create(path, "shapes-llava") as s:
        s.record(RecordedResult("sweep", SWEEP, "a 2x2 sweep"), image=IMAGE)
        s.record(RecordedResult("counterfactual", PAINTED, "painted"), image=IMAGE, mask=mask)
    return path


def _snapshot(folder: Path) -> dict:
    """Every file in ``folder`` with its bytes and mtime: what an export must leave as it was."""
    return {p.name: (p.is_file() and p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _export(capsys, session: Path, fmt: str, out: Path) -> tuple[int, list[str], str]:
    code = main(["export", "--session", str(session), "--format", fmt, "--out", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines(), captured.out


@pytest.fixture
def outdir(tmp_path) -> Path:
    out = tmp_path / "exports"
    out.mkdir()
    return out


@pytest.fixture
def home(tmp_path) -> Path:
    folder = tmp_path / "sessions"
    folder.mkdir()
    return folder


def test_export_never_writes_to_or_beside_the_session(capsys, home, outdir):
    session = _session_with_pictures(home / "s.vlmr")
    before = _snapshot(home)
    assert list(before) == ["s.vlmr"]  # closed cleanly: no -wal, no -shm
    for fmt in ("csv", "md", "json", "html", "png"):
        out = outdir / ("png" if fmt == "png" else f"audit.{fmt}")
        code, err, _ = _export(capsys, session, fmt, out)
        assert code == 0 and err == [], err
        assert _snapshot(home) == before, f"export --format {fmt} touched the session folder"
    doc = json.loads((outdir / "audit.json").read_text())
    assert [r["kind"] for r in doc["runs"]] == ["sweep", "counterfactual"]
    assert sorted(p.name for p in (outdir / "png").iterdir()) == ["run0001_sweep.png", "run0002_mask.png"]


def test_export_reads_a_session_another_program_has_open(capsys, home, outdir):
    """The app keeps its session open (its -wal and -shm exist): export reads
    the committed runs through SQLite's read-only mode, without taking it over."""
    session = _session_with_pictures(home / "s.vlmr")
    with Session.open(session) as writer:
        writer.record(RecordedResult("note", {}, "recorded while open"))
        before = set(os.listdir(home))
        code, err, out = _export(capsys, session, "json", outdir / "a.json")
        assert code == 0 and err == [] and set(os.listdir(home)) == before
        assert [r["summary"] for r in json.loads((outdir / "a.json").read_text())["runs"]][-1] == "recorded while open"
        writer.record(RecordedResult("note", {}, "and after"))  # the writer is not blocked by the export
    assert len(Session.open(session, read_only=True).runs()) == 4


def test_export_of_an_older_schema_reads_a_migrated_copy(capsys, home, outdir):
    old = home / "v1.vlmr"
    _v1_session(old)
    before = _snapshot(home)
    code, err, _ = _export(capsys, old, "json", outdir / "a.json")
    assert code == 0 and err == []
    doc = json.loads((outdir / "a.json").read_text())
    assert doc["runs"][0]["kind"] == "counterfactual" and "(flipped)" in doc["runs"][0]["summary"]
    assert _snapshot(home) == before  # still a v1 file: the migration happened in memory
    with closing(sqlite3.connect(old)) as c:
        assert c.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == 1


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("empty.vlmr", b"", "empty file, not a session"),
        ("text.vlmr", b"just some notes\n", "not a session file (not an SQLite database)"),
        ("short.vlmr", b"SQLite", "not a session file (not an SQLite database)"),
        ("missing.vlmr", None, "no such session file"),
        ("folder.vlmr", "dir", "is a folder, not a session file"),
    ],
)
def test_export_of_what_is_not_a_session_leaves_it_as_it_was(capsys, home, outdir, name, content, needle):
    path = home / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    before = _snapshot(home)
    code, err, _ = _export(capsys, path, "csv", outdir / "a.csv")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert _snapshot(home) == before and not (outdir / "a.csv").exists()


def test_export_of_another_programs_database_and_an_empty_database(capsys, home, outdir):
    foreign = home / "other.db"
    with closing(sqlite3.connect(foreign)) as c:
        c.execute("CREATE TABLE t (x)")
        c.commit()
    empty_db = home / "empty.db"
    with closing(sqlite3.connect(empty_db)) as c:
        c.execute("PRAGMA user_version = 1")  # a valid SQLite header, no tables
        c.commit()
    before = _snapshot(home)
    for path, needle in ((foreign, "another program"), (empty_db, "an empty database, not a session")):
        code, err, _ = _export(capsys, path, "md", outdir / "a.md")
        assert code == 2 and len(err) == 1 and needle in err[0], err
    assert _snapshot(home) == before


def test_export_onto_the_session_itself_is_refused(capsys, home):
    session = _session_with_pictures(home / "s.vlmr")
    before = _snapshot(home)
    for fmt in ("csv", "png"):
        code, err, _ = _export(capsys, session, fmt, session)
        assert code == 2 and len(err) == 1 and "is the session file itself" in err[0], err
    assert _snapshot(home) == before


def test_read_only_session_refuses_to_record(home):
    session = _session_with_pictures(home / "s.vlmr")
    with Session.open(session, read_only=True) as s:
        assert s.read_only and len(s.runs()) == 2 and s.image(s.runs()[0].image_sha256).pixels().size == (128, 128)
        with pytest.raises(SessionError, match="opened read-only"):
            s.record(RecordedResult("note", {"x": 1}))
        with pytest.raises(SessionError, match="opened read-only"):
            s.set_model("shapes-coca")
    assert len(Session.open(session, read_only=True).runs()) == 2


@pytest.mark.skipif(not BITS_DENY, reason="permission bits do not deny this user (root)")
def test_session_in_a_read_only_folder_exports_but_cannot_be_recorded_into(capsys, home, outdir):
    session = _session_with_pictures(home / "s.vlmr")
    before = _snapshot(home)
    home.chmod(0o555)
    try:
        code, err, _ = _export(capsys, session, "html", outdir / "a.html")
        assert code == 0 and err == []
        with pytest.raises(SessionError, match="read-only") as e:
            Session.open(session)
        assert "corrupt" not in str(e.value)
        with pytest.raises(SessionError, match="not writable"):
            check_session_file(home / "new.vlmr")
    finally:
        home.chmod(0o755)
    assert _snapshot(home) == before


def _corrupt(session: Path, table: str) -> None:
    with closing(sqlite3.connect(session)) as c:
        c.execute(f"UPDATE {table} SET png = ?", (b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 10,))
        c.commit()


def test_corrupt_stored_image_exports_the_rest_with_a_warning(capsys, home, outdir):
    session = _session_with_pictures(home / "s.vlmr")
    _corrupt(session, "images")
    code, err, out = _export(capsys, session, "html", outdir / "a.html")
    assert code == 0 and out.startswith("wrote ")
    assert len(err) == 2 and all(line.startswith("warning: run ") for line in err), err
    assert "run 1: the stored image" in err[0] and "unreadable" in err[0] and "without the image" in err[0]
    html = (outdir / "a.html").read_text()
    assert html.count("<tr>") == 3 and html.count("<strong>note:</strong>") == 2  # header + 2 runs; both notes
    assert html.count("<img ") == 2  # the sweep map on an even grid, the painted region on white
    code, err, out = _export(capsys, session, "png", outdir / "png")
    assert code == 0 and len(err) == 2 and out == "wrote 2 figures to " + str(outdir / "png") + "\n"


def test_corrupt_stored_mask_leaves_out_its_picture_with_a_warning(capsys, home, outdir):
    session = _session_with_pictures(home / "s.vlmr")
    _corrupt(session, "masks")
    code, err, _ = _export(capsys, session, "png", outdir / "png")
    assert code == 0 and len(err) == 1 and err[0].startswith("warning: run 2: ") and "mask 1 is unreadable" in err[0]
    assert sorted(p.name for p in (outdir / "png").iterdir()) == ["run0001_sweep.png"]


def test_cli_session_that_is_not_a_session_fails_before_the_model_loads(capsys, home, monkeypatch):
    def no_model(args):
        raise AssertionError("the model was loaded before the session was checked")

    monkeypatch.setattr(core.cli, "_load", no_model)
    junk = home / "junk.vlmr"
    junk.write_bytes(b"not sqlite" * 10)
    argv = ["analyze", "--image", str(IMAGE), "--question", "q?", "--json", str(home / "a.json"), "--session"]
    for session, needle in (
        (junk, "not a session file"),
        (home, "is a folder, not a session file"),
        (home / "no" / "s.vlmr", "no such"),
    ):
        assert main([*argv, str(session)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert junk.read_bytes() == b"not sqlite" * 10


def test_hostile_stored_image_is_refused_like_a_file(capsys, home, outdir):
    """A shared session's pictures get the checks of load_image: a stored
    1 x 200,000 PNG (10 GB after a model's resize) is a warning, not a decode."""
    from tests.fuzz.hostile_images import png_bytes

    session = _session_with_pictures(home / "s.vlmr")
    with closing(sqlite3.connect(session)) as c:
        c.execute("UPDATE images SET png = ?", (png_bytes(1, 200_000),))
        c.commit()
    code, err, _ = _export(capsys, session, "png", outdir / "pictures")
    assert code == 0 and err and all(line.startswith("warning: run ") for line in err), err
    assert "aspect ratio" in err[0] and "\n" not in err[0]
