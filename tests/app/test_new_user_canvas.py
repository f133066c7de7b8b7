"""What the canvas and the Answer / Attention tabs say, as a new user met them (issue 28, part 5, H1):
nothing on the canvas belongs to another run; a cross-attention model's Answer tab says the image
enters through cross-attention; the token a map or header is about stays visible at 1280 px; every
head of a small model is labelled; the canvas's note wraps inside the canvas; empty tabs name the
window's real button. Driven through the window, offscreen.

(Its own file: these tests wait on worker signals, see tests/app/test_window.py's screenshot pitfall.)"""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetricsF, QImage, QPainter
from PySide6.QtWidgets import QApplication

from app.components.run_view import NOTHING_SHOWN
from app.components.workspace import answer_token_label
from app.run_frame import STALE_STYLE
from app.samples import bundled_samples
from core.analyze import AnalyzedModel, AnalyzeInput, AnalyzeResult
from core.methods.patterns import HeadSummary
from core.readouts.residual import ResidualSection
from core.results.readout import Target
from tests.app.test_canvas_views import llava_next_folder  # noqa: F401 (a fixture)
from tests.app.test_window import run_until_idle

TIMEOUT_MS = 60_000
SCREEN = (1280, 800)
READOUT_VIEWS = ("canvas", "answer", "attention", "dla", "lens")


@pytest.fixture
def coca_window(qtbot, tmp_path):
    """A shown MainWindow with a model cache of its own: shapes-coca loaded here is not served to
    later tests of the shared cache (tests/app/test_run_unit.py expects it not loaded)."""
    from app.main_window import MainWindow

    win = MainWindow(model_cache={}, session_path=tmp_path / "session.vlmr")
    win.show()
    qtbot.waitExposed(win)
    yield win
    win.close()
    assert win.runner.workers.running() == []


def settle(window) -> None:
    """Let the window lay itself out (a resize, a tab change) and paint."""
    for _ in range(3):
        QApplication.processEvents()
    window.grab()
    QApplication.processEvents()


def show_tab(window, title: str) -> None:
    tabs = window.tabs
    tabs.setCurrentIndex(next(i for i in range(tabs.count()) if tabs.tabText(i) == title))
    settle(window)


def drawn_tick_texts(axis) -> list[tuple[float, float, str]]:
    """``(left, right, text)`` of each tick label the axis draws, left to right (what pyqtgraph paints)."""
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return sorted((rect.left(), rect.right(), text) for rect, _, text in texts)


def readout(qtbot, window, spec: str) -> dict:
    """Read out with ``spec``; the shown analysis as its JSON."""
    window.inputs.model_picker.setCurrentText(spec)
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.analysis is not None, window.inputs.error_label.text()
    return window.analysis.to_dict()


# ----- 1. nothing on the canvas belongs to another run ------------------------------------------


def canvas_run_content(window) -> dict:
    """What the canvas shows of a run: its note, heatmap title and colour bar, grid cells, and the
    Counterfactual painter's note and grid (drawn from the same read-out)."""
    canvas, painter = window.canvas, window.counterfactual_panel.canvas
    return {
        "note": canvas.note_label.text() if canvas.note_label.isVisibleTo(canvas) else "",
        "heatmap title": canvas.heatmap_title.text(),
        "colour bar": canvas.colorbar.isVisible(),
        "cells": len(canvas.cells),
        "painter note": painter.note_label.text() if painter.note_label.isVisibleTo(painter) else "",
        "painter cells": len(painter.cells),
    }


def test_a_runs_canvas_note_and_heatmap_leave_with_the_run(qtbot, window, llava_next_folder):  # noqa: F811
    """A LLaVA-NeXT run's note ("2 views ... no patch") stayed on the canvas under "no run shown yet"
    after switching the model and opening another sample. The canvas follows the shown run as the
    other views do: stale together when the input moves on, empty together when nothing is shown,
    and a restored run brings back exactly its own note."""
    from tests.core.exactness import noise_image
    from tests.core.test_llava_next import IMAGE_SIZE, QUESTION

    window.inputs.model_picker.setCurrentText(llava_next_folder)
    assert window.set_image(noise_image(IMAGE_SIZE), name="noise")
    window.set_question(QUESTION)
    run_until_idle(qtbot, window, window.actions.run_readout)
    next_run = window.session.runs("analyze")[-1].id
    shown = canvas_run_content(window)
    assert "2 views of the image" in shown["note"] and "no patch" in shown["note"], shown
    assert shown["heatmap title"] and shown["colour bar"] and shown["cells"] and shown["painter cells"]
    assert shown["painter note"] == shown["note"]

    # another model picked: every read-out view, the canvas among them, says its run is stale
    window.inputs.model_picker.setCurrentText("shapes-llava")
    for view in READOUT_VIEWS:
        frame = window.run_frames[view]
        assert frame.stale and frame.header.styleSheet() == STALE_STYLE, view

    # another sample opened: nothing of the LLaVA-NeXT run is left, on the canvas or the painter
    assert window.load_sample(bundled_samples()[1])
    settle(window)
    assert window.run_frames["canvas"].header_text() == NOTHING_SHOWN
    assert canvas_run_content(window) == {
        "note": "",
        "heatmap title": "",
        "colour bar": False,
        "cells": 0,
        "painter note": "",
        "painter cells": 0,
    }

    run_until_idle(qtbot, window, window.actions.run_readout)  # shapes-llava: one plain patch grid, no note
    llava_run = window.session.runs("analyze")[-1].id
    plain = canvas_run_content(window)
    assert plain["note"] == plain["painter note"] == "" and plain["cells"] == 64

    # History: each run brings back its own note, and only its own
    assert window.sessions.restore_run(next_run)
    qtbot.waitUntil(lambda: not window.is_busy(), timeout=TIMEOUT_MS)
    assert canvas_run_content(window)["note"] == shown["note"]
    assert window.sessions.restore_run(llava_run)
    qtbot.waitUntil(lambda: not window.is_busy(), timeout=TIMEOUT_MS)
    assert canvas_run_content(window)["note"] == ""


# ----- 2. a cross-attention model's Answer tab ----------------------------------------------------


def patterns_cells(window) -> dict[str, list[str]]:
    """The Answer tab's answer-patterns table as shown: ``{column title: [cell texts]}``."""
    table = window.answer_panel.patterns.table
    return {
        table.horizontalHeaderItem(c).text(): [table.item(r, c).text() for r in range(table.rowCount())]
        for c in range(table.columnCount())
    }


def test_a_cross_attention_models_answer_tab_says_the_image_enters_through_cross_attention(qtbot, coca_window):
    """shapes-coca's Answer tab showed image 0.000 for the answer row (its self-attention blocks have
    no image keys) and listed only self-attention blocks, while the Attention tab shows its
    cross-attention blocks at 1.0 on the image: a reader concluded the answer ignores the image."""
    window = coca_window
    analysis = readout(qtbot, window, "shapes-coca")
    show_tab(window, "Answer")
    patterns = window.answer_panel.patterns
    cross = [row for row in analysis["attention"] if row["block"].endswith(".xattn")]
    cross_blocks = sorted({row["block"] for row in cross})
    assert cross_blocks == ["L0.xattn", "L1.xattn", "L2.xattn", "L3.xattn"]

    image = patterns_cells(window)["image"]
    assert image and all(text.startswith("n/a") for text in image), image  # not "0.000"
    said = patterns.cross_note.text()
    assert patterns.cross_note.isVisible() and "cross-attention" in said
    for block in cross_blocks:  # each cross block named with its image mass (the Attention tab's)
        mass = np.mean([row["visual_mass"] for row in cross if row["block"] == block])
        assert f"{block} {mass:.3f}" in said, said
    combo = patterns.block_combo
    items = [combo.itemText(i) for i in range(combo.count())]
    assert "self-attention" in items[0], items  # the mean is over the self-attention blocks only
    assert "self-attention" in patterns.title.text()
    for i in range(1, combo.count()):  # a single self-attention block: its image mass is n/a as well
        combo.setCurrentIndex(i)
        assert all(text.startswith("n/a") for text in patterns_cells(window)["image"])

    # a model with the image in its sequence: the image column is a number, no cross note
    analysis = readout(qtbot, window, "shapes-llava")
    image = patterns_cells(window)["image"]
    assert image == [f"{row['image_mass']:.3f}" for row in analysis["answer_patterns"]["rows"]]
    assert not patterns.cross_note.isVisible()


# ----- 3. the token a map and a header are about stays visible at 1280 px -----------------------


def test_the_token_read_stays_visible_in_the_canvas_header_and_heatmap_label(qtbot, window):
    """At 1280 px the heatmap label and the canvas header were cut before the token name: read out
    at an answer token, every read-out header and the canvas's heatmap label (title and colour bar)
    show which token, eliding the other parts first."""
    window.resize(*SCREEN)
    window.inputs.model_picker.setCurrentText("shapes-llava")
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.answer_panel.generate_button, Qt.MouseButton.LeftButton)
    k = len(window.answer_panel.token_buttons) - 1
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.answer_panel.token_buttons[k], Qt.MouseButton.LeftButton)
    assert window.inputs.error_label.text() == "", window.inputs.error_label.text()
    token = answer_token_label(window.workspace.input.answer_text)  # "answer token 2 'zero'"
    show_tab(window, "Attention")

    def visible(label) -> str:
        shown = label.shown_text()
        assert label.fontMetrics().horizontalAdvance(shown) <= label.contentsRect().width() + 1
        return shown

    for view in READOUT_VIEWS:
        frame = window.run_frames[view]
        if frame.isVisible():
            assert token in visible(frame.header), (view, frame.header.shown_text())
    canvas = window.canvas
    assert token in visible(canvas.heatmap_title), canvas.heatmap_title.shown_text()
    assert token in canvas.colorbar_label(), canvas.colorbar_label()
    # a head's map put on the canvas names the token too
    row = window.analysis.attention[5]
    assert window.attention_panel.select_head(row.layer, row.head)
    settle(window)
    assert f"{row.block}.H{row.head}" in canvas.heatmap_title.text()
    assert token in visible(canvas.heatmap_title) and token in canvas.colorbar_label()

    # stale: the header says so first, and still which token each input reads
    window.inputs.question_edit.setText(window.inputs.question_edit.text() + " and is it big?")
    settle(window)
    header = window.run_frames["canvas"].header
    shown = visible(header)
    assert shown.startswith("stale (question") and token in shown, shown


# ----- 4. head ticks --------------------------------------------------------------------------------


def test_every_head_of_a_small_model_is_labelled_on_the_attention_grids(qtbot, coca_window):
    """CoCa's head axis showed only H0 and H2: with four heads each is labelled (without overlap)."""
    window = coca_window
    analysis = readout(qtbot, window, "shapes-coca")
    window.resize(*SCREEN)
    show_tab(window, "Attention")
    heads = sorted({row["head"] for row in analysis["attention"]})
    assert heads == [0, 1, 2, 3]
    for grid in (window.attention_panel.visual_grid, window.attention_panel.sink_grid):
        drawn = drawn_tick_texts(grid.plot_item.getAxis("bottom"))
        assert [text.removeprefix("H") for *_, text in drawn] == [str(h) for h in heads], drawn
        assert all(a[1] <= b[0] for a, b in zip(drawn, drawn[1:])), drawn  # no two overlap


def test_many_heads_are_labelled_at_a_regular_step(qtbot, window):
    """Heads that cannot all be labelled are labelled at one regular step, none overlapping."""
    panel = window.attention_panel
    show_tab(window, "Attention")
    result = AnalyzeResult(
        model=AnalyzedModel.from_dict({"spec": "many heads"}),
        input=AnalyzeInput("", "", False, [], [], "", (0, 0), []),
        target=Target("x", 0, None, None, 0.0, None, 0.0, "x", 0, position=3),
        top=[],
        residual_decomposition=ResidualSection(0.0, 0.0, 0.0, []),
        logit_lens=[],
        tuned_lens=None,
        attention=[HeadSummary(0, h, "L0", 0.5, 0.1, 0.0, 0, []) for h in range(40)],
        rollout=None,
        text_patterns=None,
        audit=[],
    )
    panel.set_result(result)
    settle(window)
    drawn = drawn_tick_texts(panel.visual_grid.plot_item.getAxis("bottom"))
    numbers = [int(text.removeprefix("H")) for *_, text in drawn]
    assert 1 < len(numbers) < 40
    steps = {b - a for a, b in zip(numbers, numbers[1:])}
    assert len(steps) == 1 and numbers[0] % steps.pop() == 0, numbers  # H0, Hk, H2k, ... (H0 may not fit)
    assert all(a[1] <= b[0] for a, b in zip(drawn, drawn[1:])), drawn


# ----- 5. the canvas note wraps inside the canvas ---------------------------------------------------


def test_the_canvas_note_wraps_inside_the_canvas_and_never_grows_the_window(
    qtbot,
    window,
    llava_next_folder,  # noqa: F811
):
    """The LLaVA-NeXT note made the window grow past an 800-px screen: the note wraps at the canvas's
    width (every line shown, inside the canvas), adds nothing to the canvas's minimum width, and the
    window still fits 1280 x 800, also with the canvas dragged to its narrowest."""
    from tests.core.exactness import noise_image
    from tests.core.test_llava_next import IMAGE_SIZE, QUESTION

    canvas = window.canvas
    window.inputs.model_picker.setCurrentText(llava_next_folder)
    assert window.set_image(noise_image(IMAGE_SIZE), name="noise")
    window.set_question(QUESTION)
    run_until_idle(qtbot, window, window.actions.run_readout)
    note = canvas.note_label
    text = note.text()
    assert "views of the image" in text
    splitter = window.run_frames["canvas"].parentWidget()
    for canvas_width in (560, 1):  # as opened; dragged as narrow as it goes
        splitter.setSizes([canvas_width, sum(splitter.sizes()) - canvas_width])
        window.resize(*SCREEN)
        settle(window)
        assert (window.width(), window.height()) == SCREEN
        hint = window.minimumSizeHint()
        assert hint.width() <= SCREEN[0] and hint.height() <= SCREEN[1], hint
        assert note.isVisible()
        assert note.geometry().left() >= 0 and note.geometry().right() <= canvas.width(), (
            note.geometry(),
            canvas.width(),
        )
        assert note.height() >= note.heightForWidth(note.width())  # every wrapped line is shown
        metrics = QFontMetricsF(note.font())
        assert metrics.horizontalAdvance(text) > note.width()  # it did have to wrap
    with_note = canvas.minimumSizeHint()
    canvas.set_token_note("")
    without = canvas.minimumSizeHint()
    assert with_note.width() == without.width()  # the note's text never sets the canvas's width


# ----- 6. empty tabs name the window's button ---------------------------------------------------------


def test_empty_tabs_name_the_read_out_button(qtbot, window):
    """Empty tabs said "press Run" where the window's button is "Read out"."""
    button = window.inputs.readout_button.text()
    assert button == "Read out"
    window.workspace.clear_shown()
    texts = {
        "Attention": window.attention_panel.title.text(),
        "DLA": window.dla_panel.target_label.text(),
        "Lens": window.lens_panel.title.text(),
        "Answer": window.answer_panel.caption.text(),
        "Answer patterns": window.answer_panel.patterns.title.text(),
    }
    for tab, text in texts.items():
        assert f"press {button}" in text and "press Run" not in text, (tab, text)
    stats = window.attention_panel.stats_note.text()
    action = next(a for a in window.menuBar().actions() if a.text().replace("&", "") == "Run")
    names = [a.text().replace("&", "") for a in action.menu().actions()]
    assert any(name in stats for name in names), (stats, names)  # how to get a dataset distribution
