"""The main window: an image, a question, the model's answer.

The model runs in :mod:`app.workers`, never on the GUI thread. Loaded models
are cached by spec in ``MainWindow.model_cache`` and reused. Errors show as
one red line in the window; nothing here opens a blocking dialog except the
file picker the user asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PIL import Image
from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt, Signal
from PySide6.QtGui import QAction, QImage, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

import core
from app.samples import Sample, bundled_samples
from app.workers import Worker, WorkerPool

BUILTIN_MODELS = ("shapes-llava", "shapes-coca")
IMAGE_FILTER = "Images (*.png *.jpg *.jpeg *.bmp *.gif *.tif *.tiff *.webp);;All files (*)"


def _cached_model(model_cache: dict, spec: str, progress) -> core.LoadedModel:
    """The model for ``spec`` from the cache, loading (and caching) it on a miss.

    Runs in a worker; the window runs one job at a time, so the dict needs no lock.
    """
    if spec not in model_cache:
        progress(0, 0, f"loading model {spec}…")
        model_cache[spec] = core.load_model(spec)
    return model_cache[spec]


def answer_job(
    model_cache: dict, spec: str, image: Image.Image, question: str, *, progress, cancel
) -> core.Answer | None:
    """Worker job: load (or reuse) the model and answer one question."""
    loaded = _cached_model(model_cache, spec, progress)
    if cancel.is_set():
        return None
    progress(0, 1, "answering…")
    result = core.answer(loaded, image, question)
    progress(1, 1, "answered")
    return result


def answer_pairs_job(
    model_cache: dict, spec: str, images: Sequence, questions: Sequence[str], batch_size: int, *, progress, cancel
) -> list[core.Answer]:
    """Worker job: answer many (image, question) pairs; stops early on cancel."""
    loaded = _cached_model(model_cache, spec, progress)
    progress(0, len(questions), f"answering 0/{len(questions)}…")
    return core.answer_batch(
        loaded,
        images,
        questions,
        batch_size=batch_size,
        progress=lambda done, total: progress(done, total, f"answering {done}/{total}…"),
        cancel=cancel.is_set,
    )


def qimage_to_png(image: QImage) -> bytes:
    """Encode a QImage as PNG bytes (for :func:`core.load_image`)."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def _plain_label(text: str = "") -> QLabel:
    """A label that never interprets its text as HTML (tokens like ``<pad>``)."""
    label = QLabel(text)
    label.setTextFormat(Qt.TextFormat.PlainText)
    return label


class MainWindow(QMainWindow):
    """Image + question in, answer + top alternatives out.

    Opens on the first bundled sample. Nothing runs until
    :meth:`answer_question` (the Answer button) is called.

    Args:
        model_spec: the model shown in the picker at start.
        model_cache: ``{spec: LoadedModel}`` shared with the caller (tests
            pass one to load each model once); a fresh dict by default.
    """

    idle = Signal()  # a job ended: its answer, error or cancellation is shown

    def __init__(self, model_spec: str = "shapes-llava", model_cache: dict | None = None):
        super().__init__()
        self.model_cache = {} if model_cache is None else model_cache
        self.workers = WorkerPool(self)
        self.image: Image.Image | None = None
        self.image_name = ""
        self.last_answer: core.Answer | None = None
        self.last_answers: list[core.Answer] = []
        self._job: Worker | None = None
        self._expected: str | None = None  # ground truth while a bundled sample is shown unchanged
        self.setWindowTitle("VLM Readout")
        self.setAcceptDrops(True)
        self._build_widgets(model_spec)
        self._build_menus()
        self._set_busy(False)
        self._clear_answer()
        self.resize(1000, 680)
        samples = bundled_samples()
        if samples:
            self.load_sample(samples[0])

    # ----- layout -------------------------------------------------------

    def _build_widgets(self, model_spec: str) -> None:
        self.model_picker = QComboBox()
        self.model_picker.setEditable(True)
        self.model_picker.addItems(BUILTIN_MODELS)
        self.model_picker.setCurrentText(model_spec)
        self.model_picker.setMinimumWidth(260)
        self.model_picker.setToolTip("a built-in name, a model folder, a cached repo id or open_clip name:checkpoint")

        self.image_view = pg.GraphicsLayoutWidget()
        self.image_view.setBackground("w")
        self.image_view.setAcceptDrops(False)  # let drops reach the window
        self.image_view.viewport().setAcceptDrops(False)
        self.image_plot = self.image_view.addPlot()
        self.image_plot.setAspectLocked(True)
        self.image_plot.invertY(True)  # row 0 at the top: the image is upright
        self.image_plot.setMenuEnabled(False)
        self.image_plot.hideButtons()
        self.image_plot.getViewBox().setBackgroundColor("#e6e6e6")  # shows the image's edges
        self.image_item = pg.ImageItem(axisOrder="row-major")
        self.image_plot.addItem(self.image_item)

        self.answer_label = _plain_label("no answer yet")
        font = self.answer_label.font()
        font.setPointSizeF(font.pointSizeF() * 1.5)
        font.setBold(True)
        self.answer_label.setFont(font)
        self.answer_caption = _plain_label()
        self.answer_caption.setWordWrap(True)
        self.answer_caption.setStyleSheet("color: #555;")
        self.top_table = QTableWidget(0, 2)
        self.top_table.verticalHeader().setVisible(False)
        self.top_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.top_table.setWordWrap(False)

        answer_panel = QWidget()
        answer_layout = QVBoxLayout(answer_panel)
        answer_layout.addWidget(self.answer_label)
        answer_layout.addWidget(self.answer_caption)
        self.table_title = _plain_label()
        answer_layout.addWidget(self.table_title)
        answer_layout.addWidget(self.top_table, stretch=1)

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.image_view)
        splitter.addWidget(answer_panel)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 2)
        splitter.setSizes([600, 400])

        self.question_edit = QLineEdit()
        self.question_edit.setPlaceholderText("ask a question about the image")
        self.question_edit.returnPressed.connect(self.answer_question)
        self.question_edit.textEdited.connect(self._forget_expected)
        self.answer_button = QPushButton("Answer")
        self.answer_button.clicked.connect(self.answer_question)

        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.status_label = _plain_label("ready")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)

        self.error_label = _plain_label()
        self.error_label.setStyleSheet("color: #c00000;")
        self.error_label.setWordWrap(True)
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        controls = QGridLayout()
        controls.addWidget(_plain_label("Model"), 0, 0)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_picker)
        model_row.addStretch(1)
        controls.addLayout(model_row, 0, 1, 1, 2)
        controls.addWidget(_plain_label("Question"), 1, 0)
        controls.addWidget(self.question_edit, 1, 1)
        controls.addWidget(self.answer_button, 1, 2)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress_bar, stretch=2)
        progress_row.addWidget(self.status_label, stretch=3)
        controls.addLayout(progress_row, 2, 1)
        controls.addWidget(self.cancel_button, 2, 2)
        controls.addWidget(self.error_label, 3, 0, 1, 3)

        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addWidget(splitter, stretch=1)
        layout.addLayout(controls)
        self.setCentralWidget(central)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        open_action = QAction("&Open image…", self, shortcut=QKeySequence.StandardKey.Open)
        open_action.triggered.connect(self.open_image_dialog)
        file_menu.addAction(open_action)
        samples_menu = file_menu.addMenu("&Samples")
        for sample in bundled_samples():
            action = QAction(f"{sample.image_path.name}: {sample.question}", self)
            action.triggered.connect(lambda _=False, s=sample: self.load_sample(s))
            samples_menu.addAction(action)
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

    # ----- inputs -------------------------------------------------------

    def set_image(self, source, name: str | None = None) -> bool:
        """Show an image (path, bytes or PIL image); False and an error line if it cannot be read."""
        if self.is_busy():
            self.show_error("a job is running: wait for it or cancel it before changing the image")
            return False
        try:
            image = core.load_image(source)
        except core.ImageLoadError as e:
            self.show_error(str(e))
            return False
        self.image = image
        self.image_name = name or (Path(source).name if isinstance(source, (str, Path)) else "image")
        self.image_item.setImage(np.asarray(image), autoLevels=False, levels=(0, 255))  # (H, W, 3) uint8
        self.image_plot.autoRange(padding=0.02)
        self._expected = None
        self._clear_answer()
        self.show_error("")
        self.statusBar().showMessage(f"{self.image_name}  {image.width}×{image.height}")
        return True

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

    def is_busy(self) -> bool:
        return self._job is not None

    def answer_question(self) -> bool:
        """Answer the shown question about the shown image in the background; False if not started."""
        if self.is_busy():
            return False
        if self.image is None:
            self.show_error("no image: open one (File > Open image), drop one here or paste one")
            return False
        question = self.question_edit.text().strip()
        spec = self.model_spec()
        caption = f"{spec} · {self.image_name} · {question}"
        if self._expected is not None:
            caption += f"\nexpected (sample ground truth): {self._expected}"
        self._start(
            lambda result: self._show_answer(result, caption), answer_job, self.model_cache, spec, self.image, question
        )
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
            self.model_spec(),
            list(images),
            list(questions),
            batch_size,
        )
        return True

    def answer_all_samples(self) -> bool:
        samples = bundled_samples()
        return self.answer_pairs(
            [s.image_path for s in samples], [s.question for s in samples], [s.expected for s in samples]
        )

    def cancel(self) -> None:
        """Ask the running job to stop; the window goes idle when it has."""
        if self._job is not None:
            self._job.cancel()
            self.cancel_button.setEnabled(False)
            self.status_label.setText("cancelling…")

    def _start(self, show_result, fn, *args) -> None:
        """Run ``fn(*args)`` in a worker; ``show_result(result)`` runs on success, before the window goes idle."""
        self.show_error("")
        self._clear_answer()
        job = Worker(fn, *args)
        job.progress.connect(self._on_progress)
        job.failed.connect(self._on_failed)
        job.cancelled.connect(self._on_cancelled)
        job.finished.connect(show_result)
        job.finished.connect(lambda _result: self._end_job("ready"))
        self._job = self.workers.start(job)
        self._set_busy(True)

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
        self._set_busy(False)
        self.status_label.setText(status)
        self.idle.emit()

    def _set_busy(self, busy: bool) -> None:
        self.answer_button.setEnabled(not busy)
        self.model_picker.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.progress_bar.setRange(0, 0 if busy else 1)
        self.progress_bar.setValue(0)

    # ----- output -------------------------------------------------------

    def show_error(self, message: str) -> None:
        """One line of red text; an empty message clears it."""
        self.error_label.setText(" ".join(message.split()))

    def _clear_answer(self) -> None:
        self.last_answer = None
        self.last_answers = []
        self.answer_label.setText("no answer yet")
        self.answer_caption.setText("")
        self.table_title.setText("")
        self._fill_table(["token", "probability"], [])

    def _show_answer(self, result: core.Answer, caption: str) -> None:
        self.last_answer = result
        self.answer_label.setText(f"answer: {result.answer}  (p = {result.prob:.3f})")
        self.answer_caption.setText(caption)
        self.table_title.setText("top alternatives")
        self._fill_table(["token", "probability"], [(token, f"{prob:.3f}") for token, prob in result.top])

    def _show_pairs(
        self, questions: Sequence[str], answers: list[core.Answer], expected: Sequence[str | None] | None
    ) -> None:
        self.last_answers = answers
        expected = list(expected) if expected is not None else [None] * len(answers)
        known = [(a.answer, e) for a, e in zip(answers, expected, strict=True) if e is not None]
        self.answer_label.setText(f"{len(answers)} pairs answered")
        self.table_title.setText("answers")
        if known:
            matches = sum(a == e for a, e in known)
            self.answer_caption.setText(f"{matches} of {len(known)} answers match the expected answer")
        self._fill_table(
            ["question", "answer (p)", "expected"],
            [(q, f"{a.answer} ({a.prob:.3f})", e or "") for q, a, e in zip(questions, answers, expected, strict=True)],
        )

    def _fill_table(self, headers: list[str], rows: list[tuple[str, ...]]) -> None:
        """Rows of text; the first column takes the spare width, the others fit their contents."""
        self.top_table.setColumnCount(len(headers))
        self.top_table.setHorizontalHeaderLabels(headers)
        header = self.top_table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.top_table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                self.top_table.setItem(r, c, QTableWidgetItem(text))

    def _forget_expected(self) -> None:
        self._expected = None

    def closeEvent(self, event) -> None:
        """Cancel running jobs and join their threads before the window goes."""
        self.workers.shutdown()
        super().closeEvent(event)
