"""History panel: every run of the session, one row each, newest last.

Columns: run id, kind, time, the image (a thumbnail of the session's stored
pixels, and its name), the question, the answer, the model. Selecting a row
(click or keyboard; double-click selects it again) emits
:attr:`HistoryPanel.run_selected` ``(run_id)``: the window restores that run.

The panel never touches the session: :meth:`HistoryPanel.set_runs` takes
:class:`HistoryRow` s, built by the window from ``Session.runs()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from PySide6.QtCore import QSize, Signal
from PySide6.QtGui import QIcon, QImage, QPixmap
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from app.widgets import plain_label

COLUMNS = ("run", "kind", "time", "image", "question", "answer", "model")
THUMBNAIL_PX = 48


@dataclass(frozen=True)
class HistoryRow:
    """One run as the history lists it: its id, kind and time (ISO 8601 UTC), the image's name and
    thumbnail (``(h, w, 3)`` uint8, or None), the question, the answer and the model, as shown."""

    run_id: int
    kind: str
    created: str
    image: str = ""
    thumbnail: np.ndarray | None = None
    question: str = ""
    answer: str = ""
    model: str = ""


def local_time(created: str | None) -> str:
    """An ISO 8601 UTC time (``Session``'s ``created``) as local ``YYYY-MM-DD HH:MM:SS``; the text itself
    if it does not parse."""
    if not created:
        return ""
    try:
        return datetime.fromisoformat(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return created


def thumbnail_icon(pixels) -> QIcon | None:
    """An icon from ``(h, w, 3)`` uint8 pixels (None for None)."""
    if pixels is None:
        return None
    rgb = np.ascontiguousarray(np.asarray(pixels, dtype=np.uint8)[..., :3])
    h, w = rgb.shape[:2]
    image = QImage(rgb.data, w, h, 3 * w, QImage.Format.Format_RGB888).copy()  # copy: rgb's buffer goes
    return QIcon(QPixmap.fromImage(image))


class HistoryPanel(QWidget):
    """The session's runs; selecting one asks the window to restore it."""

    run_selected = Signal(int)  # a run id

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.title = plain_label("no runs yet: Read out, run a counterfactual or ablate a head")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setWordWrap(False)
        self.table.setIconSize(QSize(THUMBNAIL_PX, THUMBNAIL_PX))
        self.table.verticalHeader().setDefaultSectionSize(THUMBNAIL_PX + 6)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(COLUMNS.index("question"), QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.table.cellDoubleClicked.connect(lambda row, _col: self._emit_row(row))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.title)
        layout.addWidget(self.table, stretch=1)
        self._ids: list[int] = []

    # ----- data in -------------------------------------------------------

    def set_runs(self, rows: Sequence[HistoryRow]) -> None:
        """Show ``rows``, oldest first; the selection (the shown run) is kept when its run is still
        listed. Emits nothing."""
        current = self.current_run()
        self.table.blockSignals(True)
        try:
            self.table.clearSelection()
            self.table.setRowCount(len(rows))
            self._ids = []
            for r, row in enumerate(rows):
                self._ids.append(int(row.run_id))
                cells = (
                    f"#{row.run_id}",
                    row.kind,
                    local_time(row.created),
                    row.image,
                    row.question,
                    row.answer,
                    row.model,
                )
                for c, text in enumerate(cells):
                    item = QTableWidgetItem(str(text))
                    item.setToolTip(str(text))
                    self.table.setItem(r, c, item)
                icon = thumbnail_icon(row.thumbnail)
                if icon is not None:
                    self.table.item(r, COLUMNS.index("image")).setIcon(icon)
        finally:
            self.table.blockSignals(False)
        n = len(rows)
        self.title.setText(
            f"{n} run{'s' if n != 1 else ''} in the session: select one to show it as it was"
            if n
            else "no runs yet: Read out, run a counterfactual or ablate a head"
        )
        if current is not None:
            self.show_current(current)

    def show_current(self, run_id: int | None) -> None:
        """Select the row of ``run_id`` (the run the window shows) without emitting; None clears."""
        self.table.blockSignals(True)
        try:
            self.table.clearSelection()
            if run_id is not None and run_id in self._ids:
                row = self._ids.index(run_id)
                self.table.selectRow(row)
                self.table.scrollToItem(self.table.item(row, 0))
        finally:
            self.table.blockSignals(False)

    # ----- selection -----------------------------------------------------

    def run_ids(self) -> list[int]:
        """The listed runs' ids, in table order."""
        return list(self._ids)

    def current_run(self) -> int | None:
        """The selected run's id, or None."""
        rows = self.table.selectionModel().selectedRows()
        return self._ids[rows[0].row()] if rows else None

    def select_run(self, run_id: int) -> bool:
        """Select ``run_id``'s row as a click would (emits :attr:`run_selected`); False if it is not listed."""
        if run_id not in self._ids:
            return False
        row = self._ids.index(run_id)
        if self.current_run() == run_id:
            self._emit_row(row)  # already selected: a click restores it again
        else:
            self.table.selectRow(row)
        return True

    def row_texts(self, run_id: int) -> dict[str, str]:
        """The shown text of ``run_id``'s row by column (for tests and tooltips)."""
        row = self._ids.index(run_id)
        return {name: self.table.item(row, c).text() for c, name in enumerate(COLUMNS)}

    def has_thumbnail(self, run_id: int) -> bool:
        item = self.table.item(self._ids.index(run_id), COLUMNS.index("image"))
        return item is not None and not item.icon().isNull()

    def _on_selection(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        if rows:
            self._emit_row(rows[0].row())

    def _emit_row(self, row: int) -> None:
        if 0 <= row < len(self._ids):
            self.run_selected.emit(self._ids[row])
