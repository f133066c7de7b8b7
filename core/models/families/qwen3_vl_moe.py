"""Qwen3-VL-MoE (transformers' ``Qwen3VLMoeForConditionalGeneration``): Qwen3-VL
(processor, geometry, q/k norms, interleaved M-RoPE, DeepStack writes) whose MLPs
are, on the layers the config makes sparse, a mixture of experts:

* the router (``mlp.gate``) scores every expert, ``softmax`` over all of them in
  float32, keeps the top ``k`` and renormalises those ``k`` weights to sum to 1;
* each expert is a SwiGLU MLP stored fused (``experts.gate_up_proj (E, 2I, d)``,
  gate rows first; ``experts.down_proj (E, d, I)``);
* the block writes ``sum_k w_k * expert_{e_k}(x)``: no shared expert.

So the MLP's write splits into one component per routed expert,
``L{l}.E{e} = w_e * expert_e(x)`` (router weight times expert output, as the model
forms it), plus ``L{l}.experts_residue`` (the write minus those: the model's own
summation order, zero but for rounding); edit site ``expert`` takes one expert's
write out of the block's output (docs/METHODS.md §4.15.2). Dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep ``L{l}.mlp``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.models.families.qwen3_vl import Qwen3VLAdapter


def fused_expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s output ``(n, d_model)`` for ``x (n, d_model)`` from the fused
    weights, as transformers' experts compute it: ``act(x W_g^T) * (x W_u^T) @ W_d^T``."""
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def routed_writes(name: str, router, experts, x: torch.Tensor, expert: int | None) -> list:
    """``[(f"{name}.E{e}", (n, d_model))]``: each routed expert's output times its router
    weight (the router module's own choice and weights), zero where a row is not routed
    to it; ``expert``: that one only."""
    _, weights, chosen = router(x)
    out = []
    for e in range(experts.num_experts) if expert is None else [expert]:
        rows, slot = torch.where(chosen == e)
        write = torch.zeros_like(x)
        if len(rows):
            write[rows] = fused_expert(experts, e, x[rows]) * weights[rows, slot, None].to(x.dtype)
        out.append((f"{name}.E{e}", write))
    return out


class FusedExperts:
    """The experts of Qwen's sparse MLP blocks (``mlp.gate`` the router, ``mlp.experts`` fused;
    Qwen3.5-MoE's also ``mlp.shared_expert`` scaled by ``sigmoid(mlp.shared_expert_gate(x))``),
    mixed into a family adapter."""

    def moe_experts(self, block: int) -> int:
        experts = getattr(self._layer(block).mlp, "experts", None)
        return 0 if experts is None else int(experts.num_experts)

    def expert_writes(self, block: int, x: torch.Tensor, expert: int | None = None) -> list:
        """The routed experts' writes and, where the block has one, ``L{l}.shared_expert``."""
        mlp = self._layer(block).mlp
        parts = routed_writes(f"L{block}", mlp.gate, mlp.experts, x, expert)
        shared = getattr(mlp, "shared_expert", None)
        if expert is None and shared is not None:
            parts.append((f"L{block}.shared_expert", torch.sigmoid(mlp.shared_expert_gate(x)) * shared(x)))
        return parts


class Qwen3VLMoeAdapter(FusedExperts, Qwen3VLAdapter):
    """Qwen3-VL with mixture-of-experts MLPs (see the module docstring)."""

    declaration = replace(
        Qwen3VLAdapter.declaration,
        name="qwen3_vl_moe",
        architectures=("Qwen3VLMoeForConditionalGeneration",),
        edit_sites=(*Qwen3VLAdapter.declaration.edit_sites, "expert"),
    )
