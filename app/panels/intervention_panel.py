"""The intervention controls and their results table.

The controls (:class:`InterventionPanel`) sit in the Counterfactual tab's
controls column; the table (:class:`InterventionResults`, ``panel.results``)
beside the answer change
(:meth:`app.panels.counterfactual_panel.CounterfactualPanel.host_interventions`).
The panel never runs the model: Ablate and Patch emit
:attr:`InterventionPanel.ablate_requested` / :attr:`InterventionPanel.patch_requested`;
the window asks the panel for the request its choices make
(:meth:`~InterventionPanel.ablation_request`, :meth:`~InterventionPanel.patch_request`:
a :class:`core.requests.AblationRequest` / :class:`core.requests.PatchingRequest`, or
a :class:`app.panels.run_requests.Refusal`) and runs it. The table draws the
intervention result of the run the Counterfactual tab shows
(:meth:`InterventionPanel.draw`, a live run and a restored one alike).

* component: the one selected last in Attention, DLA or Lens
  (:class:`app.components.selection.Selection`), named with its view;
* ablation kind: zero, mean (over the reference set: the bundled sample images,
  each asked the question shown) or resample (the source image);
* positions: the answer position, every position, or the painted region's
  visual tokens; a patch copies the painted region's visual tokens (every
  visual token with "all positions");
* patch: the site (only those the loaded family has: vision_out,
  projector_out, resid entering block l, kv_source) and the source image (a
  bundled sample or a file).

The table has one row per edit set (an ablation) or per token set and
direction (a patch): the answer, its logit difference (the answer logit
without a foil) and probability before -> after (change), the prediction
before -> after, and whether it flipped. A reverse row starts from the source
image's run. A run restored from the History fills the same table and sets
the choices it was made with (:meth:`InterventionPanel.restore_choices`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

import core
from app.components.selection import SelectedComponent, Selection
from app.panels import analysis_of
from app.panels.run_requests import IMAGE_FILTER, Refusal, RunningLine, read_source, selected_other_than
from app.widgets import ElidedLabel, plain_label, set_columns
from core.methods.interventions import InterventionResult, VisualPatchResult
from core.requests import AblationRequest, PatchingRequest
from core.requests.patching import ALL_VISUAL_TOKENS
from core.requests.recorded import RecordedParameters

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult

KINDS = {"zero": "zero", "mean": "mean", "resample": "resample"}  # engine kind -> combo text
POSITIONS = {"target": "answer position", "all": "all positions", "region": "painted region"}
SITE_TITLES = {
    "vision_out": "vision output",
    "projector_out": "projector output",
    "resid": "residual",  # entering the block chosen beside it
    "kv_source": "kv source",  # what cross-attention keys and values read
}
EARLIEST_SITE = "earliest visual site"  # the site entry before the model is loaded: the job picks it
EVERY_CROSS_BLOCK = "every cross block"
NO_SELECTION = "select a head (Attention), a bar (DLA) or a lens row (Lens) to ablate it"
NO_RESULT = "no intervention yet: select a component and Ablate, or paint a region and Patch"
COLUMNS = ("edit", "answer", "logit diff", "prob", "predicted", "flipped")


def _compact_combo(items: Sequence[tuple[str, object]] = ()) -> QComboBox:
    """A combo whose width never follows its longest item (file names would widen the column)."""
    combo = QComboBox()
    combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    combo.setMinimumContentsLength(8)
    for text, data in items:
        combo.addItem(text, data)
    return combo


def _select_data(combo: QComboBox, data) -> bool:
    index = combo.findData(data)
    if index >= 0:
        combo.setCurrentIndex(index)
    return index >= 0


def describe_result(result: InterventionResult | VisualPatchResult) -> str:
    """The table's title: which intervention, where, on which answer (and foil)."""
    original = result.original
    answer = f"answer {original.answer!r}" + (f" vs foil {original.foil!r}" if original.foil is not None else "")
    if isinstance(result, VisualPatchResult):
        where = result.site if result.layer is None else f"{result.site} block {result.layer}"
        named = Path(result.source_image_path).name if result.source_image_path else "pixels without a file"
        sha = f" (sha256 {result.source_image_sha256[:12]})" if result.source_image_sha256 else ""
        return f"visual-feature patching at {where} from {named}{sha}; {answer}"
    kind = f" ({result.ablation})" if result.ablation else ""
    return f"{result.method}{kind} read at position {result.position}; {answer}"


def _change(before: float | None, after: float | None, digits: int, signed: bool = True) -> str:
    """``+3.210 → +0.500`` and, on the next line, the change ``(-2.710)``; a change too small
    for ``digits`` decimals is written in exponent form (a probability near 1 moves little)."""
    if before is None or after is None:
        return "—"
    sign = "+" if signed else ""
    change = after - before
    tiny = change != 0 and abs(change) < 0.5 * 10**-digits
    written = f"{change:+.1e}" if tiny else f"{change:+.{digits}f}"
    return f"{before:{sign}.{digits}f} → {after:{sign}.{digits}f}\n({written})"


class InterventionResults(QWidget):
    """The results table: one row per edit set or token set and direction."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.result: InterventionResult | VisualPatchResult | None = None
        self.title = plain_label(NO_RESULT, wrap=True, selectable=True)
        self.title.setStyleSheet("font-weight: bold;")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setWordWrap(True)  # the edit's label wraps in the room the numbers leave
        self.table.verticalHeader().setVisible(False)
        header = set_columns(self.table, COLUMNS)
        header.sectionResized.connect(lambda *_: self.table.resizeRowsToContents())
        self.note = plain_label(
            "before → after (change); the score is the logit difference, the answer logit without a foil",
            wrap=True,
        )
        self.note.setStyleSheet("color: #666; font-size: 9pt;")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.note)

    def show_result(self, result: InterventionResult | VisualPatchResult) -> None:
        """Fill the table from an intervention result (an ablation's edit sets, or a visual patch's
        token sets forward and reverse: a reverse row starts from the source image's run), made now
        or restored from a session."""
        self.result = result
        rows = result.effect_rows()
        has_foil = result.original.foil is not None
        self.table.horizontalHeaderItem(2).setText("logit diff" if has_foil else "logit (no foil)")
        self.title.setText(describe_result(result) if rows else f"{describe_result(result)}: no edit set ran")
        self.table.setRowCount(len(rows))
        for r, (label, row) in enumerate(rows):
            before, after, flipped = row.original, row.edited, row.effect.flipped
            score = (lambda t: t.logit_diff) if has_foil else (lambda t: t.logit)
            cells = (
                label,
                str(before.answer),
                _change(score(before), score(after), 3),
                _change(before.prob, after.prob, 4, signed=False),
                f"{before.predicted} →\n{after.predicted}",
                "yes" if flipped else "no",
            )
            line = row.line(label)  # the whole row, as the summary says it
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(line)
                if c:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()

    def clear(self) -> None:
        self.result = None
        self.title.setText(NO_RESULT)
        self.table.setRowCount(0)

    def texts(self) -> list[list[str]]:
        """Every cell's text, row by row (what a reader sees)."""
        return [
            [self.table.item(r, c).text() for c in range(self.table.columnCount())]
            for r in range(self.table.rowCount())
        ]


class InterventionPanel(QWidget):
    """The intervention controls (see the module docstring); the table is :attr:`results`.

    Signals:
        ablate_requested(): ablate the selected component with the chosen kind and positions.
        patch_requested(): patch the chosen site from the chosen source image.
        choices_changed(): the positions or the source image chosen changed (a refusal may be met).

    Attributes:
        analysis: the read-out of the run drawn (:meth:`draw`): an ablation's component is named
            in its blocks.
    """

    ablate_requested = Signal()
    patch_requested = Signal()
    choices_changed = Signal()

    def __init__(self, selection: Selection, parent: QWidget | None = None):
        super().__init__(parent)
        self.selection = selection
        self.references: list[Path] = []
        self.reference_set = ""
        self.analysis: AnalyzeResult | None = None
        self.results = InterventionResults()

        self.component_label = ElidedLabel(NO_SELECTION, lines=2, selectable=True)
        self.kind_combo = _compact_combo([(text, kind) for kind, text in KINDS.items()])
        self.kind_combo.setToolTip(
            "zero: the write removed; mean: replaced by its mean over the reference images; "
            "resample: replaced by its value on the source image"
        )
        self.positions_combo = _compact_combo([(text, where) for where, text in POSITIONS.items()])
        self.positions_combo.setToolTip(
            "where the write is ablated: the answer position read out, every position, or the painted "
            "region's visual tokens. A patch copies the painted region (every visual token with 'all positions')"
        )
        self.reference_label = plain_label(wrap=True)
        self.reference_label.setStyleSheet("color: #555;")
        self.source_combo = _compact_combo([("choose a source image", None)])
        self.source_combo.setToolTip("the other image of resample ablation and of patching (asked the same question)")
        self.source_button = QPushButton("File…")
        self.source_button.setToolTip("choose an image file as the source")
        self.source_button.clicked.connect(self._pick_source)
        self.site_combo = _compact_combo([(EARLIEST_SITE, None)])
        self.site_combo.setToolTip("where the source image's visual-token features are copied in")
        self.block_combo = _compact_combo()
        self.block_combo.setToolTip("the block: the residual entering it, or the cross block reading the patch")
        self.ablate_button = QPushButton("Ablate")
        self.ablate_button.setToolTip("ablate the selected component and re-run at the answer token read out")
        self.ablate_button.clicked.connect(self.ablate_requested)
        self.patch_button = QPushButton("Patch")
        self.patch_button.setToolTip("copy visual-token features from the source image into this run (and back)")
        self.patch_button.clicked.connect(self.patch_requested)
        self.message_label = plain_label(wrap=True, selectable=True)
        self.message_label.setStyleSheet("color: #333;")

        group = QGroupBox("Interventions")
        grid = QGridLayout(group)
        grid.setContentsMargins(4, 4, 4, 4)
        # The controls keep their places whatever is selected or chosen: the component line has a
        # fixed height, and the lines that come and go (mean's reference set, a message) follow the buttons.
        grid.addWidget(self.component_label, 0, 0, 1, 2)
        grid.addWidget(self.kind_combo, 1, 0)
        grid.addWidget(self.positions_combo, 1, 1)
        grid.addWidget(self.source_combo, 2, 0)
        grid.addWidget(self.source_button, 2, 1)
        grid.addWidget(self.site_combo, 3, 0)
        grid.addWidget(self.block_combo, 3, 1)
        grid.addWidget(self.ablate_button, 4, 0)
        grid.addWidget(self.patch_button, 4, 1)
        grid.addWidget(self.reference_label, 5, 0, 1, 2)
        grid.addWidget(self.message_label, 6, 0, 1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(group)

        self.kind_combo.currentIndexChanged.connect(lambda _i: self._show_reference())
        self.positions_combo.currentIndexChanged.connect(lambda _i: self.choices_changed.emit())
        self.source_combo.currentIndexChanged.connect(lambda _i: self.choices_changed.emit())
        self.running = RunningLine(self.show_message, self.message_label)
        self.site_combo.currentIndexChanged.connect(lambda _i: self._fill_blocks())
        self._blocks: list[tuple[str, str]] = []
        self._pending_site: tuple[str, int | None] | None = None  # chosen before the model's sites were known
        disconnect = selection.changed.connect(self.show_selection)
        self.destroyed.connect(lambda *_: disconnect())  # the selection may outlive this widget
        self.show_selection(selection.current)
        self._show_reference()
        self._fill_blocks()

    # ----- choices -------------------------------------------------------

    def kind(self) -> str:
        return self.kind_combo.currentData()

    def set_kind(self, kind: str) -> None:
        if not _select_data(self.kind_combo, kind):
            raise ValueError(f"ablation kind {kind!r}: expected one of {', '.join(KINDS)}")

    def positions(self) -> str:
        return self.positions_combo.currentData()

    def set_positions(self, positions: str) -> None:
        if not _select_data(self.positions_combo, positions):
            raise ValueError(f"positions {positions!r}: expected one of {', '.join(POSITIONS)}")

    def set_references(self, paths: Sequence[str | Path], name: str) -> None:
        """The mean's reference set: ``paths`` (images, each asked the shown question), called ``name``."""
        self.references = [Path(p) for p in paths]
        self.reference_set = name
        self._show_reference()

    def set_sources(self, sources: Sequence[tuple[str, str | Path]]) -> None:
        """The source images offered (``(name, path)``: the bundled samples), after the placeholder."""
        for name, path in sources:
            if self.source_combo.findData(str(path)) < 0:
                self.source_combo.addItem(name, str(path))

    def set_source(self, path: str | Path) -> None:
        """Choose ``path`` as the source image (added to the list when it is not in it)."""
        path = str(path)
        if self.source_combo.findData(path) < 0:
            self.source_combo.addItem(Path(path).name, path)
        _select_data(self.source_combo, path)
        self.source_combo.setToolTip(path)

    def source(self) -> str | None:
        """The chosen source image's path, or None (none chosen)."""
        return self.source_combo.currentData()

    def set_patch_sites(
        self, sites: Sequence[str] | None, blocks: Sequence[tuple[str, str]] = (), default: str | None = None
    ) -> None:
        """The sites the loaded family can patch (None: not known yet, the job picks the earliest)
        and its blocks ``[(name, kind)]`` ("self" / "cross"), for the block choice. The choice
        made is kept when the new list has it, else ``default`` is chosen."""
        if sites is None and self._pending_site is not None:  # still not known: the choice stays shown
            self._show_pending_site(*self._pending_site)
            return
        self._pending_site = None
        site, layer = self.site_choice()
        site = site or default
        self._blocks = list(blocks)
        self.site_combo.blockSignals(True)
        self.site_combo.clear()
        if sites is None:
            self.site_combo.addItem(EARLIEST_SITE, None)
        for s in sites or ():
            self.site_combo.addItem(SITE_TITLES.get(s, s), s)
        if site is not None:
            _select_data(self.site_combo, site)
        self.site_combo.blockSignals(False)
        self._fill_blocks()
        if layer is not None:
            _select_data(self.block_combo, layer)

    def set_site(self, site: str, layer: int | None = None) -> None:
        """Choose ``site`` (one of the family's) and its block (``resid``; ``kv_source``: None = every cross
        block). Before the model is loaded (its sites not known yet) the choice is shown as it is and
        kept when :meth:`set_patch_sites` lists the family's sites (the family's default if it lacks it)."""
        if site == "resid" and layer is None:
            layer = 0
        if not self.sites():
            self._show_pending_site(site, layer)
            return
        if not _select_data(self.site_combo, site):
            raise ValueError(f"site {site!r}: this model has {', '.join(self.sites()) or 'no known site'}")
        if self.block_combo.count() and not _select_data(self.block_combo, layer):
            raise ValueError(f"{site}: no block {layer!r}")

    def _show_pending_site(self, site: str, layer: int | None) -> None:
        """``site`` and ``layer`` as the only choice, until the model's sites are known."""
        self._pending_site = (site, layer)
        self.site_combo.blockSignals(True)
        self.site_combo.clear()
        self.site_combo.addItem(SITE_TITLES.get(site, site), site)
        self.site_combo.blockSignals(False)
        self.block_combo.clear()
        if site == "kv_source" and layer is None:
            self.block_combo.addItem(EVERY_CROSS_BLOCK, None)
        elif layer is not None:
            self.block_combo.addItem(f"entering block {layer}" if site == "resid" else f"block {layer}", layer)
        self.block_combo.setEnabled(False)  # the blocks are listed once the model is loaded

    def sites(self) -> list[str]:
        """The sites offered (none before the model is known)."""
        if self._pending_site is not None:
            return []
        return [d for d in (self.site_combo.itemData(i) for i in range(self.site_combo.count())) if d is not None]

    def site_choice(self) -> tuple[str | None, int | None]:
        """``(site, block)`` to patch: None site before the model is known (the earliest it has);
        block: resid's block, kv_source's cross block (None: every cross block), else None."""
        site = self.site_combo.currentData()
        layer = self.block_combo.currentData() if self.block_combo.count() else None
        return site, layer

    def restore_choices(
        self, recorded: RecordedParameters, result: InterventionResult | VisualPatchResult, run_id: int
    ) -> list[str]:
        """Choose what intervention run ``run_id`` was made with, from its ``result`` (a patch's site,
        block, token sets and source image; an ablation's kind) and what its request recorded
        (``recorded``: an ablation's positions, references and source image). What cannot be chosen
        again (a source image that was no file, another reference set, a run not made from these
        controls) is said in red in the box and returned."""
        notes = []
        if isinstance(result, VisualPatchResult):
            try:
                self.set_site(result.site, result.layer)
            except ValueError as e:  # the model shown has no such site or block
                notes.append(f"run #{run_id} patched at a site not offered here ({e})")
            self.set_positions("all" if any(r.name == ALL_VISUAL_TOKENS for r in result.rows) else "region")
            notes += self._restore_source(result.source_image_path, run_id)
        elif result.ablation in KINDS and recorded.positions in POSITIONS:
            kind = result.ablation
            self.set_kind(kind)
            self.set_positions(recorded.positions)
            if kind == "resample":
                notes += self._restore_source(recorded.source_image, run_id)
            references = [Path(p) for p in recorded.reference_images]
            if kind == "mean" and references != self.references:
                notes.append(
                    f"run #{run_id} took its mean over other reference images than the {self.reference_set} ones"
                )
        else:
            notes.append(f"run #{run_id} was not made with these controls: they are not its choices")
        self.show_message("; ".join(notes), error=bool(notes))
        return notes

    def _restore_source(self, path: str | None, run_id: int) -> list[str]:
        if path:
            self.set_source(path)
            return []
        self.source_combo.setCurrentIndex(0)  # the placeholder: Ablate and Patch refuse until one is chosen
        return [f"run #{run_id}'s source image was no file: choose it again"]

    # ----- state in ------------------------------------------------------

    def show_selection(self, selected: SelectedComponent | None) -> None:
        """Name the component Ablate acts on (amber when it was selected in another read-out)."""
        self.component_label.setText(selected.describe() if selected is not None else NO_SELECTION)
        self.component_label.setStyleSheet(
            "color: #5a3b00; background: #ffd27a;" if selected is not None and selected.stale else "color: #222;"
        )
        self.show_message("")  # a refusal ("select a component first") no longer applies

    def set_busy(self, busy: bool) -> None:
        self.ablate_button.setEnabled(not busy)
        self.patch_button.setEnabled(not busy)

    def show_message(self, text: str, *, error: bool = False) -> None:
        self.message_label.setStyleSheet("color: #c00000;" if error else "color: #333;")
        self.message_label.setText(" ".join(text.split()))

    def run_buttons(self) -> tuple[QPushButton, ...]:
        """The buttons that start a job (disabled while one runs)."""
        return self.ablate_button, self.patch_button

    # ----- a run drawn ---------------------------------------------------

    def draw(self, run: ShownRun | None, kind: str | None = None) -> None:
        """Draw ``run``'s intervention result in the table (a live run and a restored one alike;
        none: empty) and keep its read-out, whose blocks an ablation names its component in.
        None clears the table."""
        self.analysis = analysis_of(run)
        result = run.results.get("intervention") if run is not None else None
        if result is None:
            self.results.clear()
        else:
            self.results.show_result(result)
            self.running.end()  # its result is drawn

    def shown_head(self) -> tuple[int, int] | None:
        """``(block, head)`` of the head the shown ablation edits (None: a patch, another
        component, nothing shown): a restored ablation selects it in Attention."""
        result = self.results.result
        return result.ablated_head() if result is not None else None

    # ----- the requests ----------------------------------------------------

    def ablation_request(self, asked: Mapping, painted: Callable[[], np.ndarray]) -> AblationRequest | Refusal:
        """Ablate the component selected last in Attention, DLA or Lens with the chosen kind (zero,
        mean over the references, resample from the source image) and positions, on the asked input
        (``asked``: the :class:`core.requests.base.AskedRequest` fields; ``painted()``: the painted
        region now); or why it cannot run as chosen."""
        selected = self.selection.current
        selected_again = selected_other_than(self.selection, selected)
        if selected is None:
            return Refusal(
                "select a component first: Read out, then click a head (Attention), a bar (DLA) or a lens row (Lens)",
                selected_again,
            )
        if selected.stale:
            return Refusal(
                f"{selected.name} was selected in another read-out than the one shown: select it again", selected_again
            )
        from core.methods.component_ablation import parse_component  # loaded with the read-out it was selected in

        blocks = self.analysis.block_names if self.analysis is not None else {}
        try:
            parse_component(selected.name, [blocks[i] for i in sorted(blocks)])  # embed, a bias: no write to ablate
        except core.ReadoutError as e:
            return Refusal(str(e), selected_again)
        kind, positions = self.kind(), self.positions()
        mask = painted() if positions == "region" else None
        if mask is not None and not mask.any():
            return Refusal(
                "positions 'painted region': paint a region in the Counterfactual tab",
                lambda: self.positions() != "region" or painted().any(),
            )
        chosen = {}  # the mean's references, the resample's source image
        if kind == "mean":
            if not self.references:
                return Refusal("mean ablation: no reference images (the bundled samples are missing)")
            chosen = {"references": tuple(str(r) for r in self.references), "reference_set": self.reference_set}
        elif kind == "resample":
            source = self.source()
            if source is None:
                return Refusal(
                    "resample ablation: choose a source image (a sample or File…)", lambda: self.source() is not None
                )
            source_image = read_source(source)
            if isinstance(source_image, Refusal):
                return source_image
            chosen = {"source_image": source_image, "source_image_path": str(source)}
        return AblationRequest(
            **asked, component=selected.name, selected_in=selected.view, ablation=kind, positions=positions,
            mask=mask, **chosen,
        )  # fmt: skip

    def patch_request(
        self, asked: Mapping, painted: Callable[[], np.ndarray], source=None
    ) -> PatchingRequest | Refusal:
        """Patch visual-token features from ``source`` (an image: a path, pixels; None: the chosen
        source image) into the asked input and back, at the chosen site: the painted region's
        tokens (``painted()``), or every visual token with "all positions"; or why it cannot run."""
        source = self.source() if source is None else source
        if source is None:
            return Refusal("patching: choose a source image (a sample or File…)", lambda: self.source() is not None)
        mask = None if self.positions() == "all" else painted()
        if mask is not None and not mask.any():
            return Refusal(
                "patching: paint a region in the Counterfactual tab (or choose all positions: every visual token)",
                lambda: self.positions() == "all" or painted().any(),
            )
        source_image = read_source(source)
        if isinstance(source_image, Refusal):
            return source_image
        # the source image as given (None for pixels): the result records it with its hash, so the
        # audit row names what was patched in
        source_path = str(source) if isinstance(source, (str, Path)) else None
        site, layer = self.site_choice()
        return PatchingRequest(
            **asked, source_image=source_image, source_image_path=source_path, mask=mask, site=site, layer=layer
        )

    def show_running(self, request: AblationRequest | PatchingRequest) -> None:
        """The "running: …" line of ``request`` (the panel's), until the job ends or its result is drawn."""
        if request.name == "ablation":
            self.running.show(f"running: {request.component} {request.ablation} ablation…")
        else:
            self.running.show(f"running: patching at {request.site or 'the earliest visual site'}…")

    def end_running(self) -> None:
        """The job ended: its "running: …" line goes (a message shown since stays)."""
        self.running.end()

    # ----- drawing -------------------------------------------------------

    def _show_reference(self) -> None:
        mean = self.kind() == "mean"
        self.reference_label.setVisible(mean)
        n = len(self.references)
        self.reference_label.setText(
            f"mean over the {n} {self.reference_set} images, each asked the question shown"
            if n
            else "no reference images: mean ablation is not available"
        )

    def _fill_blocks(self) -> None:
        """The block choice of the chosen site: every block for resid, the cross blocks (or
        every one) for kv_source; none for the other sites."""
        site = self.site_combo.currentData()
        self.block_combo.clear()
        if site == "resid":
            for i, (name, _kind) in enumerate(self._blocks):
                self.block_combo.addItem(f"entering {name}", i)
        elif site == "kv_source":
            self.block_combo.addItem(EVERY_CROSS_BLOCK, None)
            for i, (name, kind) in enumerate(self._blocks):
                if kind == "cross":
                    self.block_combo.addItem(name, i)
        self.block_combo.setEnabled(self.block_combo.count() > 0)

    def _pick_source(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Source image", "", IMAGE_FILTER)
        if path:
            self.set_source(path)
