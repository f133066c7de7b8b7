"""The workspace model without Qt: inputs, shown runs, their events, and the
views' stale marks (app.components)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from app.components import NOTHING_SHOWN, Event, RunInput, RunView, ShownRun, Workspace
from app.components.workspace import AnswerTokens
from core.answer_text import AnswerText

ROOT = Path(__file__).resolve().parents[2]

INPUT = RunInput(
    image_sha256="ab" * 32,
    image_path="/data/sample_00.png",
    question="what shape is left of the square?",
    model_spec="shapes-llava",
    model_fingerprint="f" * 64,
)


def recorder(event: Event) -> list[dict]:
    seen: list[dict] = []
    event.connect(lambda **payload: seen.append(payload))
    return seen


def test_an_event_calls_its_callbacks_until_disconnected():
    event = Event("changed")
    seen = []
    disconnect = event.connect(lambda **p: seen.append(p))
    event.emit(x=1)
    disconnect()
    event.emit(x=2)
    disconnect()  # twice is harmless
    assert seen == [{"x": 1}]
    assert len(event) == 0


def test_describe_and_header_name_question_image_and_model():
    assert INPUT.describe() == "'what shape is left of the square?' · sample_00.png · shapes-llava · auto · cpu"
    long = RunInput(question="what colour is the shape that is the furthest from the circle?", model_spec="m")
    assert long.describe().startswith("'what colour is the shape that is the f…?'")
    pasted = RunInput(image_sha256="0123456789" * 6, question="q", model_spec="/models/shapes-coca")
    assert pasted.describe() == "'q' · image 01234567 · shapes-coca · auto · cpu"
    targeted = RunInput(question="q", model_spec="m", answer="red", foil="blue")
    assert targeted.describe() == "'q' · no image · m · auto · cpu · target 'red' vs 'blue'"
    run = ShownRun(4, "analyze", INPUT, {"analyze": {}})
    assert run.header() == (
        "run #4 · analyze · 'what shape is left of the square?' · sample_00.png · shapes-llava · auto · cpu"
    )
    assert ShownRun(None, "answer", INPUT).header().startswith("not recorded · answer · ")


def test_set_input_emits_only_what_changed():
    workspace = Workspace(INPUT)
    seen = recorder(workspace.events.input_changed)
    assert not workspace.set_input(question=INPUT.question, answer="")  # "" target is None: nothing changed
    assert workspace.set_input(question="how many circles?", model_spec="shapes-coca")
    assert seen == [{"fields": ("question", "model_spec")}]
    assert workspace.input.question == "how many circles?"


def test_is_current_compares_image_question_model_and_tokens_not_the_path():
    workspace = Workspace(INPUT)
    run = ShownRun(1, "analyze", INPUT, {"analyze": {}})
    workspace.show_run(run)
    assert workspace.is_current()
    workspace.set_input(image_path="/elsewhere/copy.png", model_fingerprint=None)  # same pixels, same spec
    assert workspace.is_current()
    for change in ({"image_sha256": "cd" * 32}, {"question": "q"}, {"model_spec": "shapes-coca"}, {"answer": "red"}):
        workspace.set_input(**change)
        assert not workspace.is_current(run), change
        workspace.set_input(**{k: getattr(INPUT, k) for k in change})
        assert workspace.is_current(run)
    assert not Workspace(INPUT).is_current()  # nothing shown


def test_follow_up_results_join_the_shown_run_of_the_same_input():
    workspace = Workspace(INPUT)
    shown = recorder(workspace.events.run_shown)
    run = ShownRun(4, "analyze", INPUT, {"analyze": {"a": 1}})
    workspace.show_run(run)
    same = workspace.add_result("counterfactual", {"c": 1}, 5)
    assert same is run and run.results == {"analyze": {"a": 1}, "counterfactual": {"c": 1}}
    assert run.header("counterfactual").startswith("run #5 · counterfactual · ")
    assert run.header().startswith("run #4 · analyze · ")
    workspace.set_input(question="how many circles?")
    new = workspace.add_result("intervention", {"i": 1}, 6)
    assert new is not run and new.input.question == "how many circles?" and new.results == {"intervention": {"i": 1}}
    assert [(p["run"], p["kind"]) for p in shown] == [(run, "analyze"), (run, "counterfactual"), (new, "intervention")]
    workspace.clear_shown()
    assert workspace.shown is None and shown[-1] == {"run": None, "kind": None}


def test_set_runs_emits_the_list():
    workspace = Workspace()
    seen = recorder(workspace.events.runs_changed)
    workspace.set_runs(iter([1, 2]))
    assert workspace.runs == [1, 2] and seen == [{"runs": [1, 2]}]


def test_a_view_names_its_run_turns_stale_and_clears():
    workspace = Workspace(INPUT)
    analysis_view = RunView(workspace, ["analyze"])
    answer_view = RunView(workspace, ["answer"])
    changes = recorder(analysis_view.changed)
    assert analysis_view.header() == NOTHING_SHOWN and not analysis_view.stale

    readout = ShownRun(4, "analyze", INPUT, {"analyze": {}, "answer": {}})
    workspace.show_run(readout)
    assert analysis_view.run is readout and answer_view.run is readout
    assert analysis_view.header() == readout.header() and answer_view.header() == readout.header("answer")

    # a new question answered: the Answer view shows the new run, the read-out views are stale
    workspace.set_input(question="how many circles?")
    workspace.show_run(ShownRun(None, "answer", workspace.input, {"answer": {}}))
    assert not answer_view.stale and "'how many circles?'" in answer_view.header()
    assert analysis_view.stale and analysis_view.run is readout
    assert analysis_view.header() == (
        "stale (question changed): drawn for 'what shape is left of the square?' · sample_00.png · shapes-llava · "
        "auto · cpu; the input is now 'how many circles?' · sample_00.png · shapes-llava · auto · cpu"
    )
    # the model box changed too: the note says which model the run was for
    workspace.set_input(model_spec="shapes-coca")
    assert "(question, model changed)" in analysis_view.header() and "shapes-llava · auto · cpu;" in (
        analysis_view.header()
    )
    # back to the run's input: current again
    workspace.set_input(question=INPUT.question, model_spec=INPUT.model_spec)
    assert not analysis_view.stale and analysis_view.header() == readout.header()

    workspace.clear_shown()
    assert analysis_view.run is None and analysis_view.header() == NOTHING_SHOWN
    assert changes[-1] == {"cleared": True} and {"cleared": False} in changes
    analysis_view.disconnect()
    workspace.set_input(question="x")
    assert changes[-1] == {"cleared": True}


def test_the_dtype_and_device_are_part_of_the_input():
    """Another dtype or device is another model: a run drawn for float32 turns stale on bfloat16
    (naming what changed), its header names the dtype and device it ran in, and an answer
    generated in one dtype is not offered as the answer of another."""
    ran = dataclasses.replace(INPUT, loaded_dtype="float32", loaded_device="cpu")  # "auto" resolved on the CPU
    assert ran.describe().endswith("shapes-llava · float32 (auto) · cpu")
    workspace = Workspace(ran)
    view = RunView(workspace, ["analyze"])
    workspace.show_run(ShownRun(3, "analyze", ran, {"analyze": {}}))
    assert not view.stale and view.header().endswith("· shapes-llava · float32 (auto) · cpu")
    seen = recorder(workspace.events.input_changed)
    workspace.set_input(model_dtype="bfloat16", loaded_dtype=None, loaded_device=None)  # picked, not yet loaded
    assert seen == [{"fields": ("model_dtype", "loaded_dtype", "loaded_device")}]
    assert view.stale and view.header().startswith("stale (dtype changed): drawn for ")
    now = "the input is now 'what shape is left of the square?' · sample_00.png · shapes-llava · bfloat16 · cpu"
    assert view.header().endswith(now)
    workspace.set_input(model_device="cuda:0")
    assert "(dtype, device changed)" in view.header()
    tokens = AnswerTokens("square", (33,), ("square",), ran)
    assert not tokens.answers(workspace.input)
    workspace.set_input(model_dtype="auto", model_device="cpu")
    assert not view.stale and tokens.answers(workspace.input)
    float32 = dataclasses.replace(ran, model_dtype="float32")
    assert ran.model_choice() == workspace.input.model_choice() != float32.model_choice()


def test_the_components_import_no_qt():
    code = "import sys, app.components; print(sorted(m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_the_answer_token_read_is_part_of_the_input():
    """Token k of an answer (issue 14): headers name it, another k makes a run stale, and
    the answer's tokens belong to one image, question and model."""
    answer = AnswerText("square yes zero", (33, 44, 45), ("square", "yes", "zero"), 2)
    workspace = Workspace(dataclasses.replace(INPUT, answer_text=answer))
    assert workspace.input.describe() == (
        "'what shape is left of the square?' · sample_00.png · shapes-llava · auto · cpu · answer token 2 'zero'"
    )
    run = ShownRun(7, "analyze", workspace.input, {"analyze": {}})
    workspace.show_run(run)
    seen = recorder(workspace.events.input_changed)
    workspace.set_input(answer_text=answer.at(1))
    assert seen == [{"fields": ("answer_text",)}] and not workspace.is_current(run)
    assert workspace.stale_note(run).startswith("stale (answer token changed): drawn for ")
    workspace.set_input(answer_text=answer)
    assert workspace.is_current(run)
    assert workspace.input.fields()["answer_text"] is answer  # not flattened, as dataclasses.asdict would
    workspace.set_input(answer_text=None)
    assert workspace.input.answer_text is None and not workspace.is_current(run)

    tokens = AnswerTokens.of_answer_text(answer, INPUT, probs=[1.0, 0.9, 0.8])
    assert tokens.at(2) == answer and tokens.holds(answer) and not tokens.holds(None)
    assert tokens.find(["yes", "zero"]) == 1 and tokens.find(["zero", "yes"]) is None and tokens.find([]) is None
    assert tokens.answers(dataclasses.replace(INPUT, image_path="/copy.png", answer="red"))  # same pixels and question
    assert not tokens.answers(dataclasses.replace(INPUT, question="how many?"))
