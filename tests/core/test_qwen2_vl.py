"""Qwen2-VL and Qwen2.5-VL adapters on tiny random float64 models: every
recorded piece is checked against an independent computation (the model's
own outputs, autograd, or a recomputation from canonical weights and the
adapter's M-RoPE), and the geometry by experiment."""

import functools
import math

import pytest
import torch

from core.forward.capture import capture
from core.models.families.qwen2_vl import Qwen2_5_VLAdapter, Qwen2VLAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    scores_tol,
)

SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
)
WORDS = "system you are a helpful assistant . user is there red blue circle square ? what color shape yes no of the"
# Qwen's chat template, reduced to text and image items.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16


def tiny_tokenizer():
    """A word-level Qwen-style tokenizer built offline (no BOS, Qwen's special tokens)."""
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
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(kind: str):
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    cls = Qwen2VLProcessor if kind == "qwen2_vl" else Qwen2_5_VLProcessor
    return cls(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen_float64(kind: str = "qwen2_vl", tie: bool = False) -> LoadedModel:
    """A random Qwen2-VL / Qwen2.5-VL built from configs (grouped-query heads,
    M-RoPE sections [2, 3, 3] over d_head 16), in float64."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    n_vocab = len(SPECIAL) + len(dict.fromkeys(WORDS.split()))
    text = {
        "vocab_size": n_vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    common = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": tie,
    }
    if kind == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2}
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        cls = Qwen2VLForConditionalGeneration
    else:
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 4,
            "window_size": 56,  # 2x2 merged tokens per window: several windows on a small image
            "fullatt_block_indexes": [1],
        }
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        cls = Qwen2_5_VLForConditionalGeneration
    config.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(config).double().eval()
    with torch.no_grad():  # the init zeroes biases and sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(kind)
    adapter = registry.adapter_for_hf(cls.__name__)(model, processor, processor.tokenizer)
    return LoadedModel(f"tiny-{kind}", adapter.family, model, processor, processor.tokenizer, adapter)


IMAGE_SIZE = (200, 150)  # non-square: 6 x 8 patches after the resize, 3 x 4 visual tokens


@functools.cache
def traced_case(kind: str):
    """``(model, trace)`` of ``kind`` ("qwen2_vl" untied, "qwen2_5_vl" tied): one
    capture, every query position kept; built once per session (this file's tests
    and tests/core/test_family_conformance.py share it)."""
    m = tiny_qwen_float64(kind, kind == "qwen2_5_vl")
    image = noise_image(IMAGE_SIZE)
    n_pos = m.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos), keep_attn_out=True)
    return m, tr


CASES = ("qwen2_vl", "qwen2_5_vl")  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    return traced_case(request.param)


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Qwen2VLForConditionalGeneration": Qwen2VLAdapter, "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLAdapter}
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
PADDED_BATCH = ([(200, 150), (90, 130)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "assistant"
PERTURB_SIZES = [(260, 150)]


def check_canonical_weights(m, x) -> None:
    """q/k/v biases present; W_U tied or not."""
    a = m.adapter
    assert a.b_Q(1).abs().sum() > 0 and a.b_K(1).abs().sum() > 0
    emb = a.language_model.embed_tokens.weight
    assert (a.W_U.data_ptr() == emb.data_ptr()) == bool(m.model.config.tie_word_embeddings)
    assert a.W_U.shape == (a.d_model, emb.shape[0]) and torch.all(a.b_U == 0)


def check_padded_batch(m, batch) -> None:
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        m.adapter.visual_positions(batch)


def check_appended_token(m, inputs, longer) -> None:
    """A text token, one M-RoPE step after the last."""
    a = m.adapter
    assert int(longer.tensors["mm_token_type_ids"][0, -1]) == 0
    pos = a.positions_for_inputs(longer)[:, 0]
    assert torch.all(pos[:, -1] == pos[:, -2] + 1)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the visual tokens as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_grid_thw")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    """The decoder's visual inputs (for Qwen2.5-VL this also checks that the windowed
    tower's output is in row-major token order)."""
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    assert len({t.row for t in tokens}) != len({t.col for t in tokens})  # non-square
    return tokens


def check_decomposition(m, tr, r) -> None:
    """This family's part of the conformance check of the frozen decomposition ``r``."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)  # no o_proj bias in Qwen2


def test_position_ids_are_the_models_mrope_positions(traced):
    """The capture records the decoder's 3-D positions; positions_for_inputs recomputes
    them from the inputs; the visual tokens carry (start, start + row, start + col)."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    torch.testing.assert_close(a.positions_for_inputs(inputs), tr.position_ids, atol=0, rtol=0)
    pos = tr.position_ids[:, 0]  # (3, pos)
    vis = tr.visual_positions[0]
    tokens = a.visual_tokens(IMAGE_SIZE, vis.tolist())
    start = int(vis[0])
    rows = torch.tensor([t.row for t in tokens])
    cols = torch.tensor([t.col for t in tokens])
    assert torch.equal(pos[0, vis], torch.full_like(rows, start))
    assert torch.equal(pos[1, vis], start + rows)
    assert torch.equal(pos[2, vis], start + cols)
    after = int(vis[-1]) + 1
    assert torch.all(pos[:, after] == start + max(int(rows.max()), int(cols.max())) + 1)
    assert torch.equal(pos[:, :start], torch.arange(start).expand(3, -1))


def _recompute_patterns(a, tr, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(heads, pos, pos)``: the causal pattern from canonical weights and a.rotate,
    and how far (relative) the model's eager float32 softmax may be from it."""
    n_pos = tr.input_ids.shape[1]
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])  # (pos, d_model)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
    q, k = a.rotate(q, positions), a.rotate(k, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def test_patterns_recomputed_from_canonical_weights_and_mrope(traced):
    m, tr = traced
    a = m.adapter
    positions = tr.position_ids[:, 0]
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer, positions)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)
    # not vacuous: plain 1-D RoPE over the sequence index gives other patterns
    plain, _ = _recompute_patterns(a, tr, 1, torch.arange(tr.input_ids.shape[1]))
    assert (plain[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3


@pytest.mark.parametrize("size", [(200, 150), (90, 130), (40, 30), (600, 100)])
def test_visual_token_count_follows_the_resize(traced, size):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size)
    assert len(tokens) == n
    rows, cols = tokens[-1].row + 1, tokens[-1].col + 1
    thw = inputs.tensors["image_grid_thw"][0].tolist()
    assert [rows, cols] == [thw[1] // 2, thw[2] // 2]
    # the boxes tile the original image exactly
    assert tokens[0].box[:2] == [0.0, 0.0]
    assert tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
