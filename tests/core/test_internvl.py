"""InternVL adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the tiles-plus-thumbnail geometry against the processor and by experiment."""

import copy
import functools

import pytest
import torch

from core.errors import InterventionError, ModelLoadError, QuestionError
from core.forward.edits import Edit
from core.models.families.internvl import InternVLAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import capture_every_position, noise_image, projected_visual_tokens
from tests.core.test_idefics3 import check_patterns_and_values, recompute_patterns  # noqa: F401 (conformance hooks)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<unk>"]
WORDS = "user assistant is there a red blue circle square ? what color shape yes no of the"
# InternVL3's chat template (the -hf checkpoints'), reduced to text and image items.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
QUESTION = "is there a red circle?"
TILE, PATCH, MAX_TILES = 32, 4, 6  # frames of 32 px, 8x8 patches, 4x4 tokens per frame
GRID = TILE // PATCH // 2
IMAGE_SIZE = (100, 60)  # a 3 x 2 canvas of tiles (aspect 1.5, nearest 1.67 within 6 tiles) + the thumbnail


def tiny_tokenizer():
    """A word-level Qwen-style tokenizer built offline with InternVL's image markup
    as the named special tokens its processor reads."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )


def tiny_processor(chat_template: bool = True):
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES),
        tokenizer=tiny_tokenizer(),
        video_processor=InternVLVideoProcessor(),
        image_seq_length=GRID * GRID,
        chat_template=CHAT_TEMPLATE if chat_template else None,
    )


def tiny_internvl_float64() -> LoadedModel:
    """A random InternVL built from configs: a 2-layer InternViT on 32 px frames
    (patch 4), pixel shuffle 0.5, a 3-layer Qwen2 with grouped-query heads (4 query,
    2 key/value) and q/k/v biases, word embeddings tied to the LM head, in float64."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "model_type": "qwen2",
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
    }
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=GRID * GRID,
        tie_word_embeddings=True,
    )
    config.architectures = [InternVLForConditionalGeneration.__name__]
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init zeroes biases, CLS and positions and sets norm gains to 1: make them count
        embeddings = model.model.vision_tower.embeddings
        embeddings.position_embeddings.normal_(0, 0.5)
        embeddings.cls_token.normal_(0, 0.5)
        lm = model.model.language_model
        for layer in lm.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        lm.norm.weight.normal_(1, 0.3)
    processor = tiny_processor()
    adapter = registry.adapter_for_hf(InternVLForConditionalGeneration.__name__)(model, processor, processor.tokenizer)
    return LoadedModel("tiny-internvl", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace)``: one capture of the question on the tiled noise image, every
    query position kept; built once per session (shared with the conformance tests)."""
    assert kind == "internvl"
    m = tiny_internvl_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("internvl",)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def traced():
    return traced_case("internvl")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"InternVLForConditionalGeneration": InternVLAdapter}
DESCRIPTION = {
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
# 2 x 2 tiles + thumbnail and 3 x 2 tiles + thumbnail, questions of different lengths (row 0 the shorter).
PADDED_BATCH = ([(50, 50), (100, 60)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "assistant"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image markup", "is there a <IMG_CONTEXT> circle?"),
    ("special token '<img>'", "is there a <img> circle?"),
    ("too long", "red " * 600),
)
PERTURB_SIZES = [IMAGE_SIZE]
# transformers keeps output-capturing hooks of its own on the vision tower: the conformance check compares counts.
LIBRARY_HOOKS = True


def check_canonical_weights(m, x) -> None:
    """Qwen2: q/k/v biases, no o_proj bias; W_U tied to the word embeddings."""
    a = m.adapter
    assert a.b_Q(1).abs().sum() > 0 and a.b_K(1).abs().sum() > 0 and torch.all(a.b_O(1) == 0)
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() == emb.data_ptr() and torch.all(a.b_U == 0)


def check_loaded(m, loaded) -> None:
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == 7 * GRID * GRID


def check_padded_batch(m, batch) -> None:
    assert batch.tensors["pixel_values"].shape[0] == 5 + 7  # every row's frames, one after the other
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        m.adapter.visual_positions(batch)


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    a.check_question("red " * 420)  # short enough as text, too long once the 7 frames' tokens are in
    with pytest.raises(QuestionError, match="with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], ["red " * 420])


def check_decomposition(m, tr, r) -> None:
    """embed, per layer the heads and the MLP (Qwen2's o_proj has no bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the projected visual tokens (tiles, then the
    thumbnail) as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """Corners and inner tokens of tiles (0, 0), (0, 2), (1, 1), (1, 2) and of the
    thumbnail (3 x 2 tiles + thumbnail)."""
    per, last = GRID * GRID, GRID - 1
    picks = [(0, 0, 0), (2, 1, 2), (4, 2, 1), (5, last, last), (6, 0, 0), (6, last, 0), (6, 2, 1), (6, last, last)]
    probes = []
    for image, r, c in picks:
        t = tokens[image * per + r * GRID + c]
        assert (t.image, t.row, t.col, t.index) == (image, r, c, image * per + r * GRID + c)
        probes.append(t)
    return probes


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    """The other tokens of its frame; for tile tokens every visual token at all (the
    thumbnail sees the same spot at a third of the resolution)."""
    per = GRID * GRID
    frame = torch.arange(t.image * per, (t.image + 1) * per)
    return [frame, torch.arange(len(tokens))] if t.image < 6 else [frame]


# ---- this family's own checks


def test_prompt_template_and_fallback_agree(traced):
    """The processor's chat template and the documented fallback render the same text."""
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = InternVLAdapter(m.model, tiny_processor(chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def test_image_start_and_end_are_visual_delimiters(traced):
    """``<img>`` and ``</img>`` frame the image's context tokens and are delimiters;
    every ``<IMG_CONTEXT>`` is visual, in the order of visual_tokens."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    delim = a.visual_delimiter_positions(tr)
    vis = tr.visual_positions[0].tolist()
    assert [toks[i] for i in delim] == ["<img>", "</img>"]
    assert vis == list(range(delim[0] + 1, delim[1])) and len(vis) == 7 * GRID * GRID
    roles = a.token_roles(tr)
    assert [roles[i] for i in delim] == ["visual_delimiter"] * 2 and roles.count("visual") == len(vis)
    assert roles[0] == "sink" and roles[-1] == "text"
    assert [t.position for t in a.visual_tokens(IMAGE_SIZE, vis)] == vis


def test_pixel_shuffle_merges_2x2_blocks(traced):
    """Token (r, c) of a frame concatenates the patches (2r + i, 2c + j), i, j < 2:
    fed patch indices (row-major, as the tower emits them), the model's own shuffle
    returns them block by block."""
    m, _ = traced
    n = TILE // PATCH
    idx = torch.arange(n * n, dtype=torch.float64).view(1, n, n, 1)
    shuffled = m.model.model.pixel_shuffle(idx, m.model.config.downsample_ratio).reshape(GRID * GRID, 4)
    for k in range(GRID * GRID):
        r, c = divmod(k, GRID)
        assert set(shuffled[k].long().tolist()) == {(2 * r + i) * n + 2 * c + j for i in range(2) for j in range(2)}


def test_vision_features_then_projector_are_the_image_features(traced):
    """vision_features (tower, CLS dropped, shuffle) then project_visual is the
    model's get_image_features, bit for bit, one row per visual token."""
    m, _ = traced
    a = m.adapter
    pixels = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        features = a.vision_features(pixels)
        want = m.model.model.get_image_features(pixels, return_dict=True).pooler_output
        got = a.project_visual(features)
    assert features.shape == (7, GRID * GRID, 4 * m.model.config.vision_config.hidden_size)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_projector_sites_are_refused_with_the_reason(traced):
    m, _ = traced
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match="no .* edit site"):
            m.adapter.check_edits([Edit(None, None, (0,), None, site=site)])
        with pytest.raises(InterventionError, match="per frame"):
            m.adapter.site_record_hooks(site, {})


@pytest.mark.parametrize("size", [(100, 60), (60, 100), (50, 50), (33, 200), (300, 31), (20, 20), (97, 95)])
def test_tiling_follows_the_processor(traced, size):
    """The frame count is the processor's own (its pixel_values and its token
    count); the tiles' boxes and the thumbnail's each cover the original image."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    rows, cols = a.tiling(size)
    n_frames = rows * cols + 1
    inputs = a.prepare([image], [QUESTION])
    assert inputs.tensors["pixel_values"].shape[0] == n_frames
    counted = a.processor._get_num_multimodal_tokens(image_sizes=[(size[1], size[0])])
    assert counted["num_image_patches"] == [n_frames]
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size, a.visual_positions(inputs)[0].tolist())
    assert len(tokens) == n == n_frames * GRID * GRID
    assert [t.image for t in tokens[:: GRID * GRID]] == list(range(n_frames))
    for frames in (range(rows * cols), [rows * cols])[rows * cols == 0 :]:  # tiles (if any), thumbnail
        area = sum((t.box[2] - t.box[0]) * (t.box[3] - t.box[1]) for t in tokens if t.image in frames)
        assert area == pytest.approx(size[0] * size[1])
    assert tokens[-1].box[2:] == pytest.approx(list(size)) and tokens[-GRID * GRID].box[:2] == [0.0, 0.0]


def test_tile_pixels_are_the_stretched_canvas_cut(traced):
    """Experiment on the processor: tile (r, c) is the image stretched to
    (rows * T, cols * T) cut at (r, c), the last frame the image stretched to T x T."""
    from torchvision.transforms.v2 import functional as tvF

    m, _ = traced
    a = m.adapter
    ip = a.processor.image_processor
    image = noise_image(IMAGE_SIZE)
    rows, cols = a.tiling(IMAGE_SIZE)
    pixels = a.prepare([image], [QUESTION]).tensors["pixel_values"]
    x = tvF.pil_to_tensor(image)[None]
    canvas = ip.resize(x, size=type(ip.size)(height=rows * TILE, width=cols * TILE), resample=ip.resample)
    thumb = ip.resize(x, size=type(ip.size)(height=TILE, width=TILE), resample=ip.resample)
    norm = functools.partial(ip.rescale_and_normalize, do_rescale=True, rescale_factor=ip.rescale_factor)
    norm = functools.partial(norm, do_normalize=True, image_mean=ip.image_mean, image_std=ip.image_std)
    for k in range(rows * cols):
        r, c = divmod(k, cols)
        tile = canvas[..., r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE]
        torch.testing.assert_close(pixels[k : k + 1], norm(tile).double(), atol=0, rtol=0)
    torch.testing.assert_close(pixels[-1:], norm(thumb).double(), atol=0, rtol=0)


def test_one_frame_without_thumbnail(traced):
    """With at most one tile the image is a single T x T frame covering it all."""
    m, _ = traced
    a = m.adapter
    ip = a.processor.image_processor
    ip.max_patches = 1
    try:
        inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
        assert a.tiling(IMAGE_SIZE) == (0, 0) and inputs.tensors["pixel_values"].shape[0] == 1
        tokens = a.visual_tokens(IMAGE_SIZE, a.visual_positions(inputs)[0].tolist())
        assert len(tokens) == GRID * GRID and {t.image for t in tokens} == {0}
        assert tokens[1].box == pytest.approx([100 / GRID, 0, 200 / GRID, 60 / GRID])
    finally:
        ip.max_patches = MAX_TILES


@pytest.mark.parametrize(
    "field, value", [("downsample_ratio", 0.25), ("vision_feature_select_strategy", "full"), ("patch_size", (4, 8))]
)
def test_config_outside_the_mapped_geometry_is_refused(traced, field, value):
    """A shuffle other than 2x2, a kept CLS or non-square patches: no box would be right."""
    m, _ = traced
    config = copy.deepcopy(m.model.config)
    setattr(config.vision_config if field == "patch_size" else config, field, value)
    InternVLAdapter.check_config(m.model.config)
    with pytest.raises(ModelLoadError, match="InternVL geometry is mapped for"):
        InternVLAdapter.check_config(config)
