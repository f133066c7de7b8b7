"""LLaVA-OneVision adapter on a tiny random float64 model (SigLIP tower, Qwen2
decoder, the real LlavaOnevisionProcessor): every recorded piece is checked
against an independent computation (the model's own outputs, autograd, or a
recomputation from canonical weights and the adapter's RoPE), the anyres-max
resampling against a bilinear mix built from the tokens' boxes, and the
geometry by experiment (pixels perturbed in the original image move the token
whose box holds them)."""

import functools

import pytest
import torch

from core.errors import InterventionError, ModelLoadError, QuestionError
from core.forward.capture import capture
from core.forward.edits import Edit
from core.models.families.llava_next import LlavaNextAdapter
from core.models.families.llava_onevision import LlavaOnevisionAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import capture_every_position, noise_image, projected_visual_tokens
from tests.core.test_llava_next import recompute_patterns  # noqa: F401 (the conformance hook: RoPE, causal mask)
from tests.tolerances import rounding_tol

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>", "<unk>")
WORDS = "user assistant is there a red blue circle square ? what color shape yes no of the"
# llava-onevision-qwen2's chat template, reduced to text and image items.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ '\n' + item['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"
TILE, PATCH = 32, 8  # SigLIP tower: 32 px images, a 4 x 4 patch grid
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32], [64, 96], [96, 64]]  # (height, width)
ASPECT = "anyres_max_2"  # at most about 2 tiles' worth of high-res tokens: larger maps are resampled
# 2 x 3 tiles (8 x 12 features), unpadded to 6 x 12, resampled to 4 x 8 (ratio 1.5): 16 + 4 * 9 tokens.
IMAGE_SIZE = (90, 50)
SMALL_SIZE = (60, 20)  # 1 x 2 tiles (4 x 8 features), unpadded to 2 x 8, not resampled


def tiny_tokenizer():
    """A word-level Qwen-style tokenizer built offline (no BOS; ``<image>`` special)."""
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
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor(chat_template=CHAT_TEMPLATE):
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    size = {"height": TILE, "width": TILE}
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        tokenizer=tiny_tokenizer(),
        num_image_tokens=(TILE // PATCH) ** 2,  # SigLIP: no CLS
        vision_feature_select_strategy="full",
        vision_aspect_ratio=ASPECT,
        chat_template=chat_template,
    )


def tiny_config(**extra):
    from transformers import LlavaOnevisionConfig

    ids = {t: i for i, t in enumerate(SPECIAL)}
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
    text = {
        "model_type": "qwen2",
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    fields = {
        "image_token_index": ids["<image>"],
        "video_token_index": ids["<video>"],
        "image_grid_pinpoints": PINPOINTS,
        "vision_aspect_ratio": ASPECT,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
    }
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, **{**fields, **extra})
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    return config


def tiny_onevision_float64(chat_template=CHAT_TEMPLATE) -> LoadedModel:
    """A random LLaVA-OneVision built from a config: SigLIP tower (2 layers, 32 px,
    8 px patches), Qwen2 decoder (3 layers, 4 heads, 2 K/V heads, d_head 16, q/k/v
    biases, no o_proj bias), untied unembedding, float64."""
    from transformers import LlavaOnevisionForConditionalGeneration

    from core.models import registry

    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(tiny_config()).double().eval()
    with torch.no_grad():  # the init zeroes biases and sets norm gains to 1: make them count
        for layer in model.model.language_model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                proj.bias.normal_(0, 0.5)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.3)
        model.model.language_model.norm.weight.normal_(1, 0.3)
    processor = tiny_processor(chat_template)
    adapter = registry.adapter_for_hf("LlavaOnevisionForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-llava-onevision", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "llava_onevision"):
    """``(model, trace)``: one capture, every query position kept; built once per
    session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_onevision_float64()
    image = noise_image(IMAGE_SIZE)
    tr, inputs = capture_every_position(m, image, QUESTION)
    return m, tr


CASES = ("llava_onevision",)  # the conformance module's cases of this file (traced_case keys)
JACOBIAN_COMPONENTS = (0, 1, 4, 5, 6, 14)  # autograd per component is slow here
LIBRARY_HOOKS = True  # transformers keeps hooks of its own on this model: compare counts only


@pytest.fixture(scope="module")
def traced():
    return traced_case()


def image_features(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the image's tokens as the decoder receives them (packed, resampled)."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values", "image_sizes")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"LlavaOnevisionForConditionalGeneration": LlavaOnevisionAdapter}
DESCRIPTION = {
    "family": "llava_onevision",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "attention_kind": "self",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
PADDED_BATCH = ([SMALL_SIZE, IMAGE_SIZE], [QUESTION, "what color is the square of the blue circle?"])
ANSWER_TOKEN = "assistant"
BAD_QUESTIONS = (("vocabulary", "is there a purple circle?"), ("too long", " ".join(["red"] * 300)))
PERTURB_SIZES = [IMAGE_SIZE, (50, 90), SMALL_SIZE]
PERTURB_SEED, PERTURB_SHRINK = 4, 6


def check_canonical_weights(m, x) -> None:
    """q/k/v biases present, no o_proj bias (b_O zero); W_U untied; RMSNorms with the config's eps."""
    a = m.adapter
    assert a.b_Q(1).abs().sum() > 0 and a.b_K(1).abs().sum() > 0 and a.b_V(1).abs().sum() > 0
    assert a._attn(1).o_proj.bias is None and torch.all(a.b_O(1) == 0)
    emb = a.language_model.embed_tokens.weight
    assert a.W_U.data_ptr() != emb.data_ptr() and torch.all(a.b_U == 0)
    norm = a.attn_norm(2)
    assert norm.kind == "rmsnorm" and norm.eps == 1e-6


def check_padded_batch(m, batch) -> None:
    with pytest.raises(ValueError, match="different numbers of visual tokens"):
        m.adapter.visual_positions(batch)


def check_question_errors(m, monkeypatch) -> None:
    a = m.adapter
    # fits with the base image alone but not with the high-res tokens: prepare sees the real count
    n = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids.shape[1]
    monkeypatch.setattr(a, "max_positions", lambda: n - 1)
    a.check_question(QUESTION)
    with pytest.raises(QuestionError, match=f"{n} tokens with the image"):
        a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])


def check_decomposition(m, tr, r) -> None:
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)  # embed; per layer heads, mlp (no o_proj bias)


visual_inputs = image_features


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (image_features(m, image),)


def perturbation_probes(m, size, tokens) -> list:
    """Every token (not a newline) whose box centre lies inside the image."""
    w, h = size
    probes = []
    for t in tokens:
        x0, y0, x1, y1 = t.box
        if t.col >= 0 and 0 <= int((x0 + x1) / 2) < w and 0 <= int((y0 + y1) / 2) < h:
            probes.append(t)
    lay = m.adapter.anyres_layout(size)
    n_hi = sum(t.image == 1 for t in probes)
    assert len(probes) - n_hi == lay.n_base and n_hi >= lay.rows * lay.cols - 2 * max(lay.rows, lay.cols)
    return probes


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    return [torch.tensor([u.index for u in tokens if u.image == t.image and u.col >= 0])]  # its view's tokens


def check_perturbation(tokens, t, changes) -> None:
    """Every newline token exactly unchanged."""
    (change,) = changes
    assert torch.all(change[torch.tensor([u.index for u in tokens if u.col < 0])] == 0)


# ------------------------------------------------------------ anyres-max


def bilinear_weights(n_in: int, n_out: int) -> torch.Tensor:
    """``(n_out, n_in)``: resampling ``n_in`` features to ``n_out`` by sampling each
    output cell's centre (the box centre) and mixing the two nearest features."""
    w = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        x = max((i + 0.5) * n_in / n_out - 0.5, 0.0)  # in feature-centre coordinates
        j = int(x)
        w[i, j] += 1 - (x - j)
        w[i, min(j + 1, n_in - 1)] += x - j
    return w


@pytest.mark.parametrize("size", [IMAGE_SIZE, (50, 90), (40, 40), SMALL_SIZE, (100, 40)])
def test_high_res_tokens_are_the_bilinear_mix_of_the_unpadded_map(traced, size):
    """The tower's tile features (adapter.vision_features, project_visual) laid
    side by side, cut to the layout's unpadded window and mixed with the bilinear
    weights of the token cells are the model's high-res tokens; the base tokens
    are the base tile's, the newlines the model's image_newline."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size, 5)
    inputs = a.prepare([image], [QUESTION])
    lay = a.anyres_layout(size)
    n_tiles = lay.tiles[0] * lay.tiles[1]
    with torch.no_grad():
        feats = a.project_visual(a.vision_features(inputs.tensors["pixel_values"][0, : 1 + n_tiles]))
        got = image_features(m, image)
    g, d = lay.grid, feats.shape[-1]
    full = feats[1:].view(*lay.tiles, g, g, d).permute(0, 2, 1, 3, 4).reshape(lay.tiles[0] * g, lay.tiles[1] * g, d)
    (r0, c0), (ur, uc) = lay.keep, lay.unpadded
    unpadded = full[r0 : r0 + ur, c0 : c0 + uc]
    want = torch.einsum("ri,cj,ijd->rcd", bilinear_weights(ur, lay.rows), bilinear_weights(uc, lay.cols), unpadded)
    newline = torch.tensor(lay.newline_indices())
    hi = torch.tensor([i for i in range(lay.n_base, lay.n_tokens) if i not in set(newline.tolist())])
    assert got.shape[0] == lay.n_tokens == len(a.visual_tokens(size))
    torch.testing.assert_close(got[: lay.n_base], feats[0], atol=0, rtol=0)
    torch.testing.assert_close(got[newline], m.model.model.image_newline.expand(len(newline), d), atol=0, rtol=0)
    # the sample point (i + 1/2) in / out - 1/2 is rounded a few times at size up to in: each
    # weight is off by a few u * in; four weighted terms of at most max|f| each
    tol = rounding_tol(4 * unpadded.abs().max(), torch.float64, 4 * max(ur, uc) + 8)
    torch.testing.assert_close(got[hi], want.reshape(-1, d), atol=tol, rtol=0)
    resampled = (lay.rows, lay.cols) != lay.unpadded
    assert resampled == (size != SMALL_SIZE)  # not vacuous: resampled and plain maps are both checked
    if resampled:
        assert (got[hi] - unpadded[: lay.rows, : lay.cols].reshape(-1, d)).abs().max() > 1e-3


@pytest.mark.parametrize("size", [IMAGE_SIZE, (50, 90), (40, 40), SMALL_SIZE, (20, 60), (33, 70), (130, 30)])
def test_token_count_and_boxes_follow_the_layout(traced, size):
    """The processor's <image> count, the model's packed feature count and
    visual_tokens agree; high-res boxes tile the unpadded canvas row-major; without
    resampling they are LLaVA-NeXT's boxes; each token's tile holds its box centre."""
    m, _ = traced
    a = m.adapter
    image = noise_image(size)
    inputs = a.prepare([image], [QUESTION])
    n = int((inputs.input_ids == m.model.config.image_token_id).sum())
    tokens = a.visual_tokens(size)
    assert len(tokens) == n == image_features(m, image).shape[0]
    lay = a.anyres_layout(size)
    assert inputs.tensors["pixel_values"].shape[1] == 1 + lay.tiles[0] * lay.tiles[1]
    assert [t.index for t in tokens if t.col < 0] == lay.newline_indices()
    hi = [t for t in tokens[lay.n_base :] if t.col >= 0]
    assert [(t.row, t.col) for t in hi] == [divmod(i, lay.cols) for i in range(lay.rows * lay.cols)]
    for t, nxt in zip(hi, hi[1:]):
        if nxt.row == t.row:
            assert nxt.box[0] == pytest.approx(t.box[2]) and nxt.box[1] == pytest.approx(t.box[1])
        else:
            assert nxt.box[1] == pytest.approx(t.box[3])
    # resampled or not, the cells cover the unpadded map, which unpad_image cut on whole
    # features: it may reach into the padding, or drop a partly covered edge, by less than a patch
    w, h = size
    tol_x, tol_y = PATCH * w / lay.resized[1], PATCH * h / lay.resized[0]
    assert abs(hi[0].box[0]) < tol_x and abs(hi[0].box[1]) < tol_y
    assert abs(hi[-1].box[2] - w) < tol_x and abs(hi[-1].box[3] - h) < tol_y
    for t in hi:  # the tile, from the box centre mapped back onto the canvas
        (rh, rw), (top, left) = lay.resized, lay.pad
        cx = ((t.box[0] + t.box[2]) / 2) * rw / size[0] + left
        cy = ((t.box[1] + t.box[3]) / 2) * rh / size[1] + top
        assert t.tile == 1 + int(cy // TILE) * lay.tiles[1] + int(cx // TILE)
    if (lay.rows, lay.cols) == lay.unpadded:
        assert tokens == LlavaNextAdapter.visual_tokens(a, size)


def test_newline_tokens_are_delimiters(traced):
    """The newline tokens (col = -1) end each resampled row, hold exactly the
    model's image_newline embedding, and are labelled visual_delimiter."""
    m, tr = traced
    a = m.adapter
    vis = tr.visual_positions[0].tolist()
    tokens = a.visual_tokens(IMAGE_SIZE, vis)
    lay = a.anyres_layout(IMAGE_SIZE)
    assert (lay.unpadded, lay.rows, lay.cols, lay.keep, lay.tiles) == ((6, 12), 4, 8, (1, 0), (2, 3))
    newline = [t for t in tokens if t.col == -1]
    assert len(newline) == lay.rows and [t.position for t in newline] == a.visual_delimiter_positions(tr)
    assert all(t.image == 1 and t.tile is None and t.box[0] == t.box[2] == int(t.box[0]) for t in newline)
    x0 = tr.resid_pre[0][0, [t.position for t in newline]]
    torch.testing.assert_close(x0, m.model.model.image_newline.expand_as(x0), atol=0, rtol=0)
    roles = a.token_roles(tr)
    for t in tokens:
        assert roles[t.position] == ("visual_delimiter" if t.col == -1 else "visual")
    assert roles.count("visual") == len(tokens) - len(newline)


# ------------------------------------------------------------ text, errors, sites


def test_prompt_template_and_fallback(traced):
    m, _ = traced
    expected = f"<|im_start|>user <image>\n{QUESTION}<|im_end|><|im_start|>assistant\n"
    assert m.adapter.prompt(QUESTION) == expected
    assert tiny_onevision_float64(chat_template=None).adapter.prompt(QUESTION) == expected  # the documented fallback


def test_projector_sites_are_refused(traced):
    """The projector runs per tile before unpadding and resampling: no visual-token site there."""
    m, _ = traced
    inputs = m.adapter.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    for site in ("vision_out", "projector_out"):
        with pytest.raises(InterventionError, match=f"no '{site}' edit site"):
            capture(m, None, "", inputs=inputs, edits=[Edit(None, None, (0,), site=site)])


def test_configs_and_processors_it_does_not_map_are_refused(traced):
    m, _ = traced
    for extra, field in (
        ({"vision_aspect_ratio": "anyres"}, "vision_aspect_ratio"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
    ):
        with pytest.raises(ModelLoadError, match=field):
            LlavaOnevisionAdapter.check_config(tiny_config(**extra))
    sliding = tiny_config()
    sliding.text_config.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(ModelLoadError, match="sliding"):
        LlavaOnevisionAdapter.check_config(sliding)
    other = tiny_onevision_float64()
    other.processor.vision_aspect_ratio = "anyres_max_9"
    with pytest.raises(ValueError, match="vision_aspect_ratio"):
        other.adapter.visual_tokens(IMAGE_SIZE)
