"""Idefics3 and SmolVLM adapters on tiny random float64 models: every recorded
piece is checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights and the adapter's RoPE),
and the tiled geometry by experiment."""

import contextlib
import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.capture import capture, eager_attention
from core.errors import QuestionError, UnsupportedArchitectureError
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


@contextlib.contextmanager
def num2words_stub():
    """SmolVLMProcessor refuses to start without ``num2words`` (it only words
    video frame counts); a stub stands in when the package is absent."""
    import transformers.models.smolvlm.processing_smolvlm as sp

    saved = sp.num2words
    if saved is None:
        sp.num2words = str
    try:
        yield
    finally:
        sp.num2words = saved


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

    with num2words_stub():
        return SmolVLMProcessor(
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


@pytest.fixture(
    scope="module",
    params=[("idefics3", False, True), ("smolvlm", True, False)],
    ids=["idefics3", "smolvlm"],
)
def traced(request):
    kind, tie, bias = request.param
    m = tiny_model_float64(kind, tie, bias)
    image = noise_image(IMAGE_SIZE)
    inputs = m.adapter.prepare([image], [QUESTION])
    tr = capture(m, image, QUESTION, query_positions=range(inputs.input_ids.shape[1]), inputs=inputs)
    return m, tr


def test_registry_and_description(traced):
    from core.models import registry
    from core.models.families.idefics3 import Idefics3Adapter, SmolVLMAdapter

    m, _ = traced
    assert registry.adapter_for_hf("Idefics3ForConditionalGeneration") is Idefics3Adapter
    assert registry.adapter_for_hf("SmolVLMForConditionalGeneration") is SmolVLMAdapter
    with pytest.raises(UnsupportedArchitectureError, match="SmolVLMForConditionalGeneration"):
        registry.adapter_for_hf("Idefics2ForConditionalGeneration")
    d = m.adapter.describe()
    assert d["position_scheme"] == "rope" and d["final_norm"] == "rmsnorm" and d["attention_kind"] == "self"
    assert (d["n_layers"], d["n_heads"], d["d_model"]) == (3, 4, 64)
    assert m.adapter.n_kv_heads == 2 and m.adapter.d_head == 16 and m.adapter.kv_group(3) == 1


def test_prompt_template_and_fallback_agree(traced):
    """The processor's chat template and the documented fallback render the same text."""
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = type(a)(m.model, tiny_processor(m.family, chat_template=False), m.tokenizer)
    assert bare.prompt(QUESTION) == a.prompt(QUESTION)


def test_canonical_weights_match_the_projections(traced):
    """Grouped K/V expanded to each query head; biases where the config has them; W_U tied or not."""
    m, _ = traced
    a = m.adapter
    attn = a._attn(1)
    x = torch.randn(5, a.d_model, dtype=torch.float64)
    z = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    assert_canonical_projections(a, attn, 1, x, z)
    has_bias = attn.q_proj.bias is not None
    assert (a.b_Q(1).abs().sum() > 0) == has_bias and (a.b_O(1).abs().sum() > 0) == has_bias
    emb = a.language_model.embed_tokens.weight
    assert (a.W_U.data_ptr() == emb.data_ptr()) == bool(m.model.config.tie_word_embeddings)
    assert a.W_U.shape == (a.d_model, emb.shape[0]) and torch.all(a.b_U == 0)


def test_heads_sum_to_attention_output(traced):
    m, tr = traced
    assert_heads_sum_to_attention_output(m.adapter, tr)


def _lm_visual_inputs(m, inputs) -> torch.Tensor:
    """``(n_visual, d_model)``: the projected visual tokens (all frames, in order)
    as the decoder receives them."""
    with torch.no_grad():
        out = m.model.model.get_image_features(
            inputs.tensors["pixel_values"], inputs.tensors.get("pixel_attention_mask"), return_dict=True
        )
    return torch.cat(list(out.pooler_output), dim=0)


def test_residual_reconstruction_and_lens_at_last_layer(traced):
    m, tr = traced
    a = m.adapter
    assert_reconstruction_and_lens_at_last_layer(a, tr)
    # the residual entering block 0: token embeddings, with the projected frames scattered in
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    emb = a.language_model.embed_tokens(tr.input_ids[0])
    torch.testing.assert_close(tr.resid_pre[0][0, text], emb[text], atol=0, rtol=0)
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with eager_attention(m.model):  # as in the capture (the vision tower's eager softmax is float32)
        projected = _lm_visual_inputs(m, inputs)
    torch.testing.assert_close(tr.resid_pre[0][0, vis], projected, atol=0, rtol=0)


def test_captured_logits_are_a_plain_forward(traced):
    """The capture's logits equal the library model's own forward, without any hook:
    eager attention exactly (the same ops in the same order), the default (sdpa)
    attention (a float64 softmax, not eager's float32) as far as two forwards may differ."""
    m, tr = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with torch.no_grad():
        plain = m.model(**inputs.tensors).logits
        with eager_attention(m.model):
            plain_eager = m.model(**inputs.tensors).logits
    torch.testing.assert_close(plain_eager, tr.logits, atol=0, rtol=0)
    torch.testing.assert_close(
        plain, tr.logits, atol=forwards_tol(m.adapter, plain_eager, tr.input_ids.shape[1]), rtol=0
    )


def test_logit_lens_last_row_is_the_model(traced):
    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    lens = logit_lens(a, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(a.n_layers + 1))
    p = lens.position
    assert p == int(tr.answer_positions[0]) == tr.input_ids.shape[1] - 1
    assert_lens_last_row_is_the_model(a, tr, lens, a_id, f_id)


def test_frozen_dla_sums_to_logit_difference_minus_bias(traced):
    m, tr = traced
    a = m.adapter
    # Llama's RMSNorm takes its statistics in float32 even in a float64 model
    r = assert_decomposition_is_exact(a, tr, a.token_id("yes"), a.token_id("no"))
    has_bias = a._attn(0).o_proj.bias is not None
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1) + (a.n_layers if has_bias else 0)


def test_jacobian_dla_equals_autograd_directional_derivative(traced):
    m, tr = traced
    a = m.adapter
    assert_jacobian_dla_is_autograd(a, tr, a.token_id("yes"), a.token_id("no"))


def test_source_contributions_sum_to_each_heads_output(traced):
    """Summed over sources, each head's contributions equal its residual
    component (u . W_O^h z^h at the answer position), every convention."""
    from core.methods.contributions import source_contributions

    m, tr = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))


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


def test_patterns_and_values_recomputed_from_canonical_weights(traced):
    m, tr = traced
    a = m.adapter
    positions = a.rope_positions(tr)
    assert torch.equal(positions, torch.arange(tr.input_ids.shape[1]))
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer, positions)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        v = torch.einsum("pm,hmd->phd", x, a.W_V(layer)) + a.b_V(layer)
        z = torch.einsum("hqk,khd->qhd", tr.patterns[layer][0], v)
        tol = values_tol(tr.patterns[layer][0], x, a.W_V(layer), a.b_V(layer))
        torch.testing.assert_close(z, tr.z[layer][0, tr.query_positions], atol=tol, rtol=0)
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


def test_perturbing_a_box_centre_moves_its_own_token_most(traced):
    """Geometry by experiment on a non-square image (2 x 3 tiles + global):
    inverting the pixels around a token's box centre in the ORIGINAL image
    changes that token's input to the language model more than any other
    token of its frame; for tile tokens, more than any other visual token at
    all (the global image sees the same spot at a third of the resolution)."""
    m, _ = traced
    a = m.adapter
    size = IMAGE_SIZE
    base = np.asarray(noise_image(size, 3)).copy()
    tokens = a.visual_tokens(size)
    ref = _lm_visual_inputs(m, a.prepare([Image.fromarray(base)], [QUESTION]))
    assert ref.shape[0] == len(tokens)
    per = GRID * GRID
    last = GRID - 1
    # a corner of tile (0, 0), inner tokens of tiles (0, 1), (1, 0) and (1, 2), and the
    # global image's corners and an inner token
    picks = [(0, 0, 0), (1, 1, 2), (3, 2, 1), (5, last, last), (6, 0, 0), (6, last, 0), (6, 2, 1), (6, last, last)]
    for image, r, c in picks:
        t = tokens[image * per + r * GRID + c]
        assert (t.image, t.row, t.col) == (image, r, c)
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        rx, ry = max(1, int((x1 - x0) / 5)), max(1, int((y1 - y0) / 5))
        arr = base.copy()
        arr[cy - ry : cy + ry, cx - rx : cx + rx] = 255 - arr[cy - ry : cy + ry, cx - rx : cx + rx]
        change = (_lm_visual_inputs(m, a.prepare([Image.fromarray(arr)], [QUESTION])) - ref).norm(dim=-1)
        frame = change[image * per : (image + 1) * per]
        assert int(frame.argmax()) == r * GRID + c, (t, frame.view(GRID, GRID))
        if image < 6:
            assert int(change.argmax()) == t.index, (t, change.topk(3))


def test_right_padded_batch_matches_single_runs(traced):
    """Images tiled differently (2 x 3 and 3 x 3: a zero frame pads row 0) and
    questions of different lengths: right padding, the answer position is the
    last real token, each row's next-token logits equal its own run."""
    m, _ = traced
    a = m.adapter
    images = [noise_image((100, 60), 1), noise_image((50, 50), 2)]
    questions = [QUESTION, "what color is the square of the blue circle?"]
    batch = a.prepare(images, questions)
    assert a.tokenizer.padding_side == "left"  # restored
    assert batch.tensors["pixel_values"].shape[1] == 10 and torch.all(batch.tensors["pixel_values"][0, 7] == 0)
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 0 and mask[1, -1] == 1
    logits = a.next_token_logits(batch)
    for i in range(2):
        single = a.prepare([images[i]], [questions[i]])
        assert int(batch.answer_positions[i]) == int(single.answer_positions[0]) == single.input_ids.shape[1] - 1
        assert a.token_str(int(batch.input_ids[i, batch.answer_positions[i]])) == ":"
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
    assert int(longer.input_ids[0, -1]) == yes
    with torch.no_grad():
        before, after = a.forward_logits(inputs), a.forward_logits(longer)
    tol = forwards_tol(a, before, longer.input_ids.shape[1])
    torch.testing.assert_close(after[:, :-1], before, atol=tol, rtol=0)  # causal: the prefix is unchanged


def test_question_errors(traced):
    m, _ = traced
    a = m.adapter
    with pytest.raises(QuestionError, match="empty"):
        a.check_question("  ")
    with pytest.raises(QuestionError, match="vocabulary"):
        a.check_question("is there a zebra?")
    with pytest.raises(QuestionError, match="image markup"):
        a.check_question("is there a <image> circle?")
    with pytest.raises(QuestionError, match="too long"):
        a.check_question("red " * 600)
    # short enough as text, too long once the 7 frames' tokens are in
    a.check_question("red " * 450)
    with pytest.raises(QuestionError, match="with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], ["red " * 450])


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
    assert m.model.config._attn_implementation == before


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_saved_folder_loads_with_this_adapter(tmp_path, kind):
    """load_model on a saved folder picks this adapter and runs the same model."""
    from core import load_model

    m = tiny_model_float64(kind)
    m.model.float().save_pretrained(tmp_path, safe_serialization=True)
    m.processor.save_pretrained(tmp_path)
    with num2words_stub():
        loaded = load_model(tmp_path)
    assert loaded.family == kind and type(loaded.adapter) is type(m.adapter)
    image = noise_image(IMAGE_SIZE)
    with torch.no_grad():
        want = m.adapter.next_token_logits(m.adapter.prepare([image], [QUESTION]))
        got = loaded.adapter.next_token_logits(loaded.adapter.prepare([image], [QUESTION]))
    n_keys = loaded.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    torch.testing.assert_close(got, want, atol=forwards_tol(loaded.adapter, want, n_keys), rtol=0)
    assert loaded.adapter.prompt(QUESTION) == m.adapter.prompt(QUESTION)
    assert len(loaded.adapter.visual_tokens(IMAGE_SIZE)) == 7 * GRID * GRID
