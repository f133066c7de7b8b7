"""Janus adapter on a tiny random float64 model (SigLIP tower, MLP aligner,
Llama decoder; the VQ generation path built but never run): every recorded
piece is checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the letterbox geometry against the processor and by experiment."""

import copy
import functools

import numpy as np
import pytest
import torch

from core.errors import ModelLoadError, QuestionError
from core.forward.capture import capture
from core.models.families.janus import JanusAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import capture_every_position, noise_image, projected_visual_tokens
from tests.core.test_idefics3 import check_patterns_and_values, recompute_patterns  # noqa: F401 (conformance hooks)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜▁pad▁｜>", "<unk>", "<|User|>", "<|Assistant|>"]
SPECIAL += ["<image_placeholder>", "<begin_of_image>", "<end_of_image>"]
WORDS = ": is there a red blue circle square ? what color shape yes no of the"
# Janus-Pro's chat template, reduced to one user turn of an image and text items.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<|User|>: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image_placeholder>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)
QUESTION = "is there a red circle?"
SIDE, PATCH = 24, 4  # the tower's 24 px square: 6 x 6 patches, one visual token each
GRID = SIDE // PATCH
IMAGE_SIZE = (100, 60)  # -> 24 x 14 px, padded 5 px above and below


def tiny_tokenizer():
    """A word-level Llama-style tokenizer built offline (BOS added by the
    tokenizer) with Janus's image markup as the named special tokens its processor reads."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<｜▁pad▁｜>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
        extra_special_tokens={
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )


def tiny_processor(chat_template: bool = True):
    from transformers import JanusImageProcessor, JanusProcessor

    return JanusProcessor(
        image_processor=JanusImageProcessor(size={"height": SIDE, "width": SIDE}, min_size=2),
        tokenizer=tiny_tokenizer(),
        num_image_tokens=GRID * GRID,
        chat_template=CHAT_TEMPLATE if chat_template else None,
    )


def tiny_janus_float64() -> LoadedModel:
    """A random Janus built from configs: a 2-layer SigLIP tower on 24 px (patch 4),
    a 2-layer aligner, a 3-layer Llama with grouped-query heads (4 query, 2 key/value),
    word embeddings tied to the LM head, and the smallest VQ model the config allows, in float64."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "model_type": "llama",
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<｜▁pad▁｜>"],
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
    }
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "mlp_ratio": 2.0,
        "image_size": SIDE,
        "patch_size": PATCH,
        "projection_dim": 64,
        "depth": 2,
        "num_image_tokens": GRID * GRID,
    }
    vq = {
        "embed_dim": 4,
        "num_embeddings": 16,
        "latent_channels": 32,
        "base_channels": 32,  # its GroupNorms take 32 groups
        "channel_multiplier": [1, 1],
        "num_res_blocks": 1,
        "projection_dim": 64,
        "image_token_embed_dim": 64,
        "num_hidden_layers": 1,
    }
    config = JanusConfig(
        text_config=text, vision_config=vision, vq_config=vq, image_token_id=ids["<image_placeholder>"]
    )
    config.architectures = [JanusForConditionalGeneration.__name__]
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1: make them count
        lm = model.model.language_model
        for layer in lm.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        lm.norm.weight.normal_(1, 0.3)
        model.model.vision_model.embeddings.position_embedding.weight.normal_(0, 0.5)
    processor = tiny_processor()
    adapter = registry.adapter_for_hf(JanusForConditionalGeneration.__name__)(model, processor, processor.tokenizer)
    return LoadedModel("tiny-janus", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace)``: one capture of the question on the noise image, every
    query position kept; built once per session (shared with the conformance tests)."""
    assert kind == "janus"
    m = tiny_janus_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("janus",)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def traced():
    return traced_case("janus")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"JanusForConditionalGeneration": JanusAdapter}
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
# questions of different lengths (row 0 the shorter), images of different shapes
PADDED_BATCH = ([(50, 50), (100, 60)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = ":"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image markup", "is there a <image_placeholder> circle?"),
    ("special token '<begin_of_image>'", "is there a <begin_of_image> circle?"),
    ("too long", "red " * 600),
)
PERTURB_SIZES = [IMAGE_SIZE, (60, 100)]
LIBRARY_HOOKS = True  # transformers keeps output-capturing hooks of its own on the vision tower


def check_canonical_weights(m, x) -> None:
    """Llama: no q/k/v/o biases; W_U tied to the word embeddings."""
    a = m.adapter
    assert all(torch.all(b == 0) for b in (a.b_Q(1), a.b_K(1), a.b_V(1), a.b_O(1)))
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() == emb.data_ptr() and torch.all(a.b_U == 0)


def check_loaded(m, loaded) -> None:
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == GRID * GRID


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    # the prompt is BOS <|User|> : <image_placeholder> question <|Assistant|> : (6 tokens besides the
    # question); the placeholder becomes <begin_of_image>, GRID * GRID tokens, <end_of_image>
    n = 512 - 6 - (GRID * GRID + 1)
    a.check_question("red " * n)  # exactly the 512 positions
    with pytest.raises(QuestionError, match="with the image"):
        a.check_question("red " * (n + 1))  # fits as text, not with the image's tokens
    assert a.prepare([noise_image(IMAGE_SIZE)], ["red " * n]).input_ids.shape[1] == 512


def check_decomposition(m, tr, r) -> None:
    """embed, per layer the heads and the MLP (no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the aligned visual tokens as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """Tokens whose box centre lies inside the image (the padding's hold no pixel of it)."""
    w, h = size
    return [t for t in tokens if 0 < (t.box[0] + t.box[2]) / 2 < w and 0 < (t.box[1] + t.box[3]) / 2 < h]


# ---- this family's own checks


def test_prompt_template_and_fallback_agree(traced):
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = JanusAdapter(m.model, tiny_processor(chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def test_image_start_and_end_are_visual_delimiters(traced):
    """``<begin_of_image>`` / ``<end_of_image>`` frame the image's placeholders and are
    delimiters; every placeholder is visual, in the order of visual_tokens."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    delim = a.visual_delimiter_positions(tr)
    vis = tr.visual_positions[0].tolist()
    assert [toks[i] for i in delim] == ["<begin_of_image>", "<end_of_image>"]
    assert vis == list(range(delim[0] + 1, delim[1])) and len(vis) == GRID * GRID
    roles = a.token_roles(tr)
    assert [roles[i] for i in delim] == ["visual_delimiter"] * 2 and roles.count("visual") == len(vis)
    assert toks[0] == BOS and roles[0] == "sink" and roles[-1] == "text"
    assert [t.position for t in a.visual_tokens(IMAGE_SIZE, vis)] == vis


def test_vision_features_then_aligner_are_the_image_features(traced):
    """vision_features (the tower, every patch) then project_visual is the model's
    get_image_features, bit for bit, one row per visual token."""
    m, _ = traced
    a = m.adapter
    pixels = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        features = a.vision_features(pixels)
        want = m.model.model.get_image_features(pixels, return_dict=True).pooler_output
        got = a.project_visual(features)
    assert features.shape == (1, GRID * GRID, m.model.config.vision_config.hidden_size)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_image_mode_processor_is_overridden(traced):
    """A processor left in generation_mode "image" would append <begin_of_image>
    (the generation path): the adapter's prompts stay understanding prompts."""
    m, _ = traced
    a = m.adapter
    want = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids
    type(a.processor).generation_mode = "image"
    try:
        got = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids
    finally:
        type(a.processor).generation_mode = "text"
    assert torch.equal(got, want) and a.tokenizer.convert_ids_to_tokens(int(got[0, -1])) == ":"


@pytest.mark.parametrize("size", [(100, 60), (60, 100), (50, 50), (33, 200), (300, 31), (7, 9), (97, 95)])
def test_boxes_undo_the_processors_resize_and_pad(traced, size):
    """Experiment on the processor with a white image: its pixels on the canvas are
    the letterbox's rectangle (the rest is the mean-colour padding, all channels
    below 128); each box maps back to its patch, a box reaches into the image
    exactly when its patch holds image pixels, and the boxes' in-image parts tile
    the image once."""
    m, _ = traced
    a = m.adapter
    ip = a.processor.image_processor
    w, h = size
    white = np.full((h, w, 3), 255, np.uint8)
    from PIL import Image

    pixels = a.prepare([Image.fromarray(white)], [QUESTION]).tensors["pixel_values"][0]
    # the canvas in raw 0..255 values: undo the normalisation
    mean, std = torch.tensor(ip.image_mean).view(3, 1, 1), torch.tensor(ip.image_std).view(3, 1, 1)
    raw = (pixels * std.double() + mean.double()) / ip.rescale_factor
    inside = raw.amin(0) > 200  # (S, S): the image's own pixels (the padding is the mean colour)
    side, (rw, rh), (left, top) = a.letterbox(size)
    assert int(inside.sum()) == rw * rh
    assert bool(inside[top : top + rh, left : left + rw].all())
    tokens = a.visual_tokens(size)
    for t in tokens:
        x0, y0 = t.col * PATCH, t.row * PATCH
        # the box's canvas pixels, back through the scale: (box * scale) + pad is the patch
        assert [t.box[0] * rw / w + left, t.box[1] * rh / h + top] == pytest.approx([x0, y0])
        assert [t.box[2] * rw / w + left, t.box[3] * rh / h + top] == pytest.approx([x0 + PATCH, y0 + PATCH])
        clipped = (max(t.box[0], 0) < min(t.box[2], w)) and (max(t.box[1], 0) < min(t.box[3], h))
        assert clipped == bool(inside[y0 : y0 + PATCH, x0 : x0 + PATCH].any())
    area = sum(
        max(0, min(t.box[2], w) - max(t.box[0], 0)) * max(0, min(t.box[3], h) - max(t.box[1], 0)) for t in tokens
    )
    assert area == pytest.approx(w * h)


@pytest.mark.parametrize("field, value", [("num_image_tokens", 35), ("patch_size", 5)])
def test_config_outside_the_mapped_geometry_is_refused(traced, field, value):
    m, _ = traced
    config = copy.deepcopy(m.model.config)
    setattr(config.vision_config, field, value)
    JanusAdapter.check_config(m.model.config)
    with pytest.raises(ModelLoadError, match="Janus geometry is mapped for"):
        JanusAdapter.check_config(config)


def test_processor_other_than_the_towers_square_is_refused(traced):
    m, _ = traced
    ip = m.adapter.processor.image_processor
    ip.do_pad = False
    try:
        with pytest.raises(NotImplementedError, match="Janus geometry is mapped for"):
            m.adapter.visual_tokens(IMAGE_SIZE)
    finally:
        ip.do_pad = True


@pytest.mark.parametrize("site", ["vision_out", "projector_out"])
def test_visual_sites_are_the_tower_and_the_aligner(traced, site):
    """vision_out is the tower's output (vision_features), projector_out the aligned
    rows the decoder reads (visual_inputs), bitwise; patching every token with
    another image's values reproduces that image's run exactly."""
    from core.methods import interventions as iv
    from tests.core.test_interventions import same_logits

    m, _ = traced
    a = m.adapter
    images = noise_image(IMAGE_SIZE, 1), noise_image(IMAGE_SIZE, 2)
    a_in, b_in = (a.prepare([im], [QUESTION]) for im in images)
    first, _ = iv.visual_site_features(m, a_in, site, None)
    second, b_feats = iv.visual_site_features(m, b_in, site, None)
    with torch.no_grad():
        want = (
            a.vision_features(b_in.tensors["pixel_values"])[0] if site == "vision_out" else visual_inputs(m, images[1])
        )
    torch.testing.assert_close(b_feats, want, atol=0, rtol=0)
    assert (first.logits - second.logits).abs().max() > 1e-6  # the images differ for the model
    edit = iv.visual_patch_edit(site, range(b_feats.shape[0]), b_feats, first, None)
    same_logits(capture(m, None, "", inputs=a_in, edits=[edit]), second)
