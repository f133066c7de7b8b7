"""A session reproduces every run (issue 13): each audit row of every export
format names the image (path as given and SHA-256; a dataset run its file),
the model spec and fingerprint, the question, the target, the method's full
specification and a numeric summary; the ``.vlmr`` alone is complete while
the session is open (the WAL is checkpointed after each run); ``save_as``
writes a self-contained copy; a read-only session refuses to record;
:meth:`Session.run` holds everything the app needs to show a run again.

The checkpoint's cost per record is measured by ``bench/session_checkpoint.py``
(bench/results/session_checkpoint.json, bench/README.md): ~1.8 ms on a ~9 ms
app-sized record, 1.2 x a record without it, paired in one process.
"""

import csv
import hashlib
import html
import io
import json
import os
import re
import shutil
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import core.cli
from core import load_model
from core.analyze import analyze
from core.cli import main
from core.files.images import image_sha256, load_image
from core.files.pairs import read_pairs
from core.forward.capture import capture
from core.methods.counterfactual import occlusion_sweep, region_counterfactual, resolve_tokens
from core.methods.counterfactual.fills import Fill
from core.methods.interventions import patch_visual_features, run_interventions, zero_ablation
from core.methods.patterns import pattern_statistics
from core.models.loading import resources_dir
from core.results.audit_tables import cell
from core.results.readout import RecordedResult
from core.session import AUDIT_COLUMNS, RUN_COLUMNS, Session, SessionError
from core.session.files import checkpoint_wal

SAMPLES = resources_dir() / "samples"
PAIRS = SAMPLES / "pairs.jsonl"
IMAGE = SAMPLES / "sample_00.png"
OTHER = SAMPLES / "sample_01.png"
THIRD = SAMPLES / "sample_02.png"  # only ever given as pixels
MASK = SAMPLES / "sample_00_obj1.png"  # the blue square
QUESTION = "what shape is the blue object?"
NUMBER = re.compile(r"[-+]?\d")
# What a row must carry to reproduce its run; `created` is shown as a shorter time in HTML.
COMPARED = [c for c in RUN_COLUMNS if c != "created"]


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


def _ablation(llava, image, block=1, head=0):
    """What the app's ablation job runs: one head's z zeroed at the answer position."""
    inputs = llava.adapter.prepare([image], [QUESTION])
    base = capture(llava, None, "", pattern_layers=[], inputs=inputs)
    pos = int(base.answer_positions[0])
    answer_id, foil_id = resolve_tokens(llava.adapter, "square", "triangle", base.logits[0, pos])
    label = f"{base.block_names[block]}.H{head} zeroed at the answer position"
    return run_interventions(
        llava, inputs, {label: [zero_ablation(block, head, positions=[pos])]}, answer_id, foil_id, base=base
    )


@pytest.fixture(scope="module")
def every_kind(llava, tmp_path_factory):
    """A session holding one run of every kind the app and the CLI record;
    the app's images are PIL images without a path, the CLI's are paths."""
    tmp = tmp_path_factory.mktemp("kinds")
    path = tmp / "kinds.vlmr"
    shown = load_image(IMAGE)  # as the app holds it: pixels, no path
    other = load_image(OTHER)
    mask = np.asarray(Image.open(MASK).convert("L")) >= 128
    asked = {"question": QUESTION}
    with Session.create(path) as s:
        s.record(analyze(llava, shown, QUESTION, answer="square", foil="triangle"), image=shown, model=llava)
        third = load_image(THIRD)
        cf = region_counterfactual(llava, third, QUESTION, mask, "mean", answer="square", foil="triangle")
        s.record(cf, image=third, mask=mask, model=llava, parameters={**asked, "fill": "mean"})
        sweep = occlusion_sweep(llava, OTHER, QUESTION, k=4, answer="square", foil="triangle")
        s.record(sweep, image=OTHER, model=llava, parameters=asked)
        s.record(_ablation(llava, shown, 1, 0), image=shown, model=llava, parameters=asked)
        s.record(_ablation(llava, shown, 1, 1), image=shown, model=llava, parameters=asked)
        painted = patch_visual_features(
            llava, shown, QUESTION, other, site="projector_out", token_sets={"painted region": [0, 1, 2]}
        )
        s.record(painted, image=shown, mask=mask, model=llava, parameters=asked)
        from_path = patch_visual_features(llava, OTHER, QUESTION, IMAGE, site="projector_out", token_sets=[[5, 6]])
        s.record(from_path, image=OTHER, model=llava, parameters=asked)
        pairs = read_pairs(PAIRS, limit=3)
        stats = pattern_statistics(llava, [(p.image_path, p.question, None) for p in pairs])
        line = f"answer-row attention of {len(stats.heads)} heads over {stats.n_samples} samples"
        doc = {"n_samples": stats.n_samples, "heads": [h.to_dict() for h in stats.heads]}
        # what the app is asked to pass for its statistics run: the samples' file, how many were read
        used = {"dataset": str(PAIRS), "n_samples": stats.n_samples}
        s.record(RecordedResult("statistics", doc, line, used, [stats.audit]), model=llava)
    return path, painted, from_path


def _cli_runs(llava, path: Path, tmp: Path, monkeypatch) -> None:
    """The CLI's runs into the same session: analyze and counterfactual (image paths) and a dataset audit."""
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    base = ["--image", str(IMAGE), "--question", QUESTION, "--answer", "square", "--foil", "triangle", "--quiet"]
    assert main(["analyze", *base, "--json", str(tmp / "a.json"), "--session", str(path)]) == 0
    cf = ["counterfactual", *base, "--mask", str(MASK), "--fill", "blur", "--no-routing"]
    assert main([*cf, "--json", str(tmp / "c.json"), "--session", str(path)]) == 0
    audit = ["audit", "--dataset", str(PAIRS), "--limit", "2", "--methods", "answer,attention"]
    assert main([*audit, "--out", str(tmp / "aud"), "--quiet", "--session", str(path)]) == 0


def _markdown_rows(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    split = [
        [c.strip().replace("\\|", "|").replace("\\\\", "\\") for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines
    ]
    header, rows = split[0], split[2:]
    return [dict(zip(header, r, strict=True)) for r in rows]


def _html_rows(page: str) -> list[dict]:
    body = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S):
        rows.append({c: html.unescape(v) for c, v in re.findall(r'<td class="c-(\w+)[^"]*">(.*?)</td>', tr, re.S)})
    return rows


def test_every_row_of_every_format_reproduces_its_run(every_kind, llava, tmp_path, monkeypatch, capsys):
    path, painted, from_path = every_kind
    session = tmp_path / "all.vlmr"
    shutil.copyfile(path, session)
    _cli_runs(llava, session, tmp_path, monkeypatch)
    outs = {fmt: tmp_path / f"audit.{fmt}" for fmt in ("csv", "md", "html", "json")}
    for fmt, out in outs.items():
        assert main(["export", "--session", str(session), "--format", fmt, "--out", str(out)]) == 0
    capsys.readouterr()

    rows = list(csv.DictReader(io.StringIO(outs["csv"].read_text())))
    assert list(rows[0]) == list(AUDIT_COLUMNS)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"analyze", "counterfactual", "sweep", "intervention", "statistics", "audit"}
    for r in rows:
        where = f"run {r['run_id']} ({r['kind']})"
        assert re.fullmatch(r"[0-9a-f]{64}", r["image_sha256"]), where
        assert r["model_fingerprint"] == llava.fingerprint and r["model"] == "shapes-llava", where
        assert NUMBER.search(r["summary"]), where
        assert r["specification"], where
    by_run = {}
    for r in rows:
        by_run.setdefault(int(r["run_id"]), r)
    app_analyze, cf, sweep, ablate0, ablate1, patch, patch_path, stats, cli_analyze, cli_cf, audit = (
        by_run[i] for i in sorted(by_run)
    )
    shown_sha = image_sha256(load_image(IMAGE))
    # the app gave no path; the CLI's later run of the same pixels from a file names it
    assert app_analyze["image_sha256"] == shown_sha and app_analyze["image_path"] == str(IMAGE)
    third_sha = image_sha256(load_image(THIRD))
    assert cf["image_sha256"] == third_sha and cf["image_path"] == ""  # pixels only: named by their hash
    assert app_analyze["run_question"] == QUESTION and json.loads(app_analyze["target"])["foil"] == "triangle"
    assert json.loads(app_analyze["target"])["position"] is not None
    assert "rollout_alpha=0.5" in app_analyze["specification"]
    assert sweep["image_path"] == str(OTHER) and "k=4" in sweep["specification"]
    assert (
        "fill=mean" in cf["specification"]
        and "mask_area_px=" in cf["specification"]
        and "mask_id=" in cf["specification"]
    )
    # the two ablations differ by their head, and each says what it did, with its numbers
    assert "L1.H0" in ablate0["specification"] and "L1.H1" in ablate1["specification"]
    assert ablate0["specification"] != ablate1["specification"] and ablate0["summary"] != ablate1["summary"]
    for a in (ablate0, ablate1):
        assert "ablation=zero" in a["specification"] and '"site": "z"' in a["specification"]
        assert re.search(r"logit diff [-+]\d+\.\d+ -> [-+]\d+\.\d+", a["summary"])
        assert json.loads(a["target"])["position"] == json.loads(a["run_parameters"])["position"]
    # the patching rows name their source image: its hash always, its path when it had one
    assert f"source_image_sha256={image_sha256(load_image(OTHER))}" in patch["specification"]
    assert "source_image=" not in patch["specification"].replace("source_image_sha256=", "")
    assert patch["image_sha256"] == shown_sha
    assert f"source_image={IMAGE}" in patch_path["specification"] and patch_path["image_path"] == str(OTHER)
    assert painted.source_image_path is None and from_path.source_image_sha256 == shown_sha
    # a dataset run is named by its file and the SHA-256 of the file's bytes
    pairs_sha = hashlib.sha256(PAIRS.read_bytes()).hexdigest()
    for dataset_run in (stats, audit):
        assert dataset_run["image_path"] == str(PAIRS) and dataset_run["image_sha256"] == pairs_sha
    assert "accuracy" in audit["summary"] and cli_analyze["image_path"] == str(IMAGE)
    assert cli_cf["image_path"] == str(IMAGE) and "fill=blur" in cli_cf["specification"]

    # the same rows, with the same values, in Markdown, HTML and JSON
    md = _markdown_rows(outs["md"].read_text())
    page = outs["html"].read_text()
    table = _html_rows(page)
    doc = json.loads(outs["json"].read_text())
    assert len(md) == len(table) == len(doc["audit_table"]) == len(rows)
    for i, r in enumerate(rows):
        for c in COMPARED:
            assert md[i][c] == r[c].replace("\n", " "), (i, c)
            assert table[i][c] == r[c], (i, c)
            assert cell(doc["audit_table"][i][c]) == r[c], (i, c)
    runs = {d["id"]: d for d in doc["runs"]}
    assert runs[1]["image_sha256"] == shown_sha and runs[1]["model_fingerprint"] == llava.fingerprint
    assert runs[6]["specification"] == patch["specification"]
    # HTML names an image by its path when it has one, by its full hash otherwise
    assert f"image {third_sha}</p>" in page and f"image {OTHER} (sha256 {image_sha256(load_image(OTHER))})" in page


def test_the_session_file_alone_is_complete_while_it_is_open(tmp_path, capsys):
    """Copying only the .vlmr (not its -wal / -shm) while the session is open
    gives every run and audit row: each record is checkpointed into it."""
    path = tmp_path / "open.vlmr"
    rng = np.random.default_rng(0)
    with Session.create(path, "shapes-llava") as s:
        for i in range(4):
            img = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
            audits = [{"method": "model output", "parameters": {"i": i}}]
            s.record(
                RecordedResult("note", {"i": i, "payload": list(range(3000))}, f"note {i}", {"i": i}, audits), image=img
            )
        assert path.with_name("open.vlmr-wal").stat().st_size == 0  # everything is in the main file
        copy = tmp_path / "copy.vlmr"
        shutil.copyfile(path, copy)
        assert not copy.with_name("copy.vlmr-wal").exists()
        with Session.open(copy, read_only=True) as c:
            assert [r.summary for r in c.runs()] == [f"note {i}" for i in range(4)] and len(c.audit_table()) == 4
            assert c.run(4).pixels().size == (48, 32)
        assert main(["export", "--session", str(copy), "--format", "json", "--out", str(tmp_path / "c.json")]) == 0
        exported = json.loads((tmp_path / "c.json").read_text())
        assert len(exported["runs"]) == 4 and len(exported["audit_table"]) == 4

        # a reader holding an old snapshot delays the checkpoint; the record neither fails nor waits long
        with closing(sqlite3.connect(path)) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM runs").fetchone()
            s.record(RecordedResult("note", {"i": 4}, "note 4"))  # commits; the checkpoint is busy
            started = time.perf_counter()
            s.record(RecordedResult("note", {"i": 5}, "note 5"))
            assert time.perf_counter() - started < 1.0
            assert s.checkpoint() is False
            reader.execute("COMMIT")
        assert s.checkpoint() is True
        shutil.copyfile(path, copy)
        with Session.open(copy, read_only=True) as c:
            assert len(c.runs()) == 6
    capsys.readouterr()


def test_checkpoint_is_a_no_op_where_there_is_no_wal():
    with Session.temporary() as s:
        s.record(RecordedResult("note", {}, "in memory"))
        assert s.checkpoint() is True
    conn = sqlite3.connect(":memory:")
    assert checkpoint_wal(conn) is True  # not in WAL mode: nothing to copy
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 10000  # restored


def _one_line(fn, needle: str) -> str:
    with pytest.raises(SessionError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    return msg


def test_save_as_writes_one_self_contained_copy(tmp_path):
    path = tmp_path / "s.vlmr"
    mask = np.zeros((128, 128), bool)
    mask[10:30, 20:50] = True
    with Session.create(path, "shapes-llava") as s:
        s.record(RecordedResult("note", {"a": 1}, "first 1"), image=IMAGE, mask=mask)
        s.record(RecordedResult("note", {"b": 2}, "second 2"), image=load_image(OTHER))
        copy = s.save_as(tmp_path / "copy.vlmr")
        assert copy == tmp_path / "copy.vlmr" and sorted(p.name for p in tmp_path.iterdir() if "copy" in p.name) == [
            "copy.vlmr"
        ]  # one file: no -wal, -shm or temporary file beside it
        assert oct(copy.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
        s.record(RecordedResult("note", {"c": 3}, "after the copy 3"))  # the session stays on its own file
        _one_line(lambda: s.save_as(path), "this session's own file")
        _one_line(lambda: s.save_as(tmp_path / "." / "s.vlmr"), "this session's own file")
        notes = tmp_path / "notes.txt"
        notes.write_text("mine")
        _one_line(lambda: s.save_as(notes), "not a session file; refusing to overwrite")
        assert notes.read_text() == "mine"
        (tmp_path / "folder.vlmr").mkdir()
        _one_line(lambda: s.save_as(tmp_path / "folder.vlmr"), "not a regular file")
        _one_line(lambda: s.save_as(tmp_path / "missing" / "x.vlmr"), "no such folder")
        held = tmp_path / "held.vlmr"  # a session another program has open: its -wal exists beside it
        Session.create(held).close()
        held.with_name("held.vlmr-wal").write_bytes(b"")
        _one_line(lambda: s.save_as(held), "that session is open")
        s.save_as(copy)  # onto an earlier copy (a closed session): replaced whole
    with Session.open(copy, read_only=True) as c:
        assert [r.summary for r in c.runs()] == ["first 1", "second 2", "after the copy 3"] and c.check() == "ok"
        run = c.run(1)
        assert run.image_path == str(IMAGE) and np.array_equal(np.asarray(run.pixels()), np.asarray(load_image(IMAGE)))
        assert np.array_equal(run.mask(), mask) and c.model["spec"] == "shapes-llava"
        # a read-only session saves as a new file too
        again = c.save_as(tmp_path / "again.vlmr")
    with Session.open(again) as a:  # and the copy can be continued
        assert len(a.runs()) == 3 and a.journal_mode == "wal"
        a.record(RecordedResult("note", {}, "continued 4"))
    with Session.temporary() as t:  # a session saved nowhere can be saved
        t.record(RecordedResult("note", {}, "memory 1"))
        with Session.open(t.save_as(tmp_path / "memory.vlmr"), read_only=True) as m:
            assert [r.summary for r in m.runs()] == ["memory 1"]
    assert not list(tmp_path.glob(".*.tmp*"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_read_only_session_says_so_and_refuses_to_record(tmp_path):
    path = tmp_path / "s.vlmr"
    with Session.create(path) as s:
        assert s.read_only is False
        s.record(RecordedResult("note", {}, "one 1"))
    with Session.open(path, read_only=True) as s:
        assert s.read_only is True
        with pytest.raises(AttributeError):
            s.read_only = False  # a property: the app shows it, nothing flips it
        msg = _one_line(lambda: s.record(RecordedResult("note", {}, "two")), "the session is open read-only; ")
        assert str(path) in msg
        _one_line(lambda: s.set_model("shapes-coca"), "the session is open read-only; ")
        assert s.checkpoint() is True and len(s.runs()) == 1


def test_a_run_holds_everything_needed_to_show_it_again(every_kind, llava):
    path, painted, _ = every_kind
    mask = np.asarray(Image.open(MASK).convert("L")) >= 128
    with Session.open(path, read_only=True) as s:
        infos = s.runs()
        assert [i.kind for i in infos] == ["analyze", "counterfactual", "sweep"] + ["intervention"] * 4 + ["statistics"]
        first = s.run(infos[0].id)
        assert first.kind == "analyze" and first.created == infos[0].created and first.summary == infos[0].summary
        assert first.model["spec"] == "shapes-llava" and first.model["fingerprint"] == llava.fingerprint
        assert first.model["family"] == "llava" and first.question == QUESTION
        assert first.target == {"answer": "square", "foil": "triangle", "position": first.result["target"]["position"]}
        assert first.image_path is None and first.image.sha256 == first.image_sha256
        assert np.array_equal(np.asarray(first.pixels()), np.asarray(load_image(IMAGE)))
        assert first.mask() is None and first.result["input"]["question"] == QUESTION
        cf = s.run(infos[1].id)
        assert np.array_equal(cf.mask(), mask) and cf.parameters["fill"] == "mean"
        patch = s.run(infos[5].id)
        assert patch.result["source_image"] == {"path": None, "sha256": painted.source_image_sha256}
        assert patch.parameters["token_sets"] == {"painted region": [0, 1, 2]} and patch.parameters["reverse"] is True
        assert patch.columns() == {
            c: v for c, v in s.audit_table()[_first_row_of(s, patch.id)].items() if c in RUN_COLUMNS
        }
        sweep = s.run(infos[2].id)
        assert sweep.image_path == str(OTHER) and sweep.pixels().size == load_image(OTHER).size


def _first_row_of(session: Session, run_id: int) -> int:
    return next(i for i, r in enumerate(session.audit_table()) if r["run_id"] == run_id)


def test_a_paste_fill_names_its_source_image_by_hash():
    sha = image_sha256(load_image(OTHER))
    assert Fill("paste", paste_from=OTHER).parameters() == {
        "source": str(OTHER),
        "source_sha256": sha,
        "resize": "bilinear",
    }
    in_memory = Fill("paste", paste_from=np.asarray(load_image(OTHER))).parameters()
    assert in_memory["source"] == "in-memory image" and in_memory["source_sha256"] == sha
    assert Fill("mean").source_sha256 is None
