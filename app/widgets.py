"""Small widgets and layout helpers the panels, the canvas and the window share:
plain-text labels (a token such as ``<image>`` must never be read as HTML),
one-line elided labels, margin-free boxes of widgets, splitters, the pyqtgraph
plot styling, plot titles that fit their plot, and axis ticks spaced so their
labels never overlap.

Layout rule: text never sets a panel's minimum width. A title is one elided
line (:class:`ElidedLabel`, :func:`set_title`: the whole text in the tooltip)
or wraps; axis labels are thinned to every k-th (:func:`tick_step`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QFontMetricsF
from PySide6.QtWidgets import (
    QBoxLayout,
    QHeaderView,
    QLabel,
    QLayout,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

FOREGROUND = "#202020"

# what a box holds: a widget or a layout, or ``(widget or layout, stretch)``
BoxItem = QWidget | QLayout | tuple[QWidget | QLayout, int]


def plain_label(
    text: str = "", *, wrap: bool = False, selectable: bool = False, parent: QWidget | None = None
) -> QLabel:
    """A label that never interprets its text as HTML (tokens like ``<image>``).

    Args:
        wrap: wrap long text over several lines.
        selectable: the text can be selected (and copied) with the mouse.
        parent: the widget the label is a child of (None: placed by a layout).
    """
    label = QLabel(text, parent)
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setWordWrap(wrap)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


class ElidedLabel(QLabel):
    """One line of plain text, elided at the right to the width the layout gives it;
    the whole text is its tooltip while it is cut. Its minimum width is 0 and its
    height one line, so a growing title can neither widen its panel (a splitter
    jump) nor add a line (the content below jumping down).

    :meth:`text` is the whole text; :meth:`shown_text` what is drawn.
    """

    def __init__(self, text: str = "", *, selectable: bool = False, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        if selectable:
            self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._full = ""
        self._tip = ""  # the tooltip this label set itself (one set by its owner is left alone)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        self._full = text or ""
        self._elide()

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return QSize(0, super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = self.contentsRect().width()
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, max(width, 0))
        if shown != super().text():
            super().setText(shown)
        if self.toolTip() == self._tip:
            self._tip = self._full if shown != self._full else ""
            self.setToolTip(self._tip)


def set_columns(table: QTableWidget, headers) -> QHeaderView:
    """``table``'s columns named ``headers``: the first takes the spare width, the
    others fit their contents. Returns the horizontal header."""
    table.setColumnCount(len(headers))
    table.setHorizontalHeaderLabels(list(headers))
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    return header


def box(layout: QBoxLayout, *items: BoxItem, end_stretch: bool = False) -> QBoxLayout:
    """``layout`` without margins holding ``items`` in order (``(item, stretch)`` sets
    its stretch); ``end_stretch`` adds a stretch after them, so they keep their size."""
    layout.setContentsMargins(0, 0, 0, 0)
    for entry in items:
        item, stretch = entry if isinstance(entry, tuple) else (entry, 0)
        if isinstance(item, QLayout):
            layout.addLayout(item, stretch)
        else:
            layout.addWidget(item, stretch)
    if end_stretch:
        layout.addStretch(1)
    return layout


def boxed(layout: QBoxLayout, *items: BoxItem, end_stretch: bool = False) -> QWidget:
    """A widget holding :func:`box` ``(layout, *items)``."""
    holder = QWidget()
    holder.setLayout(box(layout, *items, end_stretch=end_stretch))
    return holder


def stacked(*items: BoxItem) -> QWidget:
    """A widget holding ``items`` top to bottom, without margins."""
    return boxed(QVBoxLayout(), *items)


def split(orientation: Qt.Orientation, *widgets: QWidget, sizes: Sequence[int] | None = None) -> QSplitter:
    """A splitter holding ``widgets`` in order, starting at ``sizes`` (pixels) when given."""
    splitter = QSplitter(orientation)
    for widget in widgets:
        splitter.addWidget(widget)
    if sizes is not None:
        splitter.setSizes(list(sizes))
    return splitter


def style_plot(plot: pg.PlotItem) -> None:
    """Dark axes and labels, readable on the panels' white plot background."""
    for name in ("left", "bottom", "right", "top"):
        axis = plot.getAxis(name)
        axis.setPen(pg.mkPen(FOREGROUND))
        axis.setTextPen(pg.mkPen(FOREGROUND))
    plot.titleLabel.setAttr("color", FOREGROUND)


def _lenient_update_min(label: pg.LabelItem) -> None:
    """LabelItem.updateMin without the minimum width: the title may be clipped, the plot is not."""
    bounds = label.itemRect()
    label.setMinimumWidth(0)
    label.setMinimumHeight(bounds.height())
    label._sizeHint = {
        Qt.SizeHint.MinimumSize: (0, bounds.height()),
        Qt.SizeHint.PreferredSize: (bounds.width(), bounds.height()),
        Qt.SizeHint.MaximumSize: (-1, -1),
        Qt.SizeHint.MinimumDescent: (0, 0),
    }
    label.updateGeometry()


def set_title(plot: pg.PlotItem, text: str, size: str = "10pt") -> None:
    """A plot title that does not set the plot's minimum width (a long title
    would otherwise push the plot wider than a narrow dock) and is elided at the
    right to the plot's width, the whole title in the title's tooltip (centred and
    clipped, "per-source contribution" read "er-source contributio")."""
    label = plot.titleLabel
    if not getattr(label, "_fitted", False):  # once per plot
        label._fitted = True
        if getattr(label, "updateMin", None) is not None:
            label.updateMin = lambda: _lenient_update_min(label)  # LabelItem calls it on every text change and resize
        label.geometryChanged.connect(lambda: _elide_title(plot))
    label._full_title, label._title_size = text, size
    _elide_title(plot)


def _elide_title(plot: pg.PlotItem) -> None:
    label = plot.titleLabel
    text, size = getattr(label, "_full_title", ""), getattr(label, "_title_size", "10pt")
    font = QFont(label.item.font())
    font.setPointSizeF(float(size.rstrip("pt")))
    # The title is centred over the view box's column and may overhang the axes, not the plot's edges.
    centre = label.pos().x() + label.width() / 2
    width = 2 * min(centre, plot.width() - centre) - 8  # a little room for the text item's margin
    shown = QFontMetricsF(font).elidedText(text, Qt.TextElideMode.ElideRight, width) if width > 0 else text
    label.setToolTip(text if shown != text else "")  # on the title only: the plot's cells have their own
    if (shown, size) != getattr(label, "_shown_title", None):
        label._shown_title = (shown, size)
        plot.setTitle(shown, size=size)


def full_title(plot: pg.PlotItem) -> str:
    """The whole title given to :func:`set_title` (the drawn one may be elided)."""
    return getattr(plot.titleLabel, "_full_title", plot.titleLabel.text)


def tick_step(labels: Sequence[str], room: float, font: QFont, *, vertical: bool = False, gap: float = 6.0) -> int:
    """Show every k-th of ``labels`` evenly spaced over ``room`` pixels: the smallest k
    at which neighbouring labels leave ``gap`` pixels between them (1 while the
    axis has no size yet; it is refitted once laid out)."""
    if not labels or room <= 0:
        return 1
    metrics = QFontMetricsF(font)
    need = metrics.height() if vertical else max(metrics.horizontalAdvance(str(t)) for t in labels) + gap
    return max(1, math.ceil(need / (room / len(labels))))


def axis_font(axis: pg.AxisItem) -> QFont:
    """The font an axis draws its tick labels in."""
    return axis.style.get("tickFont") or axis.font()
