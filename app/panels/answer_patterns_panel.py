"""Text-side patterns over the answer: for each answer token, how the attention
of the query that predicts it splits between the question's tokens, the
earlier answer tokens, the image, the sink and the rest (averaged over heads;
the mean over the self-attention blocks, or one block), from the analyze
JSON's ``answer_patterns`` (:mod:`core.methods.answer_patterns`). The row of
the token read out is highlighted. Shown in the Answer tab, beside the chosen
token's patch map on the canvas. Routing only: where a query reads, not what
the value carries or whether the answer needs it.

A cross-attention model (CoCa, Mllama) reads the image in its cross-attention
blocks, which these rows leave out (``skipped_blocks``): the panel says so and
names each cross-attention block with the answer row's image mass there (the
Attention tab's); where the image is not in the token sequence at all, the
self-attention rows' image column is "n/a", never an image mass of 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from PySide6.QtGui import QBrush, QColor, QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.panels import READ_OUT
from app.panels.attention_panel import block_names
from app.widgets import box, plain_label, set_columns

if TYPE_CHECKING:
    from core.analyze import AnalyzeResult
    from core.methods.answer_patterns import AnswerPatterns

MEAN_OVER_BLOCKS = "mean over blocks"
MEAN_OVER_SELF_BLOCKS = "mean over self-attention blocks"  # a model with cross-attention blocks too
NOT_IN_SEQUENCE = "n/a"  # the image column where the image is no key of self-attention
NOT_IN_SEQUENCE_COLOUR = QColor("#e4e4e4")
# the parts of a row (core.methods.answer_patterns.PARTS) and their column titles; a row's parts sum to 1
PARTS = (
    ("question_mass", "question"),
    ("answer_mass", "earlier answer"),
    ("image_mass", "image"),
    ("sink_mass", "sink"),
    ("other_mass", "other"),
)
NOTE = "each row: the query predicting that answer token, its attention by key kind; where it reads, not a cause"
NOTE_DETAIL = (
    "Each row is the query that predicts that answer token (the prompt's last token, then the answer's tokens), "
    "its attention weight split by key: the question's tokens, the answer's earlier tokens, the image, the sink, "
    "and the rest (chat markup, special tokens); the parts of a row sum to 1. Averaged over heads. A mass says "
    "where a query reads, not what the value carries or whether the answer needs it."
)
NO_PATTERNS = f"press {READ_OUT} (or click an answer token) to see the answer tokens' attention"
CHOSEN_ROW = QColor("#ffd27a")


class AnswerRow(NamedTuple):
    """One row of the table: the query's sequence position, its token, the answer token it predicts."""

    position: int
    token: str
    predicts: int


def cross_attention_image_mass(analysis: AnalyzeResult | None) -> dict[str, float]:
    """``{cross-attention block name: the answer row's image mass there, mean over heads}`` of the
    blocks ``answer_patterns`` leaves out, from the analyze ``attention`` rows (the Attention tab's)."""
    if analysis is None or analysis.answer_patterns is None:
        return {}
    skipped = {int(b) for b in analysis.answer_patterns.skipped_blocks}
    masses: dict[str, list[float]] = {}
    for row in analysis.attention:
        if row.layer in skipped:
            masses.setdefault(row.block, []).append(float(row.visual_mass))
    return {block: sum(values) / len(values) for block, values in masses.items()}


def image_in_sequence(analysis: AnalyzeResult | None) -> bool:
    """Whether the image's tokens are in the token sequence (keys of self-attention); a
    cross-attention model's visual tokens have no sequence position."""
    return analysis is not None and any(t.position is not None for t in analysis.input.visual_tokens)


def mass_colour(value: float) -> QColor:
    """A light blue whose depth follows ``value`` in [0, 1] (the cell's share of the row)."""
    v = min(max(float(value), 0.0), 1.0)
    return QColor(int(255 - 120 * v), int(255 - 75 * v), 255)


class AnswerPatternsPanel(QWidget):
    """The ``answer_patterns`` table: one row per answer token predicted, one column per key kind."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.section: AnswerPatterns | None = None
        self.answer_tokens: list[str] = []  # the answer's tokens (the analyze input's), for the row names
        self.cross_mass: dict[str, float] = {}  # the cross-attention blocks left out, with their image mass
        self.image_is_key = True  # False: the image is no key of these rows (image column n/a)
        self.title = plain_label(NO_PATTERNS, wrap=True)
        self.block_combo = QComboBox()
        self.block_combo.setToolTip("the mean over the self-attention blocks, or one block")
        # a cross-attention model's image path, said where the image column is read
        self.cross_note = plain_label(wrap=True, selectable=True)
        self.cross_note.setStyleSheet("background: #eef4ff; color: #1d3b6a; padding: 3px; border: 1px solid #9db7e0;")
        self.cross_note.hide()
        self.block_combo.currentIndexChanged.connect(lambda _i: self._fill())
        self.table = QTableWidget(0, len(PARTS) + 1)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.note = plain_label(NOTE, wrap=True)
        self.note.setStyleSheet("color: #555;")
        self.note.setToolTip(NOTE_DETAIL)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(box(QHBoxLayout(), (self.title, 1), self.block_combo))
        layout.addWidget(self.cross_note)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.note)
        self.set_result(None)

    def set_result(self, analysis: AnalyzeResult | None) -> None:
        """Show ``analysis.answer_patterns`` (None, or a run without it: empty)."""
        section = analysis.answer_patterns if analysis is not None else None
        self.section = section if section is not None and section.positions else None
        answer_text = analysis.answer_text if analysis is not None else None
        self.answer_tokens = list(answer_text.tokens) if answer_text is not None else []
        names = block_names(analysis) if self.section else {}
        self.cross_mass = cross_attention_image_mass(analysis) if self.section else {}
        self.image_is_key = not self.cross_mass or image_in_sequence(analysis)
        self._say_cross_attention(analysis.model.spec if analysis is not None else None)
        self.block_combo.blockSignals(True)
        self.block_combo.clear()
        self.block_combo.addItem(MEAN_OVER_SELF_BLOCKS if self.cross_mass else MEAN_OVER_BLOCKS)
        for block in self.section.blocks if self.section is not None else []:
            self.block_combo.addItem(names.get(int(block), f"block {block}"))
        self.block_combo.blockSignals(False)
        self.block_combo.setEnabled(self.block_combo.count() > 1)
        self._fill()

    def _say_cross_attention(self, spec: str | None) -> None:
        """The note on a model with cross-attention blocks: its image path is those blocks, each
        named with the answer row's image mass there; hidden for a model without them."""
        if not self.cross_mass:
            self.cross_note.hide()
            return
        masses = ", ".join(f"{block} {mass:.3f}" for block, mass in self.cross_mass.items())
        where = (
            "the image is not in its token sequence, so these self-attention rows have no image keys "
            f"(image: {NOT_IN_SEQUENCE}, not 0)"
            if not self.image_is_key
            else "they are left out of these rows"
        )
        self.cross_note.setText(
            f"{spec or 'this model'} reads the image through cross-attention blocks; {where}. "
            f"The answer row's image mass in each cross-attention block (mean over heads, as in the Attention tab): "
            f"{masses}"
        )
        self.cross_note.show()

    def set_block(self, name: str) -> None:
        """Show one block's values (or :data:`MEAN_OVER_BLOCKS`)."""
        index = self.block_combo.findText(name)
        if index < 0:
            raise ValueError(f"no block {name!r} in the answer patterns")
        self.block_combo.setCurrentIndex(index)

    def rows(self) -> list[AnswerRow]:
        """The section's rows (one per answer token predicted), [] when none is shown."""
        section = self.section
        if section is None:
            return []
        return [AnswerRow(*row) for row in zip(section.positions, section.tokens, section.predicts, strict=True)]

    def values(self) -> list[tuple[float, ...]]:
        """Per shown row, the masses in :data:`PARTS` order, as the table shows them."""
        return [self._masses(r) for r in range(len(self.rows()))]

    def chosen_row(self) -> int | None:
        """The row of the token read out (the last: the read-out predicts it), or None."""
        return len(self.rows()) - 1 if self.rows() else None

    def row_name(self, row: AnswerRow) -> str:
        """``2: zero``: the answer token the row's query predicts (its index when the tokens are not known)."""
        k = int(row.predicts)
        return f"{k}: {self.answer_tokens[k]}" if k < len(self.answer_tokens) else f"answer token {k}"

    def _masses(self, r: int) -> tuple[float, ...]:
        """Row ``r``'s masses in :data:`PARTS` order (the order of ``core.methods.answer_patterns.PARTS``)."""
        block = self.block_combo.currentIndex() - 1  # -1: the mean over blocks
        return self.section.masses(r, block if block >= 0 else None)

    def _fill(self) -> None:
        rows = self.rows()
        headers = ["answer token", *(title for _, title in PARTS)]
        set_columns(self.table, headers)
        self.table.setRowCount(len(rows))
        if not rows:
            self.title.setText(NO_PATTERNS)
            return
        chosen = self.chosen_row()
        self.title.setText(
            f"attention of the queries predicting answer tokens 0..{len(rows) - 1} "
            f"({self.block_combo.currentText()}; the token read out highlighted)"
        )
        bold = QFont(self.table.font())
        bold.setBold(True)
        for r, row in enumerate(rows):
            masses = self._masses(r)
            name = QTableWidgetItem(self.row_name(row))
            name.setToolTip(
                f"the query at sequence position {row.position} (token {row.token!r}) predicting "
                f"answer token {row.predicts}"
            )
            self.table.setItem(r, 0, name)
            for c, ((key, _), mass) in enumerate(zip(PARTS, masses, strict=True), start=1):
                if key == "image_mass" and not self.image_is_key:
                    item = QTableWidgetItem(NOT_IN_SEQUENCE)
                    item.setBackground(QBrush(NOT_IN_SEQUENCE_COLOUR))
                    item.setToolTip(
                        "the image is no key of self-attention in this model: it enters through the "
                        f"cross-attention blocks ({', '.join(self.cross_mass)}), see the note above"
                    )
                else:
                    item = QTableWidgetItem(f"{mass:.3f}")
                    item.setBackground(QBrush(mass_colour(mass)))
                self.table.setItem(r, c, item)
            if r == chosen:
                name.setBackground(QBrush(CHOSEN_ROW))
                for c in range(len(headers)):
                    self.table.item(r, c).setFont(bold)
        self.table.scrollToItem(self.table.item(chosen, 0))
