"""PaliGemma adapter on a tiny random float64 model: every recorded piece is
checked against an independent computation (a plain forward of the library
model, autograd, or a recomputation from canonical weights with the adapter's
RoPE, 1-indexed positions and prefix-LM mask), and the geometry by experiment
on a stretched (non-square) image."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.capture import capture, eager_attention
from core.errors import QuestionError, UnsupportedArchitectureError
from core.methods.logit_lens import logit_lens
from core.methods.residual import decompose, target_direction
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
    unembedding_tol,
    values_tol,
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


@pytest.fixture(scope="module")
def model():
    return tiny_paligemma_float64()


@pytest.fixture(scope="module", params=["prefix", "prefix+suffix"])
def traced(request, model):
    """A capture on the prompt (all prefix: bidirectional), and one with a
    suffix token appended (the suffix is causal): every query position kept."""
    m = model
    image = noise_image(IMAGE_SIZE)
    inputs = m.adapter.prepare([image], [QUESTION])
    if request.param == "prefix+suffix":
        inputs = m.adapter.append_token(inputs, m.adapter.token_id("yes"))
    n_pos = inputs.input_ids.shape[1]
    tr = capture(m, image, QUESTION, query_positions=range(n_pos), inputs=inputs)
    return m, tr, inputs


def test_registry_and_description(model):
    from core.models import registry
    from core.models.families.paligemma import PaliGemmaAdapter

    assert registry.adapter_for_hf("PaliGemmaForConditionalGeneration") is PaliGemmaAdapter
    with pytest.raises(UnsupportedArchitectureError, match="PaliGemmaForConditionalGeneration"):
        registry.adapter_for_hf("NoSuchForConditionalGeneration")
    a = model.adapter
    d = a.describe()
    assert d["family"] == "paligemma" and d["position_scheme"] == "rope" and d["final_norm"] == "rmsnorm"
    assert (d["n_layers"], d["n_heads"], d["d_model"]) == (3, 4, D_MODEL)
    assert a.n_kv_heads == 2 and a.d_head == 16 and a.kv_group(3) == 1
    assert a.score_scale(0) == pytest.approx(16**-0.5)
    norm = a.attn_norm(1)
    assert norm.weight_offset == 1.0 and norm.compute_dtype == torch.float32 and norm.eps == 1e-6


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


def test_question_errors(model):
    a = model.adapter
    with pytest.raises(QuestionError, match="empty"):
        a.check_question("  ")
    with pytest.raises(QuestionError, match="vocabulary"):
        a.check_question("is there a zebra?")
    with pytest.raises(QuestionError, match="may not contain"):
        a.check_question("<image> is there a red circle?")
    with pytest.raises(QuestionError, match="too long"):
        a.check_question(" ".join(["red"] * 500))
    a.check_question(QUESTION)
    with pytest.raises(QuestionError):
        a.prepare([noise_image(IMAGE_SIZE)], [""])


def test_canonical_weights_match_the_projections(model):
    """Grouped K/V expanded per query head; W_U tied to the *unscaled*
    embeddings; input_embeddings carry Gemma's sqrt(d_model)."""
    a = model.adapter
    x = torch.randn(5, a.d_model, dtype=torch.float64)
    z = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    assert_canonical_projections(a, a._attn(1), 1, x, z)
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


def test_heads_sum_to_attention_output(traced):
    m, tr, _ = traced
    assert_heads_sum_to_attention_output(m.adapter, tr)


def test_residual_reconstruction_and_lens_at_last_layer(traced):
    """x_L = x_0 + sum attn + sum mlp; the lens on x_L equals a plain forward's
    logits (no hooks); x_0 is the *scaled* token embedding at text positions
    and the projector output at image positions."""
    m, tr, inputs = traced
    a = m.adapter
    assert_reconstruction_and_lens_at_last_layer(a, tr)
    normed = a.final_norm_layer()(tr.final_resid[0])
    lens = normed @ a.W_U + a.b_U
    with torch.no_grad(), eager_attention(m.model):
        plain = m.model(**inputs.tensors).logits[0]
    torch.testing.assert_close(lens, plain, atol=unembedding_tol(a, normed), rtol=0)
    with torch.no_grad():  # sdpa: the softmax in float64, not eager's float32
        sdpa = m.model(**inputs.tensors).logits[0]
    tol = unembedding_tol(a, normed) + forwards_tol(a, plain, tr.input_ids.shape[1])
    torch.testing.assert_close(lens, sdpa, atol=tol, rtol=0)
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    E = a.language_model.embed_tokens.weight
    x0 = tr.resid_pre[0][0]
    scaled = E[tr.input_ids[0, text]] * math.sqrt(D_MODEL)
    tol = rounding_tol(float(scaled.abs().max()), scaled.dtype, 2)  # the scale's rounding and the product's
    torch.testing.assert_close(x0[text], scaled, atol=tol, rtol=0)
    with torch.no_grad(), eager_attention(m.model):  # the capture ran the tower eagerly too
        feats = m.model.model.get_image_features(inputs.tensors["pixel_values"]).pooler_output[0]
    torch.testing.assert_close(x0[vis], feats, atol=0, rtol=0)  # image features enter unscaled
    # the decomposition's "embed" component is that scaled x_0
    r = decompose(a, tr, a.token_id("yes"), a.token_id("no"))
    u = target_direction(a, a.token_id("yes"), a.token_id("no"))
    embed = next(c for c in r.components if c.name == "embed")
    x = x0[r.position].detach()
    assert embed.projection == pytest.approx(float(x @ u.detach()), abs=sum_tol(x.abs() @ u.abs(), a.d_model, x.dtype))
    # a square root of a d_model-term sum of squares: half its relative error
    assert embed.norm == pytest.approx(float(x.norm()), abs=sum_tol(x.norm(), a.d_model + 1, x.dtype))


def test_logit_lens_last_row_is_the_model(traced):
    m, tr, _ = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    lens = logit_lens(a, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(a.n_layers + 1))
    p = lens.position
    assert p == int(tr.answer_positions[0]) == tr.input_ids.shape[1] - 1
    assert_lens_last_row_is_the_model(a, tr, lens, a_id, f_id)


def test_frozen_dla_sums_to_logit_difference_minus_bias(traced):
    m, tr, _ = traced
    a = m.adapter
    # Gemma's final norm runs in float32 even in a float64 model; the frozen split is float64
    r = assert_decomposition_is_exact(a, tr, a.token_id("yes"), a.token_id("no"))
    assert len(r.components) == 1 + a.n_layers * (a.n_heads + 1)  # no o_proj bias in Gemma


def test_jacobian_dla_equals_autograd_directional_derivative(traced):
    m, tr, _ = traced
    a = m.adapter
    # Gemma's norm runs in float32 end to end (gain included), so autograd through it is
    # float32 arithmetic, and the adapter's Norm takes 1/sigma in float32 too
    assert_jacobian_dla_is_autograd(a, tr, a.token_id("yes"), a.token_id("no"))


def test_source_contributions_sum_to_each_heads_output(traced):
    """Summed over sources, a head's contributions projected on u equal u . W_O^h z^h
    at the answer position (which reads every real token: it is in the prefix,
    or it is the last suffix token)."""
    from core.methods.contributions import source_contributions

    m, tr, _ = traced
    a = m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))


def test_allowed_keys_are_the_prefix_lm_mask_the_model_used(traced):
    """The recorded mask equals the prefix-LM rule rebuilt from token_type_ids:
    the prefix (image, <bos>, prompt, "\\n") is bidirectional, a suffix causal."""
    from core.models.families.paligemma import prefix_lm_allowed

    m, tr, inputs = traced
    a = m.adapter
    n = tr.input_ids.shape[1]
    tt = inputs.tensors["token_type_ids"]
    rebuilt = prefix_lm_allowed(inputs.tensors["attention_mask"], tt, n)[0]
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

    from core.capture import hooks

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


def test_values_recomputed_from_canonical_weights(traced):
    m, tr, _ = traced
    a = m.adapter
    for layer in range(a.n_layers):
        x = a.attn_norm(layer)(tr.resid_pre[layer][0])
        v = torch.einsum("pm,hmd->phd", x, a.W_V(layer)) + a.b_V(layer)
        z = torch.einsum("hqk,khd->qhd", tr.patterns[layer][0], v)
        tol = values_tol(tr.patterns[layer][0], x, a.W_V(layer), a.b_V(layer))
        torch.testing.assert_close(z, tr.z[layer][0, tr.query_positions], atol=tol, rtol=0)


def test_token_roles(traced):
    m, tr, _ = traced
    a = m.adapter
    roles = a.token_roles(tr)
    n_img = a.n_image_tokens
    assert roles[:n_img] == ["visual"] * n_img  # position 0 is an image patch, not the sink
    assert roles[n_img] == "sink"  # <bos> follows the image
    assert set(roles[n_img + 1 :]) == {"text"}


def test_right_padded_batch_matches_single_runs(model):
    """Questions of different lengths: right padding, the answer position is
    the last real token ("\\n"), padding keys are masked, and each row's
    next-token logits equal its own unpadded run."""
    from core.models.families.paligemma import prefix_lm_allowed

    a = model.adapter
    images = [noise_image((90, 60), 1), noise_image((40, 70), 2)]
    questions = ["what color", QUESTION]
    batch = a.prepare(images, questions)
    assert a.tokenizer.padding_side == "left"  # restored
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 0 and mask[1, -1] == 1  # row 0 is right-padded
    logits = a.next_token_logits(batch)
    for i in range(2):
        single = a.prepare([images[i]], [questions[i]])
        assert int(batch.answer_positions[i]) == int(single.answer_positions[0]) == single.input_ids.shape[1] - 1
        assert a.tokenizer.convert_ids_to_tokens(int(batch.input_ids[i, batch.answer_positions[i]])) == "\n"
        want = a.next_token_logits(single)[0]
        torch.testing.assert_close(logits[i], want, atol=forwards_tol(a, want, mask.shape[1]), rtol=0)
    tr = capture(model, None, "", inputs=batch)
    n = batch.input_ids.shape[1]
    for row in range(2):
        want = prefix_lm_allowed(mask, batch.tensors["token_type_ids"], n)[row]
        assert torch.equal(a.allowed_keys(tr, 2, batch=row), want)
    assert not a.allowed_keys(tr, 0, batch=0)[:, -1].any()  # nobody reads row 0's padding
    assert a.token_roles(tr, batch=0)[-1] == "padding"


def test_append_token_is_a_causal_suffix(model):
    a = model.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    yes = a.token_id("yes")
    longer = a.append_token(inputs, yes)
    assert int(longer.answer_positions[0]) == int(inputs.answer_positions[0]) + 1
    assert int(longer.input_ids[0, -1]) == yes and int(longer.tensors["token_type_ids"][0, -1]) == 1
    with torch.no_grad():
        before, after = a.forward_logits(inputs), a.forward_logits(longer)
    tol = forwards_tol(a, before, longer.input_ids.shape[1])
    torch.testing.assert_close(after[:, :-1], before, atol=tol, rtol=0)  # the prefix does not read the suffix


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


def test_perturbing_a_box_centre_moves_its_own_token_most(model):
    """Geometry by experiment on a non-square image (stretched by the resize):
    inverting the pixels around a token's box centre changes that token most,
    for the four corners, the four central tokens and tokens on each edge, both in the tower's patch embeddings (pure geometry:
    resize + patch grid + token order) and in its input to the language
    model (the projector output, after the tower's attention)."""
    a = model.adapter
    size = (90, 60)
    base = np.asarray(noise_image(size, 3)).copy()
    tokens = a.visual_tokens(size)
    assert tokens[0].box[2] - tokens[0].box[0] != tokens[0].box[3] - tokens[0].box[1]
    tower = model.model.model.vision_tower

    def features(arr):
        """``(n_visual, d_vision)`` patch embeddings and ``(n_visual, d_model)``
        the visual tokens as the decoder receives them."""
        pixels = a.prepare([Image.fromarray(arr)], [QUESTION]).tensors["pixel_values"]
        with torch.no_grad():
            patches = tower.embeddings(pixels)[0]
            lm = model.model.model.get_image_features(pixels).pooler_output[0]
        return patches, lm

    ref = features(base)
    assert ref[1].shape[0] == len(tokens) == 36
    for t in (tokens[i] for i in (0, 5, 30, 35, 14, 15, 20, 21, 2, 12, 23, 33)):
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        rx, ry = max(1, int((x1 - x0) / 5)), max(1, int((y1 - y0) / 5))
        arr = base.copy()
        arr[cy - ry : cy + ry, cx - rx : cx + rx] = 255 - arr[cy - ry : cy + ry, cx - rx : cx + rx]
        for got, want in zip(features(arr), ref):
            change = (got - want).norm(dim=-1)
            assert int(change.argmax()) == t.index, (t, change.topk(3))


def test_hooks_are_removed_and_attention_restored(model):
    m = model
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


def test_saved_folder_loads_with_this_adapter(tmp_path):
    """load_model on a saved folder picks this adapter and runs the same model."""
    from core import load_model

    model = tiny_paligemma_float64()  # its own copy: saving goes through float32
    model.model.float().save_pretrained(tmp_path, safe_serialization=True)
    model.processor.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.family == "paligemma" and type(loaded.adapter) is type(model.adapter)
    image = noise_image(IMAGE_SIZE)
    with torch.no_grad():
        want = model.adapter.next_token_logits(model.adapter.prepare([image], [QUESTION]))
        got = loaded.adapter.next_token_logits(loaded.adapter.prepare([image], [QUESTION]))
    n_keys = loaded.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    torch.testing.assert_close(got, want, atol=forwards_tol(loaded.adapter, want, n_keys), rtol=0)
    assert loaded.adapter.prompt(QUESTION) == model.adapter.prompt(QUESTION)


def test_paligemma2_folder_is_refused_before_its_weights_load(tmp_path):
    """load_model asks the adapter about the config first: a PaliGemma 2
    folder is refused with the reason even though it holds no weights at all."""
    from core import load_model

    config, _ = tiny_config("gemma2")
    config.architectures = ["PaliGemmaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="gemma2.*not supported"):
        load_model(str(tmp_path))
