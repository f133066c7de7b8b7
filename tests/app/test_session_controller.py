"""The session controller (app.session_view.SessionController) on a host of its own,
without the main window: it records a request's result as the CLI records it, keeps
the History and Audit tables with the session, restores a run by setting the inputs,
showing the typed results in the workspace (the views draw from there: a RunFrame's
panel is called with them) and setting the controls the request was made from, and
opens a session to continue or read-only. Only the last test runs a model (shapes-llava,
loaded once for the app tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
from PySide6.QtWidgets import QMainWindow

import core
from app.components import ModelChoice, RunInput, RunView, Workspace
from app.components.selection import Selection
from app.input_bar import InputBar
from app.panels.answer_panel import AnswerPanel
from app.panels.attention_panel import AttentionPanel
from app.panels.audit_panel import AuditPanel
from app.panels.counterfactual_panel import CounterfactualPanel
from app.panels.dla_panel import DLAPanel
from app.panels.history_panel import HistoryPanel
from app.panels.intervention_panel import InterventionPanel
from app.run_frame import RunFrame
from app.samples import bundled_samples
from app.session_view import SessionController
from core.answer_text import AnswerText
from core.files.images import image_sha256
from core.requests import AblationRequest, AnalyzeRequest, GenerateRequest
from core.requests.base import AskedRequest
from core.results.readout import Note, RecordedResult
from core.session import Session

SAMPLE, OTHER = bundled_samples()[0], bundled_samples()[3]
ANSWER_TEXT = AnswerText("blue circle", (7, 9), ("blue", "circle"), 1)


@dataclass(frozen=True, kw_only=True, eq=False)
class NoteRequest(AskedRequest):
    """A request about an image that writes a note (no model): what any request about the shown
    input records, its painted region included. Not registered: no command has it."""

    name: ClassVar[str] = "note"
    text: str = ""
    mask: Any = None

    def parameters(self) -> dict:
        return {**self.asked_parameters(), "painted": self.mask is not None}

    def run(self, loaded, progress=None, cancel=None) -> Note:
        return Note({"text": self.text})


class Runner:
    """The runner's part the controller uses: busy or not, and the jobs it was asked to start."""

    def __init__(self):
        self.busy = False
        self.started: list[tuple] = []

    def is_busy(self) -> bool:
        return self.busy

    def start(self, on_result, fn, *args, status: str = "working…", failed=None) -> None:
        self.started.append((fn, args, status))


class DrawnRuns:
    """A view's panel that keeps every ``draw(run, kind)`` it is asked for."""

    def __init__(self):
        self.drawn: list[tuple] = []

    def draw(self, run, kind) -> None:
        self.drawn.append((run, kind))


class Host(QMainWindow):
    """What the controller uses of a window (its docstring's list), nothing more."""

    def __init__(self, model_cache: dict, session_path):
        super().__init__()
        self.model_cache = model_cache
        self.workspace = Workspace(RunInput(model_spec="shapes-llava"))
        self.inputs = InputBar(self.workspace, "shapes-llava", self.loaded_fields)
        self.runner = Runner()
        self.selection = Selection(self.workspace)
        self.history_panel, self.audit_panel = HistoryPanel(), AuditPanel()
        self.counterfactual_panel = CounterfactualPanel()
        self.intervention_panel = InterventionPanel(self.selection)
        self.answer_panel, self.attention_panel, self.dla_panel = AnswerPanel(), AttentionPanel(), DLAPanel()
        self.images: list = []  # every image set
        self.analysis_view, self.follow_up_view = DrawnRuns(), DrawnRuns()
        self.frames = [
            RunFrame(self.attention_panel, RunView(self.workspace, ("analyze",)), self.analysis_view),
            RunFrame(
                self.intervention_panel,
                RunView(self.workspace, ("counterfactual", "sweep", "intervention")),
                self.follow_up_view,
            ),
        ]
        self.sessions = SessionController(self, session_path)

    def loaded_fields(self, model: ModelChoice) -> dict:
        loaded = self.model_cache.get(model)
        if not isinstance(loaded, core.LoadedModel):
            return {"model_fingerprint": None, "loaded_dtype": None, "loaded_device": None}
        ran = loaded.adapter.dtype_and_device()
        return {"model_fingerprint": loaded.fingerprint, "loaded_dtype": ran["dtype"], "loaded_device": ran["device"]}

    def loaded_model(self):
        loaded = self.model_cache.get(self.inputs.model_choice())
        return loaded if isinstance(loaded, core.LoadedModel) else None

    def set_image(self, source, name: str | None = None) -> bool:
        image = core.load_image(source)
        self.images.append((image, name))
        self.counterfactual_panel.set_image(np.asarray(image))
        self.workspace.clear_shown()
        path = str(source) if isinstance(source, str) else None
        self.workspace.set_input(image_sha256=image_sha256(image), image_path=path)
        return True

    def show_sample(self, sample) -> None:
        assert self.set_image(str(sample.image_path))
        self.inputs.question_edit.setText(sample.question)

    def asked(self, **fields) -> dict:
        image = self.images[-1][0]
        return {"image": image, "image_path": self.workspace.input.image_path, "question": SAMPLE.question, **fields}


@pytest.fixture
def host(qtbot, tmp_path):
    win = Host({}, tmp_path / "session.vlmr")
    qtbot.addWidget(win)
    win.show_sample(SAMPLE)
    yield win
    win.sessions.close()


def painted(host) -> np.ndarray:
    image = host.images[-1][0]
    mask = np.zeros((image.height, image.width), bool)
    mask[20:60, 30:90] = True
    return mask


def test_a_request_is_recorded_as_the_cli_records_it_and_the_tables_follow(host):
    mask = painted(host)
    request = NoteRequest(**host.asked(answer="blue circle", foil="red", answer_text=ANSWER_TEXT), text="hi", mask=mask)
    run_id = host.sessions.record_request(request.run(None), request, None)
    run = host.sessions.session.run(run_id)
    assert run.kind == "note" and run.parameters == request.parameters()
    assert run.image_sha256 == image_sha256(host.images[-1][0]) and run.image_path == str(SAMPLE.image_path)
    assert np.array_equal(host.sessions.session.mask(run.mask_id), mask)
    assert run.model_spec == "shapes-llava"  # not loaded: the picked spec
    assert host.history_panel.run_ids() == [run_id] and host.history_panel.current_run() == run_id
    assert host.history_panel.row_texts(run_id)["question"] == SAMPLE.question
    assert [r.id for r in host.workspace.runs] == [run_id]
    assert host.sessions.record(RecordedResult("note", {}, "by hand")) == run_id + 1
    assert host.history_panel.run_ids() == [run_id, run_id + 1]


def test_a_restore_sets_the_inputs_shows_the_typed_result_and_sets_the_painted_region(host):
    mask = painted(host)
    request = NoteRequest(**host.asked(answer="blue circle", foil="red", answer_text=ANSWER_TEXT), text="hi", mask=mask)
    run_id = host.sessions.record_request(request.run(None), request, None)
    host.show_sample(OTHER)
    host.inputs.target_edit.setText("square")
    assert host.workspace.shown is None
    assert host.sessions.restore_run(run_id)
    inputs, shown = host.inputs, host.workspace.shown
    assert (inputs.question_edit.text(), inputs.target_edit.text(), inputs.foil_edit.text()) == (
        SAMPLE.question,
        "blue circle",
        "red",
    )
    assert image_sha256(host.images[-1][0]) == image_sha256(core.load_image(SAMPLE.image_path))
    assert host.images[-1][1] == SAMPLE.image_path.name
    assert shown.run_id == run_id and shown.kind == "note" and shown.results == {"note": Note({"text": "hi"})}
    assert shown.input.answer_text == ANSWER_TEXT and host.workspace.is_current()
    assert np.array_equal(host.counterfactual_panel.mask(), mask)
    assert host.history_panel.current_run() == run_id and inputs.error_label.text() == ""
    assert host.statusBar().currentMessage().startswith(f"run #{run_id} (note) of ")
    # the run's model is not loaded: it loads in the worker, in the dtype and on the device picked
    assert [(fn.__name__, args[1], status) for fn, args, status in host.runner.started] == [
        ("model_load_job", ModelChoice("shapes-llava", "auto", "cpu"), "loading model…")
    ]


def test_a_restore_while_busy_or_of_a_damaged_result_says_so(host):
    first = host.sessions.record(
        RecordedResult("note", {}, "first"), image=str(SAMPLE.image_path), parameters={"question": "q?"}
    )
    damaged = host.sessions.record(
        RecordedResult("analyze", {"target": {"answer": "yes"}}, "odd"),
        image=str(SAMPLE.image_path),
        parameters={"question": SAMPLE.question},
    )
    assert host.sessions.restore_run(first)
    host.runner.busy = True
    assert not host.sessions.restore_run(damaged)
    assert host.inputs.error_label.text() == "a job is running: wait for it or cancel it before showing another run"
    assert host.workspace.shown.run_id == first and host.history_panel.current_run() == first
    host.runner.busy = False
    assert host.sessions.restore_run(damaged)
    assert host.inputs.error_label.text().startswith(
        f"run #{damaged} cannot be drawn (the stored analyze result does not fit"
    )
    assert host.workspace.shown.run_id == damaged and host.workspace.shown.results == {}
    assert host.analysis_view.drawn == []  # no view drew a result it could not restore


def test_a_session_opens_to_continue_or_read_only(host, tmp_path):
    shared = tmp_path / "shared.vlmr"
    with Session.create(shared) as s:
        s.record(RecordedResult("note", {}, "shared work"), image=str(OTHER.image_path), parameters={"question": "?"})
    current = host.sessions.session
    assert host.sessions.open_session(shared, mode="read_only")
    assert (
        current.closed
        and host.sessions.label.text() == f"session: {shared} (read-only; new runs are not saved into it)"
    )
    assert host.history_panel.run_ids() == [1] and host.workspace.shown.run_id == 1  # its last run is shown
    host.sessions.record(RecordedResult("note", {}, "mine"))
    assert host.history_panel.run_ids() == [1, 2]
    with Session.open(shared, read_only=True) as s:
        assert [r.summary for r in s.runs()] == ["shared work"]
    assert host.sessions.open_session(shared, mode="append")
    assert host.sessions.label.text() == f"session: {shared}" and host.history_panel.run_ids() == [1]
    copy = tmp_path / "copy.vlmr"
    assert host.sessions.save_session_as(copy)
    assert host.sessions.session.path == copy and host.sessions.label.text() == f"session: {copy}"
    assert host.history_panel.current_run() == 1


def _shapes_llava(model_cache: dict):
    choice = ModelChoice("shapes-llava")  # the default dtype and device: the host's picked model
    if choice not in model_cache:
        model_cache[choice] = core.load_model(choice.spec, **choice.load_options())
    return model_cache[choice]


def test_a_restored_ablation_shows_its_readout_and_sets_its_controls(qtbot, model_cache, tmp_path):
    """Live results recorded, the controls moved, the ablation restored: the views are drawn with
    the typed results (equal to the live ones), the head and the Interventions box's choices are
    the run's, and the answer's tokens come from the recorded generation."""
    host = Host(model_cache, tmp_path / "session.vlmr")
    qtbot.addWidget(host)
    try:
        loaded = _shapes_llava(model_cache)
        host.show_sample(SAMPLE)
        analyze = AnalyzeRequest(**host.asked())
        analysis = analyze.run(loaded)
        analyze_id = host.sessions.record_request(analysis, analyze, loaded)
        assert host.sessions.session.run(analyze_id).model_fingerprint == loaded.fingerprint
        ablation = AblationRequest(**host.asked(), component="L1.H0", selected_in="attention", ablation="zero")
        ablated = ablation.run(loaded)
        ablation_id = host.sessions.record_request(ablated, ablation, loaded)
        generate = GenerateRequest(image=host.images[-1][0], question=SAMPLE.question, max_new_tokens=2)
        generation = generate.run(loaded)
        host.sessions.record_request(generation, generate, loaded)

        host.show_sample(OTHER)
        host.intervention_panel.set_kind("resample")
        host.intervention_panel.set_positions("all")
        host.selection.clear()
        assert host.sessions.restore_run(ablation_id), host.inputs.error_label.text()
        shown = host.workspace.shown
        assert shown.run_id == ablation_id and shown.run_ids["analyze"] == analyze_id
        assert shown.results["intervention"].to_dict() == ablated.to_dict()
        assert shown.results["analyze"].to_dict() == analysis.to_dict()
        assert shown.results["answer"].answer == analysis.top[0][0]
        assert host.analysis_view.drawn[-1] == (shown, "analyze")
        assert host.follow_up_view.drawn[-1] == (shown, "intervention")
        assert (host.intervention_panel.kind(), host.intervention_panel.positions()) == ("zero", "target")
        selected = host.selection.current
        assert (selected.name, selected.view, selected.run_id, selected.stale) == (
            "L1.H0",
            "attention",
            analyze_id,
            False,
        )
        assert host.runner.started == [] and host.inputs.error_label.text() == ""  # its model is loaded

        answer = AnswerText(generation.text, tuple(generation.token_ids), tuple(generation.tokens), 0)
        tokens = host.sessions.answer_tokens_of(shown.input, answer)
        assert tokens.token_ids == answer.token_ids and tokens.stop_reason == generation.stop_reason
        assert tokens.probs == tuple(float(p) for p in generation.probs)  # the generation's own
    finally:
        host.sessions.close()
