"""Gemma 3n adapter on the tiny random float64 model (tests/core/tiny_gemma3n.py: AltUp
with 4 streams, LAuReL, per-layer inputs, layers sliding / full / sliding / full of
which the last two reuse layers 0's and 1's keys and values, soft-capped logits, a
MobileNetV5 tower pooled to 4 x 4 soft tokens): the conformance checks that apply,
and what is its own, each against an independent computation:

* the read stream (``resid_pre``) against the decoder's final combination written out
  here by formula, the final norm's input bit for bit, and the logit lens (final norm,
  W_U, soft-cap) row by row against the same formula; its last row is the model's;
* the attention rows recomputed from what each attention read (the predicted stream
  0, normed; a KV-sharing layer's keys from its producer's input) and the values
  through the gain-free per-head v norm, against the recorded rows and z;
* head, MLP and patching edits against hooks written here on the library's modules;
* the refusals (decomposition, DLA, source contributions, the value map, a sharing
  layer's W_K, the resid and visual sites), each one line with its reason."""

import functools

import pytest
import torch

from core.errors import InterventionError, QuestionError, UndefinedReadoutError
from core.forward.capture import capture, eager_attention, edited_logits
from core.forward.edits import Edit
from core.methods.contributions import source_contributions
from core.methods.interventions import activation_patch, zero_ablation
from core.methods.logit_lens import lens_logits, logit_lens
from core.methods.qk_ov import ov_circuit, qk_circuit
from core.methods.residual import compare_with_rerun, component_stack, decompose
from core.models.families.gemma3n import Gemma3nAdapter
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_lens_last_row_is_the_model,
    capture_every_position,
    forwards_tol,
    lens_logit_tol,
    matmul_tol,
    noise_image,
    pattern_rtol,
    projected_visual_tokens,
    realized_scores_tol,
)
from tests.core.tiny_gemma3n import (
    GRID,
    IMAGE_SIDE,
    IMAGE_SIZE,
    N_IMAGE_TOKENS,
    QUESTION,
    SLIDING_WINDOW,
    tiny_model,
)
from tests.tolerances import NORM_ROUNDINGS, abs_terms, rounding_tol, sum_tol

PRODUCERS = [0, 1, 0, 1]  # the layer whose keys and values each layer attends with


def tiny_gemma3n_float64() -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model()
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-gemma3n", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    """``(model, trace, inputs)``: a capture of the prompt, every query position kept."""
    m = tiny_gemma3n_float64()
    tr, inputs = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr, inputs


CASES = ("gemma3n",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("gemma3n")


# ---- this family's parts of the conformance checks (tests/core/test_family_conformance.py)

FAMILY = "gemma3n"
ADAPTERS = {"Gemma3nForConditionalGeneration": Gemma3nAdapter}
DESCRIPTION = {
    "family": "gemma3n",
    "position_scheme": "rope",
    "final_norm": "rmsnorm",
    "norm_placement": "sandwich",
    "altup_streams": 4,
    "n_layers": 4,
    "n_heads": 4,
    "d_model": 64,
}
KV_LAYOUT = (2, 16, 1)  # n_kv_heads, d_head, kv_group(3)
CANONICAL_LAYERS = {}  # no layer has a linear value map: check_canonical_weights checks W_Q / W_K / W_O
PADDED_BATCH = ([(90, 60), (40, 70)], ["what color", QUESTION])
ANSWER_TOKEN = "\n"
BAD_QUESTIONS = (
    ("vocabulary", "is there a zebra?"),
    ("may not contain", "<image_soft_token> is there a red circle?"),
    ("too long", " ".join(["red"] * 600)),
)
PERTURB_SIZES = [(90, 60), (60, 90)]


def check_registry_and_description(m, tr) -> None:
    """Unscaled scores, the sliding window on sliding layers, the KV producers, and the
    adapter's norm (gain w, float32) the model's own bit for bit, with and without a gain."""
    a = m.adapter
    assert [a.score_scale(b) for b in range(4)] == [1.0] * 4
    assert [a.sliding_window(b) for b in range(4)] == [SLIDING_WINDOW, None, SLIDING_WINDOW, None]
    assert [a.kv_producer(b) for b in range(4)] == PRODUCERS
    layer = a.language_model.layers[0]
    y = torch.randn(7, a.d_model, dtype=torch.float64) * 3
    for module in (layer.input_layernorm, layer.post_feedforward_layernorm, a.language_model.norm):
        torch.testing.assert_close(a._norm(module)(y), module(y), atol=0, rtol=0)
    h = torch.randn(7, a.n_heads, a.d_head, dtype=torch.float64)
    torch.testing.assert_close(a._norm(layer.self_attn.v_norm)(h), layer.self_attn.v_norm(h), atol=0, rtol=0)
    torch.testing.assert_close(a.k_norm(2)(h), layer.self_attn.k_norm(h), atol=0, rtol=0)  # layer 2's: layer 0's


def check_canonical_weights(m, x) -> None:
    """W_Q of every layer, W_K of the key producers and W_O are the projections (grouped
    keys expanded); W_U is the tied, unscaled token table; the text rows of
    input_embeddings are embed_tokens' (scaled); W_V and a sharing layer's W_K are refused."""
    a = m.adapter
    n = x.shape[0]
    z = torch.randn(n, a.n_heads, a.d_head, dtype=torch.float64)
    for layer in range(a.n_layers):
        attn = a._attn(layer)
        q = attn.q_proj(x).view(n, a.n_heads, a.d_head)
        got = torch.einsum("pm,hmd->phd", x, a.W_Q(layer))
        torch.testing.assert_close(got, q, atol=matmul_tol(x, a.W_Q(layer)), rtol=0)
        o = torch.einsum("phd,hdm->pm", z, a.W_O(layer))
        flat = z.reshape(n, -1)
        torch.testing.assert_close(o, attn.o_proj(flat), atol=matmul_tol(flat, a.W_O(layer).flatten(0, 1)), rtol=0)
        if PRODUCERS[layer] == layer:
            k = attn.k_proj(x).view(n, a.n_kv_heads, a.d_head).repeat_interleave(2, dim=1)
            torch.testing.assert_close(
                torch.einsum("pm,hmd->phd", x, a.W_K(layer)), k, atol=matmul_tol(x, a.W_K(layer)), rtol=0
            )
        else:
            with pytest.raises(UndefinedReadoutError, match=f"L{layer} has no k_proj.*L{PRODUCERS[layer]}'s keys"):
                a.W_K(layer)
        with pytest.raises(UndefinedReadoutError, match="no linear value map"):
            a.W_V(layer)
    emb = a.language_model.embed_tokens
    assert a.W_U.data_ptr() == emb.weight.data_ptr() and torch.all(a.b_U == 0)
    ids = torch.tensor([2, 5, 7, 20])
    torch.testing.assert_close(a.input_embeddings()[ids], emb(ids), atol=0, rtol=0)


def check_question_errors(m, monkeypatch) -> None:
    """The length check counts the image placeholder expanded, as the processor does."""
    a = m.adapter
    n = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION]).input_ids.shape[1]
    monkeypatch.setattr(a, "max_positions", lambda: n)
    a.check_question(QUESTION)
    monkeypatch.setattr(a, "max_positions", lambda: n - 1)
    for call in (lambda: a.check_question(QUESTION), lambda: a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])):
        with pytest.raises(QuestionError, match=f"{n} tokens with the image"):
            call()


def check_appended_token(m, inputs, longer) -> None:
    assert int(longer.tensors["token_type_ids"][0, -1]) == 0


def visual_inputs(m, image) -> torch.Tensor:
    """``(16, d_model)``: the soft tokens as the decoder's stream 0 receives them."""
    return projected_visual_tokens(m, image, QUESTION, "pixel_values")


def perturbation_features(m, image) -> tuple[torch.Tensor]:
    return (visual_inputs(m, image),)


def perturbation_rivals(tokens, t) -> list[torch.Tensor]:
    """The token itself against the tokens that do not read its cell: MobileNetV5's
    stride-2 "same" convolutions pad bottom / right, so a token reads about a cell up /
    left of its own and far down / right: the tokens above and left of ``t`` read
    ``t``'s cell too (as much as ``t`` does), the ones two or more cells below or right do not."""
    far = [u.index for u in tokens if u.row >= t.row + 2 or u.col >= t.col + 2]
    return [torch.tensor([t.index, *far])]


# ---- the captures, the read stream and the logit lens


def test_captures_are_the_models_forwards(traced):
    """No hook of ours changes the computation: the default capture's logits are a plain
    (sdpa) forward's bit for bit, an eager capture's the eager forward's, and the two as
    far apart as two forwards may be; stream 0 entering block 0 holds the scaled text
    embeddings and the soft image tokens."""
    m, tr, inputs = traced
    a = m.adapter
    with torch.no_grad():
        sdpa = a.forward_logits(inputs)
        with eager_attention(m.model):
            eager = a.forward_logits(inputs)
    torch.testing.assert_close(tr.logits, sdpa, atol=0, rtol=0)
    eager_trace = capture(m, None, "", inputs=inputs, attention="eager")
    torch.testing.assert_close(eager_trace.logits, eager, atol=0, rtol=0)
    torch.testing.assert_close(sdpa, eager, atol=forwards_tol(a, eager, tr.input_ids.shape[1]), rtol=0)
    entering, _, _ = _recorded_streams(m, inputs)
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    text[tr.input_ids[0] >= m.model.model.embed_vision.vocab_offset] = False  # <end_of_image>: embed_vision's
    with torch.no_grad():
        torch.testing.assert_close(entering[0][0, 0, vis], visual_inputs(m, noise_image(IMAGE_SIZE)), atol=0, rtol=0)
        emb = a.input_embeddings()[tr.input_ids[0, text]]
        torch.testing.assert_close(entering[0][0, 0, text], emb, atol=0, rtol=0)


def _by_hand_read(model, streams: torch.Tensor) -> torch.Tensor:
    """The decoder's end, written out: stream i > 0 through its unembed projection,
    rescaled to stream 0's RMS (mean square clamped at 1e-5), then the mean of all."""
    lm = model.model.language_model
    target = streams[0].pow(2).mean(-1, keepdim=True).sqrt()
    parts = [streams[0]]
    for i, U in enumerate(lm.altup_unembed_projections, start=1):
        y = streams[i] @ U.weight.T
        parts.append(y * target / y.pow(2).mean(-1, keepdim=True).clamp(min=1e-5).sqrt())
    return sum(parts) / len(parts)


def _read_terms(model, streams: torch.Tensor) -> torch.Tensor:
    """Per entry, the size of the terms of the read stream (``|s_0|`` and each projected
    stream's ``|s_i| |U_i|`` times its rescaling), what its rounding is relative to."""
    lm = model.model.language_model
    target = streams[0].pow(2).mean(-1, keepdim=True).sqrt()
    out = streams[0].abs()
    for i, U in enumerate(lm.altup_unembed_projections, start=1):
        y = streams[i] @ U.weight.T
        out = out + abs_terms(streams[i], U.weight.T) * target / y.pow(2).mean(-1, keepdim=True).sqrt()
    return out


def _recorded_streams(m, inputs) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A plain forward with hooks written here: the 4 streams entering each layer, the
    last layer's output and the final norm's input."""
    lm = m.model.model.language_model
    entering, rec = {}, {}
    handles = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: entering.__setitem__(i, args[0]))
        for i, layer in enumerate(lm.layers)
    ]
    handles.append(lm.layers[-1].register_forward_hook(lambda mod, args, out: rec.__setitem__("out", out)))
    handles.append(lm.norm.register_forward_pre_hook(lambda mod, args: rec.__setitem__("final", args[0])))
    try:
        with torch.no_grad():
            m.model(**inputs.tensors, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [entering[i] for i in range(len(lm.layers))], rec["out"], rec["final"]


def test_resid_pre_is_the_stream_the_unembedding_would_read(traced):
    """resid_pre[l] is the decoder's final combination of the 4 streams entering block l
    (the formula written here, to float64 rounding of its terms); the same combination of
    the last layer's output is the final norm's input bit for bit; it is neither stream
    0 nor the plain mean of the streams."""
    m, tr, inputs = traced
    a = m.adapter
    entering, last, final = _recorded_streams(m, inputs)
    assert all(s.shape == (4, *tr.resid_pre[0].shape) for s in entering)
    with torch.no_grad():
        for block, streams in enumerate(entering):
            want = _by_hand_read(m.model, streams)
            tol = sum_tol(_read_terms(m.model, streams).max(), 3 * a.d_model + 8, torch.float64)
            torch.testing.assert_close(tr.resid_pre[block], want, atol=tol, rtol=0)
            torch.testing.assert_close(tr.resid_pre[block], a.read_stream(streams), atol=0, rtol=0)
            for other in (streams[0], streams.mean(0)):  # not vacuous
                assert (other - tr.resid_pre[block]).abs().max() > 1e-2
        torch.testing.assert_close(a.read_stream(last), final, atol=0, rtol=0)
    torch.testing.assert_close(tr.final_resid, final, atol=0, rtol=0)


def _lens_by_hand(m, x: torch.Tensor) -> torch.Tensor:
    """``c tanh(W_U (w * x / rms(x)) / c)`` in float64 (the model's norm runs in float32)."""
    lm, cap = m.model.model.language_model, m.adapter.text_config.final_logit_softcapping
    normed = x * (x.pow(2).mean(-1, keepdim=True) + 1e-6) ** -0.5 * lm.norm.weight
    return cap * torch.tanh((normed @ m.model.lm_head.weight.T) / cap)


def test_logit_lens_reads_the_read_stream_through_norm_unembedding_and_softcap(traced):
    """Every lens row is the soft-capped unembedding of the final norm of that layer's read
    stream (formula here; the model's norm rounds in float32); the last row is the model's
    logits; without the soft-cap, or on stream 0 alone, the rows are not."""
    m, tr, _ = traced
    a = m.adapter
    yes, no = a.token_id("yes"), a.token_id("no")
    lens = logit_lens(a, tr, yes, no)
    p = lens.position
    assert_lens_last_row_is_the_model(a, tr, lens, yes, no)
    states = torch.stack([r[0, p] for r in tr.resid_pre] + [tr.final_resid[0, p]])
    with torch.no_grad():
        want = _lens_by_hand(m, states)
        normed = a.final_norm_layer()(states)
        for row, expected, x in zip(lens.rows, want, normed):
            terms = float(abs_terms(x, a.W_U[:, [yes]]).max())
            tol = rounding_tol(terms, torch.float32, NORM_ROUNDINGS) + sum_tol(terms, a.d_model + 4, torch.float64)
            tol += rounding_tol(abs(float(expected[yes])), torch.float32)  # the row reports float32
            assert row.answer_logit == pytest.approx(float(expected[yes]), abs=tol), row.layer
        # the last row is the model's logits at every token; not vacuous: uncapped they are not
        model_logits = tr.logits[0, p]
        tol = lens_logit_tol(a, tr, p, list(range(a.W_U.shape[1])))
        torch.testing.assert_close(lens_logits(a, tr.final_resid[0, p]), model_logits, atol=tol, rtol=0)
        uncapped = a.final_norm_layer()(tr.final_resid[0, p]) @ a.W_U
        assert (uncapped - model_logits).abs().max() > 1e-2
        stream0 = lens_logits(a, tr.norm_inputs["L1.input_layernorm"][0, p])  # not the read stream
        assert (stream0 - lens_logits(a, tr.resid_pre[1][0, p])).abs().max() > 1e-2
    assert a.cap_logits(torch.tensor([1e6])).item() == pytest.approx(a.text_config.final_logit_softcapping)


# ---- attention: rows, queries and keys, values


def _attention_reads(m, inputs) -> dict[int, torch.Tensor]:
    """Per layer, what its self_attn was called with (input_layernorm of the predicted
    stream 0), recorded by hooks written here."""
    seen = {}
    lm = m.model.model.language_model
    handles = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: seen.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(lm.layers)
    ]
    try:
        with torch.no_grad():
            m.model(**inputs.tensors, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_patterns_and_values_recomputed_from_what_each_attention_read(traced):
    """Per layer: q from its own normed predicted stream 0, k from its key producer's
    (rotation of the layer's type, unscaled scores, causal + window mask) give the
    recorded rows; z is those rows times the producer's values v_norm(v_proj(x)) (no
    gain). Not vacuous: keys from the consumer's own input, queries from the read
    stream, or values without the v norm, miss."""
    m, tr, inputs = traced
    a = m.adapter
    reads = _attention_reads(m, inputs)
    n = tr.input_ids.shape[1]
    with torch.no_grad():
        for block in range(a.n_layers):
            torch.testing.assert_close(a.attention_input(tr, block), reads[block][0], atol=0, rtol=0)
            q, k = a.queries_keys(tr, block)
            scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~a.allowed_keys(tr, block), float("-inf"))
            rtol = pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, block))
            pattern = tr.patterns[block][0]
            torch.testing.assert_close(scores.softmax(-1), pattern, atol=0, rtol=rtol)
            producer = a._attn(PRODUCERS[block])
            x = reads[PRODUCERS[block]][0]
            v = producer.v_norm(producer.v_proj(x).view(n, a.n_kv_heads, a.d_head)).repeat_interleave(2, dim=1)
            z = torch.einsum("hqk,khd->qhd", pattern, v)
            terms = float(torch.einsum("hqk,khd->qhd", pattern.abs(), v.abs()).max())
            tol = sum_tol(terms, a.d_model + 1 + n, torch.float64) + rounding_tol(terms, torch.float32, NORM_ROUNDINGS)
            torch.testing.assert_close(z, tr.z[block][0], atol=tol, rtol=0)
            raw = producer.v_proj(x).view(n, a.n_kv_heads, a.d_head).repeat_interleave(2, dim=1)
            assert (torch.einsum("hqk,khd->qhd", pattern, raw) - tr.z[block][0]).abs().max() > 1e-2
        # layer 2 keyed by its own input through layer 0's W_K; layer 1 queried from its read stream
        x2 = a.attention_input(tr, 2)
        k_own = a.rotate(a.k_norm(2)(torch.einsum("pm,hmd->phd", x2, a.W_K(0))), a.rope_positions(tr), 2)
        q2, _ = a.queries_keys(tr, 2)
        own = torch.einsum("qhd,khd->hqk", q2, k_own).masked_fill(~a.allowed_keys(tr, 2), float("-inf"))
        assert (own.softmax(-1) - tr.patterns[2][0]).abs().max() > 1e-3
        x1 = a.attn_norm(1)(tr.resid_pre[1][0])
        q1 = a.rotate(a.q_norm(1)(torch.einsum("pm,hmd->phd", x1, a.W_Q(1))), a.rope_positions(tr), 1)
        _, k1 = a.queries_keys(tr, 1)
        read = torch.einsum("qhd,khd->hqk", q1, k1).masked_fill(~a.allowed_keys(tr, 1), float("-inf"))
        assert (read.softmax(-1) - tr.patterns[1][0]).abs().max() > 1e-3
    # the mask: plain causal with the window on sliding layers, image tokens included
    allowed = a.allowed_keys(tr, 0)
    vis = tr.visual_positions[0]
    assert not allowed[vis[0], vis[1]] and not allowed[n - 1, n - 1 - SLIDING_WINDOW] and a.allowed_keys(tr, 1)[-1, 0]


def test_queries_keys_are_the_models(traced):
    """adapter.queries_keys gives the model's own scores at every layer: a KV-sharing
    layer's keys are its producer's (the very tensor the attention call received)."""
    m, tr, inputs = traced
    a = m.adapter
    kept = capture(m, None, "", inputs=inputs, keep_qk=True)
    assert all(kept.k[c].data_ptr() == kept.k[p].data_ptr() for c, p in ((2, 0), (3, 1)))  # the same tensor
    for block in range(a.n_layers):
        q, k = a.queries_keys(tr, block)
        model_k = kept.k[block][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        ours = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(block)
        theirs = torch.einsum("qhd,khd->hqk", kept.q[block][0], model_k) * kept.score_scale[block]
        torch.testing.assert_close(ours, theirs, atol=realized_scores_tol(a, tr, block), rtol=0)


# ---- edits


def _hooked_logits(m, inputs, module, kind: str, fn) -> torch.Tensor:
    handle = module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn)
    try:
        with torch.no_grad():
            return m.adapter.forward_logits(inputs)
    finally:
        handle.remove()


def test_head_and_mlp_edits_and_patches_equal_hand_written_hooks(traced):
    """Zeroing a head's z (a KV-sharing layer's), zeroing an MLP's write, and patching
    either with another image's values: the logits of a hook written here on o_proj's
    input / post_feedforward_layernorm's output, bit for bit; and each moves the answer."""
    m, tr, inputs = traced
    a = m.adapter
    lm = a.language_model
    positions = [*tr.visual_positions[0][:4].tolist(), int(tr.answer_positions[0])]
    other_inputs = a.prepare([noise_image(IMAGE_SIZE, 7)], [QUESTION])
    source = capture(m, None, "", inputs=other_inputs, pattern_layers=[])
    head, d = 1, a.d_head

    def zero_z(module, args):
        x = args[0].clone()
        x[:, positions, head * d : (head + 1) * d] = 0
        return (x,)

    def patch_z(module, args):
        x = args[0].clone()
        x[:, positions, head * d : (head + 1) * d] = source.z[3][0, positions, head]
        return (x,)

    def zero_mlp(module, args, out):
        out = out.clone()
        out[:, positions] = 0
        return out

    def patch_mlp(module, args, out):
        out = out.clone()
        out[:, positions] = source.mlp_out[1][0, positions]
        return out

    cases = [
        (zero_ablation(3, head, positions), lm.layers[3].self_attn.o_proj, "pre", zero_z),
        (activation_patch(source, "z", 3, head, positions), lm.layers[3].self_attn.o_proj, "pre", patch_z),
        (zero_ablation(1, None, positions), lm.layers[1].post_feedforward_layernorm, "fwd", zero_mlp),
        (
            activation_patch(source, "mlp", 1, None, positions),
            lm.layers[1].post_feedforward_layernorm,
            "fwd",
            patch_mlp,
        ),
    ]
    for edit, module, kind, fn in cases:
        got = edited_logits(m, inputs, [edit])
        want = _hooked_logits(m, inputs, module, kind, fn)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert float((got - tr.logits).abs().max()) > 1e-3, edit.describe()
        edited = capture(m, None, "", inputs=inputs, pattern_layers=[], edits=[edit])
        torch.testing.assert_close(edited.logits, want, atol=0, rtol=0)


# ---- refusals


def _assert_refused(call, error=UndefinedReadoutError, *words: str) -> str:
    with pytest.raises(error) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message and message.startswith("gemma3n: "), message
    assert all(w in message for w in words), message
    return message


def test_decomposition_dla_and_source_contributions_are_refused_in_one_line(traced):
    """No additive split of x_L: the decomposition, both DLAs, the re-run comparison and
    the source contributions are refused, each in one line with the reason."""
    m, tr, inputs = traced
    a = m.adapter
    yes, no = a.token_id("yes"), a.token_id("no")
    p = int(tr.answer_positions[0])
    for call in (
        lambda: decompose(a, tr, yes, no),
        lambda: component_stack(a, tr, p),
        lambda: a.readout_pullback(tr, 0, p, torch.zeros(a.d_model, dtype=torch.float64)),
        lambda: compare_with_rerun(m, tr, yes, no, inputs=inputs),
    ):
        _assert_refused(call, UndefinedReadoutError, "4 AltUp streams", "not a sum of sublayer writes")
    _assert_refused(lambda: source_contributions(a, tr, yes, no), UndefinedReadoutError, "no linear value map")


def test_value_map_shared_keys_and_the_resid_and_visual_sites_are_refused(traced):
    m, tr, inputs = traced
    a = m.adapter
    for block in range(a.n_layers):
        _assert_refused(lambda b=block: a.W_V(b), UndefinedReadoutError, "v_norm")
        _assert_refused(lambda b=block: a.kv_norm(b), UndefinedReadoutError, "predicted stream 0")
        _assert_refused(lambda b=block: ov_circuit(a, b, 0), UndefinedReadoutError, "no linear value map")
    for consumer, producer in ((2, 0), (3, 1)):
        _assert_refused(lambda c=consumer: qk_circuit(a, c, 0), UndefinedReadoutError, f"L{producer}'s keys")
    assert qk_circuit(a, 1, 0).singular_values.shape == (a.d_head,)  # a producer's is defined
    _assert_refused(
        lambda: edited_logits(m, inputs, [Edit(1, None, [3], site="resid")]), InterventionError, "4 AltUp streams"
    )
    for site in ("vision_out", "projector_out"):
        _assert_refused(lambda s=site: a.visual_site_module(s), InterventionError, "embed_vision runs twice")


def test_softcap_and_kv_sharing_follow_the_config():
    """Another model: cap 10, no KV-sharing layers. Every layer keys itself (and has a
    W_K), and the lens's last row is this model's logits: the cap is the config's."""
    from tests.core.tiny_gemma3n import tiny_gemma3n_float64 as build

    model, processor = build(num_kv_shared_layers=0, final_logit_softcapping=10.0)
    a = Gemma3nAdapter(model, processor, processor.tokenizer)
    m = LoadedModel("tiny-gemma3n-unshared", a.family, model, processor, processor.tokenizer, a)
    assert [a.kv_producer(b) for b in range(4)] == [0, 1, 2, 3] and a.W_K(3).shape == (4, 64, 16)
    tr = capture(m, noise_image(IMAGE_SIZE), QUESTION)
    yes, no = a.token_id("yes"), a.token_id("no")
    assert_lens_last_row_is_the_model(a, tr, logit_lens(a, tr, yes, no), yes, no)
    p = int(tr.answer_positions[0])
    with torch.no_grad():
        uncapped = a.final_norm_layer()(tr.final_resid[0, p]) @ a.W_U
    assert float((30 * torch.tanh(uncapped / 30) - tr.logits[0, p]).abs().max()) > 1e-2  # not the default cap's
    assert a.cap_logits(torch.tensor([1e6])).item() == pytest.approx(10.0)


# ---- prompt and geometry


def test_prompt_and_processor_layout(traced):
    """<bos> ... \\n\\n <start_of_image> [16 soft tokens] <end_of_image> \\n\\n question ...;
    boi / eoi are visual delimiters, the soft tokens visual."""
    m, tr, inputs = traced
    a = m.adapter
    tokens = a.tokenizer.convert_ids_to_tokens(inputs.input_ids[0].tolist())
    boi = tokens.index("<start_of_image>")
    vis = list(range(boi + 1, boi + 1 + N_IMAGE_TOKENS))
    assert a.visual_positions(inputs)[0].tolist() == vis
    assert tokens[boi + 1 + N_IMAGE_TOKENS] == "<end_of_image>" and tokens[-2:] == ["model", "\n"]
    roles = a.token_roles(tr)
    assert roles[0] == "sink" and roles[boi] == roles[boi + 1 + N_IMAGE_TOKENS] == "visual_delimiter"
    assert a.visual_delimiter_positions(tr) == [boi, boi + 1 + N_IMAGE_TOKENS]
    assert all(roles[i] == "visual" for i in vis)


@pytest.mark.parametrize("size", [(90, 60), (40, 70), (128, 128)])
def test_visual_tokens_tile_the_stretched_image(size):
    m = tiny_gemma3n_float64()
    a = m.adapter
    inputs = a.prepare([noise_image(size)], [QUESTION])
    vis = a.visual_positions(inputs)[0].tolist()
    tokens = a.visual_tokens(size, vis)
    assert len(tokens) == N_IMAGE_TOKENS and [t.position for t in tokens] == vis
    assert (tokens[-1].row, tokens[-1].col) == (GRID - 1, GRID - 1) and (tokens[1].row, tokens[1].col) == (0, 1)
    assert tokens[0].box[:2] == [0.0, 0.0] and tokens[-1].box[2:] == pytest.approx([size[0], size[1]])
    w, h = tokens[0].box[2] - tokens[0].box[0], tokens[0].box[3] - tokens[0].box[1]
    cell = IMAGE_SIDE / GRID
    assert (w, h) == pytest.approx((cell * size[0] / IMAGE_SIDE, cell * size[1] / IMAGE_SIDE))


def test_qk_stands_where_the_ov_circuit_is_not_defined():
    """qk-ov of a head: the QK circuit and the realised scores are defined (and equal the
    model's); the OV circuit and the copying score are not (the values pass a per-head norm):
    marked not defined in the result, its lines and an audit row, never a number."""
    from core.methods.qk_ov import qk_ov

    m = traced_case(CASES[0])[0]
    result = qk_ov(m, "L1.H0", noise_image(IMAGE_SIZE), QUESTION)
    ov = result.weight_level["ov"]
    assert ov["singular_values"] is None and "no linear value map W_V" in ov["not_defined"]
    assert result.weight_level["qk"]["singular_values"] and result.weight_level["copying"] is None
    assert any(line.startswith("OV not defined: ") for line in result.weight_lines())
    assert "OV not defined" in result.summary()
    refused = [a for a in result.audit_records() if a.parameters.get("defined") is False]
    assert len(refused) == 1 and refused[0].parameters["part"] == "OV"
    agreement = result.activation_level["agreement"]["max_abs_score_difference"]
    tr = traced_case(CASES[0])[1]
    assert agreement <= realized_scores_tol(m.adapter, tr, 1)  # the realised scores are the model's
