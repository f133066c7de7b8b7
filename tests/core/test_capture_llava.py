"""Capture on LLaVA: every recorded piece is checked against an independent
computation (the model's own outputs, or a recomputation from canonical weights)."""

import math

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.models.loading import LoadedModel
from core.zoo import build, scenes
from tests.core.exactness import (
    assert_heads_sum_to_attention_output,
    assert_recomputed_rows_are_eager,
    assert_reconstruction_and_lens_at_last_layer,
    module_hook_counts,
    pattern_rtol,
    scores_tol,
    values_tol,
)
from tests.tolerances import sum_tol


def tiny_llava_float64() -> LoadedModel:
    """A random LLaVA built from a config (grouped-query heads), in float64."""
    from transformers import LlavaForConditionalGeneration

    from core.models.families.llava import LlavaAdapter

    config = build.llava_config()
    config.text_config.hidden_size = 64
    config.text_config.intermediate_size = 96
    config.text_config.num_hidden_layers = 3
    config.text_config.num_attention_heads = 4
    config.text_config.num_key_value_heads = 2
    config.text_config.head_dim = 16
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).double().eval()
    processor = build.llava_processor()
    adapter = LlavaAdapter(model, processor, processor.tokenizer)
    return LoadedModel("tiny-llava", "llava", model, processor, processor.tokenizer, adapter)


@pytest.fixture(scope="module", params=["tiny-float64", "shapes-llava"])
def traced(request):
    m = tiny_llava_float64() if request.param == "tiny-float64" else load_model("shapes-llava")
    s = scenes.make_sample("heldout", 4)
    pos = list(range(0, 70, 7))
    tr = capture(m, s.image, s.question, query_positions=pos, keep_attn_out=True)
    return m, tr


def test_recomputed_rows_equal_eager_attention(traced):
    """Grouped-query heads, causal sdpa (no mask tensor) and padding-free: the recomputed rows are eager's."""
    m, _ = traced
    s = scenes.make_sample("heldout", 4)
    assert_recomputed_rows_are_eager(m, m.adapter.prepare([Image.fromarray(s.image)], [s.question]))


def test_heads_sum_to_attention_output(traced):
    m, tr = traced
    assert_heads_sum_to_attention_output(m.adapter, tr)


def test_residual_reconstruction_and_lens_at_last_layer(traced):
    m, tr = traced
    assert_reconstruction_and_lens_at_last_layer(m.adapter, tr)


def test_patterns_recomputed_from_canonical_weights_and_rope(traced):
    """Up to eager attention's float32 softmax (float64 or float32 model alike)."""
    m, tr = traced
    a = m.adapter
    n_pos = tr.input_ids.shape[1]
    positions = torch.arange(n_pos)
    for layer in range(a.n_layers):
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])  # (pos, d_model)
        q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
        k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
        q, k = a.rotate(q, positions), a.rotate(k, positions)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
        causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, True)
        rtol = pattern_rtol(a, tr, scores[:, tr.query_positions], error)
        torch.testing.assert_close(scores.softmax(-1)[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)


def test_values_recomputed_from_canonical_weights(traced):
    m, tr = traced
    a = m.adapter
    for layer in range(a.n_layers):
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        v = torch.einsum("pm,hmd->phd", x, a.W_V(layer)) + a.b_V(layer)
        pattern = tr.patterns[layer][0]  # (heads, n_query, pos)
        z = torch.einsum("hqk,khd->qhd", pattern, v)
        tol = values_tol(pattern, x, a.W_V(layer), a.b_V(layer))
        torch.testing.assert_close(z, tr.z[layer][0, tr.query_positions], atol=tol, rtol=0)


def test_hooks_are_removed_and_attention_restored():
    m = load_model("shapes-llava")
    before = m.model.config._attn_implementation

    s = scenes.make_sample("heldout", 2)
    capture(m, s.image, s.question)  # transformers installs its own hooks lazily on a first run
    counts = module_hook_counts(m.model)
    capture(m, s.image, s.question)
    assert m.model.config._attn_implementation == before
    assert module_hook_counts(m.model) == counts
    with pytest.raises(IndexError):  # a failing run removes its hooks too
        capture(m, s.image, s.question, query_positions=[10_000])
    assert module_hook_counts(m.model) == counts


def test_rollout_is_the_product_of_mixed_patterns():
    from core.methods.patterns import rollout

    m = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 5)
    n = m.adapter.prepare([Image.fromarray(s.image)], [s.question]).input_ids.shape[1]
    tr = capture(m, s.image, s.question, query_positions=range(n))
    r = rollout(tr, alpha=0.7)
    # every term is non-negative and each row sums to 1, so 1 bounds the terms of
    # every entry; each layer adds a mean over heads and an n-term product in
    # float32, the patterns' own rows sum to 1 up to their n-key softmax
    layers, heads = m.adapter.n_layers, m.adapter.n_heads
    product = sum_tol(1.0, layers * (n + heads + 3), torch.float32)
    torch.testing.assert_close(
        r.sum(-1), torch.ones(n), atol=product + sum_tol(1.0, layers * (n + 4), torch.float32), rtol=0
    )
    expected = torch.eye(n)
    for layer in range(layers):
        expected = (0.7 * tr.patterns[layer][0].mean(0) + 0.3 * torch.eye(n)) @ expected
    torch.testing.assert_close(r, expected, atol=product, rtol=0)


def test_public_capture_records_the_named_target():
    import core

    m = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 3)
    tr = core.capture(m, s.image, s.question, answer=s.answer, foil=s.foil)
    assert isinstance(tr, core.Trace)
    assert (tr.answer_id, tr.foil_id) == (m.adapter.token_id(s.answer), m.adapter.token_id(s.foil))
    assert core.capture(m, s.image, s.question).answer_id is None
