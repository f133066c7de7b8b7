"""A read-out view with a header naming the run it was drawn for, and the
window's half that keeps the workspace current (:class:`WorkspaceMixin`).

:class:`RunFrame` wraps a panel (the panel knows nothing of runs) and draws a
:class:`app.components.RunView`: grey ``run #4 · analyze · 'what shape…?' ·
sample_00.png · shapes-llava · bfloat16 · cpu`` while the content shows the current
input; amber ``stale (question changed): drawn for …; the input is now …`` once the
image, question, model, its dtype or device, answer token or target has moved on; ``no run shown
yet`` when the workspace shows nothing (the window empties the panels then: a
new image).

:class:`AnswerTokensMixin` is the window's half of the Answer tab's tokens: it
generates the answer, makes the token clicked the answer token every panel
reads (``RunInput.answer_text``; the read-out re-runs at it), and says in one
line when a typed Target or foil is several tokens for the model.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import QVBoxLayout, QWidget

import core
from app.components import ModelChoice, RunInput, RunView, ShownRun, Workspace
from app.components.workspace import ASKED_FIELDS, AnswerTokens, answer_token_label
from app.jobs import GENERATE_TOKENS, typed_token
from app.widgets import KeepingLabel
from core.requests import GenerateRequest

CURRENT_STYLE = "color: #555555; padding: 1px 4px;"
STALE_STYLE = "color: #5a3b00; background: #ffd27a; padding: 1px 4px;"  # amber: not the current input

# the window's read-out views and the result kinds each shows (the Answer tab also shows a read-out's answer)
VIEW_KINDS = {
    "canvas": ("analyze",),
    "answer": ("answer", "generate", "analyze"),
    "attention": ("analyze",),
    "dla": ("analyze",),
    "lens": ("analyze",),
    "counterfactual": ("counterfactual", "sweep", "intervention"),
}
TARGET_PLACEHOLDER = "answer token (default: the model's top token)"


class RunFrame(QWidget):
    """``panel`` under a header that follows ``view``.

    Args:
        panel: the read-out widget shown below the header.
        view: the Qt-free state (which run, stale or not).
    """

    def __init__(self, panel: QWidget, view: RunView, parent: QWidget | None = None):
        super().__init__(parent)
        self.panel = panel
        self.view = view
        self.header = KeepingLabel()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addWidget(panel, 1)
        disconnect = view.changed.connect(lambda cleared: self.refresh())
        self.destroyed.connect(lambda *_: disconnect())  # the view may outlive this widget
        self.refresh()

    @property
    def stale(self) -> bool:
        """The header says the content was drawn for another input."""
        return self.view.stale

    def header_text(self) -> str:
        """The header's whole text (the label may show it elided)."""
        return self.header.text()

    def refresh(self) -> None:
        """Redraw the header from the view."""
        self.header.setText(self.view.header(), keep=self.view.header_kept())  # the token read stays readable
        self.header.setStyleSheet(STALE_STYLE if self.view.stale else CURRENT_STYLE)


class WorkspaceMixin:
    """The workspace half of :class:`app.main_window.MainWindow`: keeps ``workspace``
    (:class:`app.components.Workspace`) current from the window's fields, frames the
    read-out views, and empties them when the workspace shows nothing. Expects the
    window's ``model_cache``, fields (``question_edit``, ``target_edit``, ``foil_edit``,
    ``model_picker``, ``dtype_picker``, ``device_picker``, ``model_choice()``) and panels."""

    def _use_workspace(self, model_spec: str) -> None:
        """Create the workspace (before the widgets, which follow it)."""
        self.workspace = Workspace(RunInput(model_spec=model_spec.strip()))
        self.workspace.events.input_changed.connect(self._on_input_changed)
        self.workspace.events.run_shown.connect(self._on_run_shown)

    def _frame_views(self, **views: QWidget) -> dict[str, RunFrame]:
        """Each read-out view (by name in :data:`VIEW_KINDS`) under a header naming its run: ``run_frames``."""
        self.run_frames = {
            name: RunFrame(widget, RunView(self.workspace, VIEW_KINDS[name], name)) for name, widget in views.items()
        }
        return self.run_frames

    def _follow_fields(self) -> None:
        """The question, target, foil and model fields (spec, dtype, device) write into the
        workspace as they change; a spec picked brings the dtype and device it was last loaded in."""
        self.question_edit.textChanged.connect(lambda text: self.workspace.set_input(question=text.strip()))
        self.target_edit.textChanged.connect(lambda text: self.workspace.set_input(answer=text.strip()))
        self.foil_edit.textChanged.connect(lambda text: self.workspace.set_input(foil=text.strip()))
        self.model_picker.currentTextChanged.connect(self._pick_remembered)
        for picker in (self.model_picker, self.dtype_picker, self.device_picker):
            picker.currentTextChanged.connect(self._on_model_changed)
        self._on_model_changed()  # the pickers may start on a remembered dtype and device

    def _loaded_fields(self, model: ModelChoice) -> dict:
        """The RunInput fields known once ``model`` is loaded: its fingerprint and the dtype and
        device it runs in (each None while it is not loaded)."""
        loaded = self.model_cache.get(model)
        if not isinstance(loaded, core.LoadedModel):
            return {"model_fingerprint": None, "loaded_dtype": None, "loaded_device": None}
        ran = loaded.adapter.dtype_and_device()
        return {"model_fingerprint": loaded.fingerprint, "loaded_dtype": ran["dtype"], "loaded_device": ran["device"]}

    def _note_loaded_model(self) -> None:
        """The workspace's input learns what the picker's model is, once loaded."""
        self.workspace.set_input(**self._loaded_fields(self.model_choice()))

    def _made_for(self, asked: RunInput) -> RunInput:
        """``asked`` (the input a job started with) with the fingerprint, dtype and device of the model it ran."""
        known = self._loaded_fields(asked.model_choice())
        return dataclasses.replace(asked, **{k: v if v is not None else getattr(asked, k) for k, v in known.items()})

    def current_image_path(self) -> str | None:
        """The shown image's path as given (None: pasted or dropped pixels, or no image)."""
        return self.workspace.input.image_path

    def _on_model_changed(self, _text: str = "") -> None:
        """Another spec, dtype or device picked: another model (the views drawn for the previous one turn stale)."""
        model = self.model_choice()
        picked = {"model_spec": model.spec, "model_dtype": model.dtype, "model_device": model.device}
        if self.workspace.set_input(**picked, **self._loaded_fields(model)):
            self.attention_panel.set_statistics(None)  # the dataset distribution was another model's heads

    def _on_input_changed(self, fields: tuple) -> None:
        if set(ASKED_FIELDS).intersection(fields):  # the image, question or model: another input
            self.target_edit.setPlaceholderText(TARGET_PLACEHOLDER)  # "now: square" was the shown run's
            self._follow_answer_tokens()

    def _on_run_shown(self, run: ShownRun | None, kind: str | None) -> None:
        if run is None:  # nothing is shown any more: no view keeps another input's content
            self._show_analysis(None)
            self.analysis_inputs = None
            self.counterfactual_panel.clear_result()
            self.counterfactual_panel.clear_sweep()
            self.intervention_panel.clear_result()
            self.last_counterfactual = self.last_intervention = None
            self._clear_answer()
            self._set_answer_tokens(None)
            return
        if "analyze" in run.results:
            self._show_answer_token_of(run)


class AnswerTokensMixin:
    """The Answer tab's tokens half of :class:`app.main_window.MainWindow`: Generate, a token
    clicked as the answer token every panel reads, the typed-target note. Expects the
    workspace half (:class:`WorkspaceMixin`), the window's ``answer_panel``, ``target_note``,
    ``target_edit``, ``foil_edit``, ``model_cache``, ``image``, ``_run_request``,
    ``run_readout`` and ``show_error``.

    Attributes:
        answer_tokens: the answer shown as tokens (:class:`app.components.workspace.AnswerTokens`), or None.
    """

    answer_tokens: AnswerTokens | None = None

    def _follow_answer_tokens_fields(self) -> None:
        """Connect the Answer tab's Generate and tokens, and the Target / foil note."""
        self.answer_panel.set_generate_budget(GENERATE_TOKENS)
        self.answer_panel.generate_requested.connect(self.generate_answer)
        self.answer_panel.token_chosen.connect(self.choose_answer_token)
        self.target_note.read_at_requested.connect(self.read_at_answer_token)
        self.target_edit.textChanged.connect(lambda _text: self._refresh_target_note())
        self.foil_edit.textChanged.connect(lambda _text: self._refresh_target_note())
        self.idle.connect(self._refresh_target_note)  # a model loaded by the job can now tokenize the fields

    def generate_answer(self, max_new_tokens: int | None = None) -> bool:
        """Generate the model's answer to the shown image and question in the background and
        show it as clickable tokens (recorded in the session); False if not started."""
        if self.is_busy() or not self._has_image():
            return False
        budget = int(max_new_tokens or self.answer_panel.max_tokens.value())
        question, asked = self.question_edit.text().strip(), self.workspace.input
        caption = self._caption(question)
        request = GenerateRequest(
            image=self.image, image_path=asked.image_path, question=question, max_new_tokens=budget
        )

        def show(generation, run_id: int | None) -> None:
            # the token chosen stays chosen when this answer holds it (the same tokens); else none is
            chosen = asked.answer_text
            kept = chosen if chosen is not None and chosen.token_ids == tuple(generation.token_ids) else None
            if kept is None:
                self._forget_answer_token()
            made_for = self._made_for(dataclasses.replace(asked, answer_text=kept))
            tokens = AnswerTokens.of_generation(generation, made_for)
            self._set_answer_tokens(tokens)
            self.answer_panel.show_generated(tokens, caption)
            if not tokens.token_ids:
                self.show_error(f"the model generated no token (stopped: {tokens.stop_reason})")
            self.workspace.show_run(ShownRun(run_id, "generate", made_for, {"generate": generation}))

        self._run_request(request, show, clear=True)
        return True

    def choose_answer_token(self, index: int) -> bool:
        """Make token ``index`` of the shown answer the answer token of every panel and read
        out at it (the prompt and the answer's tokens before it are the input); False if not started."""
        tokens = self.answer_tokens
        if tokens is None or not tokens.answers(self.workspace.input):
            self.show_error("no answer of this image, question and model is shown: Generate first")
            return False
        if self.is_busy():
            self.answer_panel.set_chosen(self._chosen_index())
            return False
        try:
            answer_text = tokens.at(int(index))
        except core.QuestionError as e:
            self.show_error(str(e))
            return False
        self.workspace.set_input(answer_text=answer_text)  # every view drawn for another token turns stale
        self.answer_panel.set_chosen(answer_text.index)
        self._refresh_target_note()
        return self.run_readout()

    def read_at_answer_token(self, index: int) -> bool:
        """Read at answer token ``index`` (where the typed Target word starts in the answer) instead
        of the word's first sub-token at the current position: the Target field is emptied, so the
        target is that answer token itself."""
        typed = self.target_edit.text().strip()
        self.target_edit.clear()
        started = self.choose_answer_token(index)
        if started:
            self.statusBar().showMessage(f"reading {typed!r} where it starts in the answer")
        return started

    def _forget_answer_token(self) -> None:
        """No answer token is chosen any more: the next read-out is at the first token after the bare prompt."""
        self.workspace.set_input(answer_text=None)
        self.answer_panel.set_chosen(None)

    def _chosen_index(self) -> int | None:
        answer_text = self.workspace.input.answer_text
        return answer_text.index if answer_text is not None else None

    def _set_answer_tokens(self, tokens: AnswerTokens | None) -> None:
        """Show ``tokens`` as the answer's clickable tokens (None: none), the chosen one highlighted."""
        self.answer_tokens = tokens
        answer_text = self.workspace.input.answer_text
        chosen = answer_text.index if tokens is not None and tokens.holds(answer_text) else None
        usable = tokens is not None and tokens.answers(self.workspace.input)
        self.answer_panel.show_tokens(tokens, chosen, usable=usable)
        self._refresh_target_note()

    def _follow_answer_tokens(self) -> None:
        """The image, question or model changed: the shown tokens answer another input (shown, not
        clickable), and a token chosen of them is no longer the answer token read."""
        tokens = self.answer_tokens
        usable = tokens is not None and tokens.answers(self.workspace.input)
        self.answer_panel.set_usable(usable)
        if not usable and self.workspace.input.answer_text is not None:
            self._forget_answer_token()
        self._refresh_target_note()

    def _show_answer_token_of(self, run: ShownRun) -> None:
        """A read-out is shown: its answer tokens (the chosen one highlighted), the Answer tab's line
        for the token read, and the answer tokens' attention."""
        analysis = run.results["analyze"]
        self.answer_panel.patterns.set_result(analysis)
        answer_text = run.input.answer_text
        if answer_text is None:
            if self.answer_tokens is not None:
                self.answer_panel.set_chosen(None)
            return
        if self.answer_tokens is None or not (
            self.answer_tokens.holds(answer_text) and self.answer_tokens.answers(run.input)
        ):
            self._set_answer_tokens(self._answer_tokens_of(run.input, answer_text))
        else:
            self.answer_panel.set_chosen(answer_text.index)
        self.answer_panel.show_answer_token(
            analysis.target, analysis.top, answer_text, self.answer_panel.caption.text()
        )

    def _refresh_target_note(self) -> None:
        """The one-line note on a typed Target / foil of several tokens (with the offer to read at
        the answer token where the word starts), or a typed token the model does not have."""
        loaded = self.loaded_model()
        if loaded is None:
            self.target_note.show_note("")  # said once the model is loaded (after the next job)
            return
        notes, read_at = [], None
        for role, field in (("target", self.target_edit), ("foil", self.foil_edit)):
            try:
                typed = typed_token(loaded.adapter, field.text())
            except core.QuestionError as e:
                notes.append(f"{role}: {e}")
                continue
            if typed is None or not typed.spans_several:
                continue
            notes.append(f"{role}: {typed.note()}")
            tokens = self.answer_tokens
            if role == "target" and tokens is not None and tokens.answers(self.workspace.input):
                start = tokens.find(typed.tokens)
                if start is not None and start != self._chosen_index():
                    read_at = (start, answer_token_label(tokens.at(start)))
        self.target_note.show_note("; ".join(notes), read_at)
