"""The tiny random float64 Qwen3-VL-MoE of tests/core/tiny_qwen3_vl_moe.py: its
processor's image-token expansion matches the vision path, a forward is finite,
cached generation equals a greedy loop of full no-cache forwards, and the sparse MoE
blocks are exactly a routing-weighted sum of the chosen experts' SwiGLU outputs
computed here from the fused expert weights."""

import pytest
import torch

from tests.core.exactness import noise_image
from tests.core.tiny_qwen3_vl_moe import (
    DEEPSTACK_LAYERS,
    IMAGE_SIZE,
    MERGE,
    MLP_ONLY_LAYERS,
    MOE_INTERMEDIATE,
    MOE_LAYERS,
    N_EXPERTS,
    QUESTION,
    TOP_K,
    expert_output,
    moe_by_hand,
    route,
    tiny_model,
)
from tests.tolerances import sum_tol, unit_roundoff

N_NEW = 4


def prompt_inputs(processor, image, question=QUESTION):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=[image], text=[prompt], return_tensors="pt")


@pytest.fixture(scope="module")
def case():
    model, processor = tiny_model()
    inputs = prompt_inputs(processor, noise_image(IMAGE_SIZE))
    return model, processor, inputs


def record(model, inputs):
    """One forward; per decoder layer its input, attention output, MLP input and output."""
    lm = model.model.language_model
    seen, handles = {}, []
    for i, layer in enumerate(lm.layers):
        handles += [
            layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("in", i), a[0])),
            layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("out", i), o)),
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("attn", i), o[0])),
            layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("mlp", i), (a[0], o))),
        ]
        if i in MOE_LAYERS:
            handles.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("gate", i), o)))
    try:
        with torch.no_grad():
            out = model(**inputs, output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    return out, seen


def test_image_token_count_is_the_vision_paths(case):
    """12 ``<|image_pad|>`` (6 x 8 patches of 16 px merged 2 x 2) = rows of the merger's
    output and of each DeepStack feature."""
    model, processor, inputs = case
    n_image = int((inputs.input_ids == model.config.image_token_id).sum())
    thw = inputs.image_grid_thw[0].tolist()
    assert thw == [1, 6, 8] and n_image == 12 == thw[1] * thw[2] // MERGE**2
    with torch.no_grad():
        feats = model.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw, return_dict=True)
    assert sum(f.shape[0] for f in feats.pooler_output) == n_image
    assert len(feats.deepstack_features) == DEEPSTACK_LAYERS
    assert all(sum(f.shape[0] for f in fs) == n_image for fs in feats.deepstack_features)
    assert inputs.mm_token_type_ids.sum() == n_image  # image positions typed 1 (M-RoPE)
    unk = processor.tokenizer.unk_token_id
    assert unk not in inputs.input_ids[0].tolist()


def test_forward_is_finite_and_the_layers_add_to_the_stream(case):
    """Finite logits; each layer writes ``x + attn + mlp`` (plus DeepStack features at
    the visual positions after layers 0, 1); the lm_head reads the final norm of the last."""
    model, _, inputs = case
    out, seen = record(model, inputs)
    assert out.logits.shape == (1, inputs.input_ids.shape[1], model.config.text_config.vocab_size)
    assert out.logits.dtype == torch.float64 and torch.isfinite(out.logits).all()
    lm = model.model.language_model
    vis = inputs.input_ids[0] == model.config.image_token_id
    for i in range(len(lm.layers)):
        x, attn = seen[("in", i)], seen[("attn", i)]
        mlp_in, mlp_out = seen[("mlp", i)]
        assert isinstance(mlp_out, torch.Tensor)  # the MoE block returns a tensor, not a tuple
        mid = x + attn
        torch.testing.assert_close(mlp_in, lm.layers[i].post_attention_layernorm(mid), atol=0, rtol=0)
        torch.testing.assert_close(seen[("out", i)], mid + mlp_out, atol=0, rtol=0)
        if i + 1 < len(lm.layers):
            nxt = seen[("in", i + 1)]
            torch.testing.assert_close(nxt[0, ~vis], seen[("out", i)][0, ~vis], atol=0, rtol=0)
            assert (i < DEEPSTACK_LAYERS) == bool((nxt[0, vis] != seen[("out", i)][0, vis]).any())
    logits = model.lm_head(lm.norm(seen[("out", len(lm.layers) - 1)]))
    torch.testing.assert_close(logits, out.logits, atol=0, rtol=0)


def test_generate_equals_greedy_no_cache_loop(case):
    """``generate`` (KV cache, rope_deltas for the new tokens' M-RoPE positions) picks
    the tokens a loop of full forwards without cache picks (argmax of the logits cast to
    float32, as generate takes it), with the same logits."""
    model, _, inputs = case
    eos = model.config.text_config.eos_token_id
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=N_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    n_prompt = inputs.input_ids.shape[1]
    new = gen.sequences[0, n_prompt:].tolist()
    ids, mask, types = inputs.input_ids, inputs.attention_mask, inputs.mm_token_type_ids
    loop, logits = [], []
    with torch.no_grad():
        for _ in range(N_NEW):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=types,
                pixel_values=inputs.pixel_values,
                image_grid_thw=inputs.image_grid_thw,
                use_cache=False,
            )
            logits.append(out.logits[0, -1])
            nxt = int(out.logits[0, -1].float().argmax())  # generate's argmax is over float32 logits
            loop.append(nxt)
            if nxt == eos:
                break
            one = torch.ones_like(ids[:, :1])
            ids = torch.cat([ids, one * nxt], dim=1)
            mask, types = torch.cat([mask, one], dim=1), torch.cat([types, one * 0], dim=1)
    assert new == loop
    for step, want in enumerate(logits):
        # generate keeps float32 copies (generation/utils.py: ``.to(copy=True, dtype=torch.float32)``);
        # the float64 logits with and without cache differ by float64 rounding only
        assert gen.logits[step].dtype == torch.float32
        tol = 2 * unit_roundoff(torch.float32) * float(want.abs().max())
        torch.testing.assert_close(gen.logits[step][0].double(), want, atol=tol, rtol=0)


def test_layer_kinds_and_fused_expert_layout(case):
    """Layer 0 dense (``mlp_only_layers``), 1 and 2 sparse: ``mlp.gate`` (router, weight
    ``(E, d_model)``, no bias) and ``mlp.experts`` (``gate_up_proj (E, 2 I, d_model)``,
    ``down_proj (E, d_model, I)``), nothing else (no shared expert)."""
    model, _, _ = case
    tc = model.config.text_config
    assert not hasattr(tc, "norm_topk_prob")  # always renormalised
    d = tc.hidden_size
    for i, layer in enumerate(model.model.language_model.layers):
        kind = type(layer.mlp).__name__
        if i in MLP_ONLY_LAYERS:
            assert kind == "Qwen3VLMoeTextMLP" and layer.mlp.gate_proj.weight.shape == (tc.intermediate_size, d)
            continue
        assert kind == "Qwen3VLMoeTextSparseMoeBlock"
        assert [n for n, _ in layer.mlp.named_children()] == ["experts", "gate"]
        assert [n for n, _ in layer.mlp.named_parameters()] == [
            "experts.gate_up_proj",
            "experts.down_proj",
            "gate.weight",
        ]
        assert layer.mlp.experts.gate_up_proj.shape == (N_EXPERTS, 2 * MOE_INTERMEDIATE, d)
        assert layer.mlp.experts.down_proj.shape == (N_EXPERTS, d, MOE_INTERMEDIATE)
        assert layer.mlp.gate.weight.shape == (N_EXPERTS, d) and layer.mlp.gate.top_k == TOP_K
    assert model.config.text_config._experts_implementation == "eager"


def test_one_expert_by_hand_is_the_models_expert(case):
    """``expert_output(e)`` (gate rows ``[:I]``, up rows ``[I:]`` of ``gate_up_proj[e]``)
    is the experts module's output for tokens all routed to ``e`` with weight 1."""
    model, _, _ = case
    torch.manual_seed(1)
    x = torch.randn(5, model.config.text_config.hidden_size, dtype=torch.float64)
    for i in MOE_LAYERS:
        experts = model.model.language_model.layers[i].mlp.experts
        for e in range(N_EXPERTS):
            index = torch.full((5, 1), e)
            with torch.no_grad():
                theirs = experts(x, index, torch.ones(5, 1, dtype=torch.float64))
                ours = expert_output(experts, e, x)
            torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
            # the halves swapped (up as the gate) are another function
            inter = experts.intermediate_dim
            swapped = experts.act_fn(x @ experts.gate_up_proj[e, inter:].T) * (x @ experts.gate_up_proj[e, :inter].T)
            assert (swapped @ experts.down_proj[e].T - theirs).abs().max() > 1e-3


def moe_tol(block, x, weights, chosen) -> float:
    """How far two evaluations of ``sum_k w_k down_e(silu(x W_g^T) * (x W_u^T))`` may be
    apart in ``x``'s dtype: ``2 gamma_n`` times the sizes of the terms, with
    ``|silu(g)| <= 1.1 |g|``, ``|silu'| <= 1.1`` bounding how the gate / up dot products'
    errors reach ``h`` (``|g|, |u| <= |x| @ |W|^T``), and ``n = d_model + I + 4``."""
    experts = block.experts
    inter = experts.intermediate_dim
    magnitude = torch.zeros_like(x)
    for k in range(chosen.shape[1]):
        for e in range(experts.num_experts):
            rows = chosen[:, k] == e
            a_g = x[rows].abs() @ experts.gate_up_proj[e, :inter].abs().T
            a_u = x[rows].abs() @ experts.gate_up_proj[e, inter:].abs().T
            magnitude[rows] += weights[rows, k, None] * ((2.2 * a_g * a_u) @ experts.down_proj[e].abs().T)
    return sum_tol(magnitude.max(), x.shape[-1] + inter + 4, x.dtype)


def test_moe_block_is_the_weighted_sum_of_its_chosen_experts(case):
    """In each MoE layer: the router's logits, top-k experts and weights are ``route``'s,
    bit for bit (float32 softmax over all experts, top-k, renormalised); the block's
    output is ``sum_k w_k expert_output(e_k)`` to float64 rounding; the recorded
    ``router_logits`` are the logits. Not vacuous: every expert is chosen somewhere, the
    second weights matter, and weights from a float64 softmax miss by far more."""
    model, _, inputs = case
    out, seen = record(model, inputs)
    assert len(out.router_logits) == len(MOE_LAYERS)
    for n, i in enumerate(MOE_LAYERS):
        block = model.model.language_model.layers[i].mlp
        x, y = (t[0] for t in seen[("mlp", i)])
        logits, weights, chosen = route(block, x)
        model_logits, model_weights, model_chosen = seen[("gate", i)]
        assert torch.equal(logits, model_logits) and torch.equal(chosen, model_chosen)
        assert torch.equal(weights, model_weights) and weights.dtype == torch.float64
        assert torch.equal(out.router_logits[n], logits)
        # float32 values in a float64 tensor, summing to 1 in float32
        assert torch.equal(weights.float().double(), weights)
        assert torch.all(weights[:, 0] >= weights[:, 1])
        tol = moe_tol(block, x, weights, chosen)
        assert tol < 1e-10
        with torch.no_grad():
            by_hand = moe_by_hand(block, x)
        torch.testing.assert_close(by_hand, y, atol=tol, rtol=0)
        # one term at a time: sum_k w_k expert_{e_k}(x) per token
        with torch.no_grad():
            terms = torch.stack(
                [
                    torch.stack(
                        [
                            weights[t, k] * expert_output(block.experts, int(chosen[t, k]), x[t : t + 1])[0]
                            for k in range(TOP_K)
                        ]
                    )
                    for t in range(x.shape[0])
                ]
            )  # (tokens, k, d_model)
        torch.testing.assert_close(terms.sum(1), y, atol=tol, rtol=0)
        # not vacuous
        assert set(chosen.flatten().tolist()) == set(range(N_EXPERTS))
        assert float(terms[:, 1].abs().max()) > 1e6 * tol
        p64 = logits.softmax(-1)
        top64, chosen64 = p64.topk(TOP_K, dim=-1)
        assert torch.equal(chosen64, chosen)
        w64 = top64 / top64.sum(-1, keepdim=True)
        moe64 = sum(w64[:, k, None] * terms[:, k] / weights[:, k, None] for k in range(TOP_K))
        assert float((moe64 - y).abs().max()) > 1e3 * tol


def test_default_grouped_mm_experts_refuse_float64_and_agree_in_float32():
    """transformers' default experts implementation is "grouped_mm"
    (``get_correct_experts_implementation``): torch's kernel refuses float64, so the
    float64 model runs "eager". In float32 the two implementations agree."""
    model, processor = tiny_model(experts_implementation=None)
    assert model.config.text_config._experts_implementation == "grouped_mm"
    block = model.model.language_model.layers[MOE_LAYERS[0]].mlp
    x = torch.randn(7, model.config.text_config.hidden_size, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        block(x[None])
    model.float()
    xf = x.float()
    with torch.no_grad():
        grouped = block(xf[None])[0]
        model.set_experts_implementation("eager")
        eager = block(xf[None])[0]
    bound = moe_tol(block, xf, *route(block, xf)[1:])
    torch.testing.assert_close(grouped, eager, atol=bound, rtol=0)
