"""The window's input bar: the model (spec, dtype, device), the question, the
Answer and Read out buttons, the Target and foil fields with their note, the
progress bar, the status line, Cancel and the one-line error line.

It writes what the fields say into the workspace (:class:`app.components.Workspace`)
as they change and knows nothing of runs. The status line tells the current
state (a job's line while busy; when idle the last outcome, with the picked
model's load warnings); the error line holds one message, and a refusal's
message (a precondition the user can meet) goes once the precondition is met
(:meth:`InputBar.refuse_until`).
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QWidget,
)

from app.components import ModelChoice
from app.components.model_choice import CPU, device_choices
from app.panels.answer_panel import TargetNote
from app.recent_models import BUILTIN_MODELS, recent_models, remember_model, remembered_choice
from app.widgets import ElidedLabel, plain_label
from core.shell.precision import AUTO_DTYPE_MEANING, DTYPE_CHOICES

TARGET_PLACEHOLDER = "answer token (default: the model's top token)"


class InputBar(QWidget):
    """The fields and lines under the tabs (see the module docstring).

    Args:
        workspace: the fields write the question, target, foil and model into it.
        model_spec: the model picked at start (in the dtype and on the device it was last loaded in).
        loaded_fields: ``loaded_fields(ModelChoice) -> dict``: the RunInput fields known once that
            model is loaded (fingerprint, dtype and device it runs in).
    """

    outcome = "ready"  # the last job's end (ready, failed, cancelled), shown while idle
    error_shown = ""  # the error line's text

    def __init__(self, workspace, model_spec: str, loaded_fields, parent: QWidget | None = None):
        super().__init__(parent)
        self.workspace, self._loaded_fields = workspace, loaded_fields
        self.warnings = lambda: []  # the picked model's load warnings (the window sets it)
        self._unmet = None  # (panel, message, met) of the last refusal the user can meet
        self._focus_before_job = None
        self._build(model_spec)
        self.question_edit.textChanged.connect(lambda text: workspace.set_input(question=text.strip()))
        self.target_edit.textChanged.connect(lambda text: workspace.set_input(answer=text.strip()))
        self.foil_edit.textChanged.connect(lambda text: workspace.set_input(foil=text.strip()))
        self.model_picker.currentTextChanged.connect(self._pick_remembered)
        for picker in self.pickers:
            picker.currentTextChanged.connect(lambda _text: self.note_model())
        self.note_model()  # the pickers may start on a remembered dtype and device

    def _build(self, model_spec: str) -> None:
        self.model_picker = QComboBox()
        self.model_picker.setEditable(True)
        self.model_picker.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)  # listed once loaded (remember)
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
        self.pickers = (self.model_picker, self.dtype_picker, self.device_picker)
        self._pick_remembered(model_spec)
        self.model_folder_button = QPushButton("Folder…")
        self.model_folder_button.setToolTip("choose a local model folder (Hugging Face or open_clip)")
        self.model_folder_button.clicked.connect(self.choose_model_folder)

        self.question_edit = QLineEdit()
        self.question_edit.setPlaceholderText("ask a question about the image")
        self.answer_button = QPushButton("Answer")
        self.readout_button = QPushButton("Read out")
        self.readout_button.setToolTip("answer, then one capture and every read-out (attention, DLA, lens, rollout)")
        self.target_edit = QLineEdit()
        self.target_edit.setPlaceholderText(TARGET_PLACEHOLDER)
        self.foil_edit = QLineEdit()
        self.foil_edit.setPlaceholderText("foil token (optional: u = answer - foil)")
        self.target_note = TargetNote()  # a typed word of several tokens: which sub-token is read

        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.status_label = ElidedLabel("ready")
        self.cancel_button = QPushButton("Cancel")
        # One line (the whole message in its tooltip), always there when empty: a message of any
        # length leaves every control where it was (a growing line would push them all up).
        self.error_label = ElidedLabel(selectable=True)
        self.error_label.setStyleSheet("color: #c00000;")

        controls = QGridLayout(self)
        controls.setContentsMargins(0, 0, 0, 0)
        controls.addWidget(plain_label("Model"), 0, 0)
        model_row = QHBoxLayout()
        for widget in (self.model_picker, self.model_folder_button, plain_label("dtype"), self.dtype_picker):
            model_row.addWidget(widget)
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

    # ----- the model ----------------------------------------------------

    def model_spec(self) -> str:
        return self.model_picker.currentText().strip()

    def model_choice(self) -> ModelChoice:
        """The model the picker names: spec, dtype and device (the model cache's key)."""
        return ModelChoice(self.model_spec(), self.dtype_picker.currentText(), self.device_picker.currentText())

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

    def remember_model(self) -> None:
        """The picked model loaded: kept among the recent models (with its dtype and device) and listed."""
        model = self.model_choice()
        remember_model(model)
        if model.spec not in BUILTIN_MODELS and self.model_picker.findText(model.spec) < 0:
            self.model_picker.addItem(model.spec)

    def choose_model_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model folder")
        if path:
            self.model_picker.setCurrentText(path)

    def note_model(self) -> bool:
        """The workspace's input takes the picked model (and what is known of it once loaded);
        True if that changed it."""
        model = self.model_choice()
        picked = {"model_spec": model.spec, "model_dtype": model.dtype, "model_device": model.device}
        return self.workspace.set_input(**picked, **self._loaded_fields(model))

    def targets(self) -> tuple[str, str]:
        return self.target_edit.text().strip(), self.foil_edit.text().strip()

    # ----- status, error and busy lines ---------------------------------

    def show_status(self, status: str) -> None:
        """The status line when idle: ``status`` (ready, failed, cancelled) and each load warning
        of the model picked, while it is picked."""
        self.outcome = status
        notes = [f"warning: {' '.join(n.split())}" for n in self.warnings()]
        self.status_label.setText("; ".join([status, *notes]))

    def show_error(self, message: str, busy: bool = False) -> None:
        """One line of red text; an empty message clears it, and with it (when no job runs) the
        last job's "failed" or "cancelled"."""
        self.error_shown = " ".join(message.split())
        self.error_label.setText(self.error_shown)
        if not self.error_shown and not busy:
            self.show_status("ready")

    def show_progress(self, done: int, total: int, message: str) -> None:
        if total <= 0:
            self.progress_bar.setRange(0, 0)  # busy: amount unknown
        else:
            self.progress_bar.setRange(0, total)
            self.progress_bar.setValue(done)
        if message:
            self.status_label.setText(message)

    def refuse_until(self, panel, message: str, met=None) -> bool:
        """Refuse a run for a precondition the user can meet: ``message`` in ``panel`` (one with
        ``show_message`` and ``message_label``) and the error line, until ``met()`` holds (checked
        by :meth:`recheck_refusal` as the window's fields change). Returns False."""
        panel.show_message(message, error=True)
        self.show_error(message)
        self._unmet = None if met is None else (panel, " ".join(message.split()), met)
        return False

    def forget_refusal(self) -> None:
        """A job starts: its message gives way to the job's."""
        self._unmet = None

    def recheck_refusal(self, *_args, **_kwargs) -> None:
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
        if self.error_shown == message:
            self.show_error("")

    def set_busy(self, busy: bool, buttons=(), park: QWidget | None = None) -> None:
        """Disable the fields' buttons and pickers while a job runs (``buttons``: the panels' run
        buttons, whose focus is parked too). Disabling the focused button would hand the focus to
        the next field (the Question, its text selected, so a key press replaces it): park it on
        ``park`` (the tabs) and give it back afterwards."""
        focused = QApplication.focusWidget()
        if busy and focused in (
            *buttons,
            self.answer_button,
            self.readout_button,
            self.model_folder_button,
            *self.pickers,
        ):
            self._focus_before_job = focused
        if busy and self._focus_before_job is not None:
            (park or self).setFocus(Qt.FocusReason.OtherFocusReason)
        for widget in (self.answer_button, self.readout_button, self.model_folder_button, *self.pickers[:2]):
            widget.setEnabled(not busy)
        self.device_picker.setEnabled(not busy and self.device_picker.count() > 1)
        self.cancel_button.setEnabled(busy)
        self.progress_bar.setRange(0, 0 if busy else 1)
        self.progress_bar.setValue(0)
        if not busy and self._focus_before_job is not None:
            self._focus_before_job.setFocus(Qt.FocusReason.OtherFocusReason)
            self._focus_before_job = None
