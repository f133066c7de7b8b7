"""Aya Vision adapter on a tiny random float64 model (SigLIP tower on tiles plus a
thumbnail, pixel shuffle, Cohere 2 decoder with a parallel block, logit_scale,
interleaved RoPE on sliding-window layers and NoPE full-attention layers): every
recorded piece is checked against an independent computation (the model's own
outputs, autograd, or a recomputation from canonical weights with a RoPE and a
mask written here), and the geometry against the processor and by experiment."""

import copy
import functools
import math
from types import SimpleNamespace

import pytest
import torch

from core.errors import InterventionError, ModelLoadError, UnsupportedArchitectureError
from core.forward.edits import Edit
from core.models.families.aya_vision import AyaVisionAdapter
from core.models.loading import LoadedModel
from core.models.norms import Norm
from tests.core.exactness import capture_every_position, noise_image, pattern_rtol, projected_visual_tokens, scores_tol
from tests.core.test_internvl import perturbation_rivals  # noqa: F401 (conformance hook: the same frames)
from tests.tolerances import unit_roundoff

MAX_TILES = 6
TILE_MARKS = ["TILE", "TILE_GLOBAL"] + [f"TILE_{k}" for k in range(1, MAX_TILES + 1)]
SPECIAL = [
    "<PAD>",
    "<UNK>",
    "<BOS_TOKEN>",
    "<|END_OF_TURN_TOKEN|>",
    "<|START_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<image>",
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
    *TILE_MARKS,
]
WORDS = "is there a red blue circle square ? what color shape yes no of the"
# Aya Vision's chat template, reduced to one user turn of text and image items.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' }}{% else %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}"
    "{% endif %}{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{{ '<|END_OF_TURN_TOKEN|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)
QUESTION = "is there a red circle?"
TILE, PATCH, DOWN = 32, 4, 2  # frames of 32 px, 8x8 patches, 4x4 tokens of 8 px per frame
GRID = TILE // PATCH // DOWN
IMAGE_SIZE = (100, 60)  # a 3 x 2 canvas of tiles + the thumbnail: 7 frames, 112 visual tokens
WINDOW = 24  # shorter than the ~130-token prompt: the sliding layers' window bites
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
LOGIT_SCALE = 0.25


def tiny_tokenizer():
    """A word-level Cohere-style tokenizer built offline with Aya Vision's image markup as special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<UNK>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<BOS_TOKEN>",
        eos_token="<|END_OF_TURN_TOKEN|>",
        pad_token="<PAD>",
        unk_token="<UNK>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(chat_template: bool = True):
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessor

    return AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES),
        tokenizer=tiny_tokenizer(),
        patch_size=PATCH,
        img_size=TILE,
        downsample_factor=DOWN,
        chat_template=CHAT_TEMPLATE if chat_template else None,
    )


def tiny_config():
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "model_type": "cohere2",
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "layer_norm_eps": 1e-5,
        "logit_scale": LOGIT_SCALE,
        "sliding_window": WINDOW,
        "layer_types": LAYER_TYPES,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50.0},
        "pad_token_id": ids["<PAD>"],
        "bos_token_id": ids["<BOS_TOKEN>"],
        "eos_token_id": ids["<|END_OF_TURN_TOKEN|>"],
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    config = AyaVisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["<|IMG_PATCH|>"],
        downsample_factor=DOWN,
        alignment_intermediate_size=48,
        tie_word_embeddings=True,
    )
    config.architectures = [AyaVisionForConditionalGeneration.__name__]
    return config


def tiny_aya_vision_float64() -> LoadedModel:
    """A random Aya Vision built from configs: a 2-layer SigLIP on 32 px frames (patch
    4), a 2x2 pixel shuffle, a 3-layer Cohere 2 (4 query heads, 2 key/value heads,
    layers sliding / full (NoPE) / sliding, window 24, logit_scale 0.25), word
    embeddings tied to the LM head, in float64."""
    from transformers import AyaVisionForConditionalGeneration

    from core.models import registry

    torch.manual_seed(0)
    model = AyaVisionForConditionalGeneration(tiny_config()).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1 and biases to 0: make them count
        for layer in model.model.language_model.layers:
            layer.input_layernorm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
        projector = model.model.multi_modal_projector
        projector.linear_1.bias.normal_(0, 0.5)
        projector.linear_2.bias.normal_(0, 0.5)
        model.model.language_model.embed_tokens.weight.normal_(0, 1.0)  # tied: logits that are not all ~0
    processor = tiny_processor()
    adapter = registry.adapter_for_hf(AyaVisionForConditionalGeneration.__name__)(model, processor, processor.tokenizer)
    return LoadedModel("tiny-aya_vision", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace)``: one capture of the question on the tiled noise image, every
    query position kept; built once per session (shared with the conformance tests)."""
    assert kind == "aya_vision"
    m = tiny_aya_vision_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("aya_vision",)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def traced():
    return traced_case("aya_vision")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"AyaVisionForConditionalGeneration": AyaVisionAdapter}
DESCRIPTION = {
    "position_scheme": "rope",
    "final_norm": "layernorm",
    "attention_kind": "self",
    "norm_placement": "parallel",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {0: 1.0, 1: 1.0}
# 2 x 2 tiles + thumbnail and 3 x 2 tiles + thumbnail, questions of different lengths (row 0 the shorter).
PADDED_BATCH = ([(50, 50), (100, 60)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "<|CHATBOT_TOKEN|>"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image markup", "is there a <image> circle?"),
    ("special token '<|IMG_PATCH|>'", "is there a <|IMG_PATCH|> circle?"),
    ("too long", "red " * 600),
)
PERTURB_SIZES = [IMAGE_SIZE]
LIBRARY_HOOKS = True  # transformers keeps output-capturing hooks of its own on the vision tower


def output_embeddings(model):
    """The unembedding as the model applies it: ``lm_head`` times ``logit_scale``."""
    return SimpleNamespace(weight=model.lm_head.weight * model.config.text_config.logit_scale, bias=None)


def check_canonical_weights(m, x) -> None:
    """No biases (Cohere 2 without attention_bias); W_U is the tied embedding times
    logit_scale, which is not 1 (a W_U without it would fail every lens check)."""
    a = m.adapter
    assert all(torch.all(b == 0) for b in (a.b_Q(1), a.b_K(1), a.b_V(1), a.b_O(1), a.b_U))
    emb = a.language_model.embed_tokens.weight
    assert a.logit_scale == LOGIT_SCALE != 1 and torch.equal(a.W_U, emb.T * LOGIT_SCALE)


def check_loaded(m, loaded) -> None:
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == 7 * GRID * GRID


def check_padded_batch(m, batch) -> None:
    assert batch.tensors["pixel_values"].shape[0] == 5 + 7  # every row's frames, one after the other
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        m.adapter.visual_positions(batch)


def check_question_errors(m, monkeypatch) -> None:
    from core.errors import QuestionError

    a = m.adapter
    a.check_question("red " * 420)  # short enough as text, too long once the 7 frames' tokens are in
    with pytest.raises(QuestionError, match="with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], ["red " * 420])


def check_decomposition(m, tr, r) -> None:
    """embed, per layer the heads and the MLP (both read the same norm, both add to the stream; no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the projected visual tokens (tiles, then the thumbnail) as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """Corners and inner tokens of tiles and of the thumbnail (3 x 2 tiles + thumbnail)."""
    per, last = GRID * GRID, GRID - 1
    picks = [(0, 0, 0), (2, 1, 2), (4, 2, 1), (5, last, last), (6, 0, 0), (6, last, 0), (6, 2, 1), (6, last, last)]
    probes = []
    for image, r, c in picks:
        t = tokens[image * per + r * GRID + c]
        assert (t.image, t.row, t.col, t.index) == (image, r, c, image * per + r * GRID + c)
        probes.append(t)
    return probes


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Written here from the definition: coordinates ``(2i, 2i + 1)`` of ``x (pos, heads, d)``
    rotate by ``position * theta ** (-2i / d)``. The angles are float32 as the model builds
    them (their rounding grows with the position, beyond any per-step bound), the rotation float64."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = (positions.float().view(-1, 1) * inv_freq).double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _recompute_patterns(a, tr, layer: int, rope: bool, window: int | None) -> tuple[torch.Tensor, float]:
    """``(heads, pos, pos)`` from canonical weights, this file's RoPE (or none) and
    causal mask (window or none), and how far (relative) the model's float32 softmax may be."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
    n = x.shape[0]
    if rope:
        theta = a.text_config.rope_parameters["rope_theta"]
        q, k = interleaved_rope(q, torch.arange(n), theta), interleaved_rope(k, torch.arange(n), theta)
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    allowed = (j <= i) & ((j > i - window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~allowed, float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, rope)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def recompute_patterns(a, tr, layer: int) -> tuple[torch.Tensor, float]:
    """The conformance check's recomputation: sliding layers rotated and windowed, the full layer neither."""
    sliding = LAYER_TYPES[layer] == "sliding_attention"
    return _recompute_patterns(a, tr, layer, sliding, WINDOW if sliding else None)


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: the window bites on sliding layers, the rotation matters there,
    and the full layer is NoPE (rotating it gives other patterns)."""
    a = m.adapter
    n = tr.input_ids.shape[1]
    assert n > WINDOW and [a._rotary(b) is not None for b in range(3)] == [True, False, True]
    for layer, rope, window in ((0, True, None), (0, False, WINDOW), (1, True, None)):
        other, _ = _recompute_patterns(a, tr, layer, rope, window)
        assert (other[:, tr.query_positions] - tr.patterns[layer][0]).abs().max() > 1e-3
    answer = int(tr.answer_positions[0])
    assert torch.all(tr.patterns[0][0][:, answer, : answer - WINDOW + 1] == 0)
    assert torch.all(tr.patterns[1][0][:, answer, : answer + 1] > 0)  # the full layer reads every key


# ---- this family's own checks


def test_prompt_template_and_fallback_agree(traced):
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = AyaVisionAdapter(m.model, tiny_processor(chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


@torch.no_grad()
def test_queries_keys_and_allowed_keys_follow_the_layer_type(traced):
    """The adapter's queries / keys equal this file's independent recomputation
    (interleaved RoPE on sliding layers, none on the full layer), and its masks are
    the window on sliding layers, plain causal on the full one."""
    m, tr = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    theta = a.text_config.rope_parameters["rope_theta"]
    for layer, kind in enumerate(LAYER_TYPES):
        q, k = a.queries_keys(tr, layer)
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        want_q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
        want_k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
        sliding = kind == "sliding_attention"
        if sliding:
            want_q = interleaved_rope(want_q, torch.arange(n), theta)
            want_k = interleaved_rope(want_k, torch.arange(n), theta)
        # the model rotates in float32: q, k, cos and sin each rounded once, three roundings in the sum
        for got, want in ((q, want_q), (k, want_k)):
            tol = 6 * unit_roundoff(torch.float32) * float(want.abs().max()) if sliding else 0
            torch.testing.assert_close(got, want, atol=tol, rtol=0)
        want_mask = (j <= i) & ((j > i - WINDOW) if sliding else True)
        assert torch.equal(a.allowed_keys(tr, layer), want_mask)


def test_parallel_block_writes_attention_and_mlp_from_one_norm(traced):
    """Block l adds attn(LN(x_l)) + mlp(LN(x_l)) to x_l: the MLP's recorded output is
    the MLP applied to the very normed stream the attention read (attn_norm), and the
    next block's input is the sum, to float64 rounding."""
    m, tr = traced
    a = m.adapter
    for layer in range(a.n_layers):
        x = tr.resid_pre[layer][0]
        with torch.no_grad():
            mlp = a.mlp_module(layer)(a.attn_norm(layer)(x))
        torch.testing.assert_close(tr.mlp_out[layer][0], mlp, atol=0, rtol=0)
        nxt = tr.resid_pre[layer + 1][0] if layer + 1 < a.n_layers else tr.final_resid[0]
        total = x + tr.attn_out[layer][0] + tr.mlp_out[layer][0]
        torch.testing.assert_close(nxt, total, atol=0, rtol=0)


def test_cohere_norm_is_the_models(traced):
    """The canonical norm reproduces Cohere's LayerNorm bit for bit (mean-centred,
    no bias, gain in float32), and the centring matters here (an RMSNorm differs)."""
    m, tr = traced
    a = m.adapter
    x = tr.resid_pre[1][0]
    with torch.no_grad():
        want = a.language_model.layers[1].input_layernorm(x)
    torch.testing.assert_close(a.attn_norm(1)(x), want, atol=0, rtol=0)
    norm = a.attn_norm(1)
    rms = Norm("rmsnorm", norm.weight, None, norm.eps, compute_dtype=torch.float32)
    assert (rms(x) - want).abs().max() > 1e-3
    assert a.final_norm_layer().bias is None and a.final_norm_layer().kind == "layernorm"


def test_logits_are_the_scaled_unembedding(traced):
    """The model's logits are lm_head's output times logit_scale (the scale the
    canonical W_U carries; the conformance lens and DLA checks read it), bitwise:
    0.25 is a power of two; and the scale is not a no-op here."""
    m, tr = traced
    a = m.adapter
    p = int(tr.answer_positions[0])
    with torch.no_grad():
        raw = m.model.lm_head(a.language_model.norm(tr.final_resid[0, p]))
    assert torch.equal(tr.logits[0, p], raw * LOGIT_SCALE)
    assert (raw - tr.logits[0, p]).abs().max() > 1e-3


def test_image_markup_tokens_are_visual_delimiters(traced):
    """``<|START_OF_IMG|>``, each ``TILE_k``, ``TILE_GLOBAL`` and ``<|END_OF_IMG|>`` are
    delimiters; every ``<|IMG_PATCH|>`` is visual, in the order of visual_tokens."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    delim = a.visual_delimiter_positions(tr)
    vis = tr.visual_positions[0].tolist()
    want = ["<|START_OF_IMG|>"] + [f"TILE_{k}" for k in range(1, 7)] + ["TILE_GLOBAL", "<|END_OF_IMG|>"]
    assert [toks[i] for i in delim] == want
    assert sorted(delim + vis) == list(range(delim[0], delim[-1] + 1)) and len(vis) == 7 * GRID * GRID
    roles = a.token_roles(tr)
    assert [roles[i] for i in delim] == ["visual_delimiter"] * len(delim) and roles.count("visual") == len(vis)
    assert roles[0] == "sink" and roles[toks.index("red")] == "text"
    assert [t.position for t in a.visual_tokens(IMAGE_SIZE, vis)] == vis


def test_pixel_shuffle_merges_row_major_blocks(traced):
    """Token (r, c) of a frame concatenates the patches (2r + i, 2c + j), i, j < 2:
    fed patch indices (row-major, as the tower emits them), the model's own shuffle
    returns them block by block, tokens row-major."""
    m, _ = traced
    n = TILE // PATCH
    idx = torch.arange(n * n, dtype=torch.float64).view(1, n * n, 1)
    shuffled = m.model.model.multi_modal_projector.pixel_shuffle(idx).reshape(GRID * GRID, DOWN * DOWN)
    for k in range(GRID * GRID):
        r, c = divmod(k, GRID)
        want = {(DOWN * r + i) * n + DOWN * c + j for i in range(DOWN) for j in range(DOWN)}
        assert set(shuffled[k].long().tolist()) == want


def test_vision_features_then_projector_are_the_image_features(traced):
    """vision_features (the projector's input) then project_visual is the model's
    get_image_features, bit for bit, one row per visual token, and leaves no hook."""
    m, _ = traced
    a = m.adapter
    pixels = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        features = a.vision_features(pixels)
        want = m.model.model.get_image_features(pixels, return_dict=True).pooler_output
        got = a.project_visual(features)
    assert features.shape == (7, (TILE // PATCH) ** 2, m.model.config.vision_config.hidden_size)
    assert got.shape == (7, GRID * GRID, a.d_model) and not a.projector._forward_pre_hooks
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_projector_sites_are_refused_with_the_reason(traced):
    m, _ = traced
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match="no .* edit site"):
            m.adapter.check_edits([Edit(None, None, (0,), None, site=site)])
        with pytest.raises(InterventionError, match="aya_vision: .*per frame"):
            m.adapter.site_record_hooks(site, {})


@pytest.mark.parametrize("size", [(100, 60), (60, 100), (50, 50), (33, 200), (300, 31), (20, 20), (97, 95)])
def test_tiling_follows_the_processor(traced, size):
    """The frame count is the processor's own (its pixel_values and its token
    count); the tiles' boxes and the thumbnail's each cover the original image."""
    m, _ = traced
    a = m.adapter
    rows, cols = a.tiling(size)
    n_frames = rows * cols + 1
    inputs = a.prepare([noise_image(size)], [QUESTION])
    assert inputs.tensors["pixel_values"].shape[0] == n_frames
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size, a.visual_positions(inputs)[0].tolist())
    assert len(tokens) == n == n_frames * GRID * GRID
    for frames in (range(rows * cols), [rows * cols])[rows * cols == 0 :]:  # tiles (if any), thumbnail
        area = sum((t.box[2] - t.box[0]) * (t.box[3] - t.box[1]) for t in tokens if t.image in frames)
        assert area == pytest.approx(size[0] * size[1])
    assert tokens[-1].box[2:] == pytest.approx(list(size)) and tokens[-GRID * GRID].box[:2] == [0.0, 0.0]


def test_processor_geometry_mismatch_is_refused(traced):
    """A processor whose tokens are not the tower's cells: no box would be right."""
    m, _ = traced
    a = m.adapter
    p = a.processor
    old = p.patch_size
    p.patch_size = PATCH
    try:
        with pytest.raises(NotImplementedError, match="Aya Vision geometry is mapped for"):
            a.visual_tokens(IMAGE_SIZE)
    finally:
        p.patch_size = old


@pytest.mark.parametrize(
    "path, value, error",
    [
        ("vision_feature_select_strategy", "default", ModelLoadError),
        ("downsample_factor", 3, ModelLoadError),
        ("text_config.model_type", "cohere", UnsupportedArchitectureError),
    ],
)
def test_config_outside_the_mapped_model_is_refused(traced, path, value, error):
    """A dropped first patch (no CLS in SigLIP), frames not whole token cells, or another decoder."""
    m, _ = traced
    config = copy.deepcopy(m.model.config)
    owner, _, field = path.rpartition(".")
    setattr(getattr(config, owner) if owner else config, field, value)
    AyaVisionAdapter.check_config(m.model.config)
    with pytest.raises(error):
        AyaVisionAdapter.check_config(config)
