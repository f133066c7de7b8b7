"""Sessions (core/session.py) and exports (core/export.py): an analyze result
round-trips through the SQLite file, the audit table has its columns, every
export format parses, old files migrate, bad files are one-line errors,
``--session`` on the CLI commands lands runs that ``export`` then writes, and
a writer SIGKILLed mid-write leaves an intact session."""

import base64
import csv
import io
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import core.cli
from core import load_model
from core.analyze import analyze
from core.cli import main
from core.errors import ReadoutError
from core.export import audit_csv, audit_html, audit_json, audit_markdown, export_session, run_figures
from core.files.images import image_sha256, load_image
from core.models.loading import resources_dir
from core.results.audit import AuditRecord
from core.results.readout import RecordedResult
from core.session import (
    APPLICATION_ID,
    AUDIT_COLUMNS,
    METHOD_COLUMNS,
    SCHEMA_VERSION,
    RunInfo,
    Session,
    SessionError,
)
from tests.tolerances import sum_tol

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = resources_dir() / "samples"
IMAGE = SAMPLES / "sample_00.png"
MASK = SAMPLES / "sample_00_obj1.png"  # the blue square
QUESTION = "what shape is the blue object?"
CHAPTER_COLUMNS = ["method", "question", "operation", "controls", "supports", "cannot_support"]


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


@pytest.fixture(scope="module")
def analyzed(llava):
    return analyze(llava, IMAGE, QUESTION, answer="square", foil="triangle")


@pytest.fixture
def session(tmp_path):
    with Session.create(tmp_path / "s.vlmr", "shapes-llava") as s:
        yield s


def _one_line_session_error(fn, needle: str):
    with pytest.raises(SessionError) as e:
        fn()
    msg = str(e.value)
    assert isinstance(e.value, ReadoutError) and "\n" not in msg and needle in msg, msg
    return msg


# ---------------------------------------------------------------- round trip, table, events


def test_analyze_result_round_trips_identically(tmp_path, llava, analyzed):
    path = tmp_path / "rt.vlmr"
    with Session.create(path, llava) as s:
        assert s.journal_mode == "wal" and s.schema_version == SCHEMA_VERSION
        rid = s.record(analyzed, image=IMAGE)
    assert (tmp_path / "rt.vlmr").exists()
    with Session.open(path) as s:
        assert s.check() == "ok"
        (info,) = s.runs()
        assert info.id == rid and info.kind == "analyze" and info.model == "shapes-llava"
        assert info.n_audits == len(analyzed.audit)
        run = s.run(rid)
        assert json.dumps(run.result) == json.dumps(analyzed.to_dict())  # same JSON, same key order
        assert run.audits == analyzed.to_dict()["audit"]
        assert run.parameters == {
            "question": QUESTION,
            "answer": "square",
            "foil": "triangle",
            "rollout_alpha": 0.5,
            "dtype": "float32",
            "device": "cpu",
        }
        assert "answer 'square'" in run.summary
        assert run.model["spec"] == "shapes-llava" and run.model["fingerprint"] == llava.fingerprint
        assert run.model["family"] == "llava" and len(s.models()) == 1  # the create-time spec took the fingerprint
        img = s.image(run.image_sha256)
        assert run.image_sha256 == analyzed.input.image_sha256
        assert img.path == str(IMAGE) and img.size == (128, 128)
        assert np.array_equal(np.asarray(img.pixels()), np.asarray(load_image(IMAGE)))


def test_audit_table_columns_and_rows(session, analyzed):
    a = session.record(analyzed, image=IMAGE)
    rec = AuditRecord.for_method(
        "region counterfactual", controls=["matched-area control"], parameters={"fill": "mean"}
    )
    m = np.asarray(Image.open(MASK).convert("L")) >= 128
    doc = {"fill": "mean", "x": np.float32(1.5)}
    painted = RecordedResult("counterfactual", doc, "painted", audits=[rec])
    b = session.record(painted, image=IMAGE, mask=m, parameters={"fill": "mean"})
    c = session.record(RecordedResult("note", {"text": "looked at L1.H1"}, parameters={"who": "me"}))
    table = session.audit_table()
    assert tuple(table[0]) == AUDIT_COLUMNS and set(CHAPTER_COLUMNS) == set(METHOD_COLUMNS)
    assert [r["run_id"] for r in table] == [a] * len(analyzed.audit) + [b, c]
    assert [r["method"] for r in table[: len(analyzed.audit)]] == [x.method for x in analyzed.audit]
    row = table[-2]
    assert row["kind"] == "counterfactual" and row["method"] == "region counterfactual"
    assert row["controls"] == ["matched-area control"] and row["parameters"] == {"fill": "mean"}
    assert row["run_parameters"] == {"fill": "mean"} and row["created"] and row["summary"]
    assert table[-1]["method"] is None and table[-1]["run_parameters"] == {"who": "me"}  # a run without audits
    assert [r["run_id"] for r in session.audit_table(["counterfactual"])] == [b]
    assert session.run(b).result == {"fill": "mean", "x": 1.5}
    assert np.array_equal(session.mask(session.run(b).mask_id), m)
    assert [r.kind for r in session.runs()] == ["analyze", "counterfactual", "note"]


def test_recorded_events_and_other_writers(tmp_path, session):
    seen: list[RunInfo] = []
    unsubscribe = session.on_recorded(seen.append)
    rid = session.record(RecordedResult("note", {"a": 1}, "note: a=1"))
    assert [r.id for r in seen] == [rid] and seen[0].summary == "note: a=1"
    with Session.open(session.path) as other:  # e.g. a CLI --session run into the open file
        other_id = other.record(RecordedResult("note", {"b": 2}))
    assert [r.id for r in session.poll()] == [other_id] and seen[-1].id == other_id and session.poll() == []

    def broken(info):
        raise RuntimeError("listener bug")

    unsubscribe_broken = session.on_recorded(broken)
    with pytest.warns(UserWarning, match="listener bug"):
        third = session.record(RecordedResult("note", {"c": 3}))
    unsubscribe_broken()
    assert session.run(third).result == {"c": 3}  # the run is saved all the same
    unsubscribe()
    session.record(RecordedResult("note", {"d": 4}, summary="  two\nlines "))
    assert seen[-1].id == third and session.runs()[-1].summary == "two lines"


def test_bad_records_are_one_line_errors_and_leave_nothing(session):
    _one_line_session_error(lambda: session.record(RecordedResult("Bad Kind", {})), "kind")
    unserialisable = RecordedResult("note", {"x": object()})
    _one_line_session_error(lambda: session.record(unserialisable), "cannot record the result")
    note = RecordedResult("note", {})
    _one_line_session_error(lambda: session.record(note, image=IMAGE, mask=np.zeros((5, 5), bool)), "5x5")
    # a plain dict says nothing about itself (kind, summary, parameters): refused, naming what to pass
    _one_line_session_error(lambda: session.record({"fill": "mean"}), "RecordedResult")
    _one_line_session_error(lambda: session.record("note"), "takes a Readout")  # the old (kind, result) call
    assert session.runs() == [] and session.images() == []


# ---------------------------------------------------------------- exports


def test_every_export_format(tmp_path, session, analyzed, llava):
    session.record(analyzed, image=IMAGE)
    painted = RecordedResult("counterfactual", {"fill": "blur"})
    session.record(painted, image=IMAGE, mask=MASK, parameters={"fill": "blur"})
    rows = session.audit_table()

    parsed = list(csv.DictReader(io.StringIO(audit_csv(rows))))
    assert list(parsed[0]) == list(AUDIT_COLUMNS) and len(parsed) == len(rows)
    assert parsed[0]["method"] == "residual DLA" and json.loads(parsed[0]["run_parameters"])["answer"] == "square"

    md = audit_markdown(rows).splitlines()
    assert md[0] == "| " + " | ".join(AUDIT_COLUMNS) + " |" and len(md) == 2 + len(rows)

    page = audit_html(session)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page.split("<body>")[1]
    for col in CHAPTER_COLUMNS:
        assert f"<th>{col}</th>" in page
    pictures = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(pictures) >= 4  # rollout, two heads, the painted region
    for b64 in pictures:
        assert Image.open(io.BytesIO(base64.b64decode(b64))).format == "PNG"

    doc = audit_json(session)
    assert doc["schema_version"] == 1 and doc["columns"] == list(AUDIT_COLUMNS)
    assert doc["runs"][0]["result"] == json.loads(json.dumps(analyzed.to_dict())) and len(doc["audit_table"]) == len(
        rows
    )
    assert doc["session"]["models"][0]["fingerprint"] == llava.fingerprint

    names = [f.name for f in run_figures(session, 1)]
    assert names[0] == "rollout" and len(names) == 5  # rollout, two heads, and each head's text-side pattern
    assert [n for n in names if n.endswith("_text")] == [n + "_text" for n in names[1:] if not n.endswith("_text")]
    for fmt in ("csv", "md", "html", "json"):
        (out,) = export_session(session, fmt, tmp_path / f"out.{fmt}")
        assert out.stat().st_size > 0
    figs = export_session(session.path, "png", tmp_path / "figs")
    assert sorted(p.name for p in figs) == sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert {p.name for p in figs} >= {"run0001_rollout.png", "run0001_L1_H1.png", "run0002_mask.png"}
    assert not [p for p in tmp_path.rglob("*.tmp")]  # atomic writes leave no temporary files
    assert json.loads((tmp_path / "out.json").read_text())["schema_version"] == 1


def test_text_pattern_figure_draws_the_heads_own_matrix(analyzed):
    """The exported text-side picture of a head is that head's row of
    ``text_patterns``: each cell's colour is its value on the colour bar, masked
    cells are grey, and the tokens label the rows (the answer position last)."""
    from core.export import _MISSING, _VIRIDIS, _lerp, _matrix_origin, _text_pattern, token_matrix_png

    text = analyzed.to_dict()["text_patterns"]
    block, head = text["blocks"][-1], 1
    found = _text_pattern(text, {"block": text["block_names"][-1], "layer": block, "head": head})
    assert found is not None
    matrix, labels, allowed, other = found
    assert matrix == text["patterns"][-1][head] and labels[-1].startswith("[answer]")
    outside = [sum(v[head][q] for v in text["other_mass"][-1].values()) for q in range(len(matrix))]
    sums = np.asarray(matrix).sum(1) + np.asarray(outside)
    # float32 weights: the softmax's row sum over every key, then the sums here
    one = sum_tol(1.0, 2 * len(analyzed.input.input_ids) + 8, torch.float32)
    assert np.allclose(sums, 1.0, rtol=0, atol=one) and 0 <= other <= 1 + one

    cell = 18
    picture = Image.open(io.BytesIO(token_matrix_png(matrix, labels, labels, allowed=allowed, cell=cell)))
    arr = np.asarray(picture.convert("RGB"))
    left, top = _matrix_origin(labels, labels)  # no title: the matrix starts there
    hi = max(max(r) for r in matrix)
    for i in range(len(matrix)):
        for j in range(len(matrix)):
            got = tuple(int(v) for v in arr[top + i * cell + cell // 2, left + j * cell + cell // 2])
            want = _lerp(_VIRIDIS, matrix[i][j] / hi) if allowed[i][j] else _MISSING
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1, (i, j, got, want)
    assert not all(allowed[0])  # causal: the first query sees only itself, so grey cells were checked

    with pytest.raises(SessionError, match="labels"):
        token_matrix_png(matrix, labels[:-1], labels)
    assert _text_pattern(None, {"block": "L0", "head": 0}) is None
    assert _text_pattern(text, {"block": "L0.xattn", "layer": 99, "head": 0}) is None  # not a self-attention block


# ---------------------------------------------------------------- schema versions and bad files

# A v1 file exactly as the first session schema wrote it (frozen here on purpose).
V1_FILE = [
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
    "INSERT INTO schema_version VALUES (1, '2026-01-01T00:00:00+00:00')",
]


def _v1_session(path: Path) -> None:
    mask = np.zeros((128, 128), bool)
    mask[20:40, 30:60] = True
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).save(buf, "PNG")
    sha = image_sha256(load_image(IMAGE))
    result = {
        "fill": "mean",
        "original": {"answer": "square", "logit_diff": 9.5, "logit": 12.0, "prob": 0.99, "predicted": "square"},
        "edited": {"answer": "square", "logit_diff": 0.5, "logit": 3.0, "prob": 0.2, "predicted": "no"},
        "effect": {"flipped": True},
    }
    conn = sqlite3.connect(path)
    for stmt in V1_FILE:
        conn.execute(stmt)
    t = "2026-01-01T00:00:00+00:00"
    conn.execute("INSERT INTO model VALUES (1, 'shapes-llava', 'abc', 'llava', ?)", (t,))
    conn.execute("INSERT INTO images VALUES (?, ?, 128, 128, ?)", (sha, str(IMAGE), t))
    conn.execute("INSERT INTO masks VALUES (1, ?, ?, ?)", (sha, buf.getvalue(), t))
    conn.execute(
        "INSERT INTO runs VALUES (1, 'counterfactual', ?, 1, ?, 1, '{\"fill\": \"mean\"}', ?)",
        (t, sha, json.dumps(result)),
    )
    conn.execute(
        "INSERT INTO audit_rows VALUES (1, 0, 'region counterfactual', 'q', 'o', '[\"c\"]', 's', 'n', '{}', '[]')"
    )
    conn.commit()
    conn.close()


def test_v0_and_v1_files_migrate_forward(tmp_path):
    empty = tmp_path / "v0.vlmr"
    empty.touch()  # v0: what a crash during the very first create can leave
    with Session.open(empty) as s:
        assert s.schema_version == SCHEMA_VERSION and [v for v, _ in s.schema_history()] == [1, 2]
        assert s.record(RecordedResult("note", {"ok": True})) == 1

    old = tmp_path / "v1.vlmr"
    _v1_session(old)
    with Session.open(old) as s:
        assert [v for v, _ in s.schema_history()] == [1, 2] and s.check() == "ok"
        (info,) = s.runs()
        assert "logit diff +9.500 -> +0.500" in info.summary and "(flipped)" in info.summary  # backfilled
        assert s.mask(1)[20:40, 30:60].all() and s.mask(1).sum() == 20 * 30
        assert s.audit_table()[0]["controls"] == ["c"] and s.image(info.image_sha256).pixels() is None
        s.record(RecordedResult("counterfactual", s.run(1).result, info.summary), image=IMAGE, mask=s.mask(1))
        assert s.image(info.image_sha256).pixels() is not None  # v2 adds the pixels to the old image row
        assert len(s.runs()) == 2 and s.runs()[1].mask_id == 1  # the same mask is not stored twice
    with Session.open(old) as s:  # a migrated file opens without migrating again
        assert [v for v, _ in s.schema_history()] == [1, 2]


def test_bad_files_are_one_line_session_errors(tmp_path, capsys):
    _one_line_session_error(lambda: Session.open(tmp_path / "none.vlmr"), "no such session file")
    junk = tmp_path / "junk.vlmr"
    junk.write_bytes(b"this is not a database at all" * 20)
    _one_line_session_error(lambda: Session.open(junk), "not a session file (not an SQLite database)")
    foreign = tmp_path / "other.db"
    with closing(sqlite3.connect(foreign)) as c:
        c.execute("CREATE TABLE t (x)")
        c.commit()
    before = foreign.read_bytes()
    _one_line_session_error(lambda: Session.open(foreign), "another program")
    assert foreign.read_bytes() == before  # never rewritten (no WAL switch, no migration)

    newer = tmp_path / "newer.vlmr"
    Session.create(newer).close()
    with closing(sqlite3.connect(newer)) as c:
        c.execute("INSERT INTO schema_version VALUES (99, 'later')")
        c.commit()
    _one_line_session_error(lambda: Session.open(newer), "newer VLM Readout (session schema 99")

    damaged = tmp_path / "damaged.vlmr"
    with Session.create(damaged) as s:
        for i in range(10):
            s.record(RecordedResult("note", {"x": list(range(1000)), "i": i}))
    data = bytearray(damaged.read_bytes())
    for page in range(1, len(data) // 4096):  # smash every b-tree page header after the first
        data[page * 4096 : page * 4096 + 16] = b"\xff" * 16
    damaged.write_bytes(bytes(data))
    _one_line_session_error(lambda: Session.open(damaged), "corrupt session file")
    _one_line_session_error(lambda: Session.create(newer), "already exists")

    assert main(["export", "--session", str(damaged), "--format", "csv", "--out", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "corrupt" in err[0]
    assert not (tmp_path / "o.csv").exists()


# ---------------------------------------------------------------- the CLI


def test_cli_session_runs_land_in_one_exported_table(tmp_path, llava, monkeypatch, capsys):
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)  # one load for every command
    sess = tmp_path / "cli.vlmr"
    base = ["--image", str(IMAGE), "--question", QUESTION, "--answer", "square", "--foil", "triangle", "--quiet"]
    assert main(["analyze", *base, "--json", str(tmp_path / "a.json"), "--session", str(sess)]) == 0
    cf = ["counterfactual", *base, "--mask", str(MASK), "--fill", "mean", "--no-routing"]
    assert main([*cf, "--json", str(tmp_path / "c.json"), "--session", str(sess)]) == 0
    audit = ["audit", "--dataset", str(SAMPLES / "pairs.jsonl"), "--limit", "2", "--methods", "answer,attention"]
    assert main([*audit, "--out", str(tmp_path / "aud"), "--quiet", "--session", str(sess)]) == 0

    with Session.open(sess) as s:
        kinds = [r.kind for r in s.runs()]
        assert kinds == ["analyze", "counterfactual", "audit"]
        a, c, d = (s.run(r.id) for r in s.runs())
        assert a.result == json.loads((tmp_path / "a.json").read_text())
        assert c.result == json.loads((tmp_path / "c.json").read_text()) and c.parameters["fill"] == "mean"
        assert s.mask(c.mask_id).sum() == c.result["mask_area_px"] and c.image_sha256 == a.image_sha256
        assert [x["method"] for x in d.audits] == ["model output", "pattern analysis"]  # one row per method
        assert d.result["n_samples"] == 2 and d.result["out"] == str(tmp_path / "aud")
        assert d.model["fingerprint"] == llava.fingerprint
    capsys.readouterr()
    for fmt in ("csv", "json"):
        out = tmp_path / f"t.{fmt}"
        assert main(["export", "--session", str(sess), "--format", fmt, "--out", str(out)]) == 0
        assert "audit rows" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["kind"] for r in rows].count("counterfactual") == 1 and {r["kind"] for r in rows} == set(kinds)
    assert {r["run_id"] for r in json.loads((tmp_path / "t.json").read_text())["audit_table"]} == {1, 2, 3}

    bad = tmp_path / "bad.vlmr"
    bad.write_bytes(b"garbage" * 30)
    assert main(["analyze", *base, "--json", str(tmp_path / "x.json"), "--session", str(bad)]) == 2
    assert "not a session file" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_a_run_records_the_dtype_and_device_it_ran_in(session, llava, analyzed):
    """The analyze result states them in its input and model blocks; the run's parameters hold
    them (from the loaded model), and so every audit row's specification and run_parameters."""
    assert analyzed.input.dtype == analyzed.model.dtype == "float32"
    assert analyzed.input.device == analyzed.model.device == "cpu"
    rid = session.record(analyzed, image=IMAGE, model=llava)
    run = session.run(rid)
    assert run.parameters["dtype"] == "float32" and run.parameters["device"] == "cpu"
    rows = [r for r in session.audit_table() if r["run_id"] == rid]
    assert len(rows) == len(analyzed.audit) > 0
    for row in rows:
        assert "dtype=float32" in row["specification"].split("; ")
        assert "device=cpu" in row["specification"].split("; ")
        assert row["run_parameters"]["dtype"] == "float32" and row["run_parameters"]["device"] == "cpu"
    # a caller's own statement wins; a document of no model states none
    given = session.record(RecordedResult("note", {"x": 1}), parameters={"dtype": "float16", "device": "cuda:1"})
    assert session.run(given).parameters == {"dtype": "float16", "device": "cuda:1"}
    assert session.run(session.record(RecordedResult("note", {"x": 1}))).parameters == {}


def test_dtype_bfloat16_on_the_command_line_is_recorded_everywhere(tmp_path, capsys):
    """``--dtype bfloat16`` loads the model in bfloat16 (the real loader): the analyze JSON's
    input and model blocks and the session's run say bfloat16, on the CPU."""
    out, sess = tmp_path / "a.json", tmp_path / "bf16.vlmr"
    argv = ["analyze", "--model", "shapes-llava", "--dtype", "bfloat16", "--device", "cpu", "--image", str(IMAGE)]
    argv += ["--question", QUESTION, "--answer", "square", "--quiet", "--json", str(out), "--session", str(sess)]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["input"]["dtype"] == doc["model"]["dtype"] == "bfloat16"
    assert doc["input"]["device"] == doc["model"]["device"] == "cpu"
    with Session.open(sess, read_only=True) as s:
        (info,) = s.runs()
        run = s.run(info.id)
        assert run.parameters["dtype"] == "bfloat16" and run.parameters["device"] == "cpu"
        assert all("dtype=bfloat16" in r["specification"] for r in s.audit_table())


# ---------------------------------------------------------------- killed mid-write

# The writer imports core.session without the core package's __init__ (which
# loads torch): a bare package object stands in for it, so a child starts in
# a fraction of a second.
WRITER = """
import os, random, sys, types
root, path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
pkg = types.ModuleType("core"); pkg.__path__ = [os.path.join(root, "core")]; sys.modules["core"] = pkg
import numpy as np
from core.results.readout import RecordedResult
from core.session import Session
s = Session.open_or_create(path)
rng = random.Random(seed)
print("ready", flush=True)
i = 0
while True:
    k = rng.randint(1, 40)
    payload = [rng.random() for _ in range(rng.randint(2000, 40000))]
    audits = [{"method": f"m{j}", "question": "q", "controls": ["c"] * j, "parameters": {"j": j}} for j in range(k)]
    img = np.random.default_rng(seed * 100000 + i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    print("writing", flush=True)
    note = RecordedResult("note", {"seq": i, "n": len(payload), "payload": payload}, f"note {i}", audits=audits)
    rid = s.record(note, image=img, mask=img[..., 0] > 127, parameters={"n_audits": k, "seed": seed, "seq": i})
    print(rid, flush=True)
    i += 1
"""


def test_sigkill_mid_write_leaves_an_intact_session(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "killed.vlmr"
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    committed: set[int] = set()
    mid_write = 0
    for trial in range(5):
        child = subprocess.Popen(
            [sys.executable, str(script), str(ROOT), str(path), str(seed + trial)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        lines = out.split()
        committed |= {int(x) for x in lines if x.isdigit()}  # ids whose record() had returned
        mid_write += bool(lines) and lines[-1] == "writing"  # killed inside record()

        with Session.open(path) as s:
            assert s.check() == "ok", f"seed {seed}"
            runs = s.runs()
            ids = [r.id for r in runs]
            assert committed <= set(ids), f"seed {seed}: a committed run was lost"
            assert ids == list(range(1, len(ids) + 1))  # no holes: a rolled-back run leaves no trace
            for info in runs:
                run = s.run(info.id)
                assert run.result["n"] == len(run.result["payload"]), f"seed {seed}"
                assert len(run.audits) == run.parameters["n_audits"] == info.n_audits, f"seed {seed}"
                assert [a["parameters"] for a in run.audits] == [{"j": j} for j in range(len(run.audits))]
                assert s.image(run.image_sha256).pixels().size == (64, 48) and s.mask(run.mask_id).shape == (48, 64)
        with closing(sqlite3.connect(path)) as c:  # nothing stored outside a complete run
            for orphans in (
                "SELECT COUNT(*) FROM masks WHERE id NOT IN (SELECT mask_id FROM runs)",
                "SELECT COUNT(*) FROM images WHERE sha256 NOT IN (SELECT image_sha256 FROM runs)",
                "SELECT COUNT(*) FROM audit_rows WHERE run_id NOT IN (SELECT id FROM runs)",
            ):
                assert c.execute(orphans).fetchone()[0] == 0, f"seed {seed}: {orphans}"
    assert len(committed) >= 3, f"seed {seed}: too few runs were written to test anything"
    assert mid_write >= 1, f"seed {seed}: no kill landed inside record()"  # ~93% of the writer's time is there
