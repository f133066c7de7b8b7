"""BLIP captioning adapter on a tiny random float64 model: every recorded
piece is checked against an independent computation (the library's own
forward, autograd, or a recomputation from canonical weights), the
post-LayerNorm frozen-scale bookkeeping is checked to be exact, and the
geometry is checked by experiment."""

import functools
import inspect
import math

import pytest
import torch

from core.forward.capture import capture
from core.methods import contributions, residual
from core.methods.logit_lens import logit_lens
from core.methods.residual import target_direction
from core.models.families.blip import BlipAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_decomposition_is_exact,
    assert_jacobian_dla_is_autograd,
    assert_lens_last_row_is_the_model,
    frozen_map_terms,
    frozen_sum_tol,
    jacobian_tol,
    noise_image,
    norm_output_tol,
    norm_replay_tol,
    pattern_rtol,
    readout_terms,
    scores_tol,
    source_sum_tol,
    stack_tol,
    unembedding_tol,
    values_tol,
)
from tests.tolerances import abs_terms, matmul_tol, sum_tol

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]")
WORDS = "a picture of photo an the red blue circle square cat dog on is there with yes no"
PREFIX = "a picture of"
IMAGE_SIZE = (130, 70)  # non-square: the processor stretches it to 32 x 32


def tiny_tokenizer():
    """A word-level BERT-style tokenizer built offline: ``[CLS] text [SEP]``, ``[DEC]`` as BOS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        bos_token="[DEC]",
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_blip_float64() -> LoadedModel:
    """A random BLIP captioner from configs: text 3 layers x 4 heads, d 32;
    vision 2 layers, width 24 (not the text width), 32 px images, 8 px patches."""
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

    from core.models import registry

    tok = tiny_tokenizer()
    vocab = tok.get_vocab()
    text = {
        "vocab_size": len(vocab),
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
        "bos_token_id": vocab["[DEC]"],
        "pad_token_id": vocab["[PAD]"],
        "sep_token_id": vocab["[SEP]"],
        "eos_token_id": vocab["[SEP]"],
    }
    vision = {
        "hidden_size": 24,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    }
    config = BlipConfig(text_config=text, vision_config=vision)
    config.architectures = ["BlipForConditionalGeneration"]
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init zeroes biases and sets LayerNorm gains to 1: make them count
        for name, p in model.text_decoder.named_parameters():
            if "LayerNorm.weight" in name:
                p.normal_(1, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
        model.text_decoder.cls.predictions.transform.dense.weight.normal_(0, 0.3)
        emb = model.vision_model.embeddings
        emb.class_embedding.normal_(0, 1)
        emb.position_embedding.normal_(0, 0.3)
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok)
    adapter = registry.adapter_for_hf("BlipForConditionalGeneration")(model, processor, processor.tokenizer)
    return LoadedModel("tiny-blip", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str = "blip"):
    """``(model, trace)``: one capture, every query position kept; built once per
    session (this file's tests and tests/core/test_family_conformance.py share it)."""
    m = tiny_blip_float64()
    image = noise_image(IMAGE_SIZE)
    n_pos = m.adapter.prepare([image], [PREFIX]).input_ids.shape[1]
    tr = capture(m, image, PREFIX, query_positions=range(n_pos), keep_attn_out=True)
    return m, tr


CASES = ("blip",)  # the conformance module's cases of this file (traced_case keys)


@pytest.fixture(scope="module")
def traced():
    return traced_case()


def ids(m):
    a = m.adapter
    return a.token_id("cat"), a.token_id("dog")


def wired(module, hook: str) -> bool:
    """Whether a shared method module uses the adapter hook ``hook`` (the report's proposed diff)."""
    return hook in inspect.getsource(module)


# ---- registry, weights, inputs


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

ADAPTERS = {"BlipForConditionalGeneration": BlipAdapter}
UNKNOWN_ARCHITECTURE = "BlipForQuestionAnswering"  # VQA: text encoder + decoder, not mapped
DESCRIPTION = {
    "n_layers": 3,
    "n_heads": 4,
    "d_model": 32,
    "attention_kind": "cross",
    "position_scheme": "absolute",
    "final_transform": "dense+gelu+layernorm",
    "norm_placement": "post",
}
CROSS_KEYS = 17  # the vision tower's CLS + 4 x 4 patches, cross-attended by every text position
PADDED_BATCH = ([(130, 70), (40, 90)], ["a cat", "a picture of the red circle"])
APPENDED_WORD = "cat"
BAD_QUESTIONS = (("vocabulary", "a picture of zebras"), ("too long", " ".join(["a cat"] * 8)))  # 16 words + BOS
PERTURB_SIZES = [(150, 90)]


def output_embeddings(model):
    """The decoder's unembedding (the captioner itself does not expose it)."""
    return model.text_decoder.get_output_embeddings()


def check_registry_and_description(m, tr) -> None:
    """Each layer is a self block then a cross block."""
    assert m.adapter.blocks == [(f"L{i}{s}", k) for i in range(3) for s, k in (("", "self"), (".xattn", "cross"))]


def check_canonical_weights(m, x) -> None:
    """q/k/v/o of self and cross blocks (cross k/v read the vision width); W_U tied, b_U nonzero."""
    a = m.adapter
    for block in (2, 3):
        attn = a._attention(block)
        d_in = 24 if block % 2 else 32
        kv = torch.randn(5, d_in, dtype=torch.float64)
        torch.testing.assert_close(
            torch.einsum("pm,hmd->phd", x, a.W_Q(block)) + a.b_Q(block),
            attn.self.query(x).view(5, 4, 8),
            atol=matmul_tol(x, a.W_Q(block), a.b_Q(block)),
            rtol=0,
        )
        for W, b, lin in ((a.W_K, a.b_K, attn.self.key), (a.W_V, a.b_V, attn.self.value)):
            assert W(block).shape == (4, d_in, 8)
            tol = matmul_tol(kv, W(block), b(block))
            torch.testing.assert_close(
                torch.einsum("pm,hmd->phd", kv, W(block)) + b(block), lin(kv).view(5, 4, 8), atol=tol, rtol=0
            )
        z = torch.randn(5, 4, 8, dtype=torch.float64)
        torch.testing.assert_close(
            torch.einsum("phd,hdm->pm", z, a.W_O(block)) + a.b_O(block),
            attn.output.dense(z.view(5, 32)),
            atol=matmul_tol(z.view(5, 32), a.W_O(block).flatten(0, 1), a.b_O(block)),
            rtol=0,
        )
    emb = a.decoder.bert.embeddings.word_embeddings.weight
    assert a.W_U.data_ptr() == emb.data_ptr() and a.W_U.shape == (32, emb.shape[0])
    assert a.b_U.abs().sum() > 0


def check_padded_batch(m, batch) -> None:
    """[SEP] is dropped from every row (generate decodes without it)."""
    mask = batch.tensors["attention_mask"]
    assert mask.shape[1] == 7
    assert m.adapter.tokenizer.sep_token_id not in batch.input_ids[mask.bool()].tolist()


def check_appended_token(m, inputs, longer) -> None:
    assert int(longer.answer_positions[0]) == 4  # [DEC] a picture of cat


def check_question_errors(m, monkeypatch) -> None:
    m.adapter.check_question(" ".join(["a"] * 15))  # BOS + 15 = 16: fits ([SEP] is dropped)


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    """``((n_keys, d_vision),)``: the vision tower's output, the keys the decoder cross-attends to."""
    inputs = m.adapter.prepare([image], [PREFIX])
    with torch.no_grad():
        return (m.model.vision_model(inputs.tensors["pixel_values"]).last_hidden_state[0],)


def perturbation_probes(m, size, tokens) -> list:
    return [tokens[i] for i in (1, 4, 6, 11, 13, 16)]  # corners, centre, edges


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    return [torch.arange(1, len(tokens))]  # the patch keys (not CLS)


def test_prepare_mirrors_generate(traced):
    """generate() puts BOS ([DEC]) first and drops [SEP]: our input is exactly what
    it decodes from, and its greedy first token is our answer position's argmax."""
    m, _ = traced
    a = m.adapter
    image = noise_image(IMAGE_SIZE)
    inputs = a.prepare([image], [PREFIX])
    assert inputs.input_ids[0].tolist() == [a.tokenizer.convert_tokens_to_ids(t) for t in "[DEC] a picture of".split()]
    assert int(inputs.answer_positions[0]) == 3 and a.token_str(int(inputs.input_ids[0, 3])) == "of"
    raw = a.processor(images=[image], text=[PREFIX], return_tensors="pt")
    assert raw["input_ids"][0, -1] == a.tokenizer.sep_token_id
    out = m.model.generate(
        pixel_values=inputs.tensors["pixel_values"],
        input_ids=raw["input_ids"],
        attention_mask=raw["attention_mask"],
        max_new_tokens=1,
        do_sample=False,
    )
    assert out[0, :-1].tolist() == inputs.input_ids[0].tolist()
    with torch.no_grad():
        assert int(out[0, -1]) == int(a.next_token_logits(inputs)[0].argmax())


# ---- capture and exactness


def test_capture_records_the_library_stream(traced):
    """Independent of the hooks: the decoder's last hidden state, the vision tower's
    output (the cross keys) and the logits from a plain library forward."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [PREFIX])
    with torch.no_grad():
        image_embeds = m.model.vision_model(inputs.tensors["pixel_values"]).last_hidden_state
        out = a.decoder.bert(
            input_ids=inputs.input_ids,
            attention_mask=inputs.tensors["attention_mask"],
            encoder_hidden_states=image_embeds,
            is_decoder=True,
        )
        logits = m.model(**inputs.tensors).logits
    torch.testing.assert_close(tr.final_resid, out.last_hidden_state, atol=0, rtol=0)
    torch.testing.assert_close(tr.logits, logits, atol=0, rtol=0)
    for block, kind in enumerate(tr.block_kinds):
        assert (tr.kv_source[block] is None) == (kind == "self")
        if kind == "cross":
            torch.testing.assert_close(tr.kv_source[block], image_embeds, atol=0, rtol=0)
        else:
            assert torch.all(tr.mlp_out[block] == 0)
    assert tr.visual_positions.shape == (1, 0)
    assert sorted(tr.norm_inputs) == sorted(k for k, _ in a.stream_norms())
    # each block's input is the previous LayerNorm's output (post-LN): the adapter's
    # Norm against nn.LayerNorm's kernel
    norms = dict(a.stream_norms())
    for key, block in (("embed.ln", 0), ("L1.ln_self", 3), ("L1.ln_ffn", 4)):
        x = tr.norm_inputs[key]
        torch.testing.assert_close(norms[key](x), tr.resid_pre[block], atol=norm_output_tol(norms[key], x), rtol=0)


def test_attn_out_enters_its_layernorm_with_the_blocks_input(traced):
    """Post-LN: attn_out (the output projection's output, before the residual add)
    enters its LayerNorm with the block's input, self and cross blocks (the heads
    summing to attn_out is a conformance check)."""
    m, tr = traced
    for block in range(tr.n_blocks):
        layer, cross = divmod(block, 2)
        key = f"L{layer}.ln_cross" if cross else f"L{layer}.ln_self"
        torch.testing.assert_close(tr.resid_pre[block] + tr.attn_out[block], tr.norm_inputs[key], atol=0, rtol=0)


def test_components_sum_exactly_to_the_last_layer_output(traced):
    """The frozen-scale bookkeeping: at every position the components sum to x_L."""
    m, tr = traced
    a = m.adapter
    for p in range(tr.input_ids.shape[1]):
        names, C = a.component_stack(tr, p)
        err = (C.sum(0) - tr.final_resid[0, p]).abs().max()
        assert err <= stack_tol(a, tr, p), (p, float(err))
    assert names[:2] == ["embed", "bias.embed.ln"]
    per_layer = ["L{l}.H0", "L{l}.H1", "L{l}.H2", "L{l}.H3", "bias.L{l}.attn_out", "bias.L{l}.ln_self"]
    per_layer += [f"L{{l}}.xattn.H{h}" for h in range(4)] + ["bias.L{l}.xattn.attn_out", "bias.L{l}.ln_cross"]
    per_layer += ["L{l}.mlp", "bias.L{l}.ln_ffn"]
    assert names == names[:2] + [n.format(l=layer) for layer in range(3) for n in per_layer]
    # not vacuous: the pre-LN identity x_L = x_0 + sum of block outputs fails for BLIP
    pre_ln = tr.resid_pre[0] + sum(tr.attn_out) + sum(tr.mlp_out)
    assert (pre_ln - tr.final_resid).abs().max() > 1e-2


def test_readout_pullback_matches_the_propagated_components(traced):
    """P^T g . (raw block output) == g . (its component of x_L), for heads, biases and the FFN."""
    m, tr = traced
    a = m.adapter
    p = int(tr.answer_positions[0])
    names, C = a.component_stack(tr, p)
    by_name = dict(zip(names, C))
    g = torch.randn(3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    n_norms = len(a.stream_norms())

    def tol(pulled, raw, propagated):
        """Two orders of the same chain of frozen LayerNorms (a mean and a scale each) and a dot product."""
        terms = float((pulled.abs() @ raw.detach().abs()).max()) + float((g.abs() @ propagated.abs()).max())
        return sum_tol(terms, n_norms * (2 * a.d_model + 4) + a.d_model, raw.dtype)

    for block, name in enumerate(tr.block_names):
        pulled = a.readout_pullback(tr, block, p, g)  # (3, d_model)
        heads = tr.head_output(a, block, p)
        for h in range(4):
            c = by_name[f"{name}.H{h}"]
            torch.testing.assert_close(pulled @ heads[h], g @ c, atol=tol(pulled, heads[h], c), rtol=0)
        c = by_name[f"bias.{name}.attn_out"]
        torch.testing.assert_close(pulled @ a.b_O(block), g @ c, atol=tol(pulled, a.b_O(block), c), rtol=0)
        if block % 2:
            mlp = a.readout_pullback(tr, block, p, g, output="mlp")
            raw, c = tr.mlp_out[block][0, p], by_name[f"L{block // 2}.mlp"]
            torch.testing.assert_close(mlp @ raw, g @ c, atol=tol(mlp, raw, c), rtol=0)
    with pytest.raises(ValueError, match="no FFN"):
        a.readout_pullback(tr, 0, p, g, output="mlp")


def test_lens_at_the_last_layer_is_the_model(traced):
    """The head transform on x_L, then W_U and b_U, equals the plain forward's logits;
    the logit lens has one row per block plus x_L."""
    m, tr = traced
    a = m.adapter
    cat, dog = ids(m)
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [PREFIX])
    with torch.no_grad():
        plain = m.model(**inputs.tensors).logits[0]
        normed = a.final_norm_layer()(tr.final_resid[0])
    lens = normed @ a.W_U + a.b_U
    torch.testing.assert_close(lens, plain, atol=unembedding_tol(a, normed), rtol=0)
    lens = logit_lens(a, tr, cat, dog)
    assert [r.layer for r in lens.rows] == list(range(2 * a.n_layers + 1))
    assert_lens_last_row_is_the_model(a, tr, lens, cat, dog)  # lens reports float32


@torch.no_grad()
def test_frozen_dla_sums_to_the_logit_difference_minus_the_biases(traced):
    """The head linearised (frozen GELU gain and LayerNorm scale) splits the logit
    difference exactly: sum_i u . M c_i = logit diff - u . frozen_bias(x_L) - u . b_U."""
    m, tr = traced
    a = m.adapter
    cat, dog = ids(m)
    p = int(tr.answer_positions[0])
    head = a.final_norm_layer()
    x_L = tr.final_resid[0, p]
    u = target_direction(a, cat, dog)
    names, C = a.component_stack(tr, p)
    dla = head.frozen(x_L, C) @ u
    logit_diff = tr.logits[0, p, cat] - tr.logits[0, p, dog]
    expected = logit_diff - head.frozen_bias(x_L) @ u - (a.b_U[cat] - a.b_U[dog])
    assert float(dla.sum()) == pytest.approx(float(expected), abs=frozen_sum_tol(a, tr, p, cat, dog))
    # the same through the readout direction (another order of the map's terms)
    terms = frozen_map_terms(head, x_L, C, u).max()
    tol = sum_tol(terms, 3 * a.d_model + 4, dla.dtype)
    torch.testing.assert_close(C @ head.frozen_readout(x_L, u), dla, atol=tol, rtol=0)
    # M is linear with frozen_bias the rest of T(x_L): up to the map's terms, and the
    # frozen LayerNorm against nn.LayerNorm's kernel
    F = head.frozen(x_L, torch.eye(a.d_model, dtype=x_L.dtype))  # (d, d): row k = M e_k
    terms = (abs_terms(x_L, F) + head.frozen_bias(x_L).abs()).max()
    tol = sum_tol(terms, 3 * a.d_model + 4, x_L.dtype) + norm_replay_tol(head.ln, terms, x_L.dtype)
    torch.testing.assert_close(head.frozen(x_L, x_L) + head.frozen_bias(x_L), head(x_L), atol=tol, rtol=0)
    # the dense bias really passes through the frozen gain: frozen_bias is not LN_h's bias alone
    assert (head.frozen_bias(x_L) - head.bias).abs().max() > 1e-3


def test_jacobian_dla_equals_autograd(traced):
    """u^T J_T(x_L) c_i == autograd's directional derivative of the logit difference
    through the true head transform, for every component."""
    m, tr = traced
    a = m.adapter
    cat, dog = ids(m)
    p = int(tr.answer_positions[0])
    head = a.final_norm_layer()
    x_L = tr.final_resid[0, p]
    u = target_direction(a, cat, dog).detach()
    _, C = a.component_stack(tr, p)
    with torch.no_grad():
        jac = C @ head.vjp(x_L, u)
    for i in range(C.shape[0]):
        _, d = torch.autograd.functional.jvp(lambda x: head(x) @ u, x_L, C[i])
        tol = jacobian_tol(a, tr, x_L, C[i], u)
        assert float(jac[i]) == pytest.approx(float(d), abs=tol), i
        assert float((head.jvp(x_L, C[i]) @ u).detach()) == pytest.approx(float(d), abs=tol)
    # the shared check (through decompose's component stack, whichever is wired)
    assert_jacobian_dla_is_autograd(a, tr, cat, dog)


def test_decompose_with_the_adapter_hook(traced):
    """core.methods.residual.decompose defers to adapter.component_stack and
    subtracts the head's frozen_bias: exact for BLIP."""
    m, tr = traced
    a = m.adapter
    assert residual.component_stack(a, tr, 0)[0] == a.component_stack(tr, 0)[0]
    cat, dog = ids(m)
    r = assert_decomposition_is_exact(a, tr, cat, dog)
    assert [c.name for c in r.components] == a.component_stack(tr, r.position)[0]


def _recompute(a, tr, block: int):
    """``(pattern (heads, pos, keys), z (pos, heads, d_head))`` from canonical
    weights, a.rotate, a.rope_positions and a.allowed_keys, and how far the
    model's may be from them (the pattern's relative to each weight)."""
    x = a.attn_norm(block)(tr.resid_pre[block][0])
    src = tr.resid_pre[block][0] if tr.kv_source[block] is None else tr.kv_source[block][0]
    kv = a.kv_norm(block)(src)
    pos = a.rope_positions(tr)
    q = torch.einsum("pm,hmd->phd", x, a.W_Q(block)) + a.b_Q(block)
    k = torch.einsum("pm,hmd->phd", kv, a.W_K(block)) + a.b_K(block)
    v = torch.einsum("pm,hmd->phd", kv, a.W_V(block)) + a.b_V(block)
    if tr.kv_source[block] is None:
        q, k = a.rotate(q, pos), a.rotate(k, pos)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.d_head)
    scores = scores.masked_fill(~a.allowed_keys(tr, block), float("-inf"))
    pattern = scores.softmax(-1)
    rotated = tr.kv_source[block] is None and a.position_scheme in ("rope", "mrope")
    error = scores_tol(x, kv, a.W_Q(block), a.b_Q(block), a.W_K(block), a.b_K(block), a.d_head**-0.5, rotated)
    rtol = pattern_rtol(a, tr, scores, error)
    # z: the weights' own error carried through the values, then the values' products
    z_tol = values_tol(pattern, kv, a.W_V(block), a.b_V(block)) * (1 + rtol)
    z_tol += rtol * float((pattern @ abs_terms(kv, a.W_V(block), a.b_V(block)[:, None])).detach().max())
    return pattern, torch.einsum("hqk,khd->qhd", pattern, v), rtol, z_tol


def recompute_patterns(a, tr, block: int) -> tuple[torch.Tensor, float]:
    """The conformance check's recomputation of one block's pattern (see ``_recompute``)."""
    pattern, _, rtol, _ = _recompute(a, tr, block)
    return pattern, rtol


def check_patterns_and_values(m, tr) -> None:
    """Cross blocks read CLS + 4 x 4 patches; z from the recomputed patterns too."""
    a = m.adapter
    for block in range(tr.n_blocks):
        pattern, z, rtol, z_tol = _recompute(a, tr, block)
        n_keys = 17 if block % 2 else tr.input_ids.shape[1]  # CLS + 4 x 4 patches
        assert tr.patterns[block].shape == (1, 4, tr.input_ids.shape[1], n_keys)
        torch.testing.assert_close(z, tr.z[block][0], atol=z_tol, rtol=0)


@torch.no_grad()
def test_source_contributions_sum_to_the_head_output(traced):
    """Summed over sources (tokens, or visual tokens incl. CLS for cross blocks), each
    head's contributions equal its direct term: u . W_O z at the answer position;
    after the pullback (proposed hook) u . (its component of x_L), and likewise for
    dla_frozen / dla_jacobian against the frozen and Jacobian read-outs of that component."""
    m, tr = traced
    a = m.adapter
    cat, dog = ids(m)
    p = int(tr.answer_positions[0])
    sc = contributions.source_contributions(a, tr, cat, dog)
    u = target_direction(a, cat, dog)
    names, C = a.component_stack(tr, p)
    by_name = dict(zip(names, C))
    head = a.final_norm_layer()
    x_L = tr.final_resid[0, p]
    hooked = wired(contributions, "readout_pullback")
    reads = readout_terms(a, tr, cat, dog, p)
    eye = torch.eye(a.d_model, dtype=x_L.dtype)
    n_norms = len(a.stream_norms())

    def tol(block, h, read):
        """The value path summed in other orders, read through the frozen LayerNorms
        after the block (|P|^T |read|; a mean and a scale each) when the hook is wired."""
        if not hooked:
            return source_sum_tol(a, tr, block, h, p, read)
        pulled = a.readout_pullback(tr, block, p, eye).abs().T @ read  # row k of the pullback of I: P^T e_k
        return source_sum_tol(a, tr, block, h, p, pulled) + sum_tol(
            float(pulled @ raw[h].abs()), n_norms * (2 * a.d_model + 4), x_L.dtype
        )

    for block, name in enumerate(tr.block_names):
        raw = tr.head_output(a, block, p)  # (heads, d_model)
        assert sc.projection[block].shape == (4, 17 if block % 2 else p + 1)
        for h in range(4):
            got = float(sc.projection[block][h].sum())
            want = by_name[f"{name}.H{h}"] @ u if hooked else raw[h] @ u
            assert got == pytest.approx(float(want), abs=tol(block, h, reads["projection"])), (name, h)
            if hooked:
                c = by_name[f"{name}.H{h}"]
                got = float(sc.dla_frozen[block][h].sum())
                assert got == pytest.approx(float(head.frozen(x_L, c) @ u), abs=tol(block, h, reads["dla_frozen"]))
                got = float(sc.dla_jacobian[block][h].sum())
                assert got == pytest.approx(float(head.jvp(x_L, c) @ u), abs=tol(block, h, reads["dla_jacobian"]))
    # the pullback the hook applies, by hand: per-source contributions of one cross head,
    # read with P^T u, sum to u . (its component of x_L)
    block, h = 3, 2
    A = tr.patterns[block][0, h, int((tr.query_positions == p).nonzero()[0])]  # (keys,)
    v = tr.kv_source[block][0] @ a.W_V(block)[h] + a.b_V(block)[h]  # (keys, d_head)
    c = A[:, None] * (v @ a.W_O(block)[h])  # (keys, d_model)
    terms = A.abs() @ abs_terms(tr.kv_source[block][0], a.W_V(block)[h], a.b_V(block)[h]) @ a.W_O(block)[h].abs()
    n = a.W_V(block).shape[1] + 1 + a.d_head + A.shape[-1] + 4
    torch.testing.assert_close(c.sum(0), tr.head_output(a, block, p)[h], atol=sum_tol(terms.max(), n, c.dtype), rtol=0)
    raw = tr.head_output(a, block, p)
    g = a.readout_pullback(tr, block, p, u)
    assert float((c @ g).sum()) == pytest.approx(
        float(by_name[f"L1.xattn.H{h}"] @ u), abs=tol(block, h, reads["projection"])
    )


# ---- geometry


def test_visual_tokens_are_the_cross_keys_in_order(traced):
    m, tr = traced
    a = m.adapter
    tokens = a.visual_tokens(IMAGE_SIZE)
    assert len(tokens) == tr.kv_source[1].shape[1] == 17
    cls = tokens[0]
    assert (cls.index, cls.row, cls.col, cls.position) == (0, -1, -1, None)
    assert cls.box == [0.0, 0.0, 130.0, 70.0]
    assert [(t.row, t.col) for t in tokens[1:]] == [(r, c) for r in range(4) for c in range(4)]
    assert tokens[1].box == [0.0, 0.0, 32.5, 17.5]  # the stretch: 130 / 4 x 70 / 4
    assert tokens[-1].box == pytest.approx([97.5, 52.5, 130.0, 70.0])
    assert a.cross_key_roles(tr, 1) == ["visual_global"] + ["visual"] * 16
