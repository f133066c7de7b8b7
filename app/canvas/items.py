"""The canvas's box items: the patch grid, the patch heatmap and the view outlines.

Boxes are in original-image pixels. Each box has a draw layer: layer 0 is drawn
whole, layer ``k`` only outside the regions of the layers before it (its clip
path), so several views laid out on the image show, at each pixel, the finest
view that covers it (see :func:`core.views.overlay_order`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainterPath, QPen
from PySide6.QtWidgets import QGraphicsItem


def box_rect(box) -> QRectF:
    """``(x0, y0, x1, y1)`` as a QRectF."""
    x0, y0, x1, y1 = box
    return QRectF(x0, y0, x1 - x0, y1 - y0)


def cosmetic_pen(color: QColor, width: float, style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> QPen:
    """A pen whose width is in screen pixels, whatever the zoom."""
    pen = QPen(color, width, style)
    pen.setCosmetic(True)
    return pen


def layer_clips(layer_regions: Sequence[Sequence], bounds: QRectF) -> list[QPainterPath | None]:
    """The clip path of each draw layer: ``bounds`` less the regions of the
    layers before it (``layer_regions[k]``: layer ``k``'s ``(x0, y0, x1, y1)``
    boxes); None for layer 0 (drawn whole)."""
    clips: list[QPainterPath | None] = []
    above = QPainterPath()
    for k, regions in enumerate(layer_regions):
        if k == 0:
            clips.append(None)
        else:
            whole = QPainterPath()
            whole.addRect(bounds)
            clips.append(whole.subtracted(above))
        for box in regions:
            path = QPainterPath()
            path.addRect(box_rect(box))
            above = above.united(path)
    return clips


class BoxesItem(pg.GraphicsObject):
    """Base of the grid, heatmap and outline items: boxes in image pixels; ``paint``
    draws only the boxes that meet the exposed rectangle, so a brush repaint of
    a small dirty rectangle stays cheap with thousands of cells."""

    def __init__(self):
        super().__init__()
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemUsesExtendedStyleOption, True)
        self._boxes = np.zeros((0, 4))
        self._layers = np.zeros(0, dtype=int)
        self._clips: list[QPainterPath | None] = [None]
        self._bounds = QRectF()

    def _set_boxes(self, boxes, layers: Sequence[int] | None = None, clips=None) -> None:
        """The boxes ``(n, 4)``, each box's draw layer (default 0) and the layers' clip paths (:func:`layer_clips`)."""
        self.prepareGeometryChange()
        self._boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        self._layers = np.zeros(len(self._boxes), dtype=int) if layers is None else np.asarray(layers, dtype=int)
        self._clips = list(clips) if clips is not None else [None]
        if len(self._boxes):
            x0, y0 = self._boxes[:, 0].min(), self._boxes[:, 1].min()
            x1, y1 = self._boxes[:, 2].max(), self._boxes[:, 3].max()
            self._bounds = QRectF(x0, y0, x1 - x0, y1 - y0)
        else:
            self._bounds = QRectF()
        self.update()

    def _exposed(self, option) -> np.ndarray:
        """Indices of the boxes that meet the exposed rectangle (with a pixel of slack for pens)."""
        r = option.exposedRect.adjusted(-1, -1, 1, 1)
        b = self._boxes
        return np.nonzero(
            (b[:, 0] <= r.right()) & (b[:, 2] >= r.left()) & (b[:, 1] <= r.bottom()) & (b[:, 3] >= r.top())
        )[0]

    def _paint_layers(self, p, option, draw) -> None:
        """``draw(indices)`` for the exposed boxes of each layer, under that layer's clip."""
        exposed = self._exposed(option)
        for k, clip in enumerate(self._clips):
            shown = exposed[self._layers[exposed] == k] if len(self._clips) > 1 else exposed
            if not len(shown):
                continue
            p.save()
            if clip is not None:
                p.setClipPath(clip, Qt.ClipOperation.IntersectClip)
            draw(shown)
            p.restore()

    def boundingRect(self) -> QRectF:  # noqa: N802 (Qt's name)
        return self._bounds.adjusted(-1, -1, 1, 1)


class GridItem(BoxesItem):
    """Outlines of boxes, each drawn with every pen in turn (cosmetic pens: one
    screen pixel at any zoom). Default: the patch grid's dark line under a white dash."""

    def __init__(self, pens: Sequence[QPen] | None = None):
        super().__init__()
        self.rects: list[QRectF] = []
        if pens is None:
            pens = [QPen(QColor(0, 0, 0, 120), 0), QPen(QColor(255, 255, 255, 200), 0, Qt.PenStyle.DashLine)]
            for pen in pens:
                pen.setCosmetic(True)
        self._pens = list(pens)

    def set_rects(self, rects: list[QRectF], layers: Sequence[int] | None = None, clips=None) -> None:
        self.rects = rects
        self._set_boxes([(r.left(), r.top(), r.right(), r.bottom()) for r in rects], layers, clips)

    def paint(self, p, option, widget=None) -> None:
        if not self.rects:
            return

        def draw(indices) -> None:
            rects = [self.rects[i] for i in indices]
            p.setBrush(Qt.BrushStyle.NoBrush)
            for pen in self._pens:
                p.setPen(pen)
                p.drawRects(rects)

        self._paint_layers(p, option, draw)


class PatchHeatmapItem(BoxesItem):
    """One filled box per visual token, coloured by its value (NaN: left empty)."""

    def __init__(self):
        super().__init__()
        self.cells: list[tuple] = []  # (CanvasToken, value, QColor)
        self._rects: list[QRectF] = []

    def set_cells(self, cells: list[tuple], layers: Sequence[int] | None = None, clips=None) -> None:
        self.cells = cells
        self._rects = [box_rect(t.box) for t, _, _ in cells]
        self._set_boxes([t.box for t, _, _ in cells], layers, clips)

    def paint(self, p, option, widget=None) -> None:
        def draw(indices) -> None:
            p.setPen(Qt.PenStyle.NoPen)
            for i in indices:
                _, value, color = self.cells[i]
                if np.isfinite(value):
                    p.fillRect(self._rects[i], color)

        self._paint_layers(p, option, draw)
