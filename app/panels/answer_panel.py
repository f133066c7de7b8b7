"""The Answer tab: the answer with its probability, a caption (model, image,
question), a table of the top alternatives or of many pairs' answers; the
model's generated answer as clickable tokens; and, beside the chosen token's
patch map, the answer tokens' attention to the question, to earlier answer
tokens and to the image (:class:`app.panels.answer_patterns_panel.AnswerPatternsPanel`).

The panel draws itself from the run it is shown for (:meth:`AnswerPanel.draw`,
the protocol of :class:`app.run_frame.RunFrame`): an answer, a generation or a
read-out's answer (at the answer token it read), and the read-out's answer
patterns. The caption names the run's model, image and question
(:attr:`AnswerPanel.caption_of`, which the window may replace to add a sample's
expected answer).

"Generate" emits :attr:`AnswerPanel.generate_requested` (the token budget); the
window runs the generation in a worker; the answer's clickable tokens are the
window's answer-tokens component's, drawn with :meth:`AnswerPanel.show_tokens`,
:meth:`AnswerPanel.set_chosen` and :meth:`AnswerPanel.set_usable`. Clicking token
``k`` emits :attr:`AnswerPanel.token_chosen` (``k``): the window makes it the
target of every panel. The panel never runs the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from PySide6.QtCore import QPoint, QRect, QSize, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QButtonGroup,
    QHBoxLayout,
    QLayout,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

import core
from app.components.workspace import AnswerTokens, answer_token_label
from app.jobs import answer_of
from app.panels import READ_OUT, analysis_of
from app.panels.answer_patterns_panel import AnswerPatternsPanel
from app.widgets import ElidedLabel, box, plain_label, set_columns
from core.answer_text import AnswerText

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.generate import Generation
    from core.results.readout import Target

NO_ANSWER = "no answer yet"
# under NO_ANSWER: the window's buttons that give one (its "Answer" and "Read out")
HOW_TO_ANSWER = f"press {READ_OUT} for the answer and every panel, or Answer for the answer alone"
NO_TOKENS = "Generate: the model's answer, token by token; click a token to read every panel at it"
CHOOSE_TOKEN = "click a token to read every panel at it (the prompt and the answer's tokens before it are the input)"
OTHER_INPUT = "generated for another image, question or model: Generate again to read this input's answer"
CHOSEN_STYLE = "QToolButton:checked { background: #1f5fb4; color: white; font-weight: bold; }"
MAX_GENERATE_TOKENS = 256
TOKEN_ROWS = 3  # rows of token buttons shown before the area scrolls
TABLE_ROWS = 5  # rows of the answer table shown before it scrolls (the top alternatives)
ANSWER_KINDS = ("analyze", "generate", "answer")  # the results the tab draws, the first a run has by default


def run_caption(run: ShownRun, expected: str | None = None) -> str:
    """The Answer tab's caption of ``run``: ``model · image · question``, and ``expected`` (a
    bundled sample's ground truth, which no result holds) on a second line when given."""
    asked = run.input
    caption = f"{asked.model_spec} · {asked.image_name()} · {asked.question}"
    return caption + (f"\nexpected (sample ground truth): {expected}" if expected is not None else "")


class FlowLayout(QLayout):
    """Items left to right, wrapping onto a new line where the width ends (Qt's flow layout example)."""

    def __init__(self, parent: QWidget | None = None, spacing: int = 4):
        super().__init__(parent)
        self._items: list = []
        self.setContentsMargins(0, 0, 0, 0)
        self.setSpacing(spacing)

    def addItem(self, item) -> None:  # noqa: N802 (Qt's name)
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int):  # noqa: N802
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int):  # noqa: N802
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802
        return self._arrange(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802
        super().setGeometry(rect)
        self._arrange(rect, move=True)

    def sizeHint(self) -> QSize:  # noqa: N802
        return self.minimumSize()

    def minimumSize(self) -> QSize:  # noqa: N802
        size = QSize()
        for item in self._items:
            size = size.expandedTo(item.minimumSize())
        return size

    def _arrange(self, rect: QRect, move: bool) -> int:
        """Place the items in rows within ``rect``'s width (``move``: set their geometry); the height used."""
        x, y, row_height, gap = rect.x(), rect.y(), 0, self.spacing()
        for item in self._items:
            hint = item.sizeHint()
            if x + hint.width() > rect.right() + 1 and row_height > 0:  # wrap
                x, y, row_height = rect.x(), y + row_height + gap, 0
            if move:
                item.setGeometry(QRect(QPoint(x, y), hint))
            x += hint.width() + gap
            row_height = max(row_height, hint.height())
        return y + row_height - rect.y()


class AnswerPanel(QWidget):
    """``label`` (the answer), ``caption``, ``table_title`` and ``table``; the generated
    answer's tokens (``token_buttons``) and ``patterns``; it never runs the model.

    Attributes:
        run: the run drawn (:meth:`draw`), or None.
        caption_of: ``caption_of(run) -> str``, the caption of a run drawn (default
            :func:`run_caption`; the window sets one that adds a sample's expected answer).
    """

    generate_requested = Signal(int)  # the most tokens to generate
    token_chosen = Signal(int)  # the answer token clicked (0 = the first)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.run: ShownRun | None = None
        self.caption_of: Callable[[ShownRun], str] = run_caption
        self.pair_answers: list = []  # the pairs' answers shown (not a run: nothing recorded)
        self.answer_tokens: AnswerTokens | None = None
        self.token_buttons: list[QToolButton] = []
        self.generate_button = QPushButton("Generate")
        self.generate_button.setToolTip("the model's answer, decoded greedily token by token (cancellable)")
        self.generate_button.clicked.connect(self.request_generate)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, MAX_GENERATE_TOKENS)
        self.max_tokens.setPrefix("up to ")
        self.max_tokens.setSuffix(" tokens")
        self.stop_label = plain_label()
        self.stop_label.setStyleSheet("color: #555;")
        self.tokens_note = plain_label(NO_TOKENS, wrap=True)
        self.tokens_note.setStyleSheet("color: #555;")
        self._token_group = QButtonGroup(self)
        self._token_group.setExclusive(True)
        self._token_group.idClicked.connect(self._on_token_clicked)
        self._flow_holder = QWidget()
        self._flow = FlowLayout(self._flow_holder)
        # In a scroll area: a flow's height for a narrow width (one button a row) must not become the
        # window's minimum height; the area shows up to TOKEN_ROWS rows and scrolls the rest.
        self.tokens_area = QScrollArea()
        self.tokens_area.setWidgetResizable(True)
        self.tokens_area.setFrameShape(QScrollArea.Shape.NoFrame)
        self.tokens_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.tokens_area.setWidget(self._flow_holder)
        self.tokens_area.setVisible(False)

        # elided: a generated answer of many tokens must not widen the panel past the window
        self.label = ElidedLabel()
        font = self.label.font()
        font.setPointSizeF(font.pointSizeF() * 1.5)
        font.setBold(True)
        self.label.setFont(font)
        self.label.setText(NO_ANSWER)
        self.caption = plain_label()
        self.caption.setWordWrap(True)
        self.caption.setStyleSheet("color: #555;")
        self.table_title = plain_label()
        self.table = QTableWidget(0, 2)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)  # 5 rows fit
        self.patterns = AnswerPatternsPanel()

        layout = QVBoxLayout(self)
        layout.addLayout(box(QHBoxLayout(), self.generate_button, self.max_tokens, (self.stop_label, 1)))
        layout.addWidget(self.tokens_area)
        layout.addWidget(self.tokens_note)
        layout.addWidget(self.label)
        layout.addWidget(self.caption)
        layout.addWidget(self.table_title)
        layout.addWidget(self.table, stretch=1)
        layout.addWidget(self.patterns, stretch=1)
        self.clear()  # as after draw(None, None): how to get an answer

    def set_generate_budget(self, tokens: int) -> None:
        self.max_tokens.setValue(int(tokens))

    def request_generate(self) -> bool:
        """Ask for a generation (the window runs it); False while a job runs."""
        if not self.generate_button.isEnabled():
            return False
        self.generate_requested.emit(self.max_tokens.value())
        return True

    def set_busy(self, busy: bool) -> None:
        """No generation and no token choice while a job runs."""
        self.generate_button.setEnabled(not busy)
        self._enable_tokens(not busy and self._usable)

    # ----- the answer's tokens

    _usable = False  # the shown tokens answer the current input (clickable)

    def show_tokens(self, tokens: AnswerTokens | None, chosen: int | None = None, *, usable: bool = True) -> None:
        """Draw ``tokens`` as buttons (``chosen`` highlighted), each with its probability
        when known; ``usable`` False: they answer another input (shown, not clickable)."""
        self.answer_tokens = tokens
        for button in self.token_buttons:
            self._token_group.removeButton(button)
            self._flow.removeWidget(button)
            button.deleteLater()
        self.token_buttons = []
        if tokens is None:
            self.tokens_area.setVisible(False)
            self.stop_label.setText("")
            self._usable = False
            self.tokens_note.setText(NO_TOKENS)
            return
        for k, token in enumerate(tokens.tokens):
            button = QToolButton()
            prob = tokens.probs[k] if tokens.probs is not None else None
            button.setText(token if prob is None else f"{token}\n{prob:.3f}")
            button.setCheckable(True)
            button.setStyleSheet(CHOSEN_STYLE)
            alternatives = tokens.top[k] if tokens.top is not None else ()
            button.setToolTip(
                f"answer token {k}: {token!r} (id {tokens.token_ids[k]})"
                + (f", p = {prob:.4f} when generated" if prob is not None else "")
                + (f"; alternatives {', '.join(f'{t!r} {p:.3f}' for t, p in alternatives)}" if alternatives else "")
                + "; click to read every panel at this token"
            )
            self._token_group.addButton(button, k)
            self._flow.addWidget(button)
            self.token_buttons.append(button)
        self.tokens_area.setVisible(bool(self.token_buttons))
        self._fit_tokens_area()
        stop = f"stopped: {tokens.stop_reason}" if tokens.stop_reason else ""
        self.stop_label.setText(f"{len(tokens.tokens)} tokens" + (f"; {stop}" if stop else ""))
        self.set_chosen(chosen)
        self.set_usable(usable)

    def _fit_tokens_area(self) -> None:
        """The tokens' area as tall as its rows of buttons, up to :data:`TOKEN_ROWS` rows (then it scrolls)."""
        if not self.token_buttons:
            return
        row = self.token_buttons[0].sizeHint().height() + self._flow.spacing()
        width = self.tokens_area.viewport().width() or self.width()
        self.tokens_area.setFixedHeight(min(self._flow.heightForWidth(width), TOKEN_ROWS * row))

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._fit_tokens_area()

    def set_chosen(self, index: int | None) -> None:
        """Highlight answer token ``index`` (None: none)."""
        self._token_group.setExclusive(False)  # an exclusive group cannot uncheck its last button
        for k, button in enumerate(self.token_buttons):
            button.setChecked(k == index)
        self._token_group.setExclusive(True)

    def chosen(self) -> int | None:
        """The highlighted answer token's index, or None."""
        return next((k for k, b in enumerate(self.token_buttons) if b.isChecked()), None)

    def set_usable(self, usable: bool) -> None:
        """Whether the shown tokens answer the current input (only then can one be chosen)."""
        self._usable = usable and bool(self.token_buttons)
        if self.token_buttons:
            self.tokens_note.setText(CHOOSE_TOKEN if usable else OTHER_INPUT)
        self._enable_tokens(self._usable and self.generate_button.isEnabled())

    def _enable_tokens(self, enabled: bool) -> None:
        for button in self.token_buttons:
            button.setEnabled(enabled)

    def _on_token_clicked(self, index: int) -> None:
        self.token_chosen.emit(index)

    # ----- the answer read out

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run`` (live or restored alike): the result of ``kind`` (default the first of
        :data:`ANSWER_KINDS` it has): an answer with its alternatives, a generation's tokens, or a
        read-out's answer (at the answer token it read, when it read at one); and the read-out's
        answer patterns when the run has one. None clears the answer and the patterns (the
        tokens are the answer-tokens component's)."""
        self.run = run
        if run is None:
            self.clear()
            return
        analysis = analysis_of(run)
        self.patterns.set_result(analysis)
        if kind not in run.results:
            kind = next((k for k in ANSWER_KINDS if k in run.results), None)
        result, caption = run.results.get(kind), self.caption_of(run)
        if kind == "answer":
            self.show_answer(result, caption)
        elif kind == "generate":
            self.show_generated(result, caption)
        elif kind == "analyze" and analysis.answer_text is not None:
            self.show_answer_token(analysis.target, analysis.top, analysis.answer_text, caption)
        elif kind == "analyze":
            self.show_answer(answer_of(analysis), caption)  # its own forward's answer, not a second one
        else:
            self.clear()

    def clear(self) -> None:
        """The answer and the patterns go; the generated tokens stay (the window clears them when they answer nothing)."""
        self.label.setText(NO_ANSWER)
        self.caption.setText(HOW_TO_ANSWER)
        self.table_title.setText("")
        self.fill_table(["token", "probability"], [])
        self.patterns.set_result(None)
        self.pair_answers = []

    def show_answer(self, result: core.Answer, caption: str) -> None:
        """One answer: ``answer: square  (p = 0.912)`` and its top alternatives."""
        self.label.setText(f"answer: {result.answer}  (p = {result.prob:.3f})")
        self.caption.setText(caption)
        self.table_title.setText("top alternatives")
        self.fill_table(["token", "probability"], [(token, f"{prob:.3f}") for token, prob in result.top])

    def show_generated(self, tokens: Generation | AnswerTokens, caption: str) -> None:
        """A generated answer (a :class:`core.generate.Generation`, or its :class:`AnswerTokens`):
        ``answer: square yes zero`` and each token's probability when generated."""
        self.label.setText(f"answer: {tokens.text}" if tokens.token_ids else "answer: (no token)")
        self.caption.setText(caption)
        self.table_title.setText("generated tokens (click one above to read every panel at it)")
        probs = tokens.probs or [None] * len(tokens.tokens)
        self.fill_table(
            ["answer token", "probability when generated"],
            [(f"{k}: {t}", "—" if p is None else f"{p:.3f}") for k, (t, p) in enumerate(zip(tokens.tokens, probs))],
        )

    def show_answer_token(
        self, target: Target, top: Sequence[tuple[str, float]], answer_text: AnswerText, caption: str
    ) -> None:
        """A read-out at one answer token: ``answer token 2 'zero'  (p = 0.839)`` (the target's
        probability there; a typed target other than that token is named) and the alternatives
        at that position.

        Args:
            target: the analyze result's Target; ``top`` its alternatives (``AnalyzeResult.top``).
            answer_text: the answer and the token read out.
        """
        where = answer_token_label(answer_text)
        typed = target.answer_id != answer_text.token_id
        named = f"target {target.answer!r} at {where}" if typed else where
        self.label.setText(f"{named}  (p = {float(target.prob):.3f})")
        self.caption.setText(caption)
        self.table_title.setText(f"top alternatives at {where}")
        self.fill_table(["token", "probability"], [(str(t), f"{float(p):.3f}") for t, p in top])

    def show_pairs(
        self, questions: Sequence[str], answers: Sequence[core.Answer], expected: Sequence[str | None] | None
    ) -> None:
        """Many pairs' answers, and how many match the expected answers where they are known."""
        self.pair_answers = list(answers)  # not a run (nothing recorded): kept here, where they are shown
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
        header = set_columns(self.table, headers)
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                self.table.setItem(r, c, QTableWidgetItem(text))
        # the top alternatives stay readable beside the answer patterns: up to TABLE_ROWS rows unscrolled
        shown = min(len(rows), TABLE_ROWS)
        frame = 2 * self.table.frameWidth() + header.sizeHint().height()
        self.table.setMinimumHeight(frame + shown * self.table.verticalHeader().defaultSectionSize())


class TargetNote(QWidget):
    """One line under the Target / foil fields: a typed word of several tokens (which sub-token
    is read) and, when the shown answer holds that word, a button to read at the answer token
    where it starts instead (:attr:`read_at_requested` with that index)."""

    read_at_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = ElidedLabel()  # one line (the whole note in its tooltip): it never moves the fields
        self.label.setStyleSheet("color: #8a5a00;")
        self.button = QPushButton()
        self.button.setVisible(False)
        self.button.clicked.connect(lambda: self.read_at_requested.emit(self._index))
        self._index = -1
        box(QHBoxLayout(self), (self.label, 1), self.button)
        self.setVisible(False)

    def show_note(self, text: str, read_at: tuple[int, str] | None = None) -> None:
        """``text`` (empty: hide); ``read_at``: ``(answer token index, its label)`` to offer."""
        self.label.setText(text)
        self._index = read_at[0] if read_at else -1
        self.button.setText(f"read at {read_at[1]} instead" if read_at else "")
        self.button.setVisible(read_at is not None)
        self.setVisible(bool(text))

    def text(self) -> str:
        return self.label.text()
