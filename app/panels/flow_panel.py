"""The Flow tab: attention knockout over layer windows with rollout beside it, and
the activation-patching grid (docs/METHODS.md §4.12.6 and §4.12.7).

The panel never runs the model: Knock out and Patch grid emit
:attr:`FlowPanel.knockout_requested` / :attr:`FlowPanel.grid_requested`; the window
asks the panel for the request (:meth:`FlowPanel.knockout_request`,
:meth:`FlowPanel.grid_request`: a :class:`core.requests.KnockoutRequest` /
:class:`core.requests.PatchGridRequest`, or a :class:`app.panels.run_requests.Refusal`)
and runs it; the result joins the shown run, and the panel draws it from there
(:meth:`FlowPanel.draw`, kinds :data:`FLOW_KINDS`, a live and a restored run alike).

The knockout plots have the layers on the x-axis and the answer's logit difference
(its logit without a foil), then its probability, after the cut on the y-axis, one
curve per edge kind, the unedited run as a dashed line, the all-layers cut in the
legend and one window's width shaded; rollout's
reach is a plot of its own below, with each profile's correlation, said to be a
correlation of an approximation with an intervention. The grid is a heatmap of
blocks x position groups; a click on a cell shows that run's numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.panels.run_requests import IMAGE_FILTER, Refusal, RunningLine, read_source
from app.widgets import ElidedLabel, plain_label
from core.requests import KnockoutRequest, PatchGridRequest

if TYPE_CHECKING:
    from app.components import ShownRun

FLOW_KINDS = ("knockout", "patch-grid")  # the result kinds the panel draws (its view's, app.run_frame)
DEFAULT_EDGES = "image->answer,question->answer,image->question"
GRID_SITES = ("resid", "attn", "mlp")
NO_KNOCKOUT = "Knock out: cut every edge of each kind in a window of layers centred on each layer, and in all layers"
NO_GRID = "Patch grid: copy an activation from a source image at every layer x position group (0 = clean, 1 = source)"
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


class FlowPanel(QWidget):
    """Knockout profiles, rollout beside them, and the patching grid.

    Signals:
        knockout_requested(): knock out the edge kinds in the windows chosen.
        grid_requested(): patch the chosen site from the source image at every layer x group.
    """

    knockout_requested = Signal()
    grid_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.knockout = None  # the KnockoutResult drawn
        self.grid = None  # the PatchGrid drawn
        self.edges_edit = QLineEdit(DEFAULT_EDGES)
        self.edges_edit.setToolTip("SOURCE->TARGET, comma-separated: sources image, region (the painted one), question, "
                                   "text, word:W, last; targets answer, question, text, last, word:W")  # fmt: skip
        self.window_spin = QSpinBox()
        self.window_spin.setRange(1, 256)
        self.window_spin.setPrefix("window ")
        self.window_spin.setSuffix(" layer(s)")
        self.knockout_button = QPushButton("Knock out")
        self.knockout_button.clicked.connect(self.knockout_requested)
        self.source_edit = QLineEdit()
        self.source_edit.setPlaceholderText("source image (the same size): another scene, the object moved, …")
        self.browse_button = QPushButton("Source…")
        self.browse_button.clicked.connect(self._browse)
        self.site_box = QComboBox()
        self.site_box.addItems(GRID_SITES)
        self.grid_button = QPushButton("Patch grid")
        self.grid_button.clicked.connect(self.grid_requested)
        self.message_label = ElidedLabel(lines=2, selectable=True)
        self.running = RunningLine(self.show_message, self.message_label)

        self.knockout_title = plain_label(NO_KNOCKOUT, wrap=True, selectable=True)
        self.knockout_plot = pg.PlotWidget()
        self.knockout_plot.setMinimumHeight(160)
        self.knockout_plot.addLegend(offset=(5, 5))
        self.prob_plot = pg.PlotWidget()
        self.prob_plot.setMinimumHeight(110)
        self.prob_plot.setLabel("left", "p(answer) after the cut")
        self.rollout_plot = pg.PlotWidget()
        self.rollout_plot.setMinimumHeight(120)
        self.rollout_plot.setLabel("left", "rollout reach")
        for plot in (self.knockout_plot, self.prob_plot, self.rollout_plot):  # the numbers as they are, not scaled
            plot.getAxis("left").enableAutoSIPrefix(False)
        self.rollout_label = plain_label(wrap=True, selectable=True)
        self.grid_title = plain_label(NO_GRID, wrap=True, selectable=True)
        self.grid_plot = pg.PlotWidget()
        self.grid_plot.setMinimumHeight(160)
        self.grid_image = pg.ImageItem()
        self.grid_plot.addItem(self.grid_image)
        self.grid_image.setColorMap(pg.colormap.get("CET-D1"))
        self.grid_plot.scene().sigMouseClicked.connect(self._on_grid_click)
        self.cell_label = plain_label(wrap=True, selectable=True)

        knock_row = QHBoxLayout()
        knock_row.addWidget(self.edges_edit, 1)
        knock_row.addWidget(self.window_spin)
        knock_row.addWidget(self.knockout_button)
        grid_row = QHBoxLayout()
        grid_row.addWidget(self.source_edit, 1)
        grid_row.addWidget(self.browse_button)
        grid_row.addWidget(self.site_box)
        grid_row.addWidget(self.grid_button)
        layout = QVBoxLayout(self)
        layout.addLayout(knock_row)
        layout.addLayout(grid_row)
        layout.addWidget(self.message_label)
        for w in (self.knockout_title, self.knockout_plot, self.prob_plot, self.rollout_plot, self.rollout_label):
            layout.addWidget(w)
        for w in (self.grid_title, self.grid_plot, self.cell_label):
            layout.addWidget(w)

    # ---- requests (the window runs them) -------------------------------------

    def run_buttons(self) -> tuple[QPushButton, ...]:
        """The buttons that start a job (disabled while one runs)."""
        return self.knockout_button, self.grid_button, self.browse_button

    def set_busy(self, busy: bool) -> None:
        for button in self.run_buttons():
            button.setEnabled(not busy)

    def knockout_request(self, asked: dict, painted):
        """The knockout of the edge kinds typed (``painted()``: the painted region, the ``region``
        set), or a :class:`Refusal` saying why not."""
        import core

        edges = tuple(e.strip() for e in self.edges_edit.text().split(",") if e.strip())
        try:
            return KnockoutRequest(**asked, edges=edges, window=self.window_spin.value(), mask=painted_mask(painted))
        except core.ReadoutError as e:
            return Refusal(str(e))

    def grid_request(self, asked: dict, painted):
        """The patching grid from the source image chosen, or a :class:`Refusal` saying why not."""
        import core

        path = self.source_edit.text().strip()
        if not path:
            return Refusal("Patch grid: choose a source image (Source…)", lambda: bool(self.source_edit.text().strip()))
        source = read_source(path)
        if isinstance(source, Refusal):
            return source
        try:
            return PatchGridRequest(
                **asked,
                source_image=source,
                source_image_path=path,
                site=self.site_box.currentText(),
                mask=painted_mask(painted),
            )
        except core.ReadoutError as e:
            return Refusal(str(e))

    def show_running(self, request) -> None:
        """The "running: …" line of ``request`` (the panel's), until the job ends or its result is drawn."""
        self.running.show(f"running: {request.name}…")

    def end_running(self) -> None:
        """The job ended: its "running: …" line goes (a message shown since stays)."""
        self.running.end()

    def show_message(self, text: str, error: bool = False) -> None:
        self.message_label.setText(text)
        self.message_label.setStyleSheet("color: #b00020;" if error and text else "")

    # ---- drawing ---------------------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s knockout and patching grid (each cleared when the run has none)."""
        results = run.results if run is not None else {}
        self._draw_knockout(results.get("knockout"))
        self._draw_grid(results.get("patch-grid"))
        if kind in FLOW_KINDS:
            self.running.end()

    def _draw_knockout(self, result) -> None:
        self.knockout = result
        for plot in (self.knockout_plot, self.prob_plot, self.rollout_plot):
            plot.clear()
        if result is None:
            self.knockout_title.setText(NO_KNOCKOUT)
            self.rollout_label.setText("")
            return
        score, original = knockout_score(result.original)
        layers = result.layers
        axis = [list(enumerate(layers))]
        for plot in (self.knockout_plot, self.prob_plot, self.rollout_plot):
            plot.getAxis("bottom").setTicks(axis)
        self.knockout_plot.setLabel("left", f"{score} after the cut")
        dashed = pg.mkPen("#888", style=pg.QtCore.Qt.DashLine)
        self.knockout_plot.addItem(pg.InfiniteLine(original, angle=0, pen=dashed))
        self.prob_plot.addItem(pg.InfiniteLine(result.original.prob, angle=0, pen=dashed))
        # the window's width, shaded around the middle layer's window
        width = min(result.width, len(layers))
        start = max(0, min(len(layers) - width, (len(layers) - 1) // 2 - (width - 1) // 2))
        self.knockout_plot.addItem(pg.LinearRegionItem((start - 0.5, start + width - 0.5), movable=False))
        lines = []
        for i, profile in enumerate(result.profiles):
            colour = COLOURS[i % len(COLOURS)]
            xs, ys = self.profile_points(result, profile)
            every = profile.window("all")
            after = "" if every is None else f" (all layers: {knockout_score(every.edited)[1]:+.3f})"
            self.knockout_plot.plot(xs, ys, pen=pg.mkPen(colour, width=2), symbol="o", symbolBrush=colour,
                                    name=f"{profile.edge}{after}")  # fmt: skip
            probs = [profile.window(result.layers[x]).edited.prob for x in xs]
            self.prob_plot.plot(xs, probs, pen=pg.mkPen(colour, width=2), symbol="o", symbolBrush=colour)
            if profile.rollout_reach is not None:
                self.rollout_plot.plot(list(range(len(layers))), profile.rollout_reach, pen=pg.mkPen(colour, width=2))
                corr = profile.rollout_correlation
                lines.append(f"{profile.edge}: r = {'n/a' if corr is None else f'{corr:+.2f}'}")
        self.knockout_title.setText(
            f"knockout, window of {result.width} layer(s) centred on each layer; dashed: the unedited run "
            f"({score} {original:+.3f}, '{result.original.answer}')"
            + (" [cancelled]" if result.cancelled else "")
            + "".join(f"; {n}" for a in result.audit_records() for n in a.notes if n.startswith("not cut"))
        )
        self.rollout_label.setText(
            "rollout's reach from the source to the target through each layer, and its correlation with the "
            "knockout's drop over the layers (a structural approximation against an intervention, not a "
            "decomposition): " + ("; ".join(lines) or "not computed")
        )

    @staticmethod
    def profile_points(result, profile) -> tuple[list[int], list[float]]:
        """The plotted points of ``profile``: each single-layer-centred window's score after the cut."""
        xs, ys = [], []
        for i, layer in enumerate(result.layers):
            window = profile.window(layer)
            if window is not None:
                xs.append(i)
                ys.append(knockout_score(window.edited)[1])
        return xs, ys

    def _draw_grid(self, grid) -> None:
        self.grid = grid
        self.cell_label.setText("")
        if grid is None:
            self.grid_title.setText(NO_GRID)
            self.grid_image.clear()
            return
        values = np.array([[np.nan if v is None else v for v in row] for row in grid.metric], dtype=float)
        self.grid_image.setImage(values.T, levels=(-1.0, 1.0))  # x: the columns, y: the blocks
        self.grid_plot.getAxis("bottom").setTicks([[(c + 0.5, col.name) for c, col in enumerate(grid.columns)]])
        self.grid_plot.getAxis("left").setTicks([[(b + 0.5, name) for b, name in enumerate(grid.blocks)]])
        what = grid.site if grid.head is None else f"{grid.site} H{grid.head}"
        self.grid_title.setText(
            f"patch grid ({what}): (LD_patched - LD_clean) / (LD_source - LD_clean), LD = logit('{grid.clean.answer}')"
            f" - logit('{grid.clean.foil}'); clean {grid.clean.logit_diff:+.3f}, source {grid.source.logit_diff:+.3f}; "
            "click a cell for its numbers" + (" [cancelled]" if grid.cancelled else "")
        )

    def cell_text(self, block: int, column: int) -> str:
        """The numbers of one cell of the grid drawn."""
        grid = self.grid
        col = grid.columns[column]
        metric, ld = grid.metric[block][column], grid.logit_diff[block][column]
        if metric is None:
            return f"{grid.blocks[block]} x {col.name}: no position of this group in the text"
        return (
            f"{grid.blocks[block]} x {col.name} (positions {list(col.positions)[:8]}"
            f"{'…' if len(col.positions) > 8 else ''}): metric {metric:+.3f}, logit diff {ld:+.3f}"
        )

    def click_cell(self, block: int, column: int) -> None:
        if self.grid is not None and 0 <= block < len(self.grid.blocks) and 0 <= column < len(self.grid.columns):
            self.cell_label.setText(self.cell_text(block, column))

    def _on_grid_click(self, event) -> None:
        if self.grid is None:
            return
        point = self.grid_image.mapFromScene(event.scenePos())
        self.click_cell(int(np.floor(point.y())), int(np.floor(point.x())))

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Source image", "", IMAGE_FILTER)
        if path:
            self.source_edit.setText(path)


def painted_mask(painted):
    """``painted()``'s region, or None where nothing is painted."""
    mask = painted()
    return mask if mask is not None and mask.any() else None


def knockout_score(target) -> tuple[str, float]:
    """``(name, value)`` of what the knockout plot shows of a :class:`core.results.readout.Target`:
    its logit difference, or its logit without a foil."""
    if target.logit_diff is not None:
        return "logit diff", target.logit_diff
    return "logit", target.logit
