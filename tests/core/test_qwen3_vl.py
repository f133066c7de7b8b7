"""Qwen3-VL adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (the model's own outputs, the
vision tower's DeepStack features, or a recomputation from canonical weights
with q/k norms and an interleaved M-RoPE built here from the inverse
frequencies), and the geometry by experiment."""

import functools
import math

import pytest
import torch

from core.forward.capture import capture
from core.methods.residual import component_stack, decompose
from core.models.families.qwen3_vl import Qwen3VLAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_decomposition_is_exact,
    capture_every_position,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    realized_scores_tol,
    stack_tol,
)
from tests.core.test_qwen2_vl import SPECIAL, WORDS, tiny_tokenizer
from tests.tolerances import unit_roundoff

# Qwen3-VL's chat template, reduced to text and image items (no default system turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"
PATCH, MERGE = 16, 2
CELL = PATCH * MERGE
MIN_PIXELS, MAX_PIXELS = CELL * CELL * 4, CELL * CELL * 16
MROPE_SECTION = [3, 3, 2]  # temporal, height, width frequencies of d_head / 2 = 8
DEEPSTACK_LAYERS = 2  # vision layers 0 and 1 feed decoder layers 0 and 1 (of 3)


def tiny_processor():
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=PATCH, merge_size=MERGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=[0.5] * 3
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=Qwen3VLVideoProcessor(),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen3_float64(tie: bool = False) -> LoadedModel:
    """A random Qwen3-VL built from its configs (grouped-query heads, q/k norms,
    interleaved M-RoPE sections [3, 3, 2] over d_head 16, two DeepStack layers), in float64."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": list(range(DEEPSTACK_LAYERS)),
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )
    config.architectures = [Qwen3VLForConditionalGeneration.__name__]
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm):
                norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor()
    adapter = registry.adapter_for_hf(config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-qwen3_vl", adapter.family, model, processor, processor.tokenizer, adapter)


IMAGE_SIZE = (200, 150)  # non-square: 6 x 8 patches of 16 px after the resize, 3 x 4 visual tokens


@functools.cache
def traced_case(kind: str):
    """``(model, trace)``: one capture, every query position kept; built once per
    session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_qwen3_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("qwen3_vl",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("qwen3_vl")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Qwen3VLForConditionalGeneration": Qwen3VLAdapter}
UNKNOWN_ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"  # audio, video and text: not mapped
DESCRIPTION = {
    "position_scheme": "mrope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
PADDED_BATCH = (
    [(60, 130), (200, 150)],  # 8 and 12 visual tokens
    [QUESTION, "what color is the square of the blue circle?"],
)
ANSWER_TOKEN = "assistant"
BAD_QUESTIONS = (("vocabulary", "is there a purple circle?"), ("too long", " ".join(["red"] * 600)))
PERTURB_SIZES = [(260, 150)]


def check_canonical_weights(m, x) -> None:
    """No q/k/v/o biases; W_U untied; q_norm / k_norm are the model's per-head
    RMSNorms over d_head, replayed bit for bit."""
    a = m.adapter
    assert all(torch.all(b == 0) for b in (a.b_Q(1), a.b_K(1), a.b_V(1), a.b_O(1)))
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and torch.all(a.b_U == 0)
    attn = a._attn(1)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(1))
    torch.testing.assert_close(a.q_norm(1)(q), attn.q_norm(q), atol=0, rtol=0)
    torch.testing.assert_close(a.k_norm(1)(q), attn.k_norm(q), atol=0, rtol=0)
    assert torch.equal(a.qk_gain(1), attn.q_norm.weight * attn.k_norm.weight)


def check_padded_batch(m, batch) -> None:
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        m.adapter.visual_positions(batch)


def check_appended_token(m, inputs, longer) -> None:
    """A text token, one M-RoPE step after the last."""
    assert int(longer.tensors["mm_token_type_ids"][0, -1]) == 0
    pos = m.adapter.positions_for_inputs(longer)[:, 0]
    assert torch.all(pos[:, -1] == pos[:, -2] + 1)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the visual tokens as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_grid_thw")


def deepstack_features(m, image) -> list[torch.Tensor]:
    """The vision tower's DeepStack features of ``image``, ``(n_visual, d_model)`` each."""
    inputs = m.adapter.prepare([image], [QUESTION])
    with torch.no_grad():
        out = m.model.model.get_image_features(
            inputs.tensors["pixel_values"], inputs.tensors["image_grid_thw"], return_dict=True
        )
    return [torch.cat(list(f), dim=0) for f in out.deepstack_features]


def perturbation_features(m, image) -> tuple[torch.Tensor, ...]:
    """What the decoder reads of each visual token: its input and every DeepStack write."""
    return (visual_inputs(m, image), *deepstack_features(m, image))


def perturbation_probes(m, size, tokens) -> list:
    assert len({t.row for t in tokens}) != len({t.col for t in tokens})  # non-square
    return tokens


def check_decomposition(m, tr, r) -> None:
    """At the (text) answer position no DeepStack write: embed, heads and MLPs (no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)
    assert not any(c.name.startswith("deepstack.") for c in r.components)


def check_reconstruction(m, tr, inputs, **_) -> None:
    """Not vacuous: without the DeepStack writes x_L is not reconstructed at the
    visual positions (and is, unchanged, at the text positions)."""
    vis = tr.visual_positions[0]
    plain = tr.resid_pre[0] + sum(tr.attn_out) + sum(tr.mlp_out)
    missing = (plain - tr.final_resid)[0].abs().amax(-1)
    text = torch.ones_like(missing, dtype=torch.bool)
    text[vis] = False
    assert float(missing[vis].min()) > 1e3 * stack_tol(m.adapter, tr, int(vis[0]))
    assert float(missing[text].max()) <= stack_tol(m.adapter, tr, int(tr.answer_positions[0]))


# ---- family-specific checks


def test_deepstack_writes_are_the_towers_features_added_after_their_layers(traced):
    """trace.deepstack holds the vision tower's DeepStack features; resid_pre of
    block k + 1 is block k's output plus feature k at the visual positions."""
    m, tr = traced
    a = m.adapter
    vis = tr.visual_positions[0]
    want = deepstack_features(m, noise_image(IMAGE_SIZE))
    assert len(tr.deepstack) == len(want) == DEEPSTACK_LAYERS
    writes = a.stream_writes(tr)
    assert [name for name, _ in writes] == [f"deepstack.L{k}" for k in range(DEEPSTACK_LAYERS)]
    for k, (mask, embeds) in enumerate(tr.deepstack):
        assert torch.equal(mask[0].nonzero().flatten(), vis)
        torch.testing.assert_close(embeds, want[k], atol=0, rtol=0)
        out = tr.resid_pre[k] + tr.attn_out[k] + tr.mlp_out[k]  # the model's own adds, in its order
        torch.testing.assert_close(tr.resid_pre[k + 1], out + writes[k][1], atol=0, rtol=0)
        assert torch.all(writes[k][1][0, vis] != 0)
    assert a.n_layers == DEEPSTACK_LAYERS + 1  # the last layer has no DeepStack write after it
    torch.testing.assert_close(tr.final_resid, tr.resid_pre[-1] + tr.attn_out[-1] + tr.mlp_out[-1], atol=0, rtol=0)


def test_decomposition_at_a_visual_token_has_the_deepstack_components(traced):
    """At a visual position the stack holds ``deepstack.L{k}`` right after ``L{k}.mlp``
    and is exact (components sum to x_L, frozen DLA to the logit difference); without
    them the stack misses x_L by far more than the tolerance."""
    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    for position in tr.visual_positions[0][[0, 5, -1]].tolist():
        r = decompose(a, tr, a_id, f_id, position=position)
        names = [c.name for c in r.components]
        for k in range(DEEPSTACK_LAYERS):
            assert names[names.index(f"L{k}.mlp") + 1] == f"deepstack.L{k}"
        assert len(names) == 1 + a.n_layers * (a.n_heads + 1) + DEEPSTACK_LAYERS
        with torch.no_grad():
            _, C = component_stack(a, tr, position)
        x_L = tr.final_resid[0, position]
        tol = stack_tol(a, tr, position)
        assert float((C.sum(0) - x_L).abs().max()) <= tol
        kept = torch.tensor([not n.startswith("deepstack.") for n in names])
        assert float((C[kept].sum(0) - x_L).abs().max()) > 1e3 * tol
        # decompose's own claims at this position (assert_decomposition_is_exact reads r.position)
        assert_decomposition_is_exact(a, tr, a_id, f_id, r=r)


def test_deepstack_components_of_the_second_batch_row(traced):
    """In a batch of two images the DeepStack features are one list over both rows
    (the model's mask order): row 1's visual positions take the rows after row 0's."""
    m, _ = traced
    a = m.adapter
    images = [noise_image(IMAGE_SIZE, 1), noise_image(IMAGE_SIZE, 2)]
    batch = a.prepare(images, [QUESTION, QUESTION])
    tr = capture(m, None, "", inputs=batch, query_positions=[0])
    single = deepstack_features(m, images[1])
    vis = tr.visual_positions[1]
    for position in vis[[0, -1]].tolist():
        with torch.no_grad():
            names, C = component_stack(a, tr, position, batch=1)
        for k in range(DEEPSTACK_LAYERS):
            row = int((vis == position).nonzero())
            torch.testing.assert_close(C[names.index(f"deepstack.L{k}")], single[k][row], atol=0, rtol=0)
        assert float((C.sum(0) - tr.final_resid[1, position]).abs().max()) <= stack_tol(a, tr, position, batch=1)


def test_position_ids_are_the_models_mrope_positions(traced):
    """The capture records the decoder's 3-D positions; positions_for_inputs
    recomputes them; visual tokens carry (start, start + row, start + col)."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    torch.testing.assert_close(a.positions_for_inputs(inputs), tr.position_ids, atol=0, rtol=0)
    pos, vis = tr.position_ids[:, 0], tr.visual_positions[0]
    tokens = a.visual_tokens(IMAGE_SIZE, vis.tolist())
    start = int(vis[0])
    rows, cols = torch.tensor([t.row for t in tokens]), torch.tensor([t.col for t in tokens])
    assert torch.equal(pos[0, vis], torch.full_like(rows, start))
    assert torch.equal(pos[1, vis], start + rows) and torch.equal(pos[2, vis], start + cols)
    assert torch.all(pos[:, int(vis[-1]) + 1] == start + max(int(rows.max()), int(cols.max())) + 1)


def interleaved_rotation(a, x: torch.Tensor, positions: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """M-RoPE built here from the inverse frequencies: frequency ``j`` turns with the
    height id if ``j % 3 == 1`` and ``j < 3 * section[1]``, the width id if
    ``j % 3 == 2`` and ``j < 3 * section[2]``, else the temporal id (``interleaved``
    False: Qwen2-VL's contiguous sections instead). ``x (pos, heads, d_head)``."""
    inv_freq = a.language_model.rotary_emb.inv_freq.double()
    half = inv_freq.shape[0]
    j = torch.arange(half)
    if interleaved:
        axis = torch.zeros(half, dtype=torch.long)
        axis[(j % 3 == 1) & (j < 3 * MROPE_SECTION[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * MROPE_SECTION[2])] = 2
    else:
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(MROPE_SECTION))
    angle = positions[axis].T.double() * inv_freq  # (pos, half): each frequency's own axis
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_rotate_is_interleaved_mrope(traced):
    m, tr = traced
    a = m.adapter
    positions = tr.position_ids[:, 0]
    x = torch.randn(positions.shape[1], 2, a.d_head, dtype=torch.float64)
    want = interleaved_rotation(a, x, positions)
    # the model takes angle = position * inv_freq and its cos / sin in float32 (each off by
    # u32 (|angle| + 1)), then x cos + rotate_half(x) sin: two such factors per coordinate
    largest_angle = float(positions.max()) * float(a.language_model.rotary_emb.inv_freq.max())
    tol = 2 * float(x.abs().max()) * unit_roundoff(torch.float32) * (largest_angle + 2)
    torch.testing.assert_close(a.rotate(x, positions), want, atol=tol, rtol=0)
    assert (interleaved_rotation(a, x, positions, interleaved=False) - want).abs().max() > 1e-2


def _recompute_patterns(a, tr, layer: int, qk_norm: bool = True, interleaved: bool = True):
    """``(heads, pos, pos)``: the causal pattern from canonical weights, q/k RMSNorms
    (float64, by their formula) and the interleaved M-RoPE built here; and how far
    (relative) the model's eager float32 softmax may be from it."""
    n_pos = tr.input_ids.shape[1]
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
    if qk_norm:
        attn, eps = a._attn(layer), a.text_config.rms_norm_eps
        q = attn.q_norm.weight * q * (q.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        k = attn.k_norm.weight * k * (k.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    positions = tr.position_ids[:, 0]
    q, k = interleaved_rotation(a, q, positions, interleaved), interleaved_rotation(a, k, positions, interleaved)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(), float("-inf"))
    # the model's q/k norms round in float32: realized_scores_tol's q/k-norm bound
    return scores.softmax(-1), pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, layer))


def test_patterns_recomputed_with_qk_norms_and_interleaved_mrope(traced):
    m, tr = traced
    a = m.adapter
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)
    # not vacuous: without the q/k norms, or with contiguous sections, other patterns
    for variant in ({"qk_norm": False}, {"interleaved": False}):
        other, _ = _recompute_patterns(a, tr, 1, **variant)
        assert (other[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3, variant


def test_queries_keys_are_the_models(traced):
    """adapter.queries_keys (norm, W_Q / W_K, q/k norms, M-RoPE) gives the model's own
    scores (its recorded q and k) within the q/k-norm rounding bound."""
    m, tr = traced
    a = m.adapter
    kept = capture(m, None, "", inputs=a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]), keep_qk=True)
    for block in range(a.n_layers):
        q, k = a.queries_keys(tr, block)
        model_k = kept.k[block][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        ours = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(block)
        theirs = torch.einsum("qhd,khd->hqk", kept.q[block][0], model_k) * kept.score_scale[block]
        torch.testing.assert_close(ours, theirs, atol=realized_scores_tol(a, tr, block), rtol=0)


@pytest.mark.parametrize("size", [(200, 150), (90, 130), (40, 30), (600, 100)])
def test_visual_token_count_follows_the_resize(traced, size):
    """16 px patches merged 2x2: one token per 32 px cell of the resized image."""
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    tokens = a.visual_tokens(size)
    assert len(tokens) == int((inputs.input_ids == m.model.config.image_token_id).sum())
    thw = inputs.tensors["image_grid_thw"][0].tolist()
    assert [tokens[-1].row + 1, tokens[-1].col + 1] == [thw[1] // MERGE, thw[2] // MERGE]
    assert tokens[0].box[:2] == [0.0, 0.0]
    assert tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
