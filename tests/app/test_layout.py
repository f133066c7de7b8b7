"""Layout at the window sizes a user has (issue 13, item 8): the Counterfactual
controls are on screen beside the painted canvas, no title text is clipped or
set over other text, and a growing header never moves the window's splitter.

Each check was first seen on a screenshot (Xvfb, 1280 x 800 and 1920 x 1080);
these tests hold what the screenshots showed. Own file: they wait on worker
signals (see tests/app/conftest.py).
"""

from dataclasses import replace

import pytest
from PySide6.QtCore import QPoint, QRect, Qt
from PySide6.QtWidgets import QApplication, QLabel, QSplitter, QWidget

from app.panels.counterfactual_panel import CounterfactualPanel
from app.widgets import ElidedLabel

TIMEOUT_MS = 60_000
SIZES = [(1280, 800), (1400, 900), (1920, 1080)]


def show_tab(window, widget: QWidget) -> None:
    """Bring up the tab holding ``widget`` (a panel may sit inside a frame or scroll area)."""
    tabs = window.tabs
    index = next(i for i in range(tabs.count()) if tabs.widget(i) is widget or tabs.widget(i).isAncestorOf(widget))
    tabs.setCurrentIndex(index)
    QApplication.processEvents()


def on_screen(widget: QWidget) -> QRect:
    """The part of ``widget`` that is on screen, in window coordinates: its rectangle
    clipped by every parent (a scroll area's viewport, a splitter pane) and the window."""
    window = widget.window()
    if not widget.isVisible():
        return QRect()
    shown = QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
    parent = widget.parentWidget()
    while parent is not None and parent is not window:
        shown = shown.intersected(QRect(parent.mapTo(window, QPoint(0, 0)), parent.size()))
        parent = parent.parentWidget()
    return shown.intersected(window.rect())


def fully_visible(widget: QWidget) -> bool:
    shown = on_screen(widget)
    return not shown.isEmpty() and shown.size() == widget.size()


@pytest.fixture
def read_out(qtbot, window):
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.actions.run_readout()
    assert window.analysis is not None, window.inputs.error_label.text()
    return window


@pytest.mark.parametrize("size", SIZES)
def test_counterfactual_controls_are_beside_the_painter(qtbot, read_out, size):
    window = read_out
    window.resize(*size)
    panel = window.counterfactual_panel
    show_tab(window, panel)
    qtbot.waitUntil(lambda: panel.canvas.isVisible())
    QApplication.processEvents()
    controls = {
        "Fill": panel.fill_combo,
        "Run": panel.run_button,
        "sweep k": panel.sweep_k,
        "Occlusion sweep": panel.sweep_button,
        "Brush": panel.tool_buttons["brush"],
        "Undo": panel.undo_button,
        "Ablate": window.intervention_panel.ablate_button,
        "Patch": window.intervention_panel.patch_button,
        "ablation kind": window.intervention_panel.kind_combo,
        "patch site": window.intervention_panel.site_combo,
    }
    hidden = [name for name, widget in controls.items() if not fully_visible(widget)]
    assert not hidden, f"{size}: {hidden} are not on screen"
    canvas = panel.canvas.view
    assert fully_visible(canvas) and min(canvas.width(), canvas.height()) >= 200  # the painter, whole, at once


def test_counterfactual_panel_fits_any_scroll_area(qtbot):
    """The panel's preferred height is its minimum: a scroll area around it (the
    window's tab) sizes it to the viewport instead of to its tallest preferred child."""
    panel = CounterfactualPanel()
    qtbot.addWidget(panel)
    assert panel.sizeHint().height() == panel.minimumSizeHint().height() <= 480
    assert not panel.hasHeightForWidth()
    assert panel.minimumSizeHint().width() <= 1000  # fits the tab at 1280 wide (the canvas is hidden there)


def clipped_labels(root: QWidget) -> list[str]:
    """The shown one-line labels under ``root`` whose text is wider than the label."""
    out = []
    for label in root.findChildren(QLabel):
        if not label.isVisible() or label.wordWrap() or not label.text():
            continue
        text = label.shown_text() if isinstance(label, ElidedLabel) else label.text()
        if "\n" in text or label.textFormat() == Qt.TextFormat.RichText:  # a legend: wraps on its own
            continue
        if label.fontMetrics().horizontalAdvance(text) > label.contentsRect().width() + 1:
            out.append(f"{type(label.parentWidget()).__name__}: {text!r}")
    return out


@pytest.mark.parametrize("size", [(1280, 800), (1920, 1080)])
def test_no_clipped_titles_in_any_tab(qtbot, read_out, size):
    window = read_out
    window.resize(*size)
    panels = [window.attention_panel, window.dla_panel, window.lens_panel, window.counterfactual_panel]
    for panel in [*panels, window.audit_panel]:
        show_tab(window, panel)
        qtbot.waitUntil(panel.isVisible)
        roots = [panel] + ([window.canvas] if window.canvas.isVisible() else [])
        for root in roots:
            assert not clipped_labels(root), (size, clipped_labels(root))
    # the plot titles are elided to their plot, not centred and cut at both ends
    dla = window.dla_panel
    show_tab(window, dla)
    for plot in (dla.source_grid.plot_item, window.attention_panel.patch_map.plot_item):
        label = plot.titleLabel
        centre = label.pos().x() + label.width() / 2
        room = 2 * min(centre, plot.width() - centre)
        if plot.isVisible():
            assert label.item.boundingRect().width() <= room + 1, label.text


def test_a_growing_header_does_not_move_the_splitter(qtbot, read_out):
    """A long model spec or answer in a panel's title wraps or elides; it never sets
    the panel's minimum width, so the window's canvas | tabs splitter stays put."""
    window = read_out
    window.resize(1280, 800)
    splitter = window.tabs.parentWidget()
    while not isinstance(splitter, QSplitter):
        splitter = splitter.parentWidget()
    shown = window.analysis
    long = replace(
        shown,
        model=replace(shown.model, spec="/home/someone/models/" + "a-very-long-model-folder-name/" * 8),
        target=replace(shown.target, answer="an answer token that is long " * 4),
    )
    for panel in (window.attention_panel, window.dla_panel, window.lens_panel):
        show_tab(window, panel)
        before = splitter.sizes()
        panel.set_result(long)
        QApplication.processEvents()
        assert splitter.sizes() == before, type(panel).__name__
        assert panel.minimumSizeHint().width() < 700
    dla = window.dla_panel
    before = splitter.sizes()
    dla.select_component("L1.H1")  # the sources button names the head
    QApplication.processEvents()
    assert splitter.sizes() == before
    show_tab(window, window.attention_panel)
    before = splitter.sizes()
    window.canvas.set_heatmap(window.canvas.values, label="a long heatmap label, " * 20)
    QApplication.processEvents()
    assert splitter.sizes() == before
