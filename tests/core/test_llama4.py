"""Llama 4 adapter on the tiny random float64 model of tests/core/tiny_llama4.py (layers:
RoPE + chunked + dense, RoPE + chunked + MoE, RoPE + chunked + dense, NoPE + temperature
+ MoE; 8-token chunks under a 35-token prompt; one 32 px tile): the conformance checks,
and what is Llama 4's own, each against an independent computation: the patterns
recomputed by formula (consecutive-pair RoPE, the gainless q/k RMS norm, the NoPE
temperature, the chunked mask), the recorded queries holding the temperature, the MoE
write split into each expert's real write (router score on its input) plus the shared
expert, an expert's ablation against a hook written here on the library's experts
module, and the tile geometry against the processor."""

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InterventionError, ModelLoadError, UnsupportedArchitectureError
from core.forward.capture import capture, edited_logits
from core.forward.edits import Edit
from core.methods.residual import component_edit, decompose
from core.models.families.llama4 import Llama4Adapter
from core.models.inputs import ModelInputs
from core.models.loading import LoadedModel
from tests.core.exactness import (
    capture_every_position,
    forwards_tol,
    invert_around_box_centre,
    noise_image,
    pattern_rtol,
    scores_tol,
)
from tests.core.tiny_llama4 import (
    ATTN_SCALE,
    CHUNK,
    FLOOR_SCALE,
    GRID,
    IMAGE_SIZE,
    MOE_LAYERS,
    N_EXPERTS,
    NO_ROPE_LAYERS,
    QUESTION,
    TILE,
    TOKENS_PER_TILE,
    TOP_K,
    tiny_config,
    tiny_model,
)
from tests.tolerances import NORM_ROUNDINGS, gamma, matmul_tol, rounding_tol, statistic_tol, sum_tol, unit_roundoff

F32, F64 = torch.float32, torch.float64
ROPE = [b for b, rope in enumerate(NO_ROPE_LAYERS) if rope]
NOPE = [b for b, rope in enumerate(NO_ROPE_LAYERS) if not rope]
# float32 roundings of one query or key on its way through the model's RoPE: the cast to
# float32 and, per output, two products and a sum of the complex multiplication.
ROPE_ROUNDINGS = 4
# float32 roundings of the NoPE temperature: log1p, the product by attn_scale, the + 1.
TEMPERATURE_ROUNDINGS = 3


def tiny_llama4_float64(max_patches: int = 1, **text_extra) -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model(max_patches, **text_extra)
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-llama4", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "llama4"):
    m = tiny_llama4_float64()
    tr, _ = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr


@functools.cache
def tiled():
    """The same family with up to 4 tiles (a 60 x 40 image: 2 x 2 tiles and the global one)."""
    return tiny_llama4_float64(max_patches=4)


CASES = ("llama4",)


@pytest.fixture(scope="module")
def traced():
    return traced_case()


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Llama4ForConditionalGeneration": Llama4Adapter}
DESCRIPTION = {
    "family": "llama4",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 4,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0, 3: 1.0}
# one tile each (max_patches 1): 16 visual tokens per row, questions of other lengths
PADDED_BATCH = ([IMAGE_SIZE, (30, 50)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "\n\n"  # the prompt ends "<|header_end|>\n\n"
BAD_QUESTIONS = (
    ("vocabulary", "is there a purple circle?"),
    ("may not contain", "<|image|> is there a red circle?"),
    ("may not contain", "<|patch|> is there a red circle?"),
    ("too long", " ".join(["red"] * 600)),
)
PERTURB_SIZES = [IMAGE_SIZE, (30, 50)]


def check_canonical_weights(m, x) -> None:
    """No biases; W_U untied; the q/k norm is the model's gainless RMS norm bit for bit
    on RoPE layers and absent on the NoPE layer."""
    a = m.adapter
    for b in range(a.n_layers):
        assert all(torch.all(v == 0) for v in (a.b_Q(b), a.b_K(b), a.b_V(b), a.b_O(b)))
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and a.W_U.data_ptr() == m.model.language_model.lm_head.weight.data_ptr()
    h = torch.randn(7, a.n_heads, a.d_head, dtype=F64) * 3
    for b in ROPE:
        torch.testing.assert_close(a.q_norm(b)(h), a._attn(b).qk_norm(h), atol=0, rtol=0)
        assert torch.equal(a.qk_gain(b), torch.ones(a.d_head, dtype=F64))
    for b in NOPE:
        assert a.q_norm(b) is None and a.qk_gain(b) is None and not hasattr(a._attn(b), "qk_norm")
    y = torch.randn(7, a.d_model, dtype=F64) * 3
    torch.testing.assert_close(a.attn_norm(2)(y), a.language_model.layers[2].input_layernorm(y), atol=0, rtol=0)
    torch.testing.assert_close(a.final_norm_layer()(y), a.language_model.norm(y), atol=0, rtol=0)


def check_padded_batch(m, batch) -> None:
    """Right padding: each row's chunks start at its first token; nobody reads row 0's padding."""
    a = m.adapter
    tr = capture(m, None, "", inputs=batch, pattern_layers=[])
    n = batch.input_ids.shape[1]
    for row in range(2):
        real = batch.tensors["attention_mask"][row].bool()
        for block in range(a.n_layers):
            assert torch.equal(a.allowed_keys(tr, block, row), chunked_mask(n, CHUNK if block in ROPE else None) & real)
    assert a.token_roles(tr, batch=0)[-1] == "padding"


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: every tile's projected tokens in order, as the decoder receives them."""
    pixels = m.adapter.prepare([image], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        out = m.model.get_image_features(pixels, return_dict=True).pooler_output
    return out.reshape(-1, out.shape[-1])


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """The tokens whose box centre lies in the image (the others cover the tile's padding)."""
    inside = [t for t in tokens if (t.box[0] + t.box[2]) / 2 < size[0] and (t.box[1] + t.box[3]) / 2 < size[1]]
    assert 0 < len(inside) < len(tokens)  # both test images leave padding in their tile
    return inside


def chosen_experts(moe, x: torch.Tensor) -> list[list[int]]:
    """Per row of ``x (n, d_model)`` the experts its router chose (top-k logits), by hand."""
    return (x @ moe.router.weight.T).topk(TOP_K, dim=-1).indices.sort(-1).values.tolist()


def check_decomposition(m, tr, r) -> None:
    """embed; per layer its heads; a dense layer's MLP whole; a MoE layer's chosen experts
    at this position, its shared expert and the residue."""
    a = m.adapter
    want = ["embed"]
    for b in range(a.n_layers):
        want += [f"L{b}.H{h}" for h in range(a.n_heads)]
        if b in MOE_LAYERS:
            moe = a.language_model.layers[b].feed_forward
            experts = chosen_experts(moe, tr.mlp_in[b][0, r.position][None])[0]
            want += [*[f"L{b}.E{e}" for e in experts], f"L{b}.shared_expert", f"L{b}.experts_residue"]
        else:
            want.append(f"L{b}.mlp")
    assert [c.name for c in r.components] == want


def chunked_mask(n: int, chunk: int | None, left: int = 0) -> torch.Tensor:
    """``(n, n)`` bool: key j visible from query i iff j <= i (and, with chunks, the same chunk counted from ``left``)."""
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    allowed = j <= i
    return allowed if chunk is None else allowed & ((i - left) // chunk == (j - left) // chunk)


def pair_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Consecutive pairs ``(x[2j], x[2j+1])`` turned by ``p * inv_freq[j]``, in float64."""
    angle = positions.double()[:, None] * inv_freq.double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def half_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 1-3's rotate_half (first and second halves paired): not this model's."""
    angle = positions.double()[:, None] * inv_freq.double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def _recompute_patterns(a, tr, layer: int, rope=pair_rope, qk_norm=True, temperature=True, chunked=True):
    """``(heads, pos, pos)`` by formula in float64 from canonical weights: RoPE layers turn
    consecutive pairs and RMS-normalise q and k (no gain) under the chunked mask; the NoPE
    layer multiplies the query of row i by 1 + ATTN_SCALE log1p(floor((i + 1) / FLOOR_SCALE))
    under the causal mask. With the relative tolerance of the model's float32 steps."""
    n = tr.input_ids.shape[1]
    positions = torch.arange(n)
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
    eps = a.text_config.rms_norm_eps
    inv_freq = a.language_model.rotary_emb.inv_freq
    rotated = bool(NO_ROPE_LAYERS[layer])
    temp = 1 + ATTN_SCALE * torch.log1p(torch.floor((positions.double() + 1) / FLOOR_SCALE))
    if rotated:
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        if qk_norm:
            q = q * (q.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
            k = k * (k.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    elif temperature:
        q = q * temp[:, None, None]
    scores = torch.einsum("qhd,khd->hqk", q, k) * a.d_head**-0.5
    scores = scores.masked_fill(~chunked_mask(n, CHUNK if rotated and chunked else None), float("-inf"))
    if rotated:  # the model's float32 steps: RoPE tables (angle rounded, |angle| u), the rotation, the norm
        terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * a.d_head**-0.5
        angle = float(positions.max()) * float(inv_freq.max())
        # + 2: the float32 cos and sin; + 1: the float64 projections in another order (far below)
        per_vector = ROPE_ROUNDINGS + NORM_ROUNDINGS + angle + 2 + 1
        error = rounding_tol(terms, F32, 2 * per_vector) + 2 * statistic_tol(terms, F32, a.d_head)
    else:  # the projections in another order; the float32 temperature
        scale = a.d_head**-0.5 * float(temp.max())
        error = scores_tol(x, x, a.W_Q(layer), None, a.W_K(layer), None, scale, False)
        terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * a.d_head**-0.5
        error += rounding_tol(terms, F32, TEMPERATURE_ROUNDINGS)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def recompute_patterns(a, tr, layer: int):
    return _recompute_patterns(a, tr, layer)


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: each ingredient of the recomputation changes the patterns by far more
    than the tolerance; the chunked layers weight nothing outside their chunk."""
    a = m.adapter
    real = {b: tr.patterns[b][0] for b in range(a.n_layers)}
    variants = {
        "rotate_half rope": (0, {"rope": half_rope}),
        "no q/k norm": (1, {"qk_norm": False}),
        "no chunks": (2, {"chunked": False}),
        "no temperature": (3, {"temperature": False}),
    }
    for name, (layer, kw) in variants.items():
        other, _ = _recompute_patterns(a, tr, layer, **kw)
        assert (other[:, tr.query_positions] - real[layer]).abs().max() > 1e-3, name
    n = tr.input_ids.shape[1]
    outside = ~chunked_mask(n, CHUNK) & chunked_mask(n, None)
    for b in range(a.n_layers):
        weights = real[b][:, outside[tr.query_positions]]
        assert torch.all(weights == 0) if b in ROPE else torch.all(weights > 0)


# ---- layers, queries and keys, masks


def test_layers_are_declared_as_the_model_runs_them(traced):
    m, tr = traced
    a = m.adapter
    assert a.blocks == [(f"L{b}", "self") for b in range(4)] and tr.attention_blocks == [0, 1, 2, 3]
    assert [a.attention_chunk(b) for b in range(4)] == [CHUNK if b in ROPE else None for b in range(4)]
    assert [a.moe_experts(b) for b in range(4)] == [N_EXPERTS if b in MOE_LAYERS else 0 for b in range(4)]
    assert sorted(tr.mlp_in) == MOE_LAYERS and "expert" in a.edit_sites
    assert [a.query_extras(b) is not None for b in range(4)] == [True] * 4
    assert a.temperature(0, 5) is None
    torch.testing.assert_close(
        a.temperature(3, 12).double(), 1 + ATTN_SCALE * torch.log1p(torch.arange(1, 13).double().div(4).floor())
    )
    for b in MOE_LAYERS:  # what the MoE module read: the post-attention norm of the stream, (batch, pos, d_model)
        x = tr.resid_pre[b] + tr.attn_out[b]
        torch.testing.assert_close(tr.mlp_in[b], a._layer(b).post_attention_layernorm(x), atol=0, rtol=0)
        assert tr.mlp_out[b].shape == tr.resid_pre[b].shape


def _kept(m):
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    return capture(m, None, "", inputs=inputs, keep_qk=True, pattern_layers=[])


def _rope_scores_tol(q, k, scale: float, d_head: int) -> float:
    """How far two runs of the model's RoPE-layer ops on queries and keys projected in
    another order may put a score: each side's q and k take :data:`ROPE_ROUNDINGS` and the
    norm's roundings in float32 (a float64 difference may flip any of them), then a
    ``d_head``-term product."""
    terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * scale
    per_side = 2 * (ROPE_ROUNDINGS + NORM_ROUNDINGS)
    return rounding_tol(terms, F32, 2 * per_side) + 4 * statistic_tol(terms, F32, d_head) + sum_tol(terms, d_head, F64)


@torch.no_grad()
def test_recorded_queries_hold_the_temperature(traced):
    """What the NoPE layer's attention call received (the rows' source) is W_Q x times the
    temperature of each row; RoPE layers' recorded queries are unit-RMS per head."""
    m, tr = traced
    a = m.adapter
    kept = _kept(m)
    n = tr.input_ids.shape[1]
    rows = torch.arange(n, dtype=F64)
    temp = 1 + ATTN_SCALE * torch.log1p(torch.floor((rows + 1) / FLOOR_SCALE))
    assert temp.unique().numel() > 5  # the temperature varies over the prompt
    for b in NOPE:
        x = a.attn_norm(b)(tr.resid_pre[b][0])
        raw = torch.einsum("pm,hmd->phd", x, a.W_Q(b))
        want = raw * temp.view(-1, 1, 1)
        # the model's float32 temperature (TEMPERATURE_ROUNDINGS, each relative to it), its
        # projection in another order, the product's rounding
        size, t_max = float(raw.abs().max()), float(temp.max())
        tol = size * t_max * TEMPERATURE_ROUNDINGS * unit_roundoff(F32) + t_max * matmul_tol(x, a.W_Q(b))
        tol += rounding_tol(size * t_max, F64, 1)
        torch.testing.assert_close(kept.q[b][0], want, atol=tol, rtol=0)
        assert float((kept.q[b][0] - raw).abs().max()) > 1e-2  # not vacuous
    eps = a.text_config.rms_norm_eps
    for b in ROPE:  # the rotation keeps each pair's norm, the gainless norm leaves ms / (ms + eps)
        x = a.attn_norm(b)(tr.resid_pre[b][0])
        ms = torch.einsum("pm,hmd->phd", x, a.W_Q(b)).pow(2).mean(-1)
        rms = kept.q[b][0].pow(2).mean(-1).sqrt()
        tol = 2 * (ROPE_ROUNDINGS + NORM_ROUNDINGS) * unit_roundoff(F32) + gamma(a.d_head, F32)
        torch.testing.assert_close(rms, (ms / (ms + eps)).sqrt(), atol=tol, rtol=0)
        assert float((ms.sqrt() - 1).abs().max()) > 0.1  # not vacuous: the raw queries are far from unit-RMS


@torch.no_grad()
def test_queries_keys_are_the_models(traced):
    """adapter.queries_keys (canonical weights, consecutive-pair RoPE, gainless q/k norm on
    RoPE layers, the temperature on the NoPE layer) gives the model's own scores."""
    m, tr = traced
    a = m.adapter
    kept = _kept(m)
    for b in range(a.n_layers):
        q, k = a.queries_keys(tr, b)
        model_k = kept.k[b][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        ours = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(b)
        theirs = torch.einsum("qhd,khd->hqk", kept.q[b][0], model_k) * kept.score_scale[b]
        if b in ROPE:
            tol = _rope_scores_tol(q, k, a.score_scale(b), a.d_head)
        else:  # the projections in another order, then the same float32 temperature, one more product
            x = a.attn_norm(b)(tr.resid_pre[b][0])
            scale = a.score_scale(b) * float(a.temperature(b, q.shape[0]).max())
            terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * a.score_scale(b)
            tol = scores_tol(x, x, a.W_Q(b), a.b_Q(b), a.W_K(b), a.b_K(b), scale, False) + rounding_tol(terms, F64, 1)
        torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
        if b in NOPE:  # not vacuous: the same queries without the temperature score otherwise
            bare = q / a.temperature(b, q.shape[0]).double().view(-1, 1, 1)
            assert float((torch.einsum("qhd,khd->hqk", bare, k) * a.score_scale(b) - theirs).abs().max()) > 1e-2


@torch.no_grad()
def test_rotation_turns_consecutive_pairs(traced):
    """a.rotate is the complex product on pairs (2j, 2j+1), to float32 (the model rotates in float32)."""
    m, _ = traced
    a = m.adapter
    x = torch.randn(9, 4, a.d_head, dtype=F64)
    p = torch.arange(9) * 3
    want = pair_rope(x, p, a.language_model.rotary_emb.inv_freq)
    angle = float(p.max()) * float(a.language_model.rotary_emb.inv_freq.max())
    # the model's float32 steps (the angle rounded: |angle| u; cos, sin; the product) on a pair
    # of norm at most sqrt(2) max|x|
    tol = (ROPE_ROUNDINGS + angle + 2) * unit_roundoff(F32) * float(x.abs().max()) * math.sqrt(2)
    torch.testing.assert_close(a.rotate(x, p, 0), want, atol=tol, rtol=0)
    assert float((half_rope(x, p, a.language_model.rotary_emb.inv_freq) - want).abs().max()) > 1e-2
    assert torch.equal(a.rotate(x, p, 3), x)  # the NoPE layer is not rotated


def test_chunked_masks_recorded_and_rebuilt(traced):
    """The recorded masks are the chunked rule on RoPE layers (full causal on NoPE) and the
    rule rebuilt without a recording is the same, also for a left-padded row, whose chunks
    start at its first real token (the model's own mask of a left-padded batch)."""
    m, tr = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    assert n > 4 * CHUNK
    for b in range(a.n_layers):
        want = chunked_mask(n, CHUNK if b in ROPE else None)
        assert torch.equal(a.allowed_keys(tr, b), want)
    # a left-padded batch through the model itself: its masks, recorded, against the rebuilt rule
    prompts = [a.prompt(QUESTION), a.prompt("what color is the square of the blue circle?")]
    tok = a.processor.tokenizer
    batch = a.processor(images=[noise_image(IMAGE_SIZE)] * 2, text=prompts, padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and int(batch["attention_mask"][0, 0]) == 0
    tensors = dict(batch)
    tensors["pixel_values"] = tensors["pixel_values"].to(F64)
    inputs = ModelInputs(tensors, torch.full((2,), tensors["input_ids"].shape[1] - 1), tensors["input_ids"], prompts)
    left_tr = capture(m, None, "", inputs=inputs, pattern_layers=[])
    width = tensors["input_ids"].shape[1]
    left = int((tensors["attention_mask"][0] == 0).sum())
    recorded = {b: a.allowed_keys(left_tr, b) for b in range(a.n_layers)}
    del left_tr.decoder_masks
    for b in range(a.n_layers):
        real = tensors["attention_mask"][0].bool()
        want = chunked_mask(width, CHUNK if b in ROPE else None, left) & real
        assert torch.equal(recorded[b], want) and torch.equal(a.allowed_keys(left_tr, b), want), b
    assert not torch.equal(chunked_mask(width, CHUNK, left), chunked_mask(width, CHUNK))  # the shift matters


# ---- the experts


def expert_outputs(moe, x: torch.Tensor, on_output: bool = False, scores=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``((E, n, d_model), (n, E))``: each expert's write by hand and the router's scores:
    the sigmoid (float32, as the model) of the top-k logits scales the expert's INPUT,
    ``down_e(silu(s x G_e) * (s x U_e))``. ``on_output``: ``s * down_e(silu(x G_e) * (x U_e))``
    instead (the usual MoE, not this one). ``scores``: ``(n, E)`` given instead of the router by hand."""
    if scores is None:
        logits = x @ moe.router.weight.T
        top, idx = logits.topk(TOP_K, dim=-1)
        scores = torch.zeros_like(logits).scatter(1, idx, torch.sigmoid(top.float()).to(x.dtype))
    width = moe.experts.down_proj.shape[1]
    outs = []
    for e in range(N_EXPERTS):
        s = scores[:, e : e + 1]
        h = (x if on_output else x * s) @ moe.experts.gate_up_proj[e]
        y = (torch.nn.functional.silu(h[:, :width]) * h[:, width:]) @ moe.experts.down_proj[e]
        outs.append(s * y if on_output else y)
    return torch.stack(outs), scores


def swiglu_tol(gate_up: torch.Tensor, down: torch.Tensor, xs: torch.Tensor) -> float:
    """How far two evaluations of ``(silu(gate) * up) @ down``, ``gate | up = xs @ gate_up``
    (``xs (d_model,)``, ``gate_up (d_model, 2I)``, ``down (I, d_model)``) may be apart: the
    first product in another order (``sum_tol``), carried through ``silu(gate) * up``
    (``|silu'| <= 1.1``) and the down projection, which adds its own sum in another order."""
    width = down.shape[0]
    h = xs @ gate_up
    h_err = sum_tol(float((xs.abs() @ gate_up.abs()).max()), xs.shape[-1], F64)
    gate, up = h[:width], h[width:]
    act = torch.nn.functional.silu(gate) * up
    act_err = h_err * float((1.1 * up.abs() + torch.nn.functional.silu(gate).abs()).max() + h_err)
    act_err += 2 * unit_roundoff(F64) * float(act.abs().max())
    return act_err * float(down.abs().sum(0).max()) + sum_tol(float((act.abs() @ down.abs()).max()), width, F64)


def shared_by_hand(moe, x: torch.Tensor) -> torch.Tensor:
    """The shared expert, ungated: ``down(silu(gate x) * up x)``."""
    se = moe.shared_expert
    return (torch.nn.functional.silu(x @ se.gate_proj.weight.T) * (x @ se.up_proj.weight.T)) @ se.down_proj.weight.T


def test_expert_components_reconstruct_the_mlp_output(traced):
    """At every position each chosen expert's component is its write by hand (score on the
    input), the shared expert is the module's, and with the residue they are the MoE
    block's output; the score on the output instead is another write (not vacuous)."""
    m, tr = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    for b in MOE_LAYERS:
        moe = a._layer(b).feed_forward
        x = tr.mlp_in[b][0]
        with torch.no_grad():
            by_hand, scores = expert_outputs(moe, x, scores=moe.router(x)[0])
            # the router by hand: the same top-k choice; its sigmoid in float32 on logits summed in
            # another order, so one float32 rounding apart at most
            _, hand_scores = expert_outputs(moe, x)
            assert torch.equal(hand_scores != 0, scores != 0)
            torch.testing.assert_close(hand_scores, scores, atol=0, rtol=2 * unit_roundoff(F32))
            shared = shared_by_hand(moe, x)
            for p in range(n):
                parts = dict(a.mlp_components(tr, b, p))
                chosen = scores[p].nonzero().flatten().tolist()
                assert len(chosen) == TOP_K
                assert list(parts) == [*[f"L{b}.E{e}" for e in chosen], f"L{b}.shared_expert", f"L{b}.experts_residue"]
                for e in chosen:
                    tol = swiglu_tol(moe.experts.gate_up_proj[e], moe.experts.down_proj[e], x[p] * scores[p, e])
                    torch.testing.assert_close(parts[f"L{b}.E{e}"], by_hand[e, p], atol=tol, rtol=0)
                se = moe.shared_expert
                gate_up = torch.cat([se.gate_proj.weight.T, se.up_proj.weight.T], dim=1)
                tol = swiglu_tol(gate_up, se.down_proj.weight.T, x[p])
                torch.testing.assert_close(parts[f"L{b}.shared_expert"], shared[p], atol=tol, rtol=0)
                # the k + 1 writes summed in other orders than the model's (which adds E - k exact zeros)
                size = float(sum(v.abs() for v in parts.values()).max())
                total = sum(v for name, v in parts.items() if not name.endswith("residue"))
                assert float((total - tr.mlp_out[b][0, p]).abs().max()) <= sum_tol(size, 2 * len(parts), F64)
                assert float(parts[f"L{b}.experts_residue"].abs().max()) <= sum_tol(size, 2 * len(parts), F64)
            wrong = shared + expert_outputs(moe, x, on_output=True, scores=scores)[0].sum(0)
            assert float((wrong - tr.mlp_out[b][0]).abs().max()) > 1e-3


def _zero_expert_rows(experts, expert: int, positions: list[int]):
    """A forward hook on the library's experts module (output ``(E * n, d)``, expert e's rows
    ``e * n ...``) that zeroes expert ``expert``'s output at ``positions`` (one batch row)."""

    def hook(module, args, out):
        out = out.clone()
        n = out.shape[0] // module.num_experts
        out[expert * n + torch.tensor(positions)] = 0
        return out

    return experts.register_forward_hook(hook)


def test_expert_ablation_equals_a_hand_written_hook(traced):
    """Edit site "expert" (component_edit of ``L{l}.E{e}``) at some positions is a forward
    whose experts module has expert e's output zeroed there by a hook written here; a chosen
    expert's ablation moves the logits, an expert none of those positions chose changes nothing."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    answer = int(tr.answer_positions[0])
    positions = [*tr.visual_positions[0][:3].tolist(), answer]
    seen_unchosen = False
    for b in MOE_LAYERS:
        moe = a._layer(b).feed_forward
        chosen = set(sum(chosen_experts(moe, tr.mlp_in[b][0, positions]), []))
        for expert in range(N_EXPERTS):
            edit = component_edit(tr, f"L{b}.E{expert}", tuple(positions))
            assert (edit.site, edit.block, edit.expert) == ("expert", b, expert)
            got = edited_logits(m, inputs, [edit])
            handle = _zero_expert_rows(moe.experts, expert, positions)
            try:
                with torch.no_grad():
                    want = a.forward_logits(inputs)
            finally:
                handle.remove()
            torch.testing.assert_close(got, want, atol=forwards_tol(a, want, want.shape[1]), rtol=0)
            moved = float((got - tr.logits).abs().max())
            if expert in chosen:
                assert moved > 1e-3, (b, expert, moved)
            else:
                seen_unchosen = True
                assert moved == 0, (b, expert, moved)
    assert seen_unchosen


def test_mlp_edit_of_a_moe_layer_equals_a_hand_written_hook(traced):
    """Zeroing a MoE layer's whole write (site "mlp") at some positions: the module's output
    is flattened over (batch, pos) and comes with the router logits; the edit still lands at
    those positions (a hook written here on the library's module); so does a dense layer's."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    positions = [3, int(tr.answer_positions[0])]
    for b in (1, 2):
        got = edited_logits(m, inputs, [Edit(b, None, positions)])

        def zero(module, args, out):
            if isinstance(out, tuple):
                flat = out[0].clone()
                flat[torch.tensor(positions)] = 0  # one batch row: token index = position
                return (flat, out[1])
            out = out.clone()
            out[:, positions] = 0
            return out

        handle = a._layer(b).feed_forward.register_forward_hook(zero)
        try:
            with torch.no_grad():
                want = a.forward_logits(inputs)
        finally:
            handle.remove()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert float((got - tr.logits).abs().max()) > 1e-3


def test_an_expert_edit_is_checked(traced):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with pytest.raises(InterventionError, match=f"{N_EXPERTS} routed experts"):
        edited_logits(m, inputs, [Edit(1, None, [3], site="expert", expert=N_EXPERTS)])
    with pytest.raises(InterventionError, match="0 routed experts"):
        edited_logits(m, inputs, [Edit(0, None, [3], site="expert", expert=0)])


def test_decomposition_is_exact_with_expert_components(traced):
    m, tr = traced
    a = m.adapter
    for position in [int(tr.visual_positions[0][2]), int(tr.answer_positions[0])]:
        r = decompose(a, tr, a.token_id("yes"), a.token_id("no"), position=position)
        assert r.reconstruction_ok
        names = [c.name for c in r.components]
        assert "L3.shared_expert" in names and sum(n.startswith("L3.E") for n in names) == TOP_K


# ---- inputs, geometry, refusals


def test_prompt_layout_and_pixels(traced):
    """``<|image_start|><|image|>`` 16 ``<|patch|>`` ``<|image_end|>``: the patches are the
    visual tokens, the rest delimiters; pixel values come in the model's dtype (the
    processor gives bfloat16)."""
    m, tr = traced
    a = m.adapter
    tokens = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    start = tokens.index("<|image_start|>")
    vis = tr.visual_positions[0].tolist()
    assert vis == list(range(start + 2, start + 2 + TOKENS_PER_TILE))
    assert tokens[start + 1] == "<|image|>" and tokens[vis[-1] + 1] == "<|image_end|>"
    assert a.visual_delimiter_positions(tr) == [start, start + 1, vis[-1] + 1]
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles.count("visual") == TOKENS_PER_TILE
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    raw = a.processor(images=[noise_image(IMAGE_SIZE)], text=[a.prompt(QUESTION)], return_tensors="pt")
    assert raw["pixel_values"].dtype == torch.bfloat16 and inputs.tensors["pixel_values"].dtype == F64
    assert torch.equal(inputs.tensors["pixel_values"], raw["pixel_values"].to(F64))


@pytest.mark.parametrize("size", [(60, 40), (40, 60), (30, 50), (32, 32), (100, 20), (200, 150), (20, 90)])
def test_tile_layout_is_the_processors(size):
    """Tiles (the processor's aspect ratios) and the resized content (the pixels before the
    black padding, -1 after normalising) as tile_layout says; one token per tile patch
    cell plus the global tile, as many as the prompt's <|patch|> tokens."""
    m = tiled()
    a = m.adapter
    (rows, cols), (nw, nh) = a.tile_layout(size)
    out = a.processor.image_processor(images=[noise_image(size)], return_tensors="pt")
    assert out["aspect_ratios"][0].tolist() == [rows, cols]
    pixels = out["pixel_values"]
    n_tiles = rows * cols
    assert pixels.shape[0] == n_tiles + (n_tiles > 1)
    canvas = (
        pixels[:n_tiles].view(rows, cols, 3, TILE, TILE).permute(2, 0, 3, 1, 4).reshape(3, rows * TILE, cols * TILE)
    )
    padding = (canvas == -1).all(0)
    assert not padding[:nh, :nw].all(1).any() and not padding[:nh, :nw].all(0).any()  # content every row and column
    assert padding[nh:].all() and padding[:, nw:].all()
    inputs = a.prepare([noise_image(size)], [QUESTION])
    tokens = a.visual_tokens(size, a.visual_positions(inputs)[0].tolist())
    assert len(tokens) == int((inputs.input_ids == m.model.config.image_token_id).sum()) == pixels.shape[0] * GRID**2
    assert [t.image for t in tokens] == [i // GRID**2 for i in range(len(tokens))]


def test_tiles_and_the_global_tile_by_experiment():
    """A 60 x 40 image in a 2 x 2 canvas and the global tile: inverting the pixels around a
    token's box centre changes that token's features most among its own tile's (the
    boxes are where the processor put each tile and each cell) and, for the global
    tile, most among the global tile's tokens."""
    m = tiled()
    a = m.adapter
    size = IMAGE_SIZE
    tokens = a.visual_tokens(size)
    assert sorted({t.image for t in tokens}) == [0, 1, 2, 3, 4] and len(tokens) == 5 * GRID**2
    inputs = a.prepare([noise_image(size)], [QUESTION])
    assert [t.position for t in a.visual_tokens(size, a.visual_positions(inputs)[0].tolist())] == a.visual_positions(
        inputs
    )[0].tolist()
    base = np.asarray(noise_image(size, 3)).copy()
    ref = visual_inputs(m, Image.fromarray(base))
    probes = [t for t in tokens if (t.box[0] + t.box[2]) / 2 < size[0] and (t.box[1] + t.box[3]) / 2 < size[1]]
    assert {t.image for t in probes} == {0, 1, 2, 3, 4}
    for t in probes:
        change = (visual_inputs(m, Image.fromarray(invert_around_box_centre(base, t.box, 5))) - ref).norm(dim=-1)
        frame = torch.arange(t.image * GRID**2, (t.image + 1) * GRID**2)
        assert int(frame[change[frame].argmax()]) == t.index, (t, change[frame].topk(3))


def test_visual_feature_sites_are_refused(traced):
    """The projector's rows are tiles (several per image with more than one tile): no
    per-prompt visual-token layout to edit."""
    m, _ = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=f"no '{site}' edit site"):
            capture(m, None, "", inputs=inputs, edits=[Edit(None, site=site)])
        with pytest.raises(InterventionError) as refused:
            m.adapter.visual_site_module(site)
        assert "rows are tiles, not prompts" in str(refused.value) and "\n" not in str(refused.value)


def test_fallback_prompt_is_the_template(traced):
    m, _ = traced
    a = m.adapter
    assert a.fallback_prompt.format(question=QUESTION) == a.prompt(QUESTION)


def test_unmapped_configs_and_mismatched_processors_are_refused():
    config = tiny_config()
    config.text_config.layer_types = ["sliding_attention", *config.text_config.layer_types[1:]]
    with pytest.raises(UnsupportedArchitectureError, match="sliding_attention"):
        Llama4Adapter.check_config(config)
    model, processor = tiny_model()
    processor.img_patch_token = "<|image|>"
    with pytest.raises(ModelLoadError, match="patch token"):
        Llama4Adapter(model, processor, processor.tokenizer)
    model, processor = tiny_model()
    processor.patch_size = 8
    with pytest.raises(ModelLoadError, match="patch_size"):
        Llama4Adapter(model, processor, processor.tokenizer)


def test_analyze_json_is_exact_and_has_every_tiles_grid():
    """analyze on the tiled model (2 x 2 tiles and the global one): strict JSON, the
    decomposition's reconstruction within the stack's tolerance, a patch grid per view."""
    import json

    from core.analyze import analyze
    from tests.core.exactness import stack_tol

    m = tiled()
    image = noise_image(IMAGE_SIZE)
    with torch.no_grad():
        result = analyze(m, image, QUESTION).to_dict()
    json.dumps(result, allow_nan=False)
    tr = capture(m, image, QUESTION)
    target = result["target"]
    assert result["residual_decomposition"]["reconstruction_max_abs_err"] <= stack_tol(
        m.adapter, tr, target["position"]
    )
    names = {c["name"] for c in result["residual_decomposition"]["components"]}
    assert {"L1.shared_expert", "L3.shared_expert", "L1.experts_residue"} <= names
    grids = {g["image"]: np.array(g["grid"]).shape for g in result["rollout"]["visual_patch_mass_by_image"]}
    assert grids == {image: (GRID, GRID) for image in range(5)}
