"""Lens panel: what the final head reads from each layer's residual.

Three stacked curves over layers (x = the residual stream entering block l;
the last point, "final", is after the last block): the answer's rank, the
logit difference (or the answer logit when there is no foil) and the KL of
the final distribution to the layer's read-out. The panel draws itself from the
run it is shown for (:meth:`LensPanel.draw`, the protocol of
:class:`app.run_frame.RunFrame`): the analyze result's logit lens, and the
readers of its ``tuned_lens`` section (a tuned lens, its mean / random
baselines) overlaid; :meth:`LensPanel.set_readers` overlays others. A table lists the
top tokens of one reader per layer; clicking a row selects that layer
(:attr:`LensPanel.layer_selected`: the row reads the residual entering block l,
so it names what the blocks before l wrote).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.panels import NO_ANALYSIS, analysis_of
from app.panels.attention_panel import block_names
from app.widgets import axis_font, box, plain_label, set_title, split, stacked, style_plot, tick_step
from core.methods.logit_lens import LensRow

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult
    from core.methods.tuned_lens.evaluate import ReaderMetrics

LOGIT_LENS = "logit lens"
READER_COLORS = ["#1f5fb4", "#e0701b", "#2a9d3a", "#c0392b", "#8e44ad", "#7f7f7f", "#b8860b", "#17becf"]
NOTE = (
    "x: the residual stream entering each block; 'final' is after the last block (what the model outputs). "
    "Poor read-out at a layer can be a coordinate mismatch, not absence; good read-out does not prove use."
)
PLOTS = (RANK, LOGIT, KL) = ("rank", "logit", "kl")  # the stacked plots, top first
TOP_HEADER = "top tokens (p)"


def metrics_row(layer: int, metrics: ReaderMetrics) -> LensRow:
    """An ``eval-lens`` reader at lens layer ``layer`` (its
    :class:`core.methods.tuned_lens.evaluate.ReaderMetrics`: a mean rank, a KL in bits) as a
    row the panel draws: its KL in nats, the numbers it has not (logits, top tokens) None."""
    kl = metrics.kl_bits
    return LensRow(
        layer=int(layer),
        answer_rank=metrics.answer_rank_mean,
        answer_logit=None,
        logit_diff=None,
        kl_to_final=None if kl is None else float(kl) * math.log(2),
        top=[],
    )


def _number(v: float | None) -> float | None:
    return None if v is None else float(v)


def legend_html(names: Sequence[str]) -> str:
    """The plots' legend: each reader's name after a line sample in its colour
    (solid for the logit lens, dashed for the others, as drawn)."""
    import html

    parts = []
    for i, name in enumerate(names):
        color = READER_COLORS[i % len(READER_COLORS)]
        line = "\u2501\u25cf\u2501" if name == LOGIT_LENS else "\u254d\u25cf\u254d"
        parts.append(f'<span style="color:{color}"><b>{line}</b></span>&nbsp;{html.escape(name)}')
    return "&nbsp;&nbsp; ".join(parts)


class LensPanel(QWidget):
    """Per-layer answer rank, logit difference and KL to final, for one or more readers.

    Drawn with :meth:`draw` (the run's analyze result, its tuned-lens readers overlaid;
    :meth:`set_result` draws one result). :meth:`set_readers` overlays others
    (``{name: rows}``; rows are :class:`core.methods.logit_lens.LensRow` s like
    ``logit_lens``, numbers that are None skipped; an ``eval-lens`` reader's through
    :func:`metrics_row`).

    Signals:
        layer_selected(layer): a table row was clicked (``layer``: the lens row's, 0 .. n_blocks).
    """

    layer_selected = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.run: ShownRun | None = None  # the run drawn (draw)
        self.result: AnalyzeResult | None = None
        self.table_layers: list[int] = []  # table row -> lens layer
        self.readers: dict[str, list[LensRow]] = {}
        self.curves: dict[str, dict[str, pg.PlotDataItem]] = {p: {} for p in PLOTS}

        # wraps: a long model spec never widens the panel (the window's splitter would jump)
        self.title = plain_label(NO_ANALYSIS, wrap=True, selectable=True)
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setBackground("w")
        self.plots: dict[str, pg.PlotItem] = {}
        # The legend is a wrapped line of text above the plots: inside a plot it covered the curves
        # (rank 0 sits at the top of the inverted rank axis, the logit curves rise to the right), and
        # as a row of the plot layout it widened the plots past the panel.
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        for i, key in enumerate(PLOTS):
            plot = self.graphics.addPlot(row=i, col=0)
            style_plot(plot)
            plot.setMenuEnabled(False)
            plot.hideButtons()
            plot.showGrid(x=True, y=True, alpha=0.25)
            plot.getAxis("left").setWidth(60)
            if i:
                plot.setXLink(self.plots[RANK])
            self.plots[key] = plot
        self.tick_labels: list[str] = []  # the layer axis labels, thinned to what fits by _fit_ticks
        self.plots[KL].getViewBox().sigResized.connect(self._fit_ticks)
        set_title(self.plots[RANK], "answer rank (0 = top, log scale)")
        self.plots[RANK].setLogMode(y=True)
        self.plots[RANK].getViewBox().invertY(True)
        set_title(self.plots[KL], "KL(final || layer read-out), nats")

        self.reader_combo = QComboBox()
        self.reader_combo.currentTextChanged.connect(self._fill_table)
        self.table = QTableWidget(0, 5)
        self._set_headers("logit")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        for c in range(4):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
        header.setTextElideMode(Qt.TextElideMode.ElideRight)  # a narrow column cut "top tokens" at both ends
        self.table.cellClicked.connect(lambda row, _col: self.select_layer(self.table_layers[row]))
        self.note = plain_label(NOTE, wrap=True, selectable=True)

        reader_row = box(QHBoxLayout(), QLabel("top tokens per layer of:"), (self.reader_combo, 1))
        side = stacked(reader_row, (self.table, 1))
        plots = stacked(self.legend, (self.graphics, 1))
        splitter = split(Qt.Orientation.Horizontal, plots, side, sizes=[720, 520])
        layout = QVBoxLayout(self)
        layout.addWidget(self.title)
        layout.addWidget(splitter, 1)
        layout.addWidget(self.note)

    # ---- data in ----------------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s analyze result (live or restored alike): its logit lens and the readers
        of its ``tuned_lens`` section (none without one: earlier readers go); None clears."""
        self.run = run
        analysis = analysis_of(run)
        tuned = analysis.tuned_lens if analysis is not None else None
        self.set_result(analysis, readers=tuned.readers if tuned is not None else {})

    def set_result(self, result: AnalyzeResult | None, readers: Mapping[str, Sequence[LensRow]] | None = None) -> None:
        """Show an analyze result's logit lens (None clears), with ``readers``
        overlaid as in :meth:`set_readers` if given (one redraw for both);
        without ``readers`` the earlier extra readers are kept."""
        self.result = result
        if readers is not None:
            self.readers = self._extra_readers(readers)
        if result is not None:
            t = result.target
            against = f" minus foil {t.foil!r}" if t.foil else ""
            self.title.setText(
                f"{result.model.spec or '?'}: lens read-outs at the answer position {t.position}"
                f" for answer {t.answer!r}{against}"
            )
        else:
            self.title.setText(NO_ANALYSIS)
        self._redraw()

    def set_readers(self, readers: Mapping[str, Sequence[LensRow]] | None) -> None:
        """Overlay more readers, ``{name: rows}`` (replaces earlier extra readers; the logit lens stays)."""
        self.readers = self._extra_readers(readers)
        self._redraw()

    @staticmethod
    def _extra_readers(readers: Mapping[str, Sequence[LensRow]] | None) -> dict[str, list[LensRow]]:
        return {k: list(v) for k, v in (readers or {}).items() if k != LOGIT_LENS}

    def all_readers(self) -> dict[str, list[LensRow]]:
        """``{name: rows}`` of every reader drawn, the logit lens first."""
        out = {}
        if self.result is not None and self.result.logit_lens:
            out[LOGIT_LENS] = list(self.result.logit_lens)
        out.update(self.readers)
        return out

    def layer_labels(self, n_points: int) -> list[str]:
        """Tick label of each lens row: the block the residual enters, then "final"."""
        names = block_names(self.result)
        return [names.get(i, f"L{i}") if i < n_points - 1 else "final" for i in range(n_points)]

    # ---- drawing ----------------------------------------------------------

    def _uses_diff(self) -> bool:
        rows = [r for rows in self.all_readers().values() for r in rows]
        return any(r.logit_diff is not None for r in rows)

    def _redraw(self) -> None:
        readers = self.all_readers()
        use_diff = self._uses_diff()
        set_title(
            self.plots[LOGIT],
            "logit difference (answer - foil)" if use_diff else "answer logit (no foil given)",
            size="10pt",
        )
        n_points = max((len(rows) for rows in readers.values()), default=0)
        drawn = {key: {} for key in PLOTS}  # {plot: {reader: (xs, ys)}}, readers in order
        for name, rows in readers.items():
            rows = sorted(rows, key=lambda r: r.layer)
            series = {
                RANK: [(r.layer, _number(r.answer_rank)) for r in rows],
                LOGIT: [(r.layer, r.logit_diff if use_diff else r.answer_logit) for r in rows],
                KL: [(r.layer, _number(r.kl_to_final)) for r in rows],
            }
            for key, pts in series.items():
                pts = [(x, y) for x, y in pts if y is not None]
                if not pts:
                    continue
                xs = np.array([p[0] for p in pts], dtype=float)
                ys = np.array([p[1] for p in pts], dtype=float)
                drawn[key][name] = (xs, ys + 1.0 if key == RANK else ys)  # log scale: rank 0 -> 1
        if all(list(drawn[key]) == list(self.curves[key]) for key in PLOTS):
            # the same readers as before (a re-run): new data into the same curves, which is
            # several times faster than building them again
            for key in PLOTS:
                for name, (xs, ys) in drawn[key].items():
                    self.curves[key][name].setData(xs, ys)
        else:
            for key, plot in self.plots.items():
                for item in self.curves[key].values():
                    plot.removeItem(item)
                self.curves[key] = {}
            for i, name in enumerate(readers):
                color = READER_COLORS[i % len(READER_COLORS)]
                style = Qt.PenStyle.SolidLine if name == LOGIT_LENS else Qt.PenStyle.DashLine
                for key in PLOTS:
                    if name not in drawn[key]:
                        continue
                    curve = pg.PlotDataItem(
                        *drawn[key][name],
                        pen=pg.mkPen(color, width=2, style=style),
                        symbol="o",
                        symbolSize=7,
                        symbolBrush=color,
                        symbolPen=None,
                        name=name,
                    )
                    self.plots[key].addItem(curve)
                    self.curves[key][name] = curve
        self.legend.setText(legend_html(list(readers)))
        # Axis ticks use a short form of cross-attention blocks ("L0.xattn" -> "L0x"): the full
        # names overlapped at 1280 x 800 for CoCa's 10 points; the table beside keeps them whole.
        names = self.layer_labels(n_points)
        self.tick_labels = [label.replace(".xattn", "x") for label in names]
        self._fit_ticks()
        for key in PLOTS:
            self.plots[key].enableAutoRange()
        self.plots[KL].setLabel("bottom", "residual stream entering block")
        cross = " 'Lnx' on the axes: the cross-attention block of layer n." if any(".xattn" in n for n in names) else ""
        self.note.setText(NOTE + cross)
        self._rank_ticks(readers)
        self._fill_readers_combo(list(readers))

    def _fit_ticks(self, *_args) -> None:
        """Every k-th layer label on the shared x axis, as many as fit without overlapping
        (every label until the panel is shown; refitted on resize)."""
        axis = self.plots[KL].getAxis("bottom")
        room = self.plots[KL].getViewBox().sceneBoundingRect().width() if self.isVisible() else 0.0
        step = tick_step(self.tick_labels, room, axis_font(axis))
        ticks = [[(i, self.tick_labels[i]) for i in range(0, len(self.tick_labels), step)]]
        for key in PLOTS:
            self.plots[key].getAxis("bottom").setTicks(ticks)

    def _rank_ticks(self, readers: dict[str, list[LensRow]]) -> None:
        """Rank axis (log of rank + 1) labelled with ranks: 0, 1, 10, 100, ..."""
        ranks = [_number(r.answer_rank) for rows in readers.values() for r in rows]
        top = max([r for r in ranks if r is not None], default=1.0)
        major, minor, decade = [(0.0, "0")], [], 1
        while decade <= max(top, 1.0) * 10:
            major.append((math.log10(decade + 1), f"{decade:g}"))
            minor += [(math.log10(m * decade + 1), "") for m in (2, 5) if m * decade <= top * 10]
            decade *= 10
        if top >= 2:
            minor.append((math.log10(2 + 1), ""))
        self.plots[RANK].getAxis("left").setTicks([major, minor])

    def _fill_readers_combo(self, names: list[str]) -> None:
        current = self.reader_combo.currentText()
        self.reader_combo.blockSignals(True)
        self.reader_combo.clear()
        self.reader_combo.addItems(names)
        if current in names:
            self.reader_combo.setCurrentText(current)
        self.reader_combo.blockSignals(False)
        self._fill_table()

    def _set_headers(self, logit: str) -> None:
        self.table.setHorizontalHeaderLabels(["reads", "rank", logit, "KL (nats)", TOP_HEADER])
        self.table.horizontalHeaderItem(4).setToolTip("the reader's top tokens at that layer, with their probability")

    def _fill_table(self, *_args) -> None:
        rows = sorted(self.all_readers().get(self.reader_combo.currentText(), []), key=lambda r: r.layer)
        self.table_layers = [int(r.layer) for r in rows]
        labels = self.layer_labels(len(rows))
        use_diff = self._uses_diff()
        self._set_headers("logit diff" if use_diff else "logit")
        self.table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            rank, kl = _number(r.answer_rank), _number(r.kl_to_final)
            logit = r.logit_diff if use_diff else r.answer_logit
            top = ", ".join(f"{tok} {p:.2f}" for tok, p in r.top or [])
            cells = [
                labels[i] if i < len(labels) else str(r.layer),
                "" if rank is None else f"{rank:g}",
                "" if logit is None else f"{logit:+.3f}",
                "" if kl is None else f"{kl:.3f}",
                top,
            ]
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c in (1, 2, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                elif c == 4:
                    item.setToolTip(text)  # a narrow column elides the list
                self.table.setItem(i, c, item)

    def select_layer(self, layer: int, *, emit: bool = True) -> bool:
        """Select the table row of lens layer ``layer`` (and emit :attr:`layer_selected`); False if none."""
        if int(layer) not in self.table_layers:
            return False
        self.table.selectRow(self.table_layers.index(int(layer)))
        if emit:
            self.layer_selected.emit(int(layer))
        return True
