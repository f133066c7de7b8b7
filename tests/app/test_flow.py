"""The whole flow on the default model, offscreen: open a sample pair, read it
out, select a head, paint over the target object, run the counterfactual, see
the answer change, export the audit table, reopen the session."""

import csv
import time

import numpy as np
import pytest
import torch

import core
from app.samples import bundled_samples
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle
from tests.tolerances import unit_roundoff


def sample_image(sample):
    from PIL import Image

    return Image.open(sample.image_path).convert("RGB")


def _sample_with_target():
    """The first bundled attribute sample (it has a target object and its mask)."""
    import json

    from core.models.loading import resources_dir

    folder = resources_dir() / "samples"
    for line in (folder / "pairs.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "attribute" and row["target"] is not None:
            sample = next(s for s in bundled_samples() if s.image_path.name == row["image"])
            mask = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(folder / row["masks"][row["target"]]))
            return sample, row, mask > 0
    pytest.skip("no attribute sample bundled")


def test_open_read_out_paint_counterfactual_export_reopen(qtbot, window, tmp_path):
    sample, row, target_mask = _sample_with_target()
    assert window.load_sample(sample)

    # read out: answer + every panel, recorded in the session (the model loads on the first run;
    # the second run is what a user waits for after pressing Run again)
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.run_readout()
    started = time.perf_counter()
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.run_readout()
    elapsed = time.perf_counter() - started
    assert shown_result(window, "answer") is not None and shown_result(window, "answer").answer == row["answer"]
    assert window.analysis is not None and window.analysis.target.answer == row["answer"]
    assert len(window.canvas.cells) == 64  # the 8 x 8 patch grid is drawn
    assert len(window.attention_panel.cells) == 16
    assert window.session.runs("analyze")
    print(f"read-out shown {elapsed:.2f} s after Run (model loaded)")

    # select a head: its answer-row attention goes onto the canvas
    with qtbot.waitSignal(window.attention_panel.head_selected):
        window.attention_panel.select_head(3, 1)
    head = window.attention_panel.head_row(3, 1)
    shown = window.canvas.values[~np.isnan(window.canvas.values)]
    # the head's own weights, drawn in float32: one rounding, relative to each weight
    want = np.sort(np.asarray(head.visual_patch_mass).ravel())
    assert np.allclose(np.sort(shown), want, rtol=unit_roundoff(torch.float32), atol=0)

    # paint over the target object with the brush (one stroke per mask row band) and run the counterfactual
    panel = window.counterfactual_panel
    canvas = panel.canvas
    canvas.set_brush_size(12)
    ys, xs = np.nonzero(target_mask)
    for y in range(int(ys.min()), int(ys.max()) + 1, 6):
        canvas.begin_stroke(float(xs.min()), float(y))
        canvas.stroke_to(float(xs.max()), float(y))
        canvas.end_stroke()
    painted = panel.mask()
    assert (painted & target_mask).sum() >= 0.9 * target_mask.sum()
    panel.set_fill("mean")
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert panel.request_run()
    result = shown_result(window, "counterfactual")
    assert result is not None
    assert result.original.predicted == row["answer"]
    assert result.edited.logit < result.original.logit  # the answer lost support when its object went
    assert window.session.runs("counterfactual")

    # export the audit table and reopen the session in a fresh window
    out = tmp_path / "audit.csv"
    assert window.sessions.export_audit("csv", str(out))
    rows = list(csv.DictReader(out.open()))
    kinds = {r["kind"] for r in rows}
    assert {"analyze", "counterfactual"} <= kinds
    assert any(r["method"] == "region counterfactual" for r in rows)

    session_file = window.session.path
    from app.main_window import MainWindow

    other = MainWindow(model_cache=window.model_cache, session_path=tmp_path / "other.vlmr")
    qtbot.addWidget(other)
    try:
        assert other.sessions.open_session(session_file, mode="append")
        assert other.analysis is not None and other.analysis.target.answer == row["answer"]
        assert len(other.audit_panel.rows()) == len(rows)
    finally:
        other.close()


def test_tiled_model_readout_says_its_tokens_are_not_one_grid(qtbot, window):
    """A tiny random LLaVA-NeXT (base image + tiles + newline tokens) through the
    window: the canvas draws the whole-image grid and says the tokens are tiles."""
    import torch

    from tests.core.exactness import noise_image
    from tests.core.test_llava_next import IMAGE_SIZE, QUESTION, tiny_llava_next_float64

    torch.manual_seed(0)
    window.inputs.model_picker.setCurrentText("tiny-llava-next")
    window.model_cache[window.model_choice()] = tiny_llava_next_float64()  # served for the picker's choice
    assert window.set_image(noise_image(IMAGE_SIZE), name="noise")
    window.set_question(QUESTION)
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.run_readout()
    assert window.analysis is not None, window.inputs.error_label.text()
    assert "views of the image" in window.canvas.note_label.text()
    primary = window.analysis.rollout.primary_image
    assert all(c.image == primary for c in window.canvas.cells) and window.canvas.cells


def test_head_ablation_and_region_patching_from_the_counterfactual_tab(qtbot, window):
    """The Interventions box: zero the selected head, then patch the painted
    target's visual tokens from the same scene with the target's shape changed."""
    from core.zoo import scenes

    sample, row, target_mask = _sample_with_target()
    assert window.load_sample(sample)
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.run_readout()
    window.attention_panel.select_head(1, 1)
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.ablate_selected()
    ablation = shown_result(window, "intervention")
    assert ablation.method == "ablation" and ablation.rows[0].label.startswith("L1.H1")
    assert window.intervention_panel.results.texts()[0][0].startswith("L1.H1")

    window.counterfactual_panel.canvas.set_mask(target_mask)
    from core.zoo.samples import KINDS

    scene = scenes.make_sample("sample", row["index"], kind=KINDS[row["index"] % len(KINDS)])
    assert np.array_equal(scene.image, np.asarray(sample_image(sample)))  # the bundled pair, re-generated
    new_shape = next(s for s in scenes.SHAPES if s != scene.objects[scene.target].shape)
    source = scenes.counterfactual_sample(scene, shape=new_shape)
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.patch_region(source.image)
    patch = shown_result(window, "intervention")
    forward = patch.rows[0].forward
    assert forward.effect.logit_change < 0  # the original shape lost support once its tokens came from the other scene
    assert {r.kind for r in window.session.runs()} >= {"analyze", "intervention"}


def test_attention_statistics_over_the_samples_fill_the_distribution_view(qtbot, window):
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.attention_statistics_of_samples()
    assert window.inputs.error_label.text() == ""
    assert len(window.attention_panel.statistics) == 16 and window.attention_panel.n_samples == 8
    assert window.session.runs("statistics")


def test_the_lens_tab_overlays_the_committed_tuned_lens(qtbot, window):
    assert window.load_sample(bundled_samples()[0])
    with qtbot.waitSignal(window.idle, timeout=60_000):
        assert window.actions.run_readout()
    readers = window.analysis.tuned_lens.readers
    assert readers and any(name.startswith("tuned lens") for name in readers)
    assert set(readers) <= set(window.lens_panel.all_readers())
    assert any(a.method == "tuned lens" for a in window.analysis.audit)


def test_readout_makes_one_forward_and_its_answer_is_the_models(qtbot, window, monkeypatch):
    """Read out: the answer and alternatives come from analyze's capture (one
    forward), and equal what core.answer gives for the same input."""
    import core.answer as answer_module

    loaded = window.loaded_model() or core.load_model("shapes-llava", **window.model_choice().load_options())
    window.model_cache[window.model_choice()] = loaded
    expected = core.answer(loaded, window.image, window.inputs.question_edit.text())
    calls = []
    original = loaded.adapter.forward_logits
    monkeypatch.setattr(loaded.adapter, "forward_logits", lambda inputs: calls.append(1) or original(inputs))
    monkeypatch.setattr(answer_module, "answer_batch", lambda *a, **k: pytest.fail("a second forward for the answer"))
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.inputs.error_label.text() == "" and len(calls) == 1
    shown = shown_result(window, "answer")
    assert shown.answer == expected.answer and shown.answer_id == expected.answer_id
    assert shown.prob == pytest.approx(expected.prob, abs=1e-5)  # eager capture vs the plain forward's attention
    assert [t for t, _ in shown.top] == [t for t, _ in expected.top]
