"""The tiny random Llama 4 of tests/core/tiny_llama4.py, checked against the library
model itself: the processor's image-token expansion, a finite forward, generate with
the cache against a greedy loop of full forwards, and by hand (float64, from the
canonical weights) the parts an adapter must replay: chunked masks, interleaved
RoPE, the weightless q/k RMS norm, the NoPE layer's attention temperature, the MoE
(router score on the expert's input) and the pixel shuffle's grid."""

import functools
import math

import torch

from tests.core.exactness import noise_image
from tests.core.tiny_llama4 import (
    ATTN_SCALE,
    CHUNK,
    D_HEAD,
    FLOOR_SCALE,
    GRID,
    IMAGE_SIZE,
    MOE_LAYERS,
    N_EXPERTS,
    N_HEADS,
    N_KV_HEADS,
    NO_ROPE_LAYERS,
    QUESTION,
    TOKENS_PER_TILE,
    TOP_K,
    model_inputs,
    prompt,
    tiny_model,
)


@functools.cache
def built():
    model, processor = tiny_model()
    return model, processor, model_inputs(model, processor, noise_image(IMAGE_SIZE))


@functools.cache
def eager_run():
    """``(inputs, attentions, attention inputs, feed-forward (input, output))`` of one eager forward."""
    model, _, inputs = built()
    attn_in, ff = {}, {}
    handles = []
    for i, layer in enumerate(model.language_model.model.layers):
        handles.append(
            layer.self_attn.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: attn_in.__setitem__(i, kwargs["hidden_states"][0]), with_kwargs=True
            )
        )
        handles.append(layer.feed_forward.register_forward_hook(lambda mod, a, o, i=i: ff.__setitem__(i, (a[0], o))))
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
        for h in handles:
            h.remove()
    return out, attn_in, ff


def token_names(processor, ids):
    return processor.tokenizer.convert_ids_to_tokens(list(map(int, ids)))


def test_image_tokens_are_the_features_the_vision_path_produces():
    """One tile: ``<|image_start|><|image|>`` 16 x ``<|patch|>`` ``<|image_end|>``; the model
    scatters its features into the ``<|patch|>`` positions (config.image_token_id), not
    into ``<|image|>`` (the processor's image_token_id)."""
    model, processor, inputs = built()
    ids = inputs.input_ids[0]
    names = token_names(processor, ids)
    start = names.index("<|image_start|>")
    assert names[start : start + 3 + TOKENS_PER_TILE] == [
        "<|image_start|>",
        "<|image|>",
        *["<|patch|>"] * TOKENS_PER_TILE,
        "<|image_end|>",
    ]
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|patch|>")
    assert processor.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image|>")
    assert processor.image_token_id != model.config.image_token_id
    assert "<unk>" not in names
    assert 30 <= len(ids) <= 60
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    with torch.no_grad():
        feats = model.get_image_features(inputs["pixel_values"], return_dict=True).pooler_output
    assert feats.shape == (1, TOKENS_PER_TILE, model.config.text_config.hidden_size)
    assert int((ids == model.config.image_token_id).sum()) == feats.shape[0] * feats.shape[1]


def test_forward_is_finite_and_the_image_counts():
    model, processor, inputs = built()
    with torch.no_grad():
        logits = model(**inputs).logits
        other = dict(inputs, pixel_values=model_inputs(model, processor, noise_image(IMAGE_SIZE, 1))["pixel_values"])
        logits_other = model(**other).logits
    assert logits.shape == (1, inputs.input_ids.shape[1], model.config.text_config.vocab_size)
    assert logits.dtype == torch.float64 and torch.isfinite(logits).all()
    first_patch = int((inputs.input_ids[0] == model.config.image_token_id).nonzero()[0])
    diff = (logits - logits_other)[0].abs().amax(-1)
    assert torch.all(diff[:first_patch] == 0) and torch.all(diff[first_patch:] > 1e-6)


def test_generate_with_cache_is_the_greedy_loop_of_full_forwards():
    """The prompt (35 tokens) is longer than the chunk (8): the chunked layers' cache
    is a sliding window of 7 tokens, the NoPE layer's temperature reads the cache length."""
    model, processor, inputs = built()
    n = inputs.input_ids.shape[1]
    assert n > 4 * CHUNK
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        ids, mask = inputs.input_ids, inputs.attention_mask
        eos = set(model.generation_config.eos_token_id or [])
        loop, loop_logits = [], []
        for _ in range(4):
            logits = model(
                input_ids=ids, attention_mask=mask, pixel_values=inputs["pixel_values"], use_cache=False
            ).logits
            nxt = int(logits[0, -1].argmax())
            loop.append(nxt)
            loop_logits.append(logits[0, -1])
            if nxt in eos:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
    assert gen.sequences[0, n:].tolist() == loop
    assert len(loop) == 4 and not set(loop) & {model.config.image_token_id}  # four plain words
    for step, scores in enumerate(gen.scores):  # generate hands its logits over in float32
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores[0].double(), loop_logits[step], atol=1e-5, rtol=0)


def test_cached_generation_across_a_chunk_boundary_is_the_full_forward():
    """Ten new tokens (positions 35 to 44) cross the chunk boundary at 40: the chunked
    layers' sliding-window cache drops the old chunk; one full no-cache forward over the
    generated sequence gives every step's logits (to float32: generate's logits are float32)."""
    model, _, inputs = built()
    n = inputs.input_ids.shape[1]
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        seq = gen.sequences
        assert seq.shape[1] == n + 10 and n < 5 * CHUNK < n + 10
        assert not (seq[0, n:] == model.config.image_token_id).any()
        full = model(input_ids=seq, attention_mask=torch.ones_like(seq), pixel_values=inputs["pixel_values"]).logits
    for step, scores in enumerate(gen.scores):
        torch.testing.assert_close(scores[0].double(), full[0, n - 1 + step], atol=1e-5, rtol=0)


def test_layer_layout():
    """RoPE layers (no_rope_layers 1) are the chunked ones and carry the weightless q/k
    norm; the NoPE layer (0) is full attention; MoE layers every second layer."""
    model, _, _ = built()
    tc = model.config.text_config
    assert tc.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert tc.moe_layers == MOE_LAYERS
    for i, layer in enumerate(model.language_model.model.layers):
        rope = bool(NO_ROPE_LAYERS[i])
        assert bool(layer.self_attn.use_rope) == rope
        assert hasattr(layer.self_attn, "qk_norm") == rope
        assert layer.is_moe_layer == (i in MOE_LAYERS)
        assert type(layer.feed_forward).__name__ == ("Llama4TextMoe" if i in MOE_LAYERS else "Llama4TextMLP")


def interleaved_rope(x, positions, inv_freq):
    """Llama 4's RoPE: consecutive pairs (x[2j], x[2j+1]) turned by position * inv_freq[j]."""
    angle = positions.double()[:, None] * inv_freq.double()  # (pos, d/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def half_rope(x, positions, inv_freq):
    """Llama 1-3's rotate_half RoPE (first and second halves): the wrong one here."""
    angle = positions.double()[:, None] * inv_freq.double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def temperature(positions):
    return 1 + ATTN_SCALE * torch.log1p(torch.floor((positions.double() + 1) / FLOOR_SCALE))


def recompute_pattern(model, x, layer_idx, rope=interleaved_rope, qk="rms", temp=True, chunked=True):
    """``(heads, pos, pos)`` from the attention's input ``x (pos, d_model)`` and canonical weights."""
    attn = model.language_model.model.layers[layer_idx].self_attn
    tc = model.config.text_config
    n = x.shape[0]
    positions = torch.arange(n)
    q = (x @ attn.q_proj.weight.T).view(n, N_HEADS, D_HEAD)
    k = (x @ attn.k_proj.weight.T).view(n, N_KV_HEADS, D_HEAD)
    use_rope = bool(NO_ROPE_LAYERS[layer_idx])
    if use_rope:
        inv_freq = model.language_model.model.rotary_emb.inv_freq
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        if qk == "rms":  # weightless RMS norm over d_head (Llama4TextL2Norm), after the rotation
            q = q * (q.pow(2).mean(-1, keepdim=True) + tc.rms_norm_eps).rsqrt()
            k = k * (k.pow(2).mean(-1, keepdim=True) + tc.rms_norm_eps).rsqrt()
        elif qk == "l2":
            q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    elif temp:
        q = q * temperature(positions)[:, None, None]
    k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D_HEAD)
    i, j = positions[:, None], positions[None, :]
    visible = j <= i
    if use_rope and chunked:
        visible &= (i // CHUNK) == (j // CHUNK)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def test_patterns_recomputed_with_chunks_interleaved_rope_qk_rms_norm_and_temperature():
    """Every layer's eager pattern from W_Q / W_K: RoPE layers rotate consecutive pairs,
    then RMS-normalise q and k without a gain, under a causal mask cut into 8-token chunks;
    the NoPE layer multiplies q by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))
    under the plain causal mask; scores scaled by d_head ** -0.5. The model rotates and
    normalises in float32: 1e-5."""
    model, _, _ = built()
    out, attn_in, _ = eager_run()
    assert temperature(torch.arange(40)).unique().numel() > 5  # the temperature varies over the prompt
    for layer in range(len(NO_ROPE_LAYERS)):
        want = recompute_pattern(model, attn_in[layer], layer)
        torch.testing.assert_close(out.attentions[layer][0], want, atol=1e-5, rtol=0)
    # not vacuous: each ingredient changes the patterns by far more than the tolerance
    variants = {
        "rotate_half rope": (0, {"rope": half_rope}),
        "true L2 q/k norm": (1, {"qk": "l2"}),
        "no q/k norm": (1, {"qk": None}),
        "no chunks": (0, {"chunked": False}),
        "no temperature": (3, {"temp": False}),
    }
    for name, (layer, kw) in variants.items():
        other = recompute_pattern(model, attn_in[layer], layer, **kw)
        assert (other - out.attentions[layer][0]).abs().max() > 1e-3, name


def test_chunked_layers_see_only_their_chunk():
    """A key in an earlier chunk gets exactly zero weight in a chunked layer, not in the NoPE layer."""
    out, _, _ = eager_run()
    n = out.attentions[0].shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    outside = (j <= i) & (i // CHUNK != j // CHUNK)
    for layer, rope in enumerate(NO_ROPE_LAYERS):
        weights = out.attentions[layer][0][:, outside]
        assert torch.all(weights == 0) if rope else torch.all(weights > 0)


def expert_outputs(moe, x, on_output=False):
    """``(E, tokens, d_model)``: each expert's write, by hand. The router's top-k logits go
    through a sigmoid (float32, as the model) and the score multiplies the expert's INPUT:
    ``down_e((s x G_e).silu() * (s x U_e))``; unselected experts get score 0, write 0.
    ``on_output``: the usual ``s * down_e(...(x))`` instead (not this model)."""
    logits = x @ moe.router.weight.T
    top, idx = logits.topk(TOP_K, dim=-1)
    scores = torch.zeros_like(logits).scatter(1, idx, torch.sigmoid(top.float()).to(x.dtype))
    inter = moe.experts.down_proj.shape[1]
    outs = []
    for e in range(N_EXPERTS):
        s = scores[:, e : e + 1]
        xin = x if on_output else x * s
        gate_up = xin @ moe.experts.gate_up_proj[e]  # (H, 2I): gate columns first, then up
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        y = (torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e]  # (I, H)
        outs.append(s * y if on_output else y)
    return torch.stack(outs), scores, logits


def test_moe_is_shared_expert_plus_experts_on_score_scaled_inputs():
    model, _, _ = built()
    _, _, ff = eager_run()
    for layer in MOE_LAYERS:
        moe = model.language_model.model.layers[layer].feed_forward
        x_in, (out, router_logits) = ff[layer]
        x = x_in.reshape(-1, x_in.shape[-1])
        per_expert, scores, logits = expert_outputs(moe, x)
        torch.testing.assert_close(router_logits, logits, atol=1e-12, rtol=0)  # the module returns all E logits
        shared = moe.shared_expert(x)  # no gate on the shared expert
        torch.testing.assert_close(out, shared + per_expert.sum(0), atol=1e-12, rtol=0)
        assert out.shape == x.shape  # (batch * pos, d_model): the layer views it back
        assert torch.all(per_expert[scores.T == 0] == 0)  # unselected experts write exactly 0
        assert int((scores > 0).sum(-1).unique()) == TOP_K
        # not vacuous: the score on the expert's output instead is another MoE
        wrong = shared + expert_outputs(moe, x, on_output=True)[0].sum(0)
        assert (wrong - out).abs().max() > 1e-3


def test_pixel_shuffle_grid_is_row_major_2x2_cells():
    """The tower's 8 x 8 patch grid (CLS appended last, dropped before the shuffle) becomes a
    row-major 4 x 4 grid; token (r, c) concatenates patches (2r, 2c), (2r, 2c+1), (2r+1, 2c),
    (2r+1, 2c+1) in that order along channels."""
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle

    side, ch = 2 * GRID, 3
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    patches = torch.stack([rows, cols, torch.zeros_like(rows)], -1).reshape(1, side * side, ch).double()
    patches[..., 2] = torch.arange(side * side).double()
    shuffled = pixel_shuffle(patches, 0.5)
    assert shuffled.shape == (1, GRID * GRID, 4 * ch)
    for r in range(GRID):
        for c in range(GRID):
            cells = shuffled[0, r * GRID + c].view(4, ch)
            want = [(2 * r, 2 * c), (2 * r, 2 * c + 1), (2 * r + 1, 2 * c), (2 * r + 1, 2 * c + 1)]
            assert [tuple(int(v) for v in cell[:2]) for cell in cells] == want
    # the adapter reads the 64 patch tokens without the CLS token (the tower's last)
    model, _, inputs = built()
    seen = {}
    h = model.vision_model.vision_adapter.register_forward_pre_hook(lambda mod, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        model.get_image_features(inputs["pixel_values"])
    h.remove()
    assert seen["x"].shape == (1, side * side, model.config.vision_config.hidden_size)


def test_one_tile_keeps_the_aspect_ratio_and_pads_right_and_below():
    """``max_patches=1``: the 60 x 40 image is resized to 32 x 21 (aspect kept) at the tile's
    top-left and padded with black (-1 after the normalisation); the bottom grid row is all padding."""
    _, _, inputs = built()
    pv = inputs["pixel_values"][0]
    assert torch.all(pv[:, 21:, :] == -1) and not torch.all(pv[:, 20, :] == -1)
    assert not torch.all(pv[:, :21, 31] == -1)


def test_several_tiles_with_the_global_tile_last():
    """``max_patches=4``: a 60 x 40 image takes a 2 x 2 canvas; the prompt holds each tile's
    patches (x / y separators), then ``<|image|>`` and the global tile's patches; the model's
    features come in the same order (pixel_values: 4 tiles then the global one)."""
    model, processor = tiny_model(max_patches=4)
    inputs = model_inputs(model, processor, noise_image(IMAGE_SIZE))
    assert inputs["pixel_values"].shape == (5, 3, 32, 32)
    names = token_names(processor, inputs.input_ids[0])
    start, end = names.index("<|image_start|>"), names.index("<|image_end|>")
    p = ["<|patch|>"] * TOKENS_PER_TILE
    want = [*p, "<|tile_x_separator|>", *p, "<|tile_y_separator|>"] * 2 + ["<|image|>", *p]
    assert names[start + 1 : end] == want
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()
    assert int((inputs.input_ids == model.config.image_token_id).sum()) == 5 * TOKENS_PER_TILE


def test_left_padding_moves_the_nope_temperature():
    """The NoPE layer's temperature counts positions from the start of the padded row
    (arange + cache length, not position_ids): a left-padded row is not its unpadded self,
    a right-padded row is, to float32 rounding (the RMS norms normalise in float32, so
    float64 noise of the batched matmuls can flip a float32 rounding)."""
    model, processor, _ = built()
    texts = [prompt(processor), prompt(processor, "what color is the square of the blue circle?")]
    image = noise_image(IMAGE_SIZE)
    alone = model_inputs(model, processor, image)
    with torch.no_grad():
        single = model(**alone).logits[0]
        n = single.shape[0]
        for side in ("left", "right"):
            processor.tokenizer.padding_side = side
            try:
                batch = processor(images=[image, image], text=texts, return_tensors="pt", padding=True)
            finally:
                processor.tokenizer.padding_side = "left"
            batch["pixel_values"] = batch["pixel_values"].to(model.dtype)
            row = model(**batch).logits[0]
            row = row[-n:] if side == "left" else row[:n]
            gap = float((row - single).abs().max())
            assert gap > 1e-3 if side == "left" else gap < 1e-5, (side, gap)


def test_question_words_are_known():
    _, processor, _ = built()
    for q in (QUESTION, "what color is the square of the blue circle?", "is there a blue square?"):
        assert "<unk>" not in token_names(processor, processor.tokenizer(q).input_ids)
