"""`vlm-readout ablate` and `vlm-readout patch` (core/cli/ablate.py, core/cli/patch.py) on
shapes-llava: the JSON is the engine's own ablation / patch to the last digit, the run lands in
a session with the request's parameters, choices that contradict each other are one line and
exit 2 before the model loads, a component or site the model lacks before anything runs."""

import json

import pytest

import core.cli
from core import load_model
from core.cli import main
from core.files.images import load_image, load_mask
from core.forward.capture import capture
from core.forward.geometry import painted_tokens
from core.methods.component_ablation import KINDS, POSITIONS, ablation_edits, parse_component
from core.methods.interventions import patch_visual_features, run_interventions
from core.models.loading import resources_dir
from core.session import Session

SAMPLES = resources_dir() / "samples"
IMAGE, OTHER, QUESTION = SAMPLES / "sample_00.png", SAMPLES / "sample_01.png", "what shape is the blue object?"
MASK = SAMPLES / "sample_00_obj1.png"  # the blue square


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


@pytest.fixture
def cached(monkeypatch, llava):
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    return llava


def _never_loaded(args):
    raise AssertionError("the model loaded before the refusal")


def _refused(capsys, argv, starts):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {starts}"), err


def test_the_ablation_choices_are_the_engines():
    from core.cli import ablate

    assert (ablate.ABLATIONS, ablate.POSITIONS) == (KINDS, POSITIONS)


def test_ablate_is_the_engines_ablation_and_is_recorded(cached, tmp_path, capsys):
    out, session = tmp_path / "a.json", tmp_path / "s.vlmr"
    argv = ["ablate", "--image", str(IMAGE), "--question", QUESTION, "--component", "L1", "--quiet"]
    argv += ["--ablation", "resample", "--source-image", str(OTHER), "--positions", "region", "--mask", str(MASK)]
    assert main([*argv, "--json", str(out), "--session", str(session)]) == 0
    got = json.loads(out.read_text())

    adapter = cached.adapter
    image = load_image(IMAGE)
    inputs = adapter.prepare([image], [QUESTION])
    base = capture(cached, None, "", pattern_layers=[], inputs=inputs)
    source = capture(cached, None, "", pattern_layers=[], inputs=adapter.prepare([load_image(OTHER)], [QUESTION]))
    mask = load_mask(MASK)
    region = painted_tokens(adapter.visual_tokens(image.size), mask)
    edits = ablation_edits(
        adapter, base, parse_component("L1", base.block_names), kind="resample", positions="region",
        region_tokens=region, source=source,
    )  # fmt: skip
    answer_id = int(base.logits[0, int(base.answer_positions[0])].argmax())
    label = f"L1 resampled at the painted region ({len(region)} visual tokens)"
    engine = run_interventions(cached, inputs, {label: edits}, answer_id, base=base)
    assert got["rows"] == json.loads(json.dumps(engine.to_dict()["rows"]))  # to the last digit
    assert got["ablation"] == "resample" and capsys.readouterr().out.strip().startswith("ablation at position")

    (info,) = Session.open(session, read_only=True).runs()
    run = Session.open(session, read_only=True).run(info.id)
    assert run.kind == "intervention" and run.result == got and run.mask() is not None
    p = run.parameters
    assert (p["component"], p["selected_in"], p["ablation"], p["positions"]) == ("L1", None, "resample", "region")
    assert p["region_tokens"] == region and p["source_image"] == str(OTHER) and p["question"] == QUESTION
    assert (p["typed_target"], p["typed_foil"]) == ("", "")


def test_a_mean_ablation_takes_its_references_and_names_them(cached, tmp_path, capsys):
    out = tmp_path / "a.json"
    argv = ["ablate", "--image", str(IMAGE), "--question", QUESTION, "--component", "L2.mlp", "--quiet"]
    argv += ["--ablation", "mean", "--reference", str(IMAGE), "--reference", str(OTHER), "--json", str(out)]
    assert main(argv) == 0
    audit = json.loads(out.read_text())["audit"]
    assert audit["parameters"]["reference_images"] == [str(IMAGE), str(OTHER)]
    assert audit["parameters"]["n_references"] == 2
    assert "mean over 2 reference runs asked the same question" in audit["controls"]


def test_patch_is_the_engines_patch_and_is_recorded(cached, tmp_path, capsys):
    out, session = tmp_path / "p.json", tmp_path / "s.vlmr"
    argv = ["patch", "--image", str(IMAGE), "--question", QUESTION, "--source-image", str(OTHER), "--quiet"]
    argv += ["--site", "resid", "--layer", "2", "--answer", "square", "--foil", "circle"]
    assert main([*argv, "--json", str(out), "--session", str(session)]) == 0
    got = json.loads(out.read_text())
    n_visual = len(cached.adapter.visual_tokens(load_image(IMAGE).size))
    engine = patch_visual_features(
        cached, load_image(IMAGE), QUESTION, load_image(OTHER), site="resid", layer=2,
        token_sets={"all visual tokens": list(range(n_visual))}, source_image_path=str(OTHER),
        answer="square", foil="circle",
    )  # fmt: skip
    assert got == json.loads(json.dumps(engine.to_dict()))  # to the last digit
    assert capsys.readouterr().out.strip() == engine.summary()
    (info,) = Session.open(session, read_only=True).runs()
    p = Session.open(session, read_only=True).run(info.id).parameters
    assert (p["site"], p["layer"], p["typed_target"], p["typed_foil"]) == ("resid", 2, "square", "circle")
    assert p["source_image_sha256"] == engine.source_image_sha256


@pytest.mark.parametrize(
    "extra, starts",
    [
        (["ablate", "--component", "L1.H0", "--mask", str(MASK)], "--mask goes with --positions region"),
        (["ablate", "--component", "L1.H0", "--positions", "region"], "--mask goes with --positions region"),
        (["ablate", "--component", "L1.H0", "--ablation", "mean"], "--reference goes with --ablation mean"),
        (["ablate", "--component", "L1.H0", "--reference", str(OTHER)], "--reference goes with --ablation mean"),
        (["ablate", "--component", "L1.H0", "--ablation", "resample"], "--source-image goes with --ablation resample"),
        (["ablate", "--component", "L1.H0", "--ablation", "half"], "argument --ablation: invalid choice"),
        (["ablate", "--component", "L1.H0", "--ablation", "mean", "--reference", "missing.png"], "missing.png"),
        (["patch", "--source-image", str(OTHER), "--layer", "1"], "--layer goes with --site resid or --site kv_source"),
        (["patch", "--source-image", str(OTHER), "--site", "embed"], "argument --site: invalid choice"),
        (["patch", "--source-image", "missing.png"], "missing.png"),
    ],
)
def test_contradicting_choices_are_one_line_before_the_model_loads(monkeypatch, capsys, extra, starts):
    monkeypatch.setattr(core.cli, "_load", _never_loaded)
    command, *options = extra
    _refused(capsys, [command, "--image", str(IMAGE), "--question", QUESTION, *options], starts)


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["ablate", "--component", "L9.H0"], "'L9.H0' names no component of this model"),
        (["ablate", "--component", "embed"], "embed: not an activation a forward can ablate"),
        (["patch", "--source-image", str(OTHER), "--site", "kv_source"], "llava: no 'kv_source' site to patch"),
    ],
)
def test_what_the_model_lacks_is_one_line_before_anything_runs(cached, monkeypatch, capsys, tmp_path, argv, starts):
    import core.requests.ablation
    import core.requests.patching

    for request in (core.requests.ablation.AblationRequest, core.requests.patching.PatchingRequest):
        monkeypatch.setattr(request, "run", _never_loaded)
    command, *options = argv
    out = tmp_path / "out.json"
    _refused(capsys, [command, "--image", str(IMAGE), "--question", QUESTION, *options, "--json", str(out)], starts)
    assert not out.exists()


# ---------------------------------------------------------------- the requests themselves


def _request(cls, **fields):
    return cls(image=load_image(IMAGE), question=QUESTION, image_path=str(IMAGE), **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"ablation": "half"}, "ablation 'half': expected one of zero, mean, resample"),
        ({"positions": "some"}, "positions 'some': expected one of target, all, region"),
        ({"positions": "region"}, "the painted region (a mask) goes with positions 'region'"),
        ({"mask": load_mask(MASK)}, "the painted region (a mask) goes with positions 'region'"),
        ({"ablation": "mean"}, "mean ablation needs reference images"),
        ({"references": (str(OTHER),)}, "reference images go with the mean ablation"),
        ({"ablation": "resample"}, "resample ablation needs a source image"),
    ],
)
def test_an_ablation_request_refuses_choices_that_contradict_each_other(fields, message):
    from core.errors import InterventionError
    from core.requests import AblationRequest

    with pytest.raises(InterventionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _request(AblationRequest, component="L1.H0", **fields)


def test_an_ablation_requests_parameters_are_what_its_result_records(cached):
    from core.requests import AblationRequest

    request = _request(
        AblationRequest, component=" L1.mlp", selected_in="dla", ablation="resample",
        source_image=load_image(OTHER), source_image_path=str(OTHER),
    )  # fmt: skip
    result = request.run(cached)
    asked = request.parameters()
    assert asked["component"] == "L1.mlp" and asked["question"] == QUESTION and asked["typed_target"] == ""
    recorded = result.parameters()
    assert {k: recorded[k] for k in request.ablation_parameters()} == request.ablation_parameters()
    assert result.audit.parameters["selected_in"] == "dla"


def test_a_mean_ablation_stops_between_its_references_when_cancelled(cached):
    from core.requests import AblationRequest

    request = _request(AblationRequest, component="L1.H0", ablation="mean", references=(str(IMAGE), str(OTHER)))
    seen = []
    assert request.run(cached, lambda *p: seen.append(p), lambda: len(seen) >= 1) is None
    assert len(seen) == 1  # the first reference's line, then the cancel


def test_a_patch_without_a_site_takes_the_earliest_the_family_reads(cached):
    from core.errors import InterventionError
    from core.requests import PatchingRequest
    from core.requests.patching import default_patch_site, patch_sites

    adapter = cached.adapter
    request = _request(PatchingRequest, source_image=load_image(OTHER))
    assert request.resolved_site(adapter) == (default_patch_site(patch_sites(adapter)), None) == ("projector_out", None)
    assert _request(PatchingRequest, source_image=load_image(OTHER), site="resid").resolved_site(adapter) == (
        "resid",
        0,
    )
    with pytest.raises(InterventionError, match="site 'embed': expected one of"):
        _request(PatchingRequest, source_image=load_image(OTHER), site="embed")
