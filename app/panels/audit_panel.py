"""Audit panel: the session's audit table, filterable, with Export.

One row per method record of each run: run, kind, method, question,
operation, controls, supports, cannot_support, parameters, summary (the
audit columns of docs/ARCHITECTURE.md, "Audit rows", plus what this run did and found). The filter matches
any column, case-insensitively. Export asks for a file and emits
:attr:`AuditPanel.export_requested` ``(format, path)``; the format follows
the extension (csv, md, html, json). Writing the file is the caller's job
(``core.export``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.widgets import plain_label

COLUMNS = (
    "run",
    "kind",
    "method",
    "question",
    "operation",
    "controls",
    "supports",
    "cannot_support",
    "parameters",
    "summary",
)
EXPORT_FORMATS = {".csv": "csv", ".md": "md", ".markdown": "md", ".html": "html", ".htm": "html", ".json": "json"}
EXPORT_FILTER = "CSV (*.csv);;Markdown (*.md);;HTML (*.html);;JSON (*.json)"
FILTER_EXTENSION = {"CSV": ".csv", "Markdown": ".md", "HTML": ".html", "JSON": ".json"}


def cell_text(value) -> str:
    """One audit value as table text: lists joined by "; ", dicts as ``key=value``."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "; ".join(cell_text(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_inner(v)}" for k, v in value.items())
    return str(value)


def _inner(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return cell_text(value)


def export_format(path: str | Path) -> str | None:
    """``"csv" | "md" | "html" | "json"`` from a file name's extension, else None."""
    return EXPORT_FORMATS.get(Path(path).suffix.lower())


class AuditPanel(QWidget):
    """The audit table of a session.

    Setters: :meth:`set_rows` (replace), :meth:`add_rows` (append), :meth:`set_filter`.
    Read-outs: :meth:`rows`, :meth:`visible_rows`.

    Signals:
        export_requested(format, path): the user chose a file to export to
            (format from its extension: csv, md, html, json).
        run_selected(run): a row was selected (its ``run`` value).
    """

    export_requested = Signal(str, str)
    run_selected = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._rows: list[dict] = []
        self.model = QStandardItemModel(0, len(COLUMNS), self)
        self.model.setHorizontalHeaderLabels([c.replace("_", " ") for c in COLUMNS])
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setFilterKeyColumn(-1)  # every column
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)

        self.view = QTableView()
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.sortByColumn(-1, Qt.SortOrder.AscendingOrder)  # insertion order until a header is clicked
        self.view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setAlternatingRowColors(True)
        self.view.setWordWrap(True)
        self.view.verticalHeader().setVisible(False)
        self.view.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header = self.view.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(True)
        widths = {"run": 40, "kind": 80, "method": 110, "question": 130, "operation": 140, "controls": 170}
        widths |= {"supports": 120, "cannot_support": 120, "parameters": 150}
        for c, name in enumerate(COLUMNS):
            if name in widths:
                self.view.setColumnWidth(c, widths[name])
        self.view.selectionModel().selectionChanged.connect(self._on_selection)

        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("filter: matches any column (method, control, parameter, ...)")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_edit.textChanged.connect(self._on_filter)
        self.count_label = plain_label("0 rows", selectable=True)
        self.export_button = QPushButton("Export…")
        self.export_button.setToolTip("write the audit table as CSV, Markdown, HTML or JSON")
        self.export_button.clicked.connect(self.choose_export)
        self.message = plain_label("", selectable=True)
        self.message.setStyleSheet("color: #b00020;")

        top = QHBoxLayout()
        top.addWidget(QLabel("filter:"))
        top.addWidget(self.filter_edit, 1)
        top.addWidget(self.count_label)
        top.addWidget(self.export_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.message)

    # ---- data in ----------------------------------------------------------

    def set_rows(self, rows: Sequence[dict]) -> None:
        """Replace the table with ``rows`` (audit dicts; missing columns stay empty)."""
        self._rows = []
        self.model.removeRows(0, self.model.rowCount())
        self.add_rows(rows)

    def add_rows(self, rows: Sequence[dict]) -> None:
        """Append audit dicts (e.g. the records of a new run)."""
        for row in rows:
            row = dict(row)
            self._rows.append(row)
            notes = cell_text(row.get("notes"))
            items = []
            for name in COLUMNS:
                text = cell_text(row.get(name))
                item = QStandardItem(text)
                item.setEditable(False)
                item.setToolTip(text + (f"\n\nnotes: {notes}" if notes else ""))
                if name == "run" and isinstance(row.get("run"), int):
                    item.setData(row["run"], Qt.ItemDataRole.DisplayRole)  # sorts as a number
                item.setData(len(self._rows) - 1, Qt.ItemDataRole.UserRole)
                items.append(item)
            self.model.appendRow(items)
        self._update_count()

    def set_filter(self, text: str) -> None:
        """Show only rows with ``text`` in some column (case-insensitive)."""
        self.filter_edit.setText(text)

    # ---- read-outs ----------------------------------------------------------

    def rows(self) -> list[dict]:
        """Every row, in insertion order."""
        return [dict(r) for r in self._rows]

    def visible_rows(self) -> list[dict]:
        """The rows the filter lets through, in view order."""
        out = []
        for r in range(self.proxy.rowCount()):
            i = self.proxy.data(self.proxy.index(r, 0), Qt.ItemDataRole.UserRole)
            out.append(dict(self._rows[int(i)]))
        return out

    # ---- export -------------------------------------------------------------

    def choose_export(self) -> bool:
        """Ask for a file (save dialog), then :meth:`request_export`."""
        path, chosen = QFileDialog.getSaveFileName(self, "Export the audit table", "audit.csv", EXPORT_FILTER)
        if not path:
            return False
        return self.request_export(path, chosen)

    def request_export(self, path: str | Path, chosen_filter: str = "") -> bool:
        """Emit :attr:`export_requested` ``(format, path)``. A path without an
        extension takes the chosen dialog filter's; an unknown extension is
        reported in the panel and nothing is emitted."""
        path = str(path)
        if not Path(path).suffix:
            ext = next((e for name, e in FILTER_EXTENSION.items() if chosen_filter.startswith(name)), "")
            path += ext
        fmt = export_format(path)
        if fmt is None:
            self.message.setText(f"cannot export to {Path(path).name!r}: use .csv, .md, .html or .json")
            return False
        self.message.setText("")
        self.export_requested.emit(fmt, path)
        return True

    # ---- internals ----------------------------------------------------------

    def _on_filter(self, text: str) -> None:
        self.proxy.setFilterFixedString(text)
        self._update_count()

    def _update_count(self) -> None:
        shown, total = self.proxy.rowCount(), self.model.rowCount()
        self.count_label.setText(f"{shown} of {total} rows" if shown != total else f"{total} rows")

    def _on_selection(self, *_args) -> None:
        rows = self.view.selectionModel().selectedRows()
        if rows:
            i = self.proxy.data(rows[0], Qt.ItemDataRole.UserRole)
            self.run_selected.emit(self._rows[int(i)].get("run"))
