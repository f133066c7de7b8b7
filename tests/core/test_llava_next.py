"""LLaVA-NeXT adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the any-resolution geometry by experiment (pixels perturbed in the
original image move the token whose box holds them)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.capture import capture
from core.errors import QuestionError, UnsupportedArchitectureError
from core.methods.residual import decompose
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_canonical_projections,
    assert_decomposition_is_exact,
    assert_heads_sum_to_attention_output,
    assert_jacobian_dla_is_autograd,
    assert_reconstruction_and_lens_at_last_layer,
    assert_source_contributions_sum_to_each_heads_terms,
    forwards_tol,
    module_hook_counts,
    noise_image,
    pattern_rtol,
    scores_tol,
    values_tol,
)

SPECIAL = ("<pad>", "<s>", "</s>", "<unk>", "<image>")
WORDS = "user assistant : is there a red blue circle square ? what color shape yes no of the"
# Vicuna-style template (llava-v1.6-vicuna), reduced to text and image items.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QUESTION = "is there a red circle?"
TILE, PATCH = 32, 8  # vision tower: 32 px images, a 4 x 4 patch grid
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # (height, width): 1 x 2, 2 x 1 or 2 x 2 tiles
IMAGE_SIZE = (90, 50)  # (width, height): 2 x 2 tiles, the image 64 x 36 inside, 14 px pad above and below


def tiny_tokenizer():
    """A word-level Llama-style tokenizer built offline (``<s>`` prepended)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(chat_template=CHAT_TEMPLATE):
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, dropped by the "default" strategy
        chat_template=chat_template,
    )


def tiny_llava_next_float64(chat_template=CHAT_TEMPLATE) -> LoadedModel:
    """A random LLaVA-NeXT built from a config: CLIP tower (2 layers, 32 px,
    8 px patches), Llama decoder (3 layers, 4 heads, 2 K/V heads, d_head 16,
    q/k/v/o biases on so that every bias path is exercised), float64."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    n_vocab = len(SPECIAL) + len(dict.fromkeys(WORDS.split()))
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
        "projection_dim": 32,
    }
    text = {
        "model_type": "llama",
        "vocab_size": n_vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": True,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
    }
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<image>"],
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init zeroes biases and sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                proj.bias.normal_(0, 0.5)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(chat_template)
    adapter = registry.adapter_for_hf("LlavaNextForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-llava-next", adapter.family, model, processor, processor.tokenizer, adapter)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model runs fastest on one thread (and a busy machine makes more threads much slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def traced():
    m = tiny_llava_next_float64()
    image = noise_image(IMAGE_SIZE)
    n_pos = m.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos))
    return m, tr


def image_features(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the image's tokens as the decoder receives them (after the projector)."""
    inputs = m.adapter.prepare([image], [QUESTION])
    with torch.no_grad():
        out = m.model.model.get_image_features(
            inputs.tensors["pixel_values"], inputs.tensors["image_sizes"], return_dict=True
        )
    return out.pooler_output[0]


# ------------------------------------------------------------ registry, weights


def test_registry_and_description(traced):
    from core.models import registry
    from core.models.families.llava_next import LlavaNextAdapter

    m, _ = traced
    assert registry.adapter_for_hf("LlavaNextForConditionalGeneration") is LlavaNextAdapter
    with pytest.raises(UnsupportedArchitectureError, match="LlavaNextForConditionalGeneration"):
        registry.adapter_for_hf("NoSuchVLMForConditionalGeneration")
    d = m.adapter.describe()
    assert d["family"] == "llava_next" and d["position_scheme"] == "rope" and d["final_norm"] == "rmsnorm"
    assert (d["n_layers"], d["n_heads"], d["d_model"]) == (3, 4, 64)
    assert m.adapter.n_kv_heads == 2 and m.adapter.d_head == 16 and m.adapter.kv_group(3) == 1


def test_canonical_weights_match_the_projections(traced):
    """q/k/v/o biases present; grouped K/V expanded to each query head; W_U untied."""
    m, _ = traced
    a = m.adapter
    x = torch.randn(5, a.d_model, dtype=torch.float64)
    z = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    assert_canonical_projections(a, a._attn(1), 1, x, z)
    assert a.b_O(1).abs().sum() > 0
    assert a.W_U.shape == (a.d_model, a.language_model.embed_tokens.weight.shape[0]) and torch.all(a.b_U == 0)
    norm = a.attn_norm(2)
    assert norm.kind == "rmsnorm" and norm.eps == 1e-6


# ------------------------------------------------------------ exactness


def test_heads_sum_to_attention_output(traced):
    m, tr = traced
    assert_heads_sum_to_attention_output(m.adapter, tr)


def test_residual_reconstruction_and_lens_at_last_layer(traced):
    m, tr = traced
    a = m.adapter
    assert_reconstruction_and_lens_at_last_layer(a, tr)
    # the captured logits are those of a plain forward with no hook of ours: the
    # same under eager attention (the same ops in the same order), and under sdpa
    # (a float64 softmax, not eager's float32) as far as two forwards may differ
    from core.capture import eager_attention

    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with torch.no_grad():
        sdpa = m.model(**inputs.tensors).logits
        with eager_attention(m.model):
            eager = m.model(**inputs.tensors).logits
    torch.testing.assert_close(tr.logits, eager, atol=0, rtol=0)
    torch.testing.assert_close(tr.logits, sdpa, atol=forwards_tol(a, eager, tr.input_ids.shape[1]), rtol=0)
    # block 0 reads the token embeddings with the packed image features scattered
    # into the <image> positions, in the order visual_tokens lists them
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    emb = a.language_model.embed_tokens(tr.input_ids[0])
    torch.testing.assert_close(tr.resid_pre[0][0, text], emb[text], atol=0, rtol=0)
    with eager_attention(m.model):  # the capture ran the vision tower eager too
        features = image_features(m, noise_image(IMAGE_SIZE))
    torch.testing.assert_close(tr.resid_pre[0][0, vis], features, atol=0, rtol=0)


def test_frozen_dla_sums_to_logit_difference_minus_bias(traced):
    m, tr = traced
    a = m.adapter
    # Llama's RMSNorm normalises in float32 even in a float64 model: the frozen sum
    # is exact up to float32 rounding of the logit's terms
    r = assert_decomposition_is_exact(a, tr, a.token_id("yes"), a.token_id("no"))
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 2)  # embed; per layer heads, o_proj bias, mlp
    assert sum(c.name.startswith("bias.") for c in r.components) == a.n_layers


def test_jacobian_dla_equals_autograd_directional_derivative(traced):
    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    assert_jacobian_dla_is_autograd(a, tr, a_id, f_id, which=(0, 1, 4, 5, 6, 17))


def test_source_contributions_sum_to_each_heads_output(traced):
    """Summed over sources, each head's projections equal u . (W_O^h z^h) at the
    answer position (the value path with the q/k/v biases included)."""
    from core.methods.contributions import source_contributions

    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))


def _recompute_patterns(a, tr, layer: int, batch: int = 0) -> tuple[torch.Tensor, float]:
    """``(heads, pos, pos)`` from canonical weights, adapter.rotate, rope_positions
    and allowed_keys, and how far (relative) the model's eager float32 softmax may be from it."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][batch])  # (pos, d_model)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
    positions = a.rope_positions(tr, batch)
    q, k = a.rotate(q, positions), a.rotate(k, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~a.allowed_keys(tr, layer, batch), float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def test_patterns_and_values_recomputed_from_canonical_weights(traced):
    m, tr = traced
    a = m.adapter
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        v = torch.einsum("pm,hmd->phd", x, a.W_V(layer)) + a.b_V(layer)
        z = torch.einsum("hqk,khd->qhd", tr.patterns[layer][0], v)
        tol = values_tol(tr.patterns[layer][0], x, a.W_V(layer), a.b_V(layer))
        torch.testing.assert_close(z, tr.z[layer][0, tr.query_positions], atol=tol, rtol=0)


def test_right_padded_batch(traced):
    """Questions of different lengths: right padding, the answer position is
    the last real token, each row's logits equal its own run, and the padded
    row's patterns are recomputed with allowed_keys excluding the padding."""
    m, _ = traced
    a = m.adapter
    image = noise_image(IMAGE_SIZE, 1)
    questions = [QUESTION, "what color is the square of the blue circle?"]
    batch = a.prepare([image, image], questions)
    assert a.tokenizer.padding_side == "left"  # restored
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 0 and mask[1, -1] == 1
    logits = a.next_token_logits(batch)
    for i in range(2):
        single = a.prepare([image], [questions[i]])
        assert int(batch.answer_positions[i]) == single.input_ids.shape[1] - 1
        assert a.token_str(int(batch.input_ids[i, batch.answer_positions[i]])) == ":"
        want = a.next_token_logits(single)[0]
        torch.testing.assert_close(logits[i], want, atol=forwards_tol(a, want, mask.shape[1]), rtol=0)
    n = batch.input_ids.shape[1]
    tr = capture(m, None, None, inputs=batch, query_positions=range(n))
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer, batch=0)
        real = mask[0].bool()
        torch.testing.assert_close(pattern[:, real], tr.patterns[layer][0][:, real], atol=0, rtol=rtol)
    roles = a.token_roles(tr, 0)
    assert roles[-1] == "padding" and roles.count("visual_delimiter") == 4


def test_different_image_sizes_in_one_batch(traced):
    """Images with different tile counts (pixel_values zero-padded on the tile
    axis) give each row its own run's logits; visual_positions refuses ragged rows."""
    m, _ = traced
    a = m.adapter
    images = [noise_image((100, 40), 2), noise_image((40, 40), 3)]  # 1 x 2 tiles, 2 x 2 tiles
    batch = a.prepare(images, [QUESTION, QUESTION])
    assert batch.tensors["pixel_values"].shape[:2] == (2, 5)
    logits = a.next_token_logits(batch)
    for i in range(2):
        single = a.prepare([images[i]], [QUESTION])
        want = a.next_token_logits(single)[0]
        torch.testing.assert_close(logits[i], want, atol=forwards_tol(a, want, batch.input_ids.shape[1]), rtol=0)
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        a.visual_positions(batch)


def test_append_token_continues_the_text(traced):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    yes = a.token_id("yes")
    longer = a.append_token(inputs, yes)
    assert int(longer.answer_positions[0]) == int(inputs.answer_positions[0]) + 1
    assert int(longer.input_ids[0, -1]) == yes
    with torch.no_grad():
        before, after = a.forward_logits(inputs), a.forward_logits(longer)
    torch.testing.assert_close(after[:, :-1], before, atol=forwards_tol(a, before, longer.input_ids.shape[1]), rtol=0)


# ------------------------------------------------------------ roles and geometry


def test_newline_tokens_are_delimiters(traced):
    """The newline tokens (col = -1) sit at the end of each unpadded row, hold
    exactly the model's image_newline embedding, and are labelled visual_delimiter."""
    m, tr = traced
    a = m.adapter
    vis = tr.visual_positions[0].tolist()
    tokens = a.visual_tokens(IMAGE_SIZE, vis)
    assert [t.position for t in tokens] == vis
    newline = [t for t in tokens if t.col == -1]
    lay = a.anyres_layout(IMAGE_SIZE)
    assert (lay.rows, lay.cols, lay.keep, lay.tiles) == (4, 8, (2, 0), (2, 2))
    assert len(newline) == lay.rows
    assert [t.position for t in newline] == a.visual_delimiter_positions(tr)
    # a zero-width box on a whole pixel: no pixel mask covers it
    assert all(t.image == 1 and t.tile is None and t.box[0] == t.box[2] == int(t.box[0]) for t in newline)
    x0 = tr.resid_pre[0][0, [t.position for t in newline]]
    torch.testing.assert_close(x0, m.model.model.image_newline.expand_as(x0), atol=0, rtol=0)
    roles = a.token_roles(tr)
    assert roles[0] == "sink"
    for t in tokens:
        assert roles[t.position] == ("visual_delimiter" if t.col == -1 else "visual")
    assert roles.count("visual") == len(tokens) - len(newline)


@pytest.mark.parametrize("size", [(90, 50), (50, 90), (100, 40), (40, 100), (40, 40), (130, 30), (33, 70)])
def test_token_count_and_boxes_follow_the_layout(traced, size):
    """The processor's <image> count, the model's packed feature count and
    visual_tokens agree; base boxes tile the whole image; high-res boxes tile
    the unpadded canvas, rows x cols, contiguous, row-major."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    inputs = a.prepare([image], [QUESTION])
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size)
    assert len(tokens) == n == image_features(m, image).shape[0]
    lay = a.anyres_layout(size)
    assert inputs.tensors["pixel_values"].shape[1] == 1 + lay.tiles[0] * lay.tiles[1]
    base = [t for t in tokens[: lay.n_base]]
    assert all(t.image == 0 and t.tile == 0 for t in base)
    assert base[0].box[:2] == [0.0, 0.0] and base[-1].box[2:] == pytest.approx(list(size))
    hi = [t for t in tokens[lay.n_base :] if t.col >= 0]
    assert len(hi) == lay.rows * lay.cols and [(t.row, t.col) for t in hi] == [
        divmod(i, lay.cols) for i in range(len(hi))
    ]
    for t, nxt in zip(hi, hi[1:]):
        if nxt.row == t.row:
            assert nxt.box[0] == pytest.approx(t.box[2]) and nxt.box[1] == pytest.approx(t.box[1])
        else:
            assert nxt.box[1] == pytest.approx(t.box[3])
    w, h = size
    # unpad_image works on whole feature rows/columns: the kept map may reach
    # into the padding, or drop a partly covered edge row/column, by less than a patch
    tol_x, tol_y = PATCH * w / lay.resized[1], PATCH * h / lay.resized[0]
    assert abs(hi[0].box[0]) < tol_x and abs(hi[0].box[1]) < tol_y
    assert abs(hi[-1].box[2] - w) < tol_x and abs(hi[-1].box[3] - h) < tol_y


@pytest.mark.parametrize("size", [(90, 50), (50, 90), (100, 40)])
def test_perturbing_a_box_centre_moves_its_own_token_most(traced, size):
    """Geometry by experiment on non-square images: inverting the pixels
    around a token's box centre in the ORIGINAL image changes that token's
    input to the language model more than any other token of its view (base
    or high-res), leaves every token of the other tiles and every newline
    token exactly unchanged (high-res tokens), for every token whose box
    centre lies inside the image."""
    m, _ = traced
    a = m.adapter
    base_arr = np.asarray(noise_image(size, 4)).copy()
    tokens = a.visual_tokens(size)
    ref = image_features(m, Image.fromarray(base_arr))
    views = {v: torch.tensor([t.index for t in tokens if t.image == v and t.col >= 0]) for v in (0, 1)}
    newline = torch.tensor([t.index for t in tokens if t.col < 0])
    w, h = size
    checked = {0: 0, 1: 0}
    for t in tokens:
        if t.col < 0:
            continue
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        if not (0 <= cx < w and 0 <= cy < h):
            continue  # the centre lies in the padding: nothing to perturb
        rx, ry = max(1, int((x1 - x0) / 6)), max(1, int((y1 - y0) / 6))
        arr = base_arr.copy()
        ys, xs = slice(max(0, cy - ry), cy + ry), slice(max(0, cx - rx), cx + rx)
        arr[ys, xs] = 255 - arr[ys, xs]
        change = (image_features(m, Image.fromarray(arr)) - ref).norm(dim=-1)
        own = views[t.image]
        assert int(own[change[own].argmax()]) == t.index, (t, change[own].topk(3))
        assert torch.all(change[newline] == 0)
        if t.image == 1:
            other_tiles = torch.tensor([u.index for u in tokens if u.image == 1 and u.col >= 0 and u.tile != t.tile])
            assert torch.all(change[other_tiles] == 0), t
        checked[t.image] += 1
    lay = a.anyres_layout(size)
    assert checked[0] == lay.n_base and checked[1] >= lay.rows * lay.cols - 2 * max(lay.rows, lay.cols)


# ------------------------------------------------------------ text, errors, hooks, loading


def test_prompt_template_and_fallback(traced):
    m, _ = traced
    expected = f"USER: <image>\n{QUESTION} ASSISTANT:"
    assert m.adapter.prompt(QUESTION) == expected
    bare = tiny_llava_next_float64(chat_template=None)
    assert bare.adapter.prompt(QUESTION) == expected  # the documented fallback


def test_question_errors(traced, monkeypatch):
    m, _ = traced
    a = m.adapter
    with pytest.raises(QuestionError, match="empty"):
        a.check_question("   ")
    with pytest.raises(QuestionError, match="vocabulary"):
        a.check_question("is there a purple circle?")
    with pytest.raises(QuestionError, match="too long"):
        a.check_question(" ".join(["red"] * 300))
    # fits with the base image alone but not with the tiles: prepare sees the real count
    n = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids.shape[1]
    monkeypatch.setattr(a, "_max_positions", lambda: n - 1)
    a.check_question(QUESTION)
    with pytest.raises(QuestionError, match=f"{n} tokens with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])


def test_geometry_refuses_processors_it_does_not_undo():
    m = tiny_llava_next_float64()
    m.processor.image_processor.image_grid_pinpoints = [[32, 96], [64, 64]]
    with pytest.raises(ValueError, match="pinpoints"):
        m.adapter.visual_tokens(IMAGE_SIZE)
    m.processor.image_processor.image_grid_pinpoints = PINPOINTS
    m.processor.image_processor.crop_size = {"height": 24, "width": 24}
    with pytest.raises(NotImplementedError, match="geometry"):
        m.adapter.visual_tokens(IMAGE_SIZE)
    # the token layout (newline positions) and the question check need the model only
    assert m.adapter.anyres_layout(IMAGE_SIZE, pixels=False).n_tokens == 52
    m.adapter.check_question(QUESTION)


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


def test_saved_folder_loads_with_this_adapter(tmp_path):
    """load_model on a saved folder picks this adapter and runs the same model."""
    from core import load_model

    m = tiny_llava_next_float64()
    m.model.float().save_pretrained(tmp_path, safe_serialization=True)
    m.processor.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.family == "llava_next" and type(loaded.adapter) is type(m.adapter)
    image = noise_image(IMAGE_SIZE)
    with torch.no_grad():
        want = m.adapter.next_token_logits(m.adapter.prepare([image], [QUESTION]))
        got = loaded.adapter.next_token_logits(loaded.adapter.prepare([image], [QUESTION]))
    n_keys = loaded.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    torch.testing.assert_close(got, want, atol=forwards_tol(loaded.adapter, want, n_keys), rtol=0)
    assert loaded.adapter.prompt(QUESTION) == m.adapter.prompt(QUESTION)
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == len(m.adapter.visual_tokens(IMAGE_SIZE))
