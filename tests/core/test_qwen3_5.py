"""Qwen3.5 adapter on a tiny random float64 hybrid model (tests/core/tiny_qwen3_5.py:
layers [linear, full, linear, full]): the conformance checks (those of a hybrid
decoder included: the Gated DeltaNet layers have no pattern and no heads, every such
read-out refused in one line, their write one component, ablated as a whole equal to
a hook on the library's module), and what is its own: the full-attention heads'
query gate and partial interleaved M-RoPE recomputed here by their formulas."""

import functools
import math

import pytest
import torch

from core.errors import InterventionError
from core.forward.edits import Edit
from core.models.families.qwen3_5 import Qwen3_5Adapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_queries_keys_are_the_models,
    capture_every_position,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    realized_scores_tol,
)
from tests.core.tiny_qwen3_5 import IMAGE_SIZE, LAYER_TYPES, MROPE_SECTION, QUESTION, tiny_model

LINEAR, FULL = [0, 2], [1, 3]


def tiny_qwen3_5_float64(tie: bool = False) -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model(tie)
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-qwen3_5", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    m = tiny_qwen3_5_float64()
    tr, inputs = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr


CASES = ("qwen3_5",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("qwen3_5")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Qwen3_5ForConditionalGeneration": Qwen3_5Adapter}
DESCRIPTION = {
    "position_scheme": "mrope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 4,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 32, 1)  # n_kv_heads, d_head, kv_group(3)
PADDED_BATCH = ([(60, 130), (200, 150)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "Ċ"  # the prompt ends "assistant\n", byte-level: the newline is its own token
# byte-level BPE: every word has tokens, so no "vocabulary" refusal
BAD_QUESTIONS = (("too long", " ".join(["red"] * 600)),)
PERTURB_SIZES = [(260, 150)]


def check_canonical_weights(m, x) -> None:
    """W_Q is the query half of each head's q_proj rows (the other half is the
    output gate); the q / k norms are the model's (1 + w) RMSNorms bit for bit."""
    a = m.adapter
    attn = a._attn(1)
    rows = attn.q_proj(x).view(x.shape[0], a.n_heads, 2 * a.d_head)
    torch.testing.assert_close(torch.einsum("pm,hmd->phd", x, a.W_Q(1)), rows[..., : a.d_head], atol=0, rtol=1e-12)
    q = rows[..., : a.d_head]
    torch.testing.assert_close(a.q_norm(1)(q), attn.q_norm(q), atol=0, rtol=0)
    torch.testing.assert_close(a.k_norm(1)(q), attn.k_norm(q), atol=0, rtol=0)


def visual_inputs(m, image) -> torch.Tensor:
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_grid_thw")


def perturbation_features(m, image) -> tuple[torch.Tensor, ...]:
    return (visual_inputs(m, image),)


def check_decomposition(m, tr, r) -> None:
    """embed; per linear layer one write and its MLP; per full layer its heads and MLP."""
    names = [c.name for c in r.components]
    want = ["embed"]
    for layer, kind in enumerate(LAYER_TYPES):
        heads = [f"L{layer}.H{h}" for h in range(4)]
        want += ([f"L{layer}.linear_attn"] if kind == "linear_attention" else heads) + [f"L{layer}.mlp"]
    assert names == want


def _recompute_patterns(a, tr, layer: int, partial: bool = True):
    """``(heads, pos, pos)`` from canonical weights: the query half of q_proj, the
    (1 + w) q / k RMSNorms and an interleaved M-RoPE over the first rotary dims
    built here from the inverse frequencies (``partial`` False: every dim turned)."""
    n_pos = tr.input_ids.shape[1]
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
    attn, eps = a._attn(layer), a.text_config.rms_norm_eps
    q = (1 + attn.q_norm.weight) * q * (q.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    k = (1 + attn.k_norm.weight) * k * (k.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    inv_freq = a.language_model.rotary_emb.inv_freq.double()
    half = inv_freq.shape[0]
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * MROPE_SECTION[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * MROPE_SECTION[2])] = 2
    angle = tr.position_ids[:, 0][axis].T.double() * inv_freq
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def turn(v):
        dims = 2 * half if partial else v.shape[-1]
        c = cos if partial else cos.repeat(1, 1, dims // (2 * half))
        s = sin if partial else sin.repeat(1, 1, dims // (2 * half))
        r, rest = v[..., :dims], v[..., dims:]
        x1, x2 = r[..., : dims // 2], r[..., dims // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    scores = torch.einsum("qhd,khd->hqk", turn(q), turn(k)) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1), pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, layer))


def recompute_patterns(a, tr, layer: int):
    return _recompute_patterns(a, tr, layer)


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: the partial rotation matters, and so does the output gate."""
    a = m.adapter
    other, _ = _recompute_patterns(a, tr, 1, partial=False)
    assert (other[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3
    gate = a.output_gate(tr, 1)
    assert float((gate - 1).abs().min()) > 1e-3  # sigmoid(g) is nowhere 1: the heads' outputs are scaled


# ---- the layers without attention


def test_blocks_name_each_layers_mixer(traced):
    m, tr = traced
    assert m.adapter.blocks == [("L0", "linear"), ("L1", "self"), ("L2", "linear"), ("L3", "self")]
    assert tr.attention_blocks == FULL and sorted(tr.patterns) == FULL and sorted(tr.mixer_out) == LINEAR
    assert all(tr.z[b] is None for b in LINEAR)
    assert "mixer" in m.adapter.edit_sites


def test_queries_keys_are_the_models(traced):
    """adapter.queries_keys (the query half, (1 + w) q/k norms, partial M-RoPE) gives the
    model's own scores at each full-attention layer."""
    m, tr = traced
    assert_queries_keys_are_the_models(m, tr, FULL, m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION]))


def test_output_gate_is_the_models(traced):
    """z as recorded (o_proj's input) is the gate times the attention output: the gate
    recomputed from the gate half of q_proj equals z / (pattern @ V) of the model."""
    m, tr = traced
    a = m.adapter
    for block in FULL:
        x = a.attn_norm(block)(tr.resid_pre[block][0])
        raw = a._attn(block).q_proj(x).view(x.shape[0], a.n_heads, 2 * a.d_head)[..., a.d_head :]
        torch.testing.assert_close(a.output_gate(tr, block), torch.sigmoid(raw), atol=0, rtol=1e-12)


def test_knockout_cuts_only_the_attention_layers_and_says_so(traced):
    from core.methods.flow.knockout import knockout_sweep
    from core.methods.flow.positions import parse_edges

    m, tr = traced
    a = m.adapter
    image = noise_image(IMAGE_SIZE)
    inputs = a.prepare([image], [QUESTION])
    answer = int(tr.logits[0, -1].argmax())
    result = knockout_sweep(m, inputs, image, QUESTION, parse_edges("image->answer"), answer)
    assert result.layers == ["L1", "L3"]
    assert all(cut.block in ("L1", "L3") for w in result.profiles[0].windows for cut in w.cut)
    assert result.profiles[0].rollout_reach is None
    notes = " ".join(result.audit.notes)
    assert "not cut: L0, L2" in notes and "Gated DeltaNet" in notes


def test_head_edit_on_a_linear_layer_is_an_intervention_error_too(traced):
    """UndefinedReadoutError is a ValueError, as InterventionError: callers catching
    bad edits keep working."""
    m, _ = traced
    with pytest.raises(ValueError):
        m.adapter.check_edits([Edit(0, None, [1], site="expert", expert=0)])
    with pytest.raises(InterventionError, match="no 'expert' edit site"):
        m.adapter.check_edits([Edit(0, None, [1], site="expert", expert=0)])
