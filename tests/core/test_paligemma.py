"""PaliGemma adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (a plain forward of the library
model, autograd, or a recomputation from canonical weights with the adapter's
RoPE, 1-indexed positions and prefix-LM mask), and the geometry by experiment
on a stretched (non-square) image."""

import functools
import math

import pytest
import torch

from core.errors import UnsupportedArchitectureError
from core.forward.capture import capture
from core.methods.residual import decompose, target_direction
from core.models.families.paligemma import PaliGemmaAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    forwards_tol,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    scores_tol,
    unembedding_tol,
)
from tests.tolerances import rounding_tol, sum_tol

SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
WORDS = "answer en is there a red blue circle square ? what color shape yes no of the"
QUESTION = "answer en is there a red circle?"
IMAGE_SIDE, PATCH = 48, 8  # 6 x 6 = 36 visual tokens
IMAGE_SIZE = (90, 60)  # non-square: the resize stretches it
D_MODEL = 64


def tiny_tokenizer():
    """A word-level Gemma-style tokenizer built offline: <pad> <eos> <bos>
    <unk> <image> and "\\n" (PaliGemma's prompt terminator) as tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab["\n"] = len(vocab)
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens([AddedToken("\n", normalized=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_processor():
    """PaliGemma's processor (it adds the 1024 <locXXXX> and 128 <segXXX> tokens)
    over the tiny tokenizer and a SigLIP image processor resizing to 48 x 48."""
    from transformers import PaliGemmaProcessor, SiglipImageProcessor

    ip = SiglipImageProcessor(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}, image_seq_length=(IMAGE_SIDE // PATCH) ** 2
    )
    return PaliGemmaProcessor(image_processor=ip, tokenizer=tiny_tokenizer())


def tiny_config(text_kind: str = "gemma", **text_extra):
    from transformers import PaliGemmaConfig

    processor = tiny_processor()
    n_vocab = len(processor.tokenizer)
    text = {
        "model_type": text_kind,
        "vocab_size": n_vocab,
        "hidden_size": D_MODEL,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        **text_extra,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,  # one global-attention layer: a random tower's mixing stays below the local change
        "num_attention_heads": 4,
        "image_size": IMAGE_SIDE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=processor.image_token_id,
        projection_dim=D_MODEL,
        hidden_size=D_MODEL,
        vocab_size=n_vocab,
    )
    config.architectures = ["PaliGemmaForConditionalGeneration"]
    return config, processor


def tiny_paligemma_float64() -> LoadedModel:
    """A random PaliGemma (Gemma 1 decoder, grouped-query heads, d_head 16) in float64."""
    from transformers import PaliGemmaForConditionalGeneration

    from core.models import registry

    config, processor = tiny_config()
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # Gemma initialises its (1 + w) norm weights to 0: make them count
        lm = model.model.language_model
        for layer in lm.layers:
            layer.input_layernorm.weight.normal_(0, 0.3)
            layer.post_attention_layernorm.weight.normal_(0, 0.3)
        lm.norm.weight.normal_(0, 0.3)
    adapter = registry.adapter_for_hf("PaliGemmaForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-paligemma", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def tiny_model() -> LoadedModel:
    """The tiny PaliGemma, built once per session."""
    return tiny_paligemma_float64()


@functools.cache
def traced_case(kind: str):
    """``(model, trace, inputs)``: a capture on the prompt ("prefix": all prefix,
    bidirectional), or with a suffix token appended ("prefix+suffix": the suffix is
    causal), every query position kept; built once per session (this file's tests
    and tests/core/test_family_conformance.py share it)."""
    m = tiny_model()
    image = noise_image(IMAGE_SIZE)
    inputs = m.adapter.prepare([image], [QUESTION])
    if kind == "prefix+suffix":
        inputs = m.adapter.append_token(inputs, m.adapter.token_id("yes"))
    n_pos = inputs.input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos), inputs=inputs, keep_attn_out=True)
    return m, tr, inputs


CASES = ("prefix", "prefix+suffix")  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    return traced_case(request.param)


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

MODEL_CASES = ("prefix",)  # both cases run the one tiny model
FAMILY = "paligemma"
ADAPTERS = {"PaliGemmaForConditionalGeneration": PaliGemmaAdapter}
UNKNOWN_ARCHITECTURE = "NoSuchForConditionalGeneration"
DESCRIPTION = {
    "family": "paligemma",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "n_layers": 3,
    "n_heads": 4,
    "d_model": D_MODEL,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {1: 1.0}
PADDED_BATCH = ([(90, 60), (40, 70)], ["what color", QUESTION])
ANSWER_TOKEN = "\n"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("may not contain", "<image> is there a red circle?"),
    ("too long", " ".join(["red"] * 500)),
)
PERTURB_SIZES = [(90, 60)]


def check_registry_and_description(m, tr) -> None:
    """Gemma's score scale and (1 + w) RMSNorms in float32."""
    a = m.adapter
    assert a.score_scale(0) == pytest.approx(16**-0.5)
    norm = a.attn_norm(1)
    assert norm.weight_offset == 1.0 and norm.compute_dtype == torch.float32 and norm.eps == 1e-6


def check_question_errors(m, monkeypatch) -> None:
    m.adapter.check_question(QUESTION)


def check_canonical_weights(m, x) -> None:
    """W_U tied to the *unscaled* embeddings; input_embeddings carry Gemma's sqrt(d_model)."""
    a = m.adapter
    emb = a.language_model.embed_tokens
    assert a.W_U.data_ptr() == emb.weight.data_ptr() and torch.all(a.b_U == 0)
    ids = torch.tensor([2, 5, 7])
    torch.testing.assert_close(a.input_embeddings()[ids], emb(ids), atol=0, rtol=0)
    scaled = emb.weight.detach() * math.sqrt(D_MODEL)  # the scale rounded to the dtype, then one product: two roundings
    tol = rounding_tol(float(scaled.abs().max()), scaled.dtype, 2)
    torch.testing.assert_close(a.input_embeddings(), scaled, atol=tol, rtol=0)
    # the norms are the model's own, bit for bit (Gemma: (1 + w) gain in float32)
    for layer in range(a.n_layers):
        y = torch.randn(7, a.d_model, dtype=torch.float64) * 3
        mod = a.language_model.layers[layer].input_layernorm
        torch.testing.assert_close(a.attn_norm(layer)(y), mod(y), atol=0, rtol=0)
    torch.testing.assert_close(a.final_norm_layer()(y), a.language_model.norm(y), atol=0, rtol=0)


def visual_inputs(m, image) -> torch.Tensor:
    """``(n_visual, d_model)``: the projector's output, the visual tokens as the decoder receives them (unscaled)."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def check_reconstruction(m, tr, inputs, *, sdpa, eager) -> None:
    """The lens on x_L is the plain forwards' logits; x_0 is the *scaled* token
    embedding at text positions, and decompose's "embed" component is that x_0."""
    a = m.adapter
    normed = a.final_norm_layer()(tr.final_resid[0])
    lens = normed @ a.W_U + a.b_U
    torch.testing.assert_close(lens, sdpa[0], atol=unembedding_tol(a, normed), rtol=0)  # the capture ran sdpa
    tol = unembedding_tol(a, normed) + forwards_tol(a, eager[0], tr.input_ids.shape[1])
    torch.testing.assert_close(lens, eager[0], atol=tol, rtol=0)  # eager: the softmax in float32, not sdpa's float64
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    E = a.language_model.embed_tokens.weight
    x0 = tr.resid_pre[0][0]
    scaled = E[tr.input_ids[0, text]] * math.sqrt(D_MODEL)
    tol = rounding_tol(float(scaled.abs().max()), scaled.dtype, 2)  # the scale's rounding and the product's
    torch.testing.assert_close(x0[text], scaled, atol=tol, rtol=0)
    r = decompose(a, tr, a.token_id("yes"), a.token_id("no"))
    u = target_direction(a, a.token_id("yes"), a.token_id("no"))
    embed = next(c for c in r.components if c.name == "embed")
    x = x0[r.position].detach()
    assert embed.projection == pytest.approx(float(x @ u.detach()), abs=sum_tol(x.abs() @ u.abs(), a.d_model, x.dtype))
    # a square root of a d_model-term sum of squares: half its relative error
    assert embed.norm == pytest.approx(float(x.norm()), abs=sum_tol(x.norm(), a.d_model + 1, x.dtype))


def check_padded_batch(m, batch) -> None:
    """Padding keys are masked (the prefix-LM mask per row) and labelled padding."""
    from core.models.family_adapter import allowed_by_rule

    a = m.adapter
    mask = batch.tensors["attention_mask"]
    tr = capture(m, None, "", inputs=batch)
    n = batch.input_ids.shape[1]
    for row in range(2):
        want = allowed_by_rule("prefix", mask, batch.tensors["token_type_ids"], n)[row]
        assert torch.equal(a.allowed_keys(tr, 2, batch=row), want)
    assert not a.allowed_keys(tr, 0, batch=0)[:, -1].any()  # nobody reads row 0's padding
    assert a.token_roles(tr, batch=0)[-1] == "padding"


def check_appended_token(m, inputs, longer) -> None:
    """The appended token is a suffix token: causal, and the prefix does not read it."""
    assert int(longer.tensors["token_type_ids"][0, -1]) == 1


def perturbation_features(m, image) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_visual, d_vision)`` the tower's patch embeddings (pure geometry: resize +
    patch grid + token order) and ``(n_visual, d_model)`` the visual tokens as the
    decoder receives them (the projector output, after the tower's attention)."""
    pixels = m.adapter.prepare([image], [QUESTION]).tensors["pixel_values"]
    with torch.no_grad():
        patches = m.model.model.vision_tower.embeddings(pixels)[0]
        lm = m.model.model.get_image_features(pixels).pooler_output[0]
    return patches, lm


def perturbation_probes(m, size, tokens) -> list:
    """The four corners, the four central tokens and tokens on each edge of the stretched image."""
    assert len(tokens) == 36 and tokens[0].box[2] - tokens[0].box[0] != tokens[0].box[3] - tokens[0].box[1]
    return [tokens[i] for i in (0, 5, 30, 35, 14, 15, 20, 21, 2, 12, 23, 33)]


def test_paligemma2_and_logit_softcapping_are_refused():
    """A Gemma 2 decoder (PaliGemma 2) and a Gemma config with final logit
    soft-capping are refused when the adapter is built, with the reason; the
    installed PaliGemma really soft-caps its logits when the config says so."""
    from transformers import PaliGemmaForConditionalGeneration

    from core.models.families.paligemma import PaliGemmaAdapter

    config, processor = tiny_config("gemma2")
    model = PaliGemmaForConditionalGeneration(config).eval()
    with pytest.raises(UnsupportedArchitectureError, match="gemma2.*not supported.*soft-caps"):
        PaliGemmaAdapter(model, processor, processor.tokenizer)

    config, processor = tiny_config(final_logit_softcapping=2.0)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).double().eval()
    with pytest.raises(UnsupportedArchitectureError, match="soft-caps its logits"):
        PaliGemmaAdapter(model, processor, processor.tokenizer)
    inputs = processor(images=[noise_image(IMAGE_SIZE)], text=["<image>" + QUESTION], return_tensors="pt")
    inputs.pop("labels")
    inputs["pixel_values"] = inputs["pixel_values"].double()
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
        raw = model.lm_head(out.hidden_states[-1])
    # the cap divides, takes tanh and multiplies back: three roundings of terms
    # no larger than |raw| and the cap (tanh's derivative is at most 1)
    tol = rounding_tol(float(raw.abs().max()) + 2.0, torch.float64, 3)
    torch.testing.assert_close(out.logits, 2.0 * torch.tanh(raw / 2.0), atol=tol, rtol=0)
    assert (out.logits - raw).abs().max() > 1e-2  # capping changes the logits: refusing is not vacuous


def test_prompt_and_processor_layout(model):
    """The processor renders [image tokens] <bos> question "\\n"; every token is prefix."""
    a = model.adapter
    assert a.prompt(QUESTION) == "<image>" + QUESTION
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    ids = inputs.input_ids[0].tolist()
    n_img = a.n_image_tokens
    assert n_img == 36 and ids[:n_img] == [model.model.config.image_token_id] * n_img
    assert ids[n_img] == a.tokenizer.bos_token_id
    assert ids[n_img + 1 : -1] == a.tokenizer.encode(QUESTION, add_special_tokens=False)
    assert a.tokenizer.convert_ids_to_tokens(ids[-1]) == "\n"
    assert int(inputs.answer_positions[0]) == len(ids) - 1
    assert torch.all(inputs.tensors["token_type_ids"] == 0) and "labels" not in inputs.tensors
    assert inputs.tensors["pixel_values"].dtype == torch.float64
    torch.testing.assert_close(a.visual_positions(inputs)[0], torch.arange(n_img))


def check_decomposition(m, tr, r) -> None:
    """This family's part of the conformance check of the frozen decomposition ``r``."""
    a = m.adapter
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)


def test_allowed_keys_are_the_prefix_lm_mask_the_model_used(traced):
    """The recorded mask equals the prefix-LM rule rebuilt from token_type_ids:
    the prefix (image, <bos>, prompt, "\\n") is bidirectional, a suffix causal."""
    from core.models.family_adapter import allowed_by_rule

    m, tr, inputs = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    tt = inputs.tensors["token_type_ids"]
    rebuilt = allowed_by_rule("prefix", inputs.tensors["attention_mask"], tt, n)[0]
    assert sorted(tr.decoder_masks) == list(range(a.n_layers))  # recorded, not rebuilt
    for block in range(a.n_layers):
        allowed = a.allowed_keys(tr, block)
        assert allowed.shape == (n, n) and torch.equal(allowed, rebuilt)
    prefix = int((tt[0] == 0).sum())
    allowed = a.allowed_keys(tr, 0)
    assert allowed[:prefix, :prefix].all()  # image tokens read the prompt, and the prompt the image
    assert not allowed[:prefix, prefix:].any()  # the prefix never reads the suffix
    assert torch.equal(allowed[prefix:], torch.ones(n, n, dtype=torch.bool).tril()[prefix:])
    # a trace without the recorded mask falls back to the same rule
    saved = tr.decoder_masks
    try:
        del tr.decoder_masks
        assert torch.equal(a.allowed_keys(tr, 1), rebuilt)
    finally:
        tr.decoder_masks = saved


def test_positions_and_rotation_are_the_models(traced):
    """PaliGemma's positions are 1-indexed; rotate at rope_positions applies the
    cos/sin the decoder layers received."""
    from transformers.models.gemma.modeling_gemma import rotate_half

    from core.forward.capture import hooks

    m, tr, inputs = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    positions = a.rope_positions(tr)
    torch.testing.assert_close(positions, torch.arange(n) + 1, atol=0, rtol=0)
    seen = {}

    def grab(module, args, kwargs):
        seen["cos_sin"] = kwargs["position_embeddings"]

    with hooks([(a.language_model.layers[0], "pre_kw", grab)]), torch.no_grad():
        m.model(**inputs.tensors)
    cos, sin = (t[0].unsqueeze(-2) for t in seen["cos_sin"])  # (pos, 1, d_head)
    x = torch.randn(n, a.n_heads, a.d_head, dtype=torch.float64)
    tol = rounding_tol(float((x.abs() * cos.abs() + rotate_half(x).abs() * sin.abs()).max()), x.dtype, 3)
    torch.testing.assert_close(a.rotate(x, positions), x * cos + rotate_half(x) * sin, atol=tol, rtol=0)


def _recompute_patterns(a, tr, layer: int, allowed: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(heads, pos, pos)`` from canonical weights, a.rotate at a.rope_positions,
    a.score_scale and the given mask, and how far (relative) the model's eager
    float32 softmax may be from it."""
    x = a.attn_norm(layer)(tr.resid_pre[layer][0])  # (pos, d_model)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer)
    k = torch.einsum("pm,hmd->phd", x, a.W_K(layer)) + a.b_K(layer)
    positions = a.rope_positions(tr)
    q, k = a.rotate(q, positions), a.rotate(k, positions)
    scores = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(layer)
    scores = scores.masked_fill(~allowed, float("-inf"))
    error = scores_tol(x, x, a.W_Q(layer), a.b_Q(layer), a.W_K(layer), a.b_K(layer), a.score_scale(layer), True)
    return scores.softmax(-1), pattern_rtol(a, tr, scores, error)


def test_patterns_recomputed_from_canonical_weights_rope_and_prefix_mask(traced):
    m, tr, _ = traced
    a = m.adapter
    for layer in range(a.n_layers):
        pattern, rtol = _recompute_patterns(a, tr, layer, a.allowed_keys(tr, layer))
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[layer][0], atol=0, rtol=rtol)
    # not vacuous: a causal mask gives other patterns on the prefix
    n = tr.input_ids.shape[1]
    causal, _ = _recompute_patterns(a, tr, 1, torch.ones(n, n, dtype=torch.bool).tril())
    assert (causal[:, tr.query_positions] - tr.patterns[1][0]).abs().max() > 1e-2


def test_token_roles(traced):
    m, tr, _ = traced
    a = m.adapter
    roles = a.token_roles(tr)
    n_img = a.n_image_tokens
    assert roles[:n_img] == ["visual"] * n_img  # position 0 is an image patch, not the sink
    assert roles[n_img] == "sink"  # <bos> follows the image
    assert set(roles[n_img + 1 :]) == {"text"}


@pytest.mark.parametrize("size", [(90, 60), (40, 70), (48, 48), (300, 20)])
def test_visual_tokens_tile_the_stretched_image(model, size):
    a = model.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    vis = a.visual_positions(inputs)[0].tolist()
    tokens = a.visual_tokens(size, vis)
    assert len(tokens) == len(vis) == 36 and [t.position for t in tokens] == vis
    assert (tokens[-1].row, tokens[-1].col) == (5, 5)
    assert tokens[0].box[:2] == [0.0, 0.0]
    assert tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
    w, h = tokens[0].box[2] - tokens[0].box[0], tokens[0].box[3] - tokens[0].box[1]
    assert (w, h) == pytest.approx((PATCH * size[0] / IMAGE_SIDE, PATCH * size[1] / IMAGE_SIDE))


def test_paligemma2_folder_is_refused_before_its_weights_load(tmp_path):
    """load_model asks the adapter about the config first: a PaliGemma 2
    folder is refused with the reason even though it holds no weights at all."""
    from core import load_model

    config, _ = tiny_config("gemma2")
    config.architectures = ["PaliGemmaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="gemma2.*not supported"):
        load_model(str(tmp_path))
