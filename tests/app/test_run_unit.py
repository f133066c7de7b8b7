"""A run is the unit of the window (issue 13, bugs 1, 2, 4 and 5): every read-out
view names the run it was drawn for, and when the image, question, model or
target moves on it is marked stale (amber header) or cleared, never left
looking current. Driven through the window's widgets, offscreen.

(Its own file: these tests wait on worker signals, which stop arriving in a
process after test_window.py's screenshot test.)"""

import numpy as np
from PIL import Image
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

import core
from app.input_bar import TARGET_PLACEHOLDER
from app.run_frame import STALE_STYLE
from app.samples import bundled_samples
from tests.app.shown import shown_result

TIMEOUT_MS = 60_000
READOUT_VIEWS = ("canvas", "attention", "dla", "lens")


def run_until_idle(qtbot, window, start) -> None:
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert start()
    assert not window.is_busy() and window.inputs.error_label.text() == "", window.inputs.error_label.text()


def header(window, view: str) -> str:
    return window.run_frames[view].header_text()


def assert_current(window, views, prefix: str) -> None:
    for view in views:
        frame = window.run_frames[view]
        assert not frame.stale and frame.header_text().startswith(prefix), (view, frame.header_text())
        assert frame.header.styleSheet() != STALE_STYLE


def assert_stale(window, views, drawn_for: str) -> None:
    for view in views:
        frame = window.run_frames[view]
        text = frame.header_text()
        assert frame.stale and text.startswith("stale") and f"drawn for {drawn_for}" in text, (view, text)
        assert frame.header.styleSheet() == STALE_STYLE  # amber, visibly


def read_out(qtbot, window) -> int:
    """Read out the shown pair; the id of the analyze run it recorded."""
    run_until_idle(qtbot, window, window.actions.run_readout)
    return window.session.runs("analyze")[-1].id


def test_a_new_question_answered_marks_the_readout_views_stale(qtbot, window):
    """Bug 1: after a new question is answered (Enter), the canvas and the Attention, DLA and
    Lens tabs say they show the previous question; the Answer tab names the new one."""
    sample = bundled_samples()[0]
    for view in (*READOUT_VIEWS, "answer", "counterfactual"):
        assert header(window, view) == "no run shown yet"
    run_id = read_out(qtbot, window)
    described = window.workspace.input.describe()
    assert described == f"'{sample.question}' · {sample.image_path.name} · shapes-llava · float32 (auto) · cpu"
    assert_current(window, (*READOUT_VIEWS, "answer"), f"run #{run_id} · analyze · {described}")

    new_question = "how many triangles are there?"
    window.inputs.question_edit.setFocus()
    window.inputs.question_edit.selectAll()
    qtbot.keyClicks(window.inputs.question_edit, new_question)
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.keyClick(window.inputs.question_edit, Qt.Key.Key_Return)
    assert window.inputs.error_label.text() == ""

    assert_stale(window, READOUT_VIEWS, f"'{sample.question}'")
    assert "(question changed)" in header(window, "attention")
    assert f"the input is now '{new_question}'" in header(window, "dla")
    expected = core.answer(window.loaded_model(), window.image, new_question)
    assert window.answer_panel.label.text() == f"answer: {expected.answer}  (p = {expected.prob:.3f})"
    assert_current(window, ["answer"], f"not recorded · answer · '{new_question}'")

    # read out again: every view shows the new run, current
    run_id = read_out(qtbot, window)
    assert_current(window, (*READOUT_VIEWS, "answer"), f"run #{run_id} · analyze · '{new_question}'")


def test_switching_models_clears_the_dataset_distribution(qtbot, window):
    """Bug 2: Attention > dataset distribution holds the heads of the model it was computed for."""
    run_until_idle(qtbot, window, window.actions.attention_statistics_of_samples)
    panel = window.attention_panel
    assert panel.statistics and panel.tabs.isTabEnabled(1)
    window.inputs.model_picker.setCurrentText("shapes-coca")
    assert panel.statistics == [] and not panel.tabs.isTabEnabled(1)


def test_choosing_another_model_marks_the_views_stale_at_once(qtbot, window):
    """Bug 4: the model box changing is visible at once: the views say their run was for the other model."""
    run_id = read_out(qtbot, window)
    window.inputs.model_picker.setCurrentIndex(window.inputs.model_picker.findText("shapes-coca"))
    # the dtype a header names: the one it runs in once loaded (an earlier test of the run may have loaded it)
    coca_dtype = "float32 (auto)" if window.loaded_model() is not None else "auto"
    assert_stale(window, (*READOUT_VIEWS, "answer"), "")
    for view in (*READOUT_VIEWS, "answer"):
        text = header(window, view)
        assert "(model changed)" in text and "shapes-llava · float32 (auto) · cpu; the input is now" in text
        assert text.endswith(f"shapes-coca · {coca_dtype} · cpu")
    window.inputs.model_picker.setCurrentText("shapes-llava")  # back to the run's model: current again
    assert_current(window, READOUT_VIEWS, f"run #{run_id} · analyze · ")


def test_a_new_sample_or_image_clears_every_view(qtbot, window):
    read_out(qtbot, window)
    assert window.attention_panel.cells and window.canvas.cells
    assert window.load_sample(bundled_samples()[1])
    for view in (*READOUT_VIEWS, "answer", "counterfactual"):
        assert header(window, view) == "no run shown yet" and not window.run_frames[view].stale
    assert window.analysis is None and not window.attention_panel.cells and shown_result(window, "answer") is None
    assert window.answer_panel.label.text() == "no answer yet"
    assert window.workspace.input.image_path == str(bundled_samples()[1].image_path)
    pixels = np.zeros((32, 48, 3), np.uint8)
    assert window.set_image(Image.fromarray(pixels))  # pixels without a path (as pasted)
    assert window.workspace.input.image_path is None and window.workspace.input.image_path is None
    assert window.workspace.input.describe().split(" · ")[1].startswith("image ")  # a short hash, no file name


def test_the_target_placeholder_follows_the_input(qtbot, window):
    """Bug 5: "now: square" names the shown run's answer, and goes when the sample, image or question changes."""
    read_out(qtbot, window)
    answer = window.analysis.target.answer
    assert window.inputs.target_edit.placeholderText() == f"answer token (now: {answer}, the model's top token)"
    window.set_question("how many circles are there?")
    assert window.inputs.target_edit.placeholderText() == TARGET_PLACEHOLDER
    read_out(qtbot, window)
    assert "now:" in window.inputs.target_edit.placeholderText()
    assert window.load_sample(bundled_samples()[2])
    assert window.inputs.target_edit.placeholderText() == TARGET_PLACEHOLDER


def test_the_counterfactual_tab_marks_another_models_result_stale(qtbot, window):
    """Bug 5: the previous model's counterfactual and patch results are marked stale after a model switch;
    the patch run records its source image."""
    sample = bundled_samples()[0]
    read_out(qtbot, window)
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[: mask.shape[0] // 2, : mask.shape[1] // 2] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    run_until_idle(qtbot, window, lambda: window.actions.run_counterfactual(mask, "mean", {}))
    counterfactual_id = window.session.runs("counterfactual")[-1].id
    assert_current(window, ["counterfactual"], f"run #{counterfactual_id} · counterfactual · '{sample.question}'")
    assert window.workspace.shown.results.keys() >= {"analyze", "counterfactual"}

    source = bundled_samples()[1].image_path
    run_until_idle(qtbot, window, lambda: window.actions.patch_region(source))
    patch_run = window.session.runs("intervention")[-1]
    assert_current(window, ["counterfactual"], f"run #{patch_run.id} · intervention · ")
    parameters = window.session.run(patch_run.id).parameters
    assert parameters["source_image"] == str(source)  # the result names its source (VisualPatchResult.parameters)
    assert parameters["source_image_sha256"] == core.files.images.image_sha256(core.load_image(source))

    window.inputs.model_picker.setCurrentText("shapes-coca")
    assert_stale(window, ["counterfactual", *READOUT_VIEWS], f"'{sample.question}'")
    assert "shapes-llava · float32 (auto) · cpu; the input is now" in header(window, "counterfactual")


def test_cancel_clears_the_running_line(qtbot, window):
    """Bug 5: "running the occlusion sweep…" goes when the sweep is cancelled."""
    panel = window.counterfactual_panel
    panel.sweep_k.setValue(panel.sweep_k.minimum())
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert panel.request_sweep()
        assert panel.message_label.text().startswith("running the occlusion sweep")
        window.cancel()
    assert window.inputs.status_label.text().startswith("cancelled")
    assert panel.message_label.text() == ""
    assert header(window, "counterfactual") == "no run shown yet"


def test_after_an_ablation_the_focus_stays_off_the_question(qtbot, window):
    """Bug 5: the Ablate button keeps the focus; the Question's text is not selected for overwriting."""
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window)
    read_out(qtbot, window)
    window.attention_panel.select_head(1, 1)
    window.tabs.setCurrentIndex(window.tabs.indexOf(window.run_frames["counterfactual"]))
    ablate_button = window.intervention_panel.ablate_button
    ablate_button.setFocus()
    assert QApplication.focusWidget() is ablate_button
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(ablate_button, Qt.MouseButton.LeftButton)
        assert QApplication.focusWidget() is not window.inputs.question_edit  # not while the job runs either
    assert window.inputs.error_label.text() == ""
    assert QApplication.focusWidget() is ablate_button
    assert window.inputs.question_edit.selectedText() == ""
    assert header(window, "counterfactual").startswith(f"run #{window.session.runs('intervention')[-1].id} · ")


def test_after_a_counterfactual_run_the_focus_stays_on_run(qtbot, window):
    """The same for the Counterfactual tab's Run: the panel's buttons are disabled while
    the job runs, and the focus must not fall to the next field (the sweep's k, its text
    selected) but come back to Run."""
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window)
    read_out(qtbot, window)
    panel = window.counterfactual_panel
    window.tabs.setCurrentIndex(window.tabs.indexOf(window.run_frames["counterfactual"]))
    mask = np.zeros(panel.mask().shape, dtype=bool)
    mask[: mask.shape[0] // 2, : mask.shape[1] // 2] = True
    panel.canvas.set_mask(mask)
    panel.run_button.setFocus()
    assert QApplication.focusWidget() is panel.run_button
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
        assert QApplication.focusWidget() is not panel.sweep_k  # not while the job runs either
    assert QApplication.focusWidget() is panel.run_button and panel.sweep_k.lineEdit().selectedText() == ""
    assert window.session.runs("counterfactual")
