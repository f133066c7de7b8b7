"""A session reopens to exactly what was seen (issue 13): three runs on three
images (an analyze, a counterfactual, an ablation), the window closed, the
session opened in a new window, each run selected in the History tab; the
image and every panel's numbers equal the run's stored values and what the
first window showed. Also: read-only opening never writes the file, Save
session as continues in the copy, a deleted image file restores from the
session's pixels, a model not loaded is loaded in a worker.

Each test waits on worker signals, so this file stays apart from
tests/app/test_window.py (after its screenshot test queued signals stop arriving)."""

from __future__ import annotations

import csv
import hashlib
import io
import shutil

import numpy as np
import torch
from PIL import Image

from app.components import NOTHING_SHOWN, ModelChoice
from app.main_window import MainWindow
from app.panels.dla_panel import CONVENTIONS
from app.samples import bundled_samples
from core.files.images import image_sha256
from core.session import Session
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle
from tests.tolerances import unit_roundoff

FLOAT32 = unit_roundoff(torch.float32)  # the canvas draws its map in float32


def _window(qtbot, model_cache, session_path, **kwargs) -> MainWindow:
    win = MainWindow(model_cache=model_cache, session_path=session_path, **kwargs)
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    return win


def _close(win: MainWindow) -> None:
    win.close()
    assert win.runner.workers.running() == []


def _table_texts(table) -> list[list[str]]:
    return [
        [table.item(r, c).text() if table.item(r, c) else "" for c in range(table.columnCount())]
        for r in range(table.rowCount())
    ]


def _canvas_values(win: MainWindow) -> np.ndarray:
    values = win.canvas.values
    return np.sort(values[np.isfinite(values)]) if values is not None else np.zeros(0)


def _seen(win: MainWindow) -> dict:
    """What the window shows now, panel by panel."""
    return {
        "image": image_sha256(win.image),
        "question": win.inputs.question_edit.text(),
        "model": win.inputs.model_spec(),
        "target": (win.inputs.target_edit.text(), win.inputs.foil_edit.text()),
        "answer": win.answer_panel.label.text(),
        "answer_table": _table_texts(win.answer_panel.table),
        "attention": {k: a.visual_mass for k, a in win.attention_panel.cells.items()},
        "attention_grid": np.array(win.attention_panel.visual_grid.values, copy=True),
        "dla": win.dla_panel.values(),
        "lens": _table_texts(win.lens_panel.table),
        "canvas": _canvas_values(win),
        "counterfactual": _table_texts(win.counterfactual_panel.answer_table),
        "intervention": win.intervention_panel.results.texts(),
    }


def _assert_same_as_seen(now: dict, then: dict) -> None:
    for key, value in then.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(now[key], value, equal_nan=True), key
        else:
            assert now[key] == value, key


def _assert_analysis_shown(win: MainWindow, analysis: dict, head: tuple[int, int] | None = None) -> None:
    """The Answer tab, Attention, DLA, Lens and the canvas hold ``analysis``'s numbers (the canvas: its
    rollout, or with ``head`` (block, head) that head's answer-row attention)."""
    top = analysis["target"]["top"]
    assert shown_result(win, "answer").answer == top[0][0] and shown_result(win, "answer").prob == top[0][1]
    assert win.answer_panel.label.text() == f"answer: {top[0][0]}  (p = {top[0][1]:.3f})"
    assert [row[0] for row in _table_texts(win.answer_panel.table)] == [t for t, _ in top]
    stored_mass = {(a["layer"], a["head"]): a["visual_mass"] for a in analysis["attention"]}
    assert {k: a.visual_mass for k, a in win.attention_panel.cells.items()} == stored_mass
    field = CONVENTIONS[win.dla_panel.convention()][0]
    components = analysis["residual_decomposition"]["components"]
    assert win.dla_panel.values() == {c["name"]: float(c[field]) for c in components if c.get(field) is not None}
    ranks = [row[1] for row in _table_texts(win.lens_panel.table)]
    assert ranks == [f"{row['answer_rank']:g}" for row in sorted(analysis["logit_lens"], key=lambda r: r["layer"])]
    if head is None:
        drawn = analysis["rollout"]["visual_patch_mass"]
    else:
        drawn = next(a for a in analysis["attention"] if (a["layer"], a["head"]) == head)["visual_patch_mass"]
        assert win.attention_panel.selected == head
    assert np.allclose(_canvas_values(win), np.sort(np.asarray(drawn, dtype=float).ravel()), rtol=FLOAT32, atol=0)


def _assert_headers(win: MainWindow, run) -> None:
    """Every view's header names the run it shows (the read-out views: the analyze run of the run's
    input) and none is stale."""
    frames = win.run_frames
    assert not any(frame.stale for frame in frames.values())
    analyses = [r.id for r in win.session.runs("analyze") if r.image_sha256 == run.image_sha256 and r.id <= run.id]
    for name in ("canvas", "attention", "dla", "lens", "answer"):
        want = f"run #{analyses[-1]} · " if analyses else NOTHING_SHOWN
        assert frames[name].header_text().startswith(want), name
    if run.kind != "analyze":
        assert frames["counterfactual"].header_text().startswith(f"run #{run.id} · {run.kind} · ")


def _assert_nothing_read_out(win: MainWindow) -> None:
    assert win.answer_panel.label.text() == "no answer yet" and win.attention_panel.cells == {}


def _target_mask(sample) -> np.ndarray:
    return np.asarray(Image.open(sample.target_mask_path)) > 0


def test_three_runs_on_three_images_reopen_as_they_were_seen(qtbot, model_cache, tmp_path):
    samples = bundled_samples()
    first_sample, cf_sample, ablation_sample = samples[0], samples[1], samples[4]
    assert len({s.image_path for s in (first_sample, cf_sample, ablation_sample)}) == 3
    path = tmp_path / "work.vlmr"
    first = _window(qtbot, model_cache, path)
    seen: dict[int, dict] = {}
    try:
        # 1. read out the first image, with a foil typed
        assert first.load_sample(first_sample)
        first.inputs.foil_edit.setText("triangle")
        run_until_idle(qtbot, first, first.actions.run_readout)
        analyze_id = first.session.runs()[-1].id
        seen[analyze_id] = _seen(first)

        # 2. a counterfactual on the second image: its target object filled with the mean
        assert first.load_sample(cf_sample)
        first.inputs.foil_edit.setText("")
        panel = first.counterfactual_panel
        panel.canvas.set_mask(_target_mask(cf_sample))
        panel.set_fill("mean")
        run_until_idle(qtbot, first, panel.request_run)
        counterfactual_id = first.session.runs()[-1].id
        seen[counterfactual_id] = _seen(first)

        # 3. read out the third image, select a head, ablate it
        assert first.load_sample(ablation_sample)
        run_until_idle(qtbot, first, first.actions.run_readout)
        assert first.attention_panel.select_head(1, 0)
        run_until_idle(qtbot, first, first.actions.ablate_selected)
        ablation_id = first.session.runs()[-1].id
        seen[ablation_id] = _seen(first)
        kinds = {r.id: r.kind for r in first.session.runs()}
        assert [kinds[i] for i in (analyze_id, counterfactual_id, ablation_id)] == [
            "analyze",
            "counterfactual",
            "intervention",
        ]
        assert first.history_panel.run_ids() == list(kinds)
    finally:
        _close(first)

    second = _window(qtbot, model_cache, tmp_path / "other.vlmr")
    try:
        assert second.sessions.open_session(path, mode="append")
        assert second.sessions.label.text() == f"session: {path}"
        assert second.history_panel.run_ids() == list(kinds)
        # opening restores the last run: its image, question and the read-out of its input
        assert second.workspace.shown.run_id == ablation_id and second.workspace.is_current()
        _assert_same_as_seen(_seen(second), seen[ablation_id])

        for run_id in (analyze_id, counterfactual_id, ablation_id):
            with qtbot.waitSignal(second.history_panel.run_selected, timeout=5_000):
                assert second.history_panel.select_run(run_id)
            run = second.session.run(run_id)
            shown = _seen(second)
            assert shown["image"] == run.image_sha256
            assert shown["question"] == run.parameters["question"]
            assert shown["model"] == run.model["spec"]
            _assert_same_as_seen(shown, seen[run_id])
            assert second.workspace.shown.run_id == run_id and second.workspace.is_current()
            assert second.history_panel.current_run() == run_id
            _assert_headers(second, run)
            result = run.result
            if run.kind == "analyze":
                _assert_analysis_shown(second, result)
                assert shown["target"] == ("", "triangle")
            elif run.kind == "counterfactual":
                _assert_nothing_read_out(second)  # the first window read nothing out on that image either
                o, e = result["original"], result["edited"]
                table = shown["counterfactual"]
                assert table[0][:2] == [o["predicted"], e["predicted"]]
                assert table[1][:2] == [f"{o['prob']:.4f}", f"{e['prob']:.4f}"]
                assert table[2][:2] == [f"{o['logit']:.4f}", f"{e['logit']:.4f}"]
                assert second.counterfactual_panel.result.effect.to_dict() == result["effect"]
                mask = second.session.mask(run.mask_id)
                assert np.array_equal(second.counterfactual_panel.mask(), mask)
            else:
                analyses = [r for r in second.session.runs("analyze") if r.image_sha256 == run.image_sha256]
                row = result["rows"][0]
                ablated = (row["edits"][0]["block"], row["edits"][0]["head"])
                assert ablated == (1, 0)
                _assert_analysis_shown(second, second.session.run(analyses[-1].id).result, head=ablated)
                before, after = row["original"], row["edited"]
                (label, answer, logit, prob, predicted, flipped), *more = shown["intervention"]
                assert not more and label == row["label"] and answer == before["answer"]
                assert logit.startswith(f"{before['logit']:+.3f} → {after['logit']:+.3f}")  # no foil: the logit
                assert prob.startswith(f"{before['prob']:.4f} → {after['prob']:.4f}")
                assert predicted.split() == [before["predicted"], "→", after["predicted"]]
                assert flipped == ("yes" if row["effect"]["flipped"] else "no")
        assert second.session.runs()[-1].id == ablation_id  # showing runs records nothing
    finally:
        _close(second)


def _record_analyze(session_path, model_cache, sample, image_path=None) -> None:
    """One analyze run of ``sample`` recorded straight through the engine (no window)."""
    from core.analyze import analyze

    llava = ModelChoice("shapes-llava")  # the window's cache key: the default dtype and device
    loaded = model_cache.get(llava)
    if loaded is None:
        loaded = model_cache[llava] = __import__("core").load_model("shapes-llava", **llava.load_options())
    image_path = image_path or sample.image_path
    result = analyze(loaded, Image.open(image_path).convert("RGB"), sample.question)
    with Session.open_or_create(session_path) as s:
        s.record(result, image=str(image_path), model=loaded, parameters={"question": sample.question})


def _file_digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_read_only_open_records_elsewhere_and_loads_the_model(qtbot, model_cache, tmp_path):
    sample = bundled_samples()[2]
    shared = tmp_path / "shared.vlmr"
    _record_analyze(shared, model_cache, sample)
    digest = _file_digest(shared)
    fresh_cache: dict = {}  # the run's model is not loaded: the restore loads it in a worker
    win = _window(qtbot, fresh_cache, tmp_path / "mine.vlmr")
    try:
        with qtbot.waitSignal(win.idle, timeout=60_000):
            assert win.sessions.open_session(shared, mode="read_only")
        # loaded in the dtype and on the device the run records (it was made with "auto": float32 on the CPU)
        assert list(fresh_cache) == [ModelChoice("shapes-llava", "float32", "cpu")] and not win.is_busy()
        assert win.loaded_model() is fresh_cache[win.model_choice()]
        assert win.sessions.label.text() == f"session: {shared} (read-only; new runs are not saved into it)"
        assert image_sha256(win.image) == win.session.runs()[-1].image_sha256
        assert win.inputs.question_edit.text() == sample.question and win.answer_panel.label.text() != "no answer yet"
        run_until_idle(qtbot, win, win.actions.run_readout)
        assert len(win.session.runs()) == 2 and win.history_panel.run_ids() == [1, 2]
    finally:
        _close(win)
    assert _file_digest(shared) == digest
    with Session.open(shared, read_only=True) as s:
        assert len(s.runs()) == 1


def test_save_as_copies_every_run_and_continues_there(qtbot, model_cache, tmp_path):
    sample = bundled_samples()[3]
    start = tmp_path / "start.vlmr"
    _record_analyze(start, model_cache, sample)
    _record_analyze(start, model_cache, bundled_samples()[0])
    win = _window(qtbot, model_cache, tmp_path / "unused.vlmr")
    try:
        assert win.sessions.open_session(start, mode="append")
        assert not win.sessions.save_session_as(tmp_path / "no such folder" / "copy.vlmr")
        assert win.inputs.error_label.text().startswith("cannot save the session as ") and win.session.path == start
        copy = tmp_path / "copy.vlmr"
        assert win.sessions.save_session_as(copy)
        assert win.session.path == copy and win.sessions.label.text() == f"session: {copy}"
        assert win.inputs.error_label.text() == ""
        assert win.history_panel.run_ids() == [1, 2]
        run_until_idle(qtbot, win, win.actions.run_readout)
        assert win.history_panel.run_ids() == [1, 2, 3]
    finally:
        _close(win)
    with Session.open(copy, read_only=True) as s, Session.open(start, read_only=True) as original:
        assert [r.kind for r in s.runs()] == ["analyze"] * 3
        assert len(original.runs()) == 2
        assert [r.summary for r in s.runs()[:2]] == [r.summary for r in original.runs()]


def test_a_deleted_image_file_restores_from_the_stored_pixels(qtbot, model_cache, tmp_path):
    sample = bundled_samples()[5]
    moved = tmp_path / "picture.png"
    shutil.copy(sample.image_path, moved)
    session_path = tmp_path / "s.vlmr"
    _record_analyze(session_path, model_cache, sample, image_path=moved)
    sha = image_sha256(Image.open(moved).convert("RGB"))
    moved.unlink()
    win = _window(qtbot, model_cache, tmp_path / "mine.vlmr")
    try:
        assert win.sessions.open_session(session_path, mode="append")
        assert image_sha256(win.image) == sha and win.image_name == "picture.png"
        assert win.inputs.error_label.text() == ""
        assert win.history_panel.has_thumbnail(1)
        assert win.history_panel.row_texts(1)["image"] == "picture.png"
        _assert_analysis_shown(win, win.session.run(1).result)
    finally:
        _close(win)


def test_a_run_whose_image_is_gone_says_so(qtbot, model_cache, tmp_path):
    """Without stored pixels and without the file, the run is not drawn over another image."""
    sample = bundled_samples()[6]
    moved = tmp_path / "gone.png"
    shutil.copy(sample.image_path, moved)
    session_path = tmp_path / "hashes-only.vlmr"
    Session.create(session_path, store_images=False).close()
    _record_analyze(session_path, model_cache, sample, image_path=moved)
    moved.unlink()
    win = _window(qtbot, model_cache, tmp_path / "mine.vlmr")
    try:
        before = image_sha256(win.image)
        assert win.sessions.open_session(session_path, mode="append")
        assert (
            "cannot show run #1: its image" in win.inputs.error_label.text()
            and "not stored" in win.inputs.error_label.text()
        )
        assert image_sha256(win.image) == before
    finally:
        _close(win)


def test_copying_only_the_session_file_while_the_app_runs_gives_every_run(qtbot, model_cache, tmp_path):
    """Issue 13, item 7: the natural way to share a session is to copy the .vlmr;
    copied while the window is open (no -wal beside the copy), it holds every run
    and exports every audit row."""
    from core.cli import main

    path = tmp_path / "live.vlmr"
    win = _window(qtbot, model_cache, path)
    try:
        for sample in bundled_samples()[:2]:
            assert win.load_sample(sample)
            run_until_idle(qtbot, win, win.actions.run_readout)
        live = win.session.audit_table()
        copy = tmp_path / "copy.vlmr"
        shutil.copyfile(path, copy)  # the .vlmr only, while the window still holds the session
        assert not (tmp_path / "copy.vlmr-wal").exists()
        with Session.open(copy, read_only=True) as copied:
            assert [r.id for r in copied.runs()] == [r.id for r in win.session.runs()] and len(live) > 0
            assert copied.audit_table() == live
        out = tmp_path / "copy.csv"
        assert main(["export", "--session", str(copy), "--format", "csv", "--out", str(out)]) == 0
        rows = list(csv.DictReader(io.StringIO(out.read_text())))
        assert len(rows) == len(live) and all(r["image_sha256"] and r["model_fingerprint"] for r in rows)
    finally:
        _close(win)
