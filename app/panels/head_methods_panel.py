"""The Attention tab's actions on the selected head: Non-unique… (is the head's
pattern the only one that gives its output? docs/METHODS.md §4.10) and QK/OV
(what the head can select and write, and what it did on this input, §4.3).

The panel never runs the model: its buttons emit :attr:`HeadMethodsPanel.nonunique_requested`
and :attr:`HeadMethodsPanel.qk_ov_requested`; the window runs the job on the
selected head (:class:`app.components.selection.Selection`) and hands the
result back (:meth:`~HeadMethodsPanel.show_nonunique`,
:meth:`~HeadMethodsPanel.show_qk_ov`). QK/OV keeps the weight level (potential,
no input) and the activation level (this input) in two boxes of their own.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QPushButton, QVBoxLayout, QWidget

from app.components.selection import SelectedComponent, Selection
from app.widgets import ElidedLabel, box, plain_label, text_scroll

NO_HEAD = "select a head (click a cell above) to run Non-unique… or QK/OV on it"
NO_RESULT = "Non-unique…: other patterns with the same output, off the painted region (or the most-attended tokens)"


def nonunique_lines(result) -> list[str]:
    """A :class:`core.methods.nonunique.NonuniqueResult` as the command prints it: the summary, one
    statement per level, the verdict and the method's caveat."""
    return [result.summary(), *(lv.statement for lv in result.levels), result.verdict, f"caveat: {result.does_not_say}"]


class HeadMethodsPanel(QWidget):
    """Non-unique… and QK/OV on the selected head, and the last result.

    Signals:
        nonunique_requested(): search other patterns with the selected head's output.
        qk_ov_requested(): the selected head's QK / OV circuits.
    """

    nonunique_requested = Signal()
    qk_ov_requested = Signal()

    def __init__(self, selection: Selection, parent: QWidget | None = None):
        super().__init__(parent)
        self.kind: str | None = None  # "nonunique" or "qk-ov": the result shown
        # two lines whatever head is selected (the whole in the tooltip): the buttons below never move
        self.head_label = ElidedLabel(NO_HEAD, lines=2, selectable=True)
        self.nonunique_button = QPushButton("Non-unique…")
        self.nonunique_button.setToolTip(
            "could the head give the same output with its attention off the painted region (or off the tokens "
            "holding half its image attention)? three constraint levels"
        )
        self.nonunique_button.clicked.connect(self.nonunique_requested)
        self.qk_ov_button = QPushButton("QK/OV")
        self.qk_ov_button.setToolTip("the head's QK and OV circuits: weight level, and the realised scores here")
        self.qk_ov_button.clicked.connect(self.qk_ov_requested)
        self.message_label = ElidedLabel(lines=2, selectable=True)  # its height fixed, as the head line's
        self.title = plain_label(NO_RESULT, wrap=True, selectable=True)
        self.title.setStyleSheet("font-weight: bold;")
        self.text = plain_label(wrap=True, selectable=True)
        self.weight_box, self.weight_text = self._group("weight level: potential, no input")
        self.activation_box, self.activation_text = self._group("activation level: this input")
        # The result scrolls: each box keeps every line of its text however short the column is,
        # and a long result never raises the window's minimum height.
        result = QWidget()
        result_layout = box(QVBoxLayout(), self.title, self.text, self.weight_box, self.activation_box)
        result_layout.addStretch(1)
        result.setLayout(result_layout)
        self.result_scroll = text_scroll(result, min_lines=6)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.head_label)
        layout.addLayout(box(QHBoxLayout(), self.nonunique_button, self.qk_ov_button, end_stretch=True))
        layout.addWidget(self.message_label)
        layout.addWidget(self.result_scroll, 1)
        disconnect = selection.changed.connect(self._on_selection)
        self.destroyed.connect(lambda *_: disconnect())  # the selection may outlive this widget
        self._on_selection(selection.current)
        self.clear_result()

    @staticmethod
    def _group(title: str):
        group = QGroupBox(title)
        text = plain_label(wrap=True, selectable=True)
        QVBoxLayout(group).addWidget(text)
        return group, text

    def set_busy(self, busy: bool) -> None:
        self.nonunique_button.setEnabled(not busy)
        self.qk_ov_button.setEnabled(not busy)

    def show_message(self, message: str, *, error: bool = False) -> None:
        self.message_label.setStyleSheet("color: #c00000;" if error else "color: #333;")
        self.message_label.setText(" ".join(message.split()))

    def show_nonunique(self, result) -> None:
        """A :class:`core.methods.nonunique.NonuniqueResult` of one input (its header names the head
        and the source set's rule)."""
        self.kind = "nonunique"
        self.title.setText(f"non-unique attention of {result.component}; source set: {result.region_rule}")
        self.text.setText("\n".join(nonunique_lines(result)))
        self.text.setVisible(True)
        self.weight_box.setVisible(False)
        self.activation_box.setVisible(False)

    def show_qk_ov(self, result) -> None:
        """A :class:`core.methods.qk_ov.QkOvResult`: its weight and activation levels in their boxes."""
        self.kind = "qk-ov"
        self.title.setText(f"QK / OV of {result.name} ({result.block_kind}-attention)")
        self.weight_text.setText("\n".join(result.weight_lines()))
        self.activation_text.setText("\n".join(result.activation_lines()))
        self.text.setVisible(False)
        self.weight_box.setVisible(True)
        self.activation_box.setVisible(True)

    def clear_result(self) -> None:
        self.kind = None
        self.title.setText(NO_RESULT)
        for label in (self.text, self.weight_text, self.activation_text):
            label.setText("")
        self.text.setVisible(False)
        self.weight_box.setVisible(False)
        self.activation_box.setVisible(False)

    def _on_selection(self, selected: SelectedComponent | None) -> None:
        self.head_label.setText(NO_HEAD if selected is None else f"selected: {selected.describe()}")
