"""Idefics3 and SmolVLM adapters on tiny random float64 models: every recorded
piece is checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the tiled geometry by experiment."""

import functools
import math

import pytest
import torch

from core.errors import QuestionError
from core.forward.capture import capture
from core.models.families.idefics3 import Idefics3Adapter, SmolVLMAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    scores_tol,
)

SPECIAL = [
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|end_of_text|>",
    "<unk>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
WORDS = "user assistant : is there a red blue circle square ? what color shape yes no of the"
# Idefics3's / SmolVLM's chat template (text and image items); {bos} differs.
CHAT_TEMPLATE = (
    "{bos}{{% for message in messages %}}{{{{message['role'] | capitalize}}}}"
    "{{% if message['content'][0]['type'] == 'image' %}}{{{{':'}}}}{{% else %}}{{{{': '}}}}{{% endif %}}"
    "{{% for line in message['content'] %}}{{% if line['type'] == 'text' %}}{{{{line['text']}}}}"
    "{{% elif line['type'] == 'image' %}}{{{{ '<image>' }}}}{{% endif %}}{{% endfor %}}"
    "<end_of_utterance>\n{{% endfor %}}{{% if add_generation_prompt %}}{{{{ 'Assistant:' }}}}{{% endif %}}"
)
BOS = {"idefics3": "<|begin_of_text|>", "smolvlm": "<|im_start|>"}
QUESTION = "is there a red circle?"
TILE, LONGEST, PATCH, SCALE = 32, 96, 4, 2  # frames of 32 px, 8x8 patches, 4x4 tokens per frame
GRID = TILE // PATCH // SCALE
IMAGE_SIZE = (100, 60)  # resized to 96 x 58, stretched to 96 x 64: 2 x 3 tiles + the global image


def tiny_tokenizer(kind: str):
    """A word-level tokenizer built offline with Idefics3's markup tokens and
    "\\n" as a token of its own (a whitespace pre-tokenizer would drop it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
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
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS[kind],
        eos_token="<end_of_utterance>",
        pad_token="<|end_of_text|>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(kind: str, chat_template: bool = True):
    template = CHAT_TEMPLATE.format(bos=BOS[kind]) if chat_template else None
    sizes = {"size": {"longest_edge": LONGEST}, "max_image_size": {"longest_edge": TILE}}
    if kind == "idefics3":
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        return Idefics3Processor(
            image_processor=Idefics3ImageProcessor(**sizes),
            tokenizer=tiny_tokenizer(kind),
            image_seq_len=GRID * GRID,
            chat_template=template,
        )
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    return SmolVLMProcessor(  # needs num2words (a dependency: it words video frame counts)
        image_processor=SmolVLMImageProcessor(**sizes),
        tokenizer=tiny_tokenizer(kind),
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=GRID * GRID,
        chat_template=template,
    )


def tiny_model_float64(kind: str = "idefics3", tie: bool = False, bias: bool = True) -> LoadedModel:
    """A random Idefics3 / SmolVLM built from configs: a 2-layer SigLIP-style
    tower on 32 px frames (patch 4), pixel shuffle 2, a 3-layer Llama with
    grouped-query heads (4 query, 2 key/value), in float64."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    from core.models import registry

    ids = {t: i for i, t in enumerate(SPECIAL)}
    n_vocab = len(SPECIAL) + 1 + len(dict.fromkeys(WORDS.split()))
    text = {
        "vocab_size": n_vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "attention_bias": bias,
        "pad_token_id": ids["<|end_of_text|>"],
        "bos_token_id": ids[BOS[kind]],
        "eos_token_id": ids["<end_of_utterance>"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
    }
    config_cls, cls = (
        (Idefics3Config, Idefics3ForConditionalGeneration)
        if kind == "idefics3"
        else (SmolVLMConfig, SmolVLMForConditionalGeneration)
    )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=ids["<image>"],
        tie_word_embeddings=tie,
    )
    config.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(config).double().eval()
    with torch.no_grad():  # the init zeroes biases and sets norm gains to 1: make them count
        for layer in model.model.text_model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.text_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(kind)
    adapter = registry.adapter_for_hf(cls.__name__)(model, processor, processor.tokenizer)
    return LoadedModel(f"tiny-{kind}", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace)`` of ``kind`` ("idefics3": untied, o_proj bias; "smolvlm": tied,
    no bias): one capture, every query position kept; built once per session (this
    file's tests and tests/core/test_family_conformance.py share it)."""
    tie, bias = {"idefics3": (False, True), "smolvlm": (True, False)}[kind]
    m = tiny_model_float64(kind, tie, bias)
    image = noise_image(IMAGE_SIZE)
    inputs = m.adapter.prepare([image], [QUESTION])
    tr = capture(
        m, image, QUESTION, query_positions=range(inputs.input_ids.shape[1]), inputs=inputs, keep_attn_out=True
    )
    return m, tr


CASES = ("idefics3", "smolvlm")  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    return traced_case(request.param)


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Idefics3ForConditionalGeneration": Idefics3Adapter, "SmolVLMForConditionalGeneration": SmolVLMAdapter}
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
# Images tiled differently (2 x 3 and 3 x 3: a zero frame pads row 0) and questions of different lengths.
PADDED_BATCH = ([(100, 60), (50, 50)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = ":"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("image markup", "is there a <image> circle?"),
    ("too long", "red " * 600),
)
PERTURB_SIZES = [IMAGE_SIZE]


def check_canonical_weights(m, x) -> None:
    """Biases where the config has them; W_U tied or not."""
    a = m.adapter
    has_bias = a._attn(1).q_proj.bias is not None
    assert (a.b_Q(1).abs().sum() > 0) == has_bias and (a.b_O(1).abs().sum() > 0) == has_bias
    emb = a.language_model.embed_tokens.weight
    assert (a.W_U.data_ptr() == emb.data_ptr()) == bool(m.model.config.tie_word_embeddings)
    assert a.W_U.shape == (a.d_model, emb.shape[0]) and torch.all(a.b_U == 0)


def check_loaded(m, loaded) -> None:
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == 7 * GRID * GRID


def check_padded_batch(m, batch) -> None:
    a = m.adapter
    assert batch.tensors["pixel_values"].shape[1] == 10 and torch.all(batch.tensors["pixel_values"][0, 7] == 0)
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        a.visual_positions(batch)


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    # short enough as text, too long once the 7 frames' tokens are in
    a.check_question("red " * 450)
    with pytest.raises(QuestionError, match="with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], ["red " * 450])


def test_prompt_template_and_fallback_agree(traced):
    """The processor's chat template and the documented fallback render the same text."""
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = type(a)(m.model, tiny_processor(m.family, chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the projected visual tokens (all frames, in order)
    as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "pixel_attention_mask")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """A corner of tile (0, 0), inner tokens of tiles (0, 1), (1, 0) and (1, 2), and the
    global image's corners and an inner token (2 x 3 tiles + global)."""
    per, last = GRID * GRID, GRID - 1
    picks = [(0, 0, 0), (1, 1, 2), (3, 2, 1), (5, last, last), (6, 0, 0), (6, last, 0), (6, 2, 1), (6, last, last)]
    probes = []
    for image, r, c in picks:
        t = tokens[image * per + r * GRID + c]
        assert (t.image, t.row, t.col, t.index) == (image, r, c, image * per + r * GRID + c)
        probes.append(t)
    return probes


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    """The other tokens of its frame; for tile tokens every visual token at all (the
    global image sees the same spot at a third of the resolution)."""
    per = GRID * GRID
    frame = torch.arange(t.image * per, (t.image + 1) * per)
    return [frame, torch.arange(len(tokens))] if t.image < 6 else [frame]


def check_decomposition(m, tr, r) -> None:
    """This family's part of the conformance check of the frozen decomposition ``r``:
    embed, per layer the heads and the MLP, and the o_proj bias where there is one."""
    a = m.adapter
    has_bias = a._attn(0).o_proj.bias is not None
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1) + (a.n_layers if has_bias else 0)


def _recompute_patterns(a, tr, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(heads, pos, keys)`` from canonical weights, a.rotate and a.allowed_keys,
    and how far (relative) the model's eager float32 softmax may be from it."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])  # (pos, d_model)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
    q, k = a.rotate(q, positions), a.rotate(k, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~a.allowed_keys(tr, layer), float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def recompute_patterns(a, tr, layer: int) -> tuple[torch.Tensor, float]:
    """The conformance check's recomputation: RoPE at the sequence index."""
    return _recompute_patterns(a, tr, layer, a.rope_positions(tr))


def check_patterns_and_values(m, tr) -> None:
    a = m.adapter
    positions = a.rope_positions(tr)
    assert torch.equal(positions, torch.arange(tr.input_ids.shape[1]))
    # not vacuous: without the rotation the patterns differ
    unrotated, _ = _recompute_patterns(a, tr, 1, torch.zeros_like(positions))
    assert (unrotated[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3


def test_markup_tokens_are_visual_delimiters(traced):
    """Every <fake_token_around_image>, <row_r_col_c>, <global-img> and the
    newlines between tile rows are delimiters; the prompt's own newline is text."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    delim = a.visual_delimiter_positions(tr)
    rows, cols, _, _ = a.tiling(IMAGE_SIZE)
    assert (rows, cols) == (2, 3)
    markup = [i for i, t in enumerate(toks) if t in ("<fake_token_around_image>", "<global-img>") or "_col_" in t]
    assert len(markup) == 2 * rows * cols + 3  # fake + row/col per tile; fake, global, fake
    newlines = [i for i, t in enumerate(toks) if t == "\n"]
    assert len(newlines) == rows + 2  # one per tile row, one before the global image, one in the prompt
    assert delim == sorted(markup + newlines[:-1])
    roles = a.token_roles(tr)
    assert roles.count("visual") == (rows * cols + 1) * GRID * GRID
    assert roles[newlines[-1]] == "text" and roles[0] == "sink"
    assert [roles[i] for i in delim] == ["visual_delimiter"] * len(delim)


def test_pixel_shuffle_merges_row_major_blocks(traced):
    """Connector token (r, c) of a frame concatenates the patches (r*s + a, c*s + b),
    a, b < s: fed patch indices, the shuffle returns them block by block."""
    m, _ = traced
    n = TILE // PATCH
    idx = torch.arange(n * n, dtype=torch.float64).view(1, n * n, 1)
    shuffled = m.model.model.connector.pixel_shuffle(idx, SCALE)[0]  # (g*g, s*s)
    for k in range(GRID * GRID):
        r, c = divmod(k, GRID)
        want = {(r * SCALE + i) * n + c * SCALE + j for i in range(SCALE) for j in range(SCALE)}
        assert set(shuffled[k].long().tolist()) == want


@pytest.mark.parametrize("size", [(100, 60), (60, 100), (50, 50), (33, 200), (300, 31), (97, 95)])
def test_tiling_follows_the_processor(traced, size):
    """rows/cols and the cut image's size are the processor's own; the token
    count, frames and boxes follow."""
    m, _ = traced
    a = m.adapter
    ip = a.processor.image_processor
    image = noise_image(size)
    info = ip(images=[image], return_row_col_info=True, return_tensors="pt")
    rows, cols, rh, rw = a.tiling(size)
    assert (rows, cols) == (info["rows"][0][0], info["cols"][0][0])
    # the sizes from the processor's own resize functions
    from transformers.image_utils import SizeDict

    x = torch.zeros(1, 3, size[1], size[0])
    x = ip.resize(x, SizeDict(longest_edge=LONGEST))
    x = ip.resize_for_vision_encoder(x, TILE)
    assert tuple(x.shape[-2:]) == (rh, rw)
    n_frames = rows * cols + 1
    assert info["pixel_values"].shape[1] == n_frames
    inputs = a.prepare([image], [QUESTION])
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size)
    assert len(tokens) == n == n_frames * GRID * GRID
    assert [t.image for t in tokens[:: GRID * GRID]] == list(range(n_frames))
    # the tiles' boxes, and the global image's, each cover the original image exactly
    for frames in (range(rows * cols), [rows * cols]):
        area = sum((t.box[2] - t.box[0]) * (t.box[3] - t.box[1]) for t in tokens if t.image in frames)
        assert area == pytest.approx(size[0] * size[1])
    last_tile = [t for t in tokens if t.image == max(0, rows * cols - 1)][-1]
    assert last_tile.box[2:] == pytest.approx(list(size))
    assert tokens[-1].box[2:] == pytest.approx(list(size)) and tokens[-GRID * GRID].box[:2] == [0.0, 0.0]


def test_untiled_processor_gives_one_frame(traced):
    """With do_image_splitting off the image is one M x M frame covering it all."""
    m, _ = traced
    a = m.adapter
    ip = a.processor.image_processor
    ip.do_image_splitting = False
    try:
        size = (100, 60)
        inputs = a.prepare([noise_image(size)], [QUESTION])
        tokens = a.visual_tokens(size, a.visual_positions(inputs)[0].tolist())
        assert len(tokens) == GRID * GRID and {t.image for t in tokens} == {0}
        assert tokens[0].box[:2] == [0.0, 0.0] and tokens[-1].box[2:] == pytest.approx(list(size))
        assert tokens[1].box == pytest.approx([100 / GRID, 0, 200 / GRID, 60 / GRID])
    finally:
        ip.do_image_splitting = True


@pytest.mark.parametrize("kind", CASES)
def test_the_visual_feature_sites_are_refused_in_one_line(kind):
    """The connector runs per frame, so there is no (batch, n_visual, width) site: an edit
    or a patch there is one InterventionError naming the sites that exist (it was an
    AttributeError for LLaVA's projector, which this model lacks)."""
    from core.errors import InterventionError
    from core.forward.edits import Edit

    m = traced_case(kind)[0]
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=f"no '{site}' edit site") as refused:
            capture(m, None, "", inputs=inputs, edits=[Edit(None, site=site)])
        assert "\n" not in str(refused.value) and "resid" in str(refused.value)
