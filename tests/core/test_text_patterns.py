"""Text-side patterns (attention among the prompt's text tokens) against the
model's own eager attention weights, with every row's hidden mass accounted for."""

import importlib
import json

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture, eager_attention
from core.methods.patterns import TextPatterns, display_token, head_text_pattern, text_patterns, text_positions
from core.zoo import scenes
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import coarsest, step_dtype, sum_tol, unit_roundoff

analyze_module = importlib.import_module("core.analyze")
pipeline = importlib.import_module("core.readouts.pipeline")  # its FULL_PATTERN_LIMIT: the capture analyze runs


def full_capture(loaded, image, question):
    """Every row, under eager attention: the weights are then the eager forward's
    own, bitwise (the sdpa path's recomputed rows are checked against them per
    family in tests/core/test_family_conformance.py)."""
    inputs = loaded.adapter.prepare([image], [question])
    n = inputs.input_ids.shape[1]
    return inputs, capture(loaded, None, "", query_positions=range(n), inputs=inputs, attention="eager")


def assert_rows_sum_to_one(tp: TextPatterns, loaded, trace):
    """Every row's weights plus its hidden mass make 1: the softmax's row sum in its
    own dtype (float32 under eager attention), then the sums here, in the patterns' dtype."""
    n = trace.patterns[tp.blocks[0]].shape[-1]
    dtype = coarsest(
        step_dtype(loaded.adapter.family, trace.final_resid.dtype, "softmax"), tp.patterns[tp.blocks[0]].dtype
    )
    for block in tp.blocks:
        total = tp.patterns[block].sum(-1) + sum(tp.other_mass[block].values())  # (heads, queries)
        tol = sum_tol(1.0, 2 * n + len(tp.other_mass[block]) + 4, dtype)
        torch.testing.assert_close(total, torch.ones_like(total), atol=tol, rtol=0)


@pytest.fixture(scope="module")
def tiny_llava():
    loaded = tiny_llava_float64()
    s = scenes.make_sample("heldout", 4)
    inputs, trace = full_capture(loaded, Image.fromarray(s.image), s.question)
    return loaded, inputs, trace


def test_text_pattern_is_the_models_own_attention_at_text_rows_and_columns(tiny_llava):
    loaded, inputs, trace = tiny_llava
    tp = text_patterns(loaded.adapter, trace)
    roles = loaded.adapter.token_roles(trace)
    assert tp.positions == [p for p, r in enumerate(roles) if r == "text"]  # the answer position is a text token here
    assert tp.positions[-1] == tp.answer_position == int(trace.answer_positions[0])
    assert len(tp.tokens) == len(tp.positions) and "?" in tp.tokens
    assert tp.blocks == list(range(loaded.adapter.n_layers)) and tp.skipped_blocks == []
    with torch.no_grad(), eager_attention(loaded.model):
        own = loaded.model(**inputs.tensors, output_attentions=True).attentions  # per layer (batch, heads, q, k)
    idx = torch.tensor(tp.positions)
    for block in tp.blocks:
        expected = own[block][0][:, idx][:, :, idx]  # (heads, queries, keys)
        assert tp.patterns[block].shape == (loaded.adapter.n_heads, len(idx), len(idx))
        # the capture's eager forward is this one: the same weights
        torch.testing.assert_close(tp.patterns[block], expected, atol=0, rtol=0)
        for role, mass in tp.other_mass[block].items():
            keys = torch.tensor([p for p, r in enumerate(roles) if r == role])
            want = own[block][0][:, idx][:, :, keys].sum(-1)  # weights at most 1, summed in another order
            torch.testing.assert_close(mass, want, atol=sum_tol(1.0, len(keys), want.dtype), rtol=0)
        assert not bool((tp.patterns[block][:, ~tp.allowed[block]]).any())  # causal: no weight on later text
    assert set(tp.other_mass[0]) == {"sink", "visual"}
    assert_rows_sum_to_one(tp, loaded, trace)


def test_text_patterns_need_the_text_rows_in_the_capture(tiny_llava):
    loaded, inputs, _ = tiny_llava
    answer_only = capture(loaded, None, "", inputs=inputs)
    with pytest.raises(ValueError, match="query_positions"):
        text_patterns(loaded.adapter, answer_only)


def test_fewer_tokens_keep_those_nearest_the_answer_and_report_the_rest(tiny_llava):
    loaded, _, trace = tiny_llava
    full = text_patterns(loaded.adapter, trace)
    cut = text_patterns(loaded.adapter, trace, max_tokens=4)
    assert cut.positions == full.positions[-4:] and cut.n_text_dropped == len(full.positions) - 4
    torch.testing.assert_close(cut.patterns[2], full.patterns[2][:, -4:, -4:], atol=0, rtol=0)  # the same weights
    assert float(cut.other_mass[2]["text"].max()) > 0  # the earlier text tokens' mass is named, not lost
    assert_rows_sum_to_one(cut, loaded, trace)


def test_to_dict_round_trips_through_json(tiny_llava):
    loaded, _, trace = tiny_llava
    tp = text_patterns(loaded.adapter, trace)
    back = TextPatterns.from_dict(json.loads(json.dumps(tp.to_dict())))
    assert back.positions == tp.positions and back.tokens == tp.tokens and back.blocks == tp.blocks
    for block in tp.blocks:
        # the JSON keeps float32 weights: one rounding, relative to each weight
        torch.testing.assert_close(
            back.patterns[block].double(), tp.patterns[block], atol=0, rtol=unit_roundoff(torch.float32)
        )
        assert torch.equal(back.allowed[block], tp.allowed[block])
        assert set(back.other_mass[block]) == set(tp.other_mass[block])


def test_cross_attention_blocks_are_skipped_and_said_so():
    loaded = tiny_coca_float64()
    s = scenes.make_sample("heldout", 5)
    _, trace = full_capture(loaded, Image.fromarray(s.image), s.question)
    tp = text_patterns(loaded.adapter, trace)
    names = trace.block_names
    assert [names[b] for b in tp.blocks] == tp.block_names == [n for n in names if not n.endswith(".xattn")]
    assert tp.skipped_blocks == [n for n in names if n.endswith(".xattn")] and tp.skipped_blocks
    assert "cross-attention blocks skipped (image keys only)" in tp.audit.controls
    idx = torch.tensor(tp.positions)
    for block in tp.blocks:
        torch.testing.assert_close(tp.patterns[block], trace.patterns[block][0][:, idx][:, :, idx], atol=0, rtol=0)
    assert_rows_sum_to_one(tp, loaded, trace)


def test_analyze_of_a_long_prompt_keeps_the_text_rows(monkeypatch):
    """Past FULL_PATTERN_LIMIT the capture keeps the non-visual rows only; the
    text patterns and the answer row's summary are the same as with every row."""
    llava = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 7)
    full = analyze_module.analyze(llava, s.image, s.question).to_dict()
    monkeypatch.setattr(pipeline, "FULL_PATTERN_LIMIT", 0)
    long = analyze_module.analyze(llava, s.image, s.question).to_dict()
    assert long["rollout"] is None and full["rollout"] is not None
    a, b = full["text_patterns"], long["text_patterns"]
    assert a["positions"] == b["positions"] and a["tokens"] == b["tokens"]
    assert a["tokens"] == [full["input"]["tokens"][p] for p in a["positions"]]
    # the same forward (rows kept or not do not change it) and the same read-outs: exactly equal
    torch.testing.assert_close(torch.tensor(a["patterns"]), torch.tensor(b["patterns"]), atol=0, rtol=0)
    for x, y in zip(full["attention"], long["attention"], strict=True):
        assert x["visual_mass"] == y["visual_mass"]
        assert x["argmax_source"] == y["argmax_source"]
    assert any("text queries and text keys only" in c for row in full["audit"] for c in row["controls"])


def test_text_positions_are_text_tokens_and_the_answer():
    llava = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 3)
    _, trace = full_capture(llava, Image.fromarray(s.image), s.question)
    roles = llava.adapter.token_roles(trace)
    positions = text_positions(llava.adapter, trace)
    assert all(roles[p] == "text" for p in positions) and positions[-1] == int(trace.answer_positions[0])


def test_one_heads_pattern_from_the_json_and_its_token_labels():
    """What the Attention panel and the export read: one head's weights, mask and
    hidden mass from the JSON form, and tokens as labels."""
    loaded = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 1)
    _, trace = full_capture(loaded, Image.fromarray(s.image), s.question)
    text = text_patterns(loaded.adapter, trace)
    d = json.loads(json.dumps(text.to_dict()))
    block = text.blocks[-1]
    found = head_text_pattern(d, block, 2)
    # through JSON and float32: one rounding, relative to each weight
    weights = torch.tensor(found["weights"])
    torch.testing.assert_close(weights, text.head(block, 2).float(), rtol=unit_roundoff(torch.float32), atol=0)
    assert found["allowed"] == text.allowed[block].tolist()
    assert set(found["other_mass"]) == set(text.other_mass[block])
    assert head_text_pattern(d, 99, 0) is None and head_text_pattern(None, block, 0) is None

    assert display_token("a\nb\t") == "a\\nb\\t" and display_token("  ") == "\u00b7\u00b7"
    assert display_token("x" * 20) == "x" * 11 + "\u2026" and display_token("what") == "what"
