"""The window on an 800-px screen, as a new user met it (issue 28, part 5, H4): no result
raises the window's minimum size past 1280 x 800 (the Target field, the progress bar,
Cancel and the session line stay on screen after the window is made 1280 x 800 again),
no control moves when a message, an error or a combo box's choice changes, the tab bar
stays where it is when a tab is selected, and the occlusion map is big enough to read.

Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QApplication, QLabel, QTabBar, QWidget

from tests.app.test_layout import on_screen, show_tab
from tests.app.test_window import run_until_idle

SCREEN = (1280, 800)
LONG = "the model refused the request because " + "this part of the reason is long and keeps going, " * 8


def settle() -> None:
    """Let a change reach the window: each level of layouts up to it takes a pass of the event loop."""
    for _ in range(20):
        QApplication.processEvents()


def fits_the_screen(window) -> None:
    """The window's minimum fits 1280 x 800, and at 1280 x 800 the bottom controls are whole on screen."""
    settle()
    minimum = window.minimumSizeHint().expandedTo(window.minimumSize())
    assert minimum.width() <= SCREEN[0] and minimum.height() <= SCREEN[1], minimum
    window.resize(*SCREEN)
    settle()
    assert (window.width(), window.height()) == SCREEN
    bottom = {
        "Target": window.inputs.target_edit,
        "progress bar": window.inputs.progress_bar,
        "Cancel": window.inputs.cancel_button,
        "session line": window.sessions.label,
    }
    off = [name for name, w in bottom.items() if on_screen(w).size() != w.size() or not w.isVisible()]
    assert not off, f"{off} are not whole on screen at 1280 x 800"


def shows_all_its_lines(label: QLabel) -> bool:
    """A word-wrapped label is as tall as its text needs at its width (not squashed to a sliver)."""
    return label.height() >= label.heightForWidth(label.width()) - 1


def place(widget: QWidget) -> QRect:
    """``widget``'s rectangle in its window's coordinates."""
    return QRect(widget.mapTo(widget.window(), QPoint(0, 0)), widget.size())


def places(widgets: dict) -> dict:
    settle()
    return {name: place(w) for name, w in widgets.items()}


@pytest.fixture
def read_out(qtbot, window):
    window.resize(*SCREEN)
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.analysis is not None, window.inputs.error_label.text()
    return window


def test_qk_ov_results_neither_grow_the_window_nor_get_squashed(qtbot, read_out):
    window, panel = read_out, read_out.head_methods
    show_tab(window, window.attention_panel)
    assert window.attention_panel.select_head(0, 1)
    run_until_idle(qtbot, window, window.actions.run_qk_ov)
    assert panel.kind == "qk-ov", window.inputs.error_label.text()
    fits_the_screen(window)
    # the boxes keep their text: the weight and activation levels each get every line (scrolled to)
    for label in (panel.weight_text, panel.activation_text):
        assert label.text() and shows_all_its_lines(label), (label.height(), label.heightForWidth(label.width()))


def test_a_claim_steps_evidence_never_grows_the_window(qtbot, read_out):
    window, panel = read_out, read_out.validation_panel
    show_tab(window, panel)
    panel.subject_edit.setText("L1.H1")
    panel.claim_edit.setText("L1.H1 reads the colour of the shape asked about, at the answer position")
    panel.set_dataset("scenes")
    panel.n_spin.setValue(12)
    run_until_idle(qtbot, window, window.actions.run_claim)
    assert panel.validation is not None, window.inputs.error_label.text()
    fits_the_screen(window)
    for step in range(1, 8):  # histograms, the swap pairs, the paired comparisons, plain text
        assert panel.select_step(step)
        fits_the_screen(window)
        assert panel.details.text().startswith(f"step {step}:")


def test_long_messages_keep_the_window_and_its_controls_in_place(qtbot, read_out):
    """An error of several lines, a long status, a long session problem: one line each."""
    window = read_out
    controls = {
        "Answer": window.inputs.answer_button,
        "Read out": window.inputs.readout_button,
        "Cancel": window.inputs.cancel_button,
        "Target": window.inputs.target_edit,
        "foil": window.inputs.foil_edit,
        "Question": window.inputs.question_edit,
        "Model": window.inputs.model_picker,
    }
    before = places(controls)
    window.show_error(LONG)
    window.inputs.status_label.setText(LONG)
    window.sessions._show_session(LONG)
    assert places(controls) == before
    fits_the_screen(window)
    # the error line: one elided line, the whole message in its text and tooltip
    line = window.inputs.error_label
    assert line.text() == " ".join(LONG.split()) and line.toolTip() == line.text()
    assert "\n" not in line.shown_text() and line.fontMetrics().horizontalAdvance(line.shown_text()) <= line.width()
    window.show_error("")
    assert places(controls) == before


def test_counterfactual_and_intervention_controls_stay_under_the_cursor(qtbot, read_out):
    window = read_out
    panel, interventions = window.counterfactual_panel, window.intervention_panel
    show_tab(window, panel)
    controls = {
        "Run": panel.run_button,
        "sweep k": panel.sweep_k,
        "Occlusion sweep": panel.sweep_button,
        "ablation kind": interventions.kind_combo,
        "positions": interventions.positions_combo,
        "source": interventions.source_combo,
        "File…": interventions.source_button,
        "site": interventions.site_combo,
        "Ablate": interventions.ablate_button,
        "Patch": interventions.patch_button,
    }
    before = places(controls)
    for kind in ("mean", "resample", "zero", "mean"):  # mean's reference line used to push Ablate down
        interventions.set_kind(kind)
        assert places(controls) == before, kind
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[20:90, 10:100] = True
    panel.canvas.set_mask(mask)  # the region line grows
    panel.show_message(LONG, error=True)
    interventions.show_message(LONG, error=True)
    assert window.attention_panel.select_head(0, 1)  # the component line names the head
    assert places(controls) == before
    # the head actions in the Attention tab: the selected head's line never moves the buttons
    show_tab(window, window.attention_panel)
    head = window.head_methods
    buttons = {"Non-unique…": head.nonunique_button, "QK/OV": head.qk_ov_button}
    before = places(buttons)
    window.selection.select("L3.H3", "attention", window.analysis, note="a note " * 12)
    head.show_message(LONG, error=True)
    assert places(buttons) == before


def test_the_tab_bar_stays_put_whichever_tab_is_selected(qtbot, read_out):
    window = read_out
    tabs = window.tabs
    (bar,) = [
        b
        for b in window.findChildren(QTabBar)
        if b.isVisible() and [b.tabText(i) for i in range(b.count())] == [tabs.tabText(i) for i in range(tabs.count())]
    ]

    def tab_places() -> list[QRect]:
        settle()
        return [bar.tabRect(i).translated(bar.mapTo(window, QPoint(0, 0))) for i in range(bar.count())]

    before = tab_places()
    for i in range(tabs.count()):
        tabs.setCurrentIndex(i)
        assert tab_places() == before, tabs.tabText(i)
        assert bar.currentIndex() == i
    # a click on the bar selects the tab
    bar.setCurrentIndex(0)
    assert tabs.currentIndex() == 0


def test_the_occlusion_map_is_big_enough_to_read(qtbot, read_out):
    window = read_out
    panel = window.counterfactual_panel
    show_tab(window, panel)
    panel.sweep_k.setValue(2)
    run_until_idle(qtbot, window, panel.request_sweep)
    assert panel.sweep is not None, window.inputs.error_label.text()
    settle()
    canvas = panel.sweep_canvas
    assert canvas.isVisible() and on_screen(canvas.view).size() == canvas.view.size()
    drawn = canvas.image_item.sceneBoundingRect()  # the map as drawn, in the view's pixels
    assert min(drawn.width(), drawn.height()) >= 300, drawn
    fits_the_screen(window)
