"""Idefics2 adapter on tiny random float64 models: every recorded piece is
checked against an independent computation (the model's own outputs, autograd,
or a recomputation from canonical weights, the adapter's RoPE and Mistral's
sliding-window mask), and the resampler's geometry (latents, no patches) by
experiment."""

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import QuestionError
from core.forward.geometry import region_tokens
from core.models.canonical import NotMapped
from core.models.families.idefics2 import Idefics2Adapter
from core.models.loading import LoadedModel
from tests.core.exactness import capture_every_position, invert_around_box_centre, noise_image, projected_visual_tokens
from tests.core.test_idefics3 import _recompute_patterns

SPECIAL = ["<s>", "</s>", "<unk>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]
WORDS = "user assistant : is there a red blue circle square ? what color shape yes no of the"
# Idefics2's chat template (text and image items); the tokenizer adds the BOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'].capitalize()}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QUESTION = "is there a red circle?"
SHORTEST, LONGEST, PATCH, LATENTS = 24, 40, 4, 8  # frames of at most 40 px, patch 4, 8 latents a frame
IMAGE_SIZE = (100, 60)  # resized to 40 x 24 (10 x 6 patches); split: four 50 x 30 crops, each 40 x 24
WINDOW = 16  # the unsplit case's sliding window: shorter than its 27-token prompt


def tiny_tokenizer():
    """A word-level tokenizer built offline with Idefics2's markup tokens, "\\n" as
    a token of its own, and a BOS added as Idefics2's Llama tokenizer adds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab["\n"] = len(vocab)
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens([AddedToken("\n", normalized=False)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<end_of_utterance>",
        pad_token="</s>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(split: bool = False, chat_template: bool = True):
    from transformers import Idefics2ImageProcessor, Idefics2Processor

    return Idefics2Processor(
        image_processor=Idefics2ImageProcessor(
            size={"shortest_edge": SHORTEST, "longest_edge": LONGEST}, do_image_splitting=split
        ),
        tokenizer=tiny_tokenizer(),
        image_seq_len=LATENTS,
        chat_template=CHAT_TEMPLATE if chat_template else None,
    )


def tiny_model_float64(split: bool = False, tie: bool = False, window: int | None = WINDOW) -> LoadedModel:
    """A random Idefics2 built from configs: a 2-layer SigLIP-style tower (patch 4,
    up to 10 x 10 patches), a 2-layer perceiver resampler with 8 latents, a 3-layer
    Mistral with grouped-query heads (4 query, 2 key/value), in float64."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    n_vocab = len(SPECIAL) + 1 + len(dict.fromkeys(WORDS.split()))
    text = {
        "model_type": "mistral",
        "vocab_size": n_vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "sliding_window": window,
        "pad_token_id": ids["</s>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["<end_of_utterance>"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": LONGEST,
        "patch_size": PATCH,
    }
    perceiver = {
        "hidden_size": 64,
        "rms_norm_eps": 1e-5,
        "resampler_n_latents": LATENTS,
        "resampler_depth": 2,
        "resampler_n_heads": 4,
        "resampler_head_dim": 16,
        "num_key_value_heads": 2,
    }
    config = Idefics2Config(
        text_config=text,
        vision_config=vision,
        perceiver_config=perceiver,
        image_token_id=ids["<image>"],
        tie_word_embeddings=tie,
    )
    config.architectures = ["Idefics2ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Idefics2ForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains (and the latents) to 1: make them count
        for layer in model.model.text_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.text_model.norm.weight.normal_(1, 0.3)
        model.model.connector.perceiver_resampler.latents.normal_(0, 1)
        # A trained model never predicts <image>; this random one did, and a re-run of the
        # prefix would then read the generated <image> as a slot with no image features.
        model.lm_head.weight[ids["<image>"]] = 0
    processor = tiny_processor(split)
    adapter = registry.adapter_for_hf("Idefics2ForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-idefics2", adapter.family, model, processor, processor.tokenizer, adapter)


KINDS = {"idefics2": (False, False, WINDOW), "idefics2_split": (True, True, None)}  # split, tie, sliding window


@functools.cache
def traced_case(kind: str):
    """``(model, trace)`` of ``kind`` ("idefics2": one frame, untied, a sliding window
    shorter than the prompt; "idefics2_split": five frames, tied, no window): one
    capture, every query position kept; built once per session."""
    m = tiny_model_float64(*KINDS[kind])
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = tuple(KINDS)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    return traced_case(request.param)


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

FAMILY = "idefics2"
ADAPTERS = {"Idefics2ForConditionalGeneration": Idefics2Adapter}
UNKNOWN_ARCHITECTURE = "IdeficsForVisionText2Text"  # Idefics 1: gated cross-attention, not mapped
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
# Images of different sizes (the batch pads the smaller one's pixels) and questions of different lengths.
PADDED_BATCH = ([(100, 60), (50, 50)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = ":"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image markup", "is there a <image> circle?"),
    ("too long", "red " * 600),
)


def n_visual(m) -> int:
    return (5 if m.processor.image_processor.do_image_splitting else 1) * LATENTS


def check_canonical_weights(m, x) -> None:
    """No attention biases in Mistral; W_U tied or not."""
    a = m.adapter
    assert a._attn(1).q_proj.bias is None and torch.all(a.b_Q(1) == 0) and torch.all(a.b_O(1) == 0)
    emb = a.language_model.embed_tokens.weight
    assert (a.W_U.data_ptr() == emb.data_ptr()) == bool(m.model.config.tie_word_embeddings)


def check_loaded(m, loaded) -> None:
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == n_visual(m)


def check_padded_batch(m, batch) -> None:
    """Row 0's whole image (40 x 24) is padded to row 1's (40 x 40; the mask marks the
    padding), and both rows hold the same fixed number of latents."""
    mask = batch.tensors["pixel_attention_mask"][:, -1]  # the last frame: the whole image
    assert int(mask[0].sum()) == 40 * 24 and bool(mask[1].all()) and mask.shape[-2:] == (40, 40)
    assert m.adapter.visual_positions(batch).shape == (2, n_visual(m))


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    a.check_question("red " * 500)  # 507 prompt tokens: fits as text, not once the latents and BOS are in
    with pytest.raises(QuestionError, match="with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], ["red " * 500])


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the resampler's latents (every frame, in order) as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "pixel_attention_mask")


def check_decomposition(m, tr, r) -> None:
    """embed, per layer the heads and the MLP (no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def recompute_patterns(a, tr, layer: int) -> tuple[torch.Tensor, float]:
    """RoPE at the sequence index, the mask from a.allowed_keys (sliding window included)."""
    return _recompute_patterns(a, tr, layer, a.rope_positions(tr))


def check_patterns_and_values(m, tr) -> None:
    """Not vacuous: without the rotation, and (for the windowed case) under the plain
    causal mask, the recomputed patterns differ from the recorded ones."""
    a = m.adapter
    positions = a.rope_positions(tr)
    assert torch.equal(positions, torch.arange(tr.input_ids.shape[1]))
    unrotated, _ = _recompute_patterns(a, tr, 1, torch.zeros_like(positions))
    assert (unrotated[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3
    window = a.text_config.sliding_window
    n = tr.input_ids.shape[1]
    assert (window is not None) == (m.model.config.tie_word_embeddings is False) and (window is None or n > window)
    if window is not None:  # the last query's oldest keys are outside the window: weight exactly 0
        last = tr.query_positions.tolist().index(n - 1)
        assert torch.all(tr.patterns[1][0][:, last, : n - window] == 0)
        causal = torch.ones(n, n, dtype=torch.bool).tril() & tr.attention_mask[0].bool().view(1, -1)
        assert not torch.equal(causal, a.allowed_keys(tr, 1))


def test_prompt_template_and_fallback_agree(traced):
    """The processor's chat template and the documented fallback render the same text."""
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = type(a)(m.model, tiny_processor(chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def test_fake_tokens_are_the_visual_delimiters(traced):
    """Each frame's latents sit between <fake_token_around_image> markers (one shared
    between adjacent frames); those markers are the delimiters, the rest is text."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    frames = n_visual(m) // LATENTS
    fakes = [i for i, t in enumerate(toks) if t == "<fake_token_around_image>"]
    assert len(fakes) == frames + 1 and a.visual_delimiter_positions(tr) == fakes
    roles = a.token_roles(tr)
    visual = tr.visual_positions[0].tolist()
    assert visual == [i for i, t in enumerate(toks) if t == "<image>"] and len(visual) == n_visual(m)
    for f in range(frames):  # fake, 8 latents, fake
        assert visual[f * LATENTS : (f + 1) * LATENTS] == list(range(fakes[f] + 1, fakes[f + 1]))
    assert roles[0] == "sink" and toks[0] == "<s>"
    assert [roles[i] for i in fakes] == ["visual_delimiter"] * len(fakes)


def test_visual_tokens_are_latents_with_no_patch(traced):
    """One token per latent, frame by frame, at the image tokens' positions; no patch
    (row = col = -1, so no region ever counts one) and a box that refuses in one line
    naming the resampler; the record says box None."""
    m, tr = traced
    a = m.adapter
    positions = tr.visual_positions[0].tolist()
    tokens = a.visual_tokens(IMAGE_SIZE, positions)
    assert [t.position for t in tokens] == positions
    assert [(t.image, t.latent) for t in tokens] == [divmod(i, LATENTS) for i in range(n_visual(m))]
    assert all(t.row == t.col == -1 for t in tokens)
    assert tokens[0].to_dict() == {"index": 0, "position": positions[0], "image": 0, "row": -1, "col": -1, "box": None}
    for read in (lambda t: list(t.box), lambda t: t.box[0], lambda t: [*t.box]):
        with pytest.raises(NotMapped, match="perceiver resampler") as refused:
            read(tokens[3])
        assert "\n" not in str(refused.value)
    with pytest.raises(NotMapped, match="perceiver resampler"):
        a.tiling(IMAGE_SIZE)
    assert region_tokens(tokens, np.ones(IMAGE_SIZE[::-1], dtype=bool)) == []
    with pytest.raises(ValueError, match="latents"):
        a.visual_tokens(IMAGE_SIZE, positions[:-1])


def test_inverting_a_corner_moves_every_latent_of_the_frames_that_see_it(traced):
    """Geometry by experiment: inverting a small patch near the top-left corner changes
    every latent of each frame holding that corner (a latent reads all its frame's
    patches: none is local) and leaves the other frames' latents bitwise as they were
    (with splitting, frames 0..3 are the crops TL, TR, BL, BR and frame 4 the whole image)."""
    m, _ = traced
    base = np.asarray(noise_image(IMAGE_SIZE, 3)).copy()
    with torch.no_grad():
        ref = visual_inputs(m, Image.fromarray(base))
        arr = invert_around_box_centre(base, [0, 0, 20, 12], 1)
        change = (visual_inputs(m, Image.fromarray(arr)) - ref).norm(dim=-1).view(-1, LATENTS)
    seen = [0, 4] if change.shape[0] == 5 else [0]
    for f in range(change.shape[0]):
        if f in seen:
            assert bool((change[f] > 1e-6 * ref.norm(dim=-1).max()).all()), (f, change[f])
        else:
            assert torch.all(change[f] == 0), (f, change[f])


def test_no_visual_feature_site():
    """The connector's output is (frames, latents, d_model): no visual-feature edit site."""
    from core.errors import InterventionError
    from core.forward.edits import Edit

    m, _ = traced_case("idefics2")
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=site):
            m.adapter.check_edits([Edit(None, site=site)])
