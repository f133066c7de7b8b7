"""Mllama (Llama 3.2 Vision) adapter on a tiny random float64 model: every
recorded piece is checked against an independent computation (the model's
own outputs, autograd, or a recomputation from canonical weights with the
cross-attention q_norm/k_norm, tanh gates and mask), and the tile geometry by
experiment.

The cross layers' gates start at 0 in a fresh model (tanh(0) = 0: the cross
path would contribute nothing), so the fixture sets them to nonzero values."""

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import QuestionError
from core.forward.capture import capture
from core.methods.residual import decompose
from core.models.families.mllama import MllamaAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_heads_sum_to_attention_output,
    assert_jacobian_dla_is_autograd,
    assert_reconstruction_and_lens_at_last_layer,
    forwards_tol,
    head_removal_tol,
    invert_around_box_centre,
    noise_image,
    pattern_rtol,
    realized_scores_tol,
    removal_tol,
    unembedding_tol,
)
from tests.tolerances import NORM_ROUNDINGS, abs_terms, rounding_tol, statistic_tol, sum_tol

SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
    "<|python_tag|>",
    "<unk>",
)
IMAGE_TOKEN = "<|image|>"
WORDS = "user assistant is there a red blue circle square ? what color shape yes no of the"
# Llama 3.2 Vision Instruct's chat template, reduced to text and image items.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|image|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QUESTION = "is there a red circle?"
TILE, PATCH, MAX_TILES = 32, 8, 4  # 4 x 4 patches + a class token per tile: 17 keys per tile
CROSS_LAYER = 2
GATES = (0.5, -0.7)  # tanh'ed attention and MLP gates of the cross layer
# non-square: a 3-tile-wide canvas (96 x 32), the image resized to 89 x 32 inside
# it (7 px of zero padding on the right) and one padding tile
IMAGE_SIZE = (140, 50)


def _vocab() -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    vocab[IMAGE_TOKEN] = len(vocab)  # as in Llama 3.2: the image token is past the lm_head's vocabulary
    return vocab


def tiny_tokenizer():
    """A word-level Llama-3-style tokenizer built offline: it prepends
    ``<|begin_of_text|>`` itself, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([*SPECIAL, IMAGE_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(chat_template: str | None = CHAT_TEMPLATE):
    from transformers import MllamaImageProcessor, MllamaProcessor

    image_processor = MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)
    return MllamaProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(), chat_template=chat_template)


def tiny_mllama_float64(gates: tuple[float, float] | None = GATES, chat_template: str | None = CHAT_TEMPLATE):
    """A random Mllama built from configs: a 2+1-layer tiled ViT (32 px tiles,
    8 px patches, intermediate layers 0 and 1 concatenated) and a 4-layer text
    model with grouped-query heads whose layer 2 is a cross-attention layer."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    from core.models import registry

    vocab = _vocab()
    n_text = len(vocab) - 1  # the lm_head does not cover the image token
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_global_layers": 1,
        "attention_heads": 4,
        "intermediate_size": 64,
        "vision_output_dim": 96,  # (1 + len(intermediate_layers_indices)) * hidden_size
        "image_size": TILE,
        "patch_size": PATCH,
        "max_num_tiles": MAX_TILES,
        "intermediate_layers_indices": [0, 1],
    }
    text = {
        "vocab_size": n_text,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "cross_attention_layers": [CROSS_LAYER],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 64,
        "bos_token_id": vocab["<|begin_of_text|>"],
        "eos_token_id": vocab["<|eot_id|>"],
        "pad_token_id": vocab["<|finetune_right_pad_id|>"],
        "initializer_range": 0.1,
    }
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=vocab[IMAGE_TOKEN])
    config.architectures = ["MllamaForConditionalGeneration"]
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1 and every gate to 0: make them count
        lm = model.model.language_model
        for layer in lm.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
            if hasattr(layer, "cross_attn"):
                layer.cross_attn.q_norm.weight.normal_(1, 0.3)
                layer.cross_attn.k_norm.weight.normal_(1, 0.3)
                if gates is not None:
                    layer.cross_attn_attn_gate.fill_(gates[0])
                    layer.cross_attn_mlp_gate.fill_(gates[1])
        lm.norm.weight.normal_(1, 0.3)
        vm = model.model.vision_model
        vm.gated_positional_embedding.gate.fill_(0.4)
        vm.pre_tile_positional_embedding.gate.fill_(0.3)
        vm.post_tile_positional_embedding.gate.fill_(0.2)
    processor = tiny_processor(chat_template)
    adapter = registry.adapter_for_hf("MllamaForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-mllama", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "mllama"):
    """``(model, trace)``: one capture (q / k kept), every query position kept; built
    once per session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_mllama_float64()
    image = noise_image(IMAGE_SIZE)
    n_pos = m.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos), keep_qk=True, keep_attn_out=True)
    return m, tr


CASES = ("mllama",)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def traced():
    return traced_case()


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"MllamaForConditionalGeneration": MllamaAdapter}
DESCRIPTION = {
    "attention_kind": "cross",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "n_layers": 4,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0, CROSS_LAYER: math.tanh(GATES[0])}  # the cross layer's W_O carries tanh(gate)
CROSS_KEYS = MAX_TILES * 17  # every tile's patches and class token, cross-attended
PADDED_BATCH = ([(140, 50), (70, 45)], [QUESTION, "what color is the square of the blue circle?"])  # 3 and 4 tiles
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image token", "is there <|image|> a circle?"),
    ("too long", " ".join(["red"] * 60)),
)


def check_registry_and_description(m, tr) -> None:
    """Layer 2 is a cross block reading every tile's keys; no visual token sits in the text."""
    a = m.adapter
    assert a.blocks == [("L0", "self"), ("L1", "self"), ("L2.xattn", "cross"), ("L3", "self")]
    assert tr.block_names == ["L0", "L1", "L2.xattn", "L3"]
    assert tr.kv_source[0] is None and tr.kv_source[CROSS_LAYER].shape == (1, MAX_TILES * 17, 64)
    assert tr.visual_positions.shape == (1, 0)
    names = [c.name for c in decompose(a, tr, a.token_id("yes")).components]
    assert "L2.xattn.H0" in names and "L2.xattn.mlp" in names and "L3.H3" in names


def check_canonical_weights(m, x) -> None:
    """No o_proj / k_proj bias; q_norm/k_norm are the cross layer's own; no norm before its k_proj/v_proj."""
    a = m.adapter
    for layer in (1, CROSS_LAYER):
        assert torch.all(a.b_O(layer) == 0) and torch.all(a.b_K(layer) == 0)
    attn = a._attn(CROSS_LAYER)
    qh = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    torch.testing.assert_close(a.q_norm(CROSS_LAYER)(qh), attn.q_norm(qh), atol=0, rtol=0)
    torch.testing.assert_close(a.k_norm(CROSS_LAYER)(qh), attn.k_norm(qh), atol=0, rtol=0)
    torch.testing.assert_close(a.kv_norm(CROSS_LAYER)(x), x, atol=0, rtol=0)  # no norm before k_proj/v_proj
    assert a.q_norm(1) is None and a.kv_norm(1).kind == "rmsnorm"
    assert a.W_U.shape == (a.d_model, m.model.lm_head.weight.shape[0]) and torch.all(a.b_U == 0)


def check_reconstruction(m, tr, inputs, *, sdpa, eager) -> None:
    """Each block's input is the previous one's plus its recorded (gated) outputs;
    the lens on x_L is the plain forwards' logits."""
    a = m.adapter
    for b in range(tr.n_blocks - 1):  # two additions
        step = tr.resid_pre[b] + tr.attn_out[b] + tr.mlp_out[b]
        terms = tr.resid_pre[b].abs() + tr.attn_out[b].abs() + tr.mlp_out[b].abs()
        torch.testing.assert_close(step, tr.resid_pre[b + 1], atol=sum_tol(terms.max(), 3, step.dtype), rtol=0)
    normed = a.final_norm_layer()(tr.final_resid[0])
    lens = normed @ a.W_U + a.b_U
    torch.testing.assert_close(lens, sdpa[0], atol=unembedding_tol(a, normed), rtol=0)  # the capture ran sdpa
    n_keys = max(tr.input_ids.shape[1], tr.kv_source[CROSS_LAYER].shape[1])
    tol = unembedding_tol(a, normed) + forwards_tol(a, eager, n_keys)
    torch.testing.assert_close(lens, eager[0], atol=tol, rtol=0)


def check_source_contributions(m, tr, sc) -> None:
    """The cross block's sources are the visual keys, and they contribute."""
    assert sc.projection[CROSS_LAYER].shape == (m.adapter.n_heads, MAX_TILES * 17)
    assert sc.projection[CROSS_LAYER].abs().sum() > 1e-6


def check_appended_token(m, inputs, longer) -> None:
    """The new row of the cross-attention mask repeats the last one."""
    cam = longer.tensors["cross_attention_mask"]
    assert cam.shape[1] == longer.input_ids.shape[1] and torch.equal(cam[:, -1], cam[:, -2])


def check_question_errors(m, monkeypatch) -> None:
    with pytest.raises(QuestionError):
        m.adapter.token_id("red circle")


def test_prompt_has_one_bos_and_the_image_token(traced):
    m, tr = traced
    a = m.adapter
    ids = tr.input_ids[0].tolist()
    bos = a.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids.count(bos) == 1 and ids[0] == bos
    image_id = m.model.config.image_token_id
    assert ids.count(image_id) == 1 and image_id >= a.W_U.shape[1]  # not an output token
    assert a.visual_delimiter_positions(tr) == [ids.index(image_id)]
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles[ids.index(image_id)] == "visual_delimiter" and "visual" not in roles
    assert a.token_str(ids[-1]) == "<|end_header_id|>"


def test_cross_path_is_gated_and_row_masked(traced):
    """The cross block contributes (gates set); rows before <|image|> see no tile,
    so their MLP output is zeroed while their attention output is not."""
    m, tr = traced
    a = m.adapter
    no_image = a.text_rows_without_image(tr)
    image_pos = a.visual_delimiter_positions(tr)[0]
    assert no_image.tolist() == [p < image_pos for p in range(tr.input_ids.shape[1])]
    attn, mlp = tr.attn_out[CROSS_LAYER][0], tr.mlp_out[CROSS_LAYER][0]
    assert attn.norm(dim=-1).min() > 1e-3
    assert torch.all(mlp[no_image] == 0) and mlp[~no_image].norm(dim=-1).min() > 1e-3
    # with the gates at their initial 0 the cross layer adds exactly nothing
    fresh = tiny_mllama_float64(gates=None)
    t0 = capture(fresh, noise_image(IMAGE_SIZE), QUESTION, keep_attn_out=True)
    assert torch.all(t0.attn_out[CROSS_LAYER] == 0) and torch.all(t0.mlp_out[CROSS_LAYER] == 0)
    assert torch.all(fresh.adapter.W_O(CROSS_LAYER) == 0)
    torch.testing.assert_close(t0.resid_pre[CROSS_LAYER + 1], t0.resid_pre[CROSS_LAYER], atol=0, rtol=0)


def _reference_masked_forward(
    self,
    hidden_states,
    cross_attention_states,
    cross_attention_mask,
    attention_mask,
    full_text_row_masked_out_mask,
    cache=None,
    **kwargs,
):
    """MllamaCrossAttentionDecoderLayer as Meta's reference computes it (and as
    the fixes proposed for transformers issue #39379 do): the row mask also
    zeroes the cross-attention output of rows that see no image."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "use_cache", "position_embeddings")}
    residual = hidden_states
    hidden_states, _ = self.cross_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=cross_attention_mask,
        cross_attention_states=cross_attention_states,
        cache=cache,
        **kwargs,
    )
    hidden_states = full_text_row_masked_out_mask[:, 0] * hidden_states
    hidden_states = residual + self.cross_attn_attn_gate.tanh() * hidden_states
    residual = hidden_states
    hidden_states = full_text_row_masked_out_mask[:, 0] * self.mlp(self.post_attention_layernorm(hidden_states))
    return residual + self.cross_attn_mlp_gate.tanh() * hidden_states


def test_capture_stays_exact_if_transformers_masks_the_attention_output(traced, monkeypatch):
    """Should transformers adopt the reference's masking, the capture notices it
    (the parts must add up to the layer's output) and records the masked write."""
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    m, tr = traced
    a = m.adapter
    monkeypatch.setattr(MllamaCrossAttentionDecoderLayer, "forward", _reference_masked_forward)
    masked = capture(m, noise_image(IMAGE_SIZE), QUESTION, keep_attn_out=True)
    no_image = a.text_rows_without_image(masked)
    assert torch.all(masked.attn_out[CROSS_LAYER][0, no_image] == 0)
    assert torch.all(masked.z[CROSS_LAYER][0, no_image] == 0)
    # rows that see the image: the same ops on the same values (the mask multiplies by 1)
    torch.testing.assert_close(
        masked.attn_out[CROSS_LAYER][0, ~no_image], tr.attn_out[CROSS_LAYER][0, ~no_image], atol=0, rtol=0
    )
    assert (masked.logits - tr.logits).abs().max() > 1e-6  # the change matters downstream
    assert_heads_sum_to_attention_output(a, masked)
    assert_reconstruction_and_lens_at_last_layer(a, masked)
    with torch.no_grad():  # the capture ran the model's own (sdpa) attention: its logits are this forward's
        plain = a.forward_logits(a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]))
    torch.testing.assert_close(masked.logits, plain, atol=0, rtol=0)

    def unknown_change(self, hidden_states, *args, **kwargs):
        return 1.5 * _reference_masked_forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(MllamaCrossAttentionDecoderLayer, "forward", unknown_change)
    with pytest.raises(RuntimeError, match="changed"):
        capture(m, noise_image(IMAGE_SIZE), QUESTION)


def check_decomposition(m, tr, r) -> None:
    """This family's part of the conformance check of the frozen decomposition ``r``."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)  # no o_proj bias
    by_name = {c.name: c for c in r.components}
    assert sum(abs(by_name[f"L2.xattn.H{h}"].projection) for h in range(a.n_heads)) > 1e-6


def check_jacobian(m, tr, a_id: int, f_id: int, names: list[str]) -> None:
    """This family's part of the conformance Jacobian check: the cross block's
    components again on their own (autograd differentiates through the norm's
    float32 statistics)."""
    cross = [i for i, n in enumerate(names) if n.startswith("L2.xattn")]
    assert_jacobian_dla_is_autograd(m.adapter, tr, a_id, f_id, which=cross)


def _recompute_patterns(a, tr, block: int, use_qk_norm: bool = True) -> tuple[torch.Tensor, float]:
    """``(heads, pos, keys)`` from canonical weights, the adapter's q/k helpers
    (RoPE on self blocks, q_norm/k_norm on cross blocks) and allowed_keys, and
    how far (relative) the model's eager float32 softmax may be from it."""
    x = a.attn_norm(block)(tr.resid_pre[block][0])  # (pos, d_model)
    positions = a.rope_positions(tr)
    if tr.block_kinds[block] == "cross":
        src = a.kv_norm(block)(tr.kv_source[block][0])  # (keys, d_model)
        if use_qk_norm:
            q, k = a.queries(block, x), a.keys(block, src)
        else:
            q = torch.einsum("pm,hmd->phd", x, a.W_Q(block))
            k = torch.einsum("pm,hmd->phd", src, a.W_K(block))
    else:
        q, k = a.queries(block, x, positions), a.keys(block, x, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~a.allowed_keys(tr, block), float("-inf"))
    return scores.softmax(-1), pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, block))


def test_patterns_recomputed_from_canonical_weights_qk_norm_and_mask(traced):
    m, tr = traced
    a = m.adapter
    for block in range(tr.n_blocks):
        pattern, rtol = _recompute_patterns(a, tr, block)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[block][0], atol=0, rtol=rtol)
    # the cross mask: image rows put no weight on the padding tile, rows before the image see every key
    kinds = a.key_kinds(IMAGE_SIZE)
    pad = torch.tensor([k == "pad_tile" for k in kinds])
    assert pad.sum() == 17  # one padding tile
    cross = tr.patterns[CROSS_LAYER][0]  # (heads, pos, keys)
    no_image = a.text_rows_without_image(tr)
    assert torch.all(cross[:, ~no_image][..., pad] == 0)
    assert torch.all(cross[:, no_image][..., pad] > 0)
    allowed = a.allowed_keys(tr, CROSS_LAYER)
    assert torch.all(allowed[no_image]) and not allowed[~no_image][:, pad].any() and allowed[~no_image][:, ~pad].all()
    # not vacuous: without q_norm/k_norm the bilinear form gives other patterns
    plain, _ = _recompute_patterns(a, tr, CROSS_LAYER, use_qk_norm=False)
    assert (plain[:, tr.query_positions] - cross).abs().max() > 1e-2


def test_queries_keys_are_the_models_own(traced):
    """adapter.queries_keys (RoPE on self blocks, q_norm/k_norm on the cross
    block) equals the q and k the model's eager attention received; the
    realized scores and patterns of core.methods.qk_ov follow."""
    from core.methods.qk_ov import model_scores, realized_scores

    m, tr = traced
    a = m.adapter
    for block in range(tr.n_blocks):
        q, k = a.queries_keys(tr, block)
        kv = tr.k[block][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        x = a.attn_norm(block)(tr.resid_pre[block][0])
        if tr.block_kinds[block] == "cross":  # per-head norms in float32 (see realized_scores_tol)
            q_tol = rounding_tol(q.abs().max(), torch.float32, 2 * NORM_ROUNDINGS)
            k_tol = rounding_tol(k.abs().max(), torch.float32, 2 * NORM_ROUNDINGS)
        else:  # a (d_model + 1)-term product, then RoPE's three roundings mixing rotate_half partners
            q_terms, k_terms = abs_terms(x, a.W_Q(block), a.b_Q(block)[:, None]), abs_terms(x, a.W_K(block))
            q_tol = sum_tol(2 * q_terms.max(), a.d_model + 4, q.dtype)
            k_tol = sum_tol(2 * k_terms.max(), a.d_model + 4, k.dtype)
        torch.testing.assert_close(q, tr.q[block][0], atol=q_tol, rtol=0)
        torch.testing.assert_close(k, kv, atol=k_tol, rtol=0)
        assert tr.score_scale[block] == a.score_scale(block) == a.d_head**-0.5
        ours = realized_scores(a, tr, block)
        error = realized_scores_tol(a, tr, block)
        torch.testing.assert_close(ours.scores, model_scores(tr, block), atol=error, rtol=0)
        rtol = pattern_rtol(a, tr, ours.scores.masked_fill(~a.allowed_keys(tr, block), float("-inf")), error)
        torch.testing.assert_close(ours.pattern, tr.patterns[block][0], atol=0, rtol=rtol)
    assert tr.k[CROSS_LAYER].shape == (1, MAX_TILES * 17, a.n_kv_heads, a.d_head)
    # The cross scores are not the bilinear form W_Q W_K^T: with the raw projections
    # q, k they are q^T diag(g_q g_k) k / (rms(q) rms(k)) * scale (qk_gain documents it)
    x = a.attn_norm(CROSS_LAYER)(tr.resid_pre[CROSS_LAYER][0])
    q_raw = torch.einsum("pm,hmd->phd", x, a.W_Q(CROSS_LAYER))
    k_raw = torch.einsum("km,hmd->khd", tr.kv_source[CROSS_LAYER][0], a.W_K(CROSS_LAYER))
    eps = a.q_norm(CROSS_LAYER).eps
    rms_q = (q_raw.pow(2).mean(-1) + eps).sqrt().T  # (heads, pos)
    rms_k = (k_raw.pow(2).mean(-1) + eps).sqrt().T  # (heads, keys)
    bilinear = torch.einsum("qhd,d,khd->hqk", q_raw, a.qk_gain(CROSS_LAYER), k_raw)
    model = model_scores(tr, CROSS_LAYER)
    scores = bilinear / (rms_q[:, :, None] * rms_k[:, None, :]) * a.score_scale(CROSS_LAYER)
    # the model normalises q and k in float32 (its statistic over d_head and the roundings);
    # the bilinear form here is float64 throughout
    q_n, k_n = tr.q[CROSS_LAYER][0], tr.k[CROSS_LAYER][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
    terms = float(torch.einsum("qhd,khd->hqk", q_n.abs(), k_n.abs()).max()) * a.score_scale(CROSS_LAYER)
    one_norm = statistic_tol(terms, torch.float32, a.d_head) + rounding_tol(terms, torch.float32, NORM_ROUNDINGS)
    tol = 2 * one_norm + sum_tol(terms, 2 * a.d_model + a.d_head + 4, scores.dtype)
    torch.testing.assert_close(scores, model, atol=tol, rtol=0)
    plain = torch.einsum("qhd,khd->hqk", q_raw, k_raw) * a.score_scale(CROSS_LAYER)
    assert (plain - model).abs().max() > 1e-1


def test_edits_on_the_cross_block(traced):
    """Zeroing a cross head removes exactly its (gated) write; patching the cross
    head's z and the cross MLP's write with their own values changes nothing;
    the MLP write cannot be patched at rows before the image."""
    from core.forward.edits import Edit

    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    pos = int(tr.answer_positions[0])
    edited = capture(m, None, "", inputs=inputs, edits=[Edit(CROSS_LAYER, 1, (pos,))], keep_attn_out=True)
    expected = tr.attn_out[CROSS_LAYER][0, pos] - tr.head_output(a, CROSS_LAYER, pos)[1]
    tol = head_removal_tol(a, tr, CROSS_LAYER, pos)
    torch.testing.assert_close(edited.attn_out[CROSS_LAYER][0, pos], expected, atol=tol, rtol=0)
    torch.testing.assert_close(edited.attn_out[CROSS_LAYER][0, :pos], tr.attn_out[CROSS_LAYER][0, :pos], atol=0, rtol=0)
    own = [
        Edit(CROSS_LAYER, 2, (pos,), tr.z[CROSS_LAYER][0, pos : pos + 1, 2]),
        Edit(CROSS_LAYER, None, (pos - 1, pos), tr.mlp_out[CROSS_LAYER][0, pos - 1 : pos + 1]),
    ]
    same = capture(m, None, "", inputs=inputs, edits=own)
    # a write replaced by its own value: the same values through the same ops
    torch.testing.assert_close(same.mlp_out[CROSS_LAYER], tr.mlp_out[CROSS_LAYER], atol=0, rtol=0)
    torch.testing.assert_close(same.logits, tr.logits, atol=0, rtol=0)
    doubled = capture(
        m,
        None,
        "",
        inputs=inputs,
        edits=[Edit(CROSS_LAYER, None, (pos,), 2 * tr.mlp_out[CROSS_LAYER][0, pos : pos + 1])],
    )
    torch.testing.assert_close(  # the replacement is recorded as given (doubling is exact)
        doubled.mlp_out[CROSS_LAYER][0, pos], 2 * tr.mlp_out[CROSS_LAYER][0, pos], atol=0, rtol=0
    )
    zeroed = capture(m, None, "", inputs=inputs, edits=[Edit(CROSS_LAYER, None, None)])
    assert torch.all(zeroed.mlp_out[CROSS_LAYER] == 0)
    with pytest.raises(ValueError, match="before the image"):
        capture(m, None, "", inputs=inputs, edits=[Edit(CROSS_LAYER, None, (1,), torch.ones(1, a.d_model))])


def test_rerun_comparison_runs_on_cross_components(traced):
    from core.methods.residual import compare_with_rerun

    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    names = ["L3.mlp", "L2.xattn.H0", "L2.xattn.mlp"]
    cmp = compare_with_rerun(m, tr, a.token_id("yes"), a.token_id("no"), names=names, inputs=inputs)
    assert [r.name for r in cmp.rows] == names
    p = cmp.position
    tol = removal_tol(a, tr, p, a.token_id("yes"), a.token_id("no"), tr.mlp_out[-1][0, p])
    assert cmp.rows[0].total_removal == pytest.approx(cmp.rows[0].direct_removal, abs=tol)
    assert all(abs(r.total_removal) > 0 for r in cmp.rows)


@pytest.mark.parametrize(
    "size, tiles",
    [((140, 50), (1, 3)), ((50, 140), (3, 1)), ((70, 45), (2, 2)), ((20, 30), (1, 1)), ((280, 100), (1, 3))],
)
def test_tile_layout_and_token_boxes(traced, size, tiles):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    rows, cols, new_h, new_w, tile = a.tile_layout(size)
    assert (rows, cols) == tiles
    n_real = rows * cols
    assert inputs.tensors["aspect_ratio_mask"][0, 0].tolist() == [1] * n_real + [0] * (MAX_TILES - n_real)
    image_row = inputs.tensors["cross_attention_mask"][0, -1, 0].tolist()
    assert image_row == [1] * n_real + [0] * (MAX_TILES - n_real)
    tokens = a.visual_tokens(size)
    kinds = a.key_kinds(size)
    assert len(tokens) == len(kinds) == MAX_TILES * a.num_patches
    assert [t.index for t in tokens] == list(range(len(tokens))) and all(t.position is None for t in tokens)
    patches = [t for t, k in zip(tokens, kinds) if k == "patch"]
    assert len(patches) == n_real * 16
    w, h = size
    # the patches tile the canvas: the resized image covers [0, w] x [0, h], the rest is padding
    assert min(t.box[0] for t in patches) == 0 and min(t.box[1] for t in patches) == 0
    assert max(t.box[2] for t in patches) == pytest.approx(cols * tile * w / new_w)
    assert max(t.box[3] for t in patches) == pytest.approx(rows * tile * h / new_h)
    area = sum((t.box[2] - t.box[0]) * (t.box[3] - t.box[1]) for t in patches)
    assert area == pytest.approx(rows * cols * tile * tile * (w / new_w) * (h / new_h))
    cls = [t for t, k in zip(tokens, kinds) if k == "cls"]
    assert len(cls) == n_real and all(t.row == t.col == -1 for t in cls)
    # one canvas grid for heatmaps: every patch key has its own cell, row-major in pixels
    g_rows, g_cols, cell = a.canvas_grid(size)
    assert (g_rows, g_cols) == (rows * 4, cols * 4)
    keys = [i for i, k in enumerate(kinds) if k == "patch"]
    assert sorted(cell[keys].tolist()) == list(range(g_rows * g_cols))
    assert torch.all(cell[[i for i, k in enumerate(kinds) if k != "patch"]] == -1)
    for i in keys:
        r, c = divmod(int(cell[i]), g_cols)
        assert tokens[i].box[0] == pytest.approx(c * PATCH * w / new_w)
        assert tokens[i].box[1] == pytest.approx(r * PATCH * h / new_h)


def test_perturbing_a_box_centre_moves_its_own_key_most(traced):
    """Geometry by experiment on a non-square image with a padded canvas and a
    padding tile: inverting the pixels around a patch's box centre (original
    pixels) changes that key's row of cross_attention_states (the projector
    output the cross layers read) more than any other key's."""
    m, _ = traced
    a = m.adapter
    size = (280, 100)  # canvas 1 x 3 tiles, image resized to 89 x 32, one padding tile
    base = np.asarray(noise_image(size, 3)).copy()
    tokens = a.visual_tokens(size)
    kinds = a.key_kinds(size)

    def states(arrays):
        """``(n_images, n_keys, d_model)``: the cross-attention states of each image (one batch)."""
        t = a.prepare([Image.fromarray(x) for x in arrays], [QUESTION] * len(arrays)).tensors
        with torch.no_grad():
            out = m.model.model.vision_model(
                pixel_values=t["pixel_values"],
                aspect_ratio_ids=t["aspect_ratio_ids"],
                aspect_ratio_mask=t["aspect_ratio_mask"],
            ).last_hidden_state
            return m.model.model.multi_modal_projector(out).reshape(len(arrays), -1, a.d_model)

    probes, edited = [], []
    for t, kind in zip(tokens, kinds):
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        if kind != "patch" or cx >= size[0] or cy >= size[1]:
            continue  # class tokens, padding tiles and patches over the canvas padding cover no centre pixel
        probes.append(t)
        edited.append(invert_around_box_centre(base, t.box))
    out = states([base, *edited])
    ref = out[0]
    assert ref.shape[0] == len(tokens)
    checked = set()
    for t, moved in zip(probes, out[1:]):
        change = (moved - ref).norm(dim=-1)
        assert int(change.argmax()) == t.index, (t, change.topk(3))
        checked.add((t.image, t.row, t.col))
    # every real tile, its corners and centre were among them
    assert {(0, 0, 0), (0, 3, 3), (1, 0, 0), (1, 2, 2), (2, 0, 0), (2, 3, 2)} <= checked
    assert len(checked) == 3 * 16 - 4  # the last column of tile 2 lies over the canvas padding


def test_fallback_prompt_without_chat_template():
    m = tiny_mllama_float64(chat_template=None)
    a = m.adapter
    assert a.prompt(QUESTION) == tiny_processor().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
    )
    ids = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids[0].tolist()
    assert ids.count(a.tokenizer.bos_token_id) == 1


def check_attention_restored(m, before: str) -> None:
    """This family's part of the conformance hooks check: the text config's attention
    implementation (the cross layers read it) is restored too."""
    assert m.model.config.text_config._attn_implementation == before
