"""`vlm-readout nonunique`: its JSON is the library call's to the last digit (shapes-llava,
shapes-coca and a tiny random model of every served family), the default source set
follows the rule it states, --session records it and export lists its audit row, and bad
input is one line ``error: ...`` with exit status 2."""

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

import core.cli
from core import load_model
from core.cli import build_parser, main
from core.files.images import load_image
from core.forward.capture import capture
from core.forward.geometry import region_tokens
from core.methods.nonunique import NonuniqueResult, nonunique_attention, visual_token_keys
from core.models.loading import resources_dir
from core.session import Session
from tests.core.exactness import noise_image
from tests.core.test_family_conformance import FAMILY_FILES, Case, _cases

SAMPLE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"
HEADER = ("component", "region", "model", "input")  # what the command adds to the method's JSON
FAST = ["--steps", "20", "--quiet"]  # enough steps for the comparison: both sides run the same search


def _command_doc(argv, tmp_path, name="out.json"):
    out = tmp_path / name
    assert main([*argv, "--json", str(out), *FAST]) == 0
    return json.loads(out.read_text())


def _library_doc(loaded, image_path, question, block, head, keys) -> dict:
    """The library call on the same input, through a JSON round trip (as the command writes it)."""
    image = load_image(image_path)
    inputs = loaded.adapter.prepare([image], [question])
    tr = capture(loaded, image, question, pattern_layers=[block], inputs=inputs)
    res = nonunique_attention(loaded.adapter, tr, block, head, sources=keys, steps=20)
    return json.loads(json.dumps(res.to_dict(), allow_nan=False)), tr


def _method_part(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in HEADER}


def _fewest_holding(weights: torch.Tensor, share: float) -> set[int]:
    """Indices of the fewest entries of ``weights``, largest first, whose sum reaches ``share`` of the total."""
    order = weights.argsort(descending=True, stable=True)
    cum = weights[order].cumsum(0)
    n = int((cum < share * weights.sum()).sum()) + 1
    return set(order[:n].tolist())


def test_shapes_llava_default_set_equals_the_library_and_records_into_a_session(tmp_path, capsys):
    session = tmp_path / "s.vlmr"
    argv = ["nonunique", "--model", "shapes-llava", "--image", str(SAMPLE), "--question", QUESTION, "--head", "L1.H2"]
    doc = _command_doc([*argv, "--session", str(session)], tmp_path)
    m = load_model("shapes-llava")
    assert doc["schema_version"] == 1 and doc["kind"] == "nonunique" and doc["component"] == "L1.H2"
    region = doc["region"]
    block = [name for name, _ in m.adapter.blocks].index("L1")
    lib, tr = _library_doc(m, SAMPLE, QUESTION, block, 2, region["keys"])
    assert _method_part(doc) == lib
    # the stated rule, recomputed: the fewest patch tokens holding half the head's attention on the patches
    tokens = m.adapter.visual_tokens(load_image(SAMPLE).size, tr.visual_positions[0].tolist())
    patches = [i for i, t in enumerate(tokens) if t.col >= 0]
    keys = tr.visual_positions[0][patches]
    weights = tr.patterns[block][0, 2, 0, keys].double()
    chosen = _fewest_holding(weights, 0.5)
    assert region["keys"] == sorted(int(keys[i]) for i in chosen)
    assert region["visual_tokens"] == sorted(patches[i] for i in chosen) and region["mask"] is None
    assert doc["sources"] == region["keys"]
    assert {lv["level"] for lv in doc["levels"]} == {"a", "b", "c-query", "c-residual"}
    assert all(lv["certified_min_source_mass"] is not None for lv in doc["levels"] if lv["level"] in ("a", "b"))
    assert doc["does_not_say"] and doc["verdict"]
    # the stored JSON reads back into the result, its header kept
    back = NonuniqueResult.from_dict(doc)
    assert json.loads(json.dumps(back.to_dict(), allow_nan=False)) == doc and _method_part(doc) == lib

    with Session.open(session) as s:
        (run,) = s.runs()
        stored = s.run(run.id)
    assert run.kind == "nonunique" and stored.result == doc
    assert [a["method"] for a in stored.audits] == ["non-unique attention"]
    assert stored.parameters["component"] == "L1.H2" and stored.parameters["tol"] == 0.05
    capsys.readouterr()
    table = tmp_path / "t.csv"
    assert main(["export", "--session", str(session), "--format", "csv", "--out", str(table)]) == 0
    rows = list(csv.DictReader(table.open()))
    assert [(r["kind"], r["method"]) for r in rows] == [("nonunique", "non-unique attention")]


def test_shapes_coca_region_mask_equals_the_library(tmp_path):
    image = load_image(SAMPLE)
    mask = np.zeros((image.size[1], image.size[0]), np.uint8)
    mask[: image.size[1] // 2, : image.size[0] // 2] = 255  # the top-left quarter
    mask_path = tmp_path / "m.png"
    Image.fromarray(mask).save(mask_path)
    argv = ["nonunique", "--model", "shapes-coca", "--image", str(SAMPLE), "--question", QUESTION]
    doc = _command_doc([*argv, "--head", "L1.xattn.H1", "--region", str(mask_path)], tmp_path)
    m = load_model("shapes-coca")
    block = [name for name, _ in m.adapter.blocks].index("L1.xattn")
    ordinals = region_tokens(m.adapter.visual_tokens(image.size), mask > 0, 0.25)
    assert doc["region"]["visual_tokens"] == ordinals and doc["region"]["mask"] == str(mask_path)
    assert m.adapter.blocks[block][1] == "cross"  # its keys are the visual tokens themselves
    assert doc["region"]["keys"] == visual_token_keys(
        type("T", (), {"block_kinds": ["cross"] * (block + 1)}), block, ordinals
    )
    lib, _ = _library_doc(m, SAMPLE, QUESTION, block, 1, ordinals)
    assert _method_part(doc) == lib


# Gemma 3n refuses non-unique attention (its values pass a per-head norm: no linear value map;
# tests/core/test_gemma3n.py).
TINY = _cases([f for f in FAMILY_FILES if f != "gemma3n"], per_model=True)


def _reading_block(m, case) -> int:
    """The first cross block, or the first self-attention block after block 0 whose answer row
    may read a visual token (a chunked layer's may not: Llama 4's, the image outside its chunk)."""
    kinds = [k for _, k in m.adapter.blocks]
    if "cross" in kinds:
        return kinds.index("cross")
    tr = capture(m, noise_image(case.image_size), case.question, pattern_layers=[])
    answer, visual = int(tr.answer_positions[0]), tr.visual_positions[0]
    return next(b for b in tr.attention_blocks[1:] if bool(m.adapter.allowed_keys(tr, b)[answer, visual].any()))


@pytest.mark.parametrize("family,kind", TINY, ids=[k for _, k in TINY])
def test_tiny_family_models_equal_the_library(family, kind, tmp_path, monkeypatch):
    case = Case(family, kind)
    m = case.m
    block = _reading_block(m, case)
    name = f"{m.adapter.blocks[block][0]}.H0"
    image_path = tmp_path / "noise.png"
    noise_image(case.image_size).save(image_path)
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    argv = ["nonunique", "--model", "tiny", "--image", str(image_path), "--question", case.question, "--head", name]
    doc = _command_doc(argv, tmp_path)
    lib, _ = _library_doc(m, image_path, case.question, block, 0, doc["region"]["keys"])
    assert doc["block_name"] == m.adapter.blocks[block][0] and _method_part(doc) == lib


def test_answer_text_reads_out_at_the_answer_token(tmp_path):
    argv = ["nonunique", "--image", str(SAMPLE), "--question", QUESTION, "--head", "L0.H0", "--levels", "a"]
    doc = _command_doc([*argv, "--answer-text", "a blue circle", "--token-index", "1"], tmp_path)
    m = load_model("shapes-llava")
    ids = doc["input"]["answer_token_ids"]
    inputs = m.adapter.prepare([load_image(SAMPLE)], [QUESTION], answer_prefix=ids[:1])
    assert doc["position"] == int(inputs.answer_positions[0]) and doc["input"]["answer_token_index"] == 1


@pytest.mark.parametrize(
    "extra,model",
    [
        (["--head", "L9.H0"], "shapes-llava"),
        (["--head", "L1.mlp"], "shapes-llava"),
        (["--head", "L1.H99"], "shapes-llava"),
        (["--head", "L1.H0"], "shapes-coca"),  # a text-only block: no region to move mass off
        (["--head", "L1.H0", "--region", "WRONG_SIZE"], "shapes-llava"),
        (["--head", "L1.H0", "--token-index", "1"], "shapes-llava"),
        (["--head", "L1.H0", "--tol", "0"], "shapes-llava"),
    ],
)
def test_bad_input_is_one_line_error(extra, model, tmp_path, capsys):
    wrong = tmp_path / "wrong.png"
    Image.new("L", (7, 5), 255).save(wrong)
    extra = [str(wrong) if x == "WRONG_SIZE" else x for x in extra]
    argv = ["nonunique", "--model", model, "--image", str(SAMPLE), "--question", QUESTION, *extra]
    assert main([*argv, "--json", str(tmp_path / "o.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and not (tmp_path / "o.json").exists()


def test_missing_image_is_one_line_error(tmp_path, capsys):
    argv = ["nonunique", "--image", str(tmp_path / "none.png"), "--question", QUESTION, "--head", "L1.H0"]
    assert main([*argv, "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_help_explains_every_argument():
    sub = build_parser()._subparsers._group_actions[0].choices["nonunique"]
    for action in sub._actions:
        assert action.help, action.option_strings


def test_the_parsers_copies_are_the_methods_levels_and_rule():
    from core.cli.nonunique import LEVELS, TOP_TOKENS_RULE
    from core.methods.nonunique import LEVEL_NAMES
    from core.methods.nonunique import TOP_TOKENS_RULE as METHOD_RULE

    # the parser's copies (kept so that --help imports no torch)
    assert LEVELS == tuple(LEVEL_NAMES) and TOP_TOKENS_RULE == METHOD_RULE


def test_a_head_that_cannot_reach_the_image_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Llama 4's chunked layer: the answer's chunk holds no visual token, so the head puts no
    mass on the image and there is none to move: one line, exit 2, nothing written."""
    case = Case("llama4", "llama4")
    m = case.m
    tr = capture(m, noise_image(case.image_size), case.question, pattern_layers=[])
    answer, visual = int(tr.answer_positions[0]), tr.visual_positions[0]
    blind = next(b for b in tr.attention_blocks if not bool(m.adapter.allowed_keys(tr, b)[answer, visual].any()))
    image_path = tmp_path / "noise.png"
    noise_image(case.image_size).save(image_path)
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out = tmp_path / "n.json"
    argv = ["nonunique", "--model", "tiny", "--image", str(image_path), "--question", case.question]
    assert main([*argv, "--head", f"{tr.block_names[blind]}.H0", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "puts no attention on the image" in err[0] and not out.exists()
