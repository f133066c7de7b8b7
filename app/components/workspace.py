"""The workspace: what the window is asked about now, and the run its views show.

A Qt-free model in the manner of napari's ``ViewerModel``: the main window
writes the current input into it (image, question, model, target tokens) and
the runs it shows; every read-out view subscribes to its :attr:`Workspace.events`
and says which run it was drawn for, or that it is stale (see
:mod:`app.components.run_view`). The session's runs (``set_runs``) are the
history a view can list and restore.

A run is the unit: one :class:`RunInput` (what was asked) and the results it
produced, each in the engine's result vocabulary (the JSON a
:class:`core.readout.Readout` writes, ``to_dict()``), keyed by run kind
("answer", "analyze", "counterfactual", "sweep", "intervention").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from app.components.events import Event

QUESTION_CHARS = 40  # a question longer than this is shortened in headers

# RunInput fields that decide whether a view still shows the current input, and how a difference is named
COMPARED_FIELDS = {
    "image_sha256": "image",
    "question": "question",
    "model_spec": "model",
    "answer": "target",
    "foil": "foil",
}


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


@dataclass(frozen=True)
class RunInput:
    """What one run asks: the image (pixels' SHA-256 as :func:`core.images.image_sha256`,
    and the path as given, None for pasted or dropped bytes), the question, the model
    (spec as typed and, once loaded, its fingerprint), and the answer and foil tokens
    the user asked for (None: the model's top token / no foil)."""

    image_sha256: str | None = None
    image_path: str | None = None
    question: str = ""
    model_spec: str = ""
    model_fingerprint: str | None = None
    answer: str | None = None
    foil: str | None = None

    def image_name(self) -> str:
        """The image's file name, or a short hash for pixels without a path."""
        if self.image_path:
            return Path(self.image_path).name
        if self.image_sha256:
            return f"image {self.image_sha256[:8]}"
        return "no image"

    def describe(self) -> str:
        """One line: question, image, model (and the target tokens when the user chose them)."""
        parts = [short_question(self.question), self.image_name(), short_model(self.model_spec)]
        if self.answer:
            parts.append(f"target {self.answer!r}" + (f" vs {self.foil!r}" if self.foil else ""))
        elif self.foil:
            parts.append(f"foil {self.foil!r}")
        return " · ".join(parts)

    def key(self) -> tuple:
        """What two inputs must share for a run drawn for one to show the other."""
        return tuple(getattr(self, name) for name in COMPARED_FIELDS)

    def differences(self, other: RunInput) -> list[str]:
        """The names (image, question, model, target, foil) of what differs from ``other``."""
        return [label for name, label in COMPARED_FIELDS.items() if getattr(self, name) != getattr(other, name)]


@dataclass
class ShownRun:
    """One run as the window shows it: its input and every result of it, ``{kind: JSON result}``.

    ``run_id`` is the session's id of the run that made it (None: not recorded, as an
    Answer); ``run_ids`` the id of each follow-up result's own run by kind.
    """

    run_id: int | None
    kind: str
    input: RunInput
    results: dict[str, dict] = field(default_factory=dict)
    run_ids: dict[str, int | None] = field(default_factory=dict)

    def id_of(self, kind: str | None = None) -> int | None:
        """The session's id of the run that made ``kind``'s result (default: this run's)."""
        kind = kind or self.kind
        return self.run_ids.get(kind, self.run_id) if kind != self.kind else self.run_id

    def header(self, kind: str | None = None) -> str:
        """``run #4 · analyze · 'what shape…?' · sample_00.png · shapes-llava`` (``kind``: a follow-up's)."""
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
        for name in ("answer", "foil"):
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

    def add_result(self, kind: str, result: dict, run_id: int | None = None, input: RunInput | None = None) -> ShownRun:
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
        same image pixels, question, model spec, answer and foil tokens."""
        run = self.shown if run is None else run
        return run is not None and run.input.key() == self.input.key()

    def stale_note(self, run: ShownRun) -> str:
        """``stale: drawn for <run's input>; the input is now <current input>`` (naming what changed)."""
        changed = run.input.differences(self.input)
        what = f" ({', '.join(changed)} changed)" if changed else ""
        return f"stale{what}: drawn for {run.input.describe()}; the input is now {self.input.describe()}"
