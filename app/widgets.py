"""Small widgets and layout helpers the panels, the canvas and the window share:
plain-text labels (a token such as ``<image>`` must never be read as HTML),
margin-free boxes of widgets, splitters, and the pyqtgraph plot styling."""

from __future__ import annotations

from collections.abc import Sequence

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QBoxLayout, QLabel, QLayout, QSplitter, QVBoxLayout, QWidget

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
    would otherwise push the plot wider than a narrow dock and clip it)."""
    label = plot.titleLabel
    if getattr(label, "updateMin", None) is not None and not getattr(label, "_lenient", False):
        label.updateMin = lambda: _lenient_update_min(label)  # LabelItem calls it on every text change and resize
        label._lenient = True
    plot.setTitle(text, size=size)
