"""`vlm-readout validate` and its library call (core.validate): the command's
chain is the library's to the last digit on both default models, the run lands
in a session and its export; a dataset folder of the scenes gives the scenes'
own numbers; random weights (a std-matched noise copy of each default model
and the tiny random model of every served family) never give "supported";
bad subjects, data and held-out sets are one-line errors."""

import csv
import importlib
import itertools
import json
import math
import os
import shutil

import numpy as np
import pytest
from PIL import Image

import core
import core.cli
from core import load_model
from core.cli import main
from core.methods.validation import STEP_STATUSES
from core.methods.validation.spec import SHIPPED
from core.methods.validation.stats import poisson_binomial_tail
from core.validate import Validation, read_chain_data, validate
from core.zoo.dataset import JSONL_NAME, write_dataset
from core.zoo.random_weights import randomize_folder

N, N_SIDE = 16, 6
FAMILIES = [("blip", "blip"), ("idefics3", "idefics3"), ("llava_next", "llava_next"), ("mllama", "mllama")]
FAMILIES += [("paligemma", "prefix"), ("qwen2_vl", "qwen2_vl"), ("qwen2_vl", "qwen2_5_vl")]
SUBJECTS = {"shapes-llava": ["L1.H1", "L1.H0+L1.H2"], "shapes-coca": ["L1.xattn.H2", "L1.xattn.H1+H3"]}


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name) for name in SUBJECTS}


def _without_time(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "seconds"}


def _validate_args(out, *extra):
    common = ["--claim", "moves the asked colour", "--n", str(N), "--n-side", str(N_SIDE), "--json", str(out)]
    return ["validate", *common, "--quiet", *extra]


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_the_command_is_the_library_call_and_lands_in_the_session(name, models, tmp_path, monkeypatch, capsys):
    m = models[name]
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out, session = tmp_path / "v.json", tmp_path / "s.vlmr"
    heads, route = SUBJECTS[name]
    args = _validate_args(out, "--head", heads, "--route", route, "--dataset", "scenes", "--session", str(session))
    assert main(args) == 0
    got = json.loads(out.read_text())
    library = validate(m, [heads, route], claim="moves the asked colour", dataset="scenes", n=N, n_side=N_SIDE)
    assert _without_time(got) == _without_time(json.loads(json.dumps(library.to_dict())))  # to the last digit
    assert got["schema_version"] == 1 and got["kind"] == "validate"
    assert [c["subject"] for c in got["chains"]] == [heads, route.replace(f"+{route.split('.')[0]}.", "+")]
    assert got["search"]["split"] == "val" and got["heldout"]["split"] == "heldout"
    for chain in got["chains"]:
        assert set(chain["steps"]) == {str(k) for k in range(1, 8)}
        assert all(s["status"] in STEP_STATUSES for s in chain["steps"].values())
        assert all(s["n"] > 0 for s in chain["steps"].values() if s["status"] != "not tested")
    for v in got["verdicts"]:  # the verdict names the held-out distribution
        assert ("supported on " if v["supported"] else "not supported on ") + "core.zoo.scenes split 'heldout'" in v[
            "verdict"
        ]
    assert Validation.from_dict(got).to_dict() == got  # it reads back as it was written
    printed = capsys.readouterr().out
    assert "verdict: " in printed and f"{heads} (head): " in printed and "  4 " in printed

    export = tmp_path / "audit.csv"
    assert main(["export", "--session", str(session), "--format", "csv", "--out", str(export)]) == 0
    rows = list(csv.DictReader(export.open()))
    assert {r["kind"] for r in rows} == {"validate"}
    assert len(rows) == len(library.audit_records()) > 2 * 7 - 1  # each chain's row and each tested step's
    assert any("the label holds on its input condition only" in r["notes"] for r in rows)


def test_a_dataset_folder_of_the_scenes_gives_the_scenes_numbers(models, tmp_path, written_scenes):
    """The same scenes written as files (images and object masks, core.zoo.dataset) and read
    back give the scenes' step 1, 2, 3 and 5 numbers exactly; their swaps are drawn from the
    lines' objects, so step 4 is tested."""
    m = models["shapes-llava"]
    folders = _scene_files(tmp_path, written_scenes, N + 4)
    kw = dict(claim="moves the asked colour", n=N, n_side=0)
    files = validate(m, ["L1.H1"], dataset=folders["val"], heldout=folders["heldout"], **kw)
    scenes = validate(m, ["L1.H1"], dataset="scenes", **kw)
    a, b = files.chains[0].steps, scenes.chains[0].steps
    assert files.heldout.n_samples == scenes.heldout.n_samples == N
    for k in (1, 2, 3, 5):
        assert a[k].status == b[k].status and a[k].value == b[k].value, k
    assert a[4].status != "not tested" and a[4].n > 0
    assert a[7].status == "not tested"  # the folders hold no other question kind


def test_poisson_binomial_tail_is_the_exact_tail():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 0.4, 7)
    for k in range(9):
        exact = sum(
            math.prod(q if hit else 1 - q for q, hit in zip(p, hits))
            for hits in itertools.product((0, 1), repeat=len(p))
            if sum(hits) >= k
        )
        assert poisson_binomial_tail(k, p) == pytest.approx(exact, abs=1e-12)
    # one hit in one sample is no evidence, whatever the normal approximation says
    assert poisson_binomial_tail(1, [0.031]) == pytest.approx(0.031)


def _tiny(family, kind):
    """A family file's tiny random model, and a question its small vocabulary holds."""
    module = importlib.import_module(f"tests.core.test_{family}")
    return module.traced_case(kind)[0], getattr(module, "QUESTION", None) or module.PREFIX


SCENE_LINES = 80  # the most lines a test's scene folders take


@pytest.fixture(scope="module")
def written_scenes(tmp_path_factory) -> dict:
    """Attribute scenes of val and heldout written once as dataset folders (core.zoo.dataset):
    the ~4 s of drawing and PNG writing that eight tests each repeated, done once."""
    root = tmp_path_factory.mktemp("scenes")
    for split in ("val", "heldout"):
        write_dataset(root / split, split, SCENE_LINES, kind="attribute", min_distractors=1)
    return {split: root / split for split in ("val", "heldout")}


def _scene_files(tmp_path, written_scenes, n, question=None, words=None) -> dict:
    """The first ``n`` lines of the written scenes as this test's own dataset folders (what
    ``write_dataset(folder, split, n, ...)`` writes: a line-prefix of the same draw; the image and
    mask files are hard links to the written ones); for a tiny model's small vocabulary each
    line's question is replaced by ``question`` and only the lines whose answer and foil are
    both in ``words`` are kept."""
    assert n <= SCENE_LINES
    out = {}
    for split, written in written_scenes.items():
        folder = tmp_path / split
        # not the JSONL (written below) nor the manifest (its n is the written folder's)
        shutil.copytree(written, folder, copy_function=os.link, ignore=shutil.ignore_patterns("*.json*"))
        rows = [json.loads(line) for line in (written / JSONL_NAME).read_text().splitlines()][:n]
        if question is not None:
            rows = [{**r, "question": question} for r in rows if {r["answer"], r["foil"]} <= words]
        (folder / JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[split] = str(folder)
    return out


@pytest.fixture(scope="module")
def random_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("random")
    return {name: randomize_folder(name, root / name) for name in SUBJECTS}


@pytest.mark.parametrize("spec", list(SHIPPED))
@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_random_weights_support_no_label(name, spec, random_folders, tmp_path):
    """The negative control through the command, for every shipped specification: a noise
    copy of the default model, five candidates found on the scenes, and no chain may come
    out "supported"."""
    folder = random_folders[name]
    out = tmp_path / "v.json"
    args = ["--model", str(folder), "--candidates", "5", "--dataset", "scenes", "--spec", spec]
    assert main(_validate_args(out, *args)) == 0
    got = json.loads(out.read_text())
    assert got["specification"] == SHIPPED[spec].to_dict()
    heads = [c for c in got["chains"] if c["subject_kind"] == "head"]
    assert len(heads) >= 5
    assert got["model"]["fingerprint"] != load_model(name).fingerprint
    assert not any(v["supported"] for v in got["verdicts"]), got["verdicts"]


@pytest.mark.parametrize("family,kind", FAMILIES)
def test_a_tiny_random_model_of_each_family_supports_no_label(family, kind, tmp_path, monkeypatch, written_scenes):
    """The command on a served family's tiny random model: five candidates (mllama reads the
    image in one cross block of four heads), no "supported", the run in a session and its export."""
    m, question = _tiny(family, kind)
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    words = set()
    for word in ("red", "green", "blue", "yellow", "purple", "orange", "circle", "square", "triangle"):
        try:
            m.adapter.token_id(word)
            words.add(word)
        except core.ReadoutError:
            pass
    files = _scene_files(tmp_path, written_scenes, SCENE_LINES, question, words)
    out, session, export = tmp_path / "v.json", tmp_path / "s.vlmr", tmp_path / "audit.md"
    args = ["--candidates", "5", "--dataset", files["val"], "--heldout", files["heldout"], "--session", str(session)]
    assert main(_validate_args(out, *args)) == 0
    got = json.loads(out.read_text())
    assert got["schema_version"] == 1 and got["search"]["n_samples"] >= 8 and got["heldout"]["n_samples"] >= 8
    heads = {c["subject"] for c in got["chains"] if c["subject_kind"] == "head"}
    assert len(heads) >= min(5, len(got["search_table"]))
    assert not any(v["supported"] for v in got["verdicts"]), got["verdicts"]
    assert all(len(c["steps"]) == 7 and c["steps"]["1"]["n"] > 0 for c in got["chains"])
    assert main(["export", "--session", str(session), "--format", "md", "--out", str(export)]) == 0
    assert "validate" in export.read_text()


def _pairs_file(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _scene_rows(tmp_path, split="val", n=6):
    write_dataset(tmp_path / split, split, n, kind="attribute", min_distractors=1)
    return [json.loads(x) for x in (tmp_path / split / "dataset.jsonl").read_text().splitlines()]


def _error(capsys, args) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_subjects_and_data_are_one_line_errors(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(core.cli, "_load", lambda args: models["shapes-coca"])
    out = tmp_path / "v.json"
    base = _validate_args(out, "--dataset", "scenes")
    assert "reads no visual token" in _error(capsys, [*base, "--head", "T0.H0"])  # CoCa's text tower
    assert "share one block" in _error(capsys, [*base, "--route", "L0.xattn.H0+L1.xattn.H0"])
    assert "each head once" in _error(capsys, [*base, "--route", "L0.xattn.H0+H0"])
    assert "name a head or route" in _error(capsys, base)
    assert "no such scene split" in _error(capsys, [*base[:-2], "--dataset", "scenes:nope", "--head", "L1.xattn.H0"])
    assert "held-out split itself" in _error(
        capsys, [*base[:-2], "--dataset", "scenes:heldout", "--head", "L1.xattn.H0"]
    )
    assert "state the claim" in _error(capsys, [*base, "--head", "L1.xattn.H0", "--claim", " "])
    assert not out.exists()

    monkeypatch.setattr(core.cli, "_load", lambda args: models["shapes-llava"])
    rows = _scene_rows(tmp_path)
    for r in rows:
        for key in ("image", "object_masks", "target_mask", "reference_mask", "distractor_masks"):
            v = r[key]
            r[key] = f"val/{v}" if isinstance(v, str) else [f"val/{x}" for x in v] if isinstance(v, list) else v
    good = _pairs_file(tmp_path, rows)
    file_args = _validate_args(out, "--head", "L1.H1", "--dataset", str(good))
    same = _error(capsys, [*file_args, "--heldout", str(good)])
    assert "the held-out set is the search set's file" in same
    copy = _pairs_file(tmp_path, rows[:2], "copy.jsonl")
    assert "also in the search set" in _error(capsys, [*file_args, "--heldout", str(copy)])

    no_foil = _pairs_file(tmp_path, [{k: v for k, v in rows[0].items() if k != "foil"}], "no_foil.jsonl")
    assert 'needs "answer" and "foil"' in _error(capsys, [*file_args[:-2], "--dataset", str(no_foil)])
    bare = {k: v for k, v in rows[0].items() if k not in ("object_masks", "target_mask", "distractor_masks")}
    no_mask = _pairs_file(tmp_path, [bare, bare], "no_mask.jsonl")
    assert "no target region" in _error(capsys, [*file_args[:-2], "--dataset", str(no_mask)])
    small = tmp_path / "small.png"
    Image.new("L", (8, 8), 255).save(small)
    err = _error(capsys, [*file_args[:-2], "--dataset", str(no_mask), "--region", str(small)])
    assert "painted region is 8x8" in err
    two_words = _pairs_file(tmp_path, [{**rows[0], "answer": "light red"}], "words.jsonl")
    assert "not a single token" in _error(capsys, [*file_args[:-2], "--dataset", str(two_words)])
    assert not out.exists()


def test_a_painted_region_and_a_halved_file(models, tmp_path):
    """Lines without masks take the painted region as their target; without a held-out file
    the lines are halved with the seed, and the halves are disjoint."""
    m = models["shapes-llava"]
    rows = _scene_rows(tmp_path, n=8)
    shutil.copytree(tmp_path / "val" / "images", tmp_path / "images")
    bare = [{k: v for k, v in r.items() if k not in ("object_masks", "target_mask", "distractor_masks")} for r in rows]
    path = _pairs_file(tmp_path, bare)
    region = np.zeros((128, 128), dtype=bool)
    region[32:96, 32:96] = True
    search, held = read_chain_data(m, str(path), region=region, min_distractors=0, n_side=0)
    assert search.condition.split == "search half" and held.condition.split == "held-out half"
    lines = set(search.condition.seeds["lines"]), set(held.condition.seeds["lines"])
    assert lines[0] and lines[1] and not lines[0] & lines[1]
    assert all(s.objects[s.target].source == "painted region" for s in search.samples + held.samples)
    assert all((s.objects[s.target].mask == region).all() for s in search.samples)


def test_cancel_keeps_the_steps_done(models):
    m = models["shapes-llava"]
    seen = []

    def progress(done, total, message):
        seen.append(message)

    result = validate(
        m,
        ["L1.H1"],
        claim="moves the asked colour",
        dataset="scenes",
        n=N,
        n_side=0,
        progress=progress,
        cancel=lambda: any("step 3" in s for s in seen),
    )
    steps = result.chains[0].steps
    assert result.cancelled
    assert steps[1].status != "not tested" and steps[2].status != "not tested"
    assert all(steps[k].status == "not tested" for k in range(3, 8))
    assert "[cancelled]" in result.summary()


def test_help_explains_each_argument(capsys):
    from core.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["validate"]
    for action in sub._actions:
        assert action.help, action.option_strings
    assert main(["validate", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--head", "--route", "--candidates", "--claim", "--dataset", "--heldout", "--region", "--session"):
        assert flag in out


def test_steps_passed_names_the_steps_and_the_summary_the_relation_tested():
    """Issue 31: a summary that read "not a candidate (steps passed 7)" was read as seven
    passes when only step 7 passed: the count is "k of 7" with the steps named, and the
    summary names the relation tested, the held-out condition and its n."""
    from core.methods.validation.chain import ChainStep, InputCondition, ValidationChain
    from core.validate import Claim, Validation

    condition = InputCondition("scenes", "heldout", 1, kinds=("attribute",))
    chain = ValidationChain("L3.H2", "moves the asked attribute", "m", condition)
    for k in range(1, 8):
        status = "passed" if k == 7 else "failed" if k == 1 else "not tested"
        chain.record(ChainStep(k, "", status, "x", None, 1, "heldout"))
    assert chain.steps_passed() == "steps passed: 1 of 7 (step 7)"
    validation = Validation(Claim("writes the yes/no answer"), "m", "", condition, condition, [chain])
    summary = validation.summary()
    assert "steps passed: 1 of 7 (step 7)" in summary and "(steps passed 7)" not in summary
    assert f"relation tested: {validation.claim.relation!r}, on {condition.describe()}" in summary and "n=1," in summary
    (verdict,) = validation.verdicts()
    assert verdict["steps_passed"] == [7] and verdict["n"] == 1 and verdict["verdict"].endswith("(step 7)")
    chain.steps[1].status = chain.steps[2].status = "passed"
    assert chain.steps_passed() == "steps passed: 3 of 7 (steps 1, 2, 7)"


def test_step_one_power_refuses_a_set_it_cannot_pass_on_with_the_smallest_n():
    """Every sample a hit is step 1's best case: p = prod chance_i. One sample at chance 0.03
    gives p = 0.03 > 0.00135: refused, with the smallest n whose best case passes (2: 0.0009)."""
    from core.methods.validation.power import StepOnePower
    from core.methods.validation.stats import poisson_binomial_tail

    one = StepOnePower.of([0.03])
    assert not one.can_pass and one.best_p == pytest.approx(poisson_binomial_tail(1, [0.03]))
    assert one.minimum_n == 2 and StepOnePower.of([0.03, 0.03]).can_pass
    assert "held-out n=1 is too small" in one.refusal() and "step 1 could pass is 2" in one.refusal()
    # a sample whose target covers no patch token cannot hit: it does not help the best case
    assert StepOnePower.of([0.3, 0.0, 0.3]).best_p == pytest.approx(0.09)
    # at chance 0.5 six hits give 0.0156, eight 0.0039, ten 0.00098: the minimum is 10
    assert StepOnePower.of([0.5] * 9).minimum_n == 10 and not StepOnePower.of([0.5] * 9).can_pass
    assert StepOnePower.of([1.0]).minimum_n is None and "no n could" in StepOnePower.of([1.0]).refusal()


def test_a_held_out_set_too_small_for_step_one_is_refused_in_one_line(models, tmp_path, capsys):
    out = tmp_path / "v.json"
    argv = ["validate", "--head", "L1.H1", "--claim", "writes the yes/no answer", "--dataset", "scenes", "--n", "1"]
    assert main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: held-out n=1 is too small") and not out.exists()
    assert "the smallest n at which step 1 could pass is" in err[0]


def test_a_users_specification_file_round_trips(models, tmp_path, monkeypatch, capsys):
    """A specification file of the user's: its thresholds decide the steps (the criteria the
    result records name them), the verdict names its relation, and it is recorded, exported
    and read back (load, run, record, export, reopen) with the same fields."""
    from core.methods.validation.spec import ClaimSpec
    from core.session import Session

    m = models["shapes-llava"]
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    fields = {
        "name": "colour-reader",
        "relation": "reads the colour of the asked shape at the answer position",
        "hit_p": 0.001,
        "prediction_r": 0.6,
        "effect_size": 1.5,
    }
    spec_file, out, session = tmp_path / "claim.json", tmp_path / "v.json", tmp_path / "s.vlmr"
    spec_file.write_text(json.dumps(fields))
    args = _validate_args(out, "--head", "L1.H1", "--dataset", "scenes", "--spec", str(spec_file))
    assert main([*args, "--session", str(session)]) == 0
    got = json.loads(out.read_text())
    spec = ClaimSpec.from_dict(got["specification"])
    assert spec == ClaimSpec(**fields) and got["claim"]["relation"] == fields["relation"]
    assert "<= 0.001" in got["criteria"]["1"] and "r >= 0.6" in got["criteria"]["3"]
    assert "relation tested: 'reads the colour of the asked shape" in capsys.readouterr().out
    back = Validation.from_dict(got)
    assert back.spec == spec and back.to_dict() == got
    with Session.open(session, read_only=True) as s:  # reopened: the run and its specification
        (info,) = s.runs("validate")
        restored = s.run(info.id)
        assert restored.parameters["specification"] == ClaimSpec(**fields).to_dict()  # every field, defaults too
        assert restored.readout.spec == spec and restored.readout.to_dict() == got
    export = tmp_path / "audit.csv"
    assert main(["export", "--session", str(session), "--format", "csv", "--out", str(export)]) == 0
    rows = list(csv.DictReader(export.open()))
    assert any("reads the colour of the asked shape" in r["notes"] for r in rows)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"name": "x", "relation": "y", "hit_p": 2}', "'hit_p' 2 is outside (0, 1]"),
        ('{"name": "x", "relation": "y", "sorces": "z"}', "unknown field 'sorces'"),
        ('{"relation": "y"}', "missing field 'name'"),
        ('{"name": "x", "relation": "y", "sources": "nowhere"}', "'sources' 'nowhere': expected one of"),
        ('{"name": "x", "relation": "y", "sources": "previous_token"}', "'counterfactual' 'attribute_swap' does not"),
        (
            '{"name": "x", "relation": "y", "sources": "after_earlier_occurrence", "content": "copy", '
            '"counterfactual": "shift"}',
            "'query' 'answer' does not fit",
        ),
        ('{"name": "x", "relation": "y", "templates": "shape_of_color"}', "'templates' must be a list"),
        ('{"name": "x", "relation": "y", "stated_r": 1.5}', "'stated_r' 1.5 is outside (0, 1)"),
        ('{"name": "x", "relation": "y", "effect_size": "big"}', "'effect_size' must be a finite number"),
        ("[1, 2]", "expected an object of fields"),
        ("{not json", "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deep"),  # hostile: no traceback
        (" " * (1 << 21), "is not a claim specification (at most 1,048,576)"),
    ],
)
def test_an_invalid_specification_file_is_one_line_naming_the_field(tmp_path, monkeypatch, capsys, content, message):
    spec_file, out = tmp_path / "claim.json", tmp_path / "v.json"
    spec_file.write_text(content)
    monkeypatch.setattr(core.cli, "_load", lambda args: pytest.fail("the model loads only for a readable claim"))
    args = _validate_args(out, "--head", "L1.H1", "--dataset", "scenes", "--spec", str(spec_file))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {spec_file}") and message in err[0], err
    assert not out.exists()


def test_a_stated_effect_sets_step_fives_minimum_n(models, tmp_path, monkeypatch, capsys):
    """At a standardised drop of 0.5, step 5's 95% interval excludes zero only from n = 16
    (1.96 / sqrt(n) < 0.5): a held-out set of 6 is refused before any forward, with that n."""
    from core.methods.validation.spec import ClaimSpec

    assert ClaimSpec("x", "y", effect_size=0.5).minimum_n_step5() == 16
    assert ClaimSpec("x", "y", effect_size=1.96 / 3).minimum_n_step5() == 10  # 1.96 / sqrt(9) is not below it
    assert ClaimSpec("x", "y").minimum_n_step5() is None
    m = models["shapes-llava"]
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    spec_file, out = tmp_path / "claim.json", tmp_path / "v.json"
    spec_file.write_text(json.dumps({"name": "x", "relation": "y", "effect_size": 0.5}))
    args = _validate_args(out, "--head", "L1.H1", "--dataset", "scenes", "--spec", str(spec_file))
    assert main([*args, "--n", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "held-out n=6 is too small for the stated effect" in err[0] and "from n=16" in err[0]
