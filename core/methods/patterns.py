"""Attention pattern estimators (METHODS.md 4.2) for one query position.

Mass on BOS (and other sink positions) is always reported on its own, never
folded into the visual or entity averages; padding never counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.audit import AuditRecord


@dataclass
class HeadSummary:
    """One head's pattern at one query position.

    ``visual_patch_mass`` is the mass on each visual token laid out on the
    patch grid ``(rows, cols)``, patch-granular (no interpolation).
    """

    layer: int  # block index (see Trace.block_names)
    head: int
    block: str
    visual_mass: float
    bos_mass: float
    entropy: float  # nats, over the whole pattern
    argmax_source: int
    visual_patch_mass: list[list[float]]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PatternSummary:
    query_position: int
    heads: list[HeadSummary]
    audit: AuditRecord = field(repr=False, default=None)


def mass(pattern: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """``pattern (..., pos)``, ``sources (n,)`` positions -> ``(...)`` summed weight."""
    return pattern[..., sources].sum(-1)


def entropy(pattern: torch.Tensor) -> torch.Tensor:
    """``(..., pos) -> (...)``: -sum A log A in nats (0 log 0 = 0)."""
    p = pattern.clamp_min(0)
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def summarize_heads(
    trace, grid: tuple[int, int], query_index: int = 0, batch: int = 0, sink_positions: tuple[int, ...] = (0,)
) -> PatternSummary:
    """Mass on the visual tokens, on BOS, entropy and argmax source for every
    kept layer and head at ``trace.query_positions[query_index]``.

    Args:
        grid: ``(rows, cols)`` of the visual tokens, row-major.
        sink_positions: positions reported as BOS/sink mass (default: position 0).
    """
    heads = []
    for layer in sorted(trace.patterns):
        pat = trace.patterns[layer][batch, :, query_index].float()  # (heads, keys)
        if trace.block_kinds[layer] == "cross":  # every key is a visual token, none is a sink
            vis = torch.arange(pat.shape[-1])
            sinks = torch.zeros(0, dtype=torch.long)
        else:
            vis = trace.visual_positions[batch]
            sinks = torch.tensor(sink_positions, dtype=torch.long)
        vm = mass(pat, vis)
        bm = mass(pat, sinks)
        ent = entropy(pat)
        arg = pat.argmax(-1)
        grid_mass = pat[:, vis].reshape(pat.shape[0], *grid) if len(vis) else torch.zeros(pat.shape[0], *grid)
        for h in range(pat.shape[0]):
            heads.append(
                HeadSummary(
                    layer,
                    h,
                    trace.block_names[layer],
                    float(vm[h]),
                    float(bm[h]),
                    float(ent[h]),
                    int(arg[h]),
                    grid_mass[h].tolist(),
                )
            )
    qpos = int(trace.query_positions[query_index])
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=["padding excluded", "BOS/sink mass reported separately", "patch-granular (not interpolated)"],
        parameters={"query_position": qpos, "layers": sorted(trace.patterns), "sink_positions": list(sink_positions)},
        notes=[
            "attention aligned with a region shows routing co-occurrence only; a high weight on a source "
            "whose value is small may not matter"
        ],
    )
    return PatternSummary(qpos, heads, audit)


def rollout(trace, alpha: float = 0.5, heads: str | int = "mean", batch: int = 0) -> torch.Tensor:
    """Attention rollout (4.6): ``R = prod_l (alpha A_l + (1 - alpha) I)``.

    Nodes are the sequence positions, followed (for cross-attention models)
    by the visual tokens, which only receive edges from cross-attention
    blocks and keep their identity row. Needs full patterns (capture with
    every query position kept). Returns ``(nodes, nodes)``; row ``p`` is the
    reachability of each node from position ``p``. Visual tokens of a
    self-attention model are sequence positions already.
    """
    n = trace.input_ids.shape[1]
    if trace.query_positions is None or len(trace.query_positions) != n:
        raise ValueError("rollout needs the full pattern: capture with query_positions=range(seq_len)")
    n_vis = next((trace.patterns[b].shape[-1] for b, k in enumerate(trace.block_kinds) if k == "cross"), 0)
    eye = torch.eye(n + n_vis)
    out = eye.clone()
    for block in sorted(trace.patterns):
        pat = trace.patterns[block][batch].float()  # (heads, pos, keys)
        a = pat.mean(0) if heads == "mean" else pat[int(heads)]
        step = eye.clone()
        if trace.block_kinds[block] == "cross":
            step[:n, :n] *= 1 - alpha
            step[:n, n:] = alpha * a
        else:
            step[:n, :n] = alpha * a + (1 - alpha) * torch.eye(n)
        out = step @ out
    return out


def rollout_visual_mass(trace, grid: tuple[int, int], alpha: float = 0.5, batch: int = 0) -> torch.Tensor:
    """Rollout mass from the answer position onto the visual tokens, ``grid`` shaped."""
    r = rollout(trace, alpha, batch=batch)[int(trace.answer_positions[batch])]
    n = trace.input_ids.shape[1]
    vis = trace.visual_positions[batch] if trace.visual_positions.shape[1] else torch.arange(n, r.shape[0])
    return r[vis].reshape(grid)


def rollout_audit(alpha: float, heads) -> AuditRecord:
    return AuditRecord.for_method(
        "rollout / flow",
        controls=[f"residual weight 1 - alpha = {1 - alpha}"],
        parameters={"alpha": alpha, "heads": heads},
        notes=[
            "a structural-flow approximation: ignores value/output projections, head signs and directions, "
            "MLP paths, normalisation and gating; not a conserved decomposition of the output"
        ],
    )
