"""Qwen2-VL and Qwen2.5-VL adapters on tiny random float64 models: every
recorded piece is checked against an independent computation (the model's
own outputs, autograd, or a recomputation from canonical weights and the
adapter's M-RoPE), and the geometry by experiment."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.capture import capture
from core.methods.logit_lens import logit_lens
from core.methods.residual import decompose
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_canonical_projections,
    assert_decomposition_is_exact,
    assert_heads_sum_to_attention_output,
    assert_jacobian_dla_is_autograd,
    assert_lens_last_row_is_the_model,
    assert_reconstruction_and_lens_at_last_layer,
    assert_source_contributions_sum_to_each_heads_terms,
    forwards_tol,
    module_hook_counts,
    noise_image,
    pattern_rtol,
    scores_tol,
    values_tol,
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


@pytest.fixture(scope="module", params=[("qwen2_vl", False), ("qwen2_5_vl", True)], ids=["qwen2_vl", "qwen2_5_vl"])
def traced(request):
    kind, tie = request.param
    m = tiny_qwen_float64(kind, tie)
    image = noise_image(IMAGE_SIZE)
    n_pos = m.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos))
    return m, tr


def test_registry_and_description(traced):
    from core.models import registry
    from core.models.families.qwen2_vl import Qwen2_5_VLAdapter, Qwen2VLAdapter

    m, _ = traced
    assert registry.adapter_for_hf("Qwen2VLForConditionalGeneration") is Qwen2VLAdapter
    assert registry.adapter_for_hf("Qwen2_5_VLForConditionalGeneration") is Qwen2_5_VLAdapter
    d = m.adapter.describe()
    assert d["position_scheme"] == "mrope" and d["final_norm"] == "rmsnorm" and d["attention_kind"] == "self"
    assert (d["n_layers"], d["n_heads"], d["d_model"]) == (3, 4, 64)
    assert m.adapter.n_kv_heads == 2 and m.adapter.d_head == 16
    assert m.adapter.kv_group(3) == 1


def test_canonical_weights_match_the_projections(traced):
    """q/k/v biases present; grouped K/V expanded to each query head; W_U tied or not."""
    m, tr = traced
    a = m.adapter
    x = torch.randn(5, a.d_model, dtype=torch.float64)
    z = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    assert_canonical_projections(a, a._attn(1), 1, x, z)
    assert a.b_Q(1).abs().sum() > 0 and a.b_K(1).abs().sum() > 0
    emb = a.language_model.embed_tokens.weight
    assert (a.W_U.data_ptr() == emb.data_ptr()) == bool(m.model.config.tie_word_embeddings)
    assert a.W_U.shape == (a.d_model, emb.shape[0]) and torch.all(a.b_U == 0)


def test_heads_sum_to_attention_output(traced):
    m, tr = traced
    assert_heads_sum_to_attention_output(m.adapter, tr)


def test_residual_reconstruction_and_lens_at_last_layer(traced):
    m, tr = traced
    assert_reconstruction_and_lens_at_last_layer(m.adapter, tr)
    # the residual entering block 0 is the token embeddings with the visual features scattered in
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    emb = m.adapter.language_model.embed_tokens(tr.input_ids[0])
    torch.testing.assert_close(tr.resid_pre[0][0, text], emb[text], atol=0, rtol=0)


def test_logit_lens_last_row_is_the_model(traced):
    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    lens = logit_lens(a, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(a.n_layers + 1))
    p = lens.position
    assert p == int(tr.answer_positions[0]) == tr.input_ids.shape[1] - 1
    assert_lens_last_row_is_the_model(a, tr, lens, a_id, f_id)  # logit_lens reports float32 numbers
    assert lens.rows[-1].answer_rank == int((tr.logits[0, p] > tr.logits[0, p, a_id]).sum())


def test_frozen_dla_sums_to_logit_difference_minus_bias(traced):
    m, tr = traced
    a = m.adapter
    # Qwen's RMSNorm normalises in float32 even in a float64 model: its output carries
    # float32 rounding that the (float64) frozen split does not
    r = assert_decomposition_is_exact(a, tr, a.token_id("yes"), a.token_id("no"))
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)  # no o_proj bias in Qwen2


def test_jacobian_dla_equals_autograd_directional_derivative(traced):
    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    assert_jacobian_dla_is_autograd(a, tr, a_id, f_id)


def test_source_contributions_sum_to_each_heads_direct_terms(traced):
    """Summed over sources, each head's contributions equal its residual
    component under every convention (the value path, q/k/v biases included)."""
    from core.methods.contributions import source_contributions

    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))


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


def test_values_recomputed_from_canonical_weights(traced):
    m, tr = traced
    a = m.adapter
    for layer in range(a.n_layers):
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        v = torch.einsum("pm,hmd->phd", x, a.W_V(layer)) + a.b_V(layer)
        z = torch.einsum("hqk,khd->qhd", tr.patterns[layer][0], v)
        tol = values_tol(tr.patterns[layer][0], x, a.W_V(layer), a.b_V(layer))
        torch.testing.assert_close(z, tr.z[layer][0, tr.query_positions], atol=tol, rtol=0)


def test_right_padded_batch_matches_single_runs(traced):
    """Two images of different sizes and questions of different lengths: right
    padding, the answer position is the last real token, and each row's
    next-token logits equal its own unpadded run."""
    m, _ = traced
    a = m.adapter
    images = [noise_image((200, 150), 1), noise_image((90, 130), 2)]
    questions = [QUESTION, "what color is the square of the blue circle?"]
    batch = a.prepare(images, questions)
    assert a.tokenizer.padding_side == "left"  # restored
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 0 and mask[1, -1] == 1  # row 0 is right-padded
    logits = a.next_token_logits(batch)
    for i in range(2):
        single = a.prepare([images[i]], [questions[i]])
        assert int(batch.answer_positions[i]) == int(single.answer_positions[0]) == single.input_ids.shape[1] - 1
        assert a.token_str(int(batch.input_ids[i, batch.answer_positions[i]])) == "assistant"
        want = a.next_token_logits(single)[0]
        torch.testing.assert_close(logits[i], want, atol=forwards_tol(a, want, mask.shape[1]), rtol=0)
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        a.visual_positions(batch)


def test_append_token_continues_the_text(traced):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    yes = a.token_id("yes")
    longer = a.append_token(inputs, yes)
    assert int(longer.answer_positions[0]) == int(inputs.answer_positions[0]) + 1
    assert int(longer.input_ids[0, -1]) == yes and int(longer.tensors["mm_token_type_ids"][0, -1]) == 0
    pos = a.positions_for_inputs(longer)[:, 0]
    assert torch.all(pos[:, -1] == pos[:, -2] + 1)
    with torch.no_grad():
        before, after = a.forward_logits(inputs), a.forward_logits(longer)
    tol = forwards_tol(a, before, longer.input_ids.shape[1])
    torch.testing.assert_close(after[:, :-1], before, atol=tol, rtol=0)  # causal: the prefix is unchanged


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


def test_perturbing_a_box_centre_moves_its_own_token_most(traced):
    """Geometry by experiment on a non-square image: inverting the pixels around
    a token's box centre changes that token's input to the language model most
    (for Qwen2.5-VL this also checks that the windowed tower's output is in
    row-major token order)."""
    m, _ = traced
    a = m.adapter
    size = (260, 150)
    base = np.asarray(noise_image(size, 3)).copy()
    tokens = a.visual_tokens(size)
    assert len({t.row for t in tokens}) != len({t.col for t in tokens})

    def lm_inputs(arr):
        """``(n_visual, d_model)``: the visual tokens as the decoder receives them."""
        inputs = a.prepare([Image.fromarray(arr)], [QUESTION])
        with torch.no_grad():
            out = m.model.model.get_image_features(
                inputs.tensors["pixel_values"], inputs.tensors["image_grid_thw"], return_dict=True
            )
        return out.pooler_output[0]

    ref = lm_inputs(base)
    assert ref.shape[0] == len(tokens)
    for t in tokens:
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        rx, ry = max(1, int((x1 - x0) / 5)), max(1, int((y1 - y0) / 5))
        arr = base.copy()
        arr[cy - ry : cy + ry, cx - rx : cx + rx] = 255 - arr[cy - ry : cy + ry, cx - rx : cx + rx]
        change = (lm_inputs(arr) - ref).norm(dim=-1)
        assert int(change.argmax()) == t.index, (t, change.topk(3))


def test_hooks_are_removed_and_attention_restored(traced):
    m, _ = traced
    before = m.model.config._attn_implementation

    image = noise_image(IMAGE_SIZE)
    capture(m, image, QUESTION)
    counts = module_hook_counts(m.model)
    capture(m, image, QUESTION)
    assert m.model.config._attn_implementation == before
    assert module_hook_counts(m.model) == counts
    with pytest.raises(IndexError):
        capture(m, image, QUESTION, query_positions=[10_000])
    assert module_hook_counts(m.model) == counts


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_saved_folder_loads_with_this_adapter(tmp_path, kind):
    """load_model on a saved folder picks this adapter and runs the same model."""
    from core import load_model

    m = tiny_qwen_float64(kind)
    m.model.float().save_pretrained(tmp_path, safe_serialization=True)
    m.processor.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.family == kind and type(loaded.adapter) is type(m.adapter)
    image = noise_image(IMAGE_SIZE)
    with torch.no_grad():
        want = m.adapter.next_token_logits(m.adapter.prepare([image], [QUESTION]))
        got = loaded.adapter.next_token_logits(loaded.adapter.prepare([image], [QUESTION]))
    n_keys = loaded.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    torch.testing.assert_close(got, want, atol=forwards_tol(loaded.adapter, want, n_keys), rtol=0)
    assert loaded.adapter.prompt(QUESTION) == m.adapter.prompt(QUESTION)
