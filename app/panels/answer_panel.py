"""The Answer tab: the answer with its probability, a caption (model, image,
question), and a table of the top alternatives or of many pairs' answers."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

import core
from app.widgets import plain_label

NO_ANSWER = "no answer yet"


class AnswerPanel(QWidget):
    """``label`` (the answer), ``caption``, ``table_title`` and ``table``; it never runs the model."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = plain_label(NO_ANSWER)
        font = self.label.font()
        font.setPointSizeF(font.pointSizeF() * 1.5)
        font.setBold(True)
        self.label.setFont(font)
        self.caption = plain_label()
        self.caption.setWordWrap(True)
        self.caption.setStyleSheet("color: #555;")
        self.table_title = plain_label()
        self.table = QTableWidget(0, 2)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        layout.addWidget(self.caption)
        layout.addWidget(self.table_title)
        layout.addWidget(self.table, stretch=1)

    def clear(self) -> None:
        self.label.setText(NO_ANSWER)
        self.caption.setText("")
        self.table_title.setText("")
        self.fill_table(["token", "probability"], [])

    def show_answer(self, result: core.Answer, caption: str) -> None:
        """One answer: ``answer: square  (p = 0.912)`` and its top alternatives."""
        self.label.setText(f"answer: {result.answer}  (p = {result.prob:.3f})")
        self.caption.setText(caption)
        self.table_title.setText("top alternatives")
        self.fill_table(["token", "probability"], [(token, f"{prob:.3f}") for token, prob in result.top])

    def show_pairs(
        self, questions: Sequence[str], answers: Sequence[core.Answer], expected: Sequence[str | None] | None
    ) -> None:
        """Many pairs' answers, and how many match the expected answers where they are known."""
        expected = list(expected) if expected is not None else [None] * len(answers)
        known = [(a.answer, e) for a, e in zip(answers, expected, strict=True) if e is not None]
        self.label.setText(f"{len(answers)} pairs answered")
        self.table_title.setText("answers")
        if known:
            matches = sum(a == e for a, e in known)
            self.caption.setText(f"{matches} of {len(known)} answers match the expected answer")
        self.fill_table(
            ["question", "answer (p)", "expected"],
            [(q, f"{a.answer} ({a.prob:.3f})", e or "") for q, a, e in zip(questions, answers, expected, strict=True)],
        )

    def fill_table(self, headers: list[str], rows: list[tuple[str, ...]]) -> None:
        """Rows of text; the first column takes the spare width, the others fit their contents."""
        self.table.setColumnCount(len(headers))
        self.table.setHorizontalHeaderLabels(headers)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                self.table.setItem(r, c, QTableWidgetItem(text))
