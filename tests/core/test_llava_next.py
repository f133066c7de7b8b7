"""LLaVA-NeXT adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the any-resolution geometry by experiment (pixels perturbed in the
original image move the token whose box holds them)."""

import functools
import math

import pytest
import torch

from core.errors import QuestionError
from core.forward.capture import capture
from core.models.families.llava_next import LlavaNextAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    capture_every_position,
    forwards_tol,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    scores_tol,
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


@functools.cache
def traced_case(kind: str = "llava_next"):
    """``(model, trace)``: one capture, every query position kept; built once per
    session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_llava_next_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("llava_next",)  # the conformance module's cases of this file (traced_case keys)
# The components the conformance Jacobian check differentiates (autograd per component is slow here).
JACOBIAN_COMPONENTS = (0, 1, 4, 5, 6, 17)
# transformers keeps hooks of its own on this model: the conformance hooks check compares counts only.
LIBRARY_HOOKS = True


@pytest.fixture(scope="module")
def traced():
    return traced_case()


def image_features(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the image's tokens as the decoder receives them (after the projector)."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_sizes")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"LlavaNextForConditionalGeneration": LlavaNextAdapter}
DESCRIPTION = {
    "family": "llava_next",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
BAD_QUESTIONS = (("vocabulary", "is there a purple circle?"), ("too long", " ".join(["red"] * 300)))
PERTURB_SIZES = [(90, 50), (50, 90), (100, 40)]
PERTURB_SEED, PERTURB_SHRINK = 4, 6


def check_canonical_weights(m, x) -> None:
    """q/k/v/o biases present; W_U untied; the norms RMSNorms with the config's eps."""
    a = m.adapter
    assert a.b_O(1).abs().sum() > 0
    assert a.W_U.shape == (a.d_model, a.language_model.embed_tokens.weight.shape[0]) and torch.all(a.b_U == 0)
    norm = a.attn_norm(2)
    assert norm.kind == "rmsnorm" and norm.eps == 1e-6


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    # fits with the base image alone but not with the tiles: prepare sees the real count
    n = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids.shape[1]
    monkeypatch.setattr(a, "max_positions", lambda: n - 1)
    a.check_question(QUESTION)
    with pytest.raises(QuestionError, match=f"{n} tokens with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])


visual_inputs = image_features


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (image_features(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """Every token (not a newline) whose box centre lies inside the image: every base
    token, and all but at most the edge rows and columns of the high-res ones."""
    w, h = size
    probes = []
    for t in tokens:
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        if t.col >= 0 and 0 <= cx < w and 0 <= cy < h:  # else the centre lies in the padding: nothing to perturb
            probes.append(t)
    lay = m.adapter.anyres_layout(size)
    n_hi = sum(t.image == 1 for t in probes)
    assert len(probes) - n_hi == lay.n_base and n_hi >= lay.rows * lay.cols - 2 * max(lay.rows, lay.cols)
    return probes


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    return [torch.tensor([u.index for u in tokens if u.image == t.image and u.col >= 0])]  # its view's tokens


def check_perturbation(tokens, t, changes) -> None:
    """Every newline token and, for high-res tokens, every token of the other tiles, exactly unchanged."""
    (change,) = changes
    newline = torch.tensor([u.index for u in tokens if u.col < 0])
    assert torch.all(change[newline] == 0)
    if t.image == 1:
        other_tiles = torch.tensor([u.index for u in tokens if u.image == 1 and u.col >= 0 and u.tile != t.tile])
        assert torch.all(change[other_tiles] == 0), t


# ------------------------------------------------------------ exactness


def check_decomposition(m, tr, r) -> None:
    """This family's part of the conformance check of the frozen decomposition ``r``."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 2)  # embed; per layer heads, o_proj bias, mlp
    assert sum(c.name.startswith("bias.") for c in r.components) == a.n_layers


def recompute_patterns(a, tr, layer: int, batch: int = 0) -> tuple[torch.Tensor, float]:
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
        pattern, rtol = recompute_patterns(a, tr, layer, batch=0)
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


# ------------------------------------------------------------ text, errors, hooks, loading


def test_prompt_template_and_fallback(traced):
    m, _ = traced
    expected = f"USER: <image>\n{QUESTION} ASSISTANT:"
    assert m.adapter.prompt(QUESTION) == expected
    bare = tiny_llava_next_float64(chat_template=None)
    assert bare.adapter.prompt(QUESTION) == expected  # the documented fallback


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
