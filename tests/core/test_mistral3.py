"""Mistral 3 adapter on a tiny random float64 model (Pixtral tower, patch
merger, Mistral decoder with a sliding window that bites): every recorded
piece is checked against an independent computation (the model's own outputs,
autograd, or a recomputation from canonical weights, the adapter's RoPE and
its sliding-window mask), and the geometry by experiment."""

import functools
import math

import pytest
import torch

from core.errors import ImageLoadError, InterventionError, UnsupportedArchitectureError
from core.forward.capture import capture
from core.forward.edits import Edit
from core.models.families.mistral3 import Mistral3Adapter
from core.models.loading import LoadedModel
from tests.core.exactness import capture_every_position, noise_image, pattern_rtol, projected_visual_tokens, scores_tol

SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
WORDS = "is there a red blue circle square ? what color shape yes no of the"
# Mistral's chat template, reduced to one user turn of text and image items.
CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}[IMG]"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}[/INST]{% endif %}{% endfor %}"
)
QUESTION = "is there a red circle?"
PATCH, MERGE, LONGEST = 8, 2, 64  # 16 px merged cells; images fit 64 px (only scaled down)
WINDOW = 16  # Mistral's sliding window: shorter than the 24-token prompt, so it bites
IMAGE_SIZE = (200, 150)  # -> 64 x 48 px: 6 x 8 patches, 3 x 4 visual tokens, 3 delimiters


def tiny_tokenizer():
    """A word-level Mistral-style tokenizer built offline (BOS written by the template)."""
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
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(chat_template=CHAT_TEMPLATE):
    from transformers import PixtralImageProcessor, PixtralProcessor

    image_processor = PixtralImageProcessor(
        size={"longest_edge": LONGEST}, patch_size={"height": PATCH, "width": PATCH}
    )
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        chat_template=chat_template,
    )


def tiny_config(text_type: str = "mistral"):
    from transformers import Mistral3Config

    ids = {t: i for i, t in enumerate(SPECIAL)}
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": LONGEST,
        "patch_size": PATCH,
    }
    text = {
        "model_type": text_type,
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "sliding_window": WINDOW,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
    }
    config = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    config.architectures = ["Mistral3ForConditionalGeneration"]
    return config


def tiny_mistral3_float64(chat_template=CHAT_TEMPLATE) -> LoadedModel:
    """A random Mistral 3 built from configs: Pixtral tower (2 layers, 8 px patches,
    2-D RoPE), 2x2 patch merger, Mistral decoder (3 layers, 4 heads, 2 K/V heads,
    d_head 16, no biases, sliding window 16), float64."""
    from transformers import Mistral3ForConditionalGeneration

    from core.models import registry

    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(tiny_config()).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(chat_template)
    adapter = registry.adapter_for_hf("Mistral3ForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-mistral3", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "mistral3"):
    """``(model, trace)``: one capture, every query position kept; built once per
    session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_mistral3_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("mistral3",)  # the conformance module's cases of this file (traced_case keys)
# transformers installs output-capturing hooks on the Pixtral tower at its first forward:
# the conformance hooks check compares counts only.
LIBRARY_HOOKS = True


@pytest.fixture(scope="module")
def traced():
    return traced_case()


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"Mistral3ForConditionalGeneration": Mistral3Adapter}
DESCRIPTION = {
    "family": "mistral3",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
# 4 x 3 and 3 x 4 tokens: the same visual count, other delimiter positions per row
PADDED_BATCH = ([IMAGE_SIZE, (90, 130)], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "[/INST]"
BAD_QUESTIONS = (
    ("vocabulary", "is there a purple circle?"),
    ("too long", " ".join(["red"] * 300)),
)
PERTURB_SIZES = [IMAGE_SIZE, (90, 130)]


def check_canonical_weights(m, x) -> None:
    """No biases in Mistral's attention; W_U untied; RMSNorms with the config's eps."""
    a = m.adapter
    assert all(torch.all(b == 0) for b in (a.b_Q(1), a.b_K(1), a.b_V(1), a.b_O(1)))
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and a.W_U.shape == (a.d_model, emb.shape[0])
    assert torch.all(a.b_U == 0)
    norm = a.attn_norm(2)
    assert norm.kind == "rmsnorm" and norm.eps == 1e-6


def check_padded_batch(m, batch) -> None:
    """Both rows hold 12 visual tokens in other grids: each row's delimiters are its own."""
    a = m.adapter
    vis = a.visual_positions(batch)
    assert vis.shape == (2, 12)
    ids = batch.input_ids
    break_id, end_id = (a.vocab_id(t) for t in ("[IMG_BREAK]", "[IMG_END]"))
    assert [int((ids[i] == break_id).sum()) for i in range(2)] == [2, 3]  # rows - 1 breaks, then [IMG_END]
    assert all(int((ids[i] == end_id).sum()) == 1 for i in range(2))


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the merged, projected tokens as the decoder receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_sizes")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    assert len({t.row for t in tokens}) != len({t.col for t in tokens})  # non-square grids
    return tokens


def check_decomposition(m, tr, r) -> None:
    """embed, then per layer the heads and the MLP (no o_proj bias in Mistral)."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def _recompute_patterns(a, tr, layer: int, allowed: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(heads, pos, pos)`` from canonical weights and a.rotate under the mask
    ``allowed``, and how far (relative) the model's eager float32 softmax may be from it."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])  # (pos, d_model)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
    positions = a.rope_positions(tr)
    q, k = a.rotate(q, positions), a.rotate(k, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~allowed, float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.d_head**-0.5, True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def recompute_patterns(a, tr, layer: int) -> tuple[torch.Tensor, float]:
    """The conformance check's recomputation: RoPE at the sequence index, the adapter's mask."""
    return _recompute_patterns(a, tr, layer, a.allowed_keys(tr, layer))


def check_patterns_and_values(m, tr) -> None:
    """The mask is the sliding window's, and it bites: plain causal gives other patterns,
    and the answer row weights no key ``WINDOW`` or more behind it."""
    a = m.adapter
    n = tr.input_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = a.allowed_keys(tr, 1)
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    assert torch.equal(allowed, causal & (j > i - WINDOW)) and n > WINDOW
    full, _ = _recompute_patterns(a, tr, 1, causal)
    assert (full[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-3
    answer = int(tr.answer_positions[0])
    assert torch.equal(torch.as_tensor(tr.query_positions), torch.arange(n))  # row i is position i
    for layer in range(a.n_layers):
        row = tr.patterns[layer][0][:, answer]
        assert torch.all(row[:, : answer - WINDOW + 1] == 0) and torch.all(row[:, answer - WINDOW + 1 :] > 0)


# ---- roles and geometry


def test_delimiters_close_each_token_row(traced):
    """[IMG_BREAK] follows each row of ``cols`` [IMG] tokens, [IMG_END] the last row;
    they are delimiters (their own embeddings, no patch), the [IMG] tokens visual, in
    the row-major order of visual_tokens."""
    m, tr = traced
    a = m.adapter
    toks = a.tokenizer.convert_ids_to_tokens(tr.input_ids[0].tolist())
    vis = tr.visual_positions[0].tolist()
    tokens = a.visual_tokens(IMAGE_SIZE, vis)
    rows, cols = tokens[-1].row + 1, tokens[-1].col + 1
    assert (rows, cols) == (3, 4) and [t.position for t in tokens] == vis
    start = vis[0]
    want = (["[IMG]"] * cols + ["[IMG_BREAK]"]) * rows
    want[-1] = "[IMG_END]"
    assert toks[start : start + len(want)] == want
    delim = a.visual_delimiter_positions(tr)
    assert delim == [start + (r + 1) * (cols + 1) - 1 for r in range(rows)]
    for t in tokens:
        assert t.position == start + t.row * (cols + 1) + t.col
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles.count("visual") == rows * cols
    assert [roles[i] for i in delim] == ["visual_delimiter"] * rows
    assert roles[toks.index("red")] == "text"


def test_patch_merger_merges_row_major_blocks(traced):
    """Projector token ``(r, c)`` reads exactly patches ``(2r + a, 2c + b)``: changing one
    patch's vision feature changes that token's output and no other, bitwise."""
    m, _ = traced
    a = m.adapter
    rows, cols, rh, rw = a.visual_grid(IMAGE_SIZE)
    sizes = torch.tensor([[rh, rw]])
    pr, pc = rh // PATCH, rw // PATCH
    torch.manual_seed(1)
    x = torch.randn(pr * pc, 32, dtype=torch.float64)
    projector = m.model.model.multi_modal_projector
    with torch.no_grad():
        ref = projector(x, sizes)
        assert ref.shape == (rows * cols, a.d_model)
        for p in (0, 9, pc * pr - 1, 2 * pc + 5):
            y = x.clone()
            y[p] += 1.0
            changed = (projector(y, sizes) != ref).any(-1).nonzero().flatten().tolist()
            r, c = divmod(p, pc)
            assert changed == [(r // MERGE) * cols + c // MERGE], p


@pytest.mark.parametrize("size", [(200, 150), (90, 130), (40, 30), (64, 64), (600, 100), (17, 65)])
def test_visual_token_count_follows_the_resize(traced, size):
    """The processor's [IMG] count, its resized size, the model's merged features and
    visual_tokens agree; the boxes tile the original image row-major."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    inputs = a.prepare([image], [QUESTION])
    rows, cols, rh, rw = a.visual_grid(size)
    assert inputs.tensors["image_sizes"][0].tolist() == [rh, rw]
    assert rh % (PATCH * MERGE) == 0 and rw % (PATCH * MERGE) == 0 and max(rh, rw) <= LONGEST + PATCH * MERGE
    tokens = a.visual_tokens(size)
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    assert len(tokens) == n == rows * cols == visual_inputs(m, image).shape[0]
    assert [(t.row, t.col) for t in tokens] == [divmod(i, cols) for i in range(n)]
    assert tokens[0].box[:2] == [0.0, 0.0] and tokens[-1].box[2:] == pytest.approx(list(size))
    for t, nxt in zip(tokens, tokens[1:]):
        if nxt.row == t.row:
            assert nxt.box[0] == pytest.approx(t.box[2]) and nxt.box[1] == t.box[1]
        else:
            assert nxt.box[1] == pytest.approx(t.box[3]) and nxt.box[0] == 0.0
    assert a.resized_pixels(size)[0] == rh * rw


def test_an_image_resized_to_no_row_is_refused(traced):
    """600 x 4 px scaled into 64 px floors its height to 0: a one-line ImageLoadError,
    not the processor's crash; a 3-pixel-high image is read channels-last, not as channels."""
    m, _ = traced
    with pytest.raises(ImageLoadError, match="600x4 image to 64x0"):
        m.adapter.prepare([noise_image((600, 4))], [QUESTION])
    assert m.adapter.visual_grid((20, 3)) == (1, 2, 16, 32)


# ---- text, refusals


def test_prompt_template_and_fallback_agree(traced):
    m, _ = traced
    a = m.adapter
    assert a.prompt(QUESTION) == a.fallback_prompt.format(question=QUESTION)
    bare = tiny_mistral3_float64(chat_template=None)
    assert bare.adapter.prompt(QUESTION) == a.prompt(QUESTION)


def test_visual_feature_sites_are_refused(traced):
    """The projector merges every image's patches flattened: no per-token site to edit."""
    m, _ = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=site):
            capture(m, None, "", inputs=inputs, edits=[Edit(None, site=site)])
        with pytest.raises(InterventionError, match="flattened"):
            m.adapter.visual_site_module(site)


def test_ministral3_decoder_is_refused():
    """Ministral 3 scales its queries by position (llama-4 scaling): not the canonical q."""
    with pytest.raises(UnsupportedArchitectureError, match="ministral3"):
        Mistral3Adapter.check_config(tiny_config("ministral3"))
