"""The main window: it assembles the parts and wires them, and holds the image shown.

Left: the image canvas (patch grid, patch-granular heatmaps). Right, in tabs:
the answer, attention, DLA, lens, the region-counterfactual painter with the
interventions, validation, the session's audit table and history. Below: the
input bar (app.input_bar). Every read-out view sits in a :class:`app.run_frame.RunFrame`
and draws itself from the workspace's shown run (app.components.Workspace):
a run just made and a run restored from the History alike.

Background work has one path (app.runner): a request (core.requests) built by
the actions (app.actions) from the fields and the panels' controls, a worker,
the session's record (app.session_view), then the workspace shows the result.
Loaded models are cached in ``model_cache`` by spec, dtype and device. Errors
show as one red line; nothing here opens a blocking dialog except the file
pickers the user asks for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QSplitter, QVBoxLayout, QWidget

import core
from app.actions import Actions
from app.answer_tokens import AnswerTokensChooser
from app.canvas import ImageCanvas
from app.components import RunInput, RunView, Workspace
from app.components.model_cache import ModelCache
from app.components.selection import Selection
from app.input_bar import InputBar
from app.panels.answer_panel import AnswerPanel, run_caption
from app.panels.attention_panel import AttentionPanel
from app.panels.audit_panel import AuditPanel
from app.panels.counterfactual_panel import CounterfactualPanel
from app.panels.dla_panel import DLAPanel
from app.panels.flow_panel import FlowPanel
from app.panels.head_methods_panel import HeadMethodsPanel
from app.panels.history_panel import HistoryPanel
from app.panels.intervention_panel import InterventionPanel
from app.panels.lens_panel import LensPanel
from app.panels.validation_panel import ValidationPanel
from app.run_frame import VIEW_KINDS, RunFrame
from app.runner import Runner
from app.samples import Sample, bundled_pairs_file, bundled_samples
from app.session_view import SessionController
from app.widgets import DetachedTabs, ScrollPage, box
from core.files.images import image_sha256
from core.validate import subject_labels


class MainWindow(QMainWindow):
    """Image + question in; the answer and every read-out out.

    Opens on the first bundled sample; nothing runs until an action is asked
    (:attr:`actions`: Answer, Read out, a counterfactual, an ablation...).

    Args:
        model_spec: the model picked at start (in the dtype and on the device it was last loaded in,
            when the recent models remember it).
        model_cache: ``{ModelChoice: LoadedModel}`` shared with the caller (tests pass one to load
            each model once); a fresh dict by default.
        session_path: the session file to record into (default: the user's default session).
    """

    idle = Signal()  # a job ended: its result, error or cancellation is shown

    # How long closing waits for a cancelled job to stop before letting it go (app.workers); a
    # process that ends with the window waits a moment only (app.__main__).
    close_wait_ms = 30_000

    def __init__(self, model_spec: str = "shapes-llava", model_cache: dict | None = None, session_path=None):
        super().__init__()
        self.model_cache = {} if model_cache is None else model_cache
        self.image: Image.Image | None = None
        self.image_name = ""
        self.expected: str | None = None  # ground truth while a bundled sample is shown unchanged
        self.workspace = Workspace(RunInput(model_spec=model_spec.strip()))
        try:  # a stripped or edited install: the window opens without them and says why
            self.samples, samples_problem = bundled_samples(), ""
        except core.ReadoutError as e:
            self.samples, samples_problem = [], f"the bundled samples are not available: {e}"
        self.models = ModelCache(self.model_cache)
        self.inputs = InputBar(self.workspace, model_spec, self.models.fields)
        self.inputs.warnings = lambda: self.loaded_model().info.get("warnings", []) if self.loaded_model() else []
        self.runner = Runner(self.model_cache, self._record, lambda *shown: self.actions.show(*shown), self)
        self.setWindowTitle("VLM Readout")
        self.setAcceptDrops(True)
        self._build_panels()
        self.sessions = SessionController(self, session_path)
        self.session_problem = self.sessions.problem  # also printed by app.__main__ for a terminal user
        self.answer_tokens = AnswerTokensChooser(self)
        self.actions = Actions(self)
        self._build_layout()
        self._connect_views()
        self._build_menus()
        self._follow_runner()
        self.runner.busy_changed.emit(False)
        self.resize(1280, 800)
        if self.samples:
            self.load_sample(self.samples[0])
        if samples_problem:
            self.show_error(samples_problem)

    # ----- assembly -----------------------------------------------------

    def _build_panels(self) -> None:
        self.canvas = ImageCanvas()  # view mode: pan, zoom, hover a token
        self.answer_panel = AnswerPanel()
        # the component selected last in Attention, DLA or Lens: the one the Interventions box ablates
        self.selection = Selection(self.workspace)
        self.attention_panel = AttentionPanel()
        self.dla_panel = DLAPanel()
        self.lens_panel = LensPanel()
        self.counterfactual_panel = CounterfactualPanel()
        self.intervention_panel = InterventionPanel(self.selection)
        self.intervention_panel.set_references([s.image_path for s in self.samples], "bundled sample")
        self.intervention_panel.set_sources([(s.image_path.name, s.image_path) for s in self.samples])
        # the intervention controls go beside the painter (on screen with it), their table beside the answer change
        self.counterfactual_panel.host_interventions(self.intervention_panel)
        self.validation_panel = ValidationPanel(self.selection, self.workspace)
        self.validation_panel.bundled = bundled_pairs_file().parent
        read_labels: dict = {}  # each recorded run's labels, read once (a run never changes)
        self.validation_panel.labels_source = lambda subject, fingerprint: subject_labels(
            self.session, subject, fingerprint, read_labels
        )
        self.head_methods = HeadMethodsPanel(self.selection)
        self.flow_panel = FlowPanel()
        self.audit_panel = AuditPanel()
        self.history_panel = HistoryPanel()

    def _connect_views(self) -> None:
        """What one view does to another: a head clicked in Attention maps onto the canvas and is
        the selected component (the one the Interventions box ablates), as a DLA bar or a lens row."""
        self.attention_panel.head_selected.connect(self.canvas.show_head_map)
        self.attention_panel.head_selected.connect(
            lambda block, head: self.selection.select_head(self.attention_panel.result, block, head)
        )
        self.dla_panel.sources_shown.connect(self.canvas.show_sources_map)
        self.dla_panel.component_selected.connect(
            lambda name: self.selection.select(name, "dla", self.dla_panel.result)
        )
        self.lens_panel.layer_selected.connect(
            lambda layer: self.selection.select_lens_row(self.lens_panel.result, layer)
        )
        self.answer_panel.caption_of = lambda run: run_caption(
            run, self.expected if self.workspace.is_current(run) else None
        )

    def _build_layout(self) -> None:
        def framed(name: str, panel, page: bool = True) -> RunFrame:
            view = RunView(self.workspace, VIEW_KINDS[name], name)
            return RunFrame(ScrollPage(panel) if page else panel, view, panel)

        # Each tab's page scrolls what does not fit (ScrollPage): no result can raise the window's
        # minimum size past the screen or squeeze the canvas in the other tabs.
        names = ("answer", "attention", "dla", "lens", "counterfactual", "flow")
        self.run_frames = {"canvas": framed("canvas", self.canvas, page=False)}
        self.run_frames.update({name: framed(name, getattr(self, f"{name}_panel")) for name in names})
        self.head_methods_frame = framed("head methods", self.head_methods, page=False)
        self.attention_panel.add_side(self.head_methods_frame)
        # the tab bar sits above the canvas and the pages: it stays put when the Counterfactual tab
        # hides the canvas and its page takes the whole width
        self.tabs = DetachedTabs()
        for name in names:
            self.tabs.addTab(self.run_frames[name], name.upper() if name == "dla" else name.capitalize())
        self.tabs.addTab(ScrollPage(self.validation_panel), "Validation")  # a claim is of a model, not of the input
        self.tabs.addTab(ScrollPage(self.audit_panel), "Audit")
        self.tabs.addTab(self.history_panel, "History")
        self.tabs.currentChanged.connect(self._on_tab_changed)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.run_frames["canvas"])
        splitter.addWidget(self.tabs)
        splitter.setStretchFactor(0, 2)
        splitter.setStretchFactor(1, 3)
        splitter.setSizes([560, 720])
        central = QWidget()
        layout = QVBoxLayout(central)
        pages = box(QVBoxLayout(), self.tabs.bar, (splitter, 1))
        pages.setSpacing(0)  # the bar sits on its pages
        layout.addLayout(pages, stretch=1)
        layout.addWidget(self.inputs)
        self.setCentralWidget(central)
        # which file the runs are saved in: one line in the status bar, the whole in its tooltip
        self.statusBar().addPermanentWidget(self.sessions.label)

    def _build_menus(self) -> None:
        actions = self.actions
        menus = {
            "&File": [
                ("&Open image…", actions.open_image_dialog, QKeySequence.StandardKey.Open),
                (
                    "&Samples",
                    [(f"{s.image_path.name}: {s.question}", lambda s=s: self.load_sample(s)) for s in self.samples],
                ),
                None,
                ("Open &session…", self.sessions.open_session_dialog),
                ("Save session &as…", self.sessions.save_session_as_dialog),
                ("&Export audit table…", self.audit_panel.choose_export),
                None,
                ("&Quit", self.close, QKeySequence.StandardKey.Quit),
            ],
            "&Edit": [("&Paste image", actions.paste_image, QKeySequence.StandardKey.Paste)],
            "&Run": [
                ("Answer &all samples", actions.answer_all_samples),
                ("Attention &statistics over the samples", actions.attention_statistics_of_samples),
                ("&Read out", actions.run_readout, QKeySequence("Ctrl+R")),
            ],
        }
        for title, entries in menus.items():
            self._add_menu_entries(self.menuBar().addMenu(title), entries)

    def _add_menu_entries(self, menu, entries) -> None:
        for entry in entries:
            if entry is None:
                menu.addSeparator()
            elif isinstance(entry[1], list):
                self._add_menu_entries(menu.addMenu(entry[0]), entry[1])
            else:
                action = QAction(entry[0], self)
                if len(entry) > 2:
                    action.setShortcut(entry[2])
                action.triggered.connect(lambda _=False, run=entry[1]: run())
                menu.addAction(action)

    def _follow_runner(self) -> None:
        """The input bar and the panels' buttons follow the runner: busy, progress, the outcome."""
        runner, inputs = self.runner, self.inputs
        self.workspace.events.input_changed.connect(self._on_input_changed)
        runner.busy_changed.connect(self._set_busy)
        runner.started.connect(self._on_started)
        runner.progress.connect(inputs.show_progress)
        runner.failed.connect(self.show_error)
        runner.ended.connect(self._on_ended)
        inputs.cancel_button.clicked.connect(self.cancel)
        for picker in inputs.pickers:  # another model: its own load warnings, its patch sites
            picker.currentTextChanged.connect(self._on_model_picked)
        # a refusal's precondition met (a region painted, a component selected, a choice made) takes its message away
        for changed in (
            self.counterfactual_panel.mask_changed,
            self.intervention_panel.choices_changed,
            self.validation_panel.choices_changed,
        ):
            changed.connect(inputs.recheck_refusal)
        disconnect = self.selection.changed.connect(inputs.recheck_refusal)
        self.destroyed.connect(lambda *_: disconnect())

    # ----- the image and the question --------------------------------------

    def set_image(self, source, name: str | None = None) -> bool:
        """Show an image (path, bytes or PIL image); False and an error line if it cannot be read."""
        if self.runner.is_busy():
            self.show_error("a job is running: wait for it or cancel it before changing the image")
            return False
        image = self.read_image(source)
        if image is None:
            return False
        self.image = image
        path = str(source) if isinstance(source, (str, Path)) else None  # None: pasted or dropped pixels
        self.image_name = name or (Path(source).name if path else "image")
        pixels = np.asarray(image)  # (H, W, 3) uint8
        self.canvas.set_image(pixels)
        self.counterfactual_panel.set_image(pixels)
        self.workspace.clear_shown()  # every view empties
        self.workspace.set_input(image_sha256=image_sha256(image), image_path=path)
        self.expected = None
        self.show_error("")
        self.statusBar().showMessage(self.image_line())
        return True

    def image_line(self) -> str:
        """The status bar's line for the shown image: its name and size."""
        return f"{self.image_name}  {self.image.width}×{self.image.height}"

    def read_image(self, source) -> Image.Image | None:
        """``core.load_image(source)``, or None with the reason in the error line."""
        try:
            return core.load_image(source)
        except core.ImageLoadError as e:
            self.show_error(str(e))
            return None

    def set_question(self, question: str) -> None:
        self.inputs.question_edit.setText(question)
        self.expected = None

    def load_sample(self, sample: Sample) -> bool:
        """Show a bundled sample's image and question (and remember its expected answer)."""
        if not self.set_image(sample.image_path):
            return False
        self.set_question(sample.question)
        self.expected = sample.expected
        return True

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls() and event.mimeData().urls()[0].isLocalFile():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        self.set_image(event.mimeData().urls()[0].toLocalFile())
        event.acceptProposedAction()

    # ----- the model ----------------------------------------------------

    def model_choice(self):
        return self.inputs.model_choice()

    def loaded_model(self) -> core.LoadedModel | None:
        """The picked model when it is loaded (in its dtype, on its device), else None."""
        return self.models.loaded(self.model_choice())

    def _on_input_changed(self, fields: tuple) -> None:
        if {"model_spec", "model_dtype", "model_device"}.intersection(fields):
            self.attention_panel.set_statistics(None)  # the dataset distribution was another model's heads

    def _on_model_picked(self, _text: str = "") -> None:
        if not self.runner.is_busy():
            self.inputs.show_status(self.inputs.outcome)
        self.actions.refresh_patch_sites()

    # ----- runs ---------------------------------------------------------

    @property
    def session(self):
        return self.sessions.session

    @property
    def analysis(self):
        """The shown run's analyze result (typed), or None: what the read-out views show."""
        shown = self.workspace.shown
        return shown.analysis if shown is not None else None

    def _record(self, result, request) -> int | None:
        return self.sessions.record_request(result, request, self.loaded_model())

    def is_busy(self) -> bool:
        return self.runner.is_busy()

    def cancel(self) -> None:
        """Ask the running job to stop; the window goes idle when it has."""
        if self.runner.cancel():
            self.inputs.cancel_button.setEnabled(False)
            self.inputs.status_label.setText("cancelling…")

    def show_error(self, message: str) -> None:
        self.inputs.show_error(message, busy=self.runner.is_busy())

    def _on_started(self, status: str) -> None:
        self.inputs.status_label.setText(status)  # at once: the job's own lines follow
        if self.image is not None:  # a "run #N shown" line from the History is not what is shown now
            self.statusBar().showMessage(self.image_line())

    def _on_ended(self, status: str) -> None:
        for panel in self._working_panels():  # their "running: …" lines are over (a message shown since stays)
            panel.end_running()
        self.inputs.note_model()  # its fingerprint, dtype and device: known once loaded
        if self.loaded_model() is not None:  # only a model that loaded joins the picker's list
            self.inputs.remember_model()
        self.inputs.show_status(status)
        self.actions.refresh_patch_sites()  # a job may have loaded the model: its sites are known
        self.answer_tokens.refresh_note()  # a model loaded by the job can now tokenize the fields
        self.idle.emit()

    def _working_panels(self) -> tuple:
        """The panels whose buttons start runs."""
        return (
            self.counterfactual_panel,
            self.intervention_panel,
            self.validation_panel,
            self.head_methods,
            self.flow_panel,
        )

    def _set_busy(self, busy: bool) -> None:
        # the focus is parked before the panels' buttons are disabled, and given back once they are enabled
        panels = (self.answer_panel, *self._working_panels())  # the Answer tab: Generate and the answer's tokens
        buttons = [button for panel in self._working_panels() for button in panel.run_buttons()]
        if busy:
            self.inputs.set_busy(busy, buttons, park=self.tabs)
        for panel in panels:
            panel.set_busy(busy)
        if not busy:
            self.inputs.set_busy(busy, buttons, park=self.tabs)

    def _on_tab_changed(self, index: int) -> None:
        # the painter has its own canvas: give it the whole width instead of showing the image twice
        self.run_frames["canvas"].setVisible(self.tabs.tabText(index) != "Counterfactual")

    def closeEvent(self, event) -> None:
        """Cancel running jobs and join their threads before the window goes; one still running after
        ``close_wait_ms`` (in a forward it cannot leave) is let go (app.workers): nothing of it is
        shown or recorded (its outcome is dropped, the session closed)."""
        self.runner.shutdown(self.close_wait_ms)
        self.sessions.close()
        super().closeEvent(event)
