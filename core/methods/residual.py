"""Residual decomposition and direct logit attribution (METHODS.md 4.4, 4.7).

    x_L = x_0 + sum_l sum_h W_O^h z^h_l + sum_l b_O,l + sum_l m_l

Each component ``c`` is reported under every convention, side by side:

* ``norm``: ||c||_2 (ignores direction);
* ``projection``: u^T c, no norm at all;
* ``dla_frozen``: u^T (gain * center(c) / sigma(x_L)), the final norm's
  scale frozen at x_L. Additive: it sums to u^T (Norm_f(x_L) - bias_f);
* ``dla_jacobian``: u^T J_Norm_f(x_L) c, a first-order sensitivity. For a
  scale-invariant norm it sums to about 0, so it is not an additive split.

``u`` is W_U[:, answer] - W_U[:, foil] with a foil, else W_U[:, answer].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.audit import AuditRecord


@dataclass
class Component:
    name: str
    norm: float
    projection: float
    dla_frozen: float
    dla_jacobian: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ResidualDecomposition:
    """Components of x_L at one position, under each norm convention.

    Attributes:
        reconstruction_max_abs_err: max |sum of components - x_L|.
        target_logit: u^T (W_U^T Norm_f(x_L)) + u^T b_U, the model's own logit
            (difference) at this position.
        frozen_sum_expected: what ``dla_frozen`` must sum to:
            target_logit - u^T b_U - u^T bias_f.
    """

    position: int
    answer_id: int
    foil_id: int | None
    components: list[Component]
    reconstruction_max_abs_err: float
    target_logit: float
    frozen_sum_expected: float
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "answer_id": self.answer_id,
            "foil_id": self.foil_id,
            "reconstruction_max_abs_err": self.reconstruction_max_abs_err,
            "target_logit": self.target_logit,
            "frozen_sum_expected": self.frozen_sum_expected,
            "components": [c.to_dict() for c in self.components],
            "audit": self.audit.to_dict() if self.audit else None,
        }


def target_direction(adapter, answer_id: int, foil_id: int | None) -> torch.Tensor:
    """``u (d_model,)``: the answer's unembedding column minus the foil's."""
    W_U = adapter.W_U
    u = W_U[:, answer_id]
    return u - W_U[:, foil_id] if foil_id is not None else u


def component_stack(adapter, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
    """Names and ``(n_components, d_model)`` vectors that sum to x_L at ``position``."""
    names = ["embed"]
    vecs = [trace.resid_pre[0][batch, position]]
    for block, block_name in enumerate(trace.block_names):
        heads = trace.head_output(adapter, block, position, batch)  # (heads, d_model)
        names += [f"{block_name}.H{h}" for h in range(heads.shape[0])]
        vecs += list(heads)
        b_O = adapter.b_O(block)
        if torch.any(b_O != 0):
            names.append(f"bias.{block_name}.attn_out")
            vecs.append(b_O.to(heads.dtype))
        names.append(f"{block_name}.mlp")
        vecs.append(trace.mlp_out[block][batch, position])
    return names, torch.stack(vecs)


@torch.no_grad()
def decompose(
    adapter, trace, answer_id: int, foil_id: int | None = None, position: int | None = None, batch: int = 0
) -> ResidualDecomposition:
    """Split x_L at ``position`` (default: the answer position) into components."""
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    names, C = component_stack(adapter, trace, pos, batch)
    x_L = trace.final_resid[batch, pos]
    norm_f = adapter.final_norm_layer()
    u = target_direction(adapter, answer_id, foil_id).to(C.dtype)
    b_U = adapter.b_U.to(C.dtype)
    u_bias = b_U[answer_id] - (b_U[foil_id] if foil_id is not None else 0)
    norm_bias = norm_f.bias.to(C.dtype) @ u if norm_f.bias is not None else torch.zeros((), dtype=C.dtype)
    target = norm_f(x_L) @ u + u_bias
    proj = C @ u
    frozen = norm_f.frozen(x_L, C) @ u
    jac = C @ norm_f.vjp(x_L, u)
    norms = C.norm(dim=-1)
    comps = [
        Component(n, float(a), float(b), float(c), float(d)) for n, a, b, c, d in zip(names, norms, proj, frozen, jac)
    ]
    err = float((C.sum(0) - x_L).abs().max())
    audit = AuditRecord.for_method(
        "residual DLA",
        controls=[
            "reconstruction checked",
            "final norm scale frozen at x_L (dla_frozen)",
            "linearised at x_L (dla_jacobian)",
        ]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={"position": pos, "answer_id": answer_id, "foil_id": foil_id, "n_components": len(names)},
        notes=[
            "dla_frozen is additive: it sums to the logit (difference) minus the unembedding and final-norm biases",
            "dla_jacobian is a first-order sensitivity at x_L; it does not sum to the logit",
            "an addend's direct projection says nothing of its indirect effect through later layers",
        ],
    )
    return ResidualDecomposition(
        pos, answer_id, foil_id, comps, err, float(target), float(target - u_bias - norm_bias), audit
    )
