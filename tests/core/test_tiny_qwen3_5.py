"""The tiny random float64 Qwen3.5 of tests/core/tiny_qwen3_5.py: its processor's
image-token expansion matches the vision path, a forward is finite, generate's
hybrid cache (KV for full attention, conv + recurrent state for Gated DeltaNet)
reproduces a greedy loop of no-cache forwards, and both token mixers are
recomputed by hand from their weights (the adapter's reference formulas).

The model is float64 but parts of it compute in float32 (its RMSNorms, the gated
norm, the rotary cos / sin, the whole gated delta rule and its recurrent state):
recomputations agree to float32 rounding, not to float64."""

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.core.exactness import noise_image
from tests.core.tiny_qwen3_5 import (
    IMAGE_SIZE,
    LAYER_TYPES,
    MERGE,
    MROPE_SECTION,
    PARTIAL_ROTARY,
    QUESTION,
    tiny_inputs,
    tiny_model,
)

F32 = 2.0**-24  # float32 unit roundoff: the model's float32 steps bound every recomputation's error


@functools.cache
def _built():
    return tiny_model()


@pytest.fixture(scope="module")
def built():
    return _built()


def _capture_mixers(model, **inputs):
    """Run ``model`` and return (output, {layer: (mixer input, mixer output, layer input, layer output)})."""
    lm = model.model.language_model
    seen, handles = {}, []
    for i, layer in enumerate(lm.layers):
        mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn

        def mix_hook(mod, args, kwargs, out, i=i):
            seen.setdefault(i, {})["x"] = kwargs["hidden_states"]
            seen[i]["mix"] = out if torch.is_tensor(out) else out[0]

        def layer_hook(mod, args, kwargs, out, i=i):
            seen.setdefault(i, {})["resid_pre"] = args[0] if args else kwargs["hidden_states"]
            seen[i]["resid_post"] = out

        handles.append(mixer.register_forward_hook(mix_hook, with_kwargs=True))
        handles.append(layer.register_forward_hook(layer_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return out, seen


@torch.no_grad()
def test_image_tokens_match_the_vision_features(built):
    """One <|image_pad|> per 2 x 2 merged patch; the merger's rows are the tokens, 3 x 4 here."""
    model, processor = built
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    n_tokens = int((inputs.input_ids == model.config.image_token_id).sum())
    t, h, w = inputs.image_grid_thw[0].tolist()
    assert (t, h // MERGE, w // MERGE) == (1, 3, 4)
    with torch.no_grad():
        feats = model.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw, return_dict=True)
    assert len(feats.pooler_output) == 1
    assert feats.pooler_output[0].shape == (n_tokens, model.config.text_config.hidden_size) == (12, 64)
    assert torch.equal(inputs.mm_token_type_ids[0] == 1, inputs.input_ids[0] == model.config.image_token_id)
    unk = processor.tokenizer.unk_token_id
    assert not (inputs.input_ids == unk).any()


@torch.no_grad()
def test_forward_is_finite_in_float64(built):
    model, processor = built
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert [layer.block_type for layer in model.model.language_model.layers] == LAYER_TYPES
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.dtype == torch.float64
    assert logits.shape == (1, inputs.input_ids.shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_generate_with_cache_equals_a_greedy_no_cache_loop(built):
    """The generation oracle: generate's hybrid cache gives, token for token, what
    full no-cache forwards give; the logits agree to float32 rounding."""
    model, processor = built
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    n = inputs.input_ids.shape[1]
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert gen.sequences.shape[1] == n + 4
    ids, types = inputs.input_ids, inputs.mm_token_type_ids
    for step in range(4):
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=types,
                pixel_values=inputs.pixel_values,
                image_grid_thw=inputs.image_grid_thw,
                use_cache=False,
            ).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float((gen.logits[step][0] - logits).abs().max())
        assert gap <= 1e3 * F32 * float(logits.abs().max())
        assert float(top2[0] - top2[1]) > 10 * gap  # no near-tie: the comparison means something
        nxt = logits.argmax().view(1, 1)
        assert int(nxt) == int(gen.sequences[0, n + step])
        ids = torch.cat([ids, nxt], dim=1)
        types = torch.cat([types, torch.zeros_like(nxt)], dim=1)


def _cache_layer_types(cache):
    return [type(layer).__name__ for layer in cache.layers]


def delta_rule_inputs(mod, x):
    """``x (T, d_model)``: the linear-attention layer's input (after input_layernorm).
    Returns the per-value-head q, k (L2-normed; q also / sqrt(dk)) ``(T, Hv, dk)``,
    v ``(T, Hv, dv)``, beta and the log decay g ``(T, Hv)``, the gate z ``(T, Hv, dv)``
    and the convolution's input ``(T, conv_dim)``, in float64."""
    T = x.shape[0]
    K = mod.conv_kernel_size
    mixed = x @ mod.in_proj_qkv.weight.T  # (T, 2 key_dim + value_dim), channels [q | k | v]
    w = mod.conv1d.weight[:, 0, :]  # (conv_dim, K): depthwise, causal
    padded = torch.cat([mixed.new_zeros(K - 1, mixed.shape[1]), mixed])
    conv = F.silu(torch.stack([(padded[t : t + K] * w.T).sum(0) for t in range(T)]))
    q, k, v = conv.split([mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    hv, hk, dk, dv = mod.num_v_heads, mod.num_k_heads, mod.head_k_dim, mod.head_v_dim
    # key head j serves value heads j * hv/hk ... (j + 1) * hv/hk - 1 (repeat_interleave)
    q = q.view(T, hk, dk).repeat_interleave(hv // hk, dim=1)
    k = k.view(T, hk, dk).repeat_interleave(hv // hk, dim=1)
    v = v.view(T, hv, dv)
    l2 = lambda a: a * torch.rsqrt((a * a).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = l2(q) * dk**-0.5, l2(k)
    beta = torch.sigmoid(x @ mod.in_proj_b.weight.T)  # (T, hv)
    g = -mod.A_log.exp() * F.softplus(x @ mod.in_proj_a.weight.T + mod.dt_bias)  # (T, hv), log decay <= 0
    z = (x @ mod.in_proj_z.weight.T).view(T, hv, dv)
    return q, k, v, beta, g, z, mixed


def gated_delta_net_by_hand(mod, x):
    """Returns (output (T, d_model), conv state (conv_dim, K), recurrent state (Hv, dk, dv)),
    in float64, by the token-by-token gated delta rule, and the rule's output o (T, Hv, dv)."""
    q, k, v, beta, g, z, mixed = delta_rule_inputs(mod, x)
    T, hv, dk, dv = x.shape[0], mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
    S = x.new_zeros(hv, dk, dv)
    o = x.new_zeros(T, hv, dv)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + torch.einsum("hk,hv->hkv", k[t], delta)  # S_t = a_t (I - b_t k k^T) S_{t-1} + b_t k v^T
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mod.norm.variance_epsilon)
    gated = mod.norm.weight * normed * F.silu(z)  # per value head, gain shared by the heads
    out = gated.reshape(T, hv * dv) @ mod.out_proj.weight.T
    return out, mixed[-mod.conv_kernel_size :].T, S, o


def effective_mixing(mod, x):
    """``(Hv, T, T)``: W[h, t, s] = q_t^T M_t M_{t-1} ... M_{s+1} (beta_s k_s), with
    M_r = a_r (I - beta_r k_r k_r^T), a_r = exp(g_r): the rule's output is o_t = sum_s W[t, s] v_s."""
    q, k, _, beta, g, _, _ = delta_rule_inputs(mod, x)
    T, a = x.shape[0], g.exp()
    W = x.new_zeros(mod.num_v_heads, T, T)
    for s in range(T):
        u = beta[s][:, None] * k[s]  # (Hv, dk): what token s wrote, carried forward
        W[:, s, s] = (q[s] * u).sum(-1)
        for t in range(s + 1, T):
            u = a[t][:, None] * (u - beta[t][:, None] * k[t] * (k[t] * u).sum(-1, keepdim=True))
            W[:, t, s] = (q[t] * u).sum(-1)
    return W


@pytest.mark.parametrize("question", [QUESTION, " ".join(["red"] * 60) + " ?"])
@torch.no_grad()
def test_gated_delta_net_by_hand_and_its_cache(built, question):
    """Both linear-attention layers' outputs, recomputed by the token-by-token rule
    (the long question spans two of the fallback's 64-token chunks); the cache after
    a prefill holds the last K inputs of the convolution and the final state S."""
    model, processor = built
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE), question)
    out, seen = _capture_mixers(model, **inputs, use_cache=True)
    cache = out.cache
    assert _cache_layer_types(cache) == ["LinearAttentionLayer", "DynamicLayer"] * 2
    T = inputs.input_ids.shape[1]
    assert int(cache.get_seq_length()) == T and (T > 64) == (question != QUESTION)
    for i, kind in enumerate(LAYER_TYPES):
        if kind != "linear_attention":
            continue
        mod = model.model.language_model.layers[i].linear_attn
        y, conv_state, S, _ = gated_delta_net_by_hand(mod, seen[i]["x"][0])
        got = seen[i]["mix"][0]
        assert float((y - got).abs().max()) <= 1e3 * F32 * float(got.abs().max())
        layer = cache.layers[i]
        assert layer.conv_states[0].dtype == torch.float64
        assert torch.equal(layer.conv_states[0][0], conv_state)  # pre-conv, pre-activation projections
        assert layer.recurrent_states[0].dtype == torch.float32  # the delta rule runs in float32
        assert layer.recurrent_states[0].shape == (1, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim)
        assert float((layer.recurrent_states[0][0] - S).abs().max()) <= 1e3 * F32 * float(S.abs().max())


@torch.no_grad()
def test_delta_rule_is_an_effective_mixing_matrix_times_values(built):
    """The delta rule's output (the gated norm's input) is linear in the values:
    o_t = sum_{s <= t} W[t, s] v_s per value head, W built from q, k, beta, decay only;
    a plain decayed q.k "pattern" (no delta correction) is far off."""
    model, processor = built
    layer = model.model.language_model.layers[2]
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    got = {}
    handle = layer.linear_attn.norm.register_forward_pre_hook(lambda mod, args: got.__setitem__("o", args[0]))
    try:
        _, seen = _capture_mixers(model, **inputs)
    finally:
        handle.remove()
    x = seen[2]["x"][0]
    mod = layer.linear_attn
    o = got["o"].view(x.shape[0], mod.num_v_heads, mod.head_v_dim)  # norm input: (T * Hv, dv)
    _, k, v, beta, g, _, _ = delta_rule_inputs(mod, x)
    W = effective_mixing(mod, x)
    assert torch.all(W.triu(1) == 0)
    tol = 1e3 * F32 * float(o.abs().max())
    assert float((torch.einsum("hts,shd->thd", W, v) - o).abs().max()) <= tol
    q = delta_rule_inputs(mod, x)[0]
    cum = g.cumsum(0)  # (T, Hv)
    decay = (cum[:, None] - cum[None, :]).permute(2, 0, 1).exp().tril()
    plain = torch.einsum("thd,shd->hts", q, k * beta[..., None]) * decay
    assert float((torch.einsum("hts,shd->thd", plain, v) - o).abs().max()) > 100 * tol


def _mrope(x, positions, inv_freq, split=None):
    """Interleaved M-RoPE on the first ``2 * len(inv_freq)`` dims of ``x (T, H, d)``:
    frequency j turns with the height id if j % 3 == 1 and j < 3 * section[1], the
    width id if j % 3 == 2 and j < 3 * section[2], else the temporal id; dim j pairs
    with dim j + half inside the rotary slice (rotate_half of the slice; ``split``:
    pair it with j + split instead). ``positions (3, T)``."""
    half = inv_freq.shape[0]
    split = split or half
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * MROPE_SECTION[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * MROPE_SECTION[2])] = 2
    angle = positions[axis].T.double() * inv_freq.double()  # (T, half)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    out = x.clone()
    x1, x2 = x[..., :half], x[..., split : split + half]
    out[..., :half], out[..., split : split + half] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


def gated_attention_by_hand(attn, x, positions, inv_freq, gate=True, split=None):
    """``x (T, d_model)`` after input_layernorm: q_proj gives per head [query | gate]
    (d_head each), q/k RMSNorm with gain 1 + w, partial interleaved M-RoPE, causal
    softmax(q k^T / sqrt(d_head)) v over grouped kv heads, times sigmoid(gate), o_proj."""
    T, d = x.shape[0], attn.head_dim
    n_heads = attn.q_proj.out_features // (2 * d)
    qg = (x @ attn.q_proj.weight.T).view(T, n_heads, 2 * d)
    q, g = qg[..., :d], qg[..., d:]
    k = (x @ attn.k_proj.weight.T).view(T, -1, d)
    v = (x @ attn.v_proj.weight.T).view(T, -1, d)
    rms = lambda a, w: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + attn.q_norm.eps) * (1 + w)  # noqa: E731
    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = _mrope(q, positions, inv_freq, split), _mrope(k, positions, inv_freq, split)
    group = n_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    heads = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    if gate:
        heads = heads * torch.sigmoid(g)
    return heads.reshape(T, n_heads * d) @ attn.o_proj.weight.T


@torch.no_grad()
def test_gated_attention_by_hand(built):
    """The full-attention layers: output gate from q_proj's second half per head,
    (1 + w) q/k norms, RoPE on the first quarter of each head (interleaved M-RoPE on
    the 3-D positions of get_rope_index); without the gate, or pairing dim j with
    j + d_head / 2 (a full-head rotate_half), far off."""
    model, processor = built
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    _, seen = _capture_mixers(model, **inputs)
    positions, _ = model.model.get_rope_index(
        inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, attention_mask=inputs.attention_mask
    )
    positions = positions[:, 0]
    vis = (inputs.input_ids[0] == model.config.image_token_id).nonzero().flatten()
    assert not torch.equal(positions[1, vis], positions[2, vis])  # rows and columns differ: M-RoPE matters
    inv_freq = model.model.language_model.rotary_emb.inv_freq
    assert inv_freq.shape[0] == int(32 * PARTIAL_ROTARY) // 2 == sum(MROPE_SECTION)
    for i, kind in enumerate(LAYER_TYPES):
        if kind != "full_attention":
            continue
        attn = model.model.language_model.layers[i].self_attn
        x, got = seen[i]["x"][0], seen[i]["mix"][0]
        want = gated_attention_by_hand(attn, x, positions, inv_freq)
        tol = 1e3 * F32 * float(got.abs().max())
        assert float((want - got).abs().max()) <= tol
        for variant in ({"gate": False}, {"split": attn.head_dim // 2}):
            other = gated_attention_by_hand(attn, x, positions, inv_freq, **variant)
            assert float((other - got).abs().max()) > 100 * tol, variant


@torch.no_grad()
def test_layers_are_two_residual_adds_and_norms_are_one_plus_w(built):
    """x_out = x + mixer(norm1(x)) + mlp(norm2(x + mixer)) in every layer, each
    RMSNorm scales by (1 + w); hidden_states[-1] is the final norm's output (not the
    last layer's), and lm_head reads it."""
    model, processor = built
    lm = model.model.language_model
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    out, seen = _capture_mixers(model, **inputs, output_hidden_states=True)
    for i, layer in enumerate(lm.layers):
        r = seen[i]["resid_pre"]
        norm = layer.input_layernorm
        by_hand = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)
        assert float((by_hand - seen[i]["x"]).abs().max()) <= 1e2 * F32 * float(by_hand.abs().max())
        mid = r + seen[i]["mix"]
        with torch.no_grad():
            want = mid + layer.mlp(layer.post_attention_layernorm(mid))
        assert torch.equal(want, seen[i]["resid_post"])
        assert torch.equal(out.hidden_states[i], r)
    with torch.no_grad():
        final = lm.norm(seen[len(LAYER_TYPES) - 1]["resid_post"])
        assert torch.equal(out.hidden_states[-1], final)
        assert torch.equal(model.lm_head(final), out.logits)


@torch.no_grad()
def test_right_padded_batch_rows_equal_their_single_runs(built):
    """Right padding (what an adapter should use): each row's real positions equal
    its own unpadded run, in the linear-attention layers too."""
    model, processor = built
    images = [noise_image((60, 130), 1), noise_image(IMAGE_SIZE, 2)]  # 8 and 12 visual tokens
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    processor.tokenizer.padding_side = "right"
    try:
        batch = processor(images=images, text=[prompt, prompt], return_tensors="pt", padding=True)
    finally:
        processor.tokenizer.padding_side = "left"
    assert not batch.attention_mask[0].all()
    with torch.no_grad():
        logits = model(**batch).logits
        for row, image in enumerate(images):
            single = processor(images=[image], text=[prompt], return_tensors="pt")
            want = model(**single).logits[0]
            n = want.shape[0]
            assert int(batch.attention_mask[row].sum()) == n
            assert float((logits[row, :n] - want).abs().max()) <= 1e3 * F32 * float(want.abs().max())
