"""The Validation tab: state what a head or route does, check it with the seven-step
validation chain (docs/METHODS.md §4.11), and read the verdict with its evidence.

The panel never runs the model: Run emits :attr:`ValidationPanel.run_requested` and
the window asks the panel for the request its fields state
(:meth:`~ValidationPanel.validate_request`: a :class:`core.requests.ValidateRequest`, or
a :class:`app.panels.run_requests.Refusal`), runs it in a worker and hands the
:class:`core.validate.Validation` back with :meth:`~ValidationPanel.show_claim` (a run
restored from the History: :meth:`~ValidationPanel.show_restored`).

A claim is checked on a model, not on an input, so it does not join the
workspace's shown run (a run of one image and question): there it would become
the shown run whenever the input had moved on since the read-out, turning the
selected component stale and parting the follow-ups from their read-out, and a
new image would clear it. The panel keeps the claim it shows with the model it
was checked on (:attr:`ValidationPanel.claim_run`) and follows the workspace's input
itself: another model, dtype, device or other weights clear it, saying so; a new
image or question leaves it.

* subject: a head (``L1.H1``; CoCa ``L1.xattn.H2``) or a route of one block
  (``L1.H0+L1.H1``), several separated by commas; a head selected in Attention
  or DLA (:class:`app.components.selection.Selection`) fills the field;
* dataset: the bundled samples, generated shape scenes, or a folder holding a
  pairs JSONL; ``n`` inputs per set; the painted region as the target of every
  line without a mask of its own;
* result: the verdict and the distribution it holds on, then the seven steps
  as a checklist (status, key number, n, baselines with their 95% interval);
  a step clicked shows its evidence (criterion, why, numbers, baselines, and
  for steps 1, 4 and 5 the per-sample distribution / the swap pairs / the
  ablation distribution). One chain per subject: the combo picks which.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

import core
from app.components import RunInput, ShownRun
from app.components.selection import SelectedComponent, Selection, is_head
from app.panels.run_requests import Refusal, RunningLine
from app.widgets import ElidedLabel, boxed, plain_label, set_columns, set_title, split, stacked, style_plot, text_scroll
from core.methods.validation.chain import SwapPair
from core.methods.validation.spec import ATTRIBUTE_MOVING, SHIPPED, ClaimSpec
from core.methods.validation.spec import resolve as resolve_spec
from core.requests import ValidateRequest

if TYPE_CHECKING:
    from app.components import Workspace
    from core.session import Run

COLUMNS = ("step", "title", "status", "key number", "n", "baselines (95% interval)")
STATUS_COLUMN = COLUMNS.index("status")
STATUS_COLOURS = {"passed": "#d6f5d6", "failed": "#f8d0d0", "not tested": "#e6e6e6"}
DATASETS = {"bundled": "bundled samples", "scenes": "generated shape scenes", "folder": "folder…"}
NO_RESULT = "no claim checked yet: name a head or route, state the claim, pick the data and Run"
SUBJECT_HINT = "head or route: L1.H1, L1.H0+L1.H1 (several: comma-separated); a head selected in Attention or DLA"
CLAIM_HINT = "the claim with its condition, e.g. 'L1.H1 reads the colour of the shape asked about, at the answer'"
CLAIM_KINDS = ("validate",)  # the result kinds the panel draws
# the RunInput fields that name the model a claim was checked on (the others name an input)
MODEL_FIELDS = ("model_spec", "model_dtype", "model_device", "model_fingerprint")


def _number(value) -> str:
    return "—" if value is None else f"{value:.3g}"


def interval(baseline) -> str:
    """`` [0.494, 1.01]``: a baseline's 95% interval (empty when it has none)."""
    ci = baseline.interval
    return "" if ci is None else f" [{ci[0]:.3g}, {ci[1]:.3g}]"


def baseline_line(step, baseline) -> str:
    """One baseline of a step: its value and 95% interval; step 6's are paired
    comparisons (the baseline against the candidate on one step's metric)."""
    if step.number == 6:
        return (
            f"step {baseline.compared_step} {baseline.kind}: {_number(baseline.value)} vs "
            f"{_number(baseline.candidate_value)}, difference{interval(baseline)}"
        )
    return f"{baseline.kind}: {_number(baseline.value)}{interval(baseline)}"


def baselines_cell(step) -> str:
    """The checklist's compact baselines cell (step 6: how many comparisons; the details list them)."""
    if not step.baselines:
        return ""
    if step.number == 6:
        return f"{len(step.baselines)} paired comparisons (click for each)"
    return "; ".join(baseline_line(step, b) for b in step.baselines)


def step_cells(step) -> tuple[str, ...]:
    """A checklist row: step, title, status, key number, n, baselines."""
    key = f"{step.metric} {_number(step.value)}" if step.metric and step.value is not None else "—"
    n = f"{step.n} ({step.split})" if step.n else ""
    return str(step.number), step.title, step.status, key, n, baselines_cell(step)


def _scalars(numbers: dict) -> list[str]:
    """The step's numbers that are one value each (lists and tables are drawn, not printed)."""
    lines = []
    for name, v in numbers.items():
        if isinstance(v, bool) or v is None or isinstance(v, str):
            lines.append(f"  {name}: {v}")
        elif isinstance(v, (int, float)):
            lines.append(f"  {name}: {v:.4g}")
    return lines


def step_details(step) -> str:
    """The evidence of one step as text: criterion, status and why, the numbers, the baselines, notes."""
    lines = [f"step {step.number}: {step.title}", f"criterion: {step.criterion}", f"status: {step.status}"]
    if step.why:
        lines.append(f"why: {step.why}")
    if step.n:
        lines.append(f"n = {step.n} on {step.split}")
    scalars = _scalars(step.numbers)
    if scalars:
        lines += ["numbers:", *scalars]
    if step.baselines:
        lines += ["baselines:", *(f"  {baseline_line(step, b)} (n={b.n})" for b in step.baselines)]
    lines += [f"note: {note}" for note in step.notes]
    return "\n".join(lines)


class ValidationPanel(QWidget):
    """The claim, its data, Run, and the checklist of the chain shown (see the module docstring).

    Signals:
        run_requested(): check the claim as the fields state it.
        choices_changed(): a field changed (the subject, the claim, the data, the region box):
            a refusal may be met.

    Args:
        selection: a head selected in Attention or DLA names the subject.
        workspace: whose model the claim shown follows (default: the selection's).

    Attributes:
        validation: the :class:`core.validate.Validation` shown, or None.
        claim_run: the run shown (:class:`app.components.ShownRun` of kind ``validate``, its
            ``input`` the model it was checked on), or None.
    """

    run_requested = Signal()
    choices_changed = Signal()

    def __init__(self, selection: Selection, workspace: Workspace | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.workspace = workspace if workspace is not None else selection.workspace
        self.validation = None  # the core.validate.Validation shown
        self.claim_run: ShownRun | None = None
        self.folder: Path | None = None
        self.bundled: Path | None = None  # the bundled samples' folder (set by the window)

        self.subject_edit = QLineEdit()
        self.subject_edit.setPlaceholderText(SUBJECT_HINT)
        self.claim_edit = QLineEdit()
        self.claim_edit.setPlaceholderText(CLAIM_HINT)
        self.dataset_combo = QComboBox()
        for key, text in DATASETS.items():
            self.dataset_combo.addItem(text, key)
        self.dataset_combo.setCurrentIndex(self.dataset_combo.findData("scenes"))
        self.dataset_combo.activated.connect(self._on_dataset_activated)
        self.dataset_combo.setToolTip(
            "where the inputs come from: the bundled samples (halved into search and held-out), the synthetic "
            "shape scenes (their val split searched, the held-out split evaluated), or a folder holding a pairs JSONL"
        )
        # the claim's specification: the relation tested and each step's thresholds (a shipped one or a file)
        self.spec_combo = QComboBox()
        for name in SHIPPED:
            self.spec_combo.addItem(name, name)
        self.spec_combo.addItem("file…", "file")
        self.spec_combo.setToolTip(
            "the claim's specification: the relation the chain tests and each step's pre-registered threshold "
            "(a shipped one, or a JSON file of its fields)"
        )
        self.spec_combo.activated.connect(self._on_spec_activated)
        self.spec_loaded: ClaimSpec = ATTRIBUTE_MOVING
        self.n_spin = QSpinBox()
        self.n_spin.setRange(2, 5000)
        self.n_spin.setValue(150)
        self.n_spin.setToolTip("inputs per set (search and held-out); the other question kinds (step 7) get a third")
        self.region_check = QCheckBox("use the painted region for lines without a mask")
        self.region_check.setToolTip(
            "the region painted in the Counterfactual tab is the target of every line without one"
        )
        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("run the seven-step chain on each subject (cancel with the window's Cancel)")
        self.run_button.clicked.connect(self.run_requested)
        self.message_label = plain_label(wrap=True, selectable=True)

        # two lines, empty or not (the whole in the tooltip when cut): a verdict never moves the chain choice
        self.verdict_label = ElidedLabel(NO_RESULT, lines=2, selectable=True)
        self.verdict_label.setStyleSheet("font-weight: bold;")
        # fixed heights, the whole text a tooltip: the checklist keeps its room below; what was
        # tested (relation, condition, query, n) gets three lines: it is the verdict's scope
        self.distribution_label = ElidedLabel(lines=3, selectable=True)
        self.condition_label = ElidedLabel(selectable=True)
        self.condition_label.setStyleSheet("color: #444;")
        # one head may hold several labels, each on its relation and condition (4.5): the session's, listed
        self.labels_label = ElidedLabel(lines=2, selectable=True)
        self.labels_label.setStyleSheet("color: #444;")
        self.labels_source = None  # (subject, fingerprint) -> the session's labels of it (the window sets it)
        self.chain_combo = QComboBox()
        self.chain_combo.setToolTip("one chain per subject: the checklist shows this one")
        self.chain_combo.currentIndexChanged.connect(lambda _i: self._show_chain())
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setWordWrap(False)  # one line a step: the seven statuses at a glance (a cell's tooltip: all of it)
        self.table.verticalHeader().setVisible(False)
        header = set_columns(self.table, COLUMNS)
        header.setSectionResizeMode(
            0, QHeaderView.ResizeMode.ResizeToContents
        )  # the title and baselines share the room
        header.setSectionResizeMode(COLUMNS.index("title"), QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._on_step_selected)
        rows = self.table.verticalHeader().defaultSectionSize()
        self.table.setMinimumHeight(self.table.horizontalHeader().sizeHint().height() + 7 * rows + 4)

        self.details = plain_label("click a step to see its evidence", wrap=True, selectable=True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        # a step's evidence can run long: it scrolls, rather than growing the window past the screen
        self.details_scroll = text_scroll(self.details)
        self.plot = pg.PlotWidget(background="w")
        style_plot(self.plot.getPlotItem())
        self.plot.setMinimumSize(220, 80)  # with the checklist's seven rows, the tab fits 1280 x 800
        self.pairs_table = QTableWidget(0, 5)
        set_columns(self.pairs_table, ("sample", "target before", "target after", "partner before", "partner after"))
        self.pairs_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.pairs_table.verticalHeader().setVisible(False)
        self.pairs_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.pairs_table.setMinimumHeight(60)
        self.evidence_note = plain_label(wrap=True)
        self.evidence_note.setStyleSheet("color: #555;")

        form = QGridLayout()
        form.addWidget(plain_label("Subject"), 0, 0)
        form.addWidget(self.subject_edit, 0, 1, 1, 3)
        form.addWidget(plain_label("Claim"), 1, 0)
        form.addWidget(self.claim_edit, 1, 1, 1, 3)
        form.addWidget(plain_label("Data"), 2, 0)
        form.addWidget(self.dataset_combo, 2, 1)
        form.addWidget(boxed(QHBoxLayout(), plain_label("n"), self.n_spin, end_stretch=True), 2, 2)
        form.addWidget(self.run_button, 2, 3)
        form.addWidget(self.region_check, 3, 1, 1, 3)
        form.addWidget(plain_label("Relation"), 4, 0)
        form.addWidget(self.spec_combo, 4, 1, 1, 3)
        form.addWidget(self.message_label, 5, 0, 1, 4)
        form.setColumnStretch(1, 1)
        # which chain the checklist shows, below the distribution the verdict holds on
        chain_row = boxed(QHBoxLayout(), plain_label("chain of"), (self.chain_combo, 1))
        evidence = stacked((self.plot, 1), (self.pairs_table, 1), self.evidence_note)
        lower = split(Qt.Orientation.Horizontal, self.details_scroll, evidence, sizes=[420, 380])
        body = split(Qt.Orientation.Vertical, self.table, lower, sizes=[300, 300])
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.verdict_label)
        layout.addWidget(self.distribution_label)
        layout.addWidget(chain_row)
        layout.addWidget(self.condition_label)
        layout.addWidget(self.labels_label)
        layout.addWidget(body, 1)

        disconnects = [
            selection.changed.connect(self._on_selection),
            self.workspace.events.input_changed.connect(self._follow_model),
        ]
        self.destroyed.connect(lambda *_: [disconnect() for disconnect in disconnects])  # they may outlive it
        for changed in (
            self.subject_edit.textChanged,
            self.claim_edit.textChanged,
            self.dataset_combo.currentIndexChanged,
            self.region_check.toggled,
        ):
            changed.connect(lambda *_: self.choices_changed.emit())
        self.running = RunningLine(self.show_message, self.message_label)
        self.clear_result()

    # ----- choices -------------------------------------------------------

    def subjects(self) -> list[str]:
        """The heads and routes named, in order (``L1.H0 + L1.H1`` is one route)."""
        return [s.replace(" ", "") for s in self.subject_edit.text().split(",") if s.strip()]

    def claim(self) -> str:
        return self.claim_edit.text().strip()

    def set_spec(self, name_or_file: str | Path) -> bool:
        """Use a shipped specification (its name) or a JSON file's; False, with the one line
        naming the field in the message line, for a file that cannot be read (the choice stays)."""
        try:
            spec = resolve_spec(str(name_or_file))
        except core.ReadoutError as e:
            self.show_message(str(e))
            self.spec_combo.setCurrentIndex(self._spec_index())
            return False
        shipped = SHIPPED.get(str(name_or_file)) == spec
        self.use_spec(spec, None if shipped else f"file: {Path(name_or_file).name}", str(name_or_file))
        return True

    def use_spec(self, spec: ClaimSpec, label: str | None = None, where: str = "") -> None:
        """Check claims as ``spec``: a shipped one (``label`` None) picked in the Relation field,
        another shown as ``label`` (a file's, or a restored run's) with ``where`` as its tooltip."""
        self.spec_loaded = spec
        index = self.spec_combo.findData(spec.name if label is None else "file")
        if label is not None:
            self.spec_combo.setItemText(index, f"{label} ({spec.name})")
            self.spec_combo.setItemData(index, where, Qt.ItemDataRole.ToolTipRole)
        self.spec_combo.setCurrentIndex(index)
        self.choices_changed.emit()

    def set_dataset(self, key: str) -> None:
        """``bundled``, ``scenes`` or ``folder`` (the folder chosen with :meth:`set_folder`)."""
        index = self.dataset_combo.findData(key)
        if index < 0:
            raise ValueError(f"dataset {key!r}: expected one of {', '.join(DATASETS)}")
        self.dataset_combo.setCurrentIndex(index)

    def set_folder(self, folder: str | Path) -> None:
        """Use ``folder`` (a pairs JSONL, or a folder holding one) as the dataset."""
        self.folder = Path(folder)
        self.dataset_combo.setItemText(self.dataset_combo.findData("folder"), f"folder: {self.folder.name}")
        self.dataset_combo.setItemData(
            self.dataset_combo.findData("folder"), str(self.folder), Qt.ItemDataRole.ToolTipRole
        )
        self.set_dataset("folder")

    def dataset(self) -> str | None:
        """The source :func:`core.validate.validate` reads: ``scenes``, the bundled samples' folder, the
        folder chosen; None when the choice has no place (a folder not chosen yet)."""
        key = self.dataset_combo.currentData()
        if key == "scenes":
            return "scenes"
        folder = self.bundled if key == "bundled" else self.folder
        return None if folder is None else str(folder)

    def n(self) -> int:
        return int(self.n_spin.value())

    def uses_region(self) -> bool:
        return self.region_check.isChecked()

    # ----- state -----------------------------------------------------------

    def set_busy(self, busy: bool) -> None:
        self.run_button.setEnabled(not busy)

    def run_buttons(self) -> tuple[QPushButton, ...]:
        """The buttons that start a job (disabled while one runs)."""
        return (self.run_button,)

    # ----- the request -------------------------------------------------------

    def validate_request(self, painted: Callable[[], np.ndarray]) -> ValidateRequest | Refusal:
        """The claim as the fields state it, checked on its subjects and data (``painted()``: the
        region painted in the Counterfactual tab, the target of the lines without a mask when the
        box is ticked); or why it cannot run as stated (until the field is filled)."""
        subjects, claim, dataset = self.subjects(), self.claim(), self.dataset()
        if not subjects:
            return Refusal(
                "name a head or route (L1.H1, L1.H0+L1.H1), or select a head in Attention or DLA",
                lambda: bool(self.subjects()),
            )
        if not claim:
            return Refusal(
                "state the claim: what the head or route is said to do, and on which inputs", lambda: bool(self.claim())
            )
        if dataset is None:
            return Refusal(
                "choose the dataset folder (holding a pairs JSONL), or another dataset",
                lambda: self.dataset() is not None,
            )
        region = painted() if self.uses_region() else None
        if region is not None and not region.any():
            return Refusal(
                "painted region: paint one in the Counterfactual tab, or untick its box",
                lambda: not self.uses_region() or painted().any(),
            )
        n = self.n()
        spec = None if self.spec_loaded == ATTRIBUTE_MOVING else self.spec_loaded.to_dict()  # as the CLI's --spec
        return ValidateRequest(
            subjects=tuple(subjects),
            claim=claim,
            dataset=dataset,
            n=n,
            n_side=max(1, n // 3),
            region=region,
            spec=spec,
        )

    def show_running(self, request: ValidateRequest) -> None:
        """The "running: …" line of ``request``, until the job ends or its result is drawn."""
        self.running.show(f"running: the seven-step chain on {', '.join(request.subjects)}…")

    def end_running(self) -> None:
        """The job ended: its "running: …" line goes (a message shown since stays)."""
        self.running.end()

    # ----- a claim drawn -----------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s ``validate`` result (a live run and a restored one alike; ``run.input``: the
        model it was checked on); None, or a run without one, clears the panel."""
        validation = run.results.get("validate") if run is not None else None
        if validation is None:
            self.clear_result()
            return
        self.claim_run = run
        self.show_validation(validation)
        self.running.end()  # its result is drawn

    def show_claim(self, validation, run_id: int | None, made_for: RunInput) -> None:
        """Show a claim just checked: ``validation`` (recorded as run ``run_id``) on the model of
        ``made_for`` (the input the job was started with, its model as loaded)."""
        self.draw(ShownRun(run_id, "validate", made_for, {"validate": validation}))

    def show_restored(self, run: Run, made_for: RunInput, not_restored: str | None = None) -> None:
        """Show a recorded ``validate`` run (``run.readout``) restored from the History, checked on
        the model of ``made_for``; the message line says it was restored, or (red) what of its
        choices could not be (``not_restored``)."""
        self.draw(ShownRun(run.id, "validate", made_for, {"validate": run.readout}))
        self.show_message(
            not_restored or f"run #{run.id} of {run.created}, restored from the History", error=bool(not_restored)
        )

    def _follow_model(self, fields: tuple) -> None:
        """Another model picked (or other weights loaded): the claim checked on the previous one goes."""
        made_for = self.claim_run.input if self.claim_run is not None else None
        if made_for is None or not set(MODEL_FIELDS).intersection(fields):
            return
        now = self.workspace.input
        other_weights = made_for.model_fingerprint and now.model_fingerprint not in (None, made_for.model_fingerprint)
        if made_for.model_choice() != now.model_choice() or other_weights:
            self.clear_result(
                f"the claim shown was checked on {made_for.model_label()}; the model is now "
                f"{now.model_label() if now.model_spec else 'none'}: run it again, or restore it from the History"
            )

    def show_message(self, message: str, *, error: bool = False) -> None:
        """One line under the fields (red for an error); empty clears it."""
        self.message_label.setStyleSheet("color: #c00000;" if error else "color: #333;")
        self.message_label.setText(" ".join(message.split()))

    def show_validation(self, validation) -> None:
        """Show a :class:`core.validate.Validation`: the verdict of its first chain, its checklist."""
        self.validation = validation
        self.chain_combo.blockSignals(True)
        self.chain_combo.clear()
        self.chain_combo.addItems([f"{c.subject} ({c.subject_kind})" for c in validation.chains])
        self.chain_combo.blockSignals(False)
        self.chain_combo.setEnabled(len(validation.chains) > 1)
        search, held = validation.search, validation.heldout
        self.condition_label.setText(
            f"claim: {validation.claim.text!r} ({validation.claim.relation}, at the {validation.claim.position}); "
            f"model {validation.model}; candidates {validation.found_by}, searched on {search.describe()}"
            + (" [cancelled: the steps not reached are not tested]" if validation.cancelled else "")
        )
        if not validation.chains:
            self.verdict_label.setText(f"no chain ran (held-out set: {held.describe()})")
        self._show_chain()

    def clear_result(self, note: str = "") -> None:
        """Nothing shown (``note``: why, in place of the verdict)."""
        self.validation = self.claim_run = None
        self.chain_combo.clear()
        self.chain_combo.setEnabled(False)
        self.verdict_label.setText(note or NO_RESULT)
        self.condition_label.setText("")
        self.distribution_label.setText("")
        self.labels_label.setText("")
        self.table.setRowCount(0)
        self._show_step(None)

    def chain(self):
        """The :class:`core.methods.validation.ValidationChain` the checklist shows, or None."""
        index = self.chain_combo.currentIndex()
        if self.validation is None or not 0 <= index < len(self.validation.chains):
            return None
        return self.validation.chains[index]

    def status_texts(self) -> list[str]:
        """Each checklist row's status cell, step 1 first (what a reader sees)."""
        return [self.table.item(r, STATUS_COLUMN).text() for r in range(self.table.rowCount())]

    def select_step(self, number: int) -> bool:
        """Show step ``number``'s evidence, as a click on its row does; False when no chain is shown."""
        chain = self.chain()
        if chain is None or number not in chain.steps:
            return False
        self.table.selectRow(list(chain.steps).index(number))
        return True

    # ----- drawing ---------------------------------------------------------

    def _show_chain(self) -> None:
        chain = self.chain()
        if chain is None:
            self.table.setRowCount(0)
            self._show_step(None)
            return
        status, held = chain.status(), self.validation.held_back(chain)
        said = "supported" if chain.label().supported else f"not supported: {status.status}, held back by step {held}"
        self.verdict_label.setText(f"{chain.subject}: {said}; {chain.steps_passed()}")
        self.verdict_label.setToolTip(status.reason)
        self.distribution_label.setText(self.validation.tested())  # the relation, condition and n above the steps
        self._show_labels(chain.subject)
        steps = list(chain.steps.values())
        self.table.blockSignals(True)
        self.table.clearSelection()
        self.table.setRowCount(len(steps))
        for r, step in enumerate(steps):
            baselines = "\n".join(baseline_line(step, x) for x in step.baselines)
            for c, text in enumerate(step_cells(step)):
                item = QTableWidgetItem(text)
                item.setToolTip(baselines if c == len(COLUMNS) - 1 else step.why or step.criterion)
                if c == STATUS_COLUMN:
                    item.setBackground(QColor(STATUS_COLOURS[step.status]))
                self.table.setItem(r, c, item)
        self.table.blockSignals(False)
        self._show_step(None)

    def _show_labels(self, subject: str) -> None:
        """Every label the session's validate runs gave ``subject`` on these weights, each with its
        relation's specification, status and condition (the whole list in the tooltip when cut)."""
        labels = self.labels_source(subject, self.validation.fingerprint) if self.labels_source else []
        if not labels:
            self.labels_label.setText("")
            return
        said = "; ".join(f"#{x['run']} {x['specification']}: {x['status']} on {x['condition']}" for x in labels)
        self.labels_label.setText(f"labels of {subject} in this session ({len(labels)}): {said}")

    def _on_step_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        chain = self.chain()
        if rows and chain is not None:
            self._show_step(list(chain.steps.values())[rows[0].row()])

    def _show_step(self, step) -> None:
        """The details pane and the evidence drawing of ``step`` (None: a hint)."""
        self.plot.getPlotItem().clear()
        self.plot.setVisible(False)
        self.pairs_table.setVisible(False)
        self.evidence_note.setText("")
        if step is None:
            self.details.setText("click a step to see its evidence" if self.validation is not None else "")
            return
        self.details.setText(step_details(step))
        per, pairs = step.per_sample, step.swap_pairs
        if step.number == 1 and per is not None and per.target_mass is not None:
            self._histogram(per.target_mass, "attention mass on the target per held-out input", "target mass")
            hits = sum(1 for h in (per.hit if per.hit is not None else ()) if h)
            self.evidence_note.setText(f"{hits} of {len(per.target_mass)} inputs have their argmax on the target")
        elif step.number == 5 and per is not None and per.drop_mean is not None:
            self._histogram(per.drop_mean, "drop of S under mean ablation per held-out input", "drop of S")
            drop_zero = per.drop_zero  # a list read back from a session, an array from the run itself
            self.evidence_note.setText(
                f"zero ablation: mean drop {float(np.mean(drop_zero)):.3g}"
                if drop_zero is not None and len(drop_zero)
                else ""
            )
        elif step.number == 4 and pairs:
            self._show_pairs(pairs)
        elif step.number in (1, 4, 5):
            self.evidence_note.setText("this result holds no per-sample evidence (recorded before it was kept)")

    def _histogram(self, values, title: str, x_label: str) -> None:
        values = np.asarray([v for v in values if v is not None], dtype=float)
        plot = self.plot.getPlotItem()
        if values.size:
            counts, edges = np.histogram(values, bins=min(20, max(4, values.size // 2)))
            plot.addItem(pg.BarGraphItem(x0=edges[:-1], x1=edges[1:], height=counts, brush="#4a78b5"))
        set_title(plot, f"{title} (n={values.size})", "9pt")
        plot.setLabel("bottom", x_label)
        plot.setLabel("left", "inputs")
        self.plot.setVisible(True)

    def _show_pairs(self, pairs: list[SwapPair]) -> None:
        self.pairs_table.setRowCount(len(pairs))
        for r, pair in enumerate(pairs):
            masses = (
                pair.mass_target_before,
                pair.mass_target_after,
                pair.mass_partner_before,
                pair.mass_partner_after,
            )
            cells = (str(pair.sample), *("None" if v is None else f"{v:.3f}" for v in masses))
            for c, text in enumerate(cells):
                self.pairs_table.setItem(r, c, QTableWidgetItem(text))
        self.pairs_table.setVisible(True)
        followed = sum(1 for p in pairs if p.follows)
        self.evidence_note.setText(
            f"swap pairs: the head's mass on the target and its partner location before and after the swap; "
            f"{followed} of {len(pairs)} follow the swap"
        )

    def _on_selection(self, selected: SelectedComponent | None) -> None:
        """A head selected in Attention or DLA names the subject (a lens row or a bar that is no head does not)."""
        if selected is not None and selected.view in ("attention", "dla") and is_head(selected.name):
            self.subject_edit.setText(selected.name)

    def _on_spec_activated(self, index: int) -> None:
        choice = self.spec_combo.itemData(index)
        if choice != "file":
            self.set_spec(choice)
            return
        path, _ = QFileDialog.getOpenFileName(self, "Claim specification (JSON)", "", "JSON (*.json)")
        if path:
            self.set_spec(path)
        else:
            self.spec_combo.setCurrentIndex(self._spec_index())

    def _spec_index(self) -> int:
        """The combo entry of the specification in use (a shipped one's, or the file's)."""
        shipped = SHIPPED.get(self.spec_loaded.name) == self.spec_loaded
        return self.spec_combo.findData(self.spec_loaded.name if shipped else "file")

    def _on_dataset_activated(self, index: int) -> None:
        if self.dataset_combo.itemData(index) == "folder":
            folder = QFileDialog.getExistingDirectory(self, "Dataset folder (holding a pairs JSONL)")
            if folder:
                self.set_folder(folder)
