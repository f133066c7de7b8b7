"""Logit lens (METHODS.md 4.8): z_l = W_U Norm_f(x_l) + b_U.

The final norm is recomputed on each layer's own residual (never the final
layer's scale). Row ``l`` reads the residual entering block ``l``; one extra
row with ``layer = n_layers`` reads x_L and equals the model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.audit import AuditRecord


@dataclass
class LensRow:
    layer: int
    answer_rank: int  # 0 = top
    answer_logit: float
    logit_diff: float | None
    kl_to_final: float  # KL(final || lens) in nats
    top: list[tuple[str, float]]  # (token, probability)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["top"] = [[t, p] for t, p in self.top]
        return d


@dataclass
class LogitLens:
    position: int
    rows: list[LensRow]
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "rows": [r.to_dict() for r in self.rows],
            "audit": self.audit.to_dict() if self.audit else None,
        }


def lens_logits(adapter, x: torch.Tensor) -> torch.Tensor:
    """``(..., d_model) -> (..., vocab)``: the final norm recomputed on ``x``, then unembedding."""
    return adapter.final_norm_layer()(x) @ adapter.W_U.to(x.dtype) + adapter.b_U.to(x.dtype)


@torch.no_grad()
def logit_lens(
    adapter,
    trace,
    answer_id: int,
    foil_id: int | None = None,
    position: int | None = None,
    top_k: int = 5,
    batch: int = 0,
) -> LogitLens:
    """The lens at every layer for one position (default: the answer position)."""
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    states = [r[batch, pos] for r in trace.resid_pre] + [trace.final_resid[batch, pos]]
    logits = lens_logits(adapter, torch.stack(states)).float()  # (n_layers + 1, vocab)
    logp = logits.log_softmax(-1)
    final = logp[-1]
    rows = []
    for layer, (lg, lp) in enumerate(zip(logits, logp)):
        kl = float((final.exp() * (final - lp)).sum())
        rank = int((lg > lg[answer_id]).sum())
        probs, ids = lp.exp().topk(top_k)
        rows.append(
            LensRow(
                layer,
                rank,
                float(lg[answer_id]),
                float(lg[answer_id] - lg[foil_id]) if foil_id is not None else None,
                kl,
                [(adapter.token_str(int(i)), float(p)) for p, i in zip(probs, ids)],
            )
        )
    audit = AuditRecord.for_method(
        "logit lens",
        controls=["final norm recomputed on each layer's residual"],
        parameters={"position": pos, "answer_id": answer_id, "foil_id": foil_id, "top_k": top_k},
        notes=[
            "intermediate layers were never trained to live in the final basis: poor readout may be "
            "coordinate mismatch, not absence; good readout does not prove downstream use"
        ],
    )
    return LogitLens(pos, rows, audit)
