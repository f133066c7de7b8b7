"""The tiny Gemma 3n (tests/core/tiny_gemma3n.py): the processor's image-token
expansion against the vision path, a finite forward, cached generate against a
greedy loop of full no-cache forwards, and the architecture as described in the
adapter memo, checked by an independent float64 re-implementation of the whole
text decoder (embedding merge, per-layer inputs, AltUp predict / correct, LAuReL,
KV sharing, sliding masks, the 4-stream merge before the final norm, softcapping)."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers.models.gemma3n.modeling_gemma3n as modeling

from tests.core.exactness import noise_image
from tests.core.tiny_gemma3n import (
    GRID,
    IMAGE_SIDE,
    IMAGE_SIZE,
    LAYER_TYPES,
    N_IMAGE_TOKENS,
    N_TEXT,
    QUESTION,
    SLIDING_WINDOW,
    SPARSITY,
    VOCAB_SIZE,
    WORDS,
    tiny_inputs,
    tiny_model,
)


@pytest.fixture(scope="module")
def case():
    model, processor = tiny_model()
    inputs = tiny_inputs(processor, noise_image(IMAGE_SIZE))
    return model, processor, inputs


def test_vocabulary_and_question_tokenize_without_unknowns():
    _, processor = tiny_model()
    tok = processor.tokenizer
    assert len(tok) == VOCAB_SIZE
    for text in (QUESTION, "what color is the square?", WORDS):
        assert tok.unk_token_id not in tok(text)["input_ids"]
    # the real id layout: boi / boa are text tokens; eoi, the image token, eoa, the audio
    # token sit in the vision / audio vocabularies that start at N_TEXT
    assert tok.boi_token_id < N_TEXT and tok.boa_token_id < N_TEXT
    assert (tok.eoi_token_id, tok.image_token_id) == (N_TEXT, N_TEXT + 1)
    assert (tok.eoa_token_id, tok.audio_token_id) == (N_TEXT + 2, N_TEXT + 3)


def test_image_token_expansion_matches_the_vision_path(case):
    """\\n\\n <start_of_image> [16 x <image_soft_token>] <end_of_image> \\n\\n; the tower
    gives (1, 2048, 4, 4) and get_image_features 16 soft tokens of d_model."""
    model, processor, inputs = case
    tok = processor.tokenizer
    ids = inputs["input_ids"][0]
    n_image = int((ids == model.config.image_token_id).sum())
    assert n_image == N_IMAGE_TOKENS == model.config.vision_soft_tokens_per_image
    tokens = tok.convert_ids_to_tokens(ids.tolist())
    boi = tokens.index("<start_of_image>")
    assert tokens[boi + 1 : boi + 1 + n_image] == ["<image_soft_token>"] * n_image
    assert tokens[boi + 1 + n_image : boi + 3 + n_image] == ["<end_of_image>", "\n\n"]
    assert tokens[:3] == ["<bos>", "<start_of_turn>", "user"] and tokens[-3:] == ["<start_of_turn>", "model", "\n"]
    assert inputs["token_type_ids"][0].nonzero().flatten().tolist() == list(range(boi + 1, boi + 1 + n_image))
    assert inputs["pixel_values"].shape == (1, 3, IMAGE_SIDE, IMAGE_SIDE)
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], return_dict=True)
    assert out.last_hidden_state.shape == (1, 2048, GRID, GRID)
    assert out.pooler_output.shape == (1, n_image, model.config.text_config.hidden_size)


def test_forward_gives_finite_softcapped_logits(case):
    model, _, inputs = case
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], VOCAB_SIZE) and logits.dtype == torch.float64
    assert torch.isfinite(logits).all() and logits.abs().max() < 30.0
    assert logits.abs().max() > 3.0  # the tanh cap is in its curved range


def greedy_no_cache(model, inputs, n_new: int, eos: int):
    """Full forwards of the growing sequence, no cache, argmax of the last row each time."""
    ids = inputs["input_ids"]
    steps = []
    for _ in range(n_new):
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=inputs["pixel_values"],
                use_cache=False,
            ).logits[:, -1]
        steps.append(logits)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        if int(ids[0, -1]) == eos:
            break
    return ids, steps


def test_generate_with_cache_is_the_no_cache_greedy_loop(case):
    """generate (DynamicCache: sliding / full layers, dummy layers for the KV-sharing
    consumers) equals full re-runs token for token, and step logits agree to float32 rounding."""
    model, processor, inputs = case
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ids, steps = greedy_no_cache(model, inputs, 4, processor.tokenizer.eos_token_id)
    assert out.sequences.shape[1] == n + 4  # no early <eos>: the oracle compares 4 steps
    assert torch.equal(out.sequences, ids)
    assert "<end_of_audio>" in processor.tokenizer.convert_ids_to_tokens(ids[0, n:].tolist())
    for cached, plain in zip(out.logits, steps):  # generate hands its logits back in float32
        torch.testing.assert_close(cached.double(), plain, atol=1e-5, rtol=0)


# ---- an independent float64 re-implementation of the text path (the memo's description)


def rms(x, weight=None, eps=1e-6):
    y = x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5
    return y if weight is None else y * weight


def rope_cos_sin(theta: float, head_dim: int, n: int):
    """The model's cos / sin: angles and their cos / sin in float32, then float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angle = torch.arange(n).float()[:, None] * inv_freq
    emb = torch.cat([angle, angle], -1)
    return emb.cos().double(), emb.sin().double()


def rotate(x, cos, sin):  # x (n, heads, d): rotate-half RoPE
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def embed_by_hand(model, ids, soft):
    """x_0 (n, d): text ids W_E[id] sqrt(d); vision / audio vocabulary ids through their
    embedder's hard path; image placeholders replaced by the soft tokens, in order."""
    lm, mm = model.model.language_model, model.model
    x = lm.embed_tokens.weight[ids] * math.sqrt(lm.config.hidden_size)
    for emb in (mm.embed_vision, mm.embed_audio):
        sel = (ids >= emb.vocab_offset) & (ids < emb.vocab_offset + emb.vocab_size)
        hard = rms(emb.embedding.weight[ids[sel] - emb.vocab_offset], emb.hard_embedding_norm.weight)
        x[sel] = rms(hard @ emb.embedding_projection.weight.T)
    soft_in = rms(soft * math.sqrt(model.config.vision_config.hidden_size), mm.embed_vision.soft_embedding_norm.weight)
    x[ids == model.config.image_token_id] = rms(soft_in @ mm.embed_vision.embedding_projection.weight.T)
    return x


def per_layer_inputs_by_hand(model, ids, x0):
    """(n, layers, p): (norm(W x_0 / sqrt(d)) + E_pl[id] sqrt(p)) / sqrt(2); ids outside the
    text vocabulary (vision / audio ids) read row 0."""
    lm = model.model.language_model
    cfg = lm.config
    L, p = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    proj = (x0 @ lm.per_layer_model_projection.weight.T) * cfg.hidden_size**-0.5
    proj = rms(proj.reshape(-1, L, p), lm.per_layer_projection_norm.weight)
    table_ids = torch.where(ids < cfg.vocab_size_per_layer_input, ids, 0)
    tok = lm.embed_tokens_per_layer.weight[table_ids].reshape(-1, L, p) * math.sqrt(p)
    return (proj + tok) * 2**-0.5


def magnitude_matched(y, target_rms):
    return y * target_rms / y.pow(2).mean(-1, keepdim=True).clamp(min=1e-5).sqrt()


def decoder_by_hand(model, x0, pli, variant=None):
    """The text decoder on one sequence; returns (per-layer 4-stream outputs, the final
    norm's input, logits). ``variant`` breaks one described step (non-vacuity)."""
    lm = model.model.language_model
    cfg = lm.config
    n, d = x0.shape
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n_streams, active = cfg.altup_num_inputs, cfg.altup_active_idx
    target = x0.pow(2).mean(-1, keepdim=True).sqrt()
    streams = torch.stack([x0] + [magnitude_matched(x0 @ P.weight.T, target) for P in lm.altup_projections])
    theta = {t: cfg.rope_parameters[t]["rope_theta"] for t in set(cfg.layer_types)}
    q_idx, k_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = {
        "full_attention": k_idx <= q_idx,
        "sliding_attention": (k_idx <= q_idx) & (q_idx - k_idx < cfg.sliding_window),
    }
    shared, outputs = {}, []
    for i, layer in enumerate(lm.layers):
        kind = cfg.layer_types[i]
        altup, attn = layer.altup, layer.self_attn

        def modalities(x, altup=altup):  # the router: tanh(W_r (norm(x) / d_model)), both steps
            return torch.tanh((rms(x, altup.router_norm.weight) / d) @ altup.modality_router.weight.T)

        # AltUp predict: pred_i = s_i + sum_j c_ij(s_active) s_j
        coefs = (modalities(streams[active]) @ altup.prediction_coefs.weight.T).reshape(n, n_streams, n_streams)
        pred = streams + torch.einsum("tij,jtd->itd", coefs, streams)
        a = pred[active]
        xn = rms(a, layer.input_layernorm.weight)
        laurel = xn + rms(
            xn @ layer.laurel.linear_left.weight.T @ layer.laurel.linear_right.weight.T,
            layer.laurel.post_laurel_norm.weight,
        )
        cos, sin = rope_cos_sin(theta[kind], hd, n)
        q = rotate(rms((xn @ attn.q_proj.weight.T).reshape(n, H, hd), attn.q_norm.weight), cos, sin)
        if not attn.is_kv_shared_layer:
            k = rotate(rms((xn @ attn.k_proj.weight.T).reshape(n, KV, hd), attn.k_norm.weight), cos, sin)
            v = rms((xn @ attn.v_proj.weight.T).reshape(n, KV, hd))  # v_norm: no gain
            shared[kind] = (k, v)
        else:  # the last non-consumer layer of the same type (variant: of the other type)
            k, v = shared[kind if variant != "kv_other_type" else ({*shared} - {kind}).pop()]
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scale = hd**-0.5 if variant == "scaled_scores" else 1.0
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pattern = scores.masked_fill(~allowed[kind], -math.inf).softmax(-1)
        z = torch.einsum("hqk,khd->qhd", pattern, v).reshape(n, H * hd)
        attn_out = rms(z @ attn.o_proj.weight.T, layer.post_attention_layernorm.weight)
        h = (a + attn_out + laurel) / math.sqrt(2)
        g = rms(h, layer.pre_feedforward_layernorm.weight) @ layer.mlp.gate_proj.weight.T
        if SPARSITY[i] > 0 and variant != "dense":
            z_s = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(SPARSITY[i])))
            g = F.relu(g - (g.mean(-1, keepdim=True) + g.std(-1, keepdim=True, unbiased=False) * z_s))
        up = rms(h, layer.pre_feedforward_layernorm.weight) @ layer.mlp.up_proj.weight.T
        mlp = (F.gelu(g, approximate="tanh") * up) @ layer.mlp.down_proj.weight.T
        h = h + rms(mlp, layer.post_feedforward_layernorm.weight)
        # AltUp correct: s_i = pred_i + (1 + c_i(h)) (h - pred_active)
        ccoef = modalities(h) @ altup.correction_coefs.weight.T + 1.0  # (n, streams)
        streams = pred + ccoef.T[:, :, None] * (h - a)[None]
        # per-layer input, written into streams 1.. only
        gate = F.gelu(
            (streams[active] * altup.correct_output_scale) @ layer.per_layer_input_gate.weight.T, approximate="tanh"
        )
        write = rms((gate * pli[:, i]) @ layer.per_layer_projection.weight.T, layer.post_per_layer_input_norm.weight)
        streams = torch.cat([streams[:1], streams[1:] + write[None]])
        outputs.append(streams)
    target = streams[0].pow(2).mean(-1, keepdim=True).sqrt()
    merged = [streams[0]] + [
        magnitude_matched(streams[j] @ U.weight.T, target) if variant != "no_rescale" else streams[j] @ U.weight.T
        for j, U in enumerate(lm.altup_unembed_projections, start=1)
    ]
    final_in = streams[0] if variant == "active_only" else torch.stack(merged).mean(0)
    logits = rms(final_in, lm.norm.weight) @ model.lm_head.weight.T
    cap = cfg.final_logit_softcapping
    return outputs, final_in, (logits if variant == "no_softcap" else cap * torch.tanh(logits / cap))


def recorded_forward(model, inputs):
    """The model's own x_0 / per-layer inputs (language_model's kwargs), the final norm's
    input, the per-layer 4-stream outputs, the tower's soft features and the logits."""
    lm = model.model.language_model
    rec = {}
    hooks = [
        lm.register_forward_pre_hook(lambda m, a, kw: rec.update(lm_kwargs=kw), with_kwargs=True),
        lm.norm.register_forward_pre_hook(lambda m, a: rec.update(final_in=a[0])),
    ]
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
            soft = model.model.vision_tower(pixel_values=inputs["pixel_values"], do_pooling=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    rec["soft"] = soft.flatten(2).transpose(1, 2)[0]  # (16, 2048), row-major over the 4 x 4 map
    rec["hidden_states"], rec["logits"] = out.hidden_states, out.logits
    return rec


def test_decoder_by_hand_is_the_model(case):
    """The memo's description, re-implemented in float64, reproduces x_0, the per-layer
    inputs, every layer's 4 streams, the final norm's input and the logits (the model
    rounds its RMSNorms and AltUp's tanh in float32: 1e-5); each of six one-step
    deviations from the description misses the logits by far more."""
    model, _, inputs = case
    rec = recorded_forward(model, inputs)
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        x0 = embed_by_hand(model, ids, rec["soft"])
        pli = per_layer_inputs_by_hand(model, ids, x0)
        outputs, final_in, logits = decoder_by_hand(model, x0, pli)
    torch.testing.assert_close(x0, rec["lm_kwargs"]["inputs_embeds"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        pli,
        model.model.language_model.project_per_layer_inputs(
            rec["lm_kwargs"]["inputs_embeds"], rec["lm_kwargs"]["per_layer_inputs"]
        )[0],
        atol=1e-5,
        rtol=0,
    )
    hs = rec["hidden_states"]
    assert len(hs) == len(LAYER_TYPES) + 1 and hs[0].shape == (4, 1, ids.shape[0], x0.shape[1])
    assert torch.equal(hs[0][0, 0], rec["lm_kwargs"]["inputs_embeds"][0])  # stream 0 of the stack is x_0
    for layer, streams in enumerate(outputs):
        torch.testing.assert_close(streams, hs[layer + 1][:, 0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(final_in, rec["final_in"][0], atol=5e-5, rtol=0)
    torch.testing.assert_close(logits, rec["logits"][0], atol=5e-5, rtol=0)
    for variant in ("kv_other_type", "scaled_scores", "dense", "no_rescale", "active_only", "no_softcap"):
        with torch.no_grad():
            other = decoder_by_hand(model, x0, pli, variant)[2]
        assert (other - rec["logits"][0]).abs().max() > 1e-2, variant


def test_kv_sharing_consumers_attend_with_the_producers_keys(case, monkeypatch):
    """Layer 2 (sliding) reads layer 0's K / V and layer 3 (full) layer 1's, the very
    tensors, in a plain no-cache forward; consumers own q_proj / q_norm / o_proj only.
    Scores are q k^T with scaling 1.0 (no 1 / sqrt(d_head)); the sliding layers mask
    keys 8 or more positions back."""
    model, _, inputs = case
    attn_mods = [layer.self_attn for layer in model.model.language_model.layers]
    assert [m.is_kv_shared_layer for m in attn_mods] == [False, False, True, True]
    assert not hasattr(attn_mods[2], "k_proj") and not hasattr(attn_mods[3], "v_norm")
    assert all(m.scaling == 1.0 for m in attn_mods)
    seen = {}
    original = modeling.eager_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, **kwargs)
        seen[module.layer_idx] = (query, key, value, attention_mask, weights, kwargs.get("scaling"))
        return out, weights

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    for consumer, producer in ((2, 0), (3, 1)):
        assert seen[consumer][1] is seen[producer][1] and seen[consumer][2] is seen[producer][2]
        assert not torch.equal(seen[consumer][0], seen[producer][0])
    n = inputs["input_ids"].shape[1]
    for layer, (q, k, _, mask, weights, scaling) in seen.items():
        assert scaling == 1.0
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        torch.testing.assert_close((q @ k.transpose(-1, -2) + mask).softmax(-1), weights, atol=1e-6, rtol=0)
        allowed = mask[0, 0] == 0
        q_idx, k_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
        want = k_idx <= q_idx
        if LAYER_TYPES[layer] == "sliding_attention":
            want &= q_idx - k_idx < SLIDING_WINDOW
        assert torch.equal(allowed, want)


def test_soft_tokens_are_the_pooled_map_row_major(case):
    """Soft token k is cell (k // 4, k % 4) of the tower's (1, 2048, 4, 4) map, through
    the embedder (x sqrt(2048), soft norm, projection, unscaled norm)."""
    model, _, inputs = case
    mm = model.model
    with torch.no_grad():
        out = mm.get_image_features(inputs["pixel_values"], return_dict=True)
        fmap = out.last_hidden_state[0]
        for k in (0, 1, GRID, 2 * GRID + 3, N_IMAGE_TOKENS - 1):
            f = fmap[:, k // GRID, k % GRID] * math.sqrt(fmap.shape[0])
            want = rms(
                rms(f, mm.embed_vision.soft_embedding_norm.weight) @ mm.embed_vision.embedding_projection.weight.T
            )
            torch.testing.assert_close(out.pooler_output[0, k], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("row, col", [(0, 0), (1, 2), (3, 3), (2, 0)])
def test_soft_token_receptive_fields_reach_down_and_right(case, row, col):
    """Inverting the (r, c) 32 x 32 cell of the resized image moves token (r, c), and no
    token more than one cell below or right of it (beyond the tower's attention blocks'
    faint global mixing): stride-2 convolutions with TF "same" padding (pad bottom / right)
    make token (i, j) read its cell, one cell up / left, and far down / right."""
    model, _, inputs = case
    pixels = inputs["pixel_values"].double()
    cell = IMAGE_SIDE // GRID
    box = (..., slice(row * cell, (row + 1) * cell), slice(col * cell, (col + 1) * cell))
    changed = pixels.clone()
    changed[box] = 1.0 - changed[box]
    with torch.no_grad():
        a = model.model.get_image_features(pixels, return_dict=True).pooler_output[0]
        b = model.model.get_image_features(changed, return_dict=True).pooler_output[0]
    change = (a - b).norm(dim=-1).reshape(GRID, GRID)
    assert change[row, col] > 0.1
    far = torch.ones(GRID, GRID, dtype=torch.bool)
    far[: row + 2, : col + 2] = False
    assert not far.any() or change[far].max() < 1e-2


def test_tower_output_is_scaled_in_place_after_its_hooks(case):
    """get_image_features multiplies the tower's last_hidden_state by sqrt(2048) IN PLACE
    (a view of it): a hook that keeps a reference to the tower's output later holds the
    scaled tensor; a clone taken in the hook holds the tower's own output."""
    model, _, inputs = case
    kept = {}

    def hook(module, args, output):
        kept.setdefault("ref", output.last_hidden_state)
        kept.setdefault("copy", output.last_hidden_state.clone())

    handle = model.model.vision_tower.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    torch.testing.assert_close(kept["ref"], kept["copy"] * math.sqrt(2048), atol=0, rtol=1e-12)
