"""Attention panel: the answer position's attention, layer x head.

Two heat grids side by side, one cell per (block, head): the mass on the
visual tokens and, separately, the mass on BOS / the sink (never folded into
the visual mass). Clicking a cell selects that head: :attr:`AttentionPanel.head_selected`
fires with ``(layer, head)`` (``layer`` is the block index of the analyze JSON)
and the panel shows the head's entropy, argmax source, other mass and its
patch map (patch-granular, not interpolated). The panel draws itself from the run it is
shown for (:meth:`AttentionPanel.draw`, the protocol of :class:`app.run_frame.RunFrame`).
Under the grids, the selected
head's text-side pattern: question token x question token (queries as rows,
keys as columns, from the analyze JSON's ``text_patterns``), with the mass each
row put on image / BOS / special keys stated beside it, since those keys are not
drawn. A second tab shows per-head distributions over a dataset run
(:class:`core.methods.patterns.PatternStatistics`, the ``statistics`` run kind) as box plots.

:class:`HeatGrid` and :func:`token_grid` are shared with the other panels; the
plain widgets (:func:`~app.widgets.plain_label`, :func:`~app.widgets.stacked`,
:func:`~app.widgets.style_plot`, :func:`~app.widgets.set_title`) are in
:mod:`app.widgets`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFontDatabase, QFontMetricsF, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QGraphicsRectItem,
    QHBoxLayout,
    QSizePolicy,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.panels import NO_ANALYSIS, READ_OUT, analysis_of
from app.widgets import (
    FOREGROUND,
    axis_font,
    box,
    plain_label,
    set_title,
    split,
    stacked,
    style_plot,
    tick_step,
)
from core.methods.patterns import display_token

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult
    from core.forward.geometry import VisualToken
    from core.methods.patterns import HeadStatistics, HeadSummary, PatternStatistics

MASS_MAP = "viridis"
SINK_MAP = "CET-L12"  # light to dark blue: the sink grid never looks like the visual grid
SIGNED_MAP = "CET-D1"  # blue - white - red, for signed values
MAX_ANNOTATED_CELLS = 256  # cells get their value written in them up to this many


NO_STATISTICS = "no dataset run yet: Run > Attention statistics over the samples"  # the window's menu action
NO_TEXT_HEAD = "click a head to see its text-side pattern (question tokens x question tokens)"
ROLE_NAMES = {
    "sink": "BOS",
    "visual": "image",
    "visual_delimiter": "image delimiters",
    "visual_global": "image CLS",
    "special": "special",
    "text": "earlier text",
}


def describe_hidden_mass(labels: Sequence[str], other: dict[str, np.ndarray], n_text_dropped: int = 0) -> str:
    """One line: the mass each query row put on keys the text-side heatmap does
    not show (image, BOS, special tokens), so rows that do not sum to 1 are explained."""
    if not other:
        return "every key is shown: each row sums to 1"
    total = sum(other.values())
    per_role = ", ".join(f"{ROLE_NAMES.get(r, r)} {float(v.mean()):.2f}" for r, v in sorted(other.items()))
    # a no-break space keeps each token with its value when the line wraps
    rows = "  ".join(f"{label}\u00a0{float(m):.2f}" for label, m in zip(labels, total, strict=True))
    kinds = " / ".join(ROLE_NAMES.get(r, r) for r in sorted(other))
    line = (
        f"not shown: mass on {kinds} keys, per query row: {rows}  "
        f"(row mean {float(total.mean()):.2f}: {per_role}); with it every row sums to 1"
    )
    if n_text_dropped:
        line += f"; {n_text_dropped} earlier text tokens are left out (their mass counts as earlier text)"
    return line


def block_names(result: AnalyzeResult | None) -> dict[int, str]:
    """``{block index: block name}`` of an analyze result's attention rows (``{}`` for None)."""
    return result.block_names if result is not None else {}


def is_cross_block(name: str) -> bool:
    """Whether a block is a cross-attention block (the adapters name them ``L{l}.xattn``)."""
    return name.endswith(".xattn")


def token_grid(values: Sequence[float], visual_tokens: Sequence[VisualToken], image: int | None = None) -> np.ndarray:
    """Per-visual-token values laid onto one image's patch grid.

    Args:
        values: ``(n_visual_tokens,)``, in the order of ``result.input.visual_tokens``.
        visual_tokens: the analyze result's visual tokens.
        image: which image's grid; default the image with the most patch tokens.

    Returns:
        ``(rows, cols)`` float array; cells no token covers are NaN. Tokens
        without a patch (``col < 0``: newline, CLS) are left out.
    """
    values = np.asarray(values, dtype=float).ravel()
    if len(values) != len(visual_tokens):
        raise ValueError(f"{len(values)} values for {len(visual_tokens)} visual tokens")
    patches = [(k, t) for k, t in enumerate(visual_tokens) if t.col >= 0]
    if not patches:
        return np.full((0, 0), np.nan)
    if image is None:
        counts: dict[int, int] = {}
        for _, t in patches:
            counts[t.image] = counts.get(t.image, 0) + 1
        image = max(sorted(counts), key=lambda im: counts[im])
    mine = [(k, t) for k, t in patches if t.image == image]
    rows = max(t.row for _, t in mine) + 1
    cols = max(t.col for _, t in mine) + 1
    grid = np.full((rows, cols), np.nan)
    for k, t in mine:
        grid[t.row, t.col] = values[k]
    return grid


class HeatGrid(pg.PlotWidget):
    """A labelled heat grid (row-major): cell ``(r, c)`` covers ``[c, c+1] x [r, r+1]``,
    row 0 at the top, with a colour bar, optional values written in the cells,
    a hover tooltip and a click that emits :attr:`cell_clicked` ``(row, col)``."""

    cell_clicked = Signal(int, int)

    def __init__(self, title: str = "", *, color_map: str = MASS_MAP, annotate: bool = True, parent=None):
        super().__init__(parent=parent, background="w")
        self.plot_item = self.getPlotItem()
        style_plot(self.plot_item)
        self.empty_title = title  # the title while no selection's grid is shown (clear() returns to it)
        set_title(self.plot_item, title)
        self.plot_item.setMenuEnabled(False)
        self.plot_item.hideButtons()
        self.plot_item.getViewBox().invertY(True)
        self.plot_item.getViewBox().setMouseEnabled(False, False)
        self.image_item = pg.ImageItem(axisOrder="row-major")
        self.plot_item.addItem(self.image_item)
        self.color_map = pg.colormap.get(color_map)
        self.color_bar = pg.ColorBarItem(
            values=(0, 1), colorMap=self.color_map, interactive=False, width=12, pen=FOREGROUND
        )
        self.color_bar.setImageItem(self.image_item, insert_in=self.plot_item)
        self.color_bar.axis.setPen(pg.mkPen(FOREGROUND))
        self.color_bar.axis.setTextPen(pg.mkPen(FOREGROUND))
        self.annotate = annotate
        self.values = np.zeros((0, 0))
        self.row_labels: list[str] = []
        self.col_labels: list[str] = []
        self.col_ticks: list[str] | None = None  # shorter column tick labels, used where the labels do not fit
        self.value_format = "{:.2f}"
        self._texts: list[pg.TextItem] = []
        self._highlight = QGraphicsRectItem(0, 0, 1, 1)
        pen = QPen(QColor("#ff2020"))
        pen.setWidthF(3)
        pen.setCosmetic(True)
        self._highlight.setPen(pen)
        self._highlight.setZValue(20)
        self._highlight.hide()
        self.plot_item.getViewBox().addItem(self._highlight)
        self.scene().sigMouseClicked.connect(self._on_click)
        self.scene().sigMouseMoved.connect(self._on_move)
        self.plot_item.getViewBox().sigResized.connect(self._fit_texts)
        self.plot_item.getViewBox().sigResized.connect(lambda *_: self._set_ticks(*self.values.shape))
        self.setMinimumSize(160, 140)

    def set_grid(
        self,
        values: np.ndarray,
        row_labels: Sequence[str] | None = None,
        col_labels: Sequence[str] | None = None,
        *,
        levels: tuple[float, float] | None = None,
        value_format: str = "{:.2f}",
        col_ticks: Sequence[str] | None = None,
    ) -> None:
        """Show ``values (rows, cols)``; NaN cells stay empty. ``levels`` default
        to the data range (symmetric about 0 for a signed colour map). ``col_ticks``:
        shorter column tick labels (``0 1 2 3`` under an axis titled "head" for
        ``H0 H1 H2 H3``), shown where they label more columns than ``col_labels`` would;
        the hover tooltip keeps ``col_labels``."""
        values = np.asarray(values, dtype=float)
        if values.ndim != 2:
            raise ValueError(f"a heat grid needs (rows, cols) values, got shape {values.shape}")
        self.values = values
        rows, cols = values.shape
        self.row_labels = list(row_labels) if row_labels is not None else [str(r) for r in range(rows)]
        self.col_labels = list(col_labels) if col_labels is not None else [str(c) for c in range(cols)]
        self.col_ticks = list(col_ticks) if col_ticks is not None else None
        self.value_format = value_format
        finite = values[np.isfinite(values)]
        if levels is None:
            if finite.size == 0:
                levels = (0.0, 1.0)
            elif self.color_map.name.startswith("CET-D"):
                m = float(np.abs(finite).max()) or 1.0
                levels = (-m, m)
            else:
                lo, hi = float(finite.min()), float(finite.max())
                levels = (lo, hi if hi > lo else lo + 1.0)
        if values.size:
            self.image_item.setImage(values, autoLevels=False)
            self.image_item.setRect(QRectF(0, 0, cols, rows))
        else:
            self.image_item.clear()
        self.color_bar.setLevels(levels)
        self._set_ticks(rows, cols)
        self._write_values(levels)
        self.plot_item.getViewBox().setRange(xRange=(0, max(cols, 1)), yRange=(0, max(rows, 1)), padding=0.02)
        self._highlight.hide()

    def clear_grid(self) -> None:
        """No grid, and the title it was built with (not the last selection's). (Not ``clear``:
        pg.PlotWidget binds that name to its plot item's, which removes every item.)"""
        self.set_grid(np.zeros((0, 0)))
        set_title(self.plot_item, self.empty_title, "10pt")

    def _set_ticks(self, rows: int, cols: int) -> None:
        """Every k-th row and column label, as many as fit without overlapping (a 24 x 24
        patch grid in a narrow plot labels every 4th; CoCa's four heads all, as their short
        ticks where ``H0``..``H3`` do not fit); refitted on resize."""
        rect = self.plot_item.getViewBox().sceneBoundingRect()
        if not self.isVisible():  # not laid out yet: every label, refitted on resize
            rect = QRectF()
        for name, labels, short, n, room, vertical in (
            ("left", self.row_labels, None, rows, rect.height(), True),
            ("bottom", self.col_labels, self.col_ticks, cols, rect.width(), False),
        ):
            axis = self.plot_item.getAxis(name)
            step = tick_step(labels[:n], room, axis_font(axis), vertical=vertical)
            if step > 1 and short:
                short_step = tick_step(short[:n], room, axis_font(axis), vertical=vertical)
                if short_step < step:
                    labels, step = short, short_step
            axis.setTicks([[(i + 0.5, labels[i]) for i in range(0, n, step)]])

    def _write_values(self, levels: tuple[float, float]) -> None:
        cells = []
        rows, cols = self.values.shape
        if self.annotate and rows * cols <= MAX_ANNOTATED_CELLS:
            cells = [(r, c) for r in range(rows) for c in range(cols) if np.isfinite(self.values[r, c])]
        # The text items are reused from one grid to the next: adding items to a view box
        # is what made a re-run slow (every panel's grids are rewritten on each read-out).
        view = self.plot_item.getViewBox()
        while len(self._texts) > len(cells):
            view.removeItem(self._texts.pop())
        while len(self._texts) < len(cells):
            text = pg.TextItem("", anchor=(0.5, 0.5))
            view.addItem(text)
            self._texts.append(text)
        lo, hi = levels
        for text, (r, c) in zip(self._texts, cells, strict=True):
            v = self.values[r, c]
            rgba = self.color_map.map((v - lo) / (hi - lo) if hi > lo else 0.5, mode="float")
            light = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
            text.setText(self.value_format.format(v), color="k" if light > 0.55 else "w")
            text.setPos(c + 0.5, r + 0.5)
        self._fit_texts()

    def _fit_texts(self, *_args) -> None:
        """Cell values are written only while a cell is wide and tall enough to hold them."""
        if not self._texts:
            return
        rows, cols = self.values.shape
        rect = self.plot_item.getViewBox().sceneBoundingRect()
        fits = rect.width() / max(cols, 1) >= 38 and rect.height() / max(rows, 1) >= 16
        for t in self._texts:
            t.setVisible(fits)

    def highlight(self, row: int | None, col: int | None = None) -> None:
        """Outline one cell (None hides the outline)."""
        if row is None or col is None:
            self._highlight.hide()
            return
        self._highlight.setRect(QRectF(col, row, 1, 1))
        self._highlight.show()

    def cell_at(self, scene_pos: QPointF) -> tuple[int, int] | None:
        """The ``(row, col)`` under a scene position, or None."""
        vb = self.plot_item.getViewBox()
        if not vb.sceneBoundingRect().contains(scene_pos):
            return None
        p = vb.mapSceneToView(scene_pos)
        r, c = math.floor(p.y()), math.floor(p.x())
        rows, cols = self.values.shape
        if 0 <= r < rows and 0 <= c < cols:
            return r, c
        return None

    def cell_center(self, row: int, col: int) -> QPoint:
        """Widget (viewport) coordinates of a cell's centre, e.g. for a test click."""
        scene = self.plot_item.getViewBox().mapViewToScene(QPointF(col + 0.5, row + 0.5))
        return self.mapFromScene(scene)

    def _on_click(self, event) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        cell = self.cell_at(event.scenePos())
        if cell is not None:
            self.cell_clicked.emit(*cell)

    def _on_move(self, scene_pos) -> None:
        cell = self.cell_at(scene_pos)
        if cell is None:
            self.setToolTip("")
            return
        r, c = cell
        v = self.values[r, c]
        shown = self.value_format.format(v) if np.isfinite(v) else "—"
        self.setToolTip(f"{self.row_labels[r]}  {self.col_labels[c]}: {shown}")


class TokenGrid(HeatGrid):
    """A :class:`HeatGrid` with token strings on both axes. A column label that
    would overlap its neighbour moves to a second line; a label is left out only
    when neither line has room (the hover tooltip still names every cell).
    Refitted on resize."""

    def _set_ticks(self, rows: int, cols: int) -> None:
        self._fit_labels()

    def _fit_labels(self, *_args) -> None:
        rows, cols = self.values.shape
        rect = self.plot_item.getViewBox().sceneBoundingRect()
        metrics = QFontMetricsF(self.font())
        if rect.width() <= 0 or rect.height() <= 0:  # not laid out yet: every label, refitted on resize
            bottom = [(c + 0.5, self.col_labels[c]) for c in range(cols)]
            left = [(r + 0.5, self.row_labels[r]) for r in range(rows)]
        else:
            cell_width, cell_height = rect.width() / max(cols, 1), rect.height() / max(rows, 1)
            right_edge = [-math.inf, -math.inf]  # where the last label on each line ends, in pixels
            bottom = []
            for c in range(cols):
                half = metrics.horizontalAdvance(self.col_labels[c]) / 2 + 3
                centre = (c + 0.5) * cell_width
                line = next((i for i in (0, 1) if centre - half >= right_edge[i]), None)
                if line is None:
                    continue
                right_edge[line] = centre + half
                bottom.append((c + 0.5, "\n" * line + self.col_labels[c]))
            row_step = max(1, math.ceil(0.85 * metrics.height() / cell_height))  # pyqtgraph packs rows at 0.8 height
            left = [(r + 0.5, self.row_labels[r]) for r in range(0, rows, row_step)]
        self.plot_item.getAxis("bottom").setTicks([bottom])
        self.plot_item.getAxis("left").setTicks([left])


class BoxPlot(pg.PlotWidget):
    """Quantile boxes: a box from q25 to q75, whiskers to q05 and q95, a median line."""

    def __init__(self, parent=None):
        super().__init__(parent=parent, background="w")
        self.plot_item = self.getPlotItem()
        style_plot(self.plot_item)
        self.plot_item.setMenuEnabled(False)
        self.plot_item.showGrid(y=True, alpha=0.25)
        self.plot_item.getAxis("left").enableAutoSIPrefix(False)  # masses as they are, not "300 (x0.001)"
        self.boxes = pg.BarGraphItem(x=[], y0=[], height=[], width=0.6, brush="#8fb3e0", pen=FOREGROUND)
        self.whiskers = pg.PlotDataItem(pen=pg.mkPen(FOREGROUND, width=1), connect="pairs")
        self.medians = pg.PlotDataItem(pen=pg.mkPen("#d02020", width=2), connect="pairs")
        self.chance = pg.InfiniteLine(angle=0, pen=pg.mkPen("#d02020", width=1, style=Qt.PenStyle.DashLine))
        for item in (self.boxes, self.whiskers, self.medians, self.chance):
            self.plot_item.addItem(item)
        self.chance.hide()
        self.labels: list[str] = []
        view = self.plot_item.getViewBox()
        view.sigResized.connect(self._fit_ticks)
        view.sigXRangeChanged.connect(self._fit_ticks)

    def set_boxes(self, labels: Sequence[str], quantiles: Sequence[dict | None], *, y_label: str = "") -> None:
        """``quantiles[i]``: ``{"0.05", "0.25", "0.5", "0.75", "0.95"}`` (None: no data)."""
        xs, lo, hi, wx, wy, mx, my = [], [], [], [], [], [], []
        for i, q in enumerate(quantiles):
            if not q:
                continue
            q05, q25, q50, q75, q95 = (float(q[k]) for k in ("0.05", "0.25", "0.5", "0.75", "0.95"))
            xs.append(i)
            lo.append(q25)
            hi.append(q75 - q25)
            wx += [i, i, i, i]
            wy += [q05, q25, q75, q95]
            mx += [i - 0.3, i + 0.3]
            my += [q50, q50]
        self.boxes.setOpts(x=xs, y0=lo, height=hi, width=0.6)
        self.whiskers.setData(wx, wy)
        self.medians.setData(mx, my)
        self.chance.hide()
        self._ticks(labels)
        self.plot_item.setLabel("left", y_label)
        self.plot_item.getViewBox().autoRange()

    def set_bars(self, labels: Sequence[str], values: Sequence[float | None], *, chance: float | None, y_label: str):
        """Plain bars (a hit rate per head) with an optional dashed chance line."""
        xs = [i for i, v in enumerate(values) if v is not None]
        self.boxes.setOpts(x=xs, y0=[0.0] * len(xs), height=[values[i] for i in xs], width=0.6)
        self.whiskers.setData([], [])
        self.medians.setData([], [])
        if chance is not None:
            self.chance.setValue(chance)
            self.chance.show()
        else:
            self.chance.hide()
        self._ticks(labels)
        self.plot_item.setLabel("left", y_label)
        self.plot_item.getViewBox().autoRange()

    def _ticks(self, labels: Sequence[str]) -> None:
        self.labels = list(labels)
        self._fit_ticks()

    def _fit_ticks(self, *_args) -> None:
        """Every k-th head name under the boxes, as many as fit without overlapping."""
        view = self.plot_item.getViewBox()
        (x0, x1), _ = view.viewRange()
        shown = self.isVisible() and x1 > x0  # not laid out yet: every label, refitted on resize
        room = view.sceneBoundingRect().width() * len(self.labels) / (x1 - x0) if shown else 0.0
        axis = self.plot_item.getAxis("bottom")
        step = tick_step(self.labels, room, axis_font(axis))
        axis.setTicks([[(i, self.labels[i]) for i in range(0, len(self.labels), step)]])


# the metric shown -> (the HeadStatistics attribute it reads, the axis label)
STAT_METRICS = {
    "visual mass": ("visual_mass", "mass on visual tokens"),
    "BOS / sink mass": ("sink_mass", "mass on BOS / sink"),
    "target-region mass": ("region_mass", "mass on the target region"),
    "entropy": ("entropy", "entropy (nats)"),
    "hit rate": ("hit_rate", "argmax in target region (share)"),
}


class AttentionPanel(QWidget):
    """Layer x head attention of the answer position.

    Drawn with :meth:`draw` (the run's analyze result; :meth:`set_result` draws one
    result) and, for a dataset run, :meth:`set_statistics`. Select a head with a click or
    :meth:`select_head`.

    Signals:
        head_selected(layer, head): a cell was clicked (``layer`` = block index).
    """

    head_selected = Signal(int, int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.run: ShownRun | None = None  # the run drawn (draw)
        self.result: AnalyzeResult | None = None
        self.statistics: list[HeadStatistics] = []  # by block, then head
        self.n_samples: int | None = None
        self.layers: list[int] = []  # grid row -> block index
        self.heads: list[int] = []  # grid col -> head index
        self.cells: dict[tuple[int, int], HeadSummary] = {}  # (layer, head) -> attention row
        self.selected: tuple[int, int] | None = None

        # wraps: a long model spec never widens the panel (the window's splitter would jump)
        self.title = plain_label(NO_ANALYSIS, wrap=True, selectable=True)
        self.visual_grid = HeatGrid("mass on visual tokens")
        self.sink_grid = HeatGrid("BOS / sink mass (separate)", color_map=SINK_MAP)
        self.patch_map = HeatGrid("selected head: patch map", annotate=False)
        self.patch_map.setMinimumWidth(200)
        self.details = plain_label("click a cell to select a head", wrap=True, selectable=True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)
        self.visual_grid.cell_clicked.connect(self._on_cell)
        self.sink_grid.cell_clicked.connect(self._on_cell)

        self.details.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text_grid = TokenGrid("selected head: text-side pattern")
        self.text_grid.setMinimumSize(240, 200)
        self.text_note = plain_label(NO_TEXT_HEAD, wrap=True, selectable=True)
        self.text_note.setStyleSheet("color: #404040;")
        self.side = side = stacked((self.patch_map, 3), (self.details, 2))
        head_grids = split(Qt.Orientation.Horizontal, self.visual_grid, self.sink_grid)
        text_side = stacked((self.text_grid, 1), (self.text_note, 0))
        grids = split(Qt.Orientation.Vertical, head_grids, text_side, sizes=[340, 420])
        this_input = split(Qt.Orientation.Horizontal, grids, side, sizes=[760, 420])

        self.metric_combo = QComboBox()
        self.metric_combo.addItems(list(STAT_METRICS))
        self.metric_combo.currentTextChanged.connect(self._draw_statistics)
        self.stats_note = plain_label(NO_STATISTICS, wrap=True, selectable=True)
        self.box_plot = BoxPlot()
        metric_row = box(
            QHBoxLayout(),
            plain_label("per-head distribution over samples:", selectable=True),
            self.metric_combo,
            end_stretch=True,
        )
        dataset = stacked(metric_row, (self.box_plot, 1), self.stats_note)

        self.tabs = QTabWidget()
        self.tabs.addTab(this_input, "this input")
        self.tabs.addTab(dataset, "dataset distribution")
        self.tabs.setTabEnabled(1, False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.title)
        layout.addWidget(self.tabs, 1)

    def add_side(self, widget: QWidget) -> None:
        """Put ``widget`` under the selected head's details (the window's actions on the head)."""
        self.side.layout().addWidget(widget, 2)

    # ---- data in ----------------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s analyze result (live or restored alike); None clears. A new run is new
        content, yet the head selected before stays selected where the new result has it (the
        same head read at another token, or restored), without :attr:`head_selected`."""
        self.run = run
        self.set_result(analysis_of(run))

    def set_result(self, result: AnalyzeResult | None) -> None:
        """Show an analyze result (None clears). Keeps the selected head if it still exists."""
        self.result = result
        self.cells = {(a.layer, a.head): a for a in result.attention} if result is not None else {}
        names = block_names(result)
        self.layers = sorted(names)
        self.heads = sorted({h for _, h in self.cells})
        vis = np.full((len(self.layers), len(self.heads)), np.nan)
        sink = np.full_like(vis, np.nan)
        for (layer, head), a in self.cells.items():
            r, c = self.layers.index(layer), self.heads.index(head)
            vis[r, c] = a.visual_mass
            sink[r, c] = a.bos_mass
        row_labels = [names[layer] for layer in self.layers]
        col_labels = [f"H{h}" for h in self.heads]
        head_ticks = [str(h) for h in self.heads]  # under the axis titled "head" where "H0".. do not fit
        self.visual_grid.set_grid(vis, row_labels, col_labels, levels=(0.0, 1.0), col_ticks=head_ticks)
        self.sink_grid.set_grid(sink, row_labels, col_labels, levels=(0.0, 1.0), col_ticks=head_ticks)
        for grid in (self.visual_grid, self.sink_grid):
            grid.plot_item.setLabel("left", "block")
            grid.plot_item.setLabel("bottom", "head")
        if result is not None:
            undefined = result.undefined("pattern analysis")  # a hybrid decoder's layers without pattern
            self.title.setText(
                f"{result.model.spec or '?'}: attention of the answer position {result.target.position} "
                f"(answer {result.target.answer!r}); {len(self.layers)} blocks x {len(self.heads)} heads"
                + (f"; {undefined}" if undefined else "")
            )
        else:
            self.title.setText(NO_ANALYSIS)
        previous = self.selected
        self.selected = None
        if previous in self.cells:
            self.select_head(*previous, emit=False)
        else:
            self.details.setText("click a cell to select a head")
            self.patch_map.clear_grid()  # no "L1.H1: per patch" over an empty map
            self._show_text_pattern(None)

    def set_statistics(self, statistics: PatternStatistics | None) -> None:
        """Per-head distributions over a dataset run (a :class:`core.methods.patterns.PatternStatistics`,
        computed now or a ``statistics`` run restored); None clears."""
        heads = statistics.heads if statistics is not None else []
        self.statistics = sorted(heads, key=lambda h: (h.block, h.head))
        self.n_samples = statistics.n_samples if statistics is not None else None
        self.tabs.setTabEnabled(1, bool(self.statistics))
        self._draw_statistics()

    # ---- selection ---------------------------------------------------------

    def select_head(self, layer: int, head: int, *, emit: bool = True) -> bool:
        """Select a head (``layer`` = block index); False if the result has no such head."""
        a = self.cells.get((int(layer), int(head)))
        if a is None:
            return False
        self.selected = (int(layer), int(head))
        r, c = self.layers.index(int(layer)), self.heads.index(int(head))
        self.visual_grid.highlight(r, c)
        self.sink_grid.highlight(r, c)
        self.details.setText(self._describe(a))
        grid = np.asarray(a.visual_patch_mass or np.zeros((0, 0)), dtype=float)
        if grid.ndim != 2:
            grid = np.zeros((0, 0))
        set_title(self.patch_map.plot_item, f"{a.name}: per patch, not interpolated", "9pt")
        self.patch_map.set_grid(grid, levels=(0.0, max(float(np.nanmax(grid)) if grid.size else 0.0, 1e-6)))
        self.patch_map.plot_item.setLabel("left", "patch row")
        self.patch_map.plot_item.setLabel("bottom", "patch col")
        self._show_text_pattern(a)
        if emit:
            self.head_selected.emit(int(layer), int(head))
        return True

    def head_row(self, layer: int, head: int) -> HeadSummary | None:
        """The analyze attention row of one head (its ``visual_patch_mass`` is the canvas map)."""
        return self.cells.get((int(layer), int(head)))

    def text_pattern(self, layer: int, head: int) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """One head's text-side pattern from the result's ``text_patterns``:
        ``(queries, keys)`` weights and ``{role: (queries,)}`` the mass each
        query row put on keys that are not shown; None for a block without one
        (cross-attention) or a result recorded without text patterns."""
        text = self.result.text_patterns if self.result is not None else None
        found = text.head_pattern(layer, head) if text is not None else None
        if found is None:
            return None
        other = {role: v.double().numpy() for role, v in found.other_mass.items()}
        return found.weights.double().numpy(), other

    def _show_text_pattern(self, a: HeadSummary | None) -> None:
        """Draw the selected head's question-token x question-token pattern (None clears)."""
        text = self.result.text_patterns if self.result is not None else None
        pattern = self.text_pattern(a.layer, a.head) if a is not None else None
        if pattern is None:
            self.text_grid.set_grid(np.zeros((0, 0)))
            set_title(self.text_grid.plot_item, "selected head: text-side pattern", "9pt")
            if a is None:
                self.text_note.setText(NO_TEXT_HEAD)
            elif text is None:
                self.text_note.setText(
                    f"this read-out has no text-side patterns (recorded before they existed): run it again ({READ_OUT})"
                )
            else:
                self.text_note.setText(
                    f"{a.block} is a cross-attention block: its keys are image tokens only, "
                    "so it has no text-side pattern"
                )
            return
        weights, other = pattern
        allowed = text.allowed[a.layer].numpy().astype(bool)
        shown = np.where(allowed, weights, np.nan)  # keys a query may not attend (causal mask) stay blank
        labels = [display_token(t) for t in text.tokens]
        finite = shown[np.isfinite(shown)]
        self.text_grid.set_grid(
            shown, labels, labels, levels=(0.0, max(float(finite.max()) if finite.size else 0, 1e-6))
        )
        set_title(
            self.text_grid.plot_item,
            f"{a.name}: text-side attention (rows: queries, columns: keys)",
            "9pt",
        )
        self.text_grid.plot_item.setLabel("left", "query token")
        self.text_grid.plot_item.setLabel("bottom", "key token")
        self.text_note.setText(describe_hidden_mass(labels, other, text.n_text_dropped))

    def _on_cell(self, row: int, col: int) -> None:
        self.select_head(self.layers[row], self.heads[col])

    def _describe(self, a: HeadSummary) -> str:
        lines = [
            f"{a.name}  (block {a.layer}, head {a.head})",
            f"visual mass  {a.visual_mass:.3f}",
            f"BOS / sink   {a.bos_mass:.3f}",
        ]
        for role, v in sorted((a.other_mass or {}).items()):
            lines.append(f"{role.replace('_', ' ')}  {v:.3f}")
        lines.append(f"entropy      {a.entropy:.3f} nats")
        lines.append(f"argmax       {self._describe_source(a)}")
        return "\n".join(lines)

    def _describe_source(self, a: HeadSummary) -> str:
        src = a.argmax_source
        vts = self.result.input.visual_tokens if self.result is not None else []
        if is_cross_block(a.block):
            if 0 <= src < len(vts):
                t = vts[src]
                return f"key {src}: visual token {t.index} (row {t.row}, col {t.col})"
            return f"key {src}"
        tokens = self.result.input.tokens if self.result is not None else []
        tok = tokens[src] if 0 <= src < len(tokens) else "?"
        for t in vts:
            if t.position == src:
                return f"position {src} {tok!r}: visual token {t.index} (row {t.row}, col {t.col})"
        return f"position {src} {tok!r}"

    # ---- dataset distribution ----------------------------------------------

    def _draw_statistics(self, *_args) -> None:
        if not self.statistics:
            self.box_plot.set_boxes([], [])
            self.stats_note.setText(NO_STATISTICS)
            return
        key, y_label = STAT_METRICS[self.metric_combo.currentText()]
        labels = [h.name for h in self.statistics]
        if key == "hit_rate":
            chance = next((h.chance_hit_rate for h in self.statistics if h.chance_hit_rate is not None), None)
            self.box_plot.set_bars(labels, [h.hit_rate for h in self.statistics], chance=chance, y_label=y_label)
            extra = f"dashed line: chance hit rate of a uniform head ({chance:.3f})" if chance is not None else ""
        else:
            distributions = [getattr(h, key) for h in self.statistics]  # region_mass None: no target region
            quantiles = [d.quantiles if d is not None else None for d in distributions]
            self.box_plot.set_boxes(labels, quantiles, y_label=y_label)
            extra = "box: 25-75 %, whiskers: 5-95 %, red line: median"
        n = f"{self.n_samples} samples" if self.n_samples is not None else "dataset run"
        self.stats_note.setText(f"{n}, answer position; {extra}. Sink mass is kept apart from visual mass.")
