"""Issue 28 (part 5, H2): restoring a run from the History restores the controls its
request was made from, so what is on screen is the run shown and pressing its button
again runs the same experiment. On shapes-llava, offscreen; each run restored by a
click on its History row after the controls were moved elsewhere (another sample
loaded, other choices made).

Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QSettings, Qt

import app.recent_models
from app.main_window import MainWindow
from app.samples import bundled_samples
from tests.app.test_window import TIMEOUT_MS, run_until_idle


@pytest.fixture(autouse=True)
def own_settings(tmp_path, monkeypatch):
    """The recent models in a settings file of each test's own: a window loading a run's float32
    model must not change the dtype the other tests' pickers start on."""
    path = str(tmp_path / "settings.ini")
    monkeypatch.setattr(app.recent_models, "_settings", lambda: QSettings(path, QSettings.Format.IniFormat))


def read_out(qtbot, window):
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.analysis is not None, window.inputs.error_label.text()


def paint(window, rows=slice(20, 70), cols=slice(30, 90)) -> np.ndarray:
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[rows, cols] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    return mask


def click(qtbot, window, button) -> None:
    """Press ``button`` (which starts a job) and wait until the window is idle."""
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert not window.is_busy()
    assert window.inputs.error_label.text() == ""


def last_run(window, kind: str):
    return window.session.run(window.session.runs(kind)[-1].id)


def restore(window, run_id: int) -> None:
    """Select run ``run_id``'s History row, as a click on it."""
    assert window.history_panel.select_run(run_id)
    assert window.workspace.shown is not None and window.workspace.shown.run_id == run_id, (
        window.inputs.error_label.text()
    )


def elsewhere(window) -> None:
    """Move every control away from what the runs used: another sample (no painted region), other
    fill, sweep, ablation and patch choices, other Target and foil."""
    assert window.load_sample(bundled_samples()[4])
    panel, interventions = window.counterfactual_panel, window.intervention_panel
    panel.set_fill("mean")
    panel.radius_spin.setValue(9.0)
    panel.seed_spin.setValue(99)
    panel.sweep_k.setValue(1)
    interventions.set_kind("zero")
    interventions.set_positions("target")
    interventions.set_source(bundled_samples()[7].image_path)
    if interventions.sites():
        interventions.set_site("vision_out")
    window.inputs.target_edit.setText("triangle")
    window.inputs.foil_edit.setText("")
    window.answer_panel.set_generate_budget(24)


# ---------------------------------------------------------------- the Counterfactual tab's fill


@pytest.mark.parametrize(
    "fill, options",
    [
        ("inpaint", {}),
        ("blur", {"radius": 2.5}),
        ("noise", {"seed": 7}),
        ("constant", {"color": (10, 200, 30)}),
        ("paste", {"paste_from": str(bundled_samples()[2].image_path)}),
    ],
)
def test_a_restored_counterfactual_shows_its_fill_and_region(qtbot, window, fill, options):
    """After an inpaint counterfactual the Fill box said "mean": the fill, its option and the
    painted region are the run's."""
    panel = window.counterfactual_panel
    mask = paint(window)
    panel.set_fill(fill, **options)
    click(qtbot, window, panel.run_button)
    run = last_run(window, "counterfactual")
    elsewhere(window)
    restore(window, run.id)
    assert panel.fill_combo.currentText() == fill
    assert panel.fill_choice() == (fill, options)
    assert panel.fill_options.currentIndex() == panel._option_pages[fill]  # the option shown is the fill's
    if fill == "constant":
        assert panel.color_button.text() == "RGB 10, 200, 30"
    if fill == "paste":
        assert panel.paste_label.text() == bundled_samples()[2].image_path.name
    assert np.array_equal(panel.mask(), mask)
    assert window.inputs.error_label.text() == ""


def test_a_restored_sweep_shows_its_k_and_fill(qtbot, window):
    panel = window.counterfactual_panel
    panel.set_fill("blur", radius=3.0)
    panel.sweep_k.setValue(4)
    click(qtbot, window, panel.sweep_button)
    run = last_run(window, "sweep")
    elsewhere(window)
    restore(window, run.id)
    assert panel.sweep_k.value() == 4
    assert panel.fill_choice() == ("blur", {"radius": 3.0})
    assert panel.sweep_title.text() == "occlusion sweep (k = 4, blur fill)"


# ---------------------------------------------------------------- the Interventions box


def test_a_restored_mean_ablation_shows_its_kind_and_positions(qtbot, window):
    """After a mean ablation the kind box said "zero": kind, positions and the painted region
    are the run's, the component selected as it was."""
    read_out(qtbot, window)
    interventions = window.intervention_panel
    window.attention_panel.select_head(1, 0)
    mask = paint(window, slice(0, 32), slice(0, 32))
    interventions.set_kind("mean")
    interventions.set_positions("region")
    click(qtbot, window, interventions.ablate_button)
    run = last_run(window, "intervention")
    elsewhere(window)
    restore(window, run.id)
    assert interventions.kind_combo.currentText() == "mean" and interventions.kind() == "mean"
    assert interventions.positions_combo.currentText() == "painted region"
    assert not interventions.reference_label.isHidden()  # the mean's reference set is said
    assert interventions.reference_label.text().startswith("mean over the 8 bundled sample images")
    assert window.inputs.error_label.text() == "" and interventions.message_label.text() == ""
    assert np.array_equal(window.counterfactual_panel.mask(), mask)
    assert interventions.component_label.text().startswith("L1.H0 (selected in Attention, run #")


def test_a_restored_resample_ablation_shows_its_source(qtbot, window):
    read_out(qtbot, window)
    interventions = window.intervention_panel
    window.dla_panel.select_component("L1.mlp", emit=True)
    source = bundled_samples()[3].image_path
    interventions.set_kind("resample")
    interventions.set_positions("all")
    interventions.set_source(source)
    click(qtbot, window, interventions.ablate_button)
    run = last_run(window, "intervention")
    elsewhere(window)
    restore(window, run.id)
    assert (interventions.kind(), interventions.positions()) == ("resample", "all")
    assert interventions.source() == str(source) and interventions.source_combo.currentText() == source.name


def test_a_restored_patch_shows_its_site_block_source_and_positions(qtbot, window):
    read_out(qtbot, window)
    interventions = window.intervention_panel
    source = bundled_samples()[2].image_path
    interventions.set_source(source)
    interventions.set_site("resid", 1)
    interventions.set_positions("all")
    click(qtbot, window, interventions.patch_button)
    run = last_run(window, "intervention")
    elsewhere(window)
    restore(window, run.id)
    assert interventions.site_choice() == ("resid", 1)
    assert interventions.block_combo.currentText() == "entering L1"
    assert interventions.source() == str(source) and interventions.positions() == "all"


def test_a_patch_restored_before_its_model_loads_keeps_its_site(qtbot, window, tmp_path):
    """A session opened in a window that has not loaded the model yet: the site box cannot list the
    family's sites until the model loads, so it shows the run's site then (not "earliest visual site")."""
    read_out(qtbot, window)
    interventions = window.intervention_panel
    interventions.set_source(bundled_samples()[2].image_path)
    interventions.set_site("resid", 2)
    interventions.set_positions("all")
    click(qtbot, window, interventions.patch_button)
    other = MainWindow(model_cache={}, session_path=tmp_path / "other.vlmr")
    qtbot.addWidget(other)
    try:
        with qtbot.waitSignal(other.idle, timeout=TIMEOUT_MS):  # the run's model loads in a worker
            assert other.sessions.open_session(window.session.path, mode="read_only")
        assert other.intervention_panel.site_choice() == ("resid", 2)
        assert other.intervention_panel.block_combo.currentText() == "entering L2"
        assert other.intervention_panel.source() == str(bundled_samples()[2].image_path)
    finally:
        other.close()


# ---------------------------------------------------------------- the Target and foil fields


def test_a_target_of_several_words_is_restored_as_typed(qtbot, window):
    """After a run with Target "blue circle" the Target field showed "blue" (its first token): every
    kind restores the fields as they were typed."""
    window.inputs.target_edit.setText("blue circle")
    window.inputs.foil_edit.setText("red square")
    read_out(qtbot, window)
    window.attention_panel.select_head(2, 1)
    paint(window)
    panel = window.counterfactual_panel
    panel.set_fill("mean")
    click(qtbot, window, panel.run_button)
    panel.sweep_k.setValue(4)
    click(qtbot, window, panel.sweep_button)
    click(qtbot, window, window.intervention_panel.ablate_button)
    click(qtbot, window, window.head_methods.qk_ov_button)
    ids = {kind: window.session.runs(kind)[-1].id for kind in ("analyze", "counterfactual", "sweep", "intervention")}
    ids["qk-ov"] = window.session.runs("qk-ov")[-1].id
    for kind, run_id in ids.items():
        elsewhere(window)
        restore(window, run_id)
        assert (window.inputs.target_edit.text(), window.inputs.foil_edit.text()) == ("blue circle", "red square"), kind
        stale = [name for name, frame in window.run_frames.items() if frame.stale]
        assert stale == [], (kind, stale)  # the fields are the shown run's: no view says "target changed"


def test_a_readout_of_another_target_is_not_shown_as_a_restored_runs(qtbot, window):
    """A counterfactual run after the Target was changed (the read-out views were stale beside it):
    restored, its read-out is not the one of the other Target drawn as current."""
    read_out(qtbot, window)
    window.inputs.target_edit.setText("circle")
    assert window.run_frames["attention"].stale  # live: the read-out is of another Target
    paint(window)
    click(qtbot, window, window.counterfactual_panel.run_button)
    run = last_run(window, "counterfactual")
    elsewhere(window)
    restore(window, run.id)
    assert window.inputs.target_edit.text() == "circle"
    assert "analyze" not in window.workspace.shown.results and window.analysis is None
    assert window.run_frames["attention"].header_text() == "no run shown yet"
    assert window.run_frames["counterfactual"].header_text().startswith(f"run #{run.id} · counterfactual")


def test_a_restored_generation_shows_its_token_budget(qtbot, window):
    run_until_idle(qtbot, window, lambda: window.actions.generate_answer(5))
    run = last_run(window, "generate")
    elsewhere(window)
    restore(window, run.id)
    assert window.answer_panel.max_tokens.value() == 5


# ---------------------------------------------------------------- what cannot be restored is marked


def test_what_a_run_did_not_store_is_marked_not_the_runs(qtbot, window):
    """A paste counterfactual recorded (as a script records it) from an image in memory and without
    its mask, and a patch from pixels without a file: the controls that cannot be set again say so
    in red, and Run / Patch refuse rather than run another experiment."""
    from core.files.images import load_image
    from core.methods.counterfactual import region_counterfactual

    read_out(qtbot, window)
    panel, interventions = window.counterfactual_panel, window.intervention_panel
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[10:40, 10:40] = True
    pixels = np.asarray(load_image(bundled_samples()[1].image_path))
    result = region_counterfactual(
        window.loaded_model(), window.image, window.inputs.question_edit.text(), mask, "paste", paste_from=pixels
    )
    pasted = window.session.record(
        result, image=window.image, parameters={"question": window.inputs.question_edit.text()}
    )
    interventions.set_positions("all")
    run_until_idle(qtbot, window, lambda: window.actions.patch_region(load_image(bundled_samples()[2].image_path)))
    patched = last_run(window, "intervention").id
    elsewhere(window)
    panel.set_paste_source(bundled_samples()[3].image_path)

    restore(window, pasted)
    assert panel.fill_combo.currentText() == "paste" and panel.paste_source is None
    assert panel.paste_label.text() == f"run #{pasted} pasted from an image that was no file: choose it again"
    assert "c00000" in panel.paste_label.styleSheet()
    region = f"the painted region of run #{pasted} is not stored with it: the region shown is not the run's"
    assert panel.message_label.text() == region and "c00000" in panel.message_label.styleSheet()
    assert panel.paste_label.text() in window.inputs.error_label.text() and region in window.inputs.error_label.text()
    n = len(window.session.runs())
    panel.canvas.set_mask(mask)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    assert not window.is_busy() and len(window.session.runs()) == n
    assert panel.message_label.text().startswith("the paste fill needs another image")

    restore(window, patched)
    said = f"run #{patched}'s source image was no file: choose it again"
    assert interventions.source() is None and interventions.message_label.text() == said
    assert "c00000" in interventions.message_label.styleSheet() and said in window.inputs.error_label.text()
    assert interventions.positions() == "all"
    qtbot.mouseClick(interventions.patch_button, Qt.MouseButton.LeftButton)
    assert not window.is_busy() and len(window.session.runs()) == n
    assert "choose a source image" in interventions.message_label.text()


# ---------------------------------------------------------------- the Validation tab


def test_a_restored_claim_shows_its_subject_claim_data_and_n_and_runs_again_as_it_was(qtbot, window):
    """A claim restored from the History: the fields it was stated with, not the ones typed since;
    the painted region it used is not stored, and the panel says so in red. Run then checks the
    same claim on the same data."""
    panel = window.validation_panel
    panel.subject_edit.setText("L1.H1")
    panel.claim_edit.setText("L1.H1 reads the colour asked about")
    panel.set_dataset("scenes")
    panel.n_spin.setValue(12)
    paint(window)
    panel.region_check.setChecked(True)
    click(qtbot, window, panel.run_button)
    run = last_run(window, "validate")
    panel.subject_edit.setText("L0.H0")
    panel.claim_edit.setText("another claim")
    panel.set_dataset("bundled")
    panel.n_spin.setValue(40)
    panel.region_check.setChecked(False)
    picked = window.model_choice()
    assert window.history_panel.select_run(run.id)
    assert window.model_choice() == picked  # the loaded "auto" model ran it: not a second float32 copy
    assert (panel.subject_edit.text(), panel.claim_edit.text()) == ("L1.H1", "L1.H1 reads the colour asked about")
    assert (panel.dataset_combo.currentData(), panel.n(), panel.uses_region()) == ("scenes", 12, True)
    said = f"run #{run.id} used a painted region that is not stored with it: the region painted now is not the run's"
    assert panel.message_label.text() == said and "c00000" in panel.message_label.styleSheet()
    assert window.inputs.error_label.text() == said
    click(qtbot, window, panel.run_button)
    again = last_run(window, "validate")
    assert again.id > run.id and again.parameters == run.parameters


# ---------------------------------------------------------------- the run button again


def without_time(parameters: dict) -> dict:
    return {k: v for k, v in parameters.items() if k not in ("elapsed_s",)}


def test_pressing_run_after_a_restore_runs_the_restored_experiment(qtbot, window):
    """Restored, then Run / Occlusion sweep / Ablate / Patch pressed again: each new run records the
    parameters and numbers of the run restored (it used to run the controls' other choices)."""
    window.inputs.target_edit.setText("blue circle")
    read_out(qtbot, window)
    panel, interventions = window.counterfactual_panel, window.intervention_panel
    paint(window)
    panel.set_fill("noise", seed=11)
    click(qtbot, window, panel.run_button)
    panel.set_fill("inpaint")
    panel.sweep_k.setValue(4)
    click(qtbot, window, panel.sweep_button)
    window.lens_panel.select_layer(2)
    interventions.set_kind("mean")
    interventions.set_positions("region")
    click(qtbot, window, interventions.ablate_button)
    interventions.set_source(bundled_samples()[1].image_path)
    interventions.set_site("resid", 1)
    click(qtbot, window, interventions.patch_button)
    runs = window.session.runs()
    cases = [
        (runs[-4].id, panel.run_button),
        (runs[-3].id, panel.sweep_button),
        (runs[-2].id, interventions.ablate_button),
        (runs[-1].id, interventions.patch_button),
    ]
    for run_id, button in cases:
        restored = window.session.run(run_id)
        elsewhere(window)
        restore(window, run_id)
        click(qtbot, window, button)
        again = last_run(window, restored.kind)
        assert again.id > run_id
        assert without_time(again.parameters) == without_time(restored.parameters), restored.kind
        assert again.result == restored.result, restored.kind
