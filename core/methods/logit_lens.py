"""Logit lens (docs/METHODS.md §4.8): z_l = W_U Norm_f(x_l) + b_U.

The final norm is recomputed on each layer's own residual (never the final
layer's scale). Row ``l`` reads the residual entering block ``l``; one extra
row with ``layer = n_layers`` reads x_L and equals the model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.forward.capture import capture
from core.methods.patterns import Distribution
from core.results.audit import AuditRecord
from core.shell.precision import accumulating


@dataclass
class LensRow:
    """One layer of a lens read-out. ``reader`` names the tuned-lens reader that
    made the row ("trained", "mean", "random", ...; None: the logit lens, whose
    JSON row has no ``reader`` key)."""

    layer: int
    answer_rank: int  # 0 = top
    answer_logit: float
    logit_diff: float | None
    kl_to_final: float  # KL(final || lens) in nats
    top: list[tuple[str, float]]  # (token, probability)
    reader: str | None = None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["top"] = [[t, p] for t, p in self.top]
        if self.reader is None:
            del d["reader"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LensRow:
        """The row a :meth:`to_dict` (a stored analyze ``logit_lens`` or ``tuned_lens`` row) describes."""
        return cls(
            d["layer"],
            d["answer_rank"],
            d["answer_logit"],
            d["logit_diff"],
            d["kl_to_final"],
            [(t, p) for t, p in d["top"]],
            d.get("reader"),
        )


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
    """``(..., d_model) -> (..., vocab)``: the final norm recomputed on ``x``, then unembedding
    (and the model's soft-cap, :meth:`~core.models.adapter.Adapter.cap_logits`), in the
    accumulation dtype (float32 for a half-precision ``x``)."""
    x = accumulating(x)
    # on the unembedding's device: a device map puts each block's residual on its own device
    W_U = adapter.W_U
    x = x.to(W_U.device)
    return adapter.cap_logits(adapter.final_norm_layer()(x) @ W_U.to(x.dtype) + adapter.b_U.to(x.device, x.dtype))


def lens_row(
    adapter, layer: int, logits: torch.Tensor, final_logp: torch.Tensor, answer_id: int, foil_id: int | None, top_k: int
) -> LensRow:
    """One row of a lens read-out from a reader's ``logits (vocab,)`` at one
    layer and the model's own final log-probabilities: the answer's rank and
    logit, the logit difference to the foil, KL(final || reader) in nats, the top tokens."""
    logp = logits.log_softmax(-1)
    probs, ids = logp.exp().topk(min(top_k, logp.shape[-1]))
    return LensRow(
        layer,
        int((logits > logits[answer_id]).sum()),
        float(logits[answer_id]),
        float(logits[answer_id] - logits[foil_id]) if foil_id is not None else None,
        float((final_logp.exp() * (final_logp - logp)).sum()),
        [(adapter.token_str(int(i)), float(p)) for p, i in zip(probs, ids)],
    )


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
    final = logits[-1].log_softmax(-1)
    rows = [lens_row(adapter, layer, lg, final, answer_id, foil_id, top_k) for layer, lg in enumerate(logits)]
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


@dataclass
class PositionLens:
    """The lens at many positions at once (e.g. every visual token).

    Attributes:
        positions: ``(n_pos,)`` sequence positions.
        top_ids, top_probs: ``(n_layers + 1, n_pos, k)``: the top tokens of the
            lens at each layer (row ``l`` reads the residual entering block ``l``;
            the last row reads x_L) and position.
        target_probs: ``(n_layers + 1, n_pos, n_targets)`` the probability of
            each of ``target_ids`` (empty when none were asked for).
    """

    positions: list[int]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    target_ids: list[int]
    target_probs: torch.Tensor
    audit: AuditRecord = field(repr=False, default=None)

    def top_tokens(self, adapter, layer: int) -> list[str]:
        """The top-1 token at every position for one layer."""
        return [adapter.token_str(int(i)) for i in self.top_ids[layer, :, 0]]


@torch.no_grad()
def logit_lens_positions(
    adapter, trace, positions=None, *, top_k: int = 3, target_ids: list[int] | None = None, batch: int = 0
) -> PositionLens:
    """The lens over many positions (default: the visual tokens), every layer.

    Visual tokens of a self-attention model live in the text stream, so the
    lens says which vocabulary item each patch's state is closest to in final
    coordinates ("this patch reads as 'red' from layer 2"). Cross-attention
    models have no visual positions in the stream: refused.
    """
    pos = trace.visual_positions[batch] if positions is None else torch.as_tensor(positions)
    if pos.numel() == 0:
        raise ValueError("no positions to read: cross-attention models keep visual tokens out of the text stream")
    states = torch.stack([r[batch, pos] for r in trace.resid_pre] + [trace.final_resid[batch, pos]])
    probs = lens_logits(adapter, states).float().softmax(-1)  # (n_layers + 1, n_pos, vocab)
    top_probs, top_ids = probs.topk(top_k, dim=-1)
    targets = list(target_ids or [])
    target_probs = probs[..., targets] if targets else probs.new_zeros(*probs.shape[:2], 0)
    audit = AuditRecord.for_method(
        "logit lens",
        controls=["final norm recomputed on each layer's residual", "read at the given positions, not the answer"],
        parameters={"positions": pos.tolist(), "top_k": top_k, "target_ids": targets},
        notes=[
            "a visual token's state is not trained to predict a next token; its lens reading is what the "
            "final head would see in it, not what the model uses it for"
        ],
    )
    return PositionLens(pos.tolist(), top_ids, top_probs, targets, target_probs, audit)


@dataclass
class LensGroup:
    """The lens at the answer position over a group of samples, per layer."""

    n: int
    answer_rank: list  # per layer: patterns.Distribution (None when n == 0)
    logit_diff: list
    kl_to_final: list
    top1_rate: list[float | None]  # per layer: share of samples whose lens top-1 is the answer

    def to_dict(self) -> dict:
        def dist(xs):
            return [x.to_dict() if x is not None else None for x in xs]

        return {
            "n": self.n,
            "answer_rank": dist(self.answer_rank),
            "logit_diff": dist(self.logit_diff),
            "kl_to_final": dist(self.kl_to_final),
            "top1_rate": self.top1_rate,
        }


@dataclass
class LensOverSamples:
    """The logit lens split by whether the model answered correctly (4.8:
    compare successes with failures)."""

    n_layers: int
    correct: LensGroup
    incorrect: LensGroup
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "correct": self.correct.to_dict(),
            "incorrect": self.incorrect.to_dict(),
            "audit": self.audit.to_dict() if self.audit else None,
        }


def logit_lens_over_samples(loaded, samples, *, progress=None, cancel=None) -> LensOverSamples:
    """Run the lens at the answer position of every sample and split the
    samples by whether the model's top token is the correct answer.

    Args:
        samples: ``(image, question, answer, foil)`` items (foil may be None);
            the lens tracks the correct answer (minus the foil where given).
        progress: ``progress(done, total, message)``; cancel: returns True to stop.
    """

    adapter = loaded.adapter
    samples = list(samples)
    groups = {True: [], False: []}
    for n, (image, question, answer, foil) in enumerate(samples):
        if cancel is not None and cancel():
            break
        tr = capture(loaded, image, question, pattern_layers=[])
        a = adapter.token_id(answer)
        f = adapter.token_id(foil) if foil else None
        pos = int(tr.answer_positions[0])
        lens = logit_lens(adapter, tr, a, f, top_k=1)
        groups[int(tr.logits[0, pos].argmax()) == a].append(lens)
        if progress:
            progress(n + 1, len(samples), "logit lens")
    n_layers = len(adapter.blocks)  # lens rows: one per block, plus x_L

    def summarise(lenses: list[LogitLens]) -> LensGroup:
        if not lenses:
            return LensGroup(
                0, [None] * (n_layers + 1), [None] * (n_layers + 1), [None] * (n_layers + 1), [None] * (n_layers + 1)
            )
        rows = list(zip(*[x.rows for x in lenses]))  # per layer: the samples' rows
        diffs = [[r.logit_diff if r.logit_diff is not None else r.answer_logit for r in layer] for layer in rows]
        return LensGroup(
            len(lenses),
            [Distribution.of([r.answer_rank for r in layer]) for layer in rows],
            [Distribution.of(d) for d in diffs],
            [Distribution.of([r.kl_to_final for r in layer]) for layer in rows],
            [sum(r.answer_rank == 0 for r in layer) / len(layer) for layer in rows],
        )

    audit = AuditRecord.for_method(
        "logit lens",
        controls=["final norm recomputed on each layer's residual", "success/failure samples compared"],
        parameters={"n_samples": len(groups[True]) + len(groups[False]), "n_correct": len(groups[True])},
        notes=[
            "poor readout at a layer may be coordinate mismatch, not absence; a group difference is a "
            "correlation over this sample set"
        ],
    )
    return LensOverSamples(n_layers, summarise(groups[True]), summarise(groups[False]), audit)
