"""Every session run kind has a result class (core.results.readout.RESULT_TYPES), and a stored
result comes back as that class through core.results.readout.restore_result: for a result of
each kind computed on the bundled shapes-llava, ``from_dict(to_dict(x)).to_dict() ==
to_dict(x)``, and the run the session stored (by the library or by the command line,
which adds its header) restores as ``Run.readout`` to the JSON it holds. A document that
does not fit its class is one error naming the kind (a damaged run in a session)."""

import json
from pathlib import Path

import pytest

import core.cli
from core import load_image, load_model
from core.analyze import analyze
from core.dataset_audit import parse_methods, run_shard
from core.dataset_audit.summaries import AuditSummary, summarize
from core.files.images import load_mask
from core.files.pairs import read_pairs
from core.generate import generate
from core.methods import interventions as iv
from core.methods.counterfactual import Fill, occlusion_sweep, region_counterfactual
from core.methods.flow.attribution import attribution_patching
from core.methods.flow.knockout import knockout_sweep
from core.methods.flow.patch_grid import patch_grid
from core.methods.flow.positions import parse_edges
from core.methods.nonunique import nonunique_of_input
from core.methods.patterns import pattern_statistics
from core.methods.qk_ov import qk_ov
from core.methods.tuned_lens import evaluate_lens, load_lens
from core.results.readout import (
    RESULT_TYPES,
    Note,
    RecordedResult,
    ResultDocumentError,
    jsonable,
    restore_result,
    result_class,
    result_type,
)
from core.session import DamagedRunError, Session
from core.session.records import KINDS
from core.validate import validate
from core.zoo.dataset import write_dataset
from core.zoo.lens_corpus import SyntheticCorpus

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "resources" / "samples"
IMAGE, MASK, OTHER = SAMPLES / "sample_00.png", SAMPLES / "sample_00_obj1.png", SAMPLES / "sample_01.png"
QUESTION = "what shape is the blue object?"


def as_json(doc):
    return json.loads(json.dumps(jsonable(doc)))


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


def dataset_audit(llava, folder: Path) -> AuditSummary:
    """The dataset audit's summary run over two samples, as ``vlm-readout audit`` records it."""
    write_dataset(folder, "heldout", 2)
    methods = parse_methods("answer,counterfactual")
    shard = run_shard(llava, read_pairs(folder), methods, batch_size=2)
    counts = summarize(shard.records, methods, 2, shard.cancelled)
    return AuditSummary(1, {"dataset": str(folder), "methods": ["answer", "counterfactual"]}, **counts, out="out")


@pytest.fixture(scope="module")
def results(llava, tmp_path_factory):
    """One result (or more) of every run kind, computed on shapes-llava with small sizes."""
    image, mask = load_image(IMAGE), load_mask(MASK)
    validation = validate(llava, ["L1.H1"], claim="reads the asked colour", dataset="scenes", n=6, n_side=3)
    inputs = llava.adapter.prepare([image], [QUESTION])
    square, triangle = llava.adapter.token_id("square"), llava.adapter.token_id("triangle")
    lens = load_lens(ROOT / "resources" / "models" / "shapes-llava" / "tuned-lens", llava)
    return {
        "analyze": [analyze(llava, image, QUESTION, foil="triangle")],
        "generate": [generate(llava, image, QUESTION, max_new_tokens=3)],
        "counterfactual": [
            region_counterfactual(llava, image, QUESTION, mask, "mean", foil="triangle"),
            region_counterfactual(llava, image, QUESTION, mask, "blur", radius=2.0, routing=False),
            region_counterfactual(llava, image, QUESTION, mask, "paste", paste_from=str(OTHER), routing=False),
            region_counterfactual(llava, image, QUESTION, mask, "paste", paste_from=load_image(OTHER), routing=False),
        ],
        "sweep": [occlusion_sweep(llava, image, QUESTION, k=4, fill="constant", color=(1, 2, 3), foil="triangle")],
        "intervention": [
            iv.run_interventions(llava, inputs, {"L1.H0 zero": [iv.zero_ablation(1, 0)]}, square, triangle),
            iv.patch_visual_features(llava, image, QUESTION, load_image(OTHER), site="projector_out", answer=square),
        ],
        "knockout": [
            knockout_sweep(
                llava,
                inputs,
                image,
                QUESTION,
                parse_edges("image->answer,word:blue->last"),
                square,
                triangle,
                region=[0, 1],
            )
        ],
        "patch-grid": [patch_grid(llava, image, load_image(OTHER), QUESTION, site="mlp", columns=("image", "answer"))],
        "attribution-patching": [attribution_patching(llava, image, load_image(OTHER), QUESTION, top_k=4)],
        "audit": [dataset_audit(llava, tmp_path_factory.mktemp("pairs"))],
        "nonunique": [nonunique_of_input(llava, image, QUESTION, "L1.H1", mask=mask, steps=5)[0]],
        "qk-ov": [qk_ov(llava, "L1.H1", image, QUESTION)],
        "label": validation.chains,
        "validate": [validation],
        "lens": [evaluate_lens(llava, lens, SyntheticCorpus("heldout"), 2, batch_size=2)],
        "statistics": [pattern_statistics(llava, [(IMAGE, QUESTION, mask), (OTHER, QUESTION, None)])],
        "note": [Note({"text": "L1.H1 reads colour", "seen": [1, 2]})],
    }


def test_every_session_kind_has_a_class_with_from_dict():
    assert set(RESULT_TYPES) == set(KINDS)
    for kind, path in RESULT_TYPES.items():
        cls = result_class(path)
        assert cls.kind == kind and callable(cls.from_dict), kind


def test_every_result_round_trips_through_its_class(results):
    assert set(results) == set(KINDS)
    for kind, found in results.items():
        for result in found:
            doc = as_json(result.to_dict())
            assert result_type(kind, doc) == f"{type(result).__module__}:{type(result).__name__}", kind
            restored = restore_result(kind, doc)
            assert type(restored) is type(result) and restored.kind == kind
            assert as_json(restored.to_dict()) == doc, kind
            assert restored.summary() == result.summary(), kind


def test_each_stored_run_restores_as_its_readout(results, llava, tmp_path, monkeypatch):
    """The runs a session holds, recorded by the library and by the commands (whose JSON adds the
    model and input header, an interpolated sweep map; the dataset audit's summary run)."""
    path = tmp_path / "work.vlmr"
    with Session.create(path) as session:
        for found in results.values():
            for result in found:
                session.record(result, image=IMAGE)
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    common = ["--model", "shapes-llava", "--image", str(IMAGE), "--question", QUESTION, "--quiet"]
    common += ["--session", str(path)]
    for extra in (["--mask", str(MASK), "--fill", "noise", "--seed", "3"], ["--sweep", "4", "--interpolated"]):
        assert core.cli.main(["counterfactual", *common, *extra, "--json", str(tmp_path / "cf.json")]) == 0
    write_dataset(tmp_path / "pairs", "heldout", 2)
    audit = ["audit", "--model", "shapes-llava", "--dataset", str(tmp_path / "pairs"), "--out", str(tmp_path / "a")]
    assert core.cli.main([*audit, "--methods", "answer,counterfactual", "--session", str(path), "--quiet"]) == 0

    with Session.open(path, read_only=True) as session:
        runs = [session.run(info.id) for info in session.runs()]
    assert {run.kind for run in runs} == set(KINDS)
    for run in runs:
        readout = run.readout
        assert type(readout) is result_class(result_type(run.kind, run.result)), run.kind
        assert as_json(readout.to_dict()) == run.result, run.kind
        assert run.readout is readout  # restored once
    command_runs = [run.readout for run in runs[-3:]]
    assert command_runs[0].input["image_sha256"] and command_runs[1].image_size == (128, 128)
    assert command_runs[1].interpolated_map is not None and command_runs[2].n_samples == 2


def test_the_intervention_kind_holds_two_classes_told_apart_by_site(results):
    ablation, patch = results["intervention"]
    assert "site" not in ablation.to_dict() and "site" in patch.to_dict()
    assert type(restore_result("intervention", as_json(ablation.to_dict()))) is type(ablation)
    assert type(restore_result("intervention", as_json(patch.to_dict()))) is type(patch)


def test_a_restored_fill_is_the_fill_recorded(results):
    mean, blur, path_paste, pixels_paste = (
        restore_result("counterfactual", as_json(r.to_dict())) for r in results["counterfactual"]
    )
    assert mean.fill == Fill("mean") and blur.fill.radius == 2.0 and mean.routing is not None and blur.routing is None
    assert path_paste.fill.paste_from == str(OTHER) and path_paste.fill.has_source_file
    assert path_paste.fill.source_sha256 == results["counterfactual"][2].fill.source_sha256
    assert not pixels_paste.fill.has_source_file  # pixels without a file: none to read again
    sweep = restore_result("sweep", as_json(results["sweep"][0].to_dict()))
    assert sweep.fill.color == (1, 2, 3) and sweep.effect.shape == results["sweep"][0].effect.shape


def test_a_document_that_does_not_fit_is_one_error_naming_the_kind(tmp_path):
    for kind, doc, cause in (
        ("counterfactual", {"fill": "mean"}, "KeyError"),
        ("sweep", {"sweep": {"k": 1}}, "KeyError"),
        ("analyze", {"target": {"answer": "yes"}}, "Error: "),
        ("intervention", {"site": "projector_out"}, "KeyError"),
        ("counterfactual", {"fill": "glitter", "fill_parameters": {}}, "RegionError"),
        ("note", ["not", "an", "object"], "a list, not a JSON object"),
    ):
        with pytest.raises(ResultDocumentError) as e:
            restore_result(kind, doc)
        message = str(e.value)
        assert message.startswith(f"the stored {kind} result does not fit ") and "\n" not in message
        assert e.value.kind == kind and cause in e.value.cause
    # a kind without a class of its own (a notebook's) is kept as said
    other = restore_result("notebook", {"n_samples": 3})
    assert isinstance(other, RecordedResult) and other.to_dict() == {"n_samples": 3}

    path = tmp_path / "odd.vlmr"
    with Session.create(path) as session:
        rid = session.record(RecordedResult("counterfactual", {"fill": "mean"}, "hand-made"))
        run = session.run(rid)  # its stored values read; its result does not restore
        with pytest.raises(DamagedRunError) as e:
            _ = run.readout
    assert e.value.run_id == rid and str(e.value).startswith(f"{path}: run {rid}: the stored counterfactual result")
