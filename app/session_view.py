"""The window's session: which file it records into, the audit table and the
run history that follow the session's events, restoring a recorded run,
opening (to continue, or read-only), saving a copy, exporting; all held by
:class:`SessionController`, a component of the window (not a mixin).

The session is the model and the audit and history panels are views of it:
every :meth:`core.session.Session.record` fires
:meth:`~core.session.Session.on_recorded` (in the recording thread),
:class:`SessionWatch` brings that to the GUI thread as a Qt signal, and the
controller refreshes both tables there. Nothing refreshes them by hand after a record.

Recording: the window's one run path (:class:`app.runner.Runner`) records each
request's result through :meth:`SessionController.record_request`, as the CLI
records the same request (its parameters, its document, its image and mask).

A run is restored from what the session stored (:meth:`SessionController.restore_run`),
read before anything on screen changes: the image (its file when that still holds the
same pixels, else the stored pixels), the question, the model (in the dtype and on the
device it ran in), the answer token read out, the target fields (as typed), the result
restored as its class (``Run.readout``: the one conversion of stored JSON,
:func:`core.results.readout.restore_result`) and what its request was asked, typed
(:class:`core.requests.RecordedParameters`: the one reader of stored parameters). The
inputs are set, then ``workspace.show_run`` shows the run and every view draws itself
from it (:class:`app.run_frame.RunFrame`), as it drew the run when it was made; then the
controls its request was made from (fill, painted region, sweep k, the Interventions
box's choices and the component selected, the token budget, a claim's fields) are set,
so pressing its button again runs the run shown. What the run did not store is said in red.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QFileDialog, QMessageBox

import core
from app.components import ModelChoice
from app.components.workspace import AnswerTokens, RunInput, ShownRun, answer_token_label
from app.jobs import answer_of, as_run, model_load_job
from app.panels.history_panel import THUMBNAIL_PX, HistoryRow
from app.run_frame import VIEW_KINDS
from app.widgets import ElidedLabel
from core.answer_text import AnswerText
from core.files.images import image_sha256
from core.methods.validation.spec import SHIPPED
from core.requests import RecordedParameters
from core.results.readout import Readout, Target
from core.session import DamagedRunError, Run, RunInfo, Session, SessionError
from core.shell.precision import DTYPE_CHOICES

if TYPE_CHECKING:
    from core.analyze import AnalyzeResult

SESSION_FILTER = "VLM Readout sessions (*.vlmr *.sqlite *.db);;All files (*)"
OPEN_MODES = ("append", "read_only")  # continue the file; or read it and record into a temporary copy
READ_ONLY_NOTE = "read-only; new runs are not saved into it"
# the Attention tab's actions on the selected head
HEAD_METHOD_KINDS = ("nonunique", "qk-ov")
# the follow-up kinds shown beside the read-out of their input (other kinds restore their input only)
PANEL_KINDS = ("analyze", "counterfactual", "sweep", "intervention", *HEAD_METHOD_KINDS)
EDITED_KINDS = ("counterfactual", "sweep", "intervention")  # an original run and an edited one
CLAIM_KINDS = ("validate",)  # checked on a model and a dataset, not on the shown input: the Validation tab shows them
SELECTING_VIEWS = ("attention", "dla", "lens")  # the views an ablated component can have been selected in
# what restoring a run's result into the views and controls can raise on a stored value it cannot use
DRAW_ERRORS = (KeyError, TypeError, ValueError, IndexError)


def default_session_path() -> Path:
    """A new session file under the user's data folder (one per window)."""
    folder = Path.home() / ".local" / "share" / "vlm-readout" / "sessions"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / time.strftime("session-%Y%m%d-%H%M%S.vlmr")


def open_start_session(path: str | Path | None) -> tuple[Session, str | None]:
    """The session a window starts with, and a line saying so when it is not
    the one asked for: the file ``path`` (opened, or created if missing); if
    that cannot be used (not a session, a folder, an unwritable place), a new
    file in the user's data folder; if none can be made there, a session in
    memory that is not saved. Nothing is created elsewhere without saying so."""
    problem = None
    if path is not None:
        try:
            return Session.open_or_create(path), None
        except (core.ReadoutError, OSError) as e:
            problem = f"cannot use the session {path}: {e}"
    try:
        fallback = default_session_path()
        session = Session.open_or_create(fallback)
    except (core.ReadoutError, OSError) as e:
        problem = problem or f"cannot create a session file in the user's data folder: {e}"
        return Session.temporary(), f"{problem}; recording into a temporary session that is not saved"
    return session, f"{problem}; recording into a new session {fallback} instead" if problem else None


class SessionWatch(QObject):
    """Forwards one session's recorded runs as :attr:`recorded` (a
    :class:`core.session.RunInfo`), delivered on the GUI thread.

    Create it on the GUI thread: a signal emitted from a worker's thread is
    queued to the receivers there; one emitted on the GUI thread is delivered
    at once (so the table is current when ``record`` returns).
    """

    recorded = Signal(object)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._unsubscribe = None

    def watch(self, session: Session) -> None:
        """Follow ``session`` (and stop following the previous one)."""
        self.stop()
        self._unsubscribe = session.on_recorded(self._forward)

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _forward(self, info: RunInfo) -> None:
        self.recorded.emit(info)


# ---------------------------------------------------------------- what a stored run holds


def readout_of(run: Run) -> Readout | None:
    """The run's result as its class (:attr:`core.session.Run.readout`); None when its stored JSON
    does not restore (a result of another shape or version: a restore says why)."""
    try:
        return run.readout
    except DamagedRunError:
        return None


def recorded_of(run: Run) -> RecordedParameters:
    """What the run's request was asked, typed (:class:`core.requests.RecordedParameters`)."""
    return RecordedParameters.from_parameters(run.parameters)


def unedited_target(kind: str, readout: Readout | None) -> Target | None:
    """The :class:`core.results.readout.Target` of the run before any edit: analyze's ``target``, a
    counterfactual's, sweep's or intervention's ``original``; None for other kinds (or no result)."""
    if readout is None:
        return None
    if kind == "analyze":
        return readout.target
    return readout.original if kind in EDITED_KINDS else None


def history_answer(kind: str, readout: Readout | None) -> str:
    """A history row's answer: the prediction (with its probability and the answer token read
    for analyze; before -> after for an edited run)."""
    if readout is None:
        return ""
    if kind == "analyze":
        answer_text = readout.answer_text
        at = f" at {answer_token_label(answer_text)}" if answer_text is not None else ""
        return f"{readout.top[0][0]} (p {float(readout.top[0][1]):.3f}){at}" if readout.top else ""
    if kind == "counterfactual":
        before, after = readout.original, readout.edited
    elif kind == "intervention":  # an ablation's first edit set, or a visual patch's forward direction
        found = readout.first_effect()
        before, after = (found[1].original, found[1].edited) if found else (None, None)
    else:
        before, after = unedited_target(kind, readout), None
    if before is None:
        return ""
    return before.predicted + (f" → {after.predicted}" if after is not None else "")


def question_of(run: Run) -> str:
    """The run's question: the parameters the app and the CLI record, else the analyze input's."""
    question = recorded_of(run).question
    if question is None and run.kind == "analyze":
        analysis = readout_of(run)
        question = analysis.input.question if analysis is not None else None
    return question or ""


def answer_text_of(run: Run) -> AnswerText | None:
    """The answer token the run read out: an analyze run's ``input`` records it, a follow-up the
    app recorded names it in its parameters (:meth:`core.requests.base.AskedRequest.asked_parameters`);
    None: the first token after the bare prompt."""
    if run.kind == "analyze":
        analysis = readout_of(run)
        return analysis.answer_text if analysis is not None else None
    return recorded_of(run).answer_text


def uses_painted_region(run: Run) -> bool:
    """Whether the run's request read the painted region: a counterfactual, an ablation at the
    painted region, a patch of the region's tokens, any run recorded with a mask."""
    recorded = recorded_of(run)
    return (
        run.mask_id is not None
        or run.kind == "counterfactual"
        or (run.kind == "intervention" and recorded.positions == "region")
        or "painted region" in recorded.token_sets
    )


def restore_claim_choices(panel, run: Run, validation) -> str | None:
    """Put a ``validate`` run's choices back in the Validation panel (its request's parameters:
    :meth:`core.requests.ValidateRequest.parameters`; a run of an
    older session: its chains' subjects and its search set's size): subjects, claim, data, n, the
    painted-region box, the claim's specification. The painted region itself is not stored with the run: returns a line saying
    so when the run used one (None otherwise)."""
    recorded = recorded_of(run)
    panel.subject_edit.setText(recorded.typed_subjects or ", ".join(c.subject for c in validation.chains))
    panel.claim_edit.setText(validation.claim.text)
    source = recorded.dataset  # a file source's path; the generated scenes record none
    if source is None:
        panel.set_dataset("scenes")
    elif panel.bundled is not None and Path(source) == Path(panel.bundled):
        panel.set_dataset("bundled")
    else:
        panel.set_folder(source)
    panel.n_spin.setValue(recorded.n or validation.search.n_samples)
    panel.region_check.setChecked(recorded.painted_region)
    # the relation it checked: a shipped one by name, a user's as recorded with the run (its file may be gone)
    shipped = SHIPPED.get(validation.spec.name) == validation.spec
    panel.use_spec(validation.spec, None if shipped else f"run #{run.id}", "the specification recorded with the run")
    if recorded.painted_region:
        return (
            f"run #{run.id} used a painted region that is not stored with it: the region painted now is not the run's"
        )
    return None


def picked_dtype_and_device(ran_in: dict, shown: ModelChoice) -> tuple[str, str]:
    """The dtype and device the pickers take for a run that ran in ``ran_in`` (``{"dtype",
    "device"}``, as much as it records): its dtype when the picker offers it, its device
    (a model spread over several devices: "auto"); the ``shown`` ones where it records none."""
    dtype = ran_in.get("dtype") if ran_in.get("dtype") in DTYPE_CHOICES else shown.dtype
    device = ran_in.get("device") or shown.device
    return dtype, "auto" if "+" in device else device


def target_fields(run: Run, answer_text: AnswerText | None = None) -> tuple[str, str]:
    """What the Target and foil fields held for the run: as typed, where the app recorded them
    (:meth:`core.requests.base.AskedRequest.asked_parameters`); else (a run of an older session or
    an older command line) the answer token when it was not the one an empty field asks for (the
    answer token read, ``answer_text``, else the model's own top token), the foil when there was one.
    Either way a re-run reads the same numbers."""
    typed = recorded_of(run).typed_fields
    if typed is not None:
        return typed
    target = unedited_target(run.kind, readout_of(run))
    if target is None:
        return "", ""
    default = answer_text.token_id if answer_text is not None else target.predicted_id
    return ("" if target.answer_id == default else target.answer), target.foil or ""


@dataclasses.dataclass
class RestoredRun:
    """Everything a restore shows, read from the session before any widget changes."""

    run: Run
    image: object  # PIL image
    image_name: str
    image_path: str | None  # the file the pixels were read from, None for the stored pixels
    question: str
    spec: str  # the run's model spec (the shown one for a run recorded without a model)
    fingerprint: str | None
    dtype: str  # the dtype and device to pick: the run's (the shown ones for a run that records none)
    device: str
    ran_in: dict  # {"dtype", "device"} the run records (Run.dtype_and_device), {} for an older run
    answer: str
    foil: str
    answer_text: AnswerText | None = None  # the answer token read out (None: the first token, bare prompt)
    analysis: AnalyzeResult | None = None  # the run's own analyze result, or the latest of the same input
    analysis_id: int | None = None
    mask: np.ndarray | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def model(self) -> ModelChoice:
        return ModelChoice(self.spec, self.dtype, self.device)

    @property
    def recorded(self) -> RecordedParameters:
        return recorded_of(self.run)

    def input(self, sha: str) -> RunInput:
        return RunInput(
            image_sha256=sha,
            image_path=self.image_path,
            question=self.question,
            model_spec=self.spec,
            model_fingerprint=self.fingerprint,
            model_dtype=self.dtype,
            model_device=self.device,
            loaded_dtype=self.ran_in.get("dtype"),
            loaded_device=self.ran_in.get("device"),
            answer_text=self.answer_text,
            answer=self.answer or None,
            foil=self.foil or None,
        )


class SessionController(QObject):
    """The window's session (see the module docstring): the session recorded into, its
    :class:`SessionWatch`, the audit table and the history that follow it, recording, restoring a
    run, opening, saving as, exporting, the read-only copy and closing.

    It uses these of its ``window`` (the host), and nothing else:

    - ``workspace`` (the input set and the run shown), ``runner`` (``is_busy()``; ``start(...)``
      to load a restored run's model), ``model_cache`` and ``loaded_model()``;
    - ``inputs`` (:class:`app.input_bar.InputBar`: ``model_picker``, ``question_edit``,
      ``target_edit``, ``foil_edit``, ``set_model_choice``, ``model_choice``, ``model_spec``,
      ``show_error``), ``set_image(source, name) -> bool`` (which sets the workspace's image) and
      ``statusBar()``;
    - ``history_panel`` and ``audit_panel`` (the session's views: it fills them and follows their
      signals), and for a restored run's controls ``counterfactual_panel``,
      ``intervention_panel``, ``answer_panel``, ``validation_panel``, ``attention_panel``,
      ``dla_panel`` and ``selection``;
    - the window itself as the parent of its dialogs.

    Args:
        window: the host.
        session_path: the session file to record into (:func:`open_start_session`).

    Attributes:
        session: the :class:`core.session.Session` recorded into.
        watch: the :class:`SessionWatch` following it.
        label: the session line (which file the runs are saved in; red when it is not the one
            asked for); the window places it.
        problem: why the session is not the one asked for, or None (:func:`open_start_session`).
        read_only_source: the file opened read-only, when the session is its temporary copy.
    """

    def __init__(self, window, session_path: str | Path | None = None):
        super().__init__(window)
        self.window = window
        self.read_only_source: Path | None = None
        self._scratch_folder: Path | None = None  # where a read-only copy lives (removed with it)
        self._history_rows: dict[int, HistoryRow] = {}
        self._thumbnails: dict[str, np.ndarray | None] = {}
        self.label = ElidedLabel(selectable=True)
        self.watch = SessionWatch(self)
        self.watch.recorded.connect(self._on_run_recorded)
        window.history_panel.run_selected.connect(self.restore_run)
        window.audit_panel.export_requested.connect(self.export_audit)
        self.session, self.problem = open_start_session(session_path)
        self._use_session(self.session)
        self._show_session(self.problem)

    # ------------------------------------------------------------ the session in use

    def show_error(self, message: str) -> None:
        """The window's error line (while a job runs, an empty one leaves the status line as it is)."""
        self.window.inputs.show_error(message, busy=self.window.runner.is_busy())

    def _use_session(self, session: Session) -> None:
        """Record into ``session`` from now on; its audit table and history follow its events."""
        self.session = session
        self._history_rows = {}
        self._thumbnails = {}
        self.watch.watch(session)
        self._refresh_audit()
        self._refresh_history()

    def record(self, readout, *, image=None, image_path=None, mask=None, parameters=None, model=None) -> int | None:
        """Record a run in the session (autosaved): the readout, its image (None: a run of no image,
        a claim checked on a dataset) with its path as given, the painted region, ``parameters``
        beside the readout's own, the model (default: the picked one, loaded: its dtype and device
        are recorded). Returns the run's id (None, with the reason in the error line, when it could
        not be saved). The audit table and history refresh from the session's event."""
        try:
            return self.session.record(
                readout,
                image=image,
                image_path=image_path,
                mask=mask,
                parameters=parameters,
                model=model or self.window.loaded_model() or self.window.inputs.model_spec(),
            )
        except core.ReadoutError as e:
            self.show_error(f"not saved in the session: {e}")
            return None

    def record_request(self, result: Readout, request, loaded) -> int | None:
        """Record ``result`` of ``request`` run on ``loaded`` as the CLI records the same request
        (:func:`core.cli.outputs.finish`): the request as it ran (:func:`app.jobs.as_run`), its
        document of the result, its parameters, its image and painted region
        (:meth:`core.requests.base.Request.recorded_inputs`). The runner's record callback."""
        ran = as_run(request, loaded)
        inputs = ran.recorded_inputs()
        return self.record(
            ran.recorded(result, loaded),
            image=inputs.get("image"),
            image_path=inputs.get("image_path"),
            mask=inputs.get("mask"),
            parameters=ran.parameters(),
            model=loaded,
        )

    def _on_run_recorded(self, info: RunInfo) -> None:
        self._refresh_audit()
        self._refresh_history()
        self.window.history_panel.show_current(info.id)  # the app records a run as it shows it

    def _refresh_audit(self) -> None:
        self.window.audit_panel.set_rows([{**row, "run": row["run_id"]} for row in self.session.audit_table()])

    def _show_session(self, problem: str | None = None) -> None:
        """The session line: the file the runs are saved in (or the file opened read-only), or (red)
        why it is not the one asked for."""
        if problem:
            self.label.setStyleSheet("color: #c00000;")
            self.label.setText(" ".join(problem.split()))
        elif self.read_only_source is not None:
            self.label.setStyleSheet("color: #8a5a00;")
            self.label.setText(f"session: {self.read_only_source} ({READ_ONLY_NOTE})")
        else:
            self.label.setStyleSheet("color: #555555;")
            self.label.setText(f"session: {self.session.path}")

    def _switch_session(self, session: Session, read_only_source: Path | None = None) -> None:
        """Close the current session (and a read-only copy's folder) and continue in ``session``."""
        self.close()
        self.read_only_source = read_only_source
        self._use_session(session)
        self._show_session()

    def _remove_scratch(self) -> None:
        if self._scratch_folder is not None:
            shutil.rmtree(self._scratch_folder, ignore_errors=True)
            self._scratch_folder = None

    def close(self) -> None:
        """Stop following the session and close it (and remove a read-only copy): the window is
        going, or another session takes its place."""
        self.watch.stop()
        self.session.close()
        self._remove_scratch()

    # ------------------------------------------------------------ history

    def _refresh_history(self) -> None:
        """The history table and the workspace's run list from the session (each run read once)."""
        try:
            infos = self.session.runs()
            rows = [self._history_row(info) for info in infos]
        except core.ReadoutError as e:
            self.show_error(f"cannot list the session's runs: {e}")
            return
        self.window.history_panel.set_runs(rows)
        self.window.workspace.set_runs(infos)

    def _history_row(self, info: RunInfo) -> HistoryRow:
        row = self._history_rows.get(info.id)
        if row is None:
            try:
                run = self.session.run(info.id)
            except DamagedRunError as e:  # listed, but its stored values cannot be read: say so in its row
                return HistoryRow(info.id, info.kind, info.created, answer=f"damaged: {e.why}")
            stored = self.session.image(info.image_sha256) if info.image_sha256 else None
            row = HistoryRow(
                info.id,
                info.kind,
                info.created,
                image=Path(stored.path).name if stored and stored.path else (info.image_sha256 or "")[:12],
                thumbnail=self._thumbnail(info.image_sha256),
                question=question_of(run) or recorded_of(run).claim or "",
                answer=self._history_answer(run, info),
                model=info.model or "",
            )
            self._history_rows[info.id] = row
        return row

    @staticmethod
    def _history_answer(run: Run, info: RunInfo) -> str:
        """The answer column: :func:`history_answer` (else the run's summary), or why its result
        cannot be drawn."""
        try:
            readout = run.readout
        except DamagedRunError as e:  # its values read, its result does not restore
            return f"damaged: {e.why}"
        return history_answer(run.kind, readout) or info.summary

    def _thumbnail(self, sha: str | None) -> np.ndarray | None:
        """A small ``(h, w, 3)`` copy of the session's stored pixels of ``sha`` (None when not stored)."""
        if sha is None:
            return None
        if sha not in self._thumbnails:
            try:
                stored = self.session.image(sha)
                pixels = stored.pixels() if stored is not None else None
            except core.ReadoutError:
                pixels = None
            if pixels is not None:
                pixels = pixels.copy()
                pixels.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                pixels = np.asarray(pixels)
            self._thumbnails[sha] = pixels
        return self._thumbnails[sha]

    # ------------------------------------------------------------ restoring a run

    def restore_run(self, run_id: int) -> bool:
        """Show run ``run_id`` of the session as it was seen: its image, question, model (loaded in a
        worker when it is not), target fields, its result and, for a counterfactual, sweep,
        intervention or head method, the latest analyze run of the same input (the views draw them
        from the workspace), then the controls it was made from. False, with the reason in the
        error line, when it cannot be shown."""
        window = self.window
        if window.runner.is_busy():
            self.show_error("a job is running: wait for it or cancel it before showing another run")
            return self._keep_history_selection()
        try:
            run = self.session.run(int(run_id))
            if run.kind in CLAIM_KINDS:
                return self._restore_claim(run)
            restored = self._read_run(run)
        except core.ReadoutError as e:
            self.show_error(f"cannot show run #{run_id}: {e}")
            return self._keep_history_selection()
        if not window.set_image(restored.image, name=restored.image_name):
            return self._keep_history_selection()
        sha = self._set_inputs(restored)
        results: dict[str, object] = {}
        try:
            results[run.kind] = run.readout
        except DamagedRunError as e:  # a stored result of another shape or version
            restored.analysis = None  # no view claims content it could not draw
            restored.notes.append(f"run #{run.id} cannot be drawn ({e.why})")
        run_ids = {}
        if restored.analysis is not None:  # the Answer tab and the read-out views show this analyze run
            results["analyze"] = restored.analysis
            results["answer"] = answer_of(restored.analysis)
            run_ids["analyze"] = run_ids["answer"] = restored.analysis_id
        mask = restored.mask
        if mask is not None and mask.shape == (restored.image.height, restored.image.width):
            window.counterfactual_panel.canvas.set_mask(mask, undoable=False)  # an input, as the run's image
        try:
            window.workspace.show_run(ShownRun(run.id, run.kind, restored.input(sha), results, run_ids))  # views draw
            if run.kind in results:
                self._restore_controls(restored)
        except DRAW_ERRORS as e:
            window.workspace.clear_shown()  # no view claims content it could not draw
            window.workspace.show_run(ShownRun(run.id, run.kind, restored.input(sha)))
            restored.notes.append(f"run #{run.id} cannot be drawn ({type(e).__name__}: {e})")
        if run.kind != "note" and not any(run.kind in kinds for kinds in VIEW_KINDS.values()):  # a CLI run: said
            restored.notes.append(f"run #{run.id} ({run.kind}): the window has no view of this kind; export shows it")
        window.history_panel.show_current(run.id)
        self._load_run_model(restored)
        self.show_error("; ".join(restored.notes))
        window.statusBar().showMessage(f"run #{run.id} ({run.kind}) of {run.created} shown")
        return True

    def _set_inputs(self, restored: RestoredRun) -> str:
        """The run's model, question and target fields into the input bar and the workspace (the
        image was set before: its SHA-256 is returned)."""
        workspace, inputs = self.window.workspace, self.window.inputs
        sha = workspace.input.image_sha256
        inputs.model_picker.setCurrentText(restored.spec)
        restored.notes += inputs.set_model_choice(restored.dtype, restored.device)
        inputs.question_edit.setText(restored.question)
        inputs.target_edit.setText(restored.answer)
        inputs.foil_edit.setText(restored.foil)
        workspace.set_input(**restored.input(sha).fields())
        # what the pickers hold (a device this machine lacks is not picked: the run shows stale)
        picked = inputs.model_choice()
        workspace.set_input(model_dtype=picked.dtype, model_device=picked.device)
        return sha

    def _keep_history_selection(self) -> bool:
        """A run that was not shown: the history selects the run that is (returns False)."""
        shown = self.window.workspace.shown
        self.window.history_panel.show_current(shown.run_id if shown is not None else None)
        return False

    def _read_run(self, run: Run) -> RestoredRun:
        """Read everything ``run`` needs from the session (nothing on screen changes)."""
        image, name, path = self._run_image(run)
        answer_text = answer_text_of(run)
        answer, foil = target_fields(run, answer_text)
        ran_in = run.dtype_and_device
        spec = run.model_spec or self.window.inputs.model_spec()
        restored = RestoredRun(
            run,
            image,
            name,
            path,
            question_of(run),
            spec,
            run.model_fingerprint,
            *self._dtype_and_device_for(spec, ran_in),
            ran_in,
            answer,
            foil,
            answer_text,
        )
        if run.kind == "analyze":
            restored.analysis, restored.analysis_id = readout_of(run), run.id  # None: said when shown
        elif run.kind in PANEL_KINDS:
            restored.analysis_id, restored.analysis = self._analysis_of_input(
                run, restored.question, answer_text, (answer, foil)
            )
        if run.mask_id is not None:
            restored.mask = self.session.mask(run.mask_id)
        return restored

    def _dtype_and_device_for(self, spec: str, ran_in: dict) -> tuple[str, str]:
        """What the pickers take to show a run of ``spec`` that ran in ``ran_in``: the choice of a
        loaded model of ``spec`` that runs in that dtype on that device (the one picked first; an
        "auto" that resolved to it is that model), else :func:`picked_dtype_and_device`."""
        cache = self.window.model_cache
        shown = self.window.inputs.model_choice()
        loaded = [(shown, cache.get(shown))] if shown.spec == spec else []
        loaded += [(c, m) for c, m in cache.items() if isinstance(c, ModelChoice) and c.spec == spec]
        for choice, model in loaded:
            if ran_in and isinstance(model, core.LoadedModel):
                if all(model.adapter.dtype_and_device().get(k) == v for k, v in ran_in.items()):
                    return choice.dtype, choice.device
        return picked_dtype_and_device(ran_in, shown)

    def _run_image(self, run: Run):
        """``(PIL image, name, path)`` of the run's image: its file when that still holds the
        recorded pixels, else the session's stored pixels (path None)."""
        sha = run.image_sha256
        readout = readout_of(run) if sha is None and run.kind in ("analyze", "generate") else None
        if readout is not None:  # a run recorded without its image whose result names it
            sha = readout.input.image_sha256 if run.kind == "analyze" else readout.image_sha256
        stored = self.session.image(sha) if sha else None
        if stored is None:
            raise core.ReadoutError("the session has no image for it")
        name = Path(stored.path).name if stored.path else f"image {sha[:8]}"
        if stored.path and Path(stored.path).is_file():
            try:
                image = core.load_image(stored.path)
                if image_sha256(image) == sha:
                    return image, name, stored.path
            except core.ImageLoadError:
                pass  # the file changed or went bad: the stored pixels are what the run saw
        image = stored.pixels()
        if image is None:
            raise core.ReadoutError(
                f"its image {sha[:12]} is not stored in the session"
                + (f" and {stored.path} no longer holds it" if stored.path else "")
            )
        return image, name, None

    def _analysis_of_input(
        self, run: Run, question: str, answer_text: AnswerText | None = None, targets: tuple[str, str] = ("", "")
    ) -> tuple[int | None, AnalyzeResult | None]:
        """The latest analyze run before ``run`` on the same image, question, model, answer token and
        Target and foil fields (``targets``, :func:`target_fields`) (its id and result), or ``(None,
        None)``: what the read-out panels showed, current, when ``run`` was made (a read-out of another
        Target was stale beside it, and is not shown as the run's)."""
        spec = run.model_spec
        for info in reversed(self.session.runs("analyze")):
            if info.id > run.id or info.image_sha256 != run.image_sha256 or info.model != spec:
                continue
            try:
                candidate = self.session.run(info.id)
                analysis = candidate.readout
            except DamagedRunError:  # a damaged run is no run's analysis
                continue
            if (
                question_of(candidate) == question
                and answer_text_of(candidate) == answer_text
                and target_fields(candidate, answer_text) == targets
            ):
                return info.id, analysis
        return None, None

    def answer_tokens_of(self, input: RunInput, answer_text: AnswerText) -> AnswerTokens:
        """The answer a run read out at ``answer_text`` as tokens, with each token's probability and
        the stop reason when the session holds the generation of that answer (same image, question,
        model and tokens)."""
        for info in reversed(self.session.runs("generate")):
            if info.image_sha256 != input.image_sha256 or info.model != input.model_spec:
                continue
            try:
                candidate = self.session.run(info.id)
                generation = candidate.readout  # a core.generate.Generation
            except DamagedRunError:
                continue
            if question_of(candidate) == input.question and tuple(generation.token_ids) == answer_text.token_ids:
                return AnswerTokens.of_generation(generation, input)
        return AnswerTokens.of_answer_text(answer_text, input)

    def _restore_controls(self, restored: RestoredRun) -> None:
        """Set the controls the run's request was made from, beyond the image, question, model,
        Target and foil that :meth:`restore_run` sets: the head and the component selected of an
        ablation or a head method, the fill (and the painted region) of a counterfactual, a sweep's
        k and fill, the Interventions box's choices, a generation's token budget; so pressing the
        run's button again runs the run shown. What cannot be set again is marked where it shows and
        said in the error line (``restored.notes``)."""
        window, run, recorded = self.window, restored.run, restored.recorded
        readout = run.readout
        notes: list[str | None] = []
        if run.kind == "counterfactual":
            notes.append(window.counterfactual_panel.restore_fill(readout.fill, run.id, recorded.paste_from))
        elif run.kind == "sweep":
            notes.append(window.counterfactual_panel.restore_sweep(readout, run.id, recorded.paste_from))
        elif run.kind == "intervention":
            # selected first: a selection clears the Interventions box's message, which says what the
            # choices below could not set again
            head = window.intervention_panel.shown_head()  # drawn from the workspace already
            if head is not None and restored.analysis is not None:
                window.attention_panel.select_head(*head)  # its map goes onto the canvas, as when it was ablated
            self._restore_selection(recorded, restored.analysis)
            notes += window.intervention_panel.restore_choices(recorded, readout, run.id)
        elif run.kind in HEAD_METHOD_KINDS:
            head = window.head_methods.shown_head()
            if head is not None:
                window.attention_panel.select_head(*head)
        elif run.kind == "generate" and recorded.max_new_tokens:
            window.answer_panel.set_generate_budget(recorded.max_new_tokens)
        panel = window.counterfactual_panel
        if uses_painted_region(run) and not np.array_equal(panel.mask(), restored.mask):
            missing = f"the painted region of run #{run.id} is not stored with it: the region shown is not the run's"
            panel.show_message(missing, error=True)
            notes.append(missing)
        restored.notes += [note for note in notes if note]

    def _restore_selection(self, recorded: RecordedParameters, analysis) -> None:
        """A restored ablation's component, selected in the view it was selected in when it ran."""
        name, view = recorded.component, recorded.selected_in
        if name is not None and view in SELECTING_VIEWS:
            if view == "dla":
                self.window.dla_panel.select_component(name)
            self.window.selection.select(name, view, analysis)

    def _restore_claim(self, run: Run) -> bool:
        """Show a recorded ``validate`` run in the Validation tab, its model picked (it has no image): the
        panel shows it as a claim made now (on a model, not on the shown input: not the workspace's
        shown run), its choices go back into the panel."""
        window, inputs = self.window, self.window.inputs
        validation = run.readout  # a core.validate.Validation
        spec = run.model_spec or validation.model
        inputs.model_picker.setCurrentText(spec)
        dtype, device = self._dtype_and_device_for(spec, run.dtype_and_device)  # as restore_run picks them
        missing = inputs.set_model_choice(dtype, device)
        if missing:  # a device this machine lacks
            self.show_error("; ".join(missing))
        not_restored = restore_claim_choices(window.validation_panel, run, validation)
        # the input it is shown for: the one now, with the model it was checked on
        made_for = dataclasses.replace(window.workspace.input, model_fingerprint=validation.fingerprint or None)
        window.validation_panel.show_restored(run, made_for, not_restored)
        if not_restored:
            self.show_error("; ".join([*missing, not_restored]))
        window.history_panel.show_current(run.id)
        window.statusBar().showMessage(f"run #{run.id} ({run.kind}) of {run.created} shown in the Validation tab")
        return True

    def _load_run_model(self, restored: RestoredRun) -> None:
        """Load the run's model in a worker when it is not loaded (follow-ups need it); say so when
        the loaded weights are not the ones the run used."""
        if restored.run.model is None:  # recorded without a model: the shown one stays
            return
        window = self.window
        loaded = window.model_cache.get(restored.model)
        if loaded is None:
            window.runner.start(
                lambda model: self._check_run_model(model, restored),
                model_load_job,
                window.model_cache,
                restored.model,
                status="loading model…",
            )
        else:
            self._check_run_model(loaded, restored)

    def _check_run_model(self, loaded, restored: RestoredRun) -> None:
        fingerprint = getattr(loaded, "fingerprint", None)
        if restored.fingerprint and fingerprint and fingerprint != restored.fingerprint:
            restored.notes.append(
                f"{restored.spec} is not the model run #{restored.run.id} used (fingerprint "
                f"{fingerprint[:12]}, the run's {restored.fingerprint[:12]}): new runs will differ"
            )
            self.show_error("; ".join(restored.notes))

    # ------------------------------------------------------------ open, save as, export

    def export_audit(self, fmt: str, path: str) -> bool:
        from core.export import export_session  # the figures' drawing code loads on the first export

        notes: list[str] = []
        try:
            written = export_session(self.session, fmt, path, notes=notes)
        except core.ReadoutError as e:
            self.show_error(str(e))
            return False
        self.window.statusBar().showMessage(f"exported {', '.join(str(p) for p in written)}")
        if notes:  # exported; some pictures could not be drawn as recorded
            more = f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""
            self.show_error(f"exported, but {notes[0]}{more}")
        return True

    def open_session(self, path: str | Path, mode: str | None = None) -> bool:
        """Switch to another session file, show its audit table and history, and restore its last run.

        Args:
            mode: ``"append"``: later runs are saved into that file; ``"read_only"``: the file is never
                written, later runs go into a temporary copy (the session line says so); None: ask.

        A file that cannot be opened or read leaves the current session as it was, with the reason
        in the error line.
        """
        if self.window.runner.is_busy():
            self.show_error("a job is running: wait for it or cancel it before opening a session")
            return False
        mode = mode or self._ask_open_mode(Path(path))
        if mode is None:
            return False
        if mode not in OPEN_MODES:
            raise ValueError(f"mode must be one of {', '.join(OPEN_MODES)}, got {mode!r}")
        scratch = None
        try:
            if mode == "append":
                session = Session.open(path)
            else:
                session, scratch = self._read_only_copy(Path(path))
            damaged: dict[int, str] = {}  # runs whose stored values cannot be read: left out, said below
            try:  # read it before switching: a file none of whose runs can be read is refused whole
                runs = session.runs(damaged=damaged)
                session.audit_table(damaged=damaged)
                if runs:
                    try:
                        session.run(runs[-1].id)
                    except DamagedRunError as e:
                        damaged[e.run_id] = e.why
                if damaged and all(r.id in damaged for r in runs):
                    rid, why = min(damaged.items())
                    raise SessionError(f"{path}: none of its runs can be read (run {rid}: {why})")
            except core.ReadoutError:
                session.close()
                raise
        except (core.ReadoutError, OSError) as e:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            self.show_error(f"cannot open the session: {e}")
            return False
        self._switch_session(session, Path(path) if mode == "read_only" else None)
        self._scratch_folder = scratch
        self.show_error("")
        shown = [r for r in runs if r.image_sha256 is not None and r.id not in damaged]  # a note has no image
        if shown:
            self.restore_run(shown[-1].id)
        else:
            self.window.workspace.clear_shown()  # what is shown belongs to the other session
        if damaged:  # after the restore, which clears the error line when it has nothing to say
            rid, why = min(damaged.items())
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            self.show_error(f"{Path(path).name}: run {rid} cannot be read ({why}){more}; the other runs are shown")
        self.window.statusBar().showMessage(f"session {Path(path).name}: {len(runs)} runs")
        return True

    def _read_only_copy(self, path: Path) -> tuple[Session, Path]:
        """A temporary copy of the session at ``path`` (read with ``read_only=True``: the file and its
        folder are never written) to record later runs into, and the folder it lives in."""
        source = Session.open(path, read_only=True)
        scratch = Path(tempfile.mkdtemp(prefix="vlm-readout-read-only-"))
        try:
            copy = Session.open(source.save_as(scratch / path.name))
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            source.close()
        return copy, scratch

    def _ask_open_mode(self, path: Path) -> str | None:
        """Ask whether to continue the session or open it read-only (None: cancelled)."""
        box = QMessageBox(self.window)
        box.setWindowTitle("Open session")
        box.setText(f"Open {path.name}")
        box.setInformativeText(
            "Continue this session: later runs are saved into it.\n"
            "Open read-only: the file is not changed; later runs go into a temporary copy."
        )
        cont = box.addButton("Continue this session", QMessageBox.ButtonRole.AcceptRole)
        read_only = box.addButton("Open read-only", QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(cont)
        box.exec()
        return {cont: "append", read_only: "read_only"}.get(box.clickedButton())

    def open_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Open session", "", SESSION_FILTER)
        if path:
            self.open_session(path)

    def save_session_as(self, path: str | Path) -> bool:
        """Write the session to ``path`` as one self-contained file (SQLite online backup) and
        continue recording into it. False, with the reason in the error line, when it cannot."""
        if self.window.runner.is_busy():
            self.show_error("a job is running: wait for it or cancel it before saving the session")
            return False
        try:
            written = self.session.save_as(path)
            session = Session.open(written)
        except (core.ReadoutError, OSError) as e:
            self.show_error(f"cannot save the session as {path}: {e}")
            return False
        shown = self.window.workspace.shown
        self._switch_session(session)
        self.window.history_panel.show_current(shown.run_id if shown is not None else None)
        self.show_error("")
        self.window.statusBar().showMessage(f"session saved as {written}; new runs are saved there")
        return True

    def save_session_as_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self.window, "Save session as", "", SESSION_FILTER)
        if path:
            self.save_session_as(path if Path(path).suffix else f"{path}.vlmr")
