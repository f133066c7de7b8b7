"""The tiny random LFM2-VL of tests/core/tiny_lfm2_vl.py against the model's own
computation: the processor's visual-token expansion and geometry (patch order,
2 x 2 pixel unshuffle, tiles and thumbnail), each decoder block recomputed by hand
(short convolution and attention), the hybrid cache, and cached generation
against a greedy loop of full no-cache forwards."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from tests.core.exactness import noise_image
from tests.core.tiny_lfm2_vl import (
    CELL,
    CONV_KERNEL,
    D_MODEL,
    DOWNSAMPLE,
    IMAGE_SIZE,
    LAYER_TYPES,
    MAX_NUM_PATCHES,
    PATCH,
    QUESTION,
    TILE_SIZE,
    TILED_SIZE,
    WORDS,
    prompt,
    tiny_model,
)

STEPS = 4


@pytest.fixture(scope="module")
def tiny():
    import transformers

    transformers.logging.set_verbosity_error()  # the reference causal-conv1d fallback warns once per process
    return tiny_model()


def _inputs(processor, size, question=QUESTION, seed=0):
    return processor(images=[noise_image(size, seed)], text=[prompt(processor, question)], return_tensors="pt")


def _image_kwargs(inputs):
    return {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask", "spatial_shapes")}


# ---- (a) the processor's expansion is what the vision path produces


@pytest.mark.parametrize(
    "size, n_crops, n_tokens",
    [
        (IMAGE_SIZE, 1, 15),  # one tile: 80 x 48 px, 5 x 3 tokens
        ((40, 30), 1, 4),  # upscaled to the minimum: 32 x 32 px, 2 x 2 tokens
        (TILED_SIZE, 3, 2 * 4 + 15),  # 2 x 1 tiles of 2 x 2 tokens, then an 80 x 48 thumbnail
        ((600, 100), 5, 4 * 4 + 9),  # 4 x 1 tiles, then a 144 x 16 thumbnail (9 x 1 tokens)
    ],
)
def test_image_token_count_is_the_vision_paths(tiny, size, n_crops, n_tokens):
    model, processor = tiny
    inputs = _inputs(processor, size)
    ids = inputs.input_ids[0]
    assert int((ids == model.config.image_token_id).sum()) == n_tokens
    assert inputs.pixel_values.shape == (n_crops, MAX_NUM_PATCHES, 3 * PATCH * PATCH)
    shapes = inputs.spatial_shapes  # (crops, 2): patch rows, patch cols
    assert torch.equal(inputs.pixel_attention_mask.sum(-1), shapes.prod(-1).int())
    with torch.no_grad():
        feats = model.model.get_image_features(**_image_kwargs(inputs)).pooler_output
    assert [f.shape[0] for f in feats] == (shapes // DOWNSAMPLE).prod(-1).tolist()
    assert sum(f.shape[0] for f in feats) == n_tokens and feats[0].shape[1] == D_MODEL
    # the framing: <|image_start|> [<|img_row_R_col_C|> tile tokens]* [<|img_thumbnail|> thumbnail tokens] <|image_end|>
    tokens = processor.tokenizer.convert_ids_to_tokens(ids.tolist())
    start, end = tokens.index("<|image_start|>"), tokens.index("<|image_end|>")
    inner = tokens[start + 1 : end]
    if n_crops == 1:
        assert inner == ["<image>"] * n_tokens
    else:
        markers = [t for t in inner if t != "<image>"]
        cols = n_crops - 1
        assert markers == [f"<|img_row_1_col_{c}|>" for c in range(1, cols + 1)] + ["<|img_thumbnail|>"]
    assert "<unk>" not in tokens


def test_question_words_are_known(tiny):
    _, processor = tiny
    ids = processor.tokenizer(WORDS + " " + QUESTION + " what color is the square of the blue circle?").input_ids
    assert processor.tokenizer.unk_token_id not in ids


# ---- (b) a forward runs; the decoder's blocks recomputed by hand


def _record(model, inputs):
    """Each decoder layer's input and output, each mixer's (conv / attention) input and
    output and each MLP's output, from hooks; and the model's output (with hidden states)."""
    lm = model.model.language_model
    rec = {"resid": [], "mixer_in": [], "mixer_out": [], "mlp_out": []}
    hooks = []
    for layer in lm.layers:
        mixer = layer.self_attn if layer.is_attention_layer else layer.conv
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, a, kw: rec["resid"].append(a[0] if a else kw["hidden_states"]), with_kwargs=True
            )
        )
        hooks.append(
            mixer.register_forward_pre_hook(
                lambda m, a, kw: rec["mixer_in"].append(kw["hidden_states"]), with_kwargs=True
            )
        )
        hooks.append(
            mixer.register_forward_hook(lambda m, a, o: rec["mixer_out"].append(o[0] if isinstance(o, tuple) else o))
        )
        hooks.append(layer.feed_forward.register_forward_hook(lambda m, a, o: rec["mlp_out"].append(o)))
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return rec, out


def conv_by_hand(conv, n):
    """``Lfm2ShortConv`` on ``n (pos, d)``: in_proj -> (B, C, x); u = B * x; a causal
    depthwise conv over positions (weight[:, K-1] on the current token, weight[:, 0] on
    the token K-1 back, zeros before the start); out_proj(C * conv(u))."""
    d = n.shape[-1]
    B, C, x = (n @ conv.in_proj.weight.T).split(d, dim=-1)
    u = B * x
    w = conv.conv.weight[:, 0, :]  # (d, K)
    K = w.shape[1]
    y = torch.zeros_like(u)
    for t in range(u.shape[0]):
        for k in range(K):
            s = t - (K - 1) + k
            if s >= 0:
                y[t] += w[:, k] * u[s]
    return (C * y) @ conv.out_proj.weight.T, u


def attention_by_hand(model, attn, n, positions):
    """``Lfm2Attention`` on ``n (pos, d)``: per-head RMSNorm (gain w) on q and k over d_head,
    then RoPE (rotate_half), softmax(q k^T / sqrt(d_head) + causal), GQA, out_proj."""
    lm = model.model.language_model
    T, dh = n.shape[0], attn.head_dim
    q = attn.q_layernorm((n @ attn.q_proj.weight.T).view(T, -1, dh))  # (pos, heads, dh)
    k = attn.k_layernorm((n @ attn.k_proj.weight.T).view(T, -1, dh))
    v = (n @ attn.v_proj.weight.T).view(T, -1, dh)
    cos, sin = lm.rotary_emb(n, positions[None])  # (1, pos, dh), built in float32
    cos, sin = cos[0, :, None], sin[0, :, None]

    def rot(z):
        z1, z2 = z[..., : dh // 2], z[..., dh // 2 :]
        return z * cos + torch.cat([-z2, z1], dim=-1) * sin

    q, k = rot(q), rot(k)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    return o @ attn.out_proj.weight.T


@pytest.mark.parametrize("size", [IMAGE_SIZE, TILED_SIZE])
def test_forward_is_finite_and_blocks_recompute_by_hand(tiny, size):
    model, processor = tiny
    lm = model.model.language_model
    inputs = _inputs(processor, size)
    rec, out = _record(model, inputs)
    assert torch.isfinite(out.logits).all() and out.logits.dtype == torch.float64
    T = inputs.input_ids.shape[1]
    positions = torch.arange(T)

    # the embedding: embed_tokens (not scaled), the image features scattered in order over the image tokens
    with torch.no_grad():
        feats = torch.cat(model.model.get_image_features(**_image_kwargs(inputs)).pooler_output)
        embeds = lm.embed_tokens(inputs.input_ids)[0]
    is_image = inputs.input_ids[0] == model.config.image_token_id
    embeds[is_image] = feats
    torch.testing.assert_close(rec["resid"][0][0], embeds, atol=0, rtol=0)
    torch.testing.assert_close(out.hidden_states[0][0], embeds, atol=0, rtol=0)

    with torch.no_grad():
        for i, layer in enumerate(lm.layers):
            x = rec["resid"][i][0]
            n = layer.operator_norm(x)
            torch.testing.assert_close(rec["mixer_in"][i][0], n, atol=0, rtol=0)
            if LAYER_TYPES[i] == "conv":
                assert not layer.is_attention_layer and not hasattr(layer, "self_attn")
                mixed, _ = conv_by_hand(layer.conv, n)
                tol = 1e-10
            else:
                assert layer.is_attention_layer and not hasattr(layer, "conv")
                mixed = attention_by_hand(model, layer.self_attn, n, positions)
                tol = 1e-5  # the model's softmax is float32 (eager) and its RoPE table float32
            scale = float(mixed.abs().max())
            torch.testing.assert_close(rec["mixer_out"][i][0], mixed, atol=tol * scale, rtol=0)
            # sequential pre-norm block: h = x + mixer(norm(x)); out = h + ffn(ffn_norm(h))
            h = x + rec["mixer_out"][i][0]
            ff = layer.feed_forward
            ffn = ff.w2(torch.nn.functional.silu(ff.w1(layer.ffn_norm(h))) * ff.w3(layer.ffn_norm(h)))
            torch.testing.assert_close(rec["mlp_out"][i][0], ffn, atol=0, rtol=0)
            if i + 1 < len(lm.layers):
                torch.testing.assert_close(rec["resid"][i + 1][0], h + ffn, atol=0, rtol=0)
                torch.testing.assert_close(out.hidden_states[i + 1][0], h + ffn, atol=0, rtol=0)
        final = h + ffn  # the last block's output (no hook-free way to read it from the outputs)

        # the final norm is language_model.embedding_norm (so named, yet applied after the last
        # block); hidden_states has n_layers + 1 entries and its LAST is embedding_norm(final),
        # not the last block's output; lm_head is tied to embed_tokens
        assert len(out.hidden_states) == len(lm.layers) + 1
        torch.testing.assert_close(out.hidden_states[-1][0], lm.embedding_norm(final), atol=0, rtol=0)
        assert (lm.embedding_norm(final) - final).abs().max() > 1e-2
        assert model.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(
            out.logits[0], lm.embedding_norm(final) @ lm.embed_tokens.weight.T, atol=1e-12, rtol=0
        )


def test_conv_cache_holds_the_last_kernel_inputs_and_decodes_like_a_full_forward(tiny):
    """The cache is a DynamicCache with a LinearAttentionLayer (conv_states[0]: the conv
    input u = B * x at the last K positions, (batch, d_model, K)) for each conv block and a
    DynamicLayer (keys, values) for each attention block; one cached step equals the
    full forward's last position."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

    model, processor = tiny
    lm = model.model.language_model
    inputs = _inputs(processor, IMAGE_SIZE)
    rec, full = _record(model, inputs)
    T = inputs.input_ids.shape[1]
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    cache = out.cache
    assert type(cache) is DynamicCache
    for i, layer in enumerate(cache.layers):
        if LAYER_TYPES[i] == "conv":
            assert type(layer) is LinearAttentionLayer and layer.conv_kernel_size[0] == CONV_KERNEL
            with torch.no_grad():
                _, u = conv_by_hand(lm.layers[i].conv, rec["mixer_in"][i][0])
            state = layer.conv_states[0]
            assert state.shape == (1, D_MODEL, CONV_KERNEL)
            torch.testing.assert_close(state[0], u[-CONV_KERNEL:].T, atol=1e-12 * float(u.abs().max()), rtol=0)
            assert int(layer.get_seq_length()) == T
        else:
            assert type(layer) is DynamicLayer and layer.keys.shape == (1, 2, T, 16)
    # one more token through the cache == the full forward of the longer sequence
    nxt = out.logits[0, -1].argmax().view(1, 1)
    longer = torch.cat([inputs.input_ids, nxt], 1)
    with torch.no_grad():
        step = model(input_ids=nxt, attention_mask=torch.ones_like(longer), cache=cache, use_cache=True)
        whole = model(
            input_ids=longer, attention_mask=torch.ones_like(longer), **_image_kwargs(inputs), use_cache=False
        )
    torch.testing.assert_close(step.logits[0, -1], whole.logits[0, -1], atol=1e-10, rtol=0)
    torch.testing.assert_close(full.logits, whole.logits[:, :T], atol=1e-10, rtol=0)


# ---- (c) cached generate == a greedy loop of full no-cache forwards


@pytest.mark.parametrize("size, seed", [(IMAGE_SIZE, 0), (TILED_SIZE, 1)])
def test_generate_equals_greedy_loop_without_cache(tiny, size, seed):
    model, processor = tiny
    inputs = _inputs(processor, size, seed=seed)
    n = inputs.input_ids.shape[1]
    eos = processor.tokenizer.eos_token_id
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
    new = gen.sequences[0, n:].tolist()
    seq = inputs.input_ids
    loop, logits = [], []
    for _ in range(STEPS):
        with torch.no_grad():
            lo = model(
                input_ids=seq, attention_mask=torch.ones_like(seq), **_image_kwargs(inputs), use_cache=False
            ).logits[0, -1]
        token = int(lo.argmax())
        loop.append(token)
        logits.append(lo)
        seq = torch.cat([seq, torch.tensor([[token]])], 1)
        if token == eos:
            break
    assert new == loop
    # generate hands its logits (and takes its argmax) in float32, whatever the model's dtype
    assert gen.logits[0].dtype == torch.float32
    for a, b in zip(gen.logits, logits):
        torch.testing.assert_close(a[0].double(), b, atol=1e-6 * float(b.abs().max()), rtol=0)
    assert len(set(loop)) > 1  # not a fixed point of the tied embedding


def test_generation_depends_on_the_image(tiny):
    model, processor = tiny
    firsts = set()
    for seed in range(3):
        inputs = _inputs(processor, IMAGE_SIZE, seed=seed)
        with torch.no_grad():
            firsts.add(tuple(model(**inputs).logits[0, -1].topk(3).indices.tolist()))
    assert len(firsts) > 1


# ---- (d) geometry: patch order, pixel unshuffle, tiles and thumbnail


def test_pixel_values_are_row_major_patches_of_the_resized_image(tiny):
    """An image already at its smart-resize size (80 x 48) is not resized: pixel_values[0, p]
    is the (p // 10, p % 10) patch of it, flattened (y, x, channel), scaled to [-1, 1]."""
    _, processor = tiny
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)
    inputs = processor(images=[Image.fromarray(pixels)], text=[prompt(processor)], return_tensors="pt")
    assert inputs.spatial_shapes.tolist() == [[6, 10]]
    want = torch.from_numpy(pixels).double() / 255 * 2 - 1  # (h, w, 3), mean = std = 0.5
    want = want.reshape(6, PATCH, 10, PATCH, 3).permute(0, 2, 1, 3, 4).reshape(60, -1)
    torch.testing.assert_close(inputs.pixel_values[0, :60].double(), want, atol=1e-6, rtol=0)
    assert torch.all(inputs.pixel_values[0, 60:] == 0) and inputs.pixel_attention_mask[0, 60:].sum() == 0


@pytest.mark.parametrize("size", [IMAGE_SIZE, TILED_SIZE])
def test_visual_token_is_a_row_major_2x2_patch_block(tiny, size):
    """Visual token t of a crop with (rows, cols) patches is the 2 x 2 block of patch rows
    2r, 2r+1 and cols 2c, 2c+1 (r, c = divmod(t, cols // 2)), its projector input the four
    patch vectors concatenated (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1)."""
    model, processor = tiny
    inputs = _inputs(processor, size)
    proj = model.model.multi_modal_projector
    with torch.no_grad():
        out = model.model.get_image_features(**_image_kwargs(inputs))
        hidden = out.last_hidden_state  # (crops, MAX_NUM_PATCHES, d_vision), post_layernorm applied
        for crop, feats in enumerate(out.pooler_output):
            rows, cols = inputs.spatial_shapes[crop].tolist()
            grid = hidden[crop, : rows * cols].reshape(rows, cols, -1)
            blocks = grid.reshape(rows // 2, 2, cols // 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(rows * cols // 4, -1)
            want = proj.linear_2(proj.act(proj.linear_1(proj.layer_norm(blocks))))
            torch.testing.assert_close(feats, want, atol=1e-12, rtol=0)
            # not vacuous: the column-major (transposed) unshuffle gives other features
            other = grid.reshape(rows // 2, 2, cols // 2, 2, -1).permute(0, 2, 3, 1, 4).reshape(rows * cols // 4, -1)
            assert (proj.linear_2(proj.act(proj.linear_1(proj.layer_norm(other)))) - feats).abs().max() > 1e-3


def test_tiles_are_row_major_crops_of_the_grid_resize_then_the_thumbnail(tiny):
    """TILED_SIZE (200 x 120): the image is resized to 2 x 1 tiles of 32 px (64 x 32) and cut
    row-major into crops 0, 1; crop 2 is the thumbnail, the image smart-resized to 80 x 48.
    Tokens follow the crops in order, each crop's tokens row-major."""
    from torchvision.transforms.v2 import functional as tvF

    _, processor = tiny
    image = noise_image(TILED_SIZE)
    inputs = processor(images=[image], text=[prompt(processor)], return_tensors="pt")
    assert inputs.spatial_shapes.tolist() == [[4, 4], [4, 4], [6, 10]]
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # (1, 3, h, w) uint8

    def patches(img, rows, cols):
        z = img[0].double() / 255 * 2 - 1
        return z.permute(1, 2, 0).reshape(rows, PATCH, cols, PATCH, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)

    grid = tvF.resize(x, [TILE_SIZE, 2 * TILE_SIZE], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True)
    for crop, col in enumerate(range(2)):
        tile = grid[..., :, col * TILE_SIZE : (col + 1) * TILE_SIZE]
        torch.testing.assert_close(inputs.pixel_values[crop, :16].double(), patches(tile, 4, 4), atol=1e-6, rtol=0)
    thumb = tvF.resize(x, [48, 80], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True)
    torch.testing.assert_close(inputs.pixel_values[2, :60].double(), patches(thumb, 6, 10), atol=1e-6, rtol=0)
    # the token boxes (x0, y0, x1, y1) in original pixels: tiles cover the image, as does the thumbnail
    W, H = TILED_SIZE
    boxes = []
    for col in range(2):  # tile (row 1, col + 1): 2 x 2 tokens of CELL px in the 64 x 32 grid resize
        for r in range(2):
            for c in range(2):
                x0, y0 = col * TILE_SIZE + c * CELL, r * CELL
                boxes.append((x0 * W / 64, y0 * H / 32, (x0 + CELL) * W / 64, (y0 + CELL) * H / 32))
    for r in range(3):  # thumbnail: 3 x 5 tokens of the 80 x 48 resize
        for c in range(5):
            boxes.append((c * CELL * W / 80, r * CELL * H / 48, (c + 1) * CELL * W / 80, (r + 1) * CELL * H / 48))
    assert len(boxes) == int((inputs.input_ids == processor.image_token_id).sum())
    assert boxes[7][2:] == (W, H) and boxes[-1][2:] == (W, H)


def test_left_padded_batch_of_two_images_matches_single_runs(tiny):
    """Images of different crop counts in one batch: each row's features and last logits are
    its single run's (conv blocks zero the padded positions' inputs via the 2-D mask)."""
    model, processor = tiny
    images = [noise_image(IMAGE_SIZE, 1), noise_image(TILED_SIZE, 2)]
    texts = [prompt(processor), prompt(processor, "what color is the square of the blue circle?")]
    batch = processor(images=[[images[0]], [images[1]]], text=texts, padding=True, return_tensors="pt")
    assert batch.attention_mask[0, 0] == 0  # left padded
    with torch.no_grad():
        both = model(**batch).logits[:, -1]
        for row in range(2):
            single = processor(images=[images[row]], text=[texts[row]], return_tensors="pt")
            torch.testing.assert_close(both[row], model(**single).logits[0, -1], atol=1e-6, rtol=0)


def test_eager_and_sdpa_agree(tiny):
    """The capture switches the model to eager attention: the composite model switches."""
    model, processor = tiny
    inputs = _inputs(processor, IMAGE_SIZE)
    before = model.config._attn_implementation
    with torch.no_grad():
        a = model(**inputs).logits
        model.set_attn_implementation("eager")
        try:
            assert model.model.language_model.config._attn_implementation == "eager"
            b = model(**inputs).logits
        finally:
            model.set_attn_implementation(before)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_hook_sites_of_the_hybrid_blocks(tiny):
    """The depthwise ``conv.conv`` (nn.Conv1d) is never called as a module (its weight goes to
    F.conv1d / a kernel): a hook on it never fires, those on in_proj / out_proj do. Only
    attention blocks give ``attentions`` (2 of the 4 blocks here), each (batch, heads, q, k)."""
    model, processor = tiny
    lm = model.model.language_model
    inputs = _inputs(processor, IMAGE_SIZE)
    fired = []
    hooks = []
    for i, layer in enumerate(lm.layers):
        if not layer.is_attention_layer:
            for name in ("conv", "in_proj", "out_proj"):
                mod = getattr(layer.conv, name)
                hooks.append(mod.register_forward_hook(lambda m, a, o, key=(i, name): fired.append(key)))
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        model.set_attn_implementation(before)
        for h in hooks:
            h.remove()
    convs = [i for i, t in enumerate(LAYER_TYPES) if t == "conv"]
    assert sorted(fired) == sorted((i, n) for i in convs for n in ("in_proj", "out_proj"))
    T = inputs.input_ids.shape[1]
    assert len(out.attentions) == LAYER_TYPES.count("full_attention")
    assert all(a.shape == (1, 4, T, T) for a in out.attentions)


def test_pooler_output_is_per_crop_not_per_image(tiny):
    """get_image_features(...).pooler_output has one entry per crop (tile or thumbnail),
    in pixel_values order; forward concatenates them over the image tokens."""
    model, processor = tiny
    inputs = _inputs(processor, TILED_SIZE)
    with torch.no_grad():
        feats = model.model.get_image_features(**_image_kwargs(inputs)).pooler_output
    assert [f.shape[0] for f in feats] == [4, 4, 15]
