"""One request, two drivers (issue 28): every registered run kind (:data:`core.requests.REQUESTS`)
asked through the command line (``core.cli.main`` with ``--json`` and ``--session``) and through
the app (the window's one request path: the generic job in a worker, then the window's record
into its session) gives the same request parameters, the same result JSON and the same recorded
run. And the two token rules are one: a typed word of several tokens reads the same token in both.

shapes-llava, loaded once for the module (the window's model cache serves the command line too).
Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

import json
from pathlib import Path

import numpy as np
import pytest

import core.cli
from app.jobs import _cached_model, as_run
from app.samples import bundled_pairs_file, bundled_samples
from core.cli import main
from core.files.images import load_image
from core.methods.counterfactual import mask_from_png
from core.requests import (
    REQUESTS,
    AblationRequest,
    AnalyzeRequest,
    AttributionPatchingRequest,
    AuditRequest,
    CounterfactualRequest,
    GenerateRequest,
    KnockoutRequest,
    NonuniqueRequest,
    PatchGridRequest,
    PatchingRequest,
    QkOvRequest,
    SweepRequest,
    ValidateRequest,
)
from core.session import Session
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle

SAMPLE, OTHER = bundled_samples()[0], bundled_samples()[1]  # the window opens on the first
IMAGE, QUESTION = str(SAMPLE.image_path), SAMPLE.question
MASK = str(SAMPLE.target_mask_path)
# what two runs of the same request cannot share: the wall-clock time a validation took
TIMINGS = ("seconds",)


@pytest.fixture
def app(window, model_cache, monkeypatch):
    """The window on the first sample, its model loaded once into the shared cache, which the
    command line's loader reads too; every request's ``run`` notes the request it ran."""
    assert (window.workspace.input.image_path, window.inputs.question_edit.text()) == (IMAGE, QUESTION)
    loaded = _cached_model(model_cache, window.model_choice(), lambda *a: None)
    monkeypatch.setattr(core.cli, "_load", lambda args: loaded)
    window.ran = []
    for cls in REQUESTS.values():
        # the audit command runs its request's pieces (its shards, then its summary run), not run()
        for method in ("run", "run_shard") if cls is AuditRequest else ("run",):
            monkeypatch.setattr(cls, method, noting(window.ran, getattr(cls, method)))
    return window


def noting(ran: list, method):
    """``method`` that first notes the request it runs on in ``ran`` (each request once)."""

    def noted(self, *args, **kwargs):
        if not any(self is r for r in ran):
            ran.append(self)
        return method(self, *args, **kwargs)

    return noted


def through_the_cli(window, tmp_path, argv: list[str]):
    """``(request, result JSON, recorded run)`` of ``vlm-readout ARGV --json OUT --session FILE``
    (a command without ``--json``, the audit with its output folder: the run's result JSON)."""
    out, session = tmp_path / "cli.json", tmp_path / "cli.vlmr"
    writes_json = argv[0] != "audit"
    window.ran.clear()
    assert main([*argv, *(["--json", str(out)] if writes_json else []), "--session", str(session)]) == 0
    (request,) = window.ran
    with Session.open(session, read_only=True) as s:
        (info,) = s.runs()
        run = s.run(info.id)
    return request, json.loads(out.read_text() if writes_json else json.dumps(run.result)), run


def through_the_app(qtbot, window, request):
    """``(request as it ran, result JSON, recorded run)`` of ``request`` on the window's one request path."""
    window.ran.clear()
    runs_before = len(window.session.runs())
    run_until_idle(qtbot, window, lambda: window.actions.run(request, status="running…"))
    assert window.inputs.error_label.text() == ""
    (info,) = window.session.runs()[runs_before:]
    run_id, result = info.id, shown_result(window, info.kind)  # as the window shows it
    (ran,) = window.ran
    assert ran.parameters() == as_run(request, window.loaded_model()).parameters()
    document = ran.document(result, window.loaded_model())  # the result's JSON, as the window records it
    return ran, json.loads(json.dumps(document)), window.session.run(run_id)


def without_timings(doc):
    """``doc`` without the wall-clock fields two runs cannot share (:data:`TIMINGS`)."""
    if isinstance(doc, dict):
        return {k: without_timings(v) for k, v in doc.items() if k not in TIMINGS}
    if isinstance(doc, list):
        return [without_timings(v) for v in doc]
    return doc


def assert_same(cli, app):
    """The same request parameters, result JSON and recorded run (its kind, result, parameters,
    summary, image and mask) through both drivers."""
    (cli_request, cli_doc, cli_run), (app_request, app_doc, app_run) = cli, app
    assert type(cli_request) is type(app_request)
    assert cli_request.parameters() == app_request.parameters()
    assert without_timings(cli_doc) == without_timings(app_doc)
    assert cli_run.kind == app_run.kind
    assert without_timings(cli_run.result) == without_timings(app_run.result)
    assert cli_run.parameters == app_run.parameters
    assert cli_run.summary == app_run.summary
    assert (cli_run.image is None) == (app_run.image is None)
    if cli_run.image is not None:
        assert (cli_run.image.sha256, cli_run.image.path) == (app_run.image.sha256, app_run.image.path)
    cli_mask, app_mask = cli_run.mask(), app_run.mask()
    assert (cli_mask is None) == (app_mask is None)
    if cli_mask is not None:
        np.testing.assert_array_equal(cli_mask, app_mask)


def asked(window, **fields) -> dict:
    """The shown input's request fields as the window fills them (its image, question, Target
    and foil fields, the answer token read out), with ``fields`` typed into them first."""
    window.inputs.target_edit.setText(fields.pop("answer", ""))
    window.inputs.foil_edit.setText(fields.pop("foil", ""))
    return {**window.actions.asked(), **fields}


def the_mask(window) -> np.ndarray:
    return mask_from_png(MASK, window.image.size)


# one case per run kind: the command line, and the request the app runs for the same choices
def analyze_case(window, loaded):
    lens = str(loaded.path / "tuned-lens")  # the app reads the lens beside the weights (app.jobs.as_run)
    argv = ["analyze", "--image", IMAGE, "--question", QUESTION, "--foil", "circle", "--lens", lens]
    return argv, AnalyzeRequest(**asked(window, foil="circle"))


def generate_case(window, loaded):
    argv = ["generate", "--image", IMAGE, "--question", QUESTION, "--max-new-tokens", "3"]
    return argv, GenerateRequest(image=window.image, image_path=IMAGE, question=QUESTION, max_new_tokens=3)


def counterfactual_case(window, loaded):
    argv = ["counterfactual", "--image", IMAGE, "--question", QUESTION, "--mask", MASK, "--fill", "blur"]
    argv += ["--radius", "2", "--answer", "square"]
    fields = asked(window, answer="square")
    return argv, CounterfactualRequest(**fields, mask=the_mask(window), mask_name=MASK, fill="blur", radius=2.0)


def sweep_case(window, loaded):
    argv = ["counterfactual", "--image", IMAGE, "--question", QUESTION, "--sweep", "4", "--fill", "noise"]
    argv += ["--seed", "3"]
    return argv, SweepRequest(**asked(window), k=4, fill="noise", seed=3)


def ablation_case(window, loaded):
    argv = ["ablate", "--image", IMAGE, "--question", QUESTION, "--component", "L1.H2", "--ablation", "mean"]
    argv += ["--reference", IMAGE, "--reference", str(OTHER.image_path), "--positions", "region", "--mask", MASK]
    request = AblationRequest(
        **asked(window), component="L1.H2", ablation="mean", positions="region", mask=the_mask(window),
        references=(IMAGE, str(OTHER.image_path)),
    )  # fmt: skip
    return argv, request


def patching_case(window, loaded):
    other = str(OTHER.image_path)
    argv = ["patch", "--image", IMAGE, "--question", QUESTION, "--source-image", other, "--mask", MASK]
    argv += ["--site", "resid", "--layer", "1", "--foil", "circle"]
    request = PatchingRequest(
        **asked(window, foil="circle"), source_image=load_image(other), source_image_path=other,
        mask=the_mask(window), site="resid", layer=1,
    )  # fmt: skip
    return argv, request


def knockout_case(window, loaded):
    argv = ["knockout", "--image", IMAGE, "--question", QUESTION, "--edges", "image->answer,region->last"]
    argv += ["--mask", MASK, "--window", "2", "--heads", "0,2", "--foil", "circle"]
    request = KnockoutRequest(
        **asked(window, foil="circle"), edges=("image->answer", "region->last"), window=2, heads=(0, 2),
        mask=the_mask(window),
    )  # fmt: skip
    return argv, request


def patch_grid_case(window, loaded):
    other = str(OTHER.image_path)
    argv = ["patch-grid", "--image", IMAGE, "--question", QUESTION, "--source-image", other, "--mask", MASK]
    argv += ["--site", "attn", "--columns", "region,question,answer", "--answer", "square", "--foil", "circle"]
    request = PatchGridRequest(
        **asked(window, answer="square", foil="circle"), source_image=load_image(other), source_image_path=other,
        site="attn", columns=("region", "question", "answer"), mask=the_mask(window),
    )  # fmt: skip
    return argv, request


def attribution_case(window, loaded):
    other = str(OTHER.image_path)
    argv = ["attribution-patching", "--image", IMAGE, "--question", QUESTION, "--source-image", other]
    argv += ["--top-k", "6", "--foil", "circle"]
    request = AttributionPatchingRequest(
        **asked(window, foil="circle"), source_image=load_image(other), source_image_path=other, top_k=6
    )
    return argv, request


def nonunique_case(window, loaded):
    argv = ["nonunique", "--image", IMAGE, "--question", QUESTION, "--head", "L1.H1", "--region", MASK]
    argv += ["--levels", "a", "b", "--steps", "5"]
    request = NonuniqueRequest(
        **asked(window), head="L1.H1", mask=the_mask(window), mask_name=MASK, levels=("a", "b"), steps=5
    )
    return argv, request


def qk_ov_case(window, loaded):
    argv = ["qk-ov", "--head", "L2.H0", "--image", IMAGE, "--question", QUESTION]
    return argv, QkOvRequest(**asked(window), head="L2.H0")


def validate_case(window, loaded):
    argv = ["validate", "--head", "L1.H1", "--claim", "reads the named object", "--dataset", "scenes"]
    argv += ["--n", "6", "--n-side", "2"]
    return argv, ValidateRequest(subjects=("L1.H1",), claim="reads the named object", dataset="scenes", n=6, n_side=2)


def audit_case(window, loaded, tmp_path: Path):
    dataset = str(bundled_pairs_file())
    argv = ["audit", "--dataset", dataset, "--limit", "2", "--methods", "answer,attention", "--out"]
    argv.append(str(tmp_path / "audit"))
    return argv, AuditRequest(dataset=dataset, limit=2, methods="answer,attention")


CASES = {
    "analyze": analyze_case,
    "generate": generate_case,
    "counterfactual": counterfactual_case,
    "sweep": sweep_case,
    "ablation": ablation_case,
    "patching": patching_case,
    "knockout": knockout_case,
    "patch-grid": patch_grid_case,
    "attribution-patching": attribution_case,
    "nonunique": nonunique_case,
    "qk-ov": qk_ov_case,
    "validate": validate_case,
    "audit": audit_case,
}


def test_every_registered_request_kind_has_a_case():
    assert set(CASES) == set(REQUESTS)


@pytest.mark.parametrize("kind", list(CASES))
def test_the_same_request_through_the_cli_and_the_app(qtbot, app, tmp_path, kind):
    loaded = app.loaded_model()
    case = CASES[kind]
    argv, request = case(app, loaded, tmp_path) if kind == "audit" else case(app, loaded)
    cli = through_the_cli(app, tmp_path, argv)
    ran = through_the_app(qtbot, app, request)
    if kind == "audit":  # where the command wrote its per-sample files (its --out); the app writes none
        assert (cli[1].pop("out"), cli[2].result.pop("out")) == (argv[-1], argv[-1])
        assert (ran[1].pop("out"), ran[2].result.pop("out")) == (None, None)
    if kind == "qk-ov":  # the factored SVD (float32 QR + SVD) differs by ~1e-7 between threads
        for _, doc, run in (cli, ran):
            for d in (doc, run.result):
                for circuit in ("qk", "ov"):
                    values = d["weight_level"][circuit].pop("singular_values")
                    d["weight_level"][circuit]["singular_values"] = [round(v, 5) for v in values]
    assert_same(cli, ran)


def test_a_typed_word_of_several_tokens_reads_the_same_token_in_both(qtbot, app, tmp_path, capsys):
    """The Target field and ``--answer`` go through one rule (core.answer_text.typed_token): "blue
    square" is two tokens for shapes-llava; both read its first, "blue"."""
    argv = ["ablate", "--image", IMAGE, "--question", QUESTION, "--component", "L0.mlp", "--answer", "blue square"]
    cli = through_the_cli(app, tmp_path, argv)
    assert "reading its first sub-token 'blue'" in capsys.readouterr().err
    request = AblationRequest(**asked(app, answer="blue square"), component="L0.mlp")
    assert request.answer == "blue square"  # the field as typed
    ran = through_the_app(qtbot, app, request)
    adapter = app.loaded_model().adapter
    blue = adapter.token_id("blue")
    assert cli[1]["original"]["answer_id"] == ran[1]["original"]["answer_id"] == blue
    assert request.tokens(adapter)["answer"] == blue
    assert_same(cli, ran)


def test_the_generic_job_runs_nothing_once_cancelled(app, model_cache):
    import threading

    from app.jobs import request_job

    cancelled = threading.Event()
    cancelled.set()
    app.ran.clear()
    request = QkOvRequest(**asked(app), head="L0.H0")
    assert request_job(model_cache, app.model_choice(), request, progress=lambda *p: None, cancel=cancelled) is None
    assert app.ran == []
