"""What the window's buttons ask: each action checks what it needs (an image,
a selected head, a painted region), builds the request (core.requests) from the
fields and the panels' controls, and hands it to the one run path
(:class:`app.runner.Runner`): worker, record, show. A refusal the user can meet
(paint a region, select a head) says why in its panel and the error line until
it is met (:meth:`app.input_bar.InputBar.refuse_until`).

Work that makes no run of the session (an answer, the pairs' answers, one
head's source map, the dataset statistics) takes the runner's plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication, QFileDialog

import core
from app.components import ShownRun
from app.jobs import answer_job, answer_of, answer_pairs_job, head_sources_job, model_load_job, statistics_job
from app.panels.run_requests import IMAGE_FILTER, Refusal
from app.samples import bundled_pairs_file
from core.files.images import load_mask
from core.requests import AnalyzeRequest, GenerateRequest
from core.requests.patching import default_patch_site, patch_sites

# the formats core.files.images accepts (ACCEPTED_FORMATS)


def qimage_to_png(image: QImage) -> bytes:
    """Encode a QImage as PNG bytes (for :func:`core.load_image`)."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


class Actions:
    """The window's actions (see the module docstring). Uses of the window (its host):
    ``workspace``, ``inputs``, ``runner``, ``image``, ``samples``, ``expected``, the panels,
    ``selection``, ``answer_tokens``, ``sessions``, ``model_choice()``, ``loaded_model()``,
    ``models``, ``read_image()`` and ``show_error()``."""

    def __init__(self, window):
        self.window = w = window
        w.inputs.question_edit.returnPressed.connect(self.answer_question)
        w.inputs.answer_button.clicked.connect(self.answer_question)
        w.inputs.readout_button.clicked.connect(self.run_readout)
        w.answer_panel.generate_requested.connect(self.generate_answer)
        w.dla_panel.sources_requested.connect(self.request_head_sources)
        w.counterfactual_panel.run_requested.connect(self.run_counterfactual)
        w.counterfactual_panel.sweep_requested.connect(self.run_sweep)
        w.intervention_panel.ablate_requested.connect(self.ablate_selected)
        w.intervention_panel.patch_requested.connect(self.patch_region)
        w.head_methods.nonunique_requested.connect(self.run_nonunique)
        w.head_methods.qk_ov_requested.connect(self.run_qk_ov)
        w.flow_panel.knockout_requested.connect(self.run_knockout)
        w.flow_panel.grid_requested.connect(self.run_patch_grid)
        w.validation_panel.run_requested.connect(self.run_claim)

    # ----- what every action reads --------------------------------------

    def has_image(self) -> bool:
        if self.window.image is None:
            self.window.show_error("no image: open one (File > Open image), drop one here or paste one")
        return self.window.image is not None

    def ready(self, needs_image: bool = True) -> bool:
        """No job runs, and (``needs_image``) an image is shown."""
        return not self.window.runner.is_busy() and (not needs_image or self.has_image())

    def asked(self) -> dict:
        """The shown image, question, target fields as typed and answer token read out: the
        :class:`core.requests.base.AskedRequest` fields of a request about the shown input."""
        w = self.window
        answer, foil = w.inputs.targets()
        return {
            "image": w.image,
            "image_path": w.workspace.input.image_path,
            "question": w.inputs.question_edit.text().strip(),
            "answer": answer,
            "foil": foil,
            "answer_text": w.workspace.input.answer_text,
        }

    def caption(self) -> str:
        """The Answer tab's caption: model, image, question (and a bundled sample's expected answer)."""
        w = self.window
        caption = f"{w.inputs.model_spec()} · {w.image_name} · {w.inputs.question_edit.text().strip()}"
        if w.expected is not None:
            caption += f"\nexpected (sample ground truth): {w.expected}"
        return caption

    def run(self, request, *, status: str, failed=None) -> bool:
        """``request`` on the picked model through the one run path (recorded, then shown)."""
        w = self.window
        w.show_error("")
        w.inputs.forget_refusal()  # a refusal's message gives way to the job's
        w.runner.run_request(request, w.model_choice(), w.workspace.input, status=status, failed=failed)
        return True

    def run_panel(self, panel, request, *, status: str, says_failure: bool = False) -> bool:
        """A panel's request (or its :class:`app.panels.run_requests.Refusal`, said in the panel and
        the error line until met); the panel shows its "running: …" line while it runs, and
        (``says_failure``) the failure's reason too."""
        if isinstance(request, Refusal):
            return self.window.inputs.refuse_until(panel, request.message, request.met)
        failed = (lambda message: panel.show_message(message, error=True)) if says_failure else None
        self.run(request, status=status, failed=failed)
        panel.show_running(request)
        return True

    def show(self, result, run_id: int | None, asked) -> None:
        """A run's result into the workspace, the last step of the run path (every panel draws from
        there): a read-out or a generation is a run of its own; a follow-up joins the shown run of
        its input; a claim, checked on a model and not on the input, goes to the Validation panel."""
        w = self.window
        made_for = w.models.made_for(asked)
        if result.kind == "analyze":  # the Answer tab reads its answer from the same forward
            results = {"analyze": result, "answer": answer_of(result)}
            w.workspace.show_run(ShownRun(run_id, "analyze", made_for, results))
        elif result.kind == "generate":
            made_for = w.answer_tokens.kept_choice(made_for, result)
            w.workspace.show_run(ShownRun(run_id, "generate", made_for, {"generate": result}))
            if not result.token_ids:
                w.show_error(f"the model generated no token (stopped: {result.stop_reason})")
        elif result.kind == "validate":
            w.validation_panel.show_claim(result, run_id, made_for)
        else:
            w.workspace.add_result(result.kind, result, run_id, made_for)

    def start(self, on_result, fn, *args, status: str) -> bool:
        """A job that makes no run of the session (the runner's plain path)."""
        w = self.window
        w.show_error("")
        w.inputs.forget_refusal()
        w.runner.start(on_result, fn, w.model_cache, *args, status=status)
        return True

    # ----- the image --------------------------------------------------------

    def open_image_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Open image", "", IMAGE_FILTER)
        if path:
            self.window.set_image(path)

    def paste_image(self) -> None:
        """Take an image (or an image file) from the clipboard."""
        mime = QApplication.clipboard().mimeData()
        if mime is not None and mime.hasImage():
            self.window.set_image(qimage_to_png(QImage(mime.imageData())), name="pasted image")
        elif mime is not None and mime.hasUrls() and mime.urls()[0].isLocalFile():
            self.window.set_image(mime.urls()[0].toLocalFile())
        else:
            self.window.show_error("the clipboard holds no image")

    # ----- the answer and the read-out ----------------------------------

    def answer_question(self) -> bool:
        """Answer the shown question about the shown image in the background; False if not started."""
        if not self.ready():
            return False
        w = self.window
        w.answer_tokens.forget_choice()  # the model's answer: the first token after the bare prompt
        w.answer_panel.clear()
        asked = w.workspace.input

        def show(answer: core.Answer) -> None:
            # not recorded: the Answer tab names this input; the read-out views compare theirs with it
            w.workspace.show_run(ShownRun(None, "answer", w.models.made_for(asked), {"answer": answer}))

        question = w.inputs.question_edit.text().strip()
        return self.start(show, answer_job, w.model_choice(), w.image, question, status="answering…")

    def answer_pairs(self, images: Sequence, questions: Sequence[str], expected=None, batch_size: int = 16) -> bool:
        """Answer many pairs in the background (cancellable between batches); False if not started."""
        if not self.ready(needs_image=False):
            return False
        w = self.window
        w.answer_panel.clear()

        def show(answers) -> None:
            w.answer_panel.show_pairs(questions, answers, expected)

        args = (w.model_choice(), list(images), list(questions), batch_size)
        return self.start(show, answer_pairs_job, *args, status="answering the pairs…")

    def answer_all_samples(self) -> bool:
        samples = self.window.samples
        if not samples:
            self.window.show_error("no bundled samples to answer")
            return False
        return self.answer_pairs(
            [s.image_path for s in samples], [s.question for s in samples], [s.expected for s in samples]
        )

    def run_readout(self) -> bool:
        """One capture and every read-out of the shown pair in the background; False if not started."""
        if not self.ready():
            return False
        self.window.answer_panel.clear()
        return self.run(AnalyzeRequest(**self.asked()), status="reading out…")

    def generate_answer(self, max_new_tokens: int | None = None) -> bool:
        """The model's answer, generated token by token and shown as clickable tokens; False if not started."""
        if not self.ready():
            return False
        w = self.window
        budget = int(max_new_tokens or w.answer_panel.max_tokens.value())
        asked = self.asked()
        request = GenerateRequest(
            image=asked["image"], image_path=asked["image_path"], question=asked["question"], max_new_tokens=budget
        )
        w.answer_panel.clear()
        return self.run(request, status="generating…")

    def request_head_sources(self, layer: int, head: int) -> bool:
        """One head's per-source contributions for the shown read-out (the DLA tab's map)."""
        w = self.window
        shown = w.workspace.shown
        if w.runner.is_busy() or shown is None or shown.analysis is None:
            return False
        analysis, image = shown.analysis, w.image
        if shown.input.image_sha256 != w.workspace.input.image_sha256:
            return False  # the read-out shown is of another image than the one on the canvas
        model = shown.input.model_choice()
        args = (model, analysis, image, shown.input.question, layer, head)
        return self.start(
            lambda r: w.dla_panel.set_sources(*r), head_sources_job, *args, status="source contributions…"
        )

    def load_model(self, model) -> bool:
        """Load ``model`` (a restored run's) in the background, so that follow-ups can run on it."""
        return self.start(lambda _loaded: None, model_load_job, model, status="loading model…")

    # ----- the dataset statistics (Attention tab) -------------------------

    def attention_statistics(self, items: list, dataset: Path | None = None) -> bool:
        """Distributions of every head's answer-row attention over ``items`` (``(image, question,
        target mask or None)``), shown in the Attention tab; ``dataset``: the pairs file they
        came from (its path and hash go into the audit row)."""
        if not self.ready(needs_image=False):
            return False
        w = self.window

        def show(stats) -> None:
            w.attention_panel.set_statistics(stats)
            w.sessions.record(stats, parameters={"dataset": str(dataset)} if dataset else None)

        return self.start(show, statistics_job, w.model_choice(), list(items), status="attention statistics…")

    def attention_statistics_of_samples(self) -> bool:
        """The bundled samples, with each one's target mask where it has one."""
        items = []
        for sample in self.window.samples:
            try:
                mask = load_mask(sample.target_mask_path) if sample.target_mask_path else None
            except core.ImageLoadError as e:
                self.window.show_error(str(e))
                return False
            items.append((sample.image_path, sample.question, mask))
        if not items:
            self.window.show_error("no bundled samples to read out")
            return False
        return self.attention_statistics(items, dataset=bundled_pairs_file())

    # ----- the follow-ups: each panel builds its request -------------------

    def painted(self):
        return self.window.counterfactual_panel.mask()

    def run_counterfactual(self, mask=None, fill: str | None = None, options: dict | None = None) -> bool:
        """Fill the painted region (``mask``: another) and re-run the model (Counterfactual tab)."""
        if not self.ready():
            return False
        panel = self.window.counterfactual_panel
        request = panel.counterfactual_request(self.asked(), mask, fill, options)
        return self.run_panel(panel, request, status="counterfactual…")

    def run_sweep(self, k: int | None = None) -> bool:
        """The occlusion sweep with the panel's fill (Counterfactual tab)."""
        if not self.ready():
            return False
        panel = self.window.counterfactual_panel
        return self.run_panel(panel, panel.sweep_request(self.asked(), k), status="occlusion sweep…")

    def ablate_selected(self) -> bool:
        """Ablate the component selected last in Attention, DLA or Lens with the Interventions box's
        kind and positions, at the answer token read out; False, with the reason, when it cannot run."""
        if not self.ready():
            return False
        panel = self.window.intervention_panel
        return self.run_panel(panel, panel.ablation_request(self.asked(), self.painted), status="ablating…")

    def patch_region(self, source=None) -> bool:
        """Patch visual-token features from ``source`` (default: the Interventions box's source image)
        into this run and back, at the box's site; False, with the reason, when it cannot run."""
        if not self.ready():
            return False
        panel = self.window.intervention_panel
        return self.run_panel(panel, panel.patch_request(self.asked(), self.painted, source), status="patching…")

    def run_nonunique(self) -> bool:
        """Non-unique attention of the selected head on the shown input; False, with the reason, when nothing runs."""
        if not self.ready():
            return False
        panel = self.window.head_methods
        request = panel.nonunique_request(self.asked(), self.painted)
        return self.run_panel(panel, request, status="non-unique attention…", says_failure=True)

    def run_qk_ov(self) -> bool:
        """The selected head's QK / OV circuits (weights, and activations on the shown input)."""
        if not self.ready():
            return False
        panel = self.window.head_methods
        return self.run_panel(panel, panel.qk_ov_request(self.asked()), status="QK / OV…", says_failure=True)

    def run_knockout(self) -> bool:
        """The Flow tab's knockout on the shown input; False, with the reason, when it cannot run."""
        if not self.ready():
            return False
        panel = self.window.flow_panel
        request = panel.knockout_request(self.asked(), self.painted)
        return self.run_panel(panel, request, status="knockout…", says_failure=True)

    def run_patch_grid(self) -> bool:
        """The Flow tab's patching grid from its source image; False, with the reason, when it cannot run."""
        if not self.ready():
            return False
        panel = self.window.flow_panel
        request = panel.grid_request(self.asked(), self.painted)
        return self.run_panel(panel, request, status="patch grid…", says_failure=True)

    def run_claim(self) -> bool:
        """Check the Validation panel's claim on its subjects and data; False, with the reason, when it cannot run."""
        if not self.ready(needs_image=False):
            return False
        panel = self.window.validation_panel
        return self.run_panel(panel, panel.validate_request(self.painted), status="validating…", says_failure=True)

    def refresh_patch_sites(self) -> None:
        """The Interventions box offers the patch sites of the model picked, once it is loaded."""
        loaded = self.window.loaded_model()
        if loaded is not None:
            sites = patch_sites(loaded.adapter)
            self.window.intervention_panel.set_patch_sites(sites, loaded.adapter.blocks, default_patch_site(sites))
        else:
            self.window.intervention_panel.set_patch_sites(None)
