"""The painted region of the image canvas: an ``(H, W)`` bool mask on the
ORIGINAL image, its overlay item, and one undo step per stroke.

* :func:`stroke_footprint` is the brush geometry: every pixel whose centre
  lies within ``size / 2`` of the segment between two mouse positions (a
  capsule), so a fast mouse that reports points far apart still paints a
  continuous line.
* :class:`MaskOverlayItem` shows the mask as a translucent colour over the
  image. It owns a QImage whose pixels are a numpy view; a stroke rewrites
  only the dirty rectangle of that view and asks the scene to repaint only
  that rectangle, so painting stays smooth on large images.
* :class:`MaskPainter` holds the mask, the overlay and a :class:`QUndoStack`:
  a stroke (press, moves, release), a box, and a clear are one undo step each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, QPointF, QRectF, Signal
from PySide6.QtGui import QImage, QUndoCommand, QUndoStack
from PySide6.QtWidgets import QGraphicsItem

# Mask colour (R, G, B, alpha): a magenta that stands out on natural images and on the shapes scenes.
MASK_RGBA = (255, 0, 170, 120)
# The brush radius never drops below half a pixel diagonal: a dab always paints the pixel(s) it touches.
MIN_RADIUS = math.sqrt(0.5)

Slices = tuple[int, int, int, int]  # (y0, y1, x0, x1), end-exclusive


def _bbox(ax: float, ay: float, bx: float, by: float, r: float, shape: tuple[int, int]) -> Slices | None:
    h, w = shape
    x0 = max(0, int(math.floor(min(ax, bx) - r)))
    x1 = min(w, int(math.ceil(max(ax, bx) + r)) + 1)
    y0 = max(0, int(math.floor(min(ay, by) - r)))
    y1 = min(h, int(math.ceil(max(ay, by) + r)) + 1)
    if x1 <= x0 or y1 <= y0:
        return None
    return y0, y1, x0, x1


def stroke_footprint(
    p0: tuple[float, float], p1: tuple[float, float], size: float, shape: tuple[int, int]
) -> list[tuple[Slices, np.ndarray]]:
    """The pixels a brush of diameter ``size`` (image pixels) covers moving
    from ``p0 = (x, y)`` to ``p1`` on an image of ``shape = (H, W)``.

    Pixel ``(row, col)`` has its centre at ``(col + 0.5, row + 0.5)``; it is in
    the footprint when that centre lies within ``max(size / 2, sqrt(0.5))`` of
    the segment. Long segments are cut into pieces about one brush wide, so
    the work is proportional to the painted area, not to the segment's
    bounding box.

    Returns:
        ``[((y0, y1, x0, x1), hit (y1 - y0, x1 - x0) bool), ...]``, pieces
        clipped to the image (empty when the segment misses it).
    """
    r = max(float(size) / 2.0, MIN_RADIUS)
    ax, ay = float(p0[0]), float(p0[1])
    bx, by = float(p1[0]), float(p1[1])
    length = math.hypot(bx - ax, by - ay)
    n = max(1, int(math.ceil(length / max(2.0 * r, 8.0))))
    out = []
    r2 = r * r + 1e-9
    for i in range(n):
        sx, sy = ax + (bx - ax) * i / n, ay + (by - ay) * i / n
        ex, ey = ax + (bx - ax) * (i + 1) / n, ay + (by - ay) * (i + 1) / n
        box = _bbox(sx, sy, ex, ey, r, shape)
        if box is None:
            continue
        y0, y1, x0, x1 = box
        xs = np.arange(x0, x1, dtype=np.float64)[None, :] + 0.5 - sx
        ys = np.arange(y0, y1, dtype=np.float64)[:, None] + 0.5 - sy
        dx, dy = ex - sx, ey - sy
        seg2 = dx * dx + dy * dy
        if seg2 > 0:
            t = np.clip((xs * dx + ys * dy) / seg2, 0.0, 1.0)
            px, py = xs - t * dx, ys - t * dy
        else:
            px, py = xs, ys
        hit = px * px + py * py <= r2
        if hit.any():
            out.append((box, hit))
    return out


def box_slices(x0: float, y0: float, x1: float, y1: float, shape: tuple[int, int]) -> Slices | None:
    """The pixels whose centre lies in the box spanned by two corners (any
    order), as ``(y0, y1, x0, x1)`` end-exclusive slices clipped to
    ``shape = (H, W)``; the same pixels as
    :func:`core.methods.counterfactual.mask_from_box`. None when empty."""
    h, w = shape
    xa, xb = sorted((float(x0), float(x1)))
    ya, yb = sorted((float(y0), float(y1)))
    c0, c1 = max(0, math.ceil(xa - 0.5)), min(w, math.ceil(xb - 0.5))
    r0, r1 = max(0, math.ceil(ya - 0.5)), min(h, math.ceil(yb - 0.5))
    if c1 <= c0 or r1 <= r0:
        return None
    return r0, r1, c0, c1


class MaskOverlayItem(pg.GraphicsObject):
    """The mask drawn as a translucent colour, one item pixel per image pixel.

    ``refresh(mask, rect)`` rewrites the overlay pixels inside ``rect`` only
    and schedules a repaint of that rectangle only; ``paint`` draws only the
    exposed part of the image.
    """

    def __init__(self, rgba: tuple[int, int, int, int] = MASK_RGBA):
        super().__init__()
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemUsesExtendedStyleOption, True)
        r, g, b, a = rgba
        # ARGB32_Premultiplied is Qt's native raster format; in memory (little endian) it is B, G, R, A.
        self._color = np.array([b * a // 255, g * a // 255, r * a // 255, a], dtype=np.uint8)
        self._qimage = QImage()
        self._pixels = np.zeros((0, 0, 4), np.uint8)
        self._shape = (0, 0)

    def reset(self, shape: tuple[int, int]) -> None:
        """A transparent overlay for an image of ``shape = (H, W)``."""
        self.prepareGeometryChange()
        h, w = shape
        self._shape = (h, w)
        self._qimage = QImage(max(w, 1), max(h, 1), QImage.Format.Format_ARGB32_Premultiplied)
        self._qimage.fill(0)
        self._pixels = pg.functions.ndarray_from_qimage(self._qimage)  # (H, W, 4) view on the QImage's pixels
        self.update()

    def refresh(self, mask: np.ndarray, box: Slices | None = None) -> None:
        """Redraw the overlay from ``mask (H, W) bool`` inside ``box`` (all of it when None)."""
        h, w = self._shape
        y0, y1, x0, x1 = box if box is not None else (0, h, 0, w)
        if y1 <= y0 or x1 <= x0:
            return
        sub = self._pixels[y0:y1, x0:x1]
        sub[...] = 0
        sub[mask[y0:y1, x0:x1]] = self._color
        self.update(QRectF(x0, y0, x1 - x0, y1 - y0))

    def overlay_pixels(self) -> np.ndarray:
        """``(H, W, 4)`` the overlay's premultiplied B, G, R, A bytes (a view; for tests)."""
        return self._pixels

    def boundingRect(self) -> QRectF:
        h, w = self._shape
        return QRectF(0, 0, w, h)

    def paint(self, p, option, widget=None) -> None:
        h, w = self._shape
        if not h or not w:
            return
        exposed = option.exposedRect.intersected(QRectF(0, 0, w, h)).toAlignedRect()
        if exposed.isEmpty():
            return
        p.drawImage(QPointF(exposed.x(), exposed.y()), self._qimage, exposed)


class MaskEditCommand(QUndoCommand):
    """One undo step: the mask inside ``box`` before and after the edit."""

    def __init__(self, painter: MaskPainter, box: Slices, before: np.ndarray, after: np.ndarray, text: str):
        super().__init__(text)
        self._painter, self._box, self._before, self._after = painter, box, before, after
        self._applied = True  # the edit is already on the mask when the command is pushed

    def redo(self) -> None:
        if self._applied:
            self._applied = False  # QUndoStack.push calls redo once: the edit is already there
            return
        self._painter._write(self._box, self._after)

    def undo(self) -> None:
        self._painter._write(self._box, self._before)


@dataclass
class _Stroke:
    """A stroke being painted: its last point, whether it erases, the mask before it, and the
    ``(y0, y1, x0, x1)`` box it has changed so far (None: nothing yet); one undo step when it ends."""

    last: tuple[float, float]
    erase: bool
    before: np.ndarray
    box: tuple[int, int, int, int] | None = None


class MaskPainter(QObject):
    """The painted region and its edits.

    ``mask`` is ``(H, W)`` bool on the original image (``True`` = region).
    Strokes run :meth:`begin` / :meth:`move_to` / :meth:`end` in image-pixel
    coordinates (x right, y down); the brush (``erase=False``) sets pixels,
    the eraser clears them. Each stroke, box and clear is one step on
    :attr:`undo_stack`. ``mask_changed`` fires after every finished edit
    (not on every mouse move) with a copy of the mask.
    """

    mask_changed = Signal(object)  # (H, W) bool copy

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.overlay = MaskOverlayItem()
        self.undo_stack = QUndoStack(self)
        self.mask = np.zeros((0, 0), dtype=bool)
        self.size = 24.0
        self._stroke: _Stroke | None = None

    # ----- state ----------------------------------------------------------

    def reset(self, shape: tuple[int, int]) -> None:
        """An empty mask of ``shape = (H, W)`` and an empty undo history."""
        self._stroke = None
        self.mask = np.zeros(shape, dtype=bool)
        self.undo_stack.clear()
        self.overlay.reset(shape)
        self.mask_changed.emit(self.mask.copy())

    @property
    def shape(self) -> tuple[int, int]:
        return self.mask.shape

    def set_mask(self, mask: np.ndarray, *, undoable: bool = True) -> None:
        """Replace the whole mask (same shape as the image)."""
        m = np.asarray(mask, dtype=bool)
        if m.shape != self.mask.shape:
            raise ValueError(f"the mask is {m.shape} but the image is {self.mask.shape} (rows, cols)")
        self._replace(m, "set mask", undoable)

    def clear(self) -> None:
        """Empty the mask (one undo step)."""
        if self.mask.any():
            self._replace(np.zeros_like(self.mask), "clear", True)

    def _replace(self, new: np.ndarray, text: str, undoable: bool) -> None:
        h, w = self.mask.shape
        box = (0, h, 0, w)
        before = self.mask.copy()
        self.mask[...] = new
        self.overlay.refresh(self.mask)
        if undoable and not np.array_equal(before, new):
            self.undo_stack.push(MaskEditCommand(self, box, before, new.copy(), text))
        self.mask_changed.emit(self.mask.copy())

    def _write(self, box: Slices, values: np.ndarray) -> None:
        y0, y1, x0, x1 = box
        self.mask[y0:y1, x0:x1] = values
        self.overlay.refresh(self.mask, box)
        self.mask_changed.emit(self.mask.copy())

    # ----- strokes --------------------------------------------------------

    def is_stroking(self) -> bool:
        return self._stroke is not None

    def begin(self, x: float, y: float, *, erase: bool = False) -> None:
        """Start a stroke at image pixel ``(x, y)`` and paint the first dab."""
        if self._stroke is not None:
            self.end()
        self._stroke = _Stroke(last=(float(x), float(y)), erase=erase, before=self.mask.copy())
        self._paint_segment((float(x), float(y)), (float(x), float(y)))

    def move_to(self, x: float, y: float) -> None:
        """Continue the stroke to ``(x, y)``: the segment from the last point is painted whole."""
        if self._stroke is None:
            return
        p = (float(x), float(y))
        self._paint_segment(self._stroke.last, p)
        self._stroke.last = p

    def end(self) -> None:
        """Finish the stroke: one undo step (none when nothing changed)."""
        stroke, self._stroke = self._stroke, None
        if stroke is None or stroke.box is None:
            return
        y0, y1, x0, x1 = stroke.box
        before = stroke.before[y0:y1, x0:x1].copy()
        after = self.mask[y0:y1, x0:x1].copy()
        if not np.array_equal(before, after):
            text = "erase" if stroke.erase else "brush stroke"
            self.undo_stack.push(MaskEditCommand(self, stroke.box, before, after, text))
            self.mask_changed.emit(self.mask.copy())

    def _paint_segment(self, p0: tuple[float, float], p1: tuple[float, float]) -> None:
        value = not self._stroke.erase
        for box, hit in stroke_footprint(p0, p1, self.size, self.mask.shape):
            y0, y1, x0, x1 = box
            self.mask[y0:y1, x0:x1][hit] = value
            self.overlay.refresh(self.mask, box)
            old = self._stroke.box
            self._stroke.box = (
                box if old is None else (min(old[0], y0), max(old[1], y1), min(old[2], x0), max(old[3], x1))
            )

    # ----- box ------------------------------------------------------------

    def fill_box(self, x0: float, y0: float, x1: float, y1: float, *, erase: bool = False) -> None:
        """Set (or clear, ``erase``) the pixels whose centre lies in the box between
        two corners ``(x0, y0)`` and ``(x1, y1)`` (image pixels): one undo step."""
        box = box_slices(x0, y0, x1, y1, self.mask.shape)
        if box is None:
            return
        ya, yb, xa, xb = box
        before = self.mask[ya:yb, xa:xb].copy()
        if (before == (not erase)).all():
            return
        self.mask[ya:yb, xa:xb] = not erase
        self.overlay.refresh(self.mask, box)
        self.undo_stack.push(
            MaskEditCommand(self, box, before, self.mask[ya:yb, xa:xb].copy(), "erase box" if erase else "box")
        )
        self.mask_changed.emit(self.mask.copy())
