"""The image canvas: the image, its visual-token patch grid, a patch-granular
heatmap, hover read-outs, and a paintable region mask.

Coordinates are original-image pixels everywhere: the image item sits at
``(0, 0)`` with one scene unit per pixel, rows go down (row-major, y inverted),
and a token's ``box = [x0, y0, x1, y1]`` (:class:`core.forward.geometry.VisualToken`)
is drawn where it lies on the picture the user opened.

Heatmaps are drawn per patch (one filled box per visual token) by default.
The "interpolated" toggle swaps in an upsampled smooth view and, while it is
on, a banner on the canvas says ``interpolated: visual smoothing, not a
causal pixel mask``.

A tiled or multi-view model sees the image several times (:mod:`core.views`):
the view selector draws one view's grid and heatmap, or all views laid out on
the image (the finest on top), and a dashed outline marks the region of the
image each shown view covers (LLaVA-1.5's centre crop leaves the sides out).

The canvas draws itself from the run it is shown for (:meth:`ImageCanvas.draw`,
the protocol of :class:`app.run_frame.RunFrame`): the analyze result's visual
tokens, their layout note and its rollout map; a head's answer-row map
(:meth:`ImageCanvas.show_head_map`) and a head's per-source map
(:meth:`ImageCanvas.show_sources_map`) are of the same run. The image is the
input, set apart (:meth:`ImageCanvas.set_image`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PIL import Image
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFontMetricsF, QPen
from PySide6.QtWidgets import (
    QCheckBox,
    QGraphicsEllipseItem,
    QGraphicsItem,
    QGraphicsRectItem,
    QHBoxLayout,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.canvas.brush import MaskPainter
from app.canvas.items import GridItem, PatchHeatmapItem, box_rect, cosmetic_pen, layer_clips
from app.canvas.views import ALL_VIEWS, ViewSelector, default_choice, shown_views
from app.components.workspace import answer_token_label
from app.panels import analysis_of
from app.widgets import KeepingLabel, elide_keeping, plain_label
from core.methods.counterfactual import INTERPOLATED_FLAG
from core.methods.patterns import primary_image as _primary_image
from core.views import ImageView, image_views, patch_values

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult
    from core.methods.patterns import HeadSummary
    from core.readouts.rollout import RolloutSection

INTERPOLATED_TEXT = f"interpolated: {INTERPOLATED_FLAG}"
MODES = ("view", "brush", "eraser", "box")
SEQUENTIAL_MAP = "viridis"
DIVERGING_MAP = "CET-D1"  # blue - white - red, symmetric levels around 0
MAX_SMOOTH_SIDE = 768  # the interpolated view is rendered at most this many pixels on a side
HOVER_PROMPT = "hover over the image for a token"
FIT_PADDING = 0.02  # the margin around the image when the view fits it (share of its size)


@dataclass(frozen=True)
class CanvasToken:
    """A visual token as the canvas draws it.

    Attributes:
        item: position in the token list given to :meth:`ImageCanvas.set_tokens`
            (a per-token value array is indexed by it).
        index: the token's own ``index`` (ordinal among the visual tokens).
        image, row, col: which image (or tile) and its patch row / column.
        box: ``(x0, y0, x1, y1)`` in original-image pixels.
    """

    item: int
    index: int
    image: int
    row: int
    col: int
    box: tuple[float, float, float, float]

    def to_dict(self) -> dict:
        return {"index": self.index, "image": self.image, "row": self.row, "col": self.col, "box": list(self.box)}


def _field(t: Any, name: str, default=None):
    if isinstance(t, Mapping):
        return t.get(name, default)
    return getattr(t, name, default)


def as_canvas_tokens(tokens: Sequence) -> list[CanvasToken]:
    """:class:`CanvasToken` for each ``VisualToken`` or analyze-JSON token dict (``index, image, row, col, box``)."""
    out = []
    for i, t in enumerate(tokens):
        box = _field(t, "box")
        out.append(
            CanvasToken(
                i,
                int(_field(t, "index", i)),
                int(_field(t, "image", 0) or 0),
                int(_field(t, "row", -1)),
                int(_field(t, "col", -1)),
                tuple(float(v) for v in box) if box is not None else (0.0, 0.0, 0.0, 0.0),
            )
        )
    return out


def primary_image(tokens: Sequence[CanvasToken]) -> int | None:
    """The image whose patch boxes cover the most area (the whole-image view:
    ``core.methods.patterns.primary_image``); None without patch tokens."""
    return _primary_image(tokens) if any(t.col >= 0 for t in tokens) else None


def describe_token_layout(tokens: Sequence, family: str | None = None) -> str:
    """A one-line note for the canvas when the visual tokens are not one plain
    patch grid of the image (tiles, merged blocks, tokens without a patch);
    ``""`` when they are. ``family`` (the adapter's) names known cases."""
    toks = as_canvas_tokens(tokens)
    images = sorted({t.image for t in toks if t.col >= 0})
    no_patch = sum(1 for t in toks if t.col < 0)
    notes = []
    fam = (family or "").lower()
    if len(images) > 1:
        notes.append(
            f"visual tokens come from {len(images)} views of the image: the view selector draws one of them, "
            "or all laid out on the image (the finest on top)"
        )
    if fam.startswith("qwen2") or "qwen" in fam:
        notes.append("each visual token is a merged 2x2 block of patches")
    if fam.startswith("idefics") or "smolvlm" in fam:
        notes.append("each visual token is a pixel-shuffled block of patches")
    if no_patch:
        notes.append(
            f"{no_patch} visual token(s) have no patch of their own (newline / CLS / pooled): no cell on the image"
        )
    return "; ".join(notes)


def read_token(analysis: AnalyzeResult) -> str:
    """The token an analyze result's maps are about (the answer row predicts it): ``answer token 2
    'zero'`` when it read at a token of an answer (with ``target 'blue' at`` before it when another
    target was typed), else ``answer 'square'``."""
    target, answer_text = analysis.target, analysis.answer_text
    if answer_text is None:
        return f"answer {target.answer!r}"
    at = answer_token_label(answer_text)
    typed = target.answer_id != answer_text.token_id
    return f"target {target.answer!r} at {at}" if typed else at


class _CanvasViewBox(pg.ViewBox):
    """A ViewBox that hands left-button drags and clicks to the canvas's tool
    while a paint tool is active; otherwise it pans and zooms as usual."""

    def __init__(self, canvas: ImageCanvas):
        super().__init__(lockAspect=True, invertY=True, enableMenu=False)
        self._canvas = canvas

    def mouseDragEvent(self, ev, axis=None) -> None:
        if self._canvas.mode() != "view" and ev.button() == Qt.MouseButton.LeftButton:
            ev.accept()
            self._canvas._tool_drag(ev)
            return
        super().mouseDragEvent(ev, axis)

    def mouseClickEvent(self, ev) -> None:
        if self._canvas.mode() in ("brush", "eraser") and ev.button() == Qt.MouseButton.LeftButton:
            ev.accept()
            p = self.mapSceneToView(ev.scenePos())
            self._canvas.begin_stroke(p.x(), p.y())
            self._canvas.end_stroke()
            return
        super().mouseClickEvent(ev)


class ImageCanvas(QWidget):
    """An image with its visual-token grid, a patch heatmap and a paintable mask.

    Drawn with :meth:`draw` (a run's tokens and rollout map; :meth:`show_head_map`,
    :meth:`show_sources_map` of the same run). Data in: :meth:`set_image`, :meth:`set_tokens`, :meth:`set_heatmap`,
    :meth:`set_token_note`, :meth:`set_mask`; :meth:`set_view` picks the view
    of a tiled or multi-view model (the selector above the image). Tools: :meth:`set_mode`
    (``"view"`` pans and zooms; ``"brush"``, ``"eraser"``, ``"box"`` edit the
    mask), :meth:`set_brush_size`, :meth:`undo`, :meth:`redo`,
    :meth:`clear_mask`. Painting by program (tests, scripts) uses
    :meth:`begin_stroke` / :meth:`stroke_to` / :meth:`end_stroke` and
    :meth:`paint_box` with image-pixel coordinates.

    Signals:
        mask_changed(np.ndarray): ``(H, W)`` bool copy after each finished edit.
        token_hovered(int): the hovered token's position in the token list, -1 for none.
        mode_changed(str): the tool changed.
        view_changed(object): the shown view changed (a view's ``image``, or ``"all"``).
    """

    mask_changed = Signal(object)
    token_hovered = Signal(int)
    mode_changed = Signal(str)
    view_changed = Signal(object)

    def __init__(self, parent: QWidget | None = None, *, paint: bool = False):
        super().__init__(parent)
        self.run: ShownRun | None = None  # the run drawn (draw): the head and source maps are its
        self.image: np.ndarray | None = None
        self.tokens: list[CanvasToken] = []
        self.cells: list[CanvasToken] = []  # the tokens drawn as grid cells (col >= 0, shown views), token order
        self.views: list[ImageView] = []  # every view of the image in the token list (core.views)
        self.shown: list[ImageView] = []  # the views drawn, in draw-layer order (finest first)
        self.shown_image: int | None = None  # the shown view's image; None for all views
        self._view_choice: int | str | None = None  # a view's image, ALL_VIEWS, or None (no views)
        self._wanted_view: str | None = None  # the name of the view the user picked, kept across runs
        self._view_names: dict[int, str] = {}
        self._cell_layers = np.zeros(0, dtype=int)  # each cell's draw layer (index into self.shown)
        self._clips: list = [None]  # each draw layer's clip path (items.layer_clips)
        self.values: np.ndarray | None = None  # per token in self.tokens (NaN: none)
        self.levels: tuple[float, float] | None = None
        self.colormap: pg.ColorMap | None = None
        self.heatmap_label = ""
        self.token_read = ""  # the token the tokens' run is about: every heatmap's title names it
        self._heat_request: tuple = (None, None)  # the levels and colour map set_heatmap was given
        self._boxes = np.zeros((0, 4))
        self._mode = "view"
        self._interpolated = False
        self._box_start: QPointF | None = None
        self._build()
        self.painter = MaskPainter(self)
        self.painter.overlay.setZValue(30)
        self.plot.addItem(self.painter.overlay)
        self.painter.mask_changed.connect(self.mask_changed)
        self.undo_stack = self.painter.undo_stack
        self.set_mode("brush" if paint else "view")

    # ----- layout -------------------------------------------------------

    def _build(self) -> None:
        self.grid_check = QCheckBox("grid")
        self.grid_check.setChecked(True)
        self.grid_check.toggled.connect(self.set_grid_visible)
        self.heatmap_check = QCheckBox("heatmap")
        self.heatmap_check.setChecked(True)
        self.heatmap_check.toggled.connect(lambda _: self._show_heatmap_items())
        self.interpolated_check = QCheckBox("interpolated")
        self.interpolated_check.setToolTip(
            "show an upsampled, smoothed heatmap (display only: " + INTERPOLATED_FLAG + ")"
        )
        self.interpolated_check.toggled.connect(self.set_interpolated)
        self.fit_button = QToolButton()
        self.fit_button.setText("Fit")
        self.fit_button.setToolTip("fit the whole image in the view (F)")
        self.fit_button.clicked.connect(self.fit_view)
        # one elided line of its own under the controls (the whole title in its tooltip): a long title
        # neither widens the window (1280 px must hold every panel) nor pushes the image down by a line,
        # and the token the map is about is kept whole while the rest is elided
        self.heatmap_title = KeepingLabel()
        self.heatmap_title.setStyleSheet("font-weight: bold;")
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.grid_check)
        top.addWidget(self.heatmap_check)
        top.addWidget(self.interpolated_check)
        top.addWidget(self.fit_button)
        self.view_selector = ViewSelector()
        self.view_selector.currentIndexChanged.connect(self._on_view_picked)
        top.addWidget(self.view_selector)
        top.addStretch(1)

        # wraps at the canvas's width and never sets it (a LLaVA-NeXT note widened the window)
        self.note_label = plain_label(wrap=True)
        self.note_label.setStyleSheet("background: #fff3cd; color: #664d03; padding: 3px; border: 1px solid #e0c060;")
        self.note_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.note_label.hide()

        self.view = pg.GraphicsLayoutWidget()
        self.view.setBackground("w")
        self.view.setAcceptDrops(False)
        self.view.viewport().setAcceptDrops(False)
        self.view.ci.layout.setContentsMargins(2, 2, 2, 2)
        self.viewbox = _CanvasViewBox(self)
        self.plot = self.view.addPlot(viewBox=self.viewbox)
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).setStyle(tickLength=-4)
            self.plot.getAxis(axis).setTextPen("#444")
        self.viewbox.setBackgroundColor("#e6e6e6")  # shows the image's edges
        self.image_item = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image_item)
        # overlays above the image, by depth: heatmaps, the patch grid, hover box, brush cursor and box tool
        self.heatmap_item = self._overlay(PatchHeatmapItem(), 10, opacity=0.55)
        self.smooth_item = self._overlay(pg.ImageItem(axisOrder="row-major"), 10, opacity=0.55, hidden=True)
        self.grid_item = self._overlay(GridItem(), 20)
        # the region each shown view covers (dashed, above the grid): the crop the processor kept
        self.outline_item = self._overlay(GridItem([cosmetic_pen(QColor(255, 140, 0), 2, Qt.PenStyle.DashLine)]), 25)
        self.hover_item = self._overlay(QGraphicsRectItem(), 40, pen=cosmetic_pen(QColor(255, 200, 0), 2), hidden=True)
        self.cursor_item = self._overlay(
            QGraphicsEllipseItem(), 50, pen=cosmetic_pen(QColor(20, 20, 20), 1), hidden=True
        )
        self.box_item = self._overlay(
            QGraphicsRectItem(), 50, pen=cosmetic_pen(QColor(255, 0, 170), 2, Qt.PenStyle.DashLine), hidden=True
        )
        self.box_item.setBrush(QBrush(QColor(255, 0, 170, 40)))

        self.colorbar = pg.ColorBarItem(
            values=(0, 1), width=14, colorMap=pg.colormap.get(SEQUENTIAL_MAP), interactive=False, colorMapMenu=False
        )
        self.colorbar.getAxis("right").setTextPen("#222")
        self.colorbar.axis.setWidth(None)  # ColorBarItem fixes 45 px: a label then overlapped the tick values
        self.colorbar.axis.enableAutoSIPrefix(False)  # ticks in the values' own units, no "(x0.001)" on the label
        self.colorbar.geometryChanged.connect(self._fit_colorbar_label)
        self.view.addItem(self.colorbar)
        self.colorbar.hide()

        # The banner lives on the view itself (a child widget over the viewport): it stays put
        # whatever the zoom, and shows in screenshots.
        self.interpolated_label = plain_label(INTERPOLATED_TEXT, parent=self.view)
        self.interpolated_label.setStyleSheet(
            "background: rgba(255, 235, 150, 235); color: #5a3b00; font-weight: bold; padding: 3px 6px;"
            "border: 1px solid #b8860b;"
        )
        self.interpolated_label.move(8, 8)
        self.interpolated_label.adjustSize()
        self.interpolated_label.hide()

        self.hover_label = plain_label(HOVER_PROMPT, wrap=True, selectable=True)
        self.hover_label.setStyleSheet("color: #333;")
        self.hover_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addWidget(self.heatmap_title)
        layout.addWidget(self.note_label)
        layout.addWidget(self.view, stretch=1)
        layout.addWidget(self.hover_label)

        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)

    def _overlay(
        self, item: QGraphicsItem, z: float, *, opacity: float = 1.0, pen: QPen | None = None, hidden: bool = False
    ) -> QGraphicsItem:
        """``item`` added to the plot at depth ``z`` (the image is at 0), with its opacity, pen and visibility."""
        item.setZValue(z)
        item.setOpacity(opacity)
        if pen is not None:
            item.setPen(pen)
        item.setVisible(not hidden)
        self.plot.addItem(item)
        return item

    # ----- data in -------------------------------------------------------

    def set_image(self, image) -> None:
        """Show ``image``: a PIL image or an ``(H, W)``, ``(H, W, 3)`` or ``(H, W, 4)``
        uint8 array (row 0 at the top). The mask starts empty at the image's size
        and the undo history is cleared; tokens, view and heatmap are kept (the
        views' regions are clipped to the new image)."""
        if isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB"))
        arr = np.asarray(image)
        if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
            raise ValueError(f"expected an (H, W), (H, W, 3) or (H, W, 4) image, got shape {arr.shape}")
        if arr.dtype != np.uint8:
            arr = np.clip(arr * (255.0 if arr.max(initial=0) <= 1.0 else 1.0), 0, 255).astype(np.uint8)
        self.image = arr
        self.image_item.setImage(arr, autoLevels=False, levels=(0, 255))
        self.painter.reset(arr.shape[:2])
        if self.tokens:
            self.views = image_views(self.tokens, self.image_size(), self._view_names)
            self._show_view(self._view_choice)
        self._clear_hover()
        self.fit_view()  # a new image is seen whole, whatever the zoom on the last one

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        """F fits the view: a key the canvas's own widgets (the view, its check boxes) pass up,
        so it works while the canvas has the focus and never while typing elsewhere."""
        if event.key() == Qt.Key.Key_F and not event.modifiers():
            self.fit_view()
            event.accept()
            return
        super().keyPressEvent(event)

    def fit_view(self) -> None:
        """Zoom and pan so the whole image fills the view (button "Fit", key F). Only the
        image counts: the grid or heatmap of a larger previous image must not shrink it."""
        items = [self.image_item] if self.image is not None else None
        self.viewbox.autoRange(padding=FIT_PADDING, items=items)

    def image_size(self) -> tuple[int, int] | None:
        """``(width, height)`` of the shown image."""
        return None if self.image is None else (self.image.shape[1], self.image.shape[0])

    def set_tokens(
        self,
        tokens: Sequence | None,
        image: int | str | None = "primary",
        *,
        view_names: Mapping[int, str] | None = None,
        token_read: str = "",
    ) -> None:
        """Draw the patch grid of ``tokens`` (:class:`core.forward.geometry.VisualToken` or
        their JSON dicts; boxes in original-image pixels). Tokens with ``col < 0``
        (newline, CLS) are not cells. The tokens' views (:func:`core.views.image_views`,
        named by ``view_names = {image: name}`` from the family where given) fill
        the view selector. The heatmap and the note (:meth:`set_token_note`: it
        described the old tokens) are cleared; None clears the grid too.

        Args:
            image: the view drawn: ``"primary"`` (default: the view the user last
                picked when these tokens have one of that name, else
                :func:`app.canvas.views.default_choice`), a view's ``image``, or
                None for all views laid out on the image.
            token_read: the token the run of these tokens is about (:func:`read_token`),
                named in every heatmap's title and colour bar.
        """
        self.tokens = as_canvas_tokens(tokens or [])
        self.token_read = token_read
        self.set_token_note("")
        self._view_names = dict(view_names or {})
        self.views = image_views(self.tokens, self.image_size(), self._view_names)
        if image == "primary":
            choice = self._wanted_choice()
        elif image is None:
            choice = ALL_VIEWS if self.views else None
        else:
            choice = int(image)
        self.clear_heatmap()  # and the hover read-outs
        self._show_view(choice)

    # ----- a run drawn ----------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s analyze result (live or restored alike): its tokens (:meth:`draw_tokens`)
        and its rollout map; None clears the tokens, their note and the heatmap (the image stays:
        it is the input)."""
        self.run = run
        analysis = analysis_of(run)
        self.draw_tokens(analysis)
        rollout = analysis.rollout if analysis is not None else None
        if rollout is not None:
            self.set_heatmap(
                self._patch_values(rollout),
                label=f"rollout (alpha {rollout.alpha}): structural-flow approximation, not a cause",
            )

    def draw_tokens(self, analysis: AnalyzeResult | None) -> None:
        """The patch grid of ``analysis``'s visual tokens (the views named as its family names
        them), the token it read named in every heatmap title, and the note on the tokens'
        layout (:func:`describe_token_layout`); None clears them (and the heatmap, drawn on them)."""
        if analysis is None:
            self.set_tokens(None)
            return
        tokens = analysis.input.visual_tokens
        self.set_tokens(tokens, view_names=analysis.input.view_names, token_read=read_token(analysis))
        undefined = analysis.undefined("rollout / flow")  # no rollout map, and why
        note = describe_token_layout(tokens, analysis.model.family)
        self.set_token_note("\n".join(filter(None, [note, undefined and f"rollout {undefined}"])))

    def show_head_map(self, layer: int, head: int) -> bool:
        """The drawn run's head ``head`` of block ``layer``: its answer-row attention over the
        patches, as the heatmap (patch-granular); False when the run has no such head."""
        analysis = analysis_of(self.run)
        row = analysis.head(layer, head) if analysis is not None else None
        if row is None:
            return False
        self.set_heatmap(self._patch_values(row), label=f"{row.name}: answer-row attention (routing only)")
        return True

    def show_sources_map(self, layer: int, head: int, values) -> bool:
        """A head's per-source frozen-scale DLA of the drawn run (``values``: one per visual token,
        :func:`app.panels.dla_panel.visual_token_values`) as the heatmap; False without a run."""
        analysis = analysis_of(self.run)
        if analysis is None:
            return False
        block = analysis.block_names.get(int(layer), f"block {layer}")
        self.set_heatmap(np.asarray(values), label=f"{block}.H{head}: frozen-scale DLA per source token")
        return True

    def _patch_values(self, section: HeadSummary | RolloutSection) -> np.ndarray:
        """One value per drawn token from a read-out section's patch grids (every view's, where it has them)."""
        return patch_values(self.tokens, section.visual_patch_mass, section.visual_patch_mass_by_image)

    # ----- views ---------------------------------------------------------

    def set_view(self, choice: int | str) -> None:
        """Draw one view (its ``image``) or ``"all"`` views laid out on the image;
        the heatmap shows the same run's values of the new cells. The choice is
        kept for later runs that have a view of the same name."""
        choices = self.view_selector.choices()
        if choice not in choices:
            listed = ", ".join(repr(c) for c in choices) or "none"
            raise ValueError(f"no view {choice!r} in these tokens; the views are {listed}")
        self._wanted_view = ALL_VIEWS if choice == ALL_VIEWS else next(v.name for v in self.views if v.image == choice)
        if choice != self._view_choice:
            self._show_view(choice)
            self.view_changed.emit(choice)

    def view_choice(self) -> int | str | None:
        """The shown view's ``image``, ``"all"``, or None without views."""
        return self._view_choice

    def _on_view_picked(self, index: int) -> None:
        if index >= 0:
            self.set_view(self.view_selector.itemData(index))

    def _wanted_choice(self) -> int | str | None:
        """The view the user last picked, if these tokens have it by name; else the default view."""
        if self._wanted_view == ALL_VIEWS and len(self.views) > 1:
            return ALL_VIEWS
        named = [v.image for v in self.views if v.name == self._wanted_view]
        return named[0] if named else default_choice(self.views, primary_image(self.tokens))

    def _show_view(self, choice: int | str | None) -> None:
        """Make ``choice``'s patch tokens the cells (token order; each in the draw
        layer of its view), with its outlines, and redraw the heatmap on them."""
        if choice == ALL_VIEWS and len(self.views) == 1:
            choice = self.views[0].image
        self._view_choice = choice
        self.shown = shown_views(self.views, choice)
        self.shown_image = None if choice == ALL_VIEWS else choice
        layer_of = {i: k for k, v in enumerate(self.shown) for i in v.items}
        items = sorted(layer_of)
        self.cells = [self.tokens[i] for i in items]
        self._cell_layers = np.array([layer_of[i] for i in items], dtype=int)
        self._boxes = np.array([t.box for t in self.cells], dtype=np.float64).reshape(-1, 4)
        self._clips = [None]
        if len(self.shown) > 1:  # a finer view hides the coarser ones under its extent
            bounds = box_rect(
                (self._boxes[:, 0].min(), self._boxes[:, 1].min(), self._boxes[:, 2].max(), self._boxes[:, 3].max())
            ).adjusted(-2, -2, 2, 2)
            self._clips = layer_clips([[v.extent] for v in self.shown], bounds)
        self.grid_item.set_rects([box_rect(t.box) for t in self.cells], self._cell_layers, self._clips)
        self.outline_item.set_rects([box_rect(v.region) for v in self.shown])
        self.view_selector.set_choices(self.views, choice)
        if self.values is not None:
            self._draw_heatmap()
        else:
            self._clear_hover()

    def set_heatmap(
        self,
        values,
        *,
        label: str = "",
        levels: tuple[float, float] | None = None,
        colormap: str | pg.ColorMap | None = None,
    ) -> None:
        """Colour each grid cell by a value.

        Args:
            values: one value per token in the :meth:`set_tokens` list
                (``(n_tokens,)``; a read-out's grids of every view give it with
                :func:`core.views.patch_values`), or one per drawn cell in order,
                or a grid ``(rows, cols)`` indexed by the primary image's tokens'
                ``row, col`` (the ``visual_patch_mass`` layout), or ``{token
                index: value}``. NaN leaves a cell empty. None clears the heatmap.
                The values are kept per token: another view shows its own.
            label: what the values are (shown above the canvas and on the colour bar).
            levels: ``(low, high)`` of the colour scale; default: the drawn cells'
                range, symmetric around 0 when the values change sign.
            colormap: a pyqtgraph colour-map name or ColorMap; default
                viridis, or a diverging blue-white-red map for signed values.
        """
        if values is None:
            self.clear_heatmap()
            return
        self.values = self._values_per_token(values)
        self.heatmap_label = label
        self._heat_request = (levels, colormap)
        self._draw_heatmap()

    def _draw_heatmap(self) -> None:
        """Colour the drawn cells by :attr:`values`; the scale and map follow what is drawn unless they were given."""
        levels, colormap = self._heat_request
        label = self.heatmap_label
        cell_values = np.array([self.values[t.item] for t in self.cells], dtype=np.float64)
        finite = cell_values[np.isfinite(cell_values)]  # the scale covers what is drawn
        signed = finite.size and finite.min() < 0 < finite.max()
        if levels is None:
            if not finite.size:
                levels = (0.0, 1.0)
            elif signed:
                m = float(np.abs(finite).max())
                levels = (-m, m)
            else:
                levels = (float(finite.min()), float(finite.max()))
        lo, hi = float(levels[0]), float(levels[1])
        if hi == lo:
            lo, hi = lo - 0.5, hi + 0.5
        elif hi < lo:
            lo, hi = hi, lo
        if colormap is None:
            colormap = DIVERGING_MAP if signed else SEQUENTIAL_MAP
        cmap = pg.colormap.get(colormap) if isinstance(colormap, str) else colormap
        self.levels, self.colormap = (lo, hi), cmap
        colors = self._colors(cell_values)
        self.heatmap_item.set_cells(
            [
                (t, float(v), QColor(int(c[0]), int(c[1]), int(c[2])))
                for t, v, c in zip(self.cells, cell_values, colors)
            ],
            self._cell_layers,
            self._clips,
        )
        self.colorbar.setColorMap(cmap)
        self.colorbar.setLevels((lo, hi))
        self._fit_colorbar_label()
        lead = f"heatmap for {self.token_read}" if self.token_read else "heatmap"
        self.heatmap_title.setText(f"{lead}: {label}" if label else lead, keep=[lead])
        self._update_smooth()
        self._show_heatmap_items()
        self._clear_hover()  # the hovered cell's value belonged to the old map

    def clear_heatmap(self) -> None:
        """No heatmap: its cells, its title and colour-bar label, and the hover read-outs go."""
        self.values = self.levels = self.colormap = None
        self.heatmap_label = ""
        self._heat_request = (None, None)
        self.heatmap_item.set_cells([])
        self.smooth_item.clear()
        self.heatmap_title.setText("")
        self._fit_colorbar_label()
        self._show_heatmap_items()
        self._clear_hover()

    def colorbar_label(self) -> str:
        """The colour bar's label as drawn (elided to the bar's length; "" without a heatmap)."""
        axis = self.colorbar.axis
        return axis.labelText if axis.label.isVisible() else ""

    def _fit_colorbar_label(self) -> None:
        """The heatmap label along the colour bar, elided to the bar's length, the token it is
        about kept whole (the whole label is the title above the canvas and the bar's tooltip)."""
        axis = self.colorbar.axis
        token = self.token_read if self.heatmap_label else ""
        label = f"{token}: {self.heatmap_label}" if token else self.heatmap_label
        length = self.colorbar.geometry().height() - 10
        metrics = QFontMetricsF(axis.label.font())
        shown = elide_keeping(label, [token], metrics, length) if length > 0 else label
        if shown == self.colorbar_label():
            return
        if shown:
            axis.setLabel(shown)
        else:
            axis.showLabel(False)
        self.colorbar.setToolTip(label)

    def _clear_hover(self) -> None:
        """Hide the hovered cell's box and reset the hover line (the data under them changed)."""
        self.hover_item.hide()
        self.hover_label.setText(HOVER_PROMPT)
        self.view.setToolTip("")

    def _values_per_token(self, values) -> np.ndarray:
        n = len(self.tokens)
        out = np.full(n, np.nan)
        if isinstance(values, Mapping):
            by_index = {t.index: t.item for t in self.tokens}
            for k, v in values.items():
                if int(k) in by_index:
                    out[by_index[int(k)]] = np.nan if v is None else float(v)
            return out
        arr = np.array(values, dtype=np.float64)  # None -> nan
        if arr.ndim == 2:  # the primary image's grid: other views get no values from it
            primary = primary_image(self.tokens)
            for t in self.tokens:
                if t.col >= 0 and t.image == primary and t.row < arr.shape[0] and t.col < arr.shape[1]:
                    out[t.item] = arr[t.row, t.col]
            return out
        if arr.ndim == 1 and len(arr) == n:
            return arr.copy()
        if arr.ndim == 1 and len(arr) == len(self.cells):
            for t, v in zip(self.cells, arr):
                out[t.item] = v
            return out
        raise ValueError(
            f"{arr.shape} heatmap values do not fit {n} tokens ({len(self.cells)} grid cells): give one value "
            "per token, one per cell, or the primary image's (rows, cols) grid"
        )

    def _colors(self, values: np.ndarray) -> np.ndarray:
        """``(n, 4)`` uint8 RGBA of ``values`` on the current colour map and levels (NaN: transparent)."""
        lo, hi = self.levels
        norm = np.clip((np.nan_to_num(values, nan=lo) - lo) / (hi - lo), 0.0, 1.0)
        rgba = np.asarray(self.colormap.map(norm, mode=pg.ColorMap.BYTE), dtype=np.uint8).reshape(-1, 4).copy()
        rgba[~np.isfinite(values), 3] = 0
        return rgba

    def color_of(self, value: float) -> QColor:
        """The colour-map colour of ``value`` at the current levels (opaque)."""
        c = self._colors(np.array([value], dtype=np.float64))[0]
        return QColor(int(c[0]), int(c[1]), int(c[2]))

    def set_token_note(self, text: str) -> None:
        """A note above the canvas, e.g. that the model's visual tokens are tiles,
        merged blocks or a pooled mixture (hidden when empty)."""
        self.note_label.setText(text or "")
        self.note_label.setVisible(bool(text))

    def token_note(self) -> str:
        return self.note_label.text()

    def set_grid_visible(self, visible: bool) -> None:
        self.grid_item.setVisible(bool(visible))
        if self.grid_check.isChecked() != bool(visible):
            self.grid_check.setChecked(bool(visible))

    # ----- interpolated view ---------------------------------------------

    def set_interpolated(self, on: bool) -> None:
        """Show the upsampled smooth heatmap instead of the patch cells; the
        banner ``interpolated: visual smoothing, not a causal pixel mask`` is on
        the canvas exactly while this is on."""
        on = bool(on)
        self._interpolated = on
        if self.interpolated_check.isChecked() != on:
            self.interpolated_check.blockSignals(True)
            self.interpolated_check.setChecked(on)
            self.interpolated_check.blockSignals(False)
        self.interpolated_label.setVisible(on)
        self.interpolated_label.raise_()
        self._update_smooth()
        self._show_heatmap_items()

    def is_interpolated(self) -> bool:
        return self._interpolated

    def _show_heatmap_items(self) -> None:
        has = self.values is not None and bool(self.heatmap_item.cells)
        on = has and self.heatmap_check.isChecked()
        self.heatmap_item.setVisible(on and not self._interpolated)
        self.smooth_item.setVisible(on and self._interpolated)
        self.colorbar.setVisible(has)

    def _update_smooth(self) -> None:
        """Bilinear upsampling of each shown view's cell grid over its pixel extent
        (display only); with several views the finer are drawn over the coarser, as the cells are."""
        if not self._interpolated or self.values is None or not self.cells:
            return
        x0, y0 = self._boxes[:, 0].min(), self._boxes[:, 1].min()
        x1, y1 = self._boxes[:, 2].max(), self._boxes[:, 3].max()
        w, h = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
        scale = min(1.0, MAX_SMOOTH_SIDE / max(w, h))
        out_w, out_h = max(1, int(round(w * scale))), max(1, int(round(h * scale)))
        if len(self.shown) == 1:  # at least one pixel per cell
            out_w, out_h = max(self.shown[0].grid[1], out_w), max(self.shown[0].grid[0], out_h)
        rgba = np.zeros((out_h, out_w, 4), dtype=np.uint8)
        for k in reversed(range(len(self.shown))):  # the coarsest first, the finest on top
            view = self.shown[k]
            grid = np.full(view.grid, np.nan, dtype=np.float32)
            for t in (self.cells[i] for i in np.nonzero(self._cell_layers == k)[0]):
                grid[t.row, t.col] = self.values[t.item]
            ex0, ey0, ex1, ey1 = view.extent
            px0, px1 = int(round((ex0 - x0) / w * out_w)), int(round((ex1 - x0) / w * out_w))
            py0, py1 = int(round((ey0 - y0) / h * out_h)), int(round((ey1 - y0) / h * out_h))
            px1, py1 = max(px1, px0 + 1), max(py1, py0 + 1)
            rgba[py0:py1, px0:px1] = self._smooth_rgba(grid, px1 - px0, py1 - py0)
        self.smooth_item.setImage(rgba, autoLevels=False, levels=(0, 255))
        self.smooth_item.setRect(QRectF(x0, y0, w, h))

    def _smooth_rgba(self, grid: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
        """``(out_h, out_w, 4)`` uint8: ``grid (rows, cols)`` upsampled bilinearly on the
        colour map; cells without a value stay transparent (nearest-neighbour holes)."""
        missing = ~np.isfinite(grid)
        filled = np.where(missing, np.nanmean(grid) if (~missing).any() else 0.0, grid).astype(np.float32)
        smooth = np.asarray(Image.fromarray(filled, mode="F").resize((out_w, out_h), Image.BILINEAR))
        holes = np.asarray(Image.fromarray(missing.astype(np.uint8) * 255).resize((out_w, out_h), Image.NEAREST)) > 0
        return self._colors(np.where(holes, np.nan, smooth).ravel()).reshape(out_h, out_w, 4)

    # ----- hover ---------------------------------------------------------

    def token_at(self, x: float, y: float) -> CanvasToken | None:
        """The drawn cell whose box holds image point ``(x, y)``: of the top view
        there (the finest, with all views laid out), the smallest box when boxes overlap; or None."""
        if not len(self._boxes):
            return None
        b = self._boxes
        inside = np.nonzero((x >= b[:, 0]) & (x < b[:, 2]) & (y >= b[:, 1]) & (y < b[:, 3]))[0]
        if not len(inside):
            return None
        layers = self._cell_layers[inside]
        inside = inside[layers == layers.min()]
        areas = (b[inside, 2] - b[inside, 0]) * (b[inside, 3] - b[inside, 1])
        return self.cells[int(inside[int(np.argmin(areas))])]

    def value_of(self, token: CanvasToken) -> float | None:
        """The heatmap value of ``token`` (None: no heatmap or no value)."""
        if self.values is None:
            return None
        v = float(self.values[token.item])
        return v if np.isfinite(v) else None

    def describe_point(self, x: float, y: float) -> str:
        """The hover text for image point ``(x, y)``."""
        t = self.token_at(x, y)
        if t is None:
            size = self.image_size()
            inside = size is not None and 0 <= x < size[0] and 0 <= y < size[1]
            return f"pixel ({int(x)}, {int(y)}): no visual token here" if inside else ""
        x0, y0, x1, y1 = t.box
        text = (
            f"token {t.index}  ·  image {t.image}, row {t.row}, col {t.col}  ·  "
            f"box [{x0:.1f}, {y0:.1f}, {x1:.1f}, {y1:.1f}] px"
        )
        v = self.value_of(t)
        if self.values is not None:
            name = self.heatmap_label or "value"
            text += f"  ·  {name} = {v:.4g}" if v is not None else f"  ·  {name}: n/a"
        return text

    def hover_at(self, x: float, y: float) -> CanvasToken | None:
        """Update the hover read-outs (label, tooltip, highlight) for image point ``(x, y)``."""
        t = self.token_at(x, y)
        text = self.describe_point(x, y)
        self.hover_label.setText(text or HOVER_PROMPT)
        self.view.setToolTip(text)
        if t is not None:
            self.hover_item.setRect(box_rect(t.box))
            self.hover_item.show()
        else:
            self.hover_item.hide()
        self.token_hovered.emit(t.item if t is not None else -1)
        return t

    def _on_mouse_moved(self, scene_pos) -> None:
        if not self.plot.sceneBoundingRect().contains(scene_pos):
            return
        p = self.viewbox.mapSceneToView(scene_pos)
        self.hover_at(p.x(), p.y())
        self._place_cursor(p.x(), p.y())

    def _place_cursor(self, x: float, y: float) -> None:
        if self._mode in ("brush", "eraser"):
            r = max(self.painter.size / 2.0, 0.5)
            self.cursor_item.setRect(QRectF(x - r, y - r, 2 * r, 2 * r))
            self.cursor_item.show()
        else:
            self.cursor_item.hide()

    # ----- tools ---------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        """``"view"`` (pan / zoom), ``"brush"``, ``"eraser"`` or ``"box"``."""
        if mode not in MODES:
            raise ValueError(f"unknown tool {mode!r}; expected one of {', '.join(MODES)}")
        if self.painter.is_stroking():
            self.end_stroke()
        self._mode = mode
        self.cursor_item.setVisible(False)
        self.view.setCursor(Qt.CursorShape.ArrowCursor if mode == "view" else Qt.CursorShape.CrossCursor)
        self.mode_changed.emit(mode)

    def mode(self) -> str:
        return self._mode

    def set_brush_size(self, size: float) -> None:
        """Brush and eraser diameter in image pixels (at least 1)."""
        self.painter.size = max(1.0, float(size))

    def brush_size(self) -> float:
        return self.painter.size

    def mask(self) -> np.ndarray:
        """A copy of the painted region, ``(H, W)`` bool on the original image."""
        return self.painter.mask.copy()

    def set_mask(self, mask: np.ndarray, *, undoable: bool = True) -> None:
        """Replace the region (``(H, W)`` bool, the image's size)."""
        self.painter.set_mask(mask, undoable=undoable)

    def clear_mask(self) -> None:
        """Empty the region (one undo step)."""
        self.painter.clear()

    def undo(self) -> None:
        self.undo_stack.undo()

    def redo(self) -> None:
        self.undo_stack.redo()

    def begin_stroke(self, x: float, y: float) -> None:
        """Start a brush (or eraser, in eraser mode) stroke at image point ``(x, y)``."""
        self.painter.begin(x, y, erase=self._mode == "eraser")

    def stroke_to(self, x: float, y: float) -> None:
        """Continue the stroke: the whole segment from the last point is painted."""
        self.painter.move_to(x, y)

    def end_stroke(self) -> None:
        """Finish the stroke (one undo step)."""
        self.painter.end()

    def paint_box(self, x0: float, y0: float, x1: float, y1: float, *, erase: bool = False) -> None:
        """Fill the box between two corners (image pixels): one undo step."""
        self.painter.fill_box(x0, y0, x1, y1, erase=erase)

    def _tool_drag(self, ev) -> None:
        p = self.viewbox.mapSceneToView(ev.scenePos())
        if self._mode == "box":
            if ev.isStart():
                self._box_start = self.viewbox.mapSceneToView(ev.buttonDownScenePos())
            if self._box_start is None:
                return
            s = self._box_start
            self.box_item.setRect(QRectF(s, p).normalized())
            self.box_item.show()
            if ev.isFinish():
                self.box_item.hide()
                self._box_start = None
                self.paint_box(s.x(), s.y(), p.x(), p.y())
            return
        if ev.isStart():
            s = self.viewbox.mapSceneToView(ev.buttonDownScenePos())
            self.begin_stroke(s.x(), s.y())
        self.stroke_to(p.x(), p.y())
        self._place_cursor(p.x(), p.y())
        if ev.isFinish():
            self.end_stroke()
