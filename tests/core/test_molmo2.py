"""Molmo 2 adapter on a tiny random float64 model (a 2-layer ViT over a global
view and overlapping crops, the attention-pooling adapter, a Qwen3-style decoder
with per-head q/k norms), with the real Molmo2Processor: every recorded piece is
checked against an independent computation (the model's own outputs, or a
recomputation from canonical weights with q/k norms, RoPE and the image block's
bidirectional mask built here), and the geometry by experiment."""

import functools
import math

import pytest
import torch

from core.errors import InterventionError, UnsupportedArchitectureError
from core.forward.capture import capture
from core.forward.edits import Edit
from core.models.families.molmo2 import Molmo2Adapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    capture_every_position,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    realized_scores_tol,
)

SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<im_patch>",
    "<im_col>",
    "<im_start>",
    "<low_res_im_start>",
    "<frame_start>",
    "<im_end>",
    "<frame_end>",
    "<im_low>",
    "<|image|>",
    "<|video|>",
)
WORDS = "user assistant is there a red blue circle square ? what color shape yes no of the"
# Molmo 2's chat template reduced to one user turn of image and text items (the processor adds the BOS).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"
SIDE, PATCH, POOL = 16, 4, 2  # global view 16 x 16 px: 4 x 4 patches pooled 2 x 2 into 2 x 2 tokens
IMAGE_SIZE = (90, 60)  # 2 x 2 crops on a 24 x 24 px canvas: 6 x 6 patches, 3 x 3 tokens (odd: edge windows)
N_VISUAL = 4 + 9


def tiny_tokenizer():
    """A word-level Qwen-style tokenizer built offline with Molmo 2's image markup tokens."""
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
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
    )


def tiny_processor(chat_template=CHAT_TEMPLATE):
    from transformers import Molmo2ImageProcessor, Molmo2Processor, Molmo2VideoProcessor

    image_processor = Molmo2ImageProcessor(
        size={"height": SIDE, "width": SIDE},
        patch_size=PATCH,
        pooling_size=[POOL, POOL],
        max_crops=4,
        overlap_margins=[1, 1],
    )
    return Molmo2Processor(
        image_processor=image_processor,
        video_processor=Molmo2VideoProcessor(),
        tokenizer=tiny_tokenizer(),
        chat_template=chat_template,
    )


def tiny_config(**text_extra):
    from transformers import Molmo2Config

    ids = {t: i for i, t in enumerate(SPECIAL)}
    head = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}
    text = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "additional_vocab_size": 0,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        **text_extra,
    }
    config = Molmo2Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            **head,
            "image_size": [SIDE, SIDE],
            "patch_size": PATCH,
        },  # fmt: skip
        adapter_config={
            "vision_feature_layer": [-1, 0],
            "hidden_size": 32,
            "intermediate_size": 48,
            "text_hidden_size": 64,
            **head,
        },  # fmt: skip
        text_config=text,
        image_start_token_id=ids["<im_start>"],
        low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"],
        image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"],
        frame_end_token_id=ids["<frame_end>"],
    )
    config.architectures = ["Molmo2ForConditionalGeneration"]
    return config


def tiny_molmo2_float64(chat_template=CHAT_TEMPLATE) -> LoadedModel:
    """A random Molmo 2 built from configs: ViT (2 layers, 4 px patches), the
    pooling adapter over layers [-1, 0], a decoder of 3 layers (4 heads, 2 K/V
    heads, d_head 16, per-head q/k norms), float64."""
    from transformers import Molmo2ForConditionalGeneration

    from core.models import registry

    torch.manual_seed(0)
    model = Molmo2ForConditionalGeneration(tiny_config()).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                         layer.self_attn.k_norm):  # fmt: skip
                norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(chat_template)
    adapter = registry.adapter_for_hf("Molmo2ForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-molmo2", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "molmo2"):
    """``(model, trace)``: one capture, every query position kept; built once per session."""
    m = tiny_molmo2_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("molmo2",)
# transformers installs output-capturing hooks on the ViT and the pooling adapter at their first forward
LIBRARY_HOOKS = True


@pytest.fixture(scope="module")
def traced():
    return traced_case()


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Molmo2ForConditionalGeneration": Molmo2Adapter}
DESCRIPTION = {
    "family": "molmo2",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
# the same 2 x 2 tiling (13 visual tokens), questions of other lengths
PADDED_BATCH = ([IMAGE_SIZE, (40, 30)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "assistant"
BAD_QUESTIONS = (
    ("vocabulary", "is there a purple circle?"),
    ("too long", " ".join(["red"] * 300)),
)
PERTURB_SIZES = [IMAGE_SIZE, (100, 50)]  # a 1 x 3 tiling: a 2 x 4 canvas grid


def check_canonical_weights(m, x) -> None:
    """No biases in the decoder's attention; W_U untied; RMSNorms with the config's eps."""
    a = m.adapter
    assert all(torch.all(b == 0) for b in (a.b_Q(1), a.b_K(1), a.b_V(1), a.b_O(1)))
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and a.W_U.shape == (a.d_model, emb.shape[0])
    assert a.attn_norm(2).kind == "rmsnorm" and a.attn_norm(2).eps == 1e-6


def check_padded_batch(m, batch) -> None:
    """Both rows hold 13 visual tokens; each row's image block is its own."""
    vis = m.adapter.visual_positions(batch)
    assert vis.shape == (2, N_VISUAL)
    types = batch.tensors["mm_token_type_ids"]
    assert (
        int(types[0].sum()) == int(types[1].sum()) == N_VISUAL + 2 * 2 + 2 + 3
    )  # patches, starts and ends, one <im_col> a row


def pooled_features(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the adapter's pooled, projected features (global view first)."""
    names = ("pixel_values", "image_token_pooling", "image_grids", "image_num_crops")
    return projected_visual_tokens(m, image, QUESTION, *names)


def visual_inputs(m, image) -> torch.Tensor:
    """What block 0 reads at a visual position: the ``<im_patch>`` embedding plus the pooled feature."""
    patch = m.model.model.language_model.embed_tokens.weight[m.model.config.image_patch_id]
    return patch + pooled_features(m, image)


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (pooled_features(m, image),)


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    """The tokens of its own view: the other view sees the same spot too."""
    return [torch.tensor([u.index for u in tokens if u.image == t.image])]


def check_decomposition(m, tr, r) -> None:
    """embed, then per layer the heads and the MLP (no o_proj bias)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def image_block_mask(types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(pos, keys)``: the model's rule written out: causal, or both in the image block; real keys only."""
    n = types.shape[0]
    image = types == 1
    return (torch.ones(n, n, dtype=torch.bool).tril() | (image[:, None] & image[None, :])) & mask.bool()[None, :]


def _recompute_patterns(a, tr, layer: int, allowed: torch.Tensor, qk_norm: bool = True):
    """``(heads, pos, pos)`` from canonical weights, the q/k RMSNorms by their formula,
    RoPE at the sequence index and ``allowed``; and the relative tolerance."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer))
    if qk_norm:
        attn, eps = a._attn(layer), a.text_config.rms_norm_eps
        q = attn.q_norm.weight * q * (q.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        k = attn.k_norm.weight * k * (k.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    positions = torch.arange(tr.input_ids.shape[1])
    q, k = a.rotate(q, positions, layer), a.rotate(k, positions, layer)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1), pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, layer))


def recompute_patterns(a, tr, layer: int) -> tuple[torch.Tensor, float]:
    types, mask = tr.token_type_ids[0].cpu(), tr.attention_mask[0].cpu()
    return _recompute_patterns(a, tr, layer, image_block_mask(types, mask))


def check_patterns_and_values(m, tr) -> None:
    """The mask is not causal and it bites; the q/k norms count."""
    a = m.adapter
    n = tr.input_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = a.allowed_keys(tr, 1)
    assert torch.equal(allowed, image_block_mask(tr.token_type_ids[0].cpu(), tr.attention_mask[0].cpu()))
    assert not torch.equal(allowed, causal)
    for other in (_recompute_patterns(a, tr, 1, causal)[0], _recompute_patterns(a, tr, 1, allowed, False)[0]):
        assert (other[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3
    first = int(tr.visual_positions[0][0])  # the first patch reads the image block's last token
    last_image = int(tr.token_type_ids[0].nonzero().max())
    assert torch.all(tr.patterns[1][0][:, first, last_image] > 0)


# ---- roles and geometry


def test_markup_and_token_layout(traced):
    """<low_res_im_start>, (<im_patch>*cols <im_col>)*rows, <im_end>, then the canvas
    the same way: visual_tokens' views, rows and columns are the positions' order;
    the markup tokens are delimiters and in the bidirectional block."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    vis = tr.visual_positions[0].tolist()
    tokens = a.visual_tokens(IMAGE_SIZE, vis)
    assert len(tokens) == N_VISUAL and [t.position for t in tokens] == vis
    want = []
    for start, rows, cols in (("<low_res_im_start>", 2, 2), ("<im_start>", 3, 3)):
        want += [start] + (["<im_patch>"] * cols + ["<im_col>"]) * rows + ["<im_end>"]
    begin = toks.index("<low_res_im_start>")
    assert toks[begin : begin + len(want)] == want
    for t in tokens:
        offset = 0 if t.image == 0 else 2 * 3 + 2
        cols = 2 if t.image == 0 else 3
        assert t.position == begin + offset + 1 + t.row * (cols + 1) + t.col
    delim = a.visual_delimiter_positions(tr)
    assert [toks[i] for i in delim] == [w for w in want if w != "<im_patch>"]
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles.count("visual") == N_VISUAL and roles[toks.index("red")] == "text"
    assert tr.token_type_ids[0].nonzero().flatten().tolist() == list(range(begin, begin + len(want)))


@pytest.mark.parametrize("size", [(90, 60), (100, 50), (120, 40), (20, 20), (30, 80)])
def test_visual_tokens_follow_the_processor(traced, size):
    """The processor's <im_patch> count and grids, the model's pooled features and
    visual_tokens agree; each view's boxes tile the original image row-major, edge
    windows of an odd grid half as wide; every box is the union of the patches the
    processor's pooling indices name."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    inputs = a.prepare([image], [QUESTION])
    tokens = a.visual_tokens(size)
    grid = inputs.tensors["image_grids"][0].tolist()
    n = int((inputs.input_ids == m.model.config.image_patch_id).sum())
    assert len(tokens) == n == grid[0] * grid[1] + grid[2] * grid[3] == pooled_features(m, image).shape[0]
    for view, (rows, cols) in enumerate((grid[:2], grid[2:])):
        own = [t for t in tokens if t.image == view]
        assert [(t.row, t.col) for t in own] == [divmod(i, cols) for i in range(rows * cols)]
        assert own[0].box[:2] == [0.0, 0.0] and own[-1].box[2:] == pytest.approx(list(size))
        for t, nxt in zip(own, own[1:]):
            if nxt.row == t.row:
                assert nxt.box[0] == pytest.approx(t.box[2])
            else:
                assert nxt.box[1] == pytest.approx(t.box[3]) and nxt.box[0] == 0.0
    # the boxes against the processor's own pooling indices (patch ids, crop by crop)
    pooling = inputs.tensors["image_token_pooling"]
    views = a.view_grids(size)
    for t, idx in zip(tokens, pooling):
        vh, vw = views[t.image]
        if t.image == 0:
            cells = [divmod(int(i), SIDE // PATCH) for i in idx if i >= 0]
        else:
            cells = _canvas_cells(size, idx)
        ys, xs = [r for r, _ in cells], [c for _, c in cells]
        sx, sy = size[0] / vw, size[1] / vh
        want = [min(xs) * PATCH * sx, min(ys) * PATCH * sy, (max(xs) + 1) * PATCH * sx, (max(ys) + 1) * PATCH * sy]
        assert t.box == pytest.approx(want)


def _canvas_cells(size, idx) -> list[tuple[int, int]]:
    """Canvas patch ``(row, col)`` of each crop patch id the processor pools: crop
    ``k = (ty, tx)`` starts at canvas patch ``(ty * window, tx * window)``."""
    from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry

    per_side = SIDE // PATCH
    window = per_side - 2  # overlap margins 1 + 1
    tiling_w = compute_crop_geometry(size[1], size[0], 4, [1, 1], SIDE, PATCH)[1]
    cells = []
    for i in idx.tolist():
        if i < 0:
            continue
        crop, within = divmod(i - per_side * per_side, per_side * per_side)
        (ty, tx), (r, c) = divmod(crop, tiling_w), divmod(within, per_side)
        cells.append((ty * window + r, tx * window + c))
    return cells


# ---- text, refusals


def test_prompt_template_and_fallback_agree(traced):
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = tiny_molmo2_float64(chat_template=None)
    assert bare.adapter.prompt(QUESTION) == a.prompt(QUESTION)


def test_visual_feature_sites_are_refused(traced):
    m, _ = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=site):
            capture(m, None, "", inputs=inputs, edits=[Edit(None, site=site)])


@pytest.mark.parametrize("extra, match", [({"qk_norm_type": "olmo"}, "olmo"), ({"norm_after": True}, "norm_after")])
def test_unmapped_decoders_are_refused(extra, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        Molmo2Adapter.check_config(tiny_config(**extra))


def test_rotate_needs_the_block_where_layers_rotate_differently(traced):
    """Scaled RoPE on layer 0 only: rotate follows each layer's table and refuses to guess."""
    from transformers import Molmo2ForConditionalGeneration

    m, _ = traced
    scaled = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    model = Molmo2ForConditionalGeneration(tiny_config(rope_parameters=scaled, rope_scaling_layers=[0])).double()
    a = Molmo2Adapter(model, m.processor, m.tokenizer)
    x, p = torch.randn(5, 4, 16, dtype=torch.float64), torch.arange(5) + 3
    with pytest.raises(ValueError, match="needs the block"):
        a.rotate(x, p)
    assert not torch.allclose(a.rotate(x, p, 0), a.rotate(x, p, 1))
    assert torch.equal(a.rotate(x, p, 1), m.adapter.rotate(x, p))  # unscaled: the default table
