"""The main window: an image and a question in; the answer and every
read-out out, side by side with the image's visual-token grid.

Left: the image canvas (patch grid, patch-granular heatmaps). Right, in tabs:
the answer, attention, DLA, lens, the region-counterfactual painter and the
session's audit table. Every run is recorded in the session (one SQLite file,
autosaved after each run); the Audit tab follows the session's recorded-run
events (:mod:`app.session_view`).

The model runs in :mod:`app.workers`, never on the GUI thread; the jobs are
:mod:`app.jobs` (importable from here too). Loaded models are cached by spec
in ``MainWindow.model_cache`` by spec, dtype and device (:class:`app.components.ModelChoice`)
and reused. Errors show as one red line in the
window; nothing here opens a blocking dialog except the file pickers the user
asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image
from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt, Signal
from PySide6.QtGui import QAction, QImage, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

import core
from app.canvas import ImageCanvas, describe_token_layout, read_token
from app.claims import ClaimsMixin
from app.components import ModelChoice, ShownRun
from app.components.model_choice import CPU, device_choices
from app.components.selection import Selection, head_component, lens_component
from app.jobs import (
    answer_job,
    answer_of,
    answer_pairs_job,
    as_run,
    head_sources_job,
    model_load_job,
    request_job,
    statistics_job,
)
from app.panels.answer_panel import AnswerPanel, TargetNote
from app.panels.attention_panel import AttentionPanel, block_names
from app.panels.audit_panel import AuditPanel
from app.panels.counterfactual_panel import CounterfactualPanel
from app.panels.dla_panel import DLAPanel
from app.panels.intervention_panel import InterventionPanel
from app.panels.lens_panel import LensPanel
from app.recent_models import BUILTIN_MODELS, recent_models, remember_model, remembered_choice
from app.run_frame import TARGET_PLACEHOLDER, AnswerTokensMixin, WorkspaceMixin
from app.samples import Sample, bundled_pairs_file, bundled_samples
from app.session_view import SessionMixin, SessionWatch, open_start_session
from app.widgets import DetachedTabs, ElidedLabel, ScrollPage, box, plain_label
from app.workers import Worker, WorkerPool
from core.images import image_sha256, load_mask
from core.precision import AUTO_DTYPE_MEANING, DTYPE_CHOICES
from core.readout import RecordedResult
from core.requests import (
    AblationRequest,
    AnalyzeRequest,
    CounterfactualRequest,
    PatchingRequest,
    SweepRequest,
)
from core.requests.patching import default_patch_site, patch_sites
from core.views import patch_values

if TYPE_CHECKING:
    from core.analyze import AnalyzeResult
    from core.methods.patterns import HeadSummary
    from core.readouts.rollout import RolloutSection

# What the status line says as each job starts, before its first progress line (a validation's
# comes seconds later: until then the line said the last job's "ready" or "cancelled").
JOB_STATUS = {
    answer_job: "answering…",
    answer_pairs_job: "answering the pairs…",
    head_sources_job: "source contributions…",
    statistics_job: "attention statistics…",
    model_load_job: "loading model…",
    # a request_job's line: by its request's name (core.requests)
    "generate": "generating…",
    "analyze": "reading out…",
    "counterfactual": "counterfactual…",
    "sweep": "occlusion sweep…",
    "ablation": "ablating…",
    "patching": "patching…",
    "validate": "validating…",
    "nonunique": "non-unique attention…",
    "qk-ov": "QK / OV…",
}
# the formats core.images accepts (ACCEPTED_FORMATS)
IMAGE_FILTER = "Images (*.png *.jpg *.jpeg *.bmp *.gif *.tif *.tiff *.webp *.ppm *.pgm *.pbm *.pnm);;All files (*)"


def qimage_to_png(image: QImage) -> bytes:
    """Encode a QImage as PNG bytes (for :func:`core.load_image`)."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


class MainWindow(ClaimsMixin, SessionMixin, AnswerTokensMixin, WorkspaceMixin, QMainWindow):
    """Image + question in, answer + top alternatives out.

    Opens on the first bundled sample. Nothing runs until
    :meth:`answer_question` (the Answer button) is called.

    Args:
        model_spec: the model shown in the picker at start (in the dtype and on the
            device it was last loaded in, when the recent models remember it).
        model_cache: ``{ModelChoice: LoadedModel}`` shared with the caller (tests
            pass one to load each model once); a fresh dict by default.
    """

    idle = Signal()  # a job ended: its answer, error or cancellation is shown

    # How long closing waits for a cancelled job to stop before letting it go (app.workers). A job
    # let go runs on beside later ones (two loads at once clash), so only a process that ends with
    # the window waits a moment only (app.__main__).
    close_wait_ms = 30_000
    _closed = False  # closeEvent ran: a job's late outcome is dropped
    _outcome = "ready"  # the last job's end (ready, failed, cancelled), shown while idle
    _error_shown = ""  # the error line's text
    _unmet = None  # (panel, message, met) of the last refusal for a precondition the user can meet

    def __init__(
        self, model_spec: str = "shapes-llava", model_cache: dict | None = None, session_path: str | Path | None = None
    ):
        super().__init__()
        self.model_cache = {} if model_cache is None else model_cache
        session, session_problem = open_start_session(session_path)
        self.session_problem = session_problem  # also printed by app.__main__ for a terminal user
        self.session_watch = SessionWatch(self)  # the audit table follows the session's recorded runs
        self.session_watch.recorded.connect(self._on_run_recorded)
        self.analysis: AnalyzeResult | None = None  # the last analyze result shown in the panels
        self.analysis_inputs: tuple | None = None  # (ModelChoice, image, question) it was computed on
        self.last_counterfactual = None
        self.last_intervention = None
        self.workers = WorkerPool(self)
        self.image: Image.Image | None = None
        self.image_name = ""
        self.last_answer: core.Answer | None = None
        self.last_answers: list[core.Answer] = []
        self._job: Worker | None = None
        self._expected: str | None = None  # ground truth while a bundled sample is shown unchanged
        self._focus_before_job = None  # the widget that had the focus when a job disabled it
        self._use_workspace(model_spec)  # the current input and the run the views show (app.run_frame)
        try:  # a stripped or edited install: the window opens without them and says why
            self.samples, samples_problem = bundled_samples(), ""
        except core.ReadoutError as e:
            self.samples, samples_problem = [], f"the bundled samples are not available: {e}"
        self.setWindowTitle("VLM Readout")
        self.setAcceptDrops(True)
        self._build_widgets(model_spec)
        self._follow_fields()
        self._follow_answer_tokens_fields()  # Generate, a token clicked, the typed-target note (app.run_frame)
        self._follow_status_lines()
        self._build_menus()
        self._set_busy(False)
        self._clear_answer()
        self.resize(1280, 800)
        self._use_session(session)
        self._show_session(session_problem)
        if self.samples:
            self.load_sample(self.samples[0])
        if samples_problem:
            self.show_error(samples_problem)

    # ----- layout -------------------------------------------------------

    def _build_widgets(self, model_spec: str) -> None:
        self.model_picker = QComboBox()
        self.model_picker.setEditable(True)
        self.model_picker.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)  # listed once loaded (_end_job)
        self.model_picker.addItems(BUILTIN_MODELS)
        self.model_picker.setCurrentText(model_spec)
        self.model_picker.setMinimumWidth(260)
        self.model_picker.setToolTip("a built-in name, a model folder, a cached repo id or open_clip name:checkpoint")
        for spec in recent_models():
            if self.model_picker.findText(spec) < 0:
                self.model_picker.addItem(spec)
        # the dtype the model runs in and where: part of the model (a bfloat16 run is another run)
        self.dtype_picker = QComboBox()
        self.dtype_picker.addItems(DTYPE_CHOICES)
        self.dtype_picker.setToolTip(f"the dtype the model runs in ({AUTO_DTYPE_MEANING})")
        self.device_picker = QComboBox()
        devices = device_choices()
        self.device_picker.addItems(devices)
        self.device_picker.setEnabled(len(devices) > 1)  # no CUDA: the CPU only, shown disabled
        self.device_picker.setToolTip(
            "where the model runs: cpu, cuda, cuda:N, or auto (spread over the GPUs)"
            if len(devices) > 1
            else "where the model runs: no CUDA device here, so the CPU"
        )
        self._pick_remembered(model_spec)
        self.model_folder_button = QPushButton("Folder…")
        self.model_folder_button.setToolTip("choose a local model folder (Hugging Face or open_clip)")
        self.model_folder_button.clicked.connect(self.choose_model_folder)

        self.canvas = ImageCanvas()  # view mode: pan, zoom, hover a token
        self.image_plot = self.canvas.plot
        self.image_item = self.canvas.image_item

        self.answer_panel = answer_panel = AnswerPanel()
        self.answer_label, self.answer_caption = answer_panel.label, answer_panel.caption
        self.table_title, self.top_table = answer_panel.table_title, answer_panel.table

        # the component selected last in Attention, DLA or Lens: the one the Interventions box ablates
        self.selection = Selection(self.workspace)
        self.attention_panel = AttentionPanel()
        self.attention_panel.head_selected.connect(self.show_head_map)
        self.attention_panel.head_selected.connect(self._select_head)
        self.dla_panel = DLAPanel()
        self.dla_panel.sources_requested.connect(self.request_head_sources)
        self.dla_panel.sources_shown.connect(self._show_sources_map)
        self.dla_panel.component_selected.connect(lambda name: self.selection.select(name, "dla", self.analysis))
        self.lens_panel = LensPanel()
        self.lens_panel.layer_selected.connect(self._select_lens_layer)
        self.counterfactual_panel = CounterfactualPanel()
        self.counterfactual_panel.run_requested.connect(self.run_counterfactual)
        self.counterfactual_panel.sweep_requested.connect(self.run_sweep)
        self.audit_panel = AuditPanel()
        self.audit_panel.export_requested.connect(self.export_audit)
        self.intervention_panel = InterventionPanel(self.selection)
        self.intervention_panel.ablate_requested.connect(self.ablate_selected)
        self.intervention_panel.patch_requested.connect(self.patch_region)
        self.intervention_panel.set_references([s.image_path for s in self.samples], "bundled sample")
        self.intervention_panel.set_sources([(s.image_path.name, s.image_path) for s in self.samples])
        for picker in (self.model_picker, self.dtype_picker, self.device_picker):
            picker.currentTextChanged.connect(lambda _text: self._refresh_patch_sites())
        self.idle.connect(self._refresh_patch_sites)  # a job may have loaded the model: its sites are known
        # the intervention controls go in the controls column beside the painter (on screen with it),
        # their results table in a tab beside the answer change
        self.counterfactual_panel.add_controls(self.intervention_panel)
        self.counterfactual_panel.add_results(self.intervention_panel.results, "Interventions")
        self._build_claims_widgets()  # the Claims tab and the Attention tab's head actions (app.claims)
        # Each tab's page scrolls what does not fit (ScrollPage): no result (a claim step's evidence,
        # QK/OV's text, the painter's width) can raise the window's minimum size past the screen
        # or squeeze the image canvas in the other tabs.
        frames = self._frame_views(
            canvas=self.canvas,
            answer=ScrollPage(answer_panel),
            attention=ScrollPage(self.attention_panel),
            dla=ScrollPage(self.dla_panel),
            lens=ScrollPage(self.lens_panel),
            counterfactual=ScrollPage(self.counterfactual_panel),  # its own tab hides the canvas
        )
        # The tab bar sits above the canvas and the pages, so it stays put when the Counterfactual
        # tab hides the canvas and its page takes the whole width.
        self.tabs = DetachedTabs()
        for widget, title in (
            (frames["answer"], "Answer"),
            (frames["attention"], "Attention"),
            (frames["dla"], "DLA"),
            (frames["lens"], "Lens"),
            (frames["counterfactual"], "Counterfactual"),
            (ScrollPage(self.claims_panel), "Claims"),
            (ScrollPage(self.audit_panel), "Audit"),
        ):
            self.tabs.addTab(widget, title)
        self._build_history_tab()  # the session's runs (app.session_view); selecting one restores it
        self.tabs.currentChanged.connect(self._on_tab_changed)

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(frames["canvas"])
        splitter.addWidget(self.tabs)
        splitter.setStretchFactor(0, 2)
        splitter.setStretchFactor(1, 3)
        splitter.setSizes([560, 720])

        self.question_edit = QLineEdit()
        self.question_edit.setPlaceholderText("ask a question about the image")
        self.question_edit.returnPressed.connect(self.answer_question)
        self.question_edit.textEdited.connect(self._forget_expected)
        self.answer_button = QPushButton("Answer")
        self.answer_button.clicked.connect(self.answer_question)
        self.readout_button = QPushButton("Read out")
        self.readout_button.setToolTip("answer, then one capture and every read-out (attention, DLA, lens, rollout)")
        self.readout_button.clicked.connect(self.run_readout)
        self.target_edit = QLineEdit()
        self.target_edit.setPlaceholderText(TARGET_PLACEHOLDER)
        self.foil_edit = QLineEdit()
        self.foil_edit.setPlaceholderText("foil token (optional: u = answer - foil)")
        self.target_note = TargetNote()  # a typed word of several tokens: which sub-token is read

        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.status_label = ElidedLabel("ready")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)

        # One line (the whole message in its tooltip), always there when empty: a message of any
        # length leaves every control where it was (the controls sit at the window's bottom edge,
        # so a growing line above them would push them all up).
        self.error_label = ElidedLabel(selectable=True)
        self.error_label.setStyleSheet("color: #c00000;")

        controls = QGridLayout()
        controls.addWidget(plain_label("Model"), 0, 0)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_picker)
        model_row.addWidget(self.model_folder_button)
        model_row.addWidget(plain_label("dtype"))
        model_row.addWidget(self.dtype_picker)
        model_row.addWidget(plain_label("device"))
        model_row.addWidget(self.device_picker)
        model_row.addStretch(1)
        controls.addLayout(model_row, 0, 1, 1, 2)
        controls.addWidget(plain_label("Question"), 1, 0)
        controls.addWidget(self.question_edit, 1, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.answer_button)
        buttons.addWidget(self.readout_button)
        controls.addLayout(buttons, 1, 2)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress_bar, stretch=2)
        progress_row.addWidget(self.status_label, stretch=3)
        controls.addLayout(progress_row, 2, 1)
        controls.addWidget(self.cancel_button, 2, 2)
        controls.addWidget(self.error_label, 3, 0, 1, 3)
        # The typed-target note beside the fields, its room kept while it is hidden and its height a
        # button's: it comes and goes without moving the fields or anything above them.
        note_policy = self.target_note.sizePolicy()
        note_policy.setRetainSizeWhenHidden(True)
        self.target_note.setSizePolicy(note_policy)
        self.target_note.setFixedHeight(self.answer_button.sizeHint().height())
        targets = QHBoxLayout()
        targets.addWidget(self.target_edit, stretch=2)
        targets.addWidget(self.foil_edit, stretch=2)
        targets.addWidget(self.target_note, stretch=3)
        controls.addWidget(plain_label("Target"), 4, 0)
        controls.addLayout(targets, 4, 1, 1, 2)
        # Which file the runs are saved in (red, and kept: the error line clears on the next image or
        # run, when it is not the one asked for): one line in the status bar, the whole in its tooltip.
        self.session_label = ElidedLabel(selectable=True)
        self.statusBar().addPermanentWidget(self.session_label)

        central = QWidget()
        layout = QVBoxLayout(central)
        pages = box(QVBoxLayout(), self.tabs.bar, (splitter, 1))
        pages.setSpacing(0)  # the bar sits on its pages
        layout.addLayout(pages, stretch=1)
        layout.addLayout(controls)
        self.setCentralWidget(central)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        open_action = QAction("&Open image…", self, shortcut=QKeySequence.StandardKey.Open)
        open_action.triggered.connect(self.open_image_dialog)
        file_menu.addAction(open_action)
        samples_menu = file_menu.addMenu("&Samples")
        for sample in self.samples:
            action = QAction(f"{sample.image_path.name}: {sample.question}", self)
            action.triggered.connect(lambda _=False, s=sample: self.load_sample(s))
            samples_menu.addAction(action)
        file_menu.addSeparator()
        open_session = QAction("Open &session…", self)
        open_session.triggered.connect(self.open_session_dialog)
        file_menu.addAction(open_session)
        file_menu.addAction("Save session &as…", self.save_session_as_dialog)
        export_action = QAction("&Export audit table…", self)
        export_action.triggered.connect(self.audit_panel.choose_export)
        file_menu.addAction(export_action)
        file_menu.addSeparator()
        quit_action = QAction("&Quit", self, shortcut=QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)

        edit_menu = self.menuBar().addMenu("&Edit")
        paste_action = QAction("&Paste image", self, shortcut=QKeySequence.StandardKey.Paste)
        paste_action.triggered.connect(self.paste_image)
        edit_menu.addAction(paste_action)

        run_menu = self.menuBar().addMenu("&Run")
        all_samples_action = QAction("Answer &all samples", self)
        all_samples_action.triggered.connect(self.answer_all_samples)
        run_menu.addAction(all_samples_action)
        stats_action = QAction("Attention &statistics over the samples", self)
        stats_action.triggered.connect(self.attention_statistics_of_samples)
        run_menu.addAction(stats_action)
        readout_action = QAction("&Read out", self, shortcut=QKeySequence("Ctrl+R"))
        readout_action.triggered.connect(self.run_readout)
        run_menu.addAction(readout_action)

    # ----- inputs -------------------------------------------------------

    def set_image(self, source, name: str | None = None) -> bool:
        """Show an image (path, bytes or PIL image); False and an error line if it cannot be read."""
        if self.is_busy():
            self.show_error("a job is running: wait for it or cancel it before changing the image")
            return False
        image = self._read_image(source)
        if image is None:
            return False
        self.image = image
        path = str(source) if isinstance(source, (str, Path)) else None  # None: pasted or dropped pixels
        self.image_name = name or (Path(source).name if path else "image")
        pixels = np.asarray(image)  # (H, W, 3) uint8
        self.canvas.set_image(pixels)
        self.canvas.set_tokens(None)
        self.counterfactual_panel.set_image(pixels)
        self.workspace.clear_shown()  # every view empties (_on_run_shown)
        self.workspace.set_input(image_sha256=image_sha256(image), image_path=path)
        self._expected = None
        self.show_error("")
        self.statusBar().showMessage(self._image_line())
        return True

    def _image_line(self) -> str:
        """The status bar's line for the shown image: its name and size."""
        return f"{self.image_name}  {self.image.width}×{self.image.height}"

    def _read_image(self, source) -> Image.Image | None:
        """``core.load_image(source)``, or None with the reason in the error line."""
        try:
            return core.load_image(source)
        except core.ImageLoadError as e:
            self.show_error(str(e))
            return None

    def set_question(self, question: str) -> None:
        self.question_edit.setText(question)
        self._expected = None

    def load_sample(self, sample: Sample) -> bool:
        """Show a bundled sample's image and question (and remember its expected answer)."""
        if not self.set_image(sample.image_path):
            return False
        self.set_question(sample.question)
        self._expected = sample.expected
        return True

    def open_image_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open image", "", IMAGE_FILTER)
        if path:
            self.set_image(path)

    def paste_image(self) -> None:
        """Take an image (or an image file) from the clipboard."""
        mime = QApplication.clipboard().mimeData()
        if mime is not None and mime.hasImage():
            self.set_image(qimage_to_png(QImage(mime.imageData())), name="pasted image")
        elif mime is not None and mime.hasUrls() and mime.urls()[0].isLocalFile():
            self.set_image(mime.urls()[0].toLocalFile())
        else:
            self.show_error("the clipboard holds no image")

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls() and event.mimeData().urls()[0].isLocalFile():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        self.set_image(event.mimeData().urls()[0].toLocalFile())
        event.acceptProposedAction()

    # ----- jobs ---------------------------------------------------------

    def model_spec(self) -> str:
        return self.model_picker.currentText().strip()

    def model_choice(self) -> ModelChoice:
        """The model the picker names: spec, dtype and device (the model cache's key)."""
        return ModelChoice(self.model_spec(), self.dtype_picker.currentText(), self.device_picker.currentText())

    def loaded_model(self) -> core.LoadedModel | None:
        """The picker's model when it is loaded (in its dtype, on its device), else None."""
        loaded = self.model_cache.get(self.model_choice())
        return loaded if isinstance(loaded, core.LoadedModel) else None

    def set_model_choice(self, dtype: str | None = None, device: str | None = None) -> list[str]:
        """Pick ``dtype`` and ``device`` (None: leave as is); returns what could not be picked
        (a dtype not offered, a device this machine lacks), one phrase each."""
        missing = []
        for picker, value, what in ((self.dtype_picker, dtype, "dtype"), (self.device_picker, device, "device")):
            if value is None:
                continue
            index = picker.findText(value)
            if index < 0:
                missing.append(f"{what} {value} is not offered here (now {picker.currentText()})")
            else:
                picker.setCurrentIndex(index)
        return missing

    def _pick_remembered(self, spec: str) -> None:
        """The dtype and device ``spec`` was last loaded in, when the recent models remember it."""
        choice = remembered_choice(spec.strip())
        if choice is not None:
            self.set_model_choice(choice.dtype, choice.device if choice.device in device_choices() else CPU)

    def _remember_model(self, model: ModelChoice) -> None:
        """Keep the last few models that loaded (with their dtype and device), for the picker."""
        remember_model(model)
        if model.spec not in BUILTIN_MODELS and self.model_picker.findText(model.spec) < 0:
            self.model_picker.addItem(model.spec)

    def choose_model_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model folder")
        if path:
            self.model_picker.setCurrentText(path)

    def is_busy(self) -> bool:
        return self._job is not None

    def _has_image(self) -> bool:
        if self.image is None:
            self.show_error("no image: open one (File > Open image), drop one here or paste one")
        return self.image is not None

    def _caption(self, question: str) -> str:
        """The Answer tab's caption: model, image, question (and a bundled sample's expected answer)."""
        caption = f"{self.model_spec()} · {self.image_name} · {question}"
        if self._expected is not None:
            caption += f"\nexpected (sample ground truth): {self._expected}"
        return caption

    def answer_question(self) -> bool:
        """Answer the shown question about the shown image in the background; False if not started."""
        if self.is_busy() or not self._has_image():
            return False
        self._forget_answer_token()  # the model's answer: the first token after the bare prompt
        model, question = self.model_choice(), self.question_edit.text().strip()
        caption = self._caption(question)
        asked = self.workspace.input

        def show(result: core.Answer) -> None:
            self._show_answer(result, caption)
            # not recorded: the Answer tab names this input; the read-out views compare theirs with it
            self.workspace.show_run(ShownRun(None, "answer", self._made_for(asked), {"answer": result}))

        self._start(show, answer_job, self.model_cache, model, self.image, question)
        return True

    def answer_pairs(
        self,
        images: Sequence,
        questions: Sequence[str],
        expected: Sequence[str | None] | None = None,
        batch_size: int = 16,
    ) -> bool:
        """Answer many pairs in the background (cancellable between batches); False if not started."""
        if self.is_busy():
            return False
        self._start(
            lambda answers: self._show_pairs(questions, answers, expected),
            answer_pairs_job,
            self.model_cache,
            self.model_choice(),
            list(images),
            list(questions),
            batch_size,
        )
        return True

    def answer_all_samples(self) -> bool:
        samples = self.samples
        if not samples:
            self.show_error("no bundled samples to answer")
            return False
        return self.answer_pairs(
            [s.image_path for s in samples], [s.question for s in samples], [s.expected for s in samples]
        )

    def _targets(self) -> tuple[str, str]:
        return self.target_edit.text().strip(), self.foil_edit.text().strip()

    def _asked(self) -> dict:
        """The shown image, question, target fields as typed and answer token read out: the
        :class:`core.requests.base.AskedRequest` fields of a request about the shown input."""
        asked = self.workspace.input
        answer, foil = self._targets()
        return {
            "image": self.image,
            "image_path": asked.image_path,
            "question": self.question_edit.text().strip(),
            "answer": answer,
            "foil": foil,
            "answer_text": asked.answer_text,
        }

    def run_readout(self) -> bool:
        """Answer and read out the shown pair in the background; False if not started."""
        if self.is_busy() or not self._has_image():
            return False
        model, question = self.model_choice(), self.question_edit.text().strip()
        caption = self._caption(question)
        image = self.image
        asked, request = self.workspace.input, AnalyzeRequest(**self._asked())

        def show(analysis, run_id: int | None) -> None:
            answered = answer_of(analysis)  # read from the same forward, not from a second one
            self._show_answer(answered, caption)
            self.analysis_inputs = (model, image, question)
            self._show_analysis(analysis)
            results = {"analyze": analysis, "answer": answered}
            self.workspace.show_run(ShownRun(run_id, "analyze", self._made_for(asked), results))

        self._run_request(request, show, clear=True)
        return True

    def request_head_sources(self, layer: int, head: int) -> bool:
        """Compute one head's per-source contributions for the shown read-out (DLA panel)."""
        if self.is_busy() or self.analysis is None or self.analysis_inputs is None:
            return False
        model, image, question = self.analysis_inputs
        self._start(
            lambda r: self.dla_panel.set_sources(*r),
            head_sources_job,
            self.model_cache,
            model,
            self.analysis,
            image,
            question,
            layer,
            head,
            clear=False,
        )
        return True

    def run_counterfactual(self, mask, fill: str, options: dict) -> bool:
        """Fill the painted region and re-run the model (Counterfactual tab)."""
        if self.is_busy() or self.image is None:
            return False
        fill_options = self._fill_options(options)
        if fill_options is None:
            return False
        asked = self.workspace.input
        request = CounterfactualRequest(**self._asked(), mask=mask, fill=fill, **fill_options)

        def show(result, run_id: int | None) -> None:
            self.last_counterfactual = result
            self.counterfactual_panel.set_result(result)
            self.workspace.add_result("counterfactual", result, run_id, self._made_for(asked))

        self._run_request(request, show)
        self.counterfactual_panel.set_busy(True)  # after _start parked the focus of the Run button
        return True

    def run_sweep(self, k: int) -> bool:
        """The occlusion sweep with the panel's fill (Counterfactual tab)."""
        if self.is_busy() or self.image is None:
            return False
        fill, options = self.counterfactual_panel.fill_choice()
        fill_options = self._fill_options(options)
        if fill_options is None:
            return False
        asked = self.workspace.input
        request = SweepRequest(**self._asked(), k=int(k), fill=fill, **fill_options)

        def show(result, run_id: int | None) -> None:
            self.counterfactual_panel.set_sweep(result)
            self.workspace.add_result("sweep", result, run_id, self._made_for(asked))

        self._run_request(request, show)
        self.counterfactual_panel.set_busy(True)  # after _start parked the focus of the sweep button
        return True

    def _fill_options(self, options: dict) -> dict | None:
        """The Counterfactual panel's fill options as a fill request's fields: a paste source read
        into pixels (None, with the reason in the error line, when it cannot be read)."""
        options = dict(options)
        source = options.pop("paste_from", None)
        if source is not None:
            pixels = self._read_image(source)
            if pixels is None:
                return None
            options.update(paste_from=pixels, paste_from_path=str(source))
        return options

    def attention_statistics(self, items: list, dataset: Path | None = None) -> bool:
        """Distributions of every head's answer-row attention over ``items``
        (``(image, question, target mask or None)``), shown in the Attention tab;
        ``dataset``: the pairs file they came from (its path and hash go into the audit row)."""
        if self.is_busy():
            return False

        def show(stats) -> None:
            self.attention_panel.set_statistics(stats)
            doc = {"n_samples": stats.n_samples, "heads": [h.to_dict() for h in stats.heads]}
            line = f"answer-row attention of {len(stats.heads)} heads over {stats.n_samples} samples"
            parameters = {"n_samples": stats.n_samples, **({"dataset": str(dataset)} if dataset else {})}
            self._record(RecordedResult("statistics", doc, line, parameters, audits=[stats.audit]))

        self._start(show, statistics_job, self.model_cache, self.model_choice(), list(items), clear=False)
        return True

    def attention_statistics_of_samples(self) -> bool:
        """The bundled samples, with each one's target mask where it has one."""
        items = []
        for sample in self.samples:
            mask_path = sample.target_mask_path
            try:
                mask = load_mask(mask_path) if mask_path else None
            except core.ImageLoadError as e:
                self.show_error(str(e))
                return False
            items.append((sample.image_path, sample.question, mask))
        if not items:
            self.show_error("no bundled samples to read out")
            return False
        return self.attention_statistics(items, dataset=bundled_pairs_file())

    # ----- interventions (the Counterfactual tab's Interventions box) ----

    def _block_names(self) -> list[str]:
        """The shown read-out's block names, in block order (as the trace names them)."""
        names = block_names(self.analysis)
        return [names[i] for i in sorted(names)]

    def _select_head(self, layer: int, head: int) -> None:
        self.selection.select(head_component(self._block_names(), layer, head), "attention", self.analysis)

    def _select_lens_layer(self, layer: int) -> None:
        name, note = lens_component(self._block_names(), layer)
        self.selection.select(name, "lens", self.analysis, note)

    def _restore_selection(self, parameters: dict) -> None:
        """A restored ablation's component, selected in the view it was selected in when it ran."""
        name, view = parameters.get("component"), parameters.get("selected_in")
        if isinstance(name, str) and view in ("attention", "dla", "lens"):
            if view == "dla":
                self.dla_panel.select_component(name)
            self.selection.select(name, view, self.analysis)

    def _refresh_patch_sites(self) -> None:
        """The Interventions box offers the patch sites of the model picked, once it is loaded."""
        loaded = self.loaded_model()
        if loaded is not None:
            sites = patch_sites(loaded.adapter)
            self.intervention_panel.set_patch_sites(sites, loaded.adapter.blocks, default_patch_site(sites))
        else:
            self.intervention_panel.set_patch_sites(None)

    def _selected_other_than(self, selected):
        """``met()`` of a refusal about the selection ``selected`` (None: nothing selected): a current
        (not stale) component is selected, another than that one."""

        def met() -> bool:
            current = self.selection.current
            return current is not None and not current.stale and current is not selected

        return met

    def _refuse_intervention(self, message: str, met=None) -> bool:
        """An intervention that cannot run as chosen: the reason in the box and the error line (until
        ``met()``, when given, holds: :meth:`_refuse_until`)."""
        return self._refuse_until(self.intervention_panel, message, met)

    def ablate_selected(self) -> bool:
        """Ablate the component selected last in Attention, DLA or Lens with the Interventions box's
        kind (zero, mean over the bundled samples, resample from the source image) and positions, at
        the answer token read out; the effect goes into the box's table. False, with the reason in
        the window, when it cannot run as chosen."""
        if self.is_busy() or not self._has_image():
            return False
        panel, selected = self.intervention_panel, self.selection.current
        selected_again = self._selected_other_than(selected)
        if selected is None:
            return self._refuse_intervention(
                "select a component first: Read out, then click a head (Attention), a bar (DLA) or a lens row (Lens)",
                selected_again,
            )
        if selected.stale:
            return self._refuse_intervention(
                f"{selected.name} was selected in another read-out than the one shown: select it again",
                selected_again,
            )
        from core.methods.component_ablation import parse_component  # loaded with the read-out it was selected in

        try:
            parse_component(selected.name, self._block_names())  # embed, a bias: not a write a forward can ablate
        except core.ReadoutError as e:
            return self._refuse_intervention(str(e), selected_again)
        kind, positions = panel.kind(), panel.positions()
        mask = self.counterfactual_panel.mask() if positions == "region" else None
        if mask is not None and not mask.any():
            return self._refuse_intervention(
                "positions 'painted region': paint a region in the Counterfactual tab",
                lambda: panel.positions() != "region" or self.counterfactual_panel.mask().any(),
            )
        chosen = {}  # the mean's references, the resample's source image
        if kind == "mean":
            if not panel.references:
                return self._refuse_intervention("mean ablation: no reference images (the bundled samples are missing)")
            chosen = {"references": tuple(str(r) for r in panel.references), "reference_set": panel.reference_set}
        elif kind == "resample":
            source = panel.source()
            if source is None:
                return self._refuse_intervention(
                    "resample ablation: choose a source image (a sample or File…)", lambda: panel.source() is not None
                )
            source_image = self._read_image(source)
            if source_image is None:
                return False
            chosen = {"source_image": source_image, "source_image_path": str(source)}
        request = AblationRequest(
            **self._asked(), component=selected.name, selected_in=selected.view, ablation=kind, positions=positions,
            mask=mask, **chosen,
        )  # fmt: skip
        self._start_intervention(request)
        panel.show_message(f"running: {selected.name} {kind} ablation…")
        return True

    def patch_region(self, source=None) -> bool:
        """Patch visual-token features from ``source`` (an image; default: the Interventions box's
        source) into this run and back, at the box's site: the painted region's tokens, or every
        visual token with positions 'all positions'. False, with the reason in the window, when
        it cannot run as chosen."""
        if self.is_busy() or not self._has_image():
            return False
        panel = self.intervention_panel
        source = panel.source() if source is None else source
        if source is None:
            return self._refuse_intervention(
                "patching: choose a source image (a sample or File…)", lambda: panel.source() is not None
            )
        mask = None if panel.positions() == "all" else self.counterfactual_panel.mask()
        if mask is not None and not mask.any():
            return self._refuse_intervention(
                "patching: paint a region in the Counterfactual tab (or choose all positions: every visual token)",
                lambda: panel.positions() == "all" or self.counterfactual_panel.mask().any(),
            )
        source_image = self._read_image(source)
        if source_image is None:
            return False
        # the source image as given (None for pixels): the result records it with its hash, so the
        # audit row names what was patched in
        source_path = str(source) if isinstance(source, (str, Path)) else None
        site, layer = panel.site_choice()
        request = PatchingRequest(
            **self._asked(), source_image=source_image, source_image_path=source_path, mask=mask, site=site,
            layer=layer,
        )  # fmt: skip
        self._start_intervention(request)
        panel.show_message(f"running: patching at {site or 'the earliest visual site'}…")
        return True

    def _start_intervention(self, request) -> None:
        """Run an intervention request on the shown input; its result fills the table."""
        asked = self.workspace.input

        def show(result, run_id: int | None) -> None:
            self.last_intervention = result
            self._show_intervention_result(result)  # as a restored run shows it
            self.workspace.add_result("intervention", result, run_id, self._made_for(asked))

        self._run_request(request, show)

    def _run_request(self, request, show, *, clear: bool = False, failed=None) -> None:
        """Run ``request`` (:mod:`core.requests`) on the picked model in the worker: the one path
        of every run the window records. The generic job (:func:`app.jobs.request_job`), then the
        session's record of the request's document of the result with its parameters (what the
        CLI records for the same request; a request of an image records it, with the painted
        region it used), then ``show(result, run_id)`` with the typed result; nothing when it was
        cancelled before a result. ``clear``, ``failed``: as :meth:`_start`'s."""

        def done(result) -> None:
            if result is None:
                return
            loaded = self.loaded_model()
            ran = as_run(request, loaded)  # the request as it ran: its parameters, its document
            inputs = ran.recorded_inputs()  # the image and the painted region, as the CLI records them
            recorded = ran.recorded(result, loaded)
            run_id = self._record(
                recorded, mask=inputs.get("mask"), parameters=ran.parameters(), with_image="image" in inputs
            )
            show(result, run_id)

        self._start(done, request_job, self.model_cache, self.model_choice(), request, clear=clear, failed=failed)

    def cancel(self) -> None:
        """Ask the running job to stop; the window goes idle when it has."""
        if self._job is not None:
            self._job.cancel()
            self.cancel_button.setEnabled(False)
            self.status_label.setText("cancelling…")

    def _start(self, show_result, fn, *args, clear: bool = True, failed=None) -> None:
        """Run ``fn(*args)`` in a worker; ``show_result(result)`` runs on success, before the window goes idle.
        ``clear``: forget the shown answer first (new answers; not for follow-up read-outs); ``failed(message)``:
        runs on failure after the error line shows it (a panel saying it too)."""
        self.show_error("")
        self._unmet = None  # a refusal's message gives way to the job's
        if clear:
            self._clear_answer()
        job = Worker(fn, *args)

        def while_open(handler):  # an outcome queued as the window closed is nobody's (nothing recorded)
            return lambda *outcome: None if self._closed else handler(*outcome)

        job.progress.connect(while_open(self._on_progress))
        job.failed.connect(while_open(self._on_failed))
        if failed is not None:
            job.failed.connect(while_open(failed))  # after _on_failed: its _end_job clears the panels' "running" lines
        job.cancelled.connect(while_open(self._on_cancelled))
        job.finished.connect(while_open(show_result))
        job.finished.connect(while_open(lambda _result: self._end_job("ready")))
        self._job = self.workers.start(job)
        self._set_busy(True)
        status = JOB_STATUS.get(args[-1].name if fn is request_job else fn, "working…")
        self.status_label.setText(status)  # at once: the job's own lines follow
        if self.image is not None:  # a "run #N shown" line from the History is not what is shown now
            self.statusBar().showMessage(self._image_line())

    def _on_progress(self, done: int, total: int, message: str) -> None:
        if total <= 0:
            self.progress_bar.setRange(0, 0)  # busy: amount unknown
        else:
            self.progress_bar.setRange(0, total)
            self.progress_bar.setValue(done)
        if not self._job or not self._job.cancel_token.is_set():
            self.status_label.setText(message)

    def _on_failed(self, message: str) -> None:
        self.show_error(message)
        self._end_job("failed")

    def _on_cancelled(self) -> None:
        self._end_job("cancelled")

    def _end_job(self, status: str) -> None:
        self._job = None
        self.counterfactual_panel.set_busy(False)
        if status != "ready":  # its "running …" line is over; the status and error lines say why
            self.counterfactual_panel.show_message("")
            self.intervention_panel.show_message("")
            self.claims_panel.show_message("")
            self.head_methods.show_message("")
        self._set_busy(False)
        self._note_loaded_model()  # its fingerprint, dtype and device: known once loaded
        if self.loaded_model() is not None:  # only a model that loaded joins the picker's list
            self._remember_model(self.model_choice())
        self._show_status(status)
        self.idle.emit()

    def _show_status(self, status: str) -> None:
        """The status line when idle: ``status`` (ready, failed, cancelled), and beside it each load
        warning of the model picked (e.g. unexpected tensors in the weights), while it is picked."""
        self._outcome = status
        loaded = self.loaded_model()
        notes = loaded.info.get("warnings", []) if loaded is not None else []
        self.status_label.setText("; ".join([status, *(f"warning: {' '.join(n.split())}" for n in notes)]))

    def _follow_status_lines(self) -> None:
        """Keep the status and error lines true as the window changes: another model picked (its own
        load warnings), and a refusal's precondition met (a region painted, a component selected,
        a positions or source choice made; the Claims tab's fields: app.claims)."""
        for picker in (self.model_picker, self.dtype_picker, self.device_picker):
            picker.currentTextChanged.connect(
                lambda _text: None if self.is_busy() else self._show_status(self._outcome)
            )
        self.counterfactual_panel.mask_changed.connect(self._recheck_refusal)
        disconnect = self.selection.changed.connect(self._recheck_refusal)
        self.destroyed.connect(lambda *_: disconnect())
        self.intervention_panel.positions_combo.currentIndexChanged.connect(self._recheck_refusal)
        self.intervention_panel.source_combo.currentIndexChanged.connect(self._recheck_refusal)

    def _set_busy(self, busy: bool) -> None:
        # Disabling the focused button would hand the focus to the next field (the Question, its text
        # selected, so a key press replaces it): park it on the tabs and give it back afterwards.
        focused = QApplication.focusWidget()
        panel = self.counterfactual_panel
        buttons = (self.answer_button, self.readout_button, panel.run_button, panel.sweep_button)
        buttons += (self.intervention_panel.ablate_button, self.intervention_panel.patch_button)
        buttons += (self.claims_panel.run_button, self.head_methods.nonunique_button, self.head_methods.qk_ov_button)
        pickers = (self.model_picker, self.dtype_picker, self.device_picker)
        if busy and focused in (*buttons, self.model_folder_button, *pickers):
            self._focus_before_job = focused
            self.tabs.setFocus(Qt.FocusReason.OtherFocusReason)
        self.answer_button.setEnabled(not busy)
        self.answer_panel.set_busy(busy)  # Generate and the answer's tokens
        self.readout_button.setEnabled(not busy)
        self.model_folder_button.setEnabled(not busy)
        self.intervention_panel.set_busy(busy)
        self.claims_panel.set_busy(busy)
        self.head_methods.set_busy(busy)
        self.model_picker.setEnabled(not busy)
        self.dtype_picker.setEnabled(not busy)
        self.device_picker.setEnabled(not busy and self.device_picker.count() > 1)
        self.cancel_button.setEnabled(busy)
        self.progress_bar.setRange(0, 0 if busy else 1)
        self.progress_bar.setValue(0)
        if not busy and self._focus_before_job is not None:
            self._focus_before_job.setFocus(Qt.FocusReason.OtherFocusReason)
            self._focus_before_job = None

    # ----- output -------------------------------------------------------

    def show_error(self, message: str) -> None:
        """One line of red text; an empty message clears it, and with it (when no job runs) the
        last job's "failed" or "cancelled": clearing it is what a new action that went well does."""
        self._error_shown = " ".join(message.split())
        self.error_label.setText(self._error_shown)
        if not self._error_shown and not self.is_busy():
            self._show_status("ready")

    def _refuse_until(self, panel, message: str, met=None) -> bool:
        """Refuse a run for a precondition the user can meet: ``message`` in ``panel`` (one with
        ``show_message`` and ``message_label``) and the error line, until ``met()`` holds (a region
        painted, a head selected, a field filled: checked as those change). Returns False."""
        panel.show_message(message, error=True)
        self.show_error(message)
        self._unmet = None if met is None else (panel, " ".join(message.split()), met)
        return False

    def _recheck_refusal(self, *_args, **_kwargs) -> None:
        """The last refusal's precondition met: its message goes from its panel and the error
        line, where they still show it (a later message stays)."""
        if self._unmet is None:
            return
        panel, message, met = self._unmet
        if not met():
            return
        self._unmet = None
        if panel.message_label.text() == message:
            panel.show_message("")
        if self._error_shown == message:
            self.show_error("")

    def _clear_answer(self) -> None:
        self.last_answer = None
        self.last_answers = []
        self.answer_panel.clear()

    def _show_answer(self, result: core.Answer, caption: str) -> None:
        self.last_answer = result
        self.answer_panel.show_answer(result, caption)

    def _show_pairs(
        self, questions: Sequence[str], answers: list[core.Answer], expected: Sequence[str | None] | None
    ) -> None:
        self.last_answers = answers
        self.answer_panel.show_pairs(questions, answers, expected)

    def _show_analysis(self, analysis: AnalyzeResult | None) -> None:
        """Fill the read-out panels and the canvas from one analyze result (None clears)."""
        self.analysis = analysis
        self.attention_panel.set_result(analysis)
        self.dla_panel.set_result(analysis)
        tuned = analysis.tuned_lens if analysis is not None else None
        self.lens_panel.set_result(analysis, readers=tuned.readers if tuned is not None else {})
        if analysis is None:  # the grids, notes and heatmap were the run's
            self.canvas.set_tokens(None)
            self.counterfactual_panel.set_tokens(None)
            return
        tokens, view_names = analysis.input.visual_tokens, analysis.input.view_names
        self.canvas.set_tokens(tokens, view_names=view_names, token_read=read_token(analysis))
        note = describe_token_layout(tokens, analysis.model.family)
        self.canvas.set_token_note(note)
        self.counterfactual_panel.set_tokens(tokens, view_names=view_names)
        self.counterfactual_panel.set_token_note(note)
        rollout = analysis.rollout
        if rollout is not None:
            self.canvas.set_heatmap(
                self._patch_values(rollout),
                label=f"rollout (alpha {rollout.alpha}): structural-flow approximation, not a cause",
            )
        if not self.target_edit.text().strip():
            self.target_edit.setPlaceholderText(f"answer token (now: {analysis.target.answer}, the model's top token)")

    def _on_tab_changed(self, index: int) -> None:
        # the painter has its own canvas: give it the whole width instead of showing the image twice
        self.run_frames["canvas"].setVisible(self.tabs.tabText(index) != "Counterfactual")

    def show_head_map(self, layer: int, head: int) -> None:
        """Put one head's answer-row attention on the canvas (patch-granular)."""
        row = self.attention_panel.head_row(layer, head)
        if row is not None:
            self.canvas.set_heatmap(
                self._patch_values(row),
                label=f"{row.name}: answer-row attention (routing only)",
            )

    def _patch_values(self, section: HeadSummary | RolloutSection) -> np.ndarray:
        """One value per canvas token from a read-out section's patch grids (every view's, where it has them)."""
        return patch_values(self.canvas.tokens, section.visual_patch_mass, section.visual_patch_mass_by_image)

    def _show_sources_map(self, layer: int, head: int, values) -> None:
        block = block_names(self.analysis).get(int(layer), f"block {layer}")
        self.canvas.set_heatmap(np.asarray(values), label=f"{block}.H{head}: frozen-scale DLA per source token")

    def _forget_expected(self) -> None:
        self._expected = None

    def closeEvent(self, event) -> None:
        """Cancel running jobs and join their threads before the window goes; one still running after
        ``close_wait_ms`` (in a forward it cannot leave) is let go (app.workers): nothing of it is
        shown or recorded (its outcome is dropped, the session closed)."""
        self._closed = True
        self._job = None
        self.workers.shutdown(self.close_wait_ms)
        self._close_session()
        super().closeEvent(event)
