"""The Answer tab's tokens: Generate, the answer shown as clickable tokens, a
token clicked as the answer token every panel reads (``RunInput.answer_text``;
the read-out re-runs at it), and the one-line note when a typed Target or foil
is several tokens for the model.

A component of the window (not a mixin): it holds the answer shown as tokens
and follows the workspace; a generation goes through the window's one run path
(:class:`app.runner.Runner`) and its tokens are drawn when it is shown.
"""

from __future__ import annotations

import dataclasses

import core
from app.components.workspace import ASKED_FIELDS, AnswerTokens, ShownRun, answer_token_label
from app.input_bar import TARGET_PLACEHOLDER
from app.jobs import GENERATE_TOKENS
from core.answer_text import typed_token


class AnswerTokensChooser:
    """Uses of the window (its host): ``workspace``, ``inputs`` (the Target / foil fields, their
    note, the error line), ``answer_panel``, ``runner``, ``actions`` (to read out), ``loaded_model()``,
    and ``statusBar()``.

    Attributes:
        tokens: the answer shown as tokens (:class:`app.components.workspace.AnswerTokens`), or None.
    """

    def __init__(self, window):
        self.window = window
        self.tokens: AnswerTokens | None = None
        inputs, panel = window.inputs, window.answer_panel
        panel.set_generate_budget(GENERATE_TOKENS)
        panel.token_chosen.connect(self.choose)
        inputs.target_note.read_at_requested.connect(self.read_at)
        inputs.target_edit.textChanged.connect(lambda _text: self.refresh_note())
        inputs.foil_edit.textChanged.connect(lambda _text: self.refresh_note())
        window.workspace.events.input_changed.connect(self._on_input_changed)
        window.workspace.events.run_shown.connect(self._on_run_shown)

    @property
    def workspace(self):
        return self.window.workspace

    def choose(self, index: int) -> bool:
        """Make token ``index`` of the shown answer the answer token of every panel and read
        out at it (the prompt and the answer's tokens before it are the input); False if not started."""
        window = self.window
        if self.tokens is None or not self.tokens.answers(self.workspace.input):
            window.show_error("no answer of this image, question and model is shown: Generate first")
            return False
        if window.runner.is_busy():
            window.answer_panel.set_chosen(self.chosen_index())
            return False
        try:
            answer_text = self.tokens.at(int(index))
        except core.QuestionError as e:
            window.show_error(str(e))
            return False
        self.workspace.set_input(answer_text=answer_text)  # every view drawn for another token turns stale
        window.answer_panel.set_chosen(answer_text.index)
        self.refresh_note()
        return window.actions.run_readout()

    def read_at(self, index: int) -> bool:
        """Read at answer token ``index`` (where the typed Target word starts in the answer) instead
        of the word's first sub-token at the current position: the Target field is emptied, so the
        target is that answer token itself."""
        target = self.window.inputs.target_edit
        typed = target.text().strip()
        target.clear()
        started = self.choose(index)
        if started:
            self.window.statusBar().showMessage(f"reading {typed!r} where it starts in the answer")
        return started

    def forget_choice(self) -> None:
        """No answer token is chosen any more: the next read-out is at the first token after the bare prompt."""
        self.workspace.set_input(answer_text=None)
        self.window.answer_panel.set_chosen(None)

    def chosen_index(self) -> int | None:
        answer_text = self.workspace.input.answer_text
        return answer_text.index if answer_text is not None else None

    def set_tokens(self, tokens: AnswerTokens | None) -> None:
        """Show ``tokens`` as the answer's clickable tokens (None: none), the chosen one highlighted."""
        self.tokens = tokens
        answer_text = self.workspace.input.answer_text
        chosen = answer_text.index if tokens is not None and tokens.holds(answer_text) else None
        usable = tokens is not None and tokens.answers(self.workspace.input)
        self.window.answer_panel.show_tokens(tokens, chosen, usable=usable)
        self.refresh_note()

    def _on_input_changed(self, fields: tuple) -> None:
        """The image, question or model changed: the shown tokens answer another input (shown, not
        clickable), and a token chosen of them is no longer the answer token read."""
        if not set(ASKED_FIELDS).intersection(fields):
            return
        self.window.inputs.target_edit.setPlaceholderText(TARGET_PLACEHOLDER)  # "now: square" was the shown run's
        usable = self.tokens is not None and self.tokens.answers(self.workspace.input)
        self.window.answer_panel.set_usable(usable)
        if not usable and self.workspace.input.answer_text is not None:
            self.forget_choice()
        self.refresh_note()

    def _on_run_shown(self, run: ShownRun | None, kind: str | None) -> None:
        """A generation shown: its tokens; a read-out shown: the tokens of the answer it read at
        (the chosen one highlighted), and the Target field's placeholder names its answer."""
        if run is None:
            self.set_tokens(None)
            return
        if kind == "generate":
            self.set_tokens(AnswerTokens.of_generation(run.results["generate"], run.input))
            return
        analysis = run.analysis
        if analysis is None:
            return
        if not self.window.inputs.target_edit.text().strip():
            answer = analysis.target.answer
            self.window.inputs.target_edit.setPlaceholderText(f"answer token (now: {answer}, the model's top token)")
        answer_text = run.input.answer_text
        if answer_text is None:
            if self.tokens is not None:
                self.window.answer_panel.set_chosen(None)
            return
        if self.tokens is None or not (self.tokens.holds(answer_text) and self.tokens.answers(run.input)):
            self.set_tokens(self.window.sessions.answer_tokens_of(run.input, answer_text))
        else:
            self.window.answer_panel.set_chosen(answer_text.index)

    def kept_choice(self, asked, generation):
        """The input a generation answers: ``asked`` keeping its chosen token when this answer holds
        it (the same tokens); else no token is chosen any more."""
        chosen = asked.answer_text
        kept = chosen if chosen is not None and chosen.token_ids == tuple(generation.token_ids) else None
        if kept is None:
            self.forget_choice()
        return dataclasses.replace(asked, answer_text=kept)

    def refresh_note(self) -> None:
        """The one-line note on a typed Target / foil of several tokens (with the offer to read at
        the answer token where the word starts), or a typed token the model does not have."""
        inputs, loaded = self.window.inputs, self.window.loaded_model()
        if loaded is None:
            inputs.target_note.show_note("")  # said once the model is loaded (after the next job)
            return
        notes, read_at = [], None
        for role, field in (("target", inputs.target_edit), ("foil", inputs.foil_edit)):
            try:
                typed = typed_token(loaded.adapter, field.text())
            except core.QuestionError as e:
                notes.append(f"{role}: {e}")
                continue
            if typed is None or not typed.spans_several:
                continue
            notes.append(f"{role}: {typed.note()}")
            tokens = self.tokens
            if role == "target" and tokens is not None and tokens.answers(self.workspace.input):
                start = tokens.find(typed.tokens)
                if start is not None and start != self.chosen_index():
                    read_at = (start, answer_token_label(tokens.at(start)))
        inputs.target_note.show_note("; ".join(notes), read_at)
