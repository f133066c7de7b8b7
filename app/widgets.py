"""Small widgets and layout helpers the panels, the canvas and the window share:
plain-text labels (a token such as ``<image>`` must never be read as HTML),
elided labels of a fixed number of lines, margin-free boxes of widgets,
splitters, pages that scroll, a tab widget whose tab bar stays put, the
pyqtgraph plot styling, plot titles that fit their plot, and axis ticks spaced
so their labels never overlap.

Layout rules: text never sets a panel's minimum width. A title is one elided
line (:class:`ElidedLabel`, :func:`set_title`: the whole text in the tooltip)
or wraps; axis labels are thinned to every k-th (:func:`tick_step`). A message
above or beside a control is an :class:`ElidedLabel` of a fixed number of lines,
so a longer message never moves the control (text that wraps freely goes after
the controls). No content sets the window's minimum size: a tab's page is a
:class:`ScrollPage`, which scrolls what does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyqtgraph as pg
from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtGui import QFont, QFontMetricsF, QTextLayout
from PySide6.QtWidgets import (
    QBoxLayout,
    QHeaderView,
    QLabel,
    QLayout,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QTabBar,
    QTableWidget,
    QTabWidget,
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


def wrapped_lines(text: str, font: QFont, width: int) -> list[tuple[str, str]]:
    """``text`` word-wrapped to ``width`` pixels in ``font``, as a label wraps it:
    ``[(line, the text from this line on)]`` (a newline starts a line)."""
    out: list[tuple[str, str]] = []
    paragraphs = text.split("\n")
    for p, paragraph in enumerate(paragraphs):
        after = "".join(" " + rest for rest in paragraphs[p + 1 :])
        layout = QTextLayout(paragraph, font)
        layout.beginLayout()
        while True:
            line = layout.createLine()
            if not line.isValid():
                break
            line.setLineWidth(max(width, 1))
            start = line.textStart()
            out.append((paragraph[start : start + line.textLength()].rstrip(), paragraph[start:] + after))
        layout.endLayout()
        if not paragraph:
            out.append(("", after.lstrip()))
    return out


class ElidedLabel(QLabel):
    """Plain text in a fixed number of ``lines`` (one by default), word-wrapped to the
    width the layout gives it and elided at the end of the last line; the whole text
    is its tooltip while it is cut. Its minimum width is 0 and its height always
    ``lines`` lines, empty or not, so a growing text can neither widen its panel (a
    splitter jump) nor add a line (the content below jumping down).

    :meth:`text` is the whole text; :meth:`shown_text` what is drawn.
    """

    lines = 1
    _full = ""
    _tip = ""  # the tooltip this label set itself (one set by its owner is left alone)

    def __init__(self, text: str = "", *, lines: int = 1, selectable: bool = False, parent: QWidget | None = None):
        super().__init__(parent)
        self.lines = max(1, int(lines))
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        if self.lines > 1:
            self.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)  # a short text: at the top
        if selectable:
            self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        self._full = text or ""
        self._elide()
        self.updateGeometry()  # the preferred width is the whole text's

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def _text_size(self, text: str) -> QSize:
        return self.fontMetrics().boundingRect(QRect(0, 0, 10**6, 10**6), 0, text).size()

    def sizeHint(self) -> QSize:  # noqa: N802
        """The whole text on one line (the width it would like) by ``lines`` lines, with what the
        label adds around its text (margins, a style sheet's padding and border)."""
        shown = super().sizeHint()
        drawn = self._text_size(super().text() or "Ag")
        around = QSize(max(shown.width() - drawn.width(), 0), max(shown.height() - drawn.height(), 0))
        width = self.fontMetrics().horizontalAdvance(" ".join(self._full.split()))
        return QSize(width, self._text_size("\n".join(["Ag"] * self.lines)).height()) + around

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return QSize(0, self.sizeHint().height())

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() in (event.Type.FontChange, event.Type.StyleChange):
            self.updateGeometry()  # a style sheet's font: another line height
            self._elide()

    def _elide(self) -> None:
        width = max(self.contentsRect().width() - 2 * self.margin(), 0)
        metrics = self.fontMetrics()
        if self.lines == 1:
            shown = metrics.elidedText(self._full, Qt.TextElideMode.ElideRight, width)
        else:
            wrapped = wrapped_lines(self._full, self.font(), width)
            kept = [line for line, _rest in wrapped[: self.lines]]
            if len(wrapped) > self.lines:
                kept[-1] = metrics.elidedText(wrapped[self.lines - 1][1], Qt.TextElideMode.ElideRight, width)
            shown = "\n".join(kept)
        if shown != super().text():
            super().setText(shown)
        cut = " ".join(shown.split()) != " ".join(self._full.split())
        if self.toolTip() == self._tip:
            self._tip = self._full if cut else ""
            self.setToolTip(self._tip)


class _MinimumPage(QWidget):
    """A scroll page's holder: its minimum size, not its wrapped text's preferred height
    for a width, decides when the page scrolls (Qt gives a word-wrapped label's full
    height for a width as the height a layout wants, and the page would always scroll)."""

    def hasHeightForWidth(self) -> bool:  # noqa: N802 (Qt's name)
        return False

    def heightForWidth(self, _width: int) -> int:  # noqa: N802
        return -1


class ScrollPage(QScrollArea):
    """``widget`` filling a frameless scroll area that scrolls only when the area is
    smaller than the widget's minimum size. The area's own minimum is a scroll bar's:
    what the widget shows (a long result, a wide table) can never raise the minimum
    size of what holds it, e.g. the window past the screen."""

    def __init__(self, widget: QWidget, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setFrameShape(QScrollArea.Shape.NoFrame)
        holder = _MinimumPage()
        holder.setLayout(box(QVBoxLayout(), widget))
        self.setWidget(holder)


def text_scroll(widget: QWidget, *, min_lines: int = 0) -> QScrollArea:
    """``widget`` (text that wraps, boxes of it) in a frameless scroll area that scrolls it
    up and down: every line is kept at the area's width (the text is never squashed to a
    sliver when the area is short) and a long text never raises the minimum height of what
    holds the area. ``min_lines``: the area shows at least that many lines."""
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    area.setWidget(widget)
    if min_lines:
        area.setMinimumHeight(min_lines * area.fontMetrics().lineSpacing())
    return area


class DetachedTabs(QTabWidget):
    """A tab widget whose tab bar (:attr:`bar`) the owner places apart from the pages,
    so that the tabs stay where they are when the pages move or change width (a pane
    beside them hidden for one tab). The widget's own bar is hidden; the two follow
    each other's current tab, and every tab added shows in :attr:`bar`."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.bar = QTabBar()
        self.bar.setExpanding(False)
        self.tabBar().hide()
        self.setFocusProxy(self.bar)  # focus parked on the tabs lands on the bar that is seen
        self.bar.currentChanged.connect(self.setCurrentIndex)
        self.currentChanged.connect(self.bar.setCurrentIndex)

    def tabInserted(self, index: int) -> None:  # noqa: N802 (Qt's name)
        super().tabInserted(index)
        self.bar.insertTab(index, self.tabText(index))
        self.bar.setTabToolTip(index, self.tabToolTip(index))
        self.bar.setCurrentIndex(self.currentIndex())

    def tabRemoved(self, index: int) -> None:  # noqa: N802
        super().tabRemoved(index)
        self.bar.removeTab(index)


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


SEPARATOR_CHARS = " ·;:,"  # what joins the parts of a header or title


def elide_keeping(text: str, keep: Sequence[str], metrics: QFontMetricsF, width: float) -> str:
    """``text`` on one line of ``width`` pixels with the parts in ``keep`` (substrings of it, e.g.
    the token a header is about) whole: the stretches between them are elided first, the longest
    first, each at its right; only when the kept parts alone do not fit is the whole line elided."""
    if metrics.horizontalAdvance(text) <= width:
        return text
    spans: list[tuple[int, int]] = []  # the kept parts' occurrences, in order, not overlapping
    for part in filter(None, keep):
        start = text.find(part)
        while start >= 0:
            end = start + len(part)
            if all(end <= a or start >= b for a, b in spans):
                spans.append((start, end))
            start = text.find(part, end)
    spans.sort()
    pieces, at = [], 0  # (text, kept)
    for start, end in spans:
        pieces += [(text[at:start], False), (text[start:end], True)]
        at = end
    pieces.append((text[at:], False))
    free = [k for k, (piece, kept) in enumerate(pieces) if piece and not kept]
    room = width - sum(metrics.horizontalAdvance(piece) for piece, kept in pieces if kept)
    if not spans or room < metrics.horizontalAdvance("…") * len(free):
        return metrics.elidedText(text, Qt.TextElideMode.ElideRight, width)
    widths = [metrics.horizontalAdvance(pieces[k][0]) for k in free]
    low, high = 0.0, max(widths)  # the widest a free stretch may stay: the most that fits in the room
    for _ in range(24):
        cap = (low + high) / 2
        low, high = (cap, high) if sum(min(w, cap) for w in widths) <= room else (low, cap)
    for k, w in zip(free, widths, strict=True):
        if w > low:  # cut at its right, its separator to the next part (" · ") kept
            piece = pieces[k][0]
            body = piece.rstrip(SEPARATOR_CHARS)
            tail = piece[len(body) :]
            room_left = low - metrics.horizontalAdvance(tail)
            cut = metrics.elidedText(body, Qt.TextElideMode.ElideRight, room_left) if room_left > 0 else ""
            pieces[k] = ((cut or "…") + tail if room_left > 0 else "…", False)
    shown = "".join(piece for piece, _ in pieces)
    return (
        shown
        if metrics.horizontalAdvance(shown) <= width
        else metrics.elidedText(shown, Qt.TextElideMode.ElideRight, width)
    )


class KeepingLabel(ElidedLabel):
    """A one-line :class:`ElidedLabel` that keeps the parts given to :meth:`setText` as ``keep``
    whole (:func:`elide_keeping`): a header's token stays readable while its question is cut."""

    _keep: tuple[str, ...] = ()

    def setText(self, text: str, keep: Sequence[str] = ()) -> None:  # noqa: N802 (Qt's name)
        self._keep = tuple(keep)
        super().setText(text)

    def kept(self) -> tuple[str, ...]:
        return self._keep

    def _elide(self) -> None:
        if not self._keep or getattr(self, "lines", 1) != 1:
            super()._elide()
            return
        width = max(self.contentsRect().width() - 2 * self.margin(), 0)
        shown = elide_keeping(self._full, self._keep, QFontMetricsF(self.font()), width)
        if shown != QLabel.text(self):
            QLabel.setText(self, shown)
        if self.toolTip() == self._tip:
            self._tip = self._full if shown != self._full else ""
            self.setToolTip(self._tip)
