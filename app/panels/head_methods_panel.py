"""The Attention tab's actions on the selected head: Non-unique… (is the head's
pattern the only one that gives its output? docs/METHODS.md §4.10) and QK/OV
(what the head can select and write, and what it did on this input, §4.3).

The panel never runs the model: its buttons emit :attr:`HeadMethodsPanel.nonunique_requested`
and :attr:`HeadMethodsPanel.qk_ov_requested`; the window asks the panel for the
request on the selected head (:class:`app.components.selection.Selection`):
:meth:`~HeadMethodsPanel.nonunique_request`, :meth:`~HeadMethodsPanel.qk_ov_request`
(a :class:`core.requests.NonuniqueRequest` / :class:`core.requests.QkOvRequest`, or a
:class:`app.panels.run_requests.Refusal`), and runs it. The result joins the shown
run; the panel draws it from there (:meth:`HeadMethodsPanel.draw`, kinds
:data:`HEAD_METHOD_KINDS`, a live run and a restored one alike). QK/OV keeps the
weight level (potential, no input) and the activation level (this input) in two
boxes of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QPushButton, QVBoxLayout, QWidget

from app.components.selection import SelectedComponent, Selection, is_head
from app.panels.run_requests import Refusal, RunningLine, selected_other_than
from app.widgets import ElidedLabel, box, plain_label, text_scroll
from core.requests import NonuniqueRequest, QkOvRequest

if TYPE_CHECKING:
    from app.components import ShownRun

NO_HEAD = "select a head (click a cell above) to run Non-unique… or QK/OV on it"
NO_RESULT = "Non-unique…: other patterns with the same output, off the painted region (or the most-attended tokens)"
HEAD_METHOD_KINDS = ("nonunique", "qk-ov")  # the result kinds the panel draws (its view's, app.run_frame)


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
        self.selection = selection
        self.kind: str | None = None  # "nonunique" or "qk-ov": the result shown
        self.result = None  # the NonuniqueResult or QkOvResult shown
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
        self.running = RunningLine(self.show_message, self.message_label)
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

    def run_buttons(self) -> tuple[QPushButton, ...]:
        """The buttons that start a job (disabled while one runs)."""
        return self.nonunique_button, self.qk_ov_button

    # ----- the requests ----------------------------------------------------

    def selected_head(self) -> str | Refusal:
        """The selected head's name, or why there is none to run on (until another head is selected)."""
        selected = self.selection.current
        if selected is None:
            message = "select a head first: Read out, then click a head in Attention (or a head's bar in DLA)"
        elif selected.stale:
            message = f"{selected.name} was selected in another read-out than the one shown: select it again"
        elif not is_head(selected.name):
            message = f"{selected.name} is not an attention head: select a head (L1.H2) in Attention or DLA"
        else:
            return selected.name
        return Refusal(message, selected_other_than(self.selection, selected))

    def nonunique_request(self, asked: Mapping, painted: Callable[[], np.ndarray]) -> NonuniqueRequest | Refusal:
        """Non-unique attention of the selected head on the asked input (``asked``: the
        :class:`core.requests.base.AskedRequest` fields), off the painted region (``painted()``)
        when one is painted, else off the tokens holding half its image attention; or why not."""
        head = self.selected_head()
        if isinstance(head, Refusal):
            return head
        mask = painted()
        mask = mask if mask.any() else None
        region = "painted region" if mask is not None else None
        return NonuniqueRequest(**asked, head=head, mask=mask, mask_name=region)

    def qk_ov_request(self, asked: Mapping) -> QkOvRequest | Refusal:
        """The selected head's QK / OV circuits: the weight level, and the activation level on the
        asked input; or why not."""
        head = self.selected_head()
        if isinstance(head, Refusal):
            return head
        return QkOvRequest(**asked, head=head)

    def show_running(self, request: NonuniqueRequest | QkOvRequest) -> None:
        """The "running: …" line of ``request`` (the panel's), until the job ends or its result is drawn."""
        what = "non-unique attention" if request.name == "nonunique" else "QK / OV"
        self.running.show(f"running: {what} of {request.head}…")

    def end_running(self) -> None:
        """The job ended: its "running: …" line goes (a message shown since stays)."""
        self.running.end()

    # ----- a run drawn -----------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s result of ``kind`` (default the first of :data:`HEAD_METHOD_KINDS` it has),
        a live run and a restored one alike; None clears the panel."""
        results = run.results if run is not None else {}
        if kind not in HEAD_METHOD_KINDS or kind not in results:
            kind = next((k for k in HEAD_METHOD_KINDS if k in results), None)
        result = results.get(kind)
        if result is None:
            self.clear_result()
            return
        if kind == "qk-ov":
            self.show_qk_ov(result)
        else:
            self.show_nonunique(result)
        self.running.end()  # its result is drawn

    def shown_head(self) -> tuple[int, int] | None:
        """``(block, head)`` of the head whose result is shown (None: nothing shown): a restored
        result selects its head in Attention."""
        if self.kind == "qk-ov":
            return self.result.block_and_head
        if self.kind == "nonunique" and self.result.block is not None and self.result.head is not None:
            return self.result.block, self.result.head
        return None

    def show_message(self, message: str, *, error: bool = False) -> None:
        self.message_label.setStyleSheet("color: #c00000;" if error else "color: #333;")
        self.message_label.setText(" ".join(message.split()))

    def show_nonunique(self, result) -> None:
        """A :class:`core.methods.nonunique.NonuniqueResult` of one input (its header names the head
        and the source set's rule)."""
        self.kind, self.result = "nonunique", result
        self.title.setText(f"non-unique attention of {result.component}; source set: {result.region_rule}")
        self.text.setText("\n".join(nonunique_lines(result)))
        self.text.setVisible(True)
        self.weight_box.setVisible(False)
        self.activation_box.setVisible(False)

    def show_qk_ov(self, result) -> None:
        """A :class:`core.methods.qk_ov.QkOvResult`: its weight and activation levels in their boxes."""
        self.kind, self.result = "qk-ov", result
        self.title.setText(f"QK / OV of {result.name} ({result.block_kind}-attention)")
        self.weight_text.setText("\n".join(result.weight_lines()))
        self.activation_text.setText("\n".join(result.activation_lines()))
        self.text.setVisible(False)
        self.weight_box.setVisible(True)
        self.activation_box.setVisible(True)

    def clear_result(self) -> None:
        self.kind, self.result = None, None
        self.title.setText(NO_RESULT)
        for label in (self.text, self.weight_text, self.activation_text):
            label.setText("")
        self.text.setVisible(False)
        self.weight_box.setVisible(False)
        self.activation_box.setVisible(False)

    def _on_selection(self, selected: SelectedComponent | None) -> None:
        self.head_label.setText(NO_HEAD if selected is None else f"selected: {selected.describe()}")
