"""The workspace: what the window is asked about now, and the run its views show.

A Qt-free model in the manner of napari's ``ViewerModel``: the main window
writes the current input into it (image, question, model, target tokens) and
the runs it shows; every read-out view subscribes to its :attr:`Workspace.events`
and says which run it was drawn for, or that it is stale (see
:mod:`app.components.run_view`). The session's runs (``set_runs``) are the
history a view can list and restore.

A run is the unit: one :class:`RunInput` (what was asked) and the results it
produced, keyed by run kind ("answer", "generate", "analyze", "counterfactual",
"sweep", "intervention", "nonunique", "qk-ov"), each typed: the method's
:class:`core.results.readout.Readout` (a result made now, or a stored run restored by
:func:`core.results.readout.restore_result`), and the :class:`core.answer.Answer` of an
answer. JSON is what the session stores, not what the views draw.

A run may read out at one token of an answer (:class:`core.answer_text.AnswerText`,
``RunInput.answer_text``): choosing another token is another input, so every
view drawn for the previous token turns stale. :class:`AnswerTokens` is the
answer the window shows as clickable tokens, and the input it answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.components.events import Event
from app.components.model_choice import CPU, ModelChoice
from core.answer_text import AnswerText
from core.results.readout import Readout

if TYPE_CHECKING:
    from core.analyze import AnalyzeResult

QUESTION_CHARS = 40  # a question longer than this is shortened in headers

# RunInput fields that decide whether a view still shows the current input, and how a difference is named
COMPARED_FIELDS = {
    "image_sha256": "image",
    "question": "question",
    "model_spec": "model",
    "model_dtype": "dtype",
    "model_device": "device",
    "answer_text": "answer token",
    "answer": "target",
    "foil": "foil",
}
# what is asked about: an answer (generated, or its tokens chosen) belongs to one image, question and model
# (in one dtype, on one device: a bfloat16 model's answer need not be float32's)
ASKED_FIELDS = ("image_sha256", "question", "model_spec", "model_dtype", "model_device")


def short_question(question: str, limit: int = QUESTION_CHARS) -> str:
    """``question`` quoted, shortened to about ``limit`` characters (keeping a final ``?``)."""
    question = " ".join(question.split())
    if len(question) > limit:
        end = question[-1] if question[-1] in "?.!" else ""
        question = question[: limit - 1 - len(end)].rstrip() + "…" + end
    return f"'{question}'"


def short_model(spec: str) -> str:
    """A model spec for a header: a folder's name for an absolute path, else the spec as typed."""
    if not spec:
        return "no model"
    if Path(spec).is_absolute():
        return Path(spec).name or spec
    return spec


def as_run(asked: str, used: str | None) -> str:
    """A dtype or device for a header: the one the model ran in once known, marked ``(auto)``
    when the loader chose it (``float32 (auto)``); the one asked for before."""
    if not used:
        return asked
    return f"{used} (auto)" if asked == "auto" and used != "auto" else used


def answer_token_label(answer_text: AnswerText) -> str:
    """``answer token 2 'square'``: which token of the answer a run reads out (0 = the first)."""
    return f"answer token {answer_text.index} {answer_text.token!r}"


@dataclass(frozen=True)
class RunInput:
    """What one run asks: the image (pixels' SHA-256 as :func:`core.files.images.image_sha256`,
    and the path as given, None for pasted or dropped bytes), the question, the model
    (spec as typed, the dtype and device picked, and once loaded its fingerprint and the
    dtype and device it runs in: ``loaded_dtype`` float32 for "auto" on the CPU), the answer token read out
    (``answer_text``: token ``index`` of an answer, read after the prompt and the
    answer's tokens before it; None: the first token after the bare prompt), and the
    answer and foil tokens the user asked for (None: the model's top token, or the
    answer token read out, / no foil)."""

    image_sha256: str | None = None
    image_path: str | None = None
    question: str = ""
    model_spec: str = ""
    model_fingerprint: str | None = None
    model_dtype: str = "auto"
    model_device: str = CPU
    loaded_dtype: str | None = None
    loaded_device: str | None = None
    answer_text: AnswerText | None = None
    answer: str | None = None
    foil: str | None = None

    def image_name(self) -> str:
        """The image's file name, or a short hash for pixels without a path."""
        if self.image_path:
            return Path(self.image_path).name
        if self.image_sha256:
            return f"image {self.image_sha256[:8]}"
        return "no image"

    def model_choice(self) -> ModelChoice:
        """The model asked for: spec, dtype, device (the model cache's key)."""
        return ModelChoice(self.model_spec, self.model_dtype, self.model_device)

    def model_label(self) -> str:
        """``shapes-llava · bfloat16 · cpu``: the model, the dtype and the device (as run, once loaded)."""
        dtype, device = as_run(self.model_dtype, self.loaded_dtype), as_run(self.model_device, self.loaded_device)
        return f"{short_model(self.model_spec)} · {dtype} · {device}"

    def describe(self) -> str:
        """One line: question, image, model with its dtype and device (and the answer token
        read out, the target tokens when the user chose them)."""
        return " · ".join([short_question(self.question), self.image_name(), self.model_label(), *self.token_parts()])

    def token_parts(self) -> list[str]:
        """The parts of :meth:`describe` that name the tokens read: the answer token read out and
        the target tokens the user chose (a narrow header keeps them whole, eliding the rest)."""
        parts = []
        if self.answer_text is not None:
            parts.append(answer_token_label(self.answer_text))
        if self.answer:
            parts.append(f"target {self.answer!r}" + (f" vs {self.foil!r}" if self.foil else ""))
        elif self.foil:
            parts.append(f"foil {self.foil!r}")
        return parts

    def key(self) -> tuple:
        """What two inputs must share for a run drawn for one to show the other."""
        return tuple(getattr(self, name) for name in COMPARED_FIELDS)

    def differences(self, other: RunInput) -> list[str]:
        """The names (image, question, model, dtype, device, answer token, target, foil) of what
        differs from ``other``."""
        return [label for name, label in COMPARED_FIELDS.items() if getattr(self, name) != getattr(other, name)]

    def asked(self) -> tuple:
        """What an answer to this input belongs to: the image pixels, the question and the model (dtype, device)."""
        return tuple(getattr(self, name) for name in ASKED_FIELDS)

    def fields(self) -> dict:
        """Every field by name (not :func:`dataclasses.asdict`, which would turn ``answer_text`` into a dict)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class AnswerTokens:
    """An answer shown as clickable tokens: generated (each token's probability and why
    generation stopped) or read back from a run's input (``probs`` and ``stop_reason``
    None when not known), and the input it answers (``made_for``)."""

    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    made_for: RunInput
    probs: tuple[float, ...] | None = None
    stop_reason: str | None = None
    top: tuple[tuple[tuple[str, float], ...], ...] | None = None  # per token, the alternatives at its step

    @classmethod
    def of_generation(cls, generation, made_for: RunInput) -> AnswerTokens:
        """The tokens of a :class:`core.generate.Generation` (or anything with its fields)."""
        return cls(
            generation.text,
            tuple(int(i) for i in generation.token_ids),
            tuple(generation.tokens),
            made_for,
            tuple(float(p) for p in generation.probs),
            generation.stop_reason,
            tuple(tuple((str(t), float(p)) for t, p in step) for step in generation.top),
        )

    @classmethod
    def of_answer_text(cls, answer_text: AnswerText, made_for: RunInput, probs=None, stop_reason=None) -> AnswerTokens:
        return cls(
            answer_text.text,
            answer_text.token_ids,
            answer_text.tokens,
            made_for,
            None if probs is None else tuple(float(p) for p in probs),
            stop_reason,
        )

    def at(self, index: int) -> AnswerText:
        """Token ``index`` of this answer, as a read-out's target (QuestionError outside it)."""
        return AnswerText(self.text, self.token_ids, self.tokens, index)

    def answers(self, input: RunInput) -> bool:
        """Whether this is an answer to ``input`` (same image pixels, question and model)."""
        return self.made_for.asked() == input.asked()

    def holds(self, answer_text: AnswerText | None) -> bool:
        """Whether ``answer_text`` is a token of this answer."""
        return answer_text is not None and answer_text.token_ids == self.token_ids

    def find(self, tokens: tuple[str, ...] | list[str]) -> int | None:
        """The first index where ``tokens`` (token strings, as :meth:`Adapter.token_str`
        writes them) stand in this answer in a row, or None."""
        tokens = tuple(tokens)
        if not tokens:
            return None
        starts = range(len(self.tokens) - len(tokens) + 1)
        return next((i for i in starts if self.tokens[i : i + len(tokens)] == tokens), None)


@dataclass
class ShownRun:
    """One run as the window shows it: its input and every result of it, ``{kind: result}`` (a
    :class:`core.results.readout.Readout`; an answer's :class:`core.answer.Answer`).

    ``run_id`` is the session's id of the run that made it (None: not recorded, as an
    Answer); ``run_ids`` the id of each follow-up result's own run by kind.
    """

    run_id: int | None
    kind: str
    input: RunInput
    results: dict[str, Readout] = field(default_factory=dict)
    run_ids: dict[str, int | None] = field(default_factory=dict)

    @property
    def analysis(self) -> AnalyzeResult | None:
        """The analyze result this run holds (what the read-out views show), or None."""
        return self.results.get("analyze")

    def id_of(self, kind: str | None = None) -> int | None:
        """The session's id of the run that made ``kind``'s result (default: this run's)."""
        kind = kind or self.kind
        return self.run_ids.get(kind, self.run_id) if kind != self.kind else self.run_id

    def header(self, kind: str | None = None) -> str:
        """``run #4 · analyze · 'what shape…?' · sample_00.png · shapes-llava · float32 (auto) · cpu``
        (``kind``: a follow-up's)."""
        kind = kind or self.kind
        run_id = self.id_of(kind)
        named = f"run #{run_id}" if run_id is not None else "not recorded"
        return f"{named} · {kind} · {self.input.describe()}"


class WorkspaceEvents:
    """The workspace's events; each callback receives the payload named here as keywords.

    - ``input_changed(fields)``: the current input changed (``fields``: the RunInput names that did);
    - ``run_shown(run, kind)``: ``run`` is shown (``kind``: the result just shown, or the run's own
      kind); ``run`` None: nothing is shown any more, every view is cleared;
    - ``runs_changed(runs)``: the session's list of runs changed.
    """

    def __init__(self):
        self.input_changed = Event("input_changed")
        self.run_shown = Event("run_shown")
        self.runs_changed = Event("runs_changed")


class Workspace:
    """The current input, the run shown for it, and the session's runs (no Qt).

    Attributes:
        input: what the window's fields say now (:class:`RunInput`).
        shown: the run the views were last filled from, or None.
        runs: the session's runs (:class:`core.session.RunInfo`), oldest first.
        events: :class:`WorkspaceEvents`.
    """

    def __init__(self, input: RunInput | None = None):
        self.input = input or RunInput()
        self.shown: ShownRun | None = None
        self.runs: list = []
        self.events = WorkspaceEvents()

    def set_input(self, **changes) -> bool:
        """Change fields of :attr:`input` (``""`` answer / foil: none asked); emits
        ``input_changed(fields=...)`` only when something changed. True if it did."""
        for name in ("answer", "foil", "answer_text"):
            if name in changes and not changes[name]:
                changes[name] = None
        new = dataclasses.replace(self.input, **changes)
        changed = tuple(
            f.name for f in dataclasses.fields(RunInput) if getattr(new, f.name) != getattr(self.input, f.name)
        )
        if not changed:
            return False
        self.input = new
        self.events.input_changed.emit(fields=changed)
        return True

    def show_run(self, run: ShownRun) -> None:
        """Show ``run`` (a read-out just made, or a run restored from the session)."""
        self.shown = run
        self.events.run_shown.emit(run=run, kind=run.kind)

    def add_result(
        self, kind: str, result: Readout, run_id: int | None = None, input: RunInput | None = None
    ) -> ShownRun:
        """A follow-up result (a counterfactual, a sweep, an intervention, an answer) of ``input``
        (default: the current input; a job passes the input it was started with).

        Added to the shown run when that run is of the same input; else it starts a new shown
        run of its own. Emits ``run_shown`` either way; returns the shown run.
        """
        input = self.input if input is None else input
        if self.shown is not None and self.shown.input.key() == input.key():
            self.shown.results[kind] = result
            if kind == self.shown.kind:
                self.shown.run_id = run_id
            else:
                self.shown.run_ids[kind] = run_id
        else:
            self.shown = ShownRun(run_id, kind, input, {kind: result})
        self.events.run_shown.emit(run=self.shown, kind=kind)
        return self.shown

    def clear_shown(self) -> None:
        """Nothing is shown any more (a new image): every view clears."""
        self.shown = None
        self.events.run_shown.emit(run=None, kind=None)

    def set_runs(self, infos) -> None:
        """The session's runs changed (recorded, or another session opened)."""
        self.runs = list(infos)
        self.events.runs_changed.emit(runs=self.runs)

    def is_current(self, run: ShownRun | None = None) -> bool:
        """Whether ``run`` (default: the shown run) was made for the current input:
        same image pixels, question, model spec, dtype and device, answer token read out, answer and foil tokens."""
        run = self.shown if run is None else run
        return run is not None and run.input.key() == self.input.key()

    def stale_note(self, run: ShownRun) -> str:
        """``stale: drawn for <run's input>; the input is now <current input>`` (naming what changed)."""
        return f"{self.stale_lead(run)}: drawn for {run.input.describe()}; the input is now {self.input.describe()}"

    def stale_lead(self, run: ShownRun) -> str:
        """``stale (question changed)``: how :meth:`stale_note` starts."""
        changed = run.input.differences(self.input)
        return "stale" + (f" ({', '.join(changed)} changed)" if changed else "")
