"""Gemma 3 adapter on a tiny random float64 model (sliding-window and global
layers, q/k norms, sandwich norms, a pooled SigLIP grid): every recorded piece
is checked against an independent computation (a plain forward of the library
model, transformers' own generate, or a recomputation from canonical weights
with the adapter's per-layer RoPE and the model's masks), and the geometry by
experiment on a stretched (non-square) image."""

import copy
import functools
import math

import pytest
import torch

from core.errors import UnsupportedArchitectureError
from core.forward.capture import capture
from core.methods.logit_lens import logit_lens
from core.methods.residual import decompose
from core.models.families.gemma3 import Gemma3Adapter
from core.models.family_adapter import allowed_by_rule
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_lens_last_row_is_the_model,
    capture_every_position,
    forwards_tol,
    head_write_terms,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    unembedding_tol,
)
from tests.tolerances import NORM_ROUNDINGS, rounding_tol, sum_tol

SPECIAL = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
WORDS = "user model is there a red blue circle square ? what color shape yes no of the"
# Gemma 3's chat template, reduced to text and image items.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<start_of_image>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QUESTION = "is there a red circle?"
IMAGE_SIDE, PATCH, GRID = 48, 8, 3  # 6 x 6 patches pooled 2 x 2 into 3 x 3 = 9 visual tokens
IMAGE_SIZE = (90, 60)  # non-square: the resize stretches it
D_MODEL, SLIDING_WINDOW = 64, 8  # the window is shorter than the prompt (28 tokens)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_tokenizer():
    """A word-level Gemma-style tokenizer built offline, with Gemma 3's named
    image tokens and "\\n" / "\\n\\n" as tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in ["\n", "\n\n", *WORDS.split()]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens([AddedToken("\n\n", normalized=False), AddedToken("\n", normalized=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor():
    """Gemma 3's processor over the tiny tokenizer and its image processor resizing to 48 x 48."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    return Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=GRID * GRID,
    )


def tiny_config(**text_extra):
    from transformers import Gemma3Config

    processor = tiny_processor()
    tok = processor.tokenizer
    text = {
        "vocab_size": len(tok),
        "hidden_size": D_MODEL,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,  # not d_head: the scale is the config's
        "sliding_window": SLIDING_WINDOW,
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        **text_extra,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,  # one global-attention layer: a random tower's mixing stays below the local change
        "num_attention_heads": 4,
        "image_size": IMAGE_SIDE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GRID * GRID,
        image_token_index=tok.image_token_id,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config, processor


def tiny_gemma3_float64(**text_extra) -> LoadedModel:
    """A random Gemma 3 (grouped-query heads, d_head 16, sliding window 8) in float64."""
    from transformers import Gemma3ForConditionalGeneration

    from core.models import registry

    config, processor = tiny_config(**text_extra)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # Gemma initialises its (1 + w) gains and the projection to 0: make them count
        for module in model.model.language_model.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                module.weight.normal_(0, 0.3)
        projector = model.model.multi_modal_projector
        projector.mm_input_projection_weight.normal_(0, 0.2)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.3)
    adapter = registry.adapter_for_hf("Gemma3ForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-gemma3", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def tiny_model() -> LoadedModel:
    return tiny_gemma3_float64()


@functools.cache
def traced_case(kind: str):
    """``(model, trace, inputs)``: a capture of the prompt, every query position
    kept; built once per session (shared with tests/core/test_family_conformance.py)."""
    m = tiny_model()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr, inputs


CASES = ("gemma3",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("gemma3")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

FAMILY = "gemma3"
ADAPTERS = {"Gemma3ForConditionalGeneration": Gemma3Adapter}
DESCRIPTION = {
    "family": "gemma3",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "norm_placement": "sandwich",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": D_MODEL,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
PADDED_BATCH = ([(90, 60), (40, 70)], ["what color", QUESTION])
ANSWER_TOKEN = "\n"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("may not contain", "<start_of_image> is there a red circle?"),
    ("too long", " ".join(["red"] * 500)),
)
PERTURB_SIZES = [(90, 60)]


def check_registry_and_description(m, tr) -> None:
    """The config's score scale, (1 + w) RMSNorms in float32, and the two layer types."""
    a = m.adapter
    assert a.score_scale(0) == pytest.approx(24**-0.5)
    norm = a.attn_norm(1)
    assert norm.weight_offset == 1.0 and norm.compute_dtype == torch.float32 and norm.eps == 1e-6
    assert [a._attn(b).sliding_window for b in range(3)] == [SLIDING_WINDOW, None, SLIDING_WINDOW]


def check_question_errors(m, monkeypatch) -> None:
    m.adapter.check_question(QUESTION)


def check_canonical_weights(m, x) -> None:
    """W_U tied to the unscaled embeddings; input_embeddings carry sqrt(d_model); every
    norm of the adapter (stream, post, q / k) is the model's own, bit for bit."""
    a = m.adapter
    emb = a.language_model.embed_tokens
    assert a.W_U.data_ptr() == emb.weight.data_ptr() and torch.all(a.b_U == 0)
    ids = torch.tensor([2, 5, 7])
    torch.testing.assert_close(a.input_embeddings()[ids], emb(ids), atol=0, rtol=0)
    for layer in range(a.n_layers):
        mod = a.language_model.layers[layer]
        y = torch.randn(7, a.d_model, dtype=torch.float64) * 3
        torch.testing.assert_close(a.attn_norm(layer)(y), mod.input_layernorm(y), atol=0, rtol=0)
        torch.testing.assert_close(a.post_attention_norm(layer)(y), mod.post_attention_layernorm(y), atol=0, rtol=0)
        h = torch.randn(7, a.n_heads, a.d_head, dtype=torch.float64)
        torch.testing.assert_close(a._norm(mod.self_attn.q_norm)(h), mod.self_attn.q_norm(h), atol=0, rtol=0)
    torch.testing.assert_close(a.final_norm_layer()(y), a.language_model.norm(y), atol=0, rtol=0)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the pooled, normed, projected tower output (unscaled)."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def check_decomposition(m, tr, r) -> None:
    """embed, then per block the heads, the post-norm's residue and the MLP write;
    the residue is the float32 norm's rounding and no more."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 2)
    assert [c.name for c in r.components[a.n_heads + 1 : a.n_heads + 3]] == ["L0.attn_norm_residue", "L0.mlp"]


def check_padded_batch(m, batch) -> None:
    """Padding keys are masked in every layer type and labelled padding."""
    a = m.adapter
    tr = capture(m, None, "", inputs=batch)
    n = batch.input_ids.shape[1]
    for row in range(2):
        for block in range(a.n_layers):
            want = allowed_by_rule(
                "image_block",
                batch.tensors["attention_mask"],
                batch.tensors["token_type_ids"],
                n,
                a._attn(block).sliding_window,
            )[row]
            assert torch.equal(a.allowed_keys(tr, block, batch=row), want)
    assert not a.allowed_keys(tr, 1, batch=0)[:, -1].any()  # nobody reads row 0's padding
    assert a.token_roles(tr, batch=0)[-1] == "padding"


def check_appended_token(m, inputs, longer) -> None:
    """The appended token is text (token type 0): causal."""
    assert int(longer.tensors["token_type_ids"][0, -1]) == 0


def perturbation_features(m, image) -> tuple[torch.Tensor, torch.Tensor]:
    """``(9, d_vision)`` the patch embeddings pooled by the projector's own pooling
    (resize + patch grid + pooling order, no attention) and ``(9, d_model)`` the
    visual tokens as the decoder receives them."""
    pixels = m.adapter.prepare([image], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        patches = m.model.model.vision_tower.embeddings(pixels)  # (1, 36, width)
        side = IMAGE_SIDE // PATCH
        grid = patches.transpose(1, 2).reshape(1, -1, side, side)
        pooled = m.model.model.multi_modal_projector.avg_pool(grid).flatten(2).transpose(1, 2)[0]
        lm = m.model.model.get_image_features(pixels).pooler_output[0]
    return pooled, lm


def perturbation_probes(m, size, tokens) -> list:
    assert len(tokens) == 9 and tokens[0].box[2] - tokens[0].box[0] != tokens[0].box[3] - tokens[0].box[1]
    return tokens


# ---- Gemma 3's own checks


def test_prompt_and_processor_layout():
    """<bos> ... "\\n\\n" <start_of_image> [9 image tokens] <end_of_image> "\\n\\n" question ...;
    only the image tokens have token type 1; boi / eoi are visual delimiters."""
    m, tr, inputs = traced_case("gemma3")
    a = m.adapter
    ids = inputs.input_ids[0].tolist()
    tokens = a.tokenizer.convert_ids_to_tokens(ids)
    boi = tokens.index("<start_of_image>")
    assert tokens[boi - 1] == "\n" and tokens[boi + 1 : boi + 10] == ["<image_soft_token>"] * 9
    assert tokens[boi + 10 : boi + 12] == ["<end_of_image>", "\n\n"] and tokens[-2:] == ["model", "\n"]
    vis = list(range(boi + 1, boi + 10))
    assert a.visual_positions(inputs)[0].tolist() == vis
    assert inputs.tensors["token_type_ids"][0].nonzero().flatten().tolist() == vis
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles[boi] == roles[boi + 10] == "visual_delimiter"
    assert a.visual_delimiter_positions(tr) == [boi, boi + 10]


def test_masks_are_the_models_and_not_causal():
    """The recorded masks equal the rule rebuilt from token_type_ids (image tokens
    bidirectional within the image, the sliding window on sliding layers); the
    fallback rebuilds the same; each part of the rule changes the mask."""
    m, tr, inputs = traced_case("gemma3")
    a = m.adapter
    n = tr.input_ids.shape[1]
    assert sorted(tr.decoder_masks) == [0, 1, 2]
    vis = tr.visual_positions[0]
    for block in range(a.n_layers):
        window = a._attn(block).sliding_window
        want = allowed_by_rule(
            "image_block", inputs.tensors["attention_mask"], inputs.tensors["token_type_ids"], n, window
        )[0]
        assert torch.equal(a.allowed_keys(tr, block), want)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert bool(want[vis[0], vis[-1]]) and not causal[vis[0], vis[-1]]  # the first image token reads the last
    assert not a.allowed_keys(tr, 0)[n - 1, n - 1 - SLIDING_WINDOW] and a.allowed_keys(tr, 1)[n - 1, 0]
    saved = tr.decoder_masks
    try:
        tr.decoder_masks = {}
        tr.token_type_ids = inputs.tensors["token_type_ids"]
        assert all(torch.equal(a.allowed_keys(tr, b), saved[b][0, 0].cpu()) for b in range(a.n_layers))
    finally:
        tr.decoder_masks = saved


@torch.no_grad()
def test_patterns_recomputed_from_canonical_weights_qk_norms_and_layer_rope():
    """Norm, W_Q / W_K, the q/k norms, the layer's RoPE base, the config's scale and
    the recorded mask give the recorded pattern to the float32 softmax's rounding
    (the q / k norms round in float32: their error enters the scores); with the other
    layer type's RoPE base, or without the q/k norms, the patterns differ."""
    m, tr, _ = traced_case("gemma3")
    a = m.adapter
    for block in range(a.n_layers):
        q, k = a.queries_keys(tr, block)
        scores = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(block)
        scores = scores.masked_fill(~a.allowed_keys(tr, block), float("-inf"))
        terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * a.score_scale(block)
        error = rounding_tol(terms, torch.float32, 2 * (NORM_ROUNDINGS + 2)) + sum_tol(terms, a.d_head + 3, q.dtype)
        rtol = pattern_rtol(a, tr, scores, error)
        torch.testing.assert_close(scores.softmax(-1)[:, tr.query_positions], tr.patterns[block][0], atol=0, rtol=rtol)
    # not vacuous: block 0 rotated with the global base, or without q / k norms
    x = a.attn_norm(0)(tr.resid_pre[0][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(0))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(0))
    pos = a.rope_positions(tr)
    for qq, kk in ((a.rotate(q, pos, 1), a.rotate(k, pos, 1)), (a.rotate(q, pos, 0), a.rotate(k, pos, 0))):
        s = (torch.einsum("qhd,khd->hqk", qq, kk) * a.score_scale(0)).masked_fill(~a.allowed_keys(tr, 0), -math.inf)
        assert (s.softmax(-1) - tr.patterns[0][0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs the block"):
        a.rotate(q, pos)


def _post_norm_terms(a, tr, block: int) -> torch.Tensor:
    """``(pos, d_model)`` the size of the terms of each entry of the post-norm's output: |a| |1 + w| / sigma(a)."""
    post = a.post_attention_norm(block)
    x = tr.norm_inputs[f"L{block}.post_attention_layernorm"][0]
    return x.abs() * post.scale(x) * (1 + post.weight).abs()


def test_sandwich_writes_rebuild_the_stream_and_the_lens_is_the_model():
    """x_L = x_0 + sum_l post_attn(o_proj(z)) + sum_l mlp_out (the writes, replayed by
    the adapter's norm bit for bit); the lens on x_L is the forward's logits; x_0 holds
    the scaled embeddings and the projected image."""
    m, tr, inputs = traced_case("gemma3")
    a = m.adapter
    writes = []
    for block in range(a.n_layers):
        x = tr.norm_inputs[f"L{block}.post_attention_layernorm"]
        torch.testing.assert_close(x, tr.attn_out[block], atol=0, rtol=0)  # the o_proj output
        writes.append(a.post_attention_norm(block)(x[0]))
    recon = tr.resid_pre[0][0] + sum(writes) + sum(o[0] for o in tr.mlp_out)
    terms = tr.resid_pre[0][0].abs() + sum(w.abs() for w in writes) + sum(o[0].abs() for o in tr.mlp_out)
    assert (recon - tr.final_resid[0]).abs().max() <= sum_tol(terms.max(), 2 * a.n_layers + 1, recon.dtype)
    # the stream's steps are the writes exactly: the residual entering each block
    for block in range(1, a.n_layers):
        step = tr.resid_pre[block][0] - tr.resid_pre[block - 1][0] - writes[block - 1] - tr.mlp_out[block - 1][0]
        assert step.abs().max() <= sum_tol(terms.max(), 4, recon.dtype)
    with torch.no_grad():
        logits = a.forward_logits(inputs)
    torch.testing.assert_close(tr.logits, logits, atol=0, rtol=0)
    normed = a.final_norm_layer()(tr.final_resid[0])
    torch.testing.assert_close(normed @ a.W_U, logits[0], atol=unembedding_tol(a, normed), rtol=0)
    vis = tr.visual_positions[0]
    torch.testing.assert_close(tr.resid_pre[0][0, vis], visual_inputs(m, noise_image(IMAGE_SIZE)), atol=0, rtol=0)
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    torch.testing.assert_close(tr.resid_pre[0][0, text], a.language_model.embed_tokens(tr.input_ids[0])[text])
    scaled = a.language_model.embed_tokens.weight[tr.input_ids[0, text]] * math.sqrt(D_MODEL)
    tol = rounding_tol(float(scaled.abs().max()), scaled.dtype, 2)
    torch.testing.assert_close(tr.resid_pre[0][0, text], scaled, atol=tol, rtol=0)
    lens = logit_lens(a, tr, a.token_id("yes"), a.token_id("no"))
    assert_lens_last_row_is_the_model(a, tr, lens, a.token_id("yes"), a.token_id("no"))


def test_heads_at_the_frozen_post_norm_scale_sum_to_the_write():
    """Per block and position, the heads' frozen-scale writes sum to the model's
    post-normed write up to the norm's own float32 arithmetic (the residue
    component); the stack is the model's x_L; dropping the residue is not."""
    m, tr, _ = traced_case("gemma3")
    a = m.adapter
    p = int(tr.answer_positions[0])
    names, C = a.component_stack(tr, p)
    for block in range(a.n_layers):
        i = names.index(f"L{block}.H0")
        heads, residue = C[i : i + a.n_heads], C[i + a.n_heads]
        x = tr.norm_inputs[f"L{block}.post_attention_layernorm"][0, p]
        write = a.post_attention_norm(block)(x)
        post = a.post_attention_norm(block)
        raw = head_write_terms(a, tr, block, [p])[0] * post.scale(x) * (1 + post.weight).abs()
        # the model: x cast, normalised, its (1 + w) formed and applied in float32 (five roundings)
        tol = rounding_tol(float(_post_norm_terms(a, tr, block)[p].max()), torch.float32, NORM_ROUNDINGS + 2)
        tol += sum_tol(float(raw.max()), a.n_heads * a.d_head + 2, torch.float64)
        assert (heads.sum(0) - write).abs().max() <= tol
        torch.testing.assert_close(heads.sum(0) + residue, write, atol=sum_tol(raw.max(), 2, torch.float64), rtol=0)
    x_L = tr.final_resid[0, p]
    # the stack in one order, the model's stream (its 2 adds per block) in another
    tol = sum_tol(float(C.abs().sum(0).max()), C.shape[0] + 2 * a.n_layers, C.dtype)
    assert (C.sum(0) - x_L).abs().max() <= tol
    drop = [j for j, n in enumerate(names) if not n.endswith("attn_norm_residue")]
    assert (C[drop].sum(0) - x_L).abs().max() > tol  # not vacuous: the residues are the norms' rounding


def test_cached_prefill_is_the_plain_forward():
    """The cached prefill (the model's own mask building with a cache) gives the
    plain forward's logits; the cached steps against re-runs and against
    transformers' generate are tests/core/test_generate.py's (FAMILY_CASES)."""
    m, _, inputs = traced_case("gemma3")
    with torch.no_grad():
        state = m.adapter.start_decoding(inputs)
        plain = m.adapter.next_token_logits(inputs)
    n_keys = inputs.input_ids.shape[1]
    torch.testing.assert_close(state.logits, plain, atol=forwards_tol(m.adapter, plain, n_keys), rtol=0)


@pytest.mark.parametrize("size", [(90, 60), (40, 70), (48, 48)])
def test_visual_tokens_tile_the_stretched_image(size):
    m = tiny_model()
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    vis = a.visual_positions(inputs)[0].tolist()
    tokens = a.visual_tokens(size, vis)
    assert len(tokens) == 9 and [t.position for t in tokens] == vis and (tokens[-1].row, tokens[-1].col) == (2, 2)
    assert tokens[0].box[:2] == [0.0, 0.0] and tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
    w, h = tokens[0].box[2] - tokens[0].box[0], tokens[0].box[3] - tokens[0].box[1]
    assert (w, h) == pytest.approx((2 * PATCH * size[0] / IMAGE_SIDE, 2 * PATCH * size[1] / IMAGE_SIDE))


def test_softcapping_pan_and_scan_and_bidirectional_text_are_refused():
    for extra, message in (
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ):
        config, _ = tiny_config(**extra)
        with pytest.raises(UnsupportedArchitectureError, match=message):
            Gemma3Adapter.check_config(config)
    m = tiny_model()
    processor = copy.deepcopy(m.processor)
    processor.image_processor.do_pan_and_scan = True
    with pytest.raises(UnsupportedArchitectureError, match="pan-and-scan"):
        Gemma3Adapter(m.model, processor, processor.tokenizer)


def test_head_dla_under_the_frozen_post_norm_is_labelled():
    """Every DLA audit row names the convention the head components are read under."""
    m, tr, _ = traced_case("gemma3")
    r = decompose(m.adapter, tr, m.adapter.token_id("yes"), m.adapter.token_id("no"))
    assert "post-attention norm scale" in str(r.audit.to_dict())
