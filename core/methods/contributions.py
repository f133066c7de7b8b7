"""Source contributions (docs/METHODS.md §4.1, §4.4) for every head and source at one
query position, without materialising ``(layers, heads, sources, d_model)``.

    c^h_{p<-j} = A^h_{p,j} W_O^h (g^h_p * (W_V^h Norm(r_j) + b_V^h))

(``g`` the query's output gate where the family gates its heads, Qwen3.5; else 1)
exactly the value path the model computes (biases included; sum_j c = the
head's output at p). For a readout direction ``g`` in the residual space,
``g^T c = A_{p,j} (v_j^h . (W_O^h g))``, so each convention is one matrix
product per layer:

* ``projection``: g = u;
* ``dla_frozen``: g = center(gain * u) / sigma(x_L)  (final norm scale frozen);
* ``dla_jacobian``: g = J_Norm_f(x_L)^T u;
* ``norm``: ||c|| = A_{p,j} sqrt(v^T (W_O^h W_O^h^T) v), via a (d_head, d_head) Gram matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.methods.residual import target_direction
from core.results.audit import AuditRecord
from core.shell.precision import accumulating


@dataclass
class SourceContributions:
    """Each field is a list over blocks of ``(heads, sources)``: sources are
    every sequence position for self-attention blocks (keys the mask hides
    weigh 0) and the visual tokens for cross-attention blocks (``trace.block_kinds``);
    None for a block without heads (a linear-attention or convolution layer)."""

    position: int
    answer_id: int
    foil_id: int | None
    norm: list[torch.Tensor]
    projection: list[torch.Tensor]
    dla_frozen: list[torch.Tensor]
    dla_jacobian: list[torch.Tensor]
    audit: AuditRecord = field(repr=False, default=None)


@torch.no_grad()
def source_contributions(
    adapter, trace, answer_id: int, foil_id: int | None = None, position: int | None = None, batch: int = 0
) -> SourceContributions:
    """All heads x all sources for the target position (patterns for that
    position must have been captured at every layer)."""
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    qi = (trace.query_positions == pos).nonzero()
    if len(qi) == 0 or not set(trace.attention_blocks) <= set(trace.patterns):
        raise ValueError(f"capture the pattern of position {pos} at every block first")
    qi = int(qi[0])
    x_L = accumulating(trace.final_resid[batch, pos])
    dtype = x_L.dtype  # float32 for a half-precision model: every product below sums in it
    u = target_direction(adapter, answer_id, foil_id).to(x_L.device, dtype)
    norm_f = adapter.final_norm_layer()
    directions = torch.stack([u, norm_f.frozen_readout(x_L, u), norm_f.vjp(x_L, u)])  # (3, d_model)
    out = {k: [] for k in ("norm", "projection", "dla_frozen", "dla_jacobian")}
    for layer in range(trace.n_blocks):
        if layer not in trace.attention_blocks:  # no heads, no pattern (a hybrid decoder's other layers)
            for values in out.values():
                values.append(None)
            continue
        source = trace.kv_source[layer]
        # every key, not just 0..pos: a prefix-LM (PaliGemma) lets a query read later keys; masked keys weigh 0
        r = trace.resid_pre[layer][batch] if source is None else source[batch]
        v = torch.einsum("pm,hmd->phd", adapter.kv_norm(layer)(r), adapter.W_V(layer).to(dtype))
        v = v + adapter.b_V(layer).to(dtype)  # (sources, heads, d_head)
        A = trace.patterns[layer][batch, :, qi, : r.shape[0]].to(v.device, dtype)  # (heads, sources)
        W_O = adapter.W_O(layer).to(dtype)  # (heads, d_head, d_model)
        # post-norm families (BLIP): the frozen norms between this block's output and x_L, transposed
        dirs = adapter.readout_pullback(trace, layer, pos, directions, batch)
        read = torch.einsum("hdm,km->khd", W_O, dirs.to(W_O.device))  # (3, heads, d_head); a device map: the block's
        gram = torch.einsum("hdm,hem->hde", W_O, W_O)
        gate = adapter.output_gate(trace, layer, batch)
        if gate is not None:  # the query's gate scales every source's value alike: fold it into the readers
            g = gate[pos].to(read.device, dtype)  # (heads, d_head)
            read, gram = read * g, g[:, :, None] * gram * g[:, None, :]
        proj = torch.einsum("phd,khd->khp", v, read) * A  # (3, heads, sources)
        nrm = torch.einsum("phd,hde,phe->hp", v, gram, v).clamp_min(0).sqrt() * A
        out["projection"].append(proj[0].to(x_L.device))
        out["dla_frozen"].append(proj[1].to(x_L.device))
        out["dla_jacobian"].append(proj[2].to(x_L.device))
        out["norm"].append(nrm.to(x_L.device))
    audit = AuditRecord.for_method(
        "source contribution",
        controls=[
            "value path as computed (pre-norm, biases included)",
            f"{adapter.frozen_convention} (dla_frozen)",
            "linearised at x_L (dla_jacobian)",
            "signed",
        ]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={"position": pos, "answer_id": answer_id, "foil_id": foil_id},
        notes=[
            "a large norm can be suppressed later; a small direct projection can have a large indirect effect",
            "normalising each contribution separately and summing is not the normalised sum",
        ],
    )
    return SourceContributions(
        pos, answer_id, foil_id, out["norm"], out["projection"], out["dla_frozen"], out["dla_jacobian"], audit
    )
