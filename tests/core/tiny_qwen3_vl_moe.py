"""A tiny random float64 Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``), built
offline from transformers' own config and model classes, with a real
``Qwen3VLProcessor`` (the one of tests/core/test_qwen3_vl.py: Qwen2-VL image
processor, 16 px patches merged 2x2, the offline word-level Qwen tokenizer).

Three decoder layers: layer 0 a dense SwiGLU MLP (``mlp_only_layers=[0]``), layers 1
and 2 sparse MoE blocks (4 experts, top-2, no shared expert); two DeepStack layers
(vision layers 0 and 1 feed decoder layers 0 and 1). The family is not registered:
``tiny_model()`` returns the bare model and processor."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tests.core.test_qwen2_vl import SPECIAL, WORDS
from tests.core.test_qwen3_vl import (
    CHAT_TEMPLATE,
    IMAGE_SIZE,
    MERGE,
    MROPE_SECTION,
    PATCH,
    QUESTION,
    tiny_processor,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEEPSTACK_LAYERS",
    "IMAGE_SIZE",
    "MERGE",
    "MLP_ONLY_LAYERS",
    "MOE_INTERMEDIATE",
    "MOE_LAYERS",
    "N_EXPERTS",
    "N_LAYERS",
    "PATCH",
    "QUESTION",
    "SPECIAL",
    "TOP_K",
    "WORDS",
    "tiny_config",
    "tiny_model",
    "tiny_processor",
    "route",
    "expert_output",
    "moe_by_hand",
]

N_LAYERS = 3
N_EXPERTS, TOP_K, MOE_INTERMEDIATE = 4, 2, 24  # gate_up_proj (4, 48, 64): no square ambiguity
MLP_ONLY_LAYERS = [0]  # layer 0 dense (Qwen3VLMoeTextMLP); decoder_sparse_step=1 makes the others MoE
MOE_LAYERS = [i for i in range(N_LAYERS) if i not in MLP_ONLY_LAYERS]
ROUTER_STD, EXPERT_STD = 0.25, 0.15  # the init draws both with std 0.02
DEEPSTACK_LAYERS = 2  # vision layers 0 and 1 feed decoder layers 0 and 1 (of 3)
# IMAGE_SIZE (200, 150): 6 x 8 patches of 16 px after the resize, 3 x 4 = 12 visual tokens


def tiny_config(tie: bool = False):
    """The ``Qwen3VLMoeConfig`` of the tiny model (GQA 4 query / 2 kv heads of d_head 16,
    q/k norms, interleaved M-RoPE sections [3, 3, 2])."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "vocab_size": len(SPECIAL) + len(dict.fromkeys(WORDS.split())),
        "hidden_size": 64,
        "intermediate_size": 96,  # the dense layer's MLP
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        "num_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(MLP_ONLY_LAYERS),
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": list(range(DEEPSTACK_LAYERS)),
    }
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,  # the top-level flag decides (text_config's own defaults to True, unused)
    )
    config.architectures = [Qwen3VLMoeForConditionalGeneration.__name__]
    return config


def tiny_model(tie: bool = False, experts_implementation: str | None = "eager"):
    """``(model, processor)``: a random Qwen3-VL-MoE in float64, eval mode.

    The init sets norm gains to 1 and draws router / expert weights with std 0.02
    (near-uniform routing, negligible experts): the gains are randomised, the router
    is made decisive (ROUTER_STD) and the experts' writes as large as the stream's (EXPERT_STD).
    ``experts_implementation``: "eager" (default: the class's own per-expert loop,
    modeling_qwen3_vl_moe.py:126-150), or None for transformers' default, "grouped_mm"
    (integrations/moe.py:424), whose torch kernel refuses float64 ("Expected mat_a to be
    Float32, BFloat16 or Float16"): a float64 model must run its experts eagerly."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    config = tiny_config(tie)
    torch.manual_seed(1)  # seed 0 decodes <|image_pad|> within 8 greedy steps: no prompt re-run could take it
    model = Qwen3VLMoeForConditionalGeneration(config).double().eval()
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    lm = model.model.language_model
    with torch.no_grad():
        for layer in lm.layers:
            attn = layer.self_attn
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm):
                norm.weight.normal_(1, 0.3)
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.normal_(0, ROUTER_STD)
                layer.mlp.experts.gate_up_proj.normal_(0, EXPERT_STD)
                layer.mlp.experts.down_proj.normal_(0, EXPERT_STD)
        lm.norm.weight.normal_(1, 0.3)
    return model, tiny_processor()


# ---- the MoE block by hand (modeling_qwen3_vl_moe.py:113-183)


@torch.no_grad()
def route(block, x: torch.Tensor):
    """``(logits, weights, experts)`` of the block's router for ``x (n, d_model)``, as the
    model computes them (lines 161-169): logits ``x @ W_router^T`` in the model dtype;
    softmax over all experts *in float32*; top-k of those probabilities; the k kept
    renormalised to sum to 1 (always: this family has no ``norm_topk_prob``), in float32;
    cast back to the model dtype. ``weights, experts (n, k)``, largest weight first."""
    logits = torch.nn.functional.linear(x, block.gate.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, block.gate.top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), experts


@torch.no_grad()
def expert_output(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s SwiGLU output for ``x (n, d_model)``, unweighted (lines 144-146):
    ``gate_up_proj[e] (2 I, d_model)``, rows ``[:I]`` the gate and ``[I:]`` the up
    projection; ``down_proj[e] (d_model, I)``; ``silu(x W_g^T) * (x W_u^T) @ W_d^T``."""
    inter = experts.intermediate_dim
    w_gate, w_up = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:]
    h = experts.act_fn(x @ w_gate.T) * (x @ w_up.T)
    return h @ experts.down_proj[e].T


@torch.no_grad()
def moe_by_hand(block, x: torch.Tensor) -> torch.Tensor:
    """The block's output for ``x (n, d_model)``: per token the sum over its k chosen
    experts of ``weight * expert_output`` (no shared expert, no bias)."""
    _, weights, chosen = route(block, x)
    out = torch.zeros_like(x)
    for e in range(block.experts.num_experts):
        rows, slot = torch.where(chosen == e)
        if len(rows):
            out[rows] += weights[rows, slot, None] * expert_output(block.experts, e, x[rows])
    return out


# ---- the family hooks of the conformance suite's expert checks (Qwen3-VL-MoE's and Qwen3.5-MoE's
# sparse blocks are the same modules: router ``gate``, fused ``experts``; Qwen3.5-MoE adds a shared expert)


@torch.no_grad()
def expert_parts_by_hand(m, tr, block: int, position: int) -> dict:
    """``{component name: (d_model,)}``: what block ``block``'s MoE module adds at ``position``
    for each chosen expert (router weight times expert output, by :func:`route` and
    :func:`expert_output`) and, where it has one, for the shared expert (``sigmoid(g . x)``
    times its SwiGLU), from the module's recorded input."""
    moe = m.adapter._layer(block).mlp
    x = tr.mlp_in[block][0, position][None]
    _, weights, chosen = route(moe, x)
    parts = {
        f"L{block}.E{e}": weights[0, slot] * expert_output(moe.experts, e, x)[0]
        for slot, e in enumerate(chosen[0].tolist())
    }
    shared = getattr(moe, "shared_expert", None)
    if shared is not None:
        mlp = shared
        swiglu = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        parts[f"L{block}.shared_expert"] = (torch.sigmoid(x @ moe.shared_expert_gate.weight.T) * swiglu)[0]
    return parts


@contextmanager
def zeroed_expert(m, block: int, expert: int, positions):
    """The library's experts module of ``block`` patched so that expert ``expert``'s output is
    zero for the tokens at ``positions`` (batch of one: token index = position): its
    routing weight there set to 0 before the module's own forward runs."""
    experts = m.adapter._layer(block).mlp.experts
    real = type(experts).forward

    def zeroed(module, hidden, top_k_index, top_k_weights):
        weights = top_k_weights.clone()
        at = torch.zeros(hidden.shape[0], dtype=torch.bool)
        at[list(positions)] = True
        weights[at[:, None] & (top_k_index == expert)] = 0
        return real(module, hidden, top_k_index, weights)

    experts.forward = zeroed.__get__(experts)
    try:
        yield
    finally:
        del experts.forward
