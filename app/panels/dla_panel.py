"""DLA panel: direct logit attribution of every residual component.

Horizontal bars, one per component of ``residual_decomposition`` (embedding,
attention heads, MLPs, cross-attention heads, biases), coloured by kind,
sorted by magnitude, the top k shown. The convention combo picks the field:

* frozen scale (``dla_frozen``): additive, sums to the logit (difference)
  minus the unembedding and final-norm biases;
* Jacobian (``dla_jacobian``): a first-order sensitivity at x_L, does not sum;
* projection (``projection``), norm (``norm``);
* re-run (total / direct removal): rows from
  :func:`core.methods.residual.compare_with_rerun`, given with :meth:`DLAPanel.set_rerun`.

The reconstruction error and the convention's caveat are always shown.
The panel draws itself from the run it is shown for (:meth:`DLAPanel.draw`, the
protocol of :class:`app.run_frame.RunFrame`). Selecting a head's bar enables
"sources of ...", which emits :attr:`DLAPanel.sources_requested`; the window
computes the head's per-source contributions for the drawn run (:attr:`DLAPanel.run`)
and hands them back with :meth:`DLAPanel.set_sources`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QPointF, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.panels import NO_ANALYSIS, analysis_of
from app.panels.attention_panel import SIGNED_MAP, HeatGrid, block_names, is_cross_block, token_grid
from app.widgets import FOREGROUND, plain_label, set_title, split, stacked, style_plot

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult
    from core.methods.residual import Component, RerunRow

# convention shown in the combo -> (field, axis label, caveat)
CONVENTIONS: dict[str, tuple[str, str, str]] = {
    "frozen scale": (
        "dla_frozen",
        "u^T (gain * centred c / sigma(x_L))",
        "Frozen scale: the final norm's scale is frozen at x_L. Additive: all components sum to the logit "
        "(difference) minus the unembedding and final-norm biases. A direct read-out only; it says nothing of "
        "a component's indirect effect through later layers.",
    ),
    "Jacobian": (
        "dla_jacobian",
        "u^T J_norm(x_L) c",
        "Jacobian: a first-order sensitivity of the logit (difference) to each component at x_L. It does NOT "
        "sum to the logit (for a scale-invariant norm the total is about 0); compare bars, not the sum.",
    ),
    "projection": (
        "projection",
        "u^T c (no final norm)",
        "Projection: u^T c with no final norm applied; alignment with the answer direction, not logit units, "
        "and not additive to the logit.",
    ),
    "norm": (
        "norm",
        "||c||_2",
        "Norm: the size of the write, whatever its direction. Unsigned; a large write can be orthogonal to or "
        "suppressed before the answer.",
    ),
    "re-run (total removal)": (
        "total_removal",
        "logit change when zeroed, later layers re-run",
        "Re-run: the logit (difference) drop when the component's write is zeroed and every later layer is "
        "recomputed (direct + indirect effect). Zero ablation is off-distribution; only the re-run components "
        "are shown. Outlined bars: frozen-scale DLA of the same components.",
    ),
    "re-run (direct removal)": (
        "direct_removal",
        "T(x_L) - T(x_L - c), final norm recomputed",
        "Direct removal: the final norm recomputed without the component, upstream unchanged (the exact direct "
        "effect). Its gap to frozen-scale DLA is the final norm's non-linearity. Outlined bars: frozen-scale DLA.",
    ),
}
RERUN_CONVENTIONS = ("re-run (total removal)", "re-run (direct removal)")
NO_SOURCES = "select a head's bar, then press its sources button (top right) for its per-source map"

KIND_COLORS = {
    "embedding": "#8c8c8c",
    "attention head": "#3a78c3",
    "cross-attention head": "#e08214",
    "MLP": "#3a9e4a",
    "expert": "#7fbf3f",
    "token mixer (no heads)": "#17a2b8",
    "bias": "#9a5cc6",
    "other": "#c0504d",
}
HEAD_NAME = re.compile(r"^(?P<block>.+)\.H(?P<head>\d+)$")
EXPERT_NAME = re.compile(r"^L\d+\.(E\d+|shared_expert)$")
MIXER_NAME = re.compile(r"^L\d+\.(linear_attn|conv)$")  # the mixers the hybrid families declare


def legend_html() -> str:
    """The bar colours: a square in each kind's colour, then the kind."""
    shown = [(kind, color) for kind, color in KIND_COLORS.items() if kind != "other"]
    return "&nbsp;&nbsp; ".join(f'<span style="color:{color}">\u25a0</span>&nbsp;{kind}' for kind, color in shown)


def component_kind(name: str) -> str:
    """``embed`` -> embedding, ``L3.H1`` -> attention head, ``L0.xattn.H2`` ->
    cross-attention head, ``L1.mlp`` -> MLP, ``L1.E3`` / ``L1.shared_expert`` -> expert,
    ``L0.linear_attn`` / ``L0.conv`` -> token mixer (no heads), ``bias...`` -> bias."""
    if name == "embed" or name.startswith("embed"):
        return "embedding"
    if name.startswith("bias"):
        return "bias"
    m = HEAD_NAME.match(name)
    if m:
        return "cross-attention head" if is_cross_block(m.group("block")) else "attention head"
    if name.endswith(".mlp"):
        return "MLP"
    if EXPERT_NAME.match(name):
        return "expert"
    if MIXER_NAME.match(name):
        return "token mixer (no heads)"
    return "other"


def visual_token_values(result: AnalyzeResult, layer: int, sources_row: Sequence[float]) -> np.ndarray:
    """One head's per-source values (a row of ``core.methods.contributions.source_contributions``,
    ``(sources,)``: every sequence position for self-attention, the visual keys for cross-attention)
    -> ``(n_visual_tokens,)`` in the order of ``result.input.visual_tokens``."""
    row = np.asarray(sources_row, dtype=float).ravel()
    vts = result.input.visual_tokens
    if is_cross_block(block_names(result).get(int(layer), "")):
        return row[: len(vts)]
    return row[[int(t.position) for t in vts]]


def _number(value: float | None) -> float:
    """A stored number, NaN where the JSON held none (a non-finite value is written as null)."""
    return float("nan") if value is None else float(value)


class DLAPanel(QWidget):
    """Per-component direct logit attribution under a chosen convention.

    Drawn with :meth:`draw` (the run's analyze result; :meth:`set_result` draws one
    result). Setters: :meth:`set_rerun` (re-run rows),
    :meth:`set_convention`, :meth:`set_top_k`, :meth:`select_component` /
    :meth:`select_head`, :meth:`set_sources` (a head's per-visual-token values).

    Signals:
        component_selected(name): a bar was clicked.
        sources_requested(layer, head): the user asks for the selected head's
            per-source contributions (``layer`` = block index).
        sources_shown(layer, head, values): :meth:`set_sources` received
            ``values (n_visual_tokens,)`` for the canvas to map.
    """

    component_selected = Signal(str)
    sources_requested = Signal(int, int)
    sources_shown = Signal(int, int, object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.run: ShownRun | None = None  # the run drawn (draw): a head's sources are computed for it
        self.result: AnalyzeResult | None = None
        self.rerun_rows: list[RerunRow] = []
        self.rank_correlation: dict | None = None
        self.shown: list[tuple[str, float]] = []  # the bars drawn, top first
        self.selected: str | None = None
        self.source_values: np.ndarray | None = None
        self.source_head: tuple[int, int] | None = None

        self.convention_combo = QComboBox()
        self.convention_combo.addItems(list(CONVENTIONS))
        self._enable_rerun(False)
        self.convention_combo.currentTextChanged.connect(self._redraw)
        self.top_k_spin = QSpinBox()
        self.top_k_spin.setRange(0, 100000)
        self.top_k_spin.setSpecialValueText("all")
        self.top_k_spin.setValue(20)
        self.top_k_spin.setToolTip("number of components shown, largest |value| first (0 = all)")
        self.top_k_spin.valueChanged.connect(self._redraw)
        self.sources_button = QPushButton("sources of the selected head")
        self.sources_button.setEnabled(False)
        self.sources_button.setToolTip("per-source contributions of the selected head, mapped onto the patch grid")
        self.sources_button.clicked.connect(self.request_sources)
        # its text names the head ("sources of L0.xattn.H3"): a fixed minimum keeps a long name from
        # widening the panel (the window's splitter jumped)
        self.sources_button.setMinimumWidth(140)

        controls = QHBoxLayout()
        controls.addWidget(QLabel("convention:"))
        controls.addWidget(self.convention_combo)
        controls.addWidget(QLabel("top k:"))
        controls.addWidget(self.top_k_spin)
        controls.addStretch(1)
        controls.addWidget(self.sources_button)

        # wrapped: a long model spec or target never sets the panel's minimum width
        self.target_label = plain_label(NO_ANALYSIS, wrap=True, selectable=True)
        self.error_label = plain_label("", wrap=True, selectable=True)
        self.sum_label = plain_label("", wrap=True, selectable=True)
        self.caveat_label = plain_label("", wrap=True, selectable=True)
        self.caveat_label.setStyleSheet("color: #704000;")

        self.plot_widget = pg.PlotWidget(background="w")
        self.plot = self.plot_widget.getPlotItem()
        style_plot(self.plot)
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.showGrid(x=True, alpha=0.3)
        self.plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.plot.getViewBox().invertY(True)
        self.plot.getViewBox().setMouseEnabled(x=False, y=False)
        self.bars = pg.BarGraphItem(x0=[], y=[], width=[], height=0.7, pen=None)
        self.ghost_bars = pg.BarGraphItem(
            x0=[], y=[], width=[], height=0.35, brush=None, pen=pg.mkPen(FOREGROUND, width=1.5)
        )
        self.selection = pg.BarGraphItem(
            x0=[], y=[], width=[], height=0.9, brush=None, pen=pg.mkPen("#ff2020", width=3)
        )
        self.zero_line = pg.InfiniteLine(pos=0, angle=90, pen=pg.mkPen(FOREGROUND, width=1))
        for item in (self.bars, self.ghost_bars, self.selection, self.zero_line):
            self.plot.addItem(item)
        self._texts: list[pg.TextItem] = []
        # The legend is a wrapped line above the bars: inside the plot it covered bar values.
        self.legend = QLabel(legend_html())
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.plot_widget.scene().sigMouseClicked.connect(self._on_click)

        self.source_grid = HeatGrid("per-source contribution", color_map=SIGNED_MAP, annotate=False)
        self.source_label = plain_label(NO_SOURCES, wrap=True, selectable=True)
        side = stacked((self.source_grid, 1), (self.source_label, 0))
        bars = stacked(self.legend, (self.plot_widget, 1))
        splitter = split(Qt.Orientation.Horizontal, bars, side, sizes=[880, 360])

        layout = QVBoxLayout(self)
        layout.addLayout(controls)
        layout.addWidget(self.target_label)
        layout.addWidget(self.error_label)
        layout.addWidget(self.sum_label)
        layout.addWidget(self.caveat_label)
        layout.addWidget(splitter, 1)
        self.set_result(None)  # as after draw(None, None): the convention's caveat, no components

    # ---- data in ----------------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s analyze result (live or restored alike); None clears. The component
        selected before stays selected where the new result has it."""
        self.run = run
        self.set_result(analysis_of(run))

    def set_result(self, result: AnalyzeResult | None) -> None:
        """Show an analyze result (None clears); re-run rows and sources of an older result are dropped."""
        self.result = result
        self.rerun_rows, self.rank_correlation = [], None
        self._enable_rerun(False)
        self.source_values, self.source_head = None, None
        self.source_grid.clear_grid()  # the map and the head it was for go together
        self.source_label.setText(NO_SOURCES)
        if result is not None and result.residual_decomposition is None:  # refused for this architecture
            self.target_label.setText(
                f"{result.model.spec or '?'}: residual decomposition {result.undefined('residual DLA') or 'not defined'}"
            )
            self.error_label.setText("")
        elif result is not None:
            t, rd = result.target, result.residual_decomposition
            u = f"answer {t.answer!r} minus foil {t.foil!r}" if t.foil else f"answer {t.answer!r}"
            self.target_label.setText(
                f"{result.model.spec or '?'}: components of x_L at position {t.position}, "
                f"read along u = {u}; model logit{' difference' if t.foil else ''} "
                f"{_number(rd.target_logit):.3f}"
            )
            self.error_label.setText(
                rd.reconstruction_line(result.model.dtype)
                + f"; max |sum of components - x_L| = {_number(rd.reconstruction_max_abs_err):.2e}"
            )
        else:
            self.target_label.setText(NO_ANALYSIS)
            self.error_label.setText("")
        if self.selected not in {c.name for c in self.components()}:
            self.selected = None
        self._redraw()

    def set_rerun(self, rows: Sequence[RerunRow] | None, rank_correlation: dict | None = None) -> None:
        """Re-run rows (``compare_with_rerun(...).rows``: name, dla_frozen, dla_jacobian,
        direct_removal, total_removal); enables the re-run conventions. None or [] disables them."""
        self.rerun_rows = list(rows or [])
        self.rank_correlation = dict(rank_correlation) if rank_correlation else None
        self._enable_rerun(bool(self.rerun_rows))
        if not self.rerun_rows and self.convention() in RERUN_CONVENTIONS:
            self.set_convention("frozen scale")
        self._redraw()

    def set_convention(self, name: str) -> None:
        """One of :data:`CONVENTIONS` (the re-run ones need :meth:`set_rerun` first)."""
        if name not in CONVENTIONS:
            raise ValueError(f"unknown convention {name!r}; known: {', '.join(CONVENTIONS)}")
        self.convention_combo.setCurrentText(name)

    def convention(self) -> str:
        return self.convention_combo.currentText()

    def set_top_k(self, k: int) -> None:
        """Show the ``k`` largest components (0 = all)."""
        self.top_k_spin.setValue(max(0, int(k)))

    def select_component(self, name: str | None, *, emit: bool = False) -> None:
        """Outline a component's bar and enable the sources button for a head."""
        self.selected = name
        self._draw_selection()
        head = self._head_of(name)
        self.sources_button.setEnabled(head is not None)
        self.sources_button.setText(f"sources of {name}" if head is not None else "sources of the selected head")
        if emit and name is not None:
            self.component_selected.emit(name)

    def select_head(self, layer: int, head: int) -> None:
        """Select the bar of head ``head`` in block ``layer`` (e.g. from the attention panel)."""
        names = block_names(self.result)
        if int(layer) in names:
            self.select_component(f"{names[int(layer)]}.H{int(head)}")

    def request_sources(self) -> bool:
        """Emit :attr:`sources_requested` for the selected head; False when no head is selected."""
        head = self._head_of(self.selected)
        if head is None:
            return False
        self.sources_requested.emit(*head)
        return True

    def set_sources(self, layer: int, head: int, values: Sequence[float], convention: str = "dla_frozen") -> None:
        """A head's per-source contributions, ``values (n_visual_tokens,)`` in the order of
        ``result.input.visual_tokens`` (see :func:`visual_token_values`). Shown on
        the patch grid here and re-emitted with :attr:`sources_shown` for the canvas."""
        vals = np.asarray(values, dtype=float).ravel()
        vts = self.result.input.visual_tokens if self.result is not None else []
        self.source_values, self.source_head = vals, (int(layer), int(head))
        name = f"{block_names(self.result).get(int(layer), f'L{layer}')}.H{int(head)}"
        grid = token_grid(vals, vts) if vts else np.zeros((0, 0))
        set_title(self.source_grid.plot_item, f"{name}: per source ({convention}), per patch", "9pt")
        self.source_grid.set_grid(grid)
        if vals.size:
            k = int(np.nanargmax(np.abs(vals)))
            where = f" (row {vts[k].row}, col {vts[k].col})" if k < len(vts) else ""
            self.source_label.setText(
                f"{name}: sum over visual tokens {np.nansum(vals):+.3f}; largest |value| at visual token {k}{where}: "
                f"{vals[k]:+.3f}. Signed, first-order, through this head's value path only."
            )
        else:
            self.source_label.setText(f"{name}: no visual tokens")
        self.sources_shown.emit(int(layer), int(head), vals)

    # ---- read-outs (tests, the lead) ---------------------------------------

    def components(self) -> list[Component]:
        """The shown result's residual components (none without a result)."""
        rd = self.result.residual_decomposition if self.result is not None else None
        return list(rd.components) if rd is not None else []

    def values(self) -> dict[str, float]:
        """``{component: value}`` of every component under the current convention (not only the shown ones)."""
        field = CONVENTIONS[self.convention()][0]
        if self.convention() in RERUN_CONVENTIONS:
            found = {r.name: getattr(r, field) for r in self.rerun_rows}
        else:
            rd = self.result.residual_decomposition if self.result is not None else None
            found = rd.component_values(field) if rd is not None else {}
        return {name: float(v) for name, v in found.items() if v is not None}

    def shown_values(self) -> list[tuple[str, float]]:
        """The bars drawn, top first: ``[(component, value)]``."""
        return list(self.shown)

    # ---- drawing ----------------------------------------------------------

    def _enable_rerun(self, enabled: bool) -> None:
        model = self.convention_combo.model()
        for name in RERUN_CONVENTIONS:
            item = model.item(self.convention_combo.findText(name))
            item.setEnabled(enabled)
            item.setToolTip("" if enabled else "run a re-run comparison first")

    def _head_of(self, name: str | None) -> tuple[int, int] | None:
        m = HEAD_NAME.match(name or "")
        if not m:
            return None
        index = {v: k for k, v in block_names(self.result).items()}
        block, head = m.group("block", "head")
        if block not in index:
            return None
        return index[block], int(head)

    def _redraw(self, *_args) -> None:
        conv = self.convention()
        field, axis_label, caveat = CONVENTIONS[conv]
        values = self.values()
        order = sorted(values, key=lambda n: -abs(values[n]))
        k = self.top_k_spin.value()
        shown = order[:k] if k > 0 else order
        self.shown = [(n, values[n]) for n in shown]
        ys = np.arange(len(shown), dtype=float)
        v = np.array([values[n] for n in shown], dtype=float)
        brushes = [pg.mkBrush(KIND_COLORS[component_kind(n)]) for n in shown]
        self.bars.setOpts(x0=np.minimum(v, 0), y=ys, width=np.abs(v), height=0.7, brushes=brushes)
        ghost = np.zeros_like(v)
        if conv in RERUN_CONVENTIONS:
            by_name = {r.name: r for r in self.rerun_rows}
            ghost = np.array([float(by_name[n].dla_frozen) for n in shown], dtype=float)
            self.ghost_bars.setOpts(x0=np.minimum(ghost, 0), y=ys, width=np.abs(ghost), height=0.35)
        else:
            self.ghost_bars.setOpts(x0=[], y=[], width=[], height=0.35)
        self.plot.getAxis("left").setTicks([[(i, n) for i, n in enumerate(shown)]])
        self.plot.setLabel("bottom", f"{conv}: {axis_label}")
        for t in self._texts:
            self.plot.removeItem(t)
        self._texts = []
        if len(shown) <= 60:
            for y, x, g in zip(ys, v, ghost):
                # the value sits past the bar, or past its frozen-scale outline on the same side
                at = max(x, g) if x >= 0 else min(x, g)
                text = pg.TextItem(f"{x:+.3f}", color=FOREGROUND, anchor=(0, 0.5) if x >= 0 else (1, 0.5))
                text.setPos(float(at), float(y))
                self.plot.addItem(text)
                self._texts.append(text)
        if len(shown):
            lo = min(0.0, float(v.min()), float(ghost.min()))
            hi = max(0.0, float(v.max()), float(ghost.max()))
            pad = 0.18 * (hi - lo or 1.0)
            self.plot.getViewBox().setRange(
                xRange=(lo - (pad if lo < 0 else 0.02 * pad), hi + pad), yRange=(-0.6, len(shown) - 0.4), padding=0
            )
        self._draw_selection()
        self._write_sums(conv, values)
        self.caveat_label.setText(caveat)

    def _write_sums(self, conv: str, values: dict[str, float]) -> None:
        n_shown, n_all = len(self.shown), len(values)
        shown_sum = sum(x for _, x in self.shown)
        parts = [f"{n_shown} of {n_all} components shown; sum of shown bars {shown_sum:+.4f}"]
        if n_shown < n_all:
            parts.append(f"sum of all {sum(values.values()):+.4f}")
        if conv == "frozen scale" and self.result is not None and self.result.residual_decomposition is not None:
            expected = _number(self.result.residual_decomposition.frozen_sum_expected)
            parts.append(f"expected (logit - unembedding and final-norm biases) {expected:+.4f}")
        elif conv == "Jacobian":
            parts.append("not additive: the sum is not the logit")
        elif conv in RERUN_CONVENTIONS and self.rank_correlation:
            corr = ", ".join(f"{k} {v:+.2f}" for k, v in self.rank_correlation.items())
            parts.append(f"Spearman vs total removal: {corr}")
        if not values:
            parts = ["no components"]
        self.sum_label.setText("; ".join(parts))

    def _draw_selection(self) -> None:
        names = [n for n, _ in self.shown]
        if self.selected in names:
            i = names.index(self.selected)
            x = self.shown[i][1]
            self.selection.setOpts(x0=[min(x, 0.0)], y=[i], width=[abs(x)], height=0.9)
        else:
            self.selection.setOpts(x0=[], y=[], width=[], height=0.9)

    def bar_center(self, name: str) -> QPoint | None:
        """Widget coordinates of a shown bar's middle (for a test click)."""
        names = [n for n, _ in self.shown]
        if name not in names:
            return None
        i = names.index(name)
        x = self.shown[i][1]
        scene = self.plot.getViewBox().mapViewToScene(QPointF(x / 2, i))
        return self.plot_widget.mapFromScene(scene)

    def _on_click(self, event) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        vb = self.plot.getViewBox()
        if not vb.sceneBoundingRect().contains(event.scenePos()):
            return
        i = int(round(vb.mapSceneToView(event.scenePos()).y()))
        if 0 <= i < len(self.shown):
            self.select_component(self.shown[i][0], emit=True)
