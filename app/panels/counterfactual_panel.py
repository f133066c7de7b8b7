"""The counterfactual panel: paint a region, choose a fill, ask for a run, and
read the result beside the edited image.

The panel never runs the model. "Run" emits ``run_requested(mask, fill,
fill_options)`` and "Occlusion sweep" emits ``sweep_requested(k)``; the window
builds the request from the panel's controls (:meth:`CounterfactualPanel.counterfactual_request`,
:meth:`~CounterfactualPanel.sweep_request`: a :class:`core.requests.CounterfactualRequest` /
:class:`core.requests.SweepRequest`, or a :class:`app.panels.run_requests.Refusal`) and runs it.

The panel draws itself from the run its view shows (:meth:`CounterfactualPanel.draw`, the
protocol of :class:`app.run_frame.RunFrame`; kinds :data:`DRAWN_KINDS`): the region
counterfactual (:class:`core.methods.counterfactual.RegionCounterfactual`), the occlusion map
(:class:`core.methods.counterfactual.OcclusionMap`), the interventions table it hosts
(:meth:`CounterfactualPanel.host_interventions`) and the visual-token grid of the run's
read-out, a live run and a restored one alike. The painted region and the image are the
run's inputs, not its results: a draw leaves them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PIL import Image
from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QColor, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QButtonGroup,
    QColorDialog,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.canvas import ImageCanvas
from app.panels import analysis_of
from app.panels.run_requests import IMAGE_FILTER, Refusal, RunningLine, read_source
from app.widgets import ElidedLabel, box, boxed, plain_label, split, stacked
from core.methods.counterfactual import FILLS, Fill, OcclusionMap, RegionCounterfactual
from core.requests import CounterfactualRequest, SweepRequest

if TYPE_CHECKING:
    from app.components import ShownRun
    from app.panels.intervention_panel import InterventionPanel
    from core.analyze import AnalyzeResult

TOOLS = (("brush", "Brush", "B"), ("eraser", "Eraser", "E"), ("box", "Box", "R"), ("view", "Pan", "H"))
NO_PASTE_SOURCE = "no image chosen"
PAINT_FIRST = "paint a region first (brush or box), then Run"  # Run's refusal, until a region is painted
NO_PASTE = "the paste fill needs another image: choose one with Image…"
# the result kinds the panel draws (its view's, app.run_frame): the painter's grid is the read-out's tokens
DRAWN_KINDS = ("counterfactual", "sweep", "intervention", "analyze")


def recorded_fill(fill: Fill) -> tuple[str, dict]:
    """``(fill, options)`` as :meth:`CounterfactualPanel.fill_choice` gives them, of the fill a recorded
    run ran with (a restored :class:`core.methods.counterfactual.Fill`); a paste source that was no
    file is left out."""
    if fill.kind == "constant":
        return fill.kind, {"color": tuple(int(v) for v in fill.color)}
    if fill.kind == "blur":
        return fill.kind, {"radius": float(fill.radius)}
    if fill.kind == "noise":
        return fill.kind, {"seed": int(fill.seed)}
    if fill.kind == "paste" and fill.has_source_file:
        return fill.kind, {"paste_from": str(fill.paste_from)}
    return fill.kind, {}


def _fmt(v: Any, signed: bool = False) -> str:
    if v is None:
        return "—"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, float, np.floating, np.integer)):
        return f"{float(v):+.4f}" if signed else f"{float(v):.4f}"
    return str(v)


def _readonly_table(rows: int, headers: Sequence[str]) -> QTableWidget:
    table = QTableWidget(rows, len(headers))
    table.setHorizontalHeaderLabels(list(headers))
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
    table.setWordWrap(False)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
    return table


class _ImagePreview(pg.GraphicsLayoutWidget):
    """A small upright (row-major) image view with a caption."""

    def __init__(self, caption: str):
        super().__init__()
        self.setBackground("w")
        self.ci.layout.setContentsMargins(0, 0, 0, 0)
        self.caption = self.addLabel(caption, color="#222", size="9pt")
        self.nextRow()
        self.box = self.addViewBox(lockAspect=True, invertY=True, enableMenu=False)
        self.box.setBackgroundColor("#e6e6e6")
        self.image_item = pg.ImageItem(axisOrder="row-major")
        self.box.addItem(self.image_item)
        self.image: np.ndarray | None = None

    def set_image(self, image: np.ndarray | None, caption: str | None = None) -> None:
        self.image = None if image is None else np.asarray(image)
        if image is None:
            self.image_item.clear()
        else:
            self.image_item.setImage(self.image, autoLevels=False, levels=(0, 255))
            self.box.autoRange(padding=0.02)
        if caption is not None:
            self.caption.setText(caption, color="#222", size="9pt")


class CounterfactualPanel(QWidget):
    """Paint a region on the image, choose a fill, and read the answer change
    and the region's routing read-outs side by side.

    Data in: :meth:`set_image` (the input), :meth:`draw` (a run's results: the answer change,
    the occlusion map, the interventions table, the read-out's token grid), :meth:`set_busy`,
    :meth:`show_message`; the requests out: :meth:`counterfactual_request`, :meth:`sweep_request`.

    Signals:
        run_requested(mask, fill, fill_options): ``mask`` ``(H, W)`` bool on
            the original image; ``fill`` one of :data:`core.methods.counterfactual.FILLS`;
            ``fill_options`` the keyword options for it (``color``, ``radius``,
            ``seed``, ``paste_from``), ready for ``region_counterfactual(...,
            mask, fill, **fill_options)``.
        sweep_requested(k): run the occlusion sweep with k x k patch cells
            (the fill is :meth:`fill_choice`).
        mask_changed(np.ndarray): the painted region after each edit.
    """

    run_requested = Signal(object, str, dict)
    sweep_requested = Signal(int)
    mask_changed = Signal(object)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.image: np.ndarray | None = None
        self.tokens: list = []
        self.result: RegionCounterfactual | None = None
        self.sweep: OcclusionMap | np.ndarray | None = None
        self.paste_source: str | None = None
        self.interventions: InterventionPanel | None = None  # the hosted Interventions box (host_interventions)
        self._color = (128, 128, 128)
        self._build()
        self.running = RunningLine(self.show_message, self.message_label)
        self.set_busy(False)
        self._update_region_label(self.canvas.mask())

    # ----- layout -------------------------------------------------------

    def _build(self) -> None:
        self.canvas = ImageCanvas(paint=True)
        self.canvas.mask_changed.connect(self._on_mask_changed)
        self.canvas.mode_changed.connect(self._on_mode_changed)

        self.tool_group = QButtonGroup(self)
        self.tool_group.setExclusive(True)
        self.tool_buttons: dict[str, QToolButton] = {}
        tools = QHBoxLayout()
        for mode, text, key in TOOLS:
            b = QToolButton()
            b.setText(text)
            b.setCheckable(True)
            b.setToolTip(f"{text} ({key})")
            b.setShortcut(QKeySequence(key))
            b.clicked.connect(lambda _=False, m=mode: self.canvas.set_mode(m))
            self.tool_group.addButton(b)
            self.tool_buttons[mode] = b
            tools.addWidget(b)
        self.tool_buttons[self.canvas.mode()].setChecked(True)
        self.size_slider = QSlider(Qt.Orientation.Horizontal)
        self.size_slider.setRange(1, 200)
        self.size_slider.setValue(int(self.canvas.brush_size()))
        self.size_slider.setMinimumWidth(90)
        self.size_slider.setToolTip("brush and eraser diameter, in image pixels")
        self.size_slider.valueChanged.connect(self._on_size)
        self.size_label = plain_label(f"size {int(self.canvas.brush_size())} px")
        self.size_label.setMinimumWidth(70)
        tools.addStretch(1)
        brush_row = box(QHBoxLayout(), (self.size_slider, 1), self.size_label)
        edits = QHBoxLayout()
        self.undo_button = QToolButton()
        self.undo_button.setText("Undo")
        self.undo_button.clicked.connect(self.canvas.undo)
        self.redo_button = QToolButton()
        self.redo_button.setText("Redo")
        self.redo_button.clicked.connect(self.canvas.redo)
        self.clear_button = QToolButton()
        self.clear_button.setText("Clear")
        self.clear_button.clicked.connect(self.canvas.clear_mask)
        stack = self.canvas.undo_stack
        stack.canUndoChanged.connect(self.undo_button.setEnabled)
        stack.canRedoChanged.connect(self.redo_button.setEnabled)
        self.undo_button.setEnabled(stack.canUndo())
        self.redo_button.setEnabled(stack.canRedo())
        for b in (self.undo_button, self.redo_button, self.clear_button):
            edits.addWidget(b)
        edits.addStretch(1)
        for seq, slot in (
            (QKeySequence.StandardKey.Undo, self.canvas.undo),
            (QKeySequence.StandardKey.Redo, self.canvas.redo),
        ):
            sc = QShortcut(seq, self)
            sc.setContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
            sc.activated.connect(slot)

        # fill choice, with the options of the chosen fill only
        self.fill_combo = QComboBox()
        self.fill_combo.addItems(list(FILLS))
        self.fill_combo.setToolTip("what the painted pixels are replaced with")
        self.fill_options = QStackedWidget()
        no_options = self.fill_options.addWidget(QWidget())
        self._option_pages: dict[str, int] = {"mean": no_options, "inpaint": no_options}
        self.color_button = QPushButton()
        self.color_button.setToolTip("the constant fill's colour")
        self.color_button.clicked.connect(self._pick_color)
        self._option_pages["constant"] = self._add_option_page(self.color_button)
        self.radius_spin = QDoubleSpinBox()
        self.radius_spin.setRange(0.5, 100.0)
        self.radius_spin.setValue(4.0)
        self.radius_spin.setSuffix(" px σ")
        self._option_pages["blur"] = self._add_option_page(self.radius_spin)
        self.seed_spin = QSpinBox()
        self.seed_spin.setRange(0, 2**31 - 1)
        self.seed_spin.setPrefix("seed ")
        self._option_pages["noise"] = self._add_option_page(self.seed_spin)
        self.paste_button = QPushButton("Image…")
        self.paste_button.setToolTip("the image whose same region is pasted in (resized to this image)")
        self.paste_button.clicked.connect(self._pick_paste_source)
        self.paste_label = ElidedLabel(NO_PASTE_SOURCE)  # a long file name must not widen the controls
        self.paste_label.setStyleSheet("color: #555;")
        self._option_pages["paste"] = self._add_option_page(self.paste_button, self.paste_label)
        self.fill_combo.currentTextChanged.connect(self._on_fill_changed)
        self._set_color_swatch()

        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("fill the painted region and re-run the model")
        self.run_button.setStyleSheet("font-weight: bold;")
        self.run_button.clicked.connect(self.request_run)
        self.sweep_k = QSpinBox()
        self.sweep_k.setRange(1, 16)
        self.sweep_k.setPrefix("k = ")
        self.sweep_k.setToolTip("cells of k x k patches")
        self.sweep_button = QPushButton("Occlusion sweep")
        self.sweep_button.setToolTip("fill every k x k block of patches in turn: a map of the answer effect")
        self.sweep_button.clicked.connect(self.request_sweep)

        fill_row = box(QHBoxLayout(), plain_label("Fill"), (self.fill_combo, 1))
        # The region and message lines have a fixed height (the whole text in the tooltip when cut):
        # painting or a message never moves the sweep and intervention controls below them.
        self.region_label = ElidedLabel(lines=2)
        self.region_label.setStyleSheet("color: #333;")
        sweep_row = box(QHBoxLayout(), self.sweep_k, (self.sweep_button, 1))

        self.message_label = ElidedLabel(lines=3, selectable=True)

        # The controls are a column beside the painter, scrolled on their own when the window is
        # short: below the canvas they fell under the visible area at 1280 x 800, so the painted
        # region and Run were never on screen together. The painter takes what width is left.
        controls = QWidget()
        self.controls_layout = QVBoxLayout(controls)
        self.controls_layout.setContentsMargins(4, 0, 4, 0)
        for item in (tools, brush_row, edits, fill_row, self.fill_options, self.run_button, self.region_label):
            self._add_control(item)
        self.controls_layout.addSpacing(6)
        for item in (sweep_row, self.message_label):
            self._add_control(item)
        self.controls_layout.addStretch(1)
        self.controls_scroll = QScrollArea()
        self.controls_scroll.setWidgetResizable(True)
        self.controls_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.controls_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.controls_scroll.setWidget(controls)
        self.controls_scroll.setMinimumWidth(controls.minimumSizeHint().width() + 16)  # room for a scroll bar

        # results, each in a tab of the results column: the answer change (the edited image over its
        # numbers), the occlusion map (the whole column: a map beside the edited image was ~120 px
        # wide at 1280 x 800) and the window's interventions table (add_results)
        self.edited_view = _ImagePreview("edited image")
        self.sweep_canvas = ImageCanvas()
        self.sweep_title = ElidedLabel("occlusion sweep: not run")
        self.sweep_title.setStyleSheet("font-weight: bold;")
        self.sweep_summary = plain_label(wrap=True)
        self.sweep_summary.setStyleSheet("color: #333;")
        self.sweep_box = stacked(self.sweep_title, (self.sweep_canvas, 1), self.sweep_summary)

        self.answer_group = QGroupBox("Answer change")
        self.tokens_label = plain_label("no run yet", wrap=True)
        self.flip_label = plain_label(wrap=True)
        font = self.flip_label.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.15)
        self.flip_label.setFont(font)
        self.answer_table = _readonly_table(4, ["original", "edited", "change"])
        self.answer_table.setVerticalHeaderLabels(["predicted", "prob", "logit", "logit diff"])
        self.answer_table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.answer_table.resizeRowsToContents()
        height = self.answer_table.horizontalHeader().sizeHint().height() + 4
        height += sum(self.answer_table.rowHeight(r) for r in range(self.answer_table.rowCount()))
        self.answer_table.setFixedHeight(height)
        self.fill_summary = plain_label(wrap=True)
        self.fill_summary.setStyleSheet("color: #555;")
        answer_layout = QVBoxLayout(self.answer_group)
        answer_layout.addWidget(self.tokens_label)
        answer_layout.addWidget(self.flip_label)
        answer_layout.addWidget(self.answer_table)
        answer_layout.addWidget(self.fill_summary)
        answer_layout.addStretch(1)

        self.routing_group = QGroupBox("Routing read-outs for the region")
        self.top_k = QSpinBox()
        self.top_k.setRange(1, 64)
        self.top_k.setValue(5)
        self.top_k.setPrefix("top ")
        self.top_k.valueChanged.connect(lambda _: self._show_routing())
        self.routing_numbers = QGridLayout()
        self.rollout_value = plain_label("—")
        self.dla_value = plain_label("—")
        self.mean_mass_value = plain_label("—")
        for r, (name, widget) in enumerate(
            (
                ("rollout mass", self.rollout_value),
                ("DLA through region", self.dla_value),
                ("mean head mass", self.mean_mass_value),
            )
        ):
            self.routing_numbers.addWidget(plain_label(name), r, 0)
            self.routing_numbers.addWidget(widget, r, 1)
        self.heads_title = plain_label("attention mass per head")
        self.heads_table = _readonly_table(0, ["head", "block", "mass"])
        self.heads_table.verticalHeader().setVisible(False)
        routing_caption = plain_label(
            "attention, rollout and DLA show routing and the direct write from one capture of the original; "
            "the answer change is the causal read-out",
            wrap=True,
        )
        routing_caption.setStyleSheet("color: #666; font-size: 9pt;")
        heads_row = box(QHBoxLayout(), (self.heads_title, 1), self.top_k)
        routing_layout = QVBoxLayout(self.routing_group)
        routing_layout.addLayout(self.routing_numbers)
        routing_layout.addLayout(heads_row)
        routing_layout.addWidget(self.heads_table, stretch=1)
        routing_layout.addWidget(routing_caption)

        numbers_box = boxed(QHBoxLayout(), (self.answer_group, 1), (self.routing_group, 1))

        answer_change = split(Qt.Orientation.Vertical, self.edited_view, numbers_box, sizes=[240, 400])
        self.numbers_tabs = QTabWidget()
        self.numbers_tabs.addTab(answer_change, "Answer change")
        self.numbers_tabs.addTab(self.sweep_box, "Occlusion sweep")
        splitter = split(Qt.Orientation.Horizontal, self.canvas, self.controls_scroll, self.numbers_tabs)
        for i, stretch in enumerate((3, 0, 4)):
            splitter.setStretchFactor(i, stretch)
        for i in (0, 1):
            splitter.setCollapsible(i, False)  # neither the painter nor its controls can vanish
        splitter.setSizes([400, 220, 640])
        self.splitter = splitter
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(splitter)
        self._clear_numbers()

    def _add_control(self, item: QWidget | QHBoxLayout) -> None:
        if isinstance(item, QWidget):
            self.controls_layout.addWidget(item)
        else:
            self.controls_layout.addLayout(item)

    def add_controls(self, *widgets: QWidget) -> None:
        """Put ``widgets`` (the window's intervention buttons) at the end of the controls
        column, beside the painter, so they are on screen with it."""
        stretch = self.controls_layout.count() - 1  # the stretch stays last
        for offset, widget in enumerate(widgets):
            self.controls_layout.insertWidget(stretch + offset, widget)
        self.controls_scroll.setMinimumWidth(self.controls_scroll.widget().minimumSizeHint().width() + 16)

    def add_results(self, widget: QWidget, title: str) -> None:
        """Put ``widget`` (the window's intervention results) in a tab ``title`` beside the answer
        change; :meth:`show_results` brings it up."""
        self.numbers_tabs.addTab(widget, title)

    def host_interventions(self, panel: InterventionPanel) -> None:
        """The Interventions box: its controls in the controls column beside the painter (on screen
        with it), its results table in a tab beside the answer change; :meth:`draw` draws it too."""
        self.add_controls(panel)
        self.add_results(panel.results, "Interventions")
        self.interventions = panel

    def show_results(self, widget: QWidget | None = None) -> None:
        """Bring up the results tab of ``widget`` (None: the answer change)."""
        self.numbers_tabs.setCurrentIndex(0 if widget is None else self.numbers_tabs.indexOf(widget))

    def run_buttons(self) -> tuple[QPushButton, ...]:
        """The buttons that start a job (disabled while one runs)."""
        return self.run_button, self.sweep_button

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        """Preferred height = minimum height: the panel fills the height it is given, and a
        scroll area around it (the window's tab) never scrolls its controls out of sight."""
        hint = super().sizeHint()
        return QSize(hint.width(), self.minimumSizeHint().height())

    def hasHeightForWidth(self) -> bool:  # noqa: N802
        return False  # a wrapped label inside must not make an enclosing scroll area size the panel by it

    def _add_option_page(self, *widgets: QWidget) -> int:
        return self.fill_options.addWidget(boxed(QHBoxLayout(), *widgets, end_stretch=True))

    # ----- data in -------------------------------------------------------

    def set_image(self, image) -> None:
        """Show an image (PIL or ``(H, W, 3)`` uint8, row 0 at the top) on the paint
        canvas and the sweep map; clears the mask, its history and the results."""
        if isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGB"))
        self.image = np.asarray(image)
        self.canvas.set_image(self.image)
        self.sweep_canvas.set_image(self.image)
        self.sweep_canvas.set_tokens([])
        self.clear_result()
        self.clear_sweep()

    def set_tokens(self, tokens: Sequence | None, *, view_names: Mapping[int, str] | None = None) -> None:
        """The visual tokens (``VisualToken`` or their dicts) drawn as the patch grid
        (``view_names``: the family's names of the views, as the main canvas gets them)."""
        self.tokens = list(tokens or [])
        self.canvas.set_tokens(self.tokens, view_names=view_names)
        self._update_region_label(self.canvas.mask())

    def set_token_note(self, text: str) -> None:
        """The canvas note about what a visual token is (tiles, merged blocks, pooled)."""
        self.canvas.set_token_note(text)

    def set_brush_size(self, size: int) -> None:
        """Brush and eraser diameter in image pixels (moves the size slider)."""
        self.size_slider.setValue(int(size))

    def mask(self) -> np.ndarray:
        """The painted region, ``(H, W)`` bool (a copy)."""
        return self.canvas.mask()

    def set_busy(self, busy: bool) -> None:
        """Disable Run and the sweep while a job runs."""
        self.run_button.setEnabled(not busy)
        self.sweep_button.setEnabled(not busy)

    def show_message(self, text: str, *, error: bool = False) -> None:
        """One line under the canvas (red when ``error``)."""
        self.message_label.setStyleSheet("color: #c00000;" if error else "color: #333;")
        self.message_label.setText(text)

    # ----- fill ----------------------------------------------------------

    def set_fill(self, kind: str, *, color=None, radius=None, seed=None, paste_from=None) -> None:
        """Choose the fill and its options (``color=(r, g, b)``, ``radius``, ``seed``, ``paste_from``;
        None: as they are)."""
        if kind not in FILLS:
            raise ValueError(f"unknown fill {kind!r}; expected one of {', '.join(FILLS)}")
        if color is not None:
            self._color = tuple(int(v) for v in color)
            self._set_color_swatch()
        if radius is not None:
            self.radius_spin.setValue(float(radius))
        if seed is not None:
            self.seed_spin.setValue(int(seed))
        if paste_from is not None:
            self.set_paste_source(paste_from)
        self.fill_combo.setCurrentText(kind)

    def restore_fill(self, fill: Fill, run_id: int, paste_file: str | None = None) -> str | None:
        """Choose the fill run ``run_id`` ran with (:func:`recorded_fill`; ``paste_file``: the file a
        paste's pixels were read from, as the request recorded it). A paste source that was no file
        cannot be chosen again: no source is chosen (Run refuses until one is) and the source line
        says so in red; the same words are returned (None: the whole fill is the run's)."""
        kind, options = recorded_fill(fill)
        if kind == "paste" and not options and paste_file:
            options = {"paste_from": paste_file}
        self.set_fill(kind, **options)
        if kind != "paste" or options:
            return None
        self.paste_source = None
        missing = f"run #{run_id} pasted from an image that was no file: choose it again"
        self.paste_label.setText(missing)
        self.paste_label.setToolTip(missing)
        self.paste_label.setStyleSheet("color: #c00000;")
        return missing

    def restore_sweep(self, sweep: OcclusionMap, run_id: int, paste_file: str | None = None) -> str | None:
        """The sweep controls of run ``run_id`` (its ``k`` and fill); what could not be chosen again,
        as :meth:`restore_fill` says it."""
        self.sweep_k.setValue(int(sweep.k))
        return self.restore_fill(sweep.fill, run_id, paste_file)

    def fill_choice(self) -> tuple[str, dict]:
        """``(fill, options)`` as :func:`core.methods.counterfactual.region_counterfactual` takes them."""
        kind = self.fill_combo.currentText()
        if kind == "constant":
            return kind, {"color": tuple(self._color)}
        if kind == "blur":
            return kind, {"radius": float(self.radius_spin.value())}
        if kind == "noise":
            return kind, {"seed": int(self.seed_spin.value())}
        if kind == "paste":
            return kind, {"paste_from": self.paste_source} if self.paste_source else {}
        return kind, {}

    def set_paste_source(self, path: str | Path) -> None:
        self.paste_source = str(path)
        self.paste_label.setText(Path(path).name)
        self.paste_label.setToolTip(str(path))
        self.paste_label.setStyleSheet("color: #555;")

    def _on_fill_changed(self, kind: str) -> None:
        self.fill_options.setCurrentIndex(self._option_pages.get(kind, 0))

    def _set_color_swatch(self) -> None:
        r, g, b = self._color
        text_color = "#000" if (r * 299 + g * 587 + b * 114) / 1000 > 128 else "#fff"
        self.color_button.setText(f"RGB {r}, {g}, {b}")
        self.color_button.setStyleSheet(f"background: rgb({r}, {g}, {b}); color: {text_color};")

    def _pick_color(self) -> None:
        color = QColorDialog.getColor(QColor(*self._color), self, "Constant fill colour")
        if color.isValid():
            self._color = (color.red(), color.green(), color.blue())
            self._set_color_swatch()

    def _pick_paste_source(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Paste the region from", "", IMAGE_FILTER)
        if path:
            self.set_paste_source(path)

    # ----- actions -------------------------------------------------------

    def request_run(self) -> bool:
        """Emit ``run_requested(mask, fill, options)``; False (and the reason in the panel) when
        there is no image, no painted pixel, or a paste fill without a source."""
        mask = self.canvas.mask()
        kind, options = self.fill_choice()
        refusal = self._fill_refusal(kind, options, mask)
        if refusal is not None:
            self.show_message(refusal.message, error=True)
            return False
        self.run_requested.emit(mask, kind, options)
        return True

    def request_sweep(self) -> bool:
        """Emit ``sweep_requested(k)``; False (and the reason in the panel) without an image, or
        with a paste fill without a source."""
        kind, options = self.fill_choice()
        refusal = self._fill_refusal(kind, options)
        if refusal is not None:
            self.show_message(refusal.message, error=True)
            return False
        self.sweep_requested.emit(int(self.sweep_k.value()))
        return True

    def counterfactual_request(
        self, asked: Mapping, mask: np.ndarray | None = None, fill: str | None = None, options: dict | None = None
    ) -> CounterfactualRequest | Refusal:
        """The region counterfactual of the asked input (``asked``: the
        :class:`core.requests.base.AskedRequest` fields the window gives), filling ``mask`` with
        ``fill`` and its ``options`` (None: the painted region, the chosen fill: what
        :attr:`run_requested` carries); or why it cannot run."""
        mask = self.canvas.mask() if mask is None else mask
        if fill is None:
            fill, options = self.fill_choice()
        fields = self._fill_fields(fill, options or {}, mask)
        if isinstance(fields, Refusal):
            return fields
        return CounterfactualRequest(**asked, mask=mask, fill=fill, **fields)

    def sweep_request(self, asked: Mapping, k: int | None = None) -> SweepRequest | Refusal:
        """The occlusion sweep of the asked input with ``k`` x ``k`` cells (None: the panel's k) and
        the chosen fill; or why it cannot run."""
        k = int(self.sweep_k.value()) if k is None else int(k)
        fill, options = self.fill_choice()
        fields = self._fill_fields(fill, options)
        if isinstance(fields, Refusal):
            return fields
        return SweepRequest(**asked, k=k, fill=fill, **fields)

    def show_running(self, request: CounterfactualRequest | SweepRequest) -> None:
        """The "running: …" line of ``request`` (the panel's), until the job ends or its result is drawn."""
        if request.name == "sweep":
            k = request.k
            self.running.show(f"running the occlusion sweep ({k}x{k} patches per cell, {request.fill})…")
        else:
            self.running.show(f"running: {request.fill} fill over {int(np.count_nonzero(request.mask))} px…")

    def end_running(self) -> None:
        """The job ended: its "running: …" line goes (a message shown since stays)."""
        self.running.end()

    def _fill_refusal(self, fill: str, options: dict, mask: np.ndarray | None = None) -> Refusal | None:
        """Why a fill of ``mask`` (None: a sweep, which fills every cell) cannot run: no image, no
        painted pixel (until one is painted), a paste fill without a source; None when it can."""
        if self.image is None:
            return Refusal("no image to edit" if mask is not None else "no image to sweep")
        if mask is not None and not mask.any():
            return Refusal(PAINT_FIRST, lambda: self.canvas.mask().any())
        if fill == "paste" and not options.get("paste_from"):
            return Refusal(NO_PASTE)
        return None

    def _fill_fields(self, fill: str, options: dict, mask: np.ndarray | None = None) -> dict | Refusal:
        """A fill request's fields of the fill options (a paste source read into pixels, with the
        file it was read from), or why it cannot run."""
        refusal = self._fill_refusal(fill, options, mask)
        if refusal is not None:
            return refusal
        fields = dict(options)
        source = fields.pop("paste_from", None)
        if source is not None:
            pixels = read_source(source)
            if isinstance(pixels, Refusal):
                return pixels
            fields.update(paste_from=pixels, paste_from_path=str(source))
        return fields

    def _on_mask_changed(self, mask: np.ndarray) -> None:
        self._update_region_label(mask)
        if mask.any() and self.message_label.text() == PAINT_FIRST:
            self.show_message("")  # a region is painted now: the refusal no longer holds
        self.mask_changed.emit(mask)

    def _on_mode_changed(self, mode: str) -> None:
        b = self.tool_buttons.get(mode)
        if b is not None and not b.isChecked():
            b.setChecked(True)

    def _on_size(self, value: int) -> None:
        self.canvas.set_brush_size(value)
        self.size_label.setText(f"size {value} px")

    def _update_region_label(self, mask: np.ndarray) -> None:
        area = int(np.count_nonzero(mask))
        if not area:
            self.region_label.setText("region: nothing painted")
            return
        touched = 0
        if self.canvas.cells:
            b = np.array([t.box for t in self.canvas.cells])
            h, w = mask.shape
            for x0, y0, x1, y1 in b:
                xa, ya = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
                xb, yb = min(w, int(np.ceil(x1))), min(h, int(np.ceil(y1)))
                if xb > xa and yb > ya and mask[ya:yb, xa:xb].any():
                    touched += 1
        self.region_label.setText(f"region: {area} px, touches {touched} of {len(self.canvas.cells)} patch tokens")

    # ----- results -------------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s results of :data:`DRAWN_KINDS` (a live run and a restored one alike): the
        answer change, the occlusion map, the interventions table and the visual-token grid of its
        read-out, each emptied when the run has none; the tab of ``kind`` (the result just shown)
        comes up. None clears them all; the painted region and the image stay (they are inputs)."""
        results = run.results if run is not None else {}
        self.draw_tokens(analysis_of(run))
        counterfactual, sweep = results.get("counterfactual"), results.get("sweep")
        if counterfactual is not None:
            self.set_result(counterfactual)
        else:
            self.clear_result()
        if sweep is not None:
            self.set_sweep(sweep)
        else:
            self.clear_sweep()
        if self.interventions is not None:
            self.interventions.draw(run, kind)
        tabs = {"counterfactual": None, "sweep": self.sweep_box}
        if self.interventions is not None:
            tabs["intervention"] = self.interventions.results
        if kind in tabs and kind in results:  # the result just made (or restored) is what to see
            self.show_results(tabs[kind])
        self.running.end()  # its result is drawn

    def draw_tokens(self, analysis: AnalyzeResult | None) -> None:
        """The patch grid of ``analysis``'s visual tokens and the note on their layout, on the
        painter (as the main canvas draws them: :meth:`app.canvas.ImageCanvas.draw_tokens`); None
        clears them."""
        self.tokens = list(analysis.input.visual_tokens) if analysis is not None else []
        self.canvas.draw_tokens(analysis)
        self._update_region_label(self.canvas.mask())

    def set_result(self, result: RegionCounterfactual, edited_image=None) -> None:
        """Show a region counterfactual (made now, or restored from a session). ``edited_image``
        ``(H, W, 3)`` uint8 (default: the result's ``edited_image``, which a restored one has not)."""
        if edited_image is None:
            edited_image = result.edited_image
        self.result = result
        o, e, eff = result.original, result.edited, result.effect
        self.tokens_label.setText(
            f"answer {o.answer!r} vs foil {o.foil!r}"
            if o.foil is not None
            else f"answer {o.answer!r} (no foil: logit only)"
        )
        if eff.flipped:
            self.flip_label.setText(f"flipped: predicted {o.predicted!r} → {e.predicted!r}")
            self.flip_label.setStyleSheet("color: #b00000;")
        else:
            self.flip_label.setText(f"not flipped: predicted {o.predicted!r} both times")
            self.flip_label.setStyleSheet("color: #1b6e1b;")
        rows = [
            (o.predicted, e.predicted, "flipped" if eff.flipped else "same"),
            (_fmt(o.prob), _fmt(e.prob), _fmt(eff.prob_change, True)),
            (_fmt(o.logit), _fmt(e.logit), _fmt(eff.logit_change, True)),
            (_fmt(o.logit_diff), _fmt(e.logit_diff), _fmt(eff.logit_diff_change, True)),
        ]
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                item = QTableWidgetItem(str(text))
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.answer_table.setItem(r, c, item)
        fill = result.fill.kind
        self.fill_summary.setText(f"fill: {result.fill.describe()}  ·  region {result.mask_area_px} px")
        if edited_image is not None:
            self.edited_view.set_image(np.asarray(edited_image), f"edited image ({fill} fill)")
        else:
            self.edited_view.set_image(None, "edited image: not in the result")
        self._show_routing()

    def _show_routing(self) -> None:
        routing = self.result.routing if self.result is not None else None
        if routing is None:
            for label in (self.rollout_value, self.dla_value, self.mean_mass_value):
                label.setText("—")
            self.heads_title.setText(
                "attention mass per head: not computed" if self.result else "attention mass per head"
            )
            self.heads_table.setRowCount(0)
            return
        rollout, alpha = routing.rollout_mass, routing.rollout_alpha
        # what the result's audit rows say is not defined for this architecture (a hybrid decoder's
        # rollout; Gemma 3n's source contributions), in place of a number
        undefined = {a.method: a.notes[0] for a in self.result.audit_records() if a.parameters.get("defined") is False}
        self.rollout_value.setText(
            f"{rollout:.4f}" + (f"  (α = {alpha})" if alpha is not None else "")
            if rollout is not None
            else f"— ({undefined['rollout / flow']})"
            if "rollout / flow" in undefined
            else "— (prompt too long for full patterns)"
        )
        dla = routing.dla_through_region
        self.dla_value.setText(
            _fmt(dla, True) + "  (frozen-scale)"
            if dla is not None
            else f"— ({undefined['source contribution']})"
            if "source contribution" in undefined
            else "—"
        )
        heads = routing.attention_mass
        self.mean_mass_value.setText(f"{routing.mean_attention_mass:.4f} over {len(heads)} heads" if heads else "—")
        top = routing.top_heads(min(int(self.top_k.value()), len(heads)))
        self.heads_title.setText(f"attention mass per head, top {len(top)} of {len(heads)}")
        self.heads_table.setRowCount(len(top))
        for r, h in enumerate(top):
            for c, text in enumerate((h.name, h.block, f"{h.mass:.4f}")):
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.heads_table.setItem(r, c, item)

    def clear_result(self) -> None:
        self.result = None
        self.edited_view.set_image(None, "edited image")
        self._clear_numbers()

    def _clear_numbers(self) -> None:
        self.tokens_label.setText("no run yet: paint a region, choose a fill, press Run")
        self.flip_label.setText("")
        for r in range(self.answer_table.rowCount()):
            for c in range(self.answer_table.columnCount()):
                self.answer_table.setItem(r, c, QTableWidgetItem(""))
        self.fill_summary.setText("")
        self._show_routing()

    # ----- occlusion sweep ------------------------------------------------

    def set_sweep(self, sweep: OcclusionMap | np.ndarray, *, label: str | None = None) -> None:
        """Show an occlusion-sweep map on the patch grid: an ``OcclusionMap`` (made now, or restored
        from a session) on its cells, or a bare ``(grid_rows, grid_cols)`` array of effects on the
        panel's visual tokens (k = 1). ``label``: what the values are (default from the sweep)."""
        flipped = k = fill = None
        if isinstance(sweep, OcclusionMap):
            grid_values = np.array(sweep.effect, dtype=np.float64)
            name = "logit diff change" if sweep.logit_diff_change is not None else "answer logit change"
            tokens, flipped, k, fill = sweep.cell_tokens(), sweep.flipped, sweep.k, sweep.fill.kind
        else:
            grid_values, name, tokens, k = np.array(sweep, dtype=np.float64), "effect", self.tokens, 1
        if grid_values.ndim != 2:
            raise ValueError(f"the sweep map must be a (rows, cols) grid, got shape {grid_values.shape}")
        self.sweep = sweep
        self.sweep_canvas.set_tokens(tokens, image=None)
        self.sweep_canvas.set_heatmap(grid_values, label=label or name)
        where = f"k = {k}"
        self.sweep_title.setText("occlusion sweep" + (f" ({where}, {fill} fill)" if fill else f" ({where})"))
        finite = np.isfinite(grid_values)
        parts = []
        if finite.any():
            worst = np.unravel_index(np.nanargmin(grid_values), grid_values.shape)
            parts.append(f"largest drop {-float(np.nanmin(grid_values)):.3f} at cell [{worst[0]}, {worst[1]}]")
        if flipped is not None:
            parts.append(f"{int(np.sum(np.asarray(flipped, dtype=bool)))} cells flip the answer")
        if not finite.all():
            parts.append(f"{int((~finite).sum())} cells not run")
        parts.append("patch-granular: each cell filled on its own")
        self.sweep_summary.setText("; ".join(parts))

    def clear_sweep(self) -> None:
        self.sweep = None
        self.sweep_canvas.clear_heatmap()
        self.sweep_title.setText("occlusion sweep: not run")
        self.sweep_summary.setText("")
