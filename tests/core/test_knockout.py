"""Attention knockout over layer windows (issue 29, part 1): every window's answer
numbers equal an independent eager reference that sets the cut scores to minus
infinity before the softmax (tests/core/knockout_reference.py), on both default
models; the windows, the position sets and the batched rows are what they say;
the command writes the windows' numbers, records the run and refuses bad edges
in one line. (Every served family's tiny model: tests/core/test_family_conformance.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import core.cli
from core import load_model
from core.cli import main
from core.errors import InterventionError
from core.files.images import load_image
from core.forward.capture import capture, edited_logits
from core.forward.edits import Edit
from core.forward.geometry import painted_tokens
from core.methods.flow.knockout import ALL_LAYERS, KnockoutResult, knockout_sweep, windows
from core.methods.flow.positions import EdgeKind, parse_edges, position_sets
from core.models.loading import resources_dir
from core.results.readout import restore_result
from tests.core.exactness import forwards_tol
from tests.core.knockout_reference import reference_logits

SAMPLE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what color is the circle?"
EDGES = "image->answer,question->answer,region->answer,word:circle->last"


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name) for name in ("shapes-llava", "shapes-coca")}


def region_mask(size) -> np.ndarray:
    mask = np.zeros((size[1], size[0]), dtype=bool)
    mask[: size[1] // 2, : size[0] // 2] = True  # the upper-left quarter
    return mask


def sweep(m, edges=EDGES, **kw):
    image = load_image(SAMPLE)
    inputs = m.adapter.prepare([image], [QUESTION])
    base = capture(m, None, "", pattern_layers=[], inputs=inputs)
    pos = int(base.answer_positions[0])
    answer_id = int(base.logits[0, pos].argmax())
    foil_id = int(base.logits[0, pos].topk(2).indices[1])
    region = painted_tokens(m.adapter.visual_tokens(image.size), region_mask(image.size))
    result = knockout_sweep(
        m, inputs, image, QUESTION, parse_edges(edges), answer_id, foil_id, base=base, region=region, **kw
    )
    return result, inputs, base


def assert_window_is_the_reference(m, inputs, base, result, profile, window, heads=None):
    """The window's logit and probability against the eager reference with the same cuts."""
    names = base.block_names
    cuts = {names.index(c.block): (c.queries, c.keys) for c in window.cut}
    logits = reference_logits(m, inputs, cuts, heads)[0, result.position].double()
    tol = forwards_tol(m.adapter, logits, base.logits.shape[1] + 64)
    edited = window.edited
    assert edited.logit == pytest.approx(float(logits[edited.answer_id]), abs=tol), (profile.edge, window.centre)
    diff = float(logits[edited.answer_id] - logits[edited.foil_id])
    assert edited.logit_diff == pytest.approx(diff, abs=2 * tol), (profile.edge, window.centre)
    p = float(logits.softmax(-1)[edited.answer_id])
    assert edited.prob == pytest.approx(p, abs=p * math.expm1(2 * tol) + 1e-12), (profile.edge, window.centre)


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_every_window_equals_the_eager_reference(models, name):
    m = models[name]
    result, inputs, base = sweep(m)
    assert [p.edge for p in result.profiles] == EDGES.split(",")
    for profile in result.profiles:
        assert [w.centre for w in profile.windows] == [*result.layers, ALL_LAYERS]
        for window in profile.windows:
            if window.cut:
                assert_window_is_the_reference(m, inputs, base, result, profile, window)
            else:  # no edge of the kind in these layers: the original numbers, no forward
                assert window.edited == result.original and window.effect.drop == 0
    every = result.profile("image->answer").window(ALL_LAYERS)
    kinds = {base.block_kinds[base.block_names.index(c.block)] for c in every.cut}
    # the image enters LLaVA's sequence (self-attention keys) and CoCa's cross-attention only
    assert kinds == ({"self"} if name == "shapes-llava" else {"cross"})
    assert every.effect.drop != 0  # cutting the image from the answer in every layer moves it


def test_one_heads_cut_equals_the_reference(models):
    m = models["shapes-llava"]
    result, inputs, base = sweep(m, "image->answer", heads=[1], width=2)
    profile = result.profiles[0]
    for window in profile.windows:
        assert_window_is_the_reference(m, inputs, base, result, profile, window, heads=[1])
    assert result.heads == [1] and result.width == 2


def test_windows_are_centred_and_clipped():
    layers = ["L0", "L1", "L2", "L3", "L4"]
    assert windows(layers, 1) == [(x, [x]) for x in layers] + [(ALL_LAYERS, layers)]
    three = dict(windows(layers, 3))
    assert three["L0"] == ["L0", "L1"] and three["L2"] == ["L1", "L2", "L3"] and three["L4"] == ["L3", "L4"]
    four = dict(windows(layers, 4))
    assert four["L2"] == ["L1", "L2", "L3", "L4"]  # an even width reaches one further to later layers
    assert dict(windows(layers, 9))["L2"] == layers
    with pytest.raises(InterventionError, match="at least 1"):
        windows(layers, 0)


def test_position_sets_name_the_right_tokens(models):
    for m in models.values():
        a = m.adapter
        image = load_image(SAMPLE)
        inputs = a.prepare([image], [QUESTION])
        base = capture(m, None, "", pattern_layers=[], inputs=inputs)
        region = painted_tokens(a.visual_tokens(image.size), region_mask(image.size))
        sets = position_sets(
            a,
            base,
            inputs,
            QUESTION,
            ["question", "word:circle", "last", "answer", "image", "region"],
            region=region,
        )
        ids = inputs.input_ids[0].tolist()
        q = sets["question"].positions
        assert a.tokenizer.decode([ids[p] for p in q]).strip() == QUESTION
        assert "circle" in a.tokenizer.decode([ids[p] for p in sets["word:circle"].positions])
        assert set(sets["word:circle"].positions) < set(q)
        assert sets["last"].positions == sets["answer"].positions == (int(base.answer_positions[0]),)
        assert sets["region"].visual == tuple(sorted(region)) and set(sets["region"].visual) < set(sets["image"].visual)
        with pytest.raises(InterventionError, match="not in the question"):
            position_sets(a, base, inputs, QUESTION, ["word:triangle"])


def test_teacher_forced_answer_position_is_after_the_last_prompt_token(models):
    m = models["shapes-llava"]
    a = m.adapter
    image = load_image(SAMPLE)
    prefix = [a.token_id("yellow")]
    inputs = a.prepare([image], [QUESTION], answer_prefix=prefix)
    base = capture(m, None, "", pattern_layers=[], inputs=inputs)
    sets = position_sets(a, base, inputs, QUESTION, ["last", "answer", "question"], answer_prefix=prefix)
    assert sets["answer"].positions[0] == sets["last"].positions[0] + 1
    assert a.tokenizer.decode([inputs.input_ids[0, p] for p in sets["question"].positions]).strip() == QUESTION


def test_an_edit_of_one_batch_row_leaves_the_others_as_they_were(models):
    m = models["shapes-llava"]
    image = load_image(SAMPLE)
    batch = m.adapter.prepare([image, image], [QUESTION, QUESTION])
    clean = edited_logits(m, batch, [])
    pos = int(batch.answer_positions[0])
    edit = Edit(1, None, (pos,), site="knockout", keys=tuple(range(3, 20)), rows=(1,))
    edited = edited_logits(m, batch, [edit])
    assert torch.equal(edited[0], clean[0]) and not torch.equal(edited[1], clean[1])
    alone = edited_logits(
        m, m.adapter.prepare([image], [QUESTION]), [Edit(1, None, (pos,), site="knockout", keys=tuple(range(3, 20)))]
    )
    torch.testing.assert_close(edited[1], alone[0], atol=forwards_tol(m.adapter, clean[0], clean.shape[1]), rtol=0)
    with pytest.raises(InterventionError, match="batch row 2"):
        edited_logits(m, batch, [Edit(1, 0, (pos,), site="z", rows=(2,))])


def test_edge_kinds_are_parsed_and_bad_ones_refused():
    assert parse_edges("image->answer, word:blue->last") == [EdgeKind("image", "answer"), EdgeKind("word:blue", "last")]
    for bad, said in [
        ("image", "SOURCE->TARGET"),
        ("pixels->answer", "source set 'pixels'"),
        ("image->image", "target set 'image'"),
        ("word:->answer", "name the word"),
        ("image->answer,image->answer", "named twice"),
        (",", "at least one"),
    ]:
        with pytest.raises(InterventionError, match=said):
            parse_edges(bad)


def test_cancel_keeps_the_windows_run(models):
    m = models["shapes-llava"]
    calls = []
    result, _, _ = sweep(
        m, "image->answer,question->answer", batch_size=2, cancel=lambda: calls.append(1) or len(calls) > 2
    )
    assert result.cancelled and "[cancelled]" in result.summary()
    ran = [w for p in result.profiles for w in p.windows]
    assert len(ran) == 4  # two forwards of two windows


def test_the_command_writes_every_window_and_records_the_run(models, tmp_path, monkeypatch, capsys):
    m = models["shapes-llava"]
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out, session = tmp_path / "k.json", tmp_path / "s.vlmr"
    mask = tmp_path / "mask.png"
    from PIL import Image

    Image.fromarray(region_mask(load_image(SAMPLE).size)).save(mask)
    argv = ["knockout", "--image", str(SAMPLE), "--question", QUESTION, "--edges", "image->answer,region->last"]
    argv += [
        "--mask",
        str(mask),
        "--window",
        "3",
        "--foil",
        "blue",
        "--json",
        str(out),
        "--session",
        str(session),
        "--quiet",
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["window"] == 3 and doc["original"]["foil"] == "blue" and doc["layers"] == ["L0", "L1", "L2", "L3"]
    for profile in doc["profiles"]:
        for window in profile["windows"]:
            assert window["layers"] and {"logit", "logit_diff", "prob", "predicted"} <= set(window["edited"])
            assert all(c["block"] in window["layers"] for c in window["cut"])
    assert "knockout (window 3)" in capsys.readouterr().out
    from core.session import Session

    with Session.open(session) as s:
        (info,) = s.runs("knockout")
        run = s.run(info.id)
        restored = run.readout
    assert isinstance(restored, KnockoutResult) and restored.to_dict() == doc
    assert restore_result("knockout", doc).summary() == info.summary
    assert run.parameters["edges"] == ["image->answer", "region->last"] and run.mask is not None
    with Session.open(session) as s:
        assert any(r["method"] == "attention knockout" for r in s.audit_table())


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--edges", "image->nowhere"], "target set 'nowhere'"),
        (["--edges", "region->answer"], "needs a painted region"),
        (["--edges", "image->answer", "--heads", "9"], "the model has heads 0-"),
        (["--edges", "image->answer", "--heads", "a"], "comma-separated head indices"),
        (["--edges", "word:triangle->answer"], "not in the question"),
    ],
)
def test_bad_edges_are_one_line(models, tmp_path, monkeypatch, capsys, extra, said):
    monkeypatch.setattr(core.cli, "_load", lambda args: models["shapes-llava"])
    out = tmp_path / "k.json"
    assert (
        main(["knockout", "--image", str(SAMPLE), "--question", QUESTION, *extra, "--json", str(out), "--quiet"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and "\n" not in err and not out.exists()


def test_rollout_reach_ends_at_the_rollout_of_the_whole_model(models):
    """Each profile's per-layer rollout reach is rollout's target row on the source (through
    that layer); at the last layer it is :func:`core.methods.patterns.rollout`'s answer row
    summed over the source, from full patterns (the oracle); its correlation with the drops
    is Pearson's, and the audit row calls it a correlation, not a decomposition."""
    from core.methods.patterns import rollout

    for m in models.values():
        result, inputs, base = sweep(m, "image->answer,question->answer")
        n = inputs.input_ids.shape[1]
        full = capture(m, None, "", inputs=inputs, query_positions=range(n))
        r = rollout(full, 0.5)[result.position].double()
        for profile in result.profiles:
            nodes = list(profile.source.positions) + [n + v for v in profile.source.visual if n + v < r.shape[0]]
            assert profile.rollout_reach[-1] == pytest.approx(float(r[nodes].sum()), abs=1e-5)
            assert all(0 <= x <= 1 + 1e-6 for x in profile.rollout_reach)
            drops = np.array(profile.drops(result.layers), dtype=float)
            reach = np.array(profile.rollout_reach)
            assert profile.rollout_correlation == pytest.approx(np.corrcoef(drops, reach)[0, 1], abs=1e-9)
        assert any("not a decomposition" in note for note in result.audit.notes)


def test_copies_of_one_input_are_what_the_processor_makes_of_copies(models):
    """The rows the flow methods edit: the one prepared row repeated where every tensor is batch-first
    (the image processed once) equals the processor's batch of the same copies, tensor for tensor."""
    from core.methods.flow.batches import copies

    for m in models.values():
        a = m.adapter
        image = load_image(SAMPLE)
        one = a.prepare([image], [QUESTION])
        three = copies(a, one, 3, image, QUESTION)
        want = a.prepare([image] * 3, [QUESTION] * 3)
        assert three.tensors.keys() == want.tensors.keys()
        for k, t in want.tensors.items():
            assert torch.equal(three.tensors[k], t), k
        assert torch.equal(three.answer_positions, want.answer_positions)
        assert torch.equal(three.input_ids, want.input_ids) and three.prompts == want.prompts
        assert copies(a, one, 1, image, QUESTION) is one
