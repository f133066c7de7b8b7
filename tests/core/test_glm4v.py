"""GLM-4V adapter on a tiny random float64 model (grouped-query heads with q/k/v
biases, partial interleaved M-RoPE, sandwich norms, a 2x2-merging vision tower):
every recorded piece is checked against an independent computation (a plain
forward of the library model, transformers' own generate via
tests/core/test_generate.py, a rotation built here from the inverse frequencies,
or a recomputation from canonical weights), and the geometry by experiment."""

import functools

import pytest
import torch

from core.methods.logit_lens import logit_lens
from core.models.families.glm4v import Glm4vAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_lens_last_row_is_the_model,
    capture_every_position,
    head_write_terms,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    scores_tol,
    unembedding_tol,
)
from tests.tolerances import NORM_ROUNDINGS, rounding_tol, sum_tol, unit_roundoff

SPECIAL = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
    "<unk>",
)
WORDS = "is there a red blue circle square ? what color shape yes no of the"
# GLM-4.1V's chat template, reduced to text and image items.
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
QUESTION = "is there a red circle?"
PATCH, MERGE, FRAMES = 16, 2, 2
CELL = PATCH * MERGE
# GLM's smart_resize counts an image as FRAMES frames against the pixel bounds: 4 to 16 tokens
MIN_PIXELS, MAX_PIXELS = FRAMES * CELL * CELL * 4, FRAMES * CELL * CELL * 16
MROPE_SECTION = [2, 1, 1]  # temporal, height, width frequencies of the 8 rotated coordinates
PARTIAL = 0.5  # half of d_head 16 rotates
IMAGE_SIZE = (200, 150)  # non-square: 3 x 4 visual tokens after the resize


def tiny_tokenizer():
    """A word-level GLM-style tokenizer built offline (GLM's named image and video tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor():
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    image_processor = Glm4vImageProcessor(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=FRAMES,
        image_mean=[0.5] * 3,
    )
    return Glm4vProcessor(
        image_processor=image_processor,
        video_processor=Glm4vVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=FRAMES),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_glm4v_float64() -> LoadedModel:
    """A random GLM-4V built from its configs (4 heads over 2 K/V heads, d_head 16 of
    which 8 rotate, M-RoPE sections [2, 1, 1]), every norm gain random, in float64."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": PARTIAL,
            "mrope_section": MROPE_SECTION,
        },
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": 64,
        "image_size": 64,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": FRAMES,
    }
    config = Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    config.architectures = [Glm4vForConditionalGeneration.__name__]
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1 and the q/k/v biases to 0: make them count
        for module in model.model.language_model.modules():
            if type(module).__name__ == "Glm4vRMSNorm":
                module.weight.normal_(1, 0.3)
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    processor = tiny_processor()
    adapter = registry.adapter_for_hf(config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-glm4v", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace, inputs)``: one capture, every query position kept; built once
    per session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_glm4v_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr, inputs


CASES = ("glm4v",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("glm4v")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Glm4vForConditionalGeneration": Glm4vAdapter}
UNKNOWN_ARCHITECTURE = "Glm4vMoeForConditionalGeneration"  # mixture-of-experts MLPs: not mapped
DESCRIPTION = {
    "family": "glm4v",
    "position_scheme": "mrope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "norm_placement": "sandwich",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
PADDED_BATCH = ([(60, 130), (200, 150)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "<|assistant|>"
BAD_QUESTIONS = (("vocabulary", "is there a purple circle?"), ("too long", " ".join(["red"] * 600)))
PERTURB_SIZES = [(260, 150)]


def check_canonical_weights(m, x) -> None:
    """q/k/v biases, no o_proj bias; W_U untied; every norm of the adapter (input,
    post-attention, the stream's post-norms, final) is the model's own, bit for bit."""
    a = m.adapter
    assert a.b_Q(1).abs().sum() > 0 and a.b_K(1).abs().sum() > 0 and a.b_V(1).abs().sum() > 0
    assert torch.all(a.b_O(1) == 0)
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and torch.all(a.b_U == 0)
    y = x * 3
    for layer in range(a.n_layers):
        mod = a.language_model.layers[layer]
        torch.testing.assert_close(a.attn_norm(layer)(y), mod.input_layernorm(y), atol=0, rtol=0)
        torch.testing.assert_close(a.post_attention_norm(layer)(y), mod.post_self_attn_layernorm(y), atol=0, rtol=0)
    norms = dict(a.stream_norms())
    assert sorted(norms) == sorted(
        f"L{i}.{n}" for i in range(3) for n in ("post_self_attn_layernorm", "post_mlp_layernorm")
    )
    torch.testing.assert_close(norms["L2.post_mlp_layernorm"](y), a.language_model.layers[2].post_mlp_layernorm(y))
    torch.testing.assert_close(a.final_norm_layer()(y), a.language_model.norm(y), atol=0, rtol=0)


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


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    assert len({t.row for t in tokens}) != len({t.col for t in tokens})  # non-square
    return tokens


def check_decomposition(m, tr, r) -> None:
    """embed, then per block the heads, the post-norm's residue and the MLP write (no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 2)
    assert [c.name for c in r.components[a.n_heads + 1 : a.n_heads + 3]] == ["L0.attn_norm_residue", "L0.mlp"]


def _interleaved_first(W: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W / b with d_head reordered so each rotated pair ``(2i, 2i + 1)`` sits ``d_head / 2``
    apart, where :func:`scores_tol` bounds the rotation's mixing (unrotated coordinates
    are paired with each other: a looser, still valid bound)."""
    d, rot = W.shape[-1], int(W.shape[-1] * PARTIAL)
    order = [*range(0, rot, 2), *range(rot, rot + (d - rot) // 2), *range(1, rot, 2), *range(rot + (d - rot) // 2, d)]
    return W[..., order], b[..., order]


def recompute_patterns(a, tr, block: int, positions=None):
    """``(heads, pos, pos)``: the causal pattern from canonical weights (biases included)
    and the adapter's rotation at the recorded 3-D positions; and how far (relative)
    the model's eager float32 softmax may be from it."""
    n_pos = tr.input_ids.shape[1]
    positions = tr.position_ids[:, 0] if positions is None else positions
    x = a.attn_norm(block)(tr.resid_pre[block][0])
    q = a.rotate(torch.einsum("pm,hmd->phd", x, a.W_Q(block)) + a.b_Q(block), positions)
    k = a.rotate(torch.einsum("pm,hmd->phd", x, a.W_K(block)) + a.b_K(block), positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(block)
    scores = scores.masked_fill(~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(), float("-inf"))
    W_Q, b_Q = _interleaved_first(a.W_Q(block), a.b_Q(block))
    W_K, b_K = _interleaved_first(a.W_K(block), a.b_K(block))
    error = scores_tol(x, x, W_Q, b_Q, W_K, b_K, a.score_scale(block), True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: 1-D positions (the sequence index) give other patterns."""
    other, _ = recompute_patterns(m.adapter, tr, 1, torch.arange(tr.input_ids.shape[1]))
    assert (other[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3


# ---- GLM-4V's own checks


def glm_rotation(a, x: torch.Tensor, positions: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """GLM's M-RoPE built here from the inverse frequencies, in float64: frequency
    ``i`` turns with the temporal / height / width id by contiguous MROPE_SECTION
    blocks and rotates the pair ``(2i, 2i + 1)`` of the first ``PARTIAL * d_head``
    coordinates (``interleaved`` False: the pair ``(i, i + rot / 2)`` instead)."""
    inv_freq = a.language_model.rotary_emb.inv_freq.double()
    half = inv_freq.shape[0]
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(MROPE_SECTION))
    angle = positions[axis].T.double() * inv_freq  # (pos, half)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    y = torch.stack([y1, y2], -1).flatten(-2) if interleaved else torch.cat([y1, y2], -1)
    return torch.cat([y, rest], dim=-1)


def test_rotate_is_glms_partial_interleaved_mrope(traced):
    m, tr, _ = traced
    a = m.adapter
    assert a.language_model.rotary_emb.inv_freq.shape[0] * 2 == int(PARTIAL * a.d_head) == 8
    positions = tr.position_ids[:, 0]
    x = torch.randn(positions.shape[1], 2, a.d_head, dtype=torch.float64)
    want = glm_rotation(a, x, positions)
    # the model takes angle = position * inv_freq and its cos / sin in float32 (each off by
    # u32 (|angle| + 1)), then x cos + rotate_half(x) sin: two such factors per coordinate
    largest_angle = float(positions.max()) * float(a.language_model.rotary_emb.inv_freq.max())
    tol = 2 * float(x.abs().max()) * unit_roundoff(torch.float32) * (largest_angle + 2)
    got = a.rotate(x, positions)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert torch.equal(got[..., 8:], x[..., 8:])  # the unrotated half passes as it is
    assert (glm_rotation(a, x, positions, interleaved=False) - want).abs().max() > 1e-2


def test_position_ids_are_the_models_mrope_positions(traced):
    """The capture records the decoder's 3-D positions; positions_for_inputs
    recomputes them; visual tokens carry (start, start + row, start + col)."""
    m, tr, inputs = traced
    a = m.adapter
    torch.testing.assert_close(a.positions_for_inputs(inputs), tr.position_ids, atol=0, rtol=0)
    pos, vis = tr.position_ids[:, 0], tr.visual_positions[0]
    tokens = a.visual_tokens(IMAGE_SIZE, vis.tolist())
    start = int(vis[0])
    rows, cols = torch.tensor([t.row for t in tokens]), torch.tensor([t.col for t in tokens])
    assert torch.equal(pos[0, vis], torch.full_like(rows, start))
    assert torch.equal(pos[1, vis], start + rows) and torch.equal(pos[2, vis], start + cols)
    assert torch.all(pos[:, int(vis[-1]) + 1] == start + max(int(rows.max()), int(cols.max())) + 1)


def test_prompt_layout(traced):
    """[gMASK] <sop> <|user|> <|begin_of_image|> [12 image tokens] <|end_of_image|> question <|assistant|>."""
    m, tr, inputs = traced
    tokens = m.tokenizer.convert_ids_to_tokens(inputs.input_ids[0].tolist())
    assert tokens[:4] == ["[gMASK]", "<sop>", "<|user|>", "<|begin_of_image|>"]
    assert tokens[4:16] == ["<|image|>"] * 12 and tokens[16] == "<|end_of_image|>" and tokens[-1] == "<|assistant|>"
    assert m.adapter.visual_positions(inputs)[0].tolist() == list(range(4, 16))
    assert inputs.tensors["mm_token_type_ids"][0].nonzero().flatten().tolist() == list(range(4, 16))


def test_sandwich_writes_rebuild_the_stream_and_the_lens_is_the_model(traced):
    """x_L = x_0 + sum_l post_self_attn(o_proj(z)) + sum_l mlp_out (the writes, replayed
    by the adapter's norm); each stream step is the block's two writes; the lens on
    x_L is the forward's logits; x_0 holds the embeddings and the projected image."""
    m, tr, inputs = traced
    a = m.adapter
    writes = []
    for block in range(a.n_layers):
        x = tr.norm_inputs[f"L{block}.post_self_attn_layernorm"]
        torch.testing.assert_close(x, tr.attn_out[block], atol=0, rtol=0)  # the o_proj output
        writes.append(a.post_attention_norm(block)(x[0]))
    recon = tr.resid_pre[0][0] + sum(writes) + sum(o[0] for o in tr.mlp_out)
    terms = tr.resid_pre[0][0].abs() + sum(w.abs() for w in writes) + sum(o[0].abs() for o in tr.mlp_out)
    assert (recon - tr.final_resid[0]).abs().max() <= sum_tol(terms.max(), 2 * a.n_layers + 1, recon.dtype)
    for block in range(1, a.n_layers):
        step = tr.resid_pre[block][0] - tr.resid_pre[block - 1][0] - writes[block - 1] - tr.mlp_out[block - 1][0]
        assert step.abs().max() <= sum_tol(terms.max(), 4, recon.dtype)
    # not vacuous: the pre-norm attention output does not rebuild the stream
    plain = tr.resid_pre[0][0] + sum(o[0] for o in tr.attn_out) + sum(o[0] for o in tr.mlp_out)
    assert (plain - tr.final_resid[0]).abs().max() > 1e3 * sum_tol(terms.max(), 2 * a.n_layers + 1, recon.dtype)
    with torch.no_grad():
        logits = a.forward_logits(inputs)
    torch.testing.assert_close(tr.logits, logits, atol=0, rtol=0)
    normed = a.final_norm_layer()(tr.final_resid[0])
    torch.testing.assert_close(normed @ a.W_U, logits[0], atol=unembedding_tol(a, normed), rtol=0)
    vis = tr.visual_positions[0]
    torch.testing.assert_close(tr.resid_pre[0][0, vis], visual_inputs(m, noise_image(IMAGE_SIZE)), atol=0, rtol=0)
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    emb = a.language_model.embed_tokens(tr.input_ids[0])
    torch.testing.assert_close(tr.resid_pre[0][0, text], emb[text], atol=0, rtol=0)
    lens = logit_lens(a, tr, a.token_id("yes"), a.token_id("no"))
    assert_lens_last_row_is_the_model(a, tr, lens, a.token_id("yes"), a.token_id("no"))


def test_heads_at_the_frozen_post_norm_scale_sum_to_the_write(traced):
    """Per block, the heads' frozen-scale writes sum to the model's post-normed write
    up to the float32 norm's rounding (the residue component); the stack is x_L;
    dropping the residues is not."""
    m, tr, _ = traced
    a = m.adapter
    p = int(tr.answer_positions[0])
    names, C = a.component_stack(tr, p)
    for block in range(a.n_layers):
        i = names.index(f"L{block}.H0")
        heads, residue = C[i : i + a.n_heads], C[i + a.n_heads]
        post = a.post_attention_norm(block)
        x = tr.norm_inputs[f"L{block}.post_self_attn_layernorm"][0, p]
        write = post(x)
        gain = post.weight.detach().abs()
        raw = head_write_terms(a, tr, block, [p])[0] * post.scale(x) * gain
        tol = rounding_tol(float((x.abs() * post.scale(x) * gain).max()), torch.float32, NORM_ROUNDINGS + 2)
        tol += sum_tol(float(raw.max()), a.n_heads * a.d_head + 2, torch.float64)
        assert (heads.sum(0) - write).abs().max() <= tol
        torch.testing.assert_close(heads.sum(0) + residue, write, atol=sum_tol(raw.max(), 2, torch.float64), rtol=0)
    x_L = tr.final_resid[0, p]
    tol = sum_tol(float(C.abs().sum(0).max()), C.shape[0] + 2 * a.n_layers, C.dtype)
    assert (C.sum(0) - x_L).abs().max() <= tol
    drop = [j for j, n in enumerate(names) if not n.endswith("attn_norm_residue")]
    assert (C[drop].sum(0) - x_L).abs().max() > tol


@pytest.mark.parametrize("size", [(200, 150), (90, 130), (20, 30), (600, 100)])
def test_visual_token_count_follows_glms_resize(traced, size):
    """16 px patches merged 2x2: one token per 32 px cell of the resized image (GLM's
    smart_resize: two frames against the bounds, small images scaled up)."""
    m, _, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    tokens = a.visual_tokens(size)
    assert len(tokens) == int((inputs.input_ids == m.model.config.image_token_id).sum())
    thw = inputs.tensors["image_grid_thw"][0].tolist()
    assert [tokens[-1].row + 1, tokens[-1].col + 1] == [thw[1] // MERGE, thw[2] // MERGE]
    assert tokens[0].box[:2] == [0.0, 0.0]
    assert tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
