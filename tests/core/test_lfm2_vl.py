"""LFM2-VL adapter on a tiny random float64 hybrid model (tests/core/tiny_lfm2_vl.py:
layers [conv, full, full, conv]): the conformance checks over its attention layers,
and what is its own: the short-convolution layers have no pattern and no heads (every
such read-out refused in one line, their write one component, recomputed here by hand
from the layer's input, ablated as a whole equal to a hand-written hook); the renamed
attention parts (out_proj, q/k layernorms) and the final ``embedding_norm``; and the
visual tokens of tiles and thumbnail, their boxes by formula, the processor's own
layout and by experiment."""

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InterventionError, UndefinedReadoutError, UnsupportedArchitectureError
from core.forward.capture import capture, edited_logits
from core.forward.edits import Edit
from core.methods.residual import component_edit
from core.models.families.lfm2_vl import Lfm2VlAdapter
from core.models.loading import LoadedModel
from core.views import image_views
from tests.core.exactness import (
    assert_queries_keys_are_the_models,
    capture_every_position,
    invert_around_box_centre,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    realized_scores_tol,
)
from tests.core.tiny_lfm2_vl import (
    CELL,
    CONV_KERNEL,
    IMAGE_SIZE,
    LAYER_TYPES,
    PATCH,
    QUESTION,
    TILE_SIZE,
    TILED_SIZE,
    tiny_config,
    tiny_model,
    tiny_processor,
)
from tests.tolerances import NORM_ROUNDINGS, abs_terms, gamma, matmul_tol, unit_roundoff

CONV, FULL = [0, 3], [1, 2]
QUESTION_2 = "what color is the square of the blue circle?"


def tiny_lfm2_vl_float64() -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model()
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-lfm2_vl", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "lfm2_vl"):
    """``(model, trace)``: one capture, every query position kept; built once per session."""
    import transformers

    transformers.logging.set_verbosity_error()  # the reference causal-conv1d fallback warns once per process
    m = tiny_lfm2_vl_float64()
    tr, _ = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr


CASES = ("lfm2_vl",)


@pytest.fixture(scope="module")
def traced():
    return traced_case()


def with_processor(m, **image_settings) -> Lfm2VlAdapter:
    """An adapter of the same model over a tiny processor with other image-processor settings."""
    processor = tiny_processor()
    for name, value in image_settings.items():
        setattr(processor.image_processor, name, value)
    return Lfm2VlAdapter(m.model, processor, processor.tokenizer)


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Lfm2VlForConditionalGeneration": Lfm2VlAdapter}
DESCRIPTION = {
    "family": "lfm2_vl",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 4,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
# one crop of 15 tokens, and 2 tiles of 4 + a 15-token thumbnail: other crop counts and markers
PADDED_BATCH = ([IMAGE_SIZE, TILED_SIZE], [QUESTION, QUESTION_2])
ANSWER_TOKEN = "assistant"  # the prompt ends "assistant\n": the word-level tokenizer drops the newline
BAD_QUESTIONS = (
    ("vocabulary", "is there a purple circle?"),
    ("too long", " ".join(["red"] * 600)),
    ("special token", "is there a <|img_row_1_col_2|> circle?"),
)
PERTURB_SIZES = [IMAGE_SIZE, TILED_SIZE]


def check_canonical_weights(m, x) -> None:
    """W_Q / W_K / W_V are q_proj / k_proj / v_proj per head (grouped K/V expanded),
    W_O is out_proj (not o_proj); the q / k norms are the model's q_layernorm /
    k_layernorm bit for bit; the attention norm is operator_norm; W_U is tied."""
    a = m.adapter
    for layer in FULL:
        attn = m.model.model.language_model.layers[layer].self_attn
        n, group = x.shape[0], a.n_heads // a.n_kv_heads
        q = attn.q_proj(x).view(n, a.n_heads, a.d_head)
        k = attn.k_proj(x).view(n, a.n_kv_heads, a.d_head)
        v = attn.v_proj(x).view(n, a.n_kv_heads, a.d_head)
        for W, want in (
            (a.W_Q(layer), q),
            (a.W_K(layer), k.repeat_interleave(group, 1)),
            (a.W_V(layer), v.repeat_interleave(group, 1)),
        ):
            torch.testing.assert_close(torch.einsum("pm,hmd->phd", x, W), want, atol=matmul_tol(x, W), rtol=0)
        z = torch.randn(n, a.n_heads, a.d_head, dtype=x.dtype)
        W_O = a.W_O(layer).flatten(0, 1)
        torch.testing.assert_close(
            z.flatten(1) @ W_O, attn.out_proj(z.flatten(1)), atol=matmul_tol(z.flatten(1), W_O), rtol=0
        )
        assert all(torch.all(b == 0) for b in (a.b_Q(layer), a.b_K(layer), a.b_V(layer), a.b_O(layer)))
        torch.testing.assert_close(a.q_norm(layer)(q), attn.q_layernorm(q), atol=0, rtol=0)
        torch.testing.assert_close(a.k_norm(layer)(k), attn.k_layernorm(k), atol=0, rtol=0)
    layer = m.model.model.language_model.layers[0]
    torch.testing.assert_close(a.attn_norm(0)(x), layer.operator_norm(x), atol=0, rtol=0)
    final = m.model.model.language_model.embedding_norm
    torch.testing.assert_close(a.final_norm_layer()(x), final(x), atol=0, rtol=0)
    assert a.W_U.data_ptr() == a.language_model.embed_tokens.weight.data_ptr()


def check_padded_batch(m, batch) -> None:
    """Row 0: 15 visual tokens, 2 markers; row 1: 2 x 4 tile tokens and 15 thumbnail
    tokens, 5 markers; each row's own."""
    a = m.adapter
    ids = batch.input_ids
    image_id = m.model.config.image_token_id
    assert [int((ids[i] == image_id).sum()) for i in range(2)] == [15, 23]
    marks = a.delimiter_ids()
    assert [sum(int(t) in marks for t in ids[i]) for i in range(2)] == [2, 5]


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: every crop's projected tokens in order, as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "spatial_shapes", "pixel_attention_mask")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """The tokens of the one crop, or of the thumbnail: on a tile of 4 x 4 patches the
    random tower's attention spreads a change over the whole crop, so a tile token's
    geometry is probed on the pixels it reads (test_each_token_reads_the_pixels_of_its_box)."""
    last = max(t.image for t in tokens)
    return [t for t in tokens if t.image == last]


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    """A token's rivals are its own crop's tokens: a tile token and the thumbnail token
    over the same pixels both see the change."""
    return [torch.tensor([u.index for u in tokens if u.image == t.image])]


def check_decomposition(m, tr, r) -> None:
    """embed; per conv layer one write and its MLP; per attention layer its heads and MLP."""
    names = [c.name for c in r.components]
    want = ["embed"]
    for layer, kind in enumerate(LAYER_TYPES):
        heads = [f"L{layer}.H{h}" for h in range(4)]
        want += ([f"L{layer}.conv"] if kind == "conv" else heads) + [f"L{layer}.mlp"]
    assert names == want


def _rms(v, weight, eps):
    """LFM2's RMSNorm by its formula: statistics in float32, cast back, gain ``w`` (not ``1 + w``)."""
    f = v.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)


def _recompute_patterns(a, tr, layer: int, qk_norms: bool = True, rope: bool = True):
    """``(heads, pos, pos)`` from the layer's own weights: operator_norm, q_proj / k_proj,
    the per-head RMSNorms, a full rotate-half RoPE whose table is built here from
    rope_theta (in float32, as the model builds it), causal softmax; GQA as kv head
    ``h // 2``."""
    lm = a.language_model
    attn, eps = lm.layers[layer].self_attn, a.text_config.norm_eps
    n_pos, dh = tr.input_ids.shape[1], a.d_head
    x = _rms(tr.resid_pre[layer][0], lm.layers[layer].operator_norm.weight, eps)
    q = (x @ attn.q_proj.weight.T).view(n_pos, -1, dh)
    k = (x @ attn.k_proj.weight.T).view(n_pos, -1, dh)
    if qk_norms:
        q, k = _rms(q, attn.q_layernorm.weight, eps), _rms(k, attn.k_layernorm.weight, eps)
    theta = a.text_config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    angle = torch.arange(n_pos, dtype=torch.float32)[:, None] * inv_freq
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(q.dtype)[:, None], angle.sin().to(q.dtype)[:, None]

    def turn(v):
        if not rope:
            return v
        v1, v2 = v[..., : dh // 2], v[..., dh // 2 :]
        return v * cos + torch.cat([-v2, v1], -1) * sin

    k = k.repeat_interleave(a.n_heads // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", turn(q), turn(k)) / math.sqrt(dh)
    scores = scores.masked_fill(~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1), pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, layer))


def recompute_patterns(a, tr, layer: int):
    return _recompute_patterns(a, tr, layer)


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: without the q / k layernorms, or without the rotation, the patterns differ."""
    a = m.adapter
    for layer in FULL:
        for other in (_recompute_patterns(a, tr, layer, qk_norms=False), _recompute_patterns(a, tr, layer, rope=False)):
            assert (other[0][:, tr.query_positions] - tr.patterns[layer][0]).abs().max() > 1e-3


# ---- the layers without attention


def test_blocks_name_each_layers_mixer(traced):
    m, tr = traced
    a = m.adapter
    assert a.blocks == [("L0", "conv"), ("L1", "self"), ("L2", "self"), ("L3", "conv")]
    assert tr.attention_blocks == FULL and sorted(tr.patterns) == FULL and sorted(tr.mixer_out) == CONV
    assert all(tr.z[b] is None for b in CONV)
    assert "mixer" in a.edit_sites and a.first_attention_block == 1
    assert a.mixer_module(0) is m.model.model.language_model.layers[0].conv


def test_pattern_and_head_readouts_of_a_conv_layer_are_refused_in_one_line(traced):
    """A pattern, queries and keys, a head's write, a head or knockout edit and a pattern
    stream of a short-convolution layer: each refused with the layer and the reason."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    reason = "L0 has no attention pattern and no heads: LFM2 gated short convolution"
    for call in (
        lambda: capture(m, None, "", inputs=inputs, pattern_layers=[0]),
        lambda: capture(m, None, "", inputs=inputs, keep_qk=[3]),
        lambda: tr.head_output(a, 0, 3),
        lambda: a.W_Q(0),
        lambda: a.W_O(3),
        lambda: a.queries_keys(tr, 3),
        lambda: edited_logits(m, inputs, [Edit(0, 1, [3])]),
        lambda: edited_logits(m, inputs, [Edit(3, None, [3], site="knockout", keys=[1])]),
        lambda: capture(m, None, "", inputs=inputs, pattern_streams=[lambda *args: None]),
    ):
        with pytest.raises(UndefinedReadoutError) as refused:
            call()
        message = str(refused.value)
        assert "\n" not in message and "no attention pattern" in message and "short convolution" in message
    assert reason in str(pytest.raises(UndefinedReadoutError, a.W_Q, 0).value)


def conv_by_hand(layer, x, order=(0, 1, 2), causal: bool = True):
    """The conv layer's write for its input ``x (pos, d)``, from its weights alone:
    ``n = operator_norm(x)``; ``B, C, u = rows [0:d], [d:2d], [2d:3d] of in_proj``;
    ``y[t] = sum_k w[:, k] * (B * u)[t - (K-1) + k]`` (zeros before position 0);
    ``out_proj(C * y)``. Also the terms ``|.|`` of every product on the way.
    ``order``: which chunk is read as B, C, u; ``causal`` False: the kernel read the
    other way (``w[:, 0]`` on the current token): wrong variants, to show the check can fail."""
    conv, d = layer.conv, x.shape[-1]
    n = _rms(x, layer.operator_norm.weight, layer.operator_norm.variance_epsilon)
    W = [conv.in_proj.weight[i * d : (i + 1) * d].T for i in order]
    B, C, u = (n @ w for w in W)
    aB, aC, au = (abs_terms(n, w) for w in W)
    w = conv.conv.weight[:, 0, :]  # (d, K)
    w = w if causal else w.flip(-1)
    K = w.shape[1]
    gated, agated = B * u, aB * au
    y, ay = torch.zeros_like(gated), torch.zeros_like(gated)
    for t in range(x.shape[0]):
        for k in range(K):
            s = t - (K - 1) + k
            if s >= 0:
                y[t] += w[:, k] * gated[s]
                ay[t] += w[:, k].abs() * agated[s]
    out = (C * y) @ conv.out_proj.weight.T
    terms = abs_terms(aC * ay, conv.out_proj.weight.T)
    return out, terms


def conv_tol(terms: torch.Tensor, d: int, K: int) -> float:
    """How far two evaluations of the write may differ, relative to its terms: it is
    trilinear in the normed stream, three ``d``-term products, a ``K``-term conv and two
    gate products in float64 on each side, plus the norm's float32 roundings (the model's
    and this file's norm may round apart) in each of the three factors."""
    rel = 2 * gamma(3 * d + K + 4, torch.float64) + 3 * NORM_ROUNDINGS * unit_roundoff(torch.float32)
    return float(terms.max()) * rel


def test_a_conv_layers_write_is_the_conv_recomputed_by_hand(traced):
    """trace.mixer_out of each conv layer equals in_proj -> (B, C, x) -> causal depthwise
    conv of B * x -> out_proj(C * y) recomputed from the layer's input (resid_pre); a
    flipped (anti-causal) kernel or the gates swapped (C for B) give other writes."""
    m, tr = traced
    lm = m.model.model.language_model
    with torch.no_grad():
        for block in CONV:
            layer, x = lm.layers[block], tr.resid_pre[block][0]
            want, terms = conv_by_hand(layer, x)
            tol = conv_tol(terms, x.shape[-1], CONV_KERNEL)
            torch.testing.assert_close(tr.mixer_out[block][0], want, atol=tol, rtol=0)
            # the check can fail: the kernel read the other way, or B and C exchanged
            for other, _ in (conv_by_hand(layer, x, causal=False), conv_by_hand(layer, x, order=(1, 0, 2))):
                assert float((other - tr.mixer_out[block][0]).abs().max()) > 1e3 * tol


def test_a_conv_layers_ablation_equals_a_hand_written_hook(traced):
    """Edit site "mixer" (what component_edit gives for ``L3.conv``) zeroes the short
    convolution's write at the chosen positions: the same logits as a forward hook written
    here on the layer's out_proj (whose output is the write); and it changes the logits."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    positions = tr.visual_positions[0][:5].tolist() + [int(tr.answer_positions[0])]
    for block in CONV:
        edit = component_edit(tr, f"L{block}.conv", tuple(positions))
        assert edit.site == "mixer" and edit.block == block
        got = edited_logits(m, inputs, [edit])

        def zero(module, args, out):
            out = out.clone()
            out[:, positions] = 0
            return out

        handle = m.model.model.language_model.layers[block].conv.out_proj.register_forward_hook(zero)
        try:
            with torch.no_grad():
                want = m.model(**inputs.tensors, use_cache=False).logits
        finally:
            handle.remove()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert float((got - tr.logits).abs().max()) > 1e-3


def test_queries_keys_are_the_models(traced):
    """adapter.queries_keys (q/k layernorms, RoPE) gives the model's own scores at each
    attention layer (the q and k its attention function received)."""
    m, tr = traced
    assert_queries_keys_are_the_models(m, tr, FULL, m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION]))


def test_the_stream_ends_in_embedding_norm(traced):
    """x_L is the last block's output (not the model's last hidden state, which is
    embedding_norm of it); the captured logits are lm_head(embedding_norm(x_L))."""
    m, tr = traced
    a = m.adapter
    lm = m.model.model.language_model
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with torch.no_grad():
        out = m.model(**inputs.tensors, output_hidden_states=True, use_cache=False)
        torch.testing.assert_close(out.hidden_states[-1], lm.embedding_norm(tr.final_resid), atol=0, rtol=0)
        assert (out.hidden_states[-1] - tr.final_resid).abs().max() > 1e-2
        torch.testing.assert_close(tr.logits, m.model.lm_head(lm.embedding_norm(tr.final_resid)), atol=0, rtol=0)


def test_knockout_cuts_only_the_attention_layers_and_says_so(traced):
    from core.methods.flow.knockout import knockout_sweep
    from core.methods.flow.positions import parse_edges

    m, tr = traced
    a = m.adapter
    image = noise_image(IMAGE_SIZE)
    inputs = a.prepare([image], [QUESTION])
    answer = int(tr.logits[0, -1].argmax())
    result = knockout_sweep(m, inputs, image, QUESTION, parse_edges("image->answer"), answer)
    assert result.layers == ["L1", "L2"]
    assert all(cut.block in ("L1", "L2") for w in result.profiles[0].windows for cut in w.cut)
    notes = " ".join(result.audit.notes)
    assert "not cut: L0, L3" in notes and "short convolution" in notes


def test_expert_and_visual_feature_sites_are_refused(traced):
    """No experts; the projector runs over every crop's token slots side by side: no
    per-token visual-feature site."""
    m, _ = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with pytest.raises(InterventionError, match="no 'expert' edit site"):
        m.adapter.check_edits([Edit(1, None, [1], site="expert", expert=0)])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=site):
            capture(m, None, "", inputs=inputs, edits=[Edit(None, site=site)])
        with pytest.raises(InterventionError, match="side by side"):
            m.adapter.visual_site_module(site)


# ---- geometry


@pytest.mark.parametrize(
    "size", [IMAGE_SIZE, TILED_SIZE, (40, 30), (600, 100), (100, 600), (130, 170), (17, 65), (300, 40)]
)
def test_visual_tokens_are_the_processors_crops_in_order(traced, size):
    """Per size: the processor's own layout (return_row_col_info), the model's features
    per crop (spatial_shapes / 2) and visual_tokens agree: tiles row-major, each a
    (tile / cell)^2 grid, then the thumbnail on the smart-resize grid; positions in order."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    info = m.processor.image_processor(images=[image], return_row_col_info=True, return_tensors="pt")
    rows, cols = int(info["image_rows"][0]), int(info["image_cols"][0])
    rh, rw = (int(v) for v in info["image_sizes"][0])
    assert a.layout(size)[:4] == (rows, cols, rh, rw)
    inputs = a.prepare([image], [QUESTION])
    vis = a.visual_positions(inputs)[0].tolist()
    tokens = a.visual_tokens(size, vis)
    assert [t.position for t in tokens] == vis and [t.index for t in tokens] == list(range(len(vis)))
    assert len(tokens) == visual_inputs(m, image).shape[0]
    shapes = inputs.tensors["spatial_shapes"].tolist()  # per crop (patch rows, patch cols)
    crops = sorted({t.image for t in tokens})
    assert crops == list(range(len(shapes)))
    for crop, (pr, pc) in zip(crops, shapes):
        grid = [(t.row, t.col) for t in tokens if t.image == crop]
        assert grid == [divmod(i, pc // 2) for i in range((pr // 2) * (pc // 2))]
    tiled = rows * cols > 1
    assert len(shapes) == (rows * cols + 1 if tiled else 1)
    if tiled:
        assert shapes[:-1] == [[TILE_SIZE // PATCH] * 2] * (rows * cols) and shapes[-1] == [rh // PATCH, rw // PATCH]
    # the thumbnail (or the one crop) and the tiles each cover the image exactly
    w, h = size
    for crop in crops:
        boxes = torch.tensor([t.box for t in tokens if t.image == crop], dtype=torch.float64)
        area = float(((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum())
        if crop == crops[-1]:
            assert area == pytest.approx(w * h) and boxes[-1, 2:].tolist() == pytest.approx([w, h])
    if tiled:
        tile_boxes = torch.tensor([t.box for t in tokens if t.image < rows * cols], dtype=torch.float64)
        area = float(((tile_boxes[:, 2] - tile_boxes[:, 0]) * (tile_boxes[:, 3] - tile_boxes[:, 1])).sum())
        assert area == pytest.approx(w * h)


def _token_changes(a, base, arr) -> torch.Tensor:
    """``(n_visual,)``: per visual token, how much the pixels its 2 x 2 patches read
    (pixel_values, crop by crop) change from image ``base`` to ``arr``."""
    before, after = (a.processor.image_processor(images=[Image.fromarray(x)], return_tensors="pt") for x in (base, arr))
    out = []
    for crop, (pr, pc) in enumerate(before["spatial_shapes"].tolist()):
        d = (after["pixel_values"][crop, : pr * pc] - before["pixel_values"][crop, : pr * pc]).norm(dim=-1)
        out.append(d.view(pr // 2, 2, pc // 2, 2).sum((1, 3)).flatten())
    return torch.cat(out)


@pytest.mark.parametrize("size", [TILED_SIZE, (150, 300), (600, 100), IMAGE_SIZE])
def test_each_token_reads_the_pixels_of_its_box(traced, size):
    """Geometry by experiment on what the vision tower reads (its input patches, before its
    attention mixes a crop): inverting the pixels around a token's box centre changes, of
    its own crop, that token's patches most; and in the other view (tiles, thumbnail), the
    token that changes most has a box over the inverted pixels: the image is seen twice."""
    m, _ = traced
    a = m.adapter
    base = np.asarray(noise_image(size, 3)).copy()
    tokens = a.visual_tokens(size)
    rows, cols, rh, rw, _ = a.layout(size)
    w, h = size
    margin = max(
        w / rw, h / rh, w / (cols * TILE_SIZE), h / (rows * TILE_SIZE)
    )  # one resized pixel, the kernel's reach
    seen_twice = 0
    for t in tokens:
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        rx, ry = max(1, int((x1 - x0) / 5)), max(1, int((y1 - y0) / 5))
        change = _token_changes(a, base, invert_around_box_centre(base, t.box))
        assert len(change) == len(tokens)
        for view in sorted({u.image for u in tokens}):
            group = [u for u in tokens if u.image == view]
            values = change[[u.index for u in group]]
            top = group[int(values.argmax())]
            if view == t.image:
                assert top.index == t.index, (t, values.topk(2))
                continue
            if float(values.max()) == 0:
                continue
            seen_twice += 1
            bx0, by0, bx1, by1 = top.box
            assert bx0 - margin < cx + rx and cx - rx < bx1 + margin, (t, top)
            assert by0 - margin < cy + ry and cy - ry < by1 + margin, (t, top)
    assert (seen_twice > 0) == (rows * cols > 1)


def test_tile_and_thumbnail_boxes_by_formula(traced):
    """TILED_SIZE (200 x 120): 2 x 1 tiles (cols x rows) of the image stretched to 64 x 32,
    tile C's token (r, c) the box ((32 C + 16 c) 200/64, 16 r 120/32, + one cell); then the
    thumbnail: the image stretched to 80 x 48, 3 x 5 tokens of 16 px. Their views: two
    tiles side by side, and the thumbnail over the whole image."""
    m, _ = traced
    a = m.adapter
    W, H = TILED_SIZE
    want = []
    for C in range(2):
        for r in range(2):
            for c in range(2):
                x0, y0 = C * TILE_SIZE + c * CELL, r * CELL
                want.append((C, r, c, [x0 * W / 64, y0 * H / 32, (x0 + CELL) * W / 64, (y0 + CELL) * H / 32]))
    for r in range(3):
        for c in range(5):
            want.append(
                (2, r, c, [c * CELL * W / 80, r * CELL * H / 48, (c + 1) * CELL * W / 80, (r + 1) * CELL * H / 48])
            )
    got = [(t.image, t.row, t.col, t.box) for t in a.visual_tokens(TILED_SIZE)]
    assert len(got) == len(want)
    for g, wnt in zip(got, want):
        assert g[:3] == wnt[:3] and g[3] == pytest.approx(wnt[3], abs=1e-12)
    views = image_views(a.visual_tokens(TILED_SIZE), TILED_SIZE, a.view_names(TILED_SIZE))
    assert [(v.name, v.grid) for v in views] == [
        ("tile 0 (row 0, col 0)", (2, 2)),
        ("tile 1 (row 0, col 1)", (2, 2)),
        ("thumbnail", (3, 5)),
    ]
    assert views[2].region == (0.0, 0.0, float(W), float(H))
    # one crop: IMAGE_SIZE (100 x 60) stretched to 80 x 48, 3 x 5 tokens
    one = a.visual_tokens(IMAGE_SIZE)
    assert [t.box for t in one[:2]] == [[0.0, 0.0, 20.0, 20.0], [20.0, 0.0, 40.0, 20.0]] and one[-1].box == [
        80.0,
        40.0,
        100.0,
        60.0,
    ]
    assert a.view_names(IMAGE_SIZE) == {}


def test_markers_are_delimiters_never_visual(traced):
    """A tiled image's markup: <|image_start|>, <|img_row_1_col_C|> before each tile's
    tokens, <|img_thumbnail|> before the thumbnail's, <|image_end|>: visual delimiters."""
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(TILED_SIZE)], [QUESTION])
    tr = capture(m, None, "", inputs=inputs, pattern_layers=[])
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    start = toks.index("<|image_start|>")
    want = ["<|image_start|>", "<|img_row_1_col_1|>", *["<image>"] * 4, "<|img_row_1_col_2|>", *["<image>"] * 4]
    want += ["<|img_thumbnail|>", *["<image>"] * 15, "<|image_end|>"]
    assert toks[start : start + len(want)] == want
    delim = a.visual_delimiter_positions(tr)
    assert [toks[i] for i in delim] == [t for t in want if t != "<image>"]
    roles = a.token_roles(tr)
    assert [roles[i] for i in delim] == ["visual_delimiter"] * 5 and roles.count("visual") == 23
    tokens = a.visual_tokens(TILED_SIZE, tr.visual_positions[0].tolist())
    assert [t.position for t in tokens if t.image == 1][0] == start + 7  # after tile 1's marker


def test_without_thumbnail_or_splitting(traced):
    """use_thumbnail False: the tiles only; do_image_splitting False: one smart-resized crop.
    Each as the processor writes and the model's features count."""
    m, _ = traced
    image = noise_image(TILED_SIZE)
    for settings, n, crops in (({"use_thumbnail": False}, 8, [0, 1]), ({"do_image_splitting": False}, 15, [0])):
        a = with_processor(m, **settings)
        inputs = a.prepare([image], [QUESTION])
        tokens = a.visual_tokens(TILED_SIZE, a.visual_positions(inputs)[0].tolist())
        assert len(tokens) == n and sorted({t.image for t in tokens}) == crops
        with torch.no_grad():
            feats = m.model.model.get_image_features(
                inputs.tensors["pixel_values"], inputs.tensors["spatial_shapes"], inputs.tensors["pixel_attention_mask"]
            ).pooler_output
        assert sum(f.shape[0] for f in feats) == n
        assert torch.isfinite(a.next_token_logits(inputs)).all()


def test_one_tile_of_another_count_is_refused(traced):
    """min_tiles 1 can cut a too large square image into one tile of tile_size px, while
    the processor writes the token count of its smart resize: the model refuses those
    inputs, and the geometry says why in one line."""
    m, _ = traced
    a = with_processor(m, min_tiles=1, max_tiles=3)
    with pytest.raises(ValueError, match="min_tiles = 1") as refused:
        a.visual_tokens((100, 100))
    assert "\n" not in str(refused.value)
    inputs = a.processor(images=[noise_image((100, 100))], text=[a.prompt(QUESTION)], return_tensors="pt")
    with pytest.raises(ValueError, match="do not match"):
        with torch.no_grad():
            m.model(**inputs)


def test_a_tiled_image_decodes_through_the_cache_as_a_rerun(traced, monkeypatch):
    """Generation on a tiled image (three crops, markers): each cached step (conv states and
    keys / values) gives the logits of a full re-run of the prefix, as tests/core/test_generate.py
    checks the family's one-crop case."""
    from tests.core.test_generate import assert_cached_steps_equal_a_rerun

    m, _ = traced

    def no_end_tokens(m):
        monkeypatch.setattr(m.adapter, "end_token_ids", lambda: set())
        return m

    assert_cached_steps_equal_a_rerun(m, noise_image(TILED_SIZE, 1), QUESTION, 0, no_end_tokens)


# ---- text, config


def test_prompt_template_and_fallback_agree(traced):
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = Lfm2VlAdapter(m.model, tiny_processor(), m.tokenizer)
    bare.processor.chat_template = None
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def test_other_layer_types_are_refused():
    """A layer type the adapter does not map (or no attention at all) is refused before loading."""
    config = tiny_config()
    config.text_config.layer_types = ["conv", "sliding_attention", "full_attention", "conv"]
    with pytest.raises(UnsupportedArchitectureError, match="sliding_attention"):
        Lfm2VlAdapter.check_config(config)
    config.text_config.layer_types = ["conv"] * 4
    with pytest.raises(UnsupportedArchitectureError, match="no full_attention"):
        Lfm2VlAdapter.check_config(config)
