"""The request layer (core.requests): every run kind has one frozen, keyword-only
request; each request's run() is the engine function its command calls, to the last
digit; parameters() is JSON that round-trips, agrees with the result's own parameters
where they share a name, and is what the commands record beside them; the typed
answer has one rule; importing the layer imports no torch."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import core.cli
from core import load_model
from core.answer_text import AnswerText
from core.cli import main
from core.errors import QuestionError
from core.files.images import load_image, load_mask
from core.models.loading import resources_dir
from core.requests import (
    REQUESTS,
    AnalyzeRequest,
    AuditRequest,
    CounterfactualRequest,
    GenerateRequest,
    NonuniqueRequest,
    QkOvRequest,
    Request,
    SweepRequest,
    ValidateRequest,
)
from core.session import Session

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = resources_dir() / "samples"
IMAGE_PATH, QUESTION = SAMPLES / "sample_00.png", "what shape is the blue object?"
MASK_PATH = SAMPLES / "sample_00_obj1.png"  # the blue square
KINDS = (
    "analyze",
    "generate",
    "counterfactual",
    "sweep",
    "ablation",
    "patching",
    "nonunique",
    "qk-ov",
    "validate",
    "audit",
)


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


@pytest.fixture(scope="module")
def image():
    return load_image(IMAGE_PATH)


def _json(doc) -> str:
    """The document as the commands write it (strict JSON, key order kept)."""
    return json.dumps(doc, allow_nan=False)


def _check_parameters(request: Request, result) -> dict:
    """``request.parameters()`` is JSON that round-trips, and where it names what the
    result's own parameters name, it says the same (recorded together, neither overrides
    the other with another value)."""
    asked = request.parameters()
    assert json.loads(_json(asked)) == asked
    own = json.loads(_json(result.parameters()))
    assert {k: asked[k] for k in asked.keys() & own.keys()} == {k: own[k] for k in asked.keys() & own.keys()}
    return asked


# ---------------------------------------------------------------- the registry


def test_every_run_kind_has_one_frozen_keyword_only_request():
    assert set(KINDS) <= set(REQUESTS)
    for name, cls in REQUESTS.items():
        assert cls.name == name and issubclass(cls, Request)
        params = cls.__dataclass_params__
        assert params.frozen, name
        assert all(f.kw_only for f in dataclasses.fields(cls)), name
    with pytest.raises(ValueError, match="two requests are named 'analyze'"):
        core.requests.register_request(type("Again", (AnalyzeRequest,), {}))


def test_importing_the_requests_imports_no_torch_numpy_or_pil():
    probe = "import sys, core.requests; print(' '.join(m for m in ('torch', 'numpy', 'PIL') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_a_request_is_frozen_and_equal_only_to_itself(image):
    request = AnalyzeRequest(image=image, question=QUESTION)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.question = "another"
    again = dataclasses.replace(request)
    assert request == request and again != request  # no partial comparison of pixels and arrays


def test_the_nonunique_levels_are_the_methods():
    from core.methods.nonunique import LEVEL_NAMES

    assert NonuniqueRequest.__dataclass_fields__["levels"].default == tuple(LEVEL_NAMES)


# ---------------------------------------------------------------- each run is its engine function


def test_analyze_is_the_library_call(llava, image):
    from core.analyze import analyze

    answer_text = AnswerText.of_text(llava.adapter, "blue square", 1)
    request = AnalyzeRequest(image=image, image_path=str(IMAGE_PATH), question=QUESTION, answer_text=answer_text)
    request = dataclasses.replace(request, foil="circle")
    got = request.run(llava)
    want = analyze(llava, image, QUESTION, foil="circle", answer_text=answer_text)
    assert _json(got.to_dict()) == _json(want.to_dict())
    asked = _check_parameters(request, got)
    assert asked["typed_target"] == "" and asked["typed_foil"] == "circle" and asked["answer_token_index"] == 1
    assert asked["attention"] == "sdpa" and asked["lens"] is None


def test_analyze_reads_a_lens_folder_and_eager_attention(llava, image):
    from core.analyze import analyze
    from core.methods.tuned_lens.store import load_lens

    lens = llava.path / "tuned-lens"
    request = AnalyzeRequest(image=image, question=QUESTION, answer="square", lens=str(lens), attention="eager")
    want = analyze(llava, image, QUESTION, answer="square", tuned=load_lens(lens), attention="eager")
    got = request.run(llava)
    assert got.to_dict()["tuned_lens"] is not None
    assert _json(got.to_dict()) == _json(want.to_dict())
    assert _check_parameters(request, got)["lens"] == str(lens)
    with pytest.raises(QuestionError, match="attention 'flash': expected one of sdpa, eager"):
        AnalyzeRequest(image=image, question=QUESTION, attention="flash")


def test_a_typed_word_of_several_tokens_reads_its_first_sub_token(llava, image):
    adapter = llava.adapter
    request = AnalyzeRequest(image=image, question=QUESTION, answer="blue square", foil="red")
    assert request.tokens(adapter) == {"answer": adapter.token_id("blue"), "foil": adapter.token_id("red")}
    assert request.run(llava).to_dict()["target"]["answer_id"] == adapter.token_id("blue")


def test_generate_is_the_library_call_and_cancels_between_tokens(llava, image):
    from core.generate import generate

    request = GenerateRequest(image=image, question=QUESTION, max_new_tokens=3, stop_strings=("zz",), top_k=2)
    got = request.run(llava)
    want = generate(llava, image, QUESTION, max_new_tokens=3, stop_strings=["zz"], top_k=2)
    assert _json(got.to_dict()) == _json(want.to_dict())
    assert _check_parameters(request, got)["max_new_tokens"] == 3
    assert "max_new_tokens" not in GenerateRequest(image=image, question=QUESTION).parameters()  # the folder's
    stopped = request.run(llava, cancel=lambda: True)
    assert stopped.stop_reason == "cancelled" and stopped.token_ids == []


def test_counterfactual_is_the_library_call(llava, image):
    from core.methods.counterfactual import Fill, region_counterfactual

    mask = load_mask(MASK_PATH)
    request = CounterfactualRequest(
        image=image, question=QUESTION, answer="square", foil="triangle", mask=mask, mask_name=str(MASK_PATH),
        fill="constant", color=(0, 255, 0),
    )  # fmt: skip
    got = request.run(llava)
    want = region_counterfactual(
        llava, image, QUESTION, mask, Fill("constant", color=(0, 255, 0)), answer="square", foil="triangle"
    )
    assert _json(got.to_dict()) == _json(want.to_dict())
    asked = _check_parameters(request, got)
    assert asked["fill_options"] == {"color": [0, 255, 0]} and asked["mask"] == str(MASK_PATH) and asked["routing"]


def test_a_sweep_is_the_library_call_and_cancels_between_batches(llava, image):
    from core.methods.counterfactual import occlusion_sweep

    source = load_image(SAMPLES / "sample_01.png")
    request = SweepRequest(
        image=image, question=QUESTION, k=4, fill="paste", paste_from=source, paste_from_path="other.png", batch_size=3
    )
    got = request.run(llava)
    want = occlusion_sweep(llava, image, QUESTION, k=4, fill="paste", paste_from=source, batch_size=3)
    assert _json(got.to_dict()) == _json(want.to_dict())
    asked = _check_parameters(request, got)
    assert (asked["fill"], asked["paste_from"], asked["k"], asked["batch_size"]) == ("paste", "other.png", 4, 3)
    assert not request.run(llava, cancel=lambda: True).complete  # the first batch runs, then it stops


def test_nonunique_is_the_library_call(llava, image):
    from core.methods.nonunique import nonunique_of_input

    mask = load_mask(MASK_PATH)
    options = dict(levels=("a", "b"), score_bounds=(1.5,), steps=4, tol=0.1)
    request = NonuniqueRequest(
        image=image, image_path=str(IMAGE_PATH), question=QUESTION, head="L1.H2", mask=mask, mask_name="m.png",
        **options,
    )  # fmt: skip
    got = request.run(llava)
    _, doc = nonunique_of_input(
        llava, image, QUESTION, "L1.H2", mask=mask, mask_name="m.png", image_path=str(IMAGE_PATH), **options
    )
    assert _json(got.to_dict()) == _json(doc)  # the result carries the command's header
    asked = _check_parameters(request, got)
    assert asked["component"] == "L1.H2" and asked["levels"] == ["a", "b"] and asked["mask"] == "m.png"


def test_qk_ov_is_the_library_call_with_and_without_an_input(llava, image):
    from core.methods.qk_ov import qk_ov

    weights = QkOvRequest(head="L1.H1", copy_tokens="red, blue")
    copy_ids = weights.copy_ids(llava.adapter)
    got = weights.run(llava)
    assert _json(got.to_dict()) == _json(qk_ov(llava, "L1.H1", copy_tokens=copy_ids).to_dict())
    assert _check_parameters(weights, got)["question"] is None
    answer_text = AnswerText.of_text(llava.adapter, "blue square", 1)
    on_input = QkOvRequest(head="L1.H1", image=image, question=QUESTION, answer_text=answer_text, top_k=3)
    got = on_input.run(llava)
    want = qk_ov(llava, "L1.H1", image, QUESTION, answer_text=answer_text, top_k=3)
    assert _json(got.to_dict()) == _json(want.to_dict())
    assert _check_parameters(on_input, got)["component"] == "L1.H1"


def test_qk_ov_refuses_half_an_input_and_copy_tokens_of_no_head(llava, image):
    with pytest.raises(QuestionError, match="needs both an image and a question"):
        QkOvRequest(head="L1.H1", image=image)
    with pytest.raises(QuestionError, match="an answer token is read out on an input"):
        QkOvRequest(head="L1.H1", answer_text=AnswerText.of_text(llava.adapter, "blue", 0))
    with pytest.raises(QuestionError, match="--copy-tokens word 'qqqq'"):
        QkOvRequest(head="L1.H1", copy_tokens="red,qqqq").copy_ids(llava.adapter)


def test_validate_is_the_library_call(llava):
    from core.validate import validate

    options = dict(claim="moves the asked colour", dataset="scenes", n=4, n_side=0, seed=3)
    request = ValidateRequest(subjects=("L1.H1",), **options)
    got = request.run(llava)
    want = validate(llava, ["L1.H1"], **options)
    without_time = [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in (got, want)]
    assert _json(without_time[0]) == _json(without_time[1])
    asked = _check_parameters(request, got)
    assert asked["typed_subjects"] == "L1.H1" and asked["n"] == 4 and not asked["painted_region"]
    assert "dataset" not in asked  # the generated scenes are no file to hash


def test_the_audit_in_one_process_is_the_shards_merged(llava):
    from core.dataset_audit import (
        DEFAULT_METHODS,
        AuditOptions,
        merge_shards,
        parse_methods,
        run_shard,
        summarize,
    )
    from core.files.pairs import read_pairs

    request = AuditRequest(dataset=str(SAMPLES), limit=3, batch_size=2)
    got = request.run(llava)
    items = read_pairs(SAMPLES / "pairs.jsonl", limit=3)
    methods = parse_methods(DEFAULT_METHODS)
    merged = merge_shards([run_shard(llava, items, methods, AuditOptions(), batch_size=2)])
    doc = got.to_dict()
    assert doc["n_samples"] == 3 and doc["out"] is None
    assert _json({k: doc[k] for k in doc if k not in ("schema_version", "parameters", "out")}) == _json(
        json.loads(_json(summarize(merged.records, methods, 3, False)))
    )
    assert got.kind == "audit" and [a.method for a in got.audit_records()] == [m.audit_method for m in methods]
    asked = _check_parameters(request, got)
    assert asked["dataset"] == str(SAMPLES / "pairs.jsonl") and asked["methods"] == list(DEFAULT_METHODS)


def test_an_answer_text_of_the_audit_is_every_pairs(llava):
    request = AuditRequest(dataset=str(SAMPLES), limit=2, answer_text="blue square", answer_token_index=1)
    assert [(i.answer_text, i.answer_token_index) for i in request.read_items()] == [("blue square", 1)] * 2
    assert [i.answer_text for i in AuditRequest(dataset=str(SAMPLES), limit=2).read_items()] == [None, None]


# ---------------------------------------------------------------- the commands record the request's parameters


def _stored(session: Path):
    with Session.open(session, read_only=True) as s:
        return s.run(s.runs()[-1].id)


def test_the_commands_record_what_they_recorded_and_the_requests_parameters(llava, tmp_path, monkeypatch, capsys):
    """Each command records its result's parameters with its request's beside them: the
    names it recorded before the request layer keep their values."""
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    session = tmp_path / "s.vlmr"
    common = ["--image", str(IMAGE_PATH), "--question", QUESTION, "--session", str(session)]
    out = str(tmp_path / "out.json")

    argv = ["counterfactual", *common, "--mask", str(MASK_PATH), "--answer-text", "blue square", "--json", out]
    assert main([*argv, "--token-index", "1", "--fill", "noise", "--seed", "3", "--no-routing"]) == 0
    run = _stored(session)
    before = {"question": QUESTION, "paste_from": None, "answer_text": "blue square", "answer_token_index": 1}
    assert {k: run.parameters[k] for k in before} == before
    assert run.parameters["fill"] == "noise" and run.parameters["fill_options"] == {"seed": 3}
    assert run.parameters["answer"] == "square"  # the token the result read, not the typed field
    assert run.parameters["mask"] == str(MASK_PATH) and run.parameters["routing"] is False

    argv = ["nonunique", *common, "--head", "L1.H2", "--levels", "a", "--json", out]
    assert main(argv) == 0
    run = _stored(session)
    assert run.parameters["component"] == "L1.H2" and run.parameters["question"] == QUESTION
    assert run.parameters["region_rule"] == json.loads(Path(out).read_text())["region"]["rule"]

    argv = ["validate", "--head", "L1.H1", "--claim", "moves the asked colour", "--dataset", "scenes", "--n", "4"]
    assert main([*argv, "--n-side", "0", "--json", out, "--session", str(session), "--quiet"]) == 0
    run = _stored(session)
    assert run.parameters["typed_subjects"] == "L1.H1" and isinstance(run.parameters["heldout"], dict)

    argv = ["analyze", *common, "--answer", "square", "--json", out, "--quiet"]
    assert main(argv) == 0
    run = _stored(session)
    assert (run.parameters["answer"], run.parameters["typed_target"], run.parameters["typed_foil"]) == (
        "square",
        "square",
        "",
    )
    capsys.readouterr()


def test_the_audit_command_records_the_requests_summary_run(llava, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    session, out = tmp_path / "s.vlmr", tmp_path / "audit"
    argv = ["audit", "--dataset", str(SAMPLES), "--limit", "3", "--batch-size", "2", "--out", str(out)]
    assert main([*argv, "--session", str(session), "--quiet"]) == 0
    run = _stored(session)
    request = AuditRequest(dataset=str(SAMPLES), limit=3, batch_size=2)
    got = request.run(llava)
    assert run.result == {**json.loads(_json(got.to_dict())), "out": str(out)}
    # the run's parameters and the request's (what the app records for it too)
    asked = {**got.parameters(), **request.parameters()}
    assert run.parameters == {**asked, "dataset_sha256": run.parameters["dataset_sha256"]}
    assert len(run.audits) == len(got.audit_records())
    capsys.readouterr()


def test_a_mask_and_image_reach_the_session_with_the_run(llava, tmp_path, monkeypatch, capsys):
    """The shared epilogue stores the request's image and painted region with the run."""
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    session = tmp_path / "s.vlmr"
    argv = ["counterfactual", "--image", str(IMAGE_PATH), "--question", QUESTION, "--mask", str(MASK_PATH)]
    assert main([*argv, "--json", str(tmp_path / "c.json"), "--session", str(session)]) == 0
    run = _stored(session)
    assert np.array_equal(run.mask(), load_mask(MASK_PATH)) and run.image_path == str(IMAGE_PATH)
    capsys.readouterr()
