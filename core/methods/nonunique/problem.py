"""The problem: one head at one query position (:class:`HeadProblem`), collected
from a trace (:func:`head_problem`) or built from raw tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from core.errors import InterventionError
from core.methods.nonunique.query_map import QueryMap, query_path
from core.models.adapter import Adapter
from core.shell.precision import accumulation_dtype


@dataclass
class HeadProblem:
    """One head at one query position, everything in float64.

    Attributes:
        values: ``(keys, d)`` the values in the measured space (``space``):
            ``v_j`` (z) or ``v_j L`` with ``L L^T = W_O^h W_O^h^T`` (write), so
            ``||x @ values||`` is the norm of the head's write for weights ``x``.
        pattern: ``(keys,)`` the real pattern A (zero on masked keys).
        allowed: ``(keys,)`` bool, the model's mask for this query.
        scores: ``(keys,)`` the real pre-softmax scores (scaled, transformed; before the mask).
        keys: ``(keys, d_head)`` the real keys (after bias, norms, rotation).
        query: ``(d_head,)`` the real query (after bias, norms, rotation).
        score_scale: the factor ``q . k`` is multiplied by.
        sources: ``(keys,)`` bool, the set mass is moved off.
        transform: what the model does to scaled scores before the mask (identity by default).
        residual: ``(d_model,)`` the residual the query reads, when the residual variant is mapped.
        query_of_residual: ``(d_model,) -> (d_head,)`` the model's query for a residual (None: not mapped).
        query_map: the queries a residual can produce (:class:`QueryMap`), None if not mapped.
    """

    values: torch.Tensor
    pattern: torch.Tensor
    allowed: torch.Tensor
    scores: torch.Tensor
    keys: torch.Tensor
    query: torch.Tensor
    score_scale: float
    sources: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    residual: torch.Tensor | None = None
    query_of_residual: Callable[[torch.Tensor], torch.Tensor] | None = None
    query_map: QueryMap | None = None
    space: str = "write"
    block: int | None = None
    head: int | None = None
    position: int | None = None
    block_name: str | None = None
    checks: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def output(self) -> torch.Tensor:
        """``(d,)`` o = A @ values."""
        return self.pattern @ self.values

    def scores_of_query(self, q: torch.Tensor) -> torch.Tensor:
        """``(d_head,) -> (keys,)`` transformed scaled scores of a query against the real keys."""
        s = (self.keys @ q) * self.score_scale
        return s if self.transform is None else self.transform(s)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """``(keys,) -> (keys,)`` softmax over the allowed keys, exactly 0 elsewhere."""
        return scores.masked_fill(~self.allowed, float("-inf")).softmax(-1)

    def relative_error(self, pattern: torch.Tensor) -> float:
        """``||(A' - A) values|| / ||o||`` for a full-length pattern ``(keys,)``."""
        return float(((pattern - self.pattern) @ self.values).norm() / self.output.norm().clamp_min(1e-300))

    @classmethod
    def from_tensors(
        cls,
        values: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        *,
        score_scale: float | None = None,
        allowed: torch.Tensor | None = None,
        sources: Sequence[int] | None = None,
    ) -> HeadProblem:
        """A problem from raw tensors (the real pattern is the softmax of ``query``
        against ``keys``): values ``(keys, d)``, keys ``(keys, d_head)``, query ``(d_head,)``."""
        values, keys, query = values.double(), keys.double(), query.double()
        n = keys.shape[0]
        allowed = torch.ones(n, dtype=torch.bool) if allowed is None else torch.as_tensor(allowed, dtype=torch.bool)
        scale = keys.shape[1] ** -0.5 if score_scale is None else float(score_scale)
        scores = (keys @ query) * scale
        pattern = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        src = source_mask(pattern, allowed, sources)
        return cls(values, pattern, allowed, scores, keys, query, scale, src, space="given")


def source_mask(pattern: torch.Tensor, allowed: torch.Tensor, sources: Sequence[int] | None) -> torch.Tensor:
    n = pattern.shape[0]
    mask = torch.zeros(n, dtype=torch.bool)
    if sources is None:
        mask[int(pattern.masked_fill(~allowed, -1.0).argmax())] = True
        return mask
    idx = [int(i) for i in sources]
    if not idx:
        raise InterventionError("the source set is empty")
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise InterventionError(f"source keys {bad} are out of range (this block has {n} keys)")
    hidden = [i for i in idx if not bool(allowed[i])]
    if hidden:
        raise InterventionError(f"source keys {hidden} are masked for this query (no pattern can put mass there)")
    mask[idx] = True
    return mask


def visual_token_keys(trace, block: int, token_indices: Sequence[int], batch: int = 0) -> list[int]:
    """Key indices of visual tokens (ordinals, as :func:`core.forward.geometry.region_tokens`
    returns them) in block ``block``: sequence positions for self-attention,
    the ordinals themselves for cross-attention keys."""
    idx = [int(i) for i in token_indices]
    if trace.block_kinds[block] == "cross":
        return idx
    vp = trace.visual_positions[batch]
    if any(not 0 <= i < vp.shape[0] for i in idx):
        raise InterventionError(f"visual token ordinals must be in 0..{vp.shape[0] - 1}")
    return [int(vp[i]) for i in idx]


@torch.no_grad()
def head_problem(
    adapter,
    trace,
    block: int,
    head: int,
    position: int | None = None,
    sources: Sequence[int] | None = None,
    *,
    space: str = "write",
    batch: int = 0,
) -> HeadProblem:
    """Collect head ``head`` of block ``block`` at query ``position`` (default:
    the answer position) from a trace captured with that block's pattern and
    position (``capture(..., pattern_layers=[block, ...], query_positions=[position, ...])``).

    Args:
        sources: key indices to move mass off (self-attention: sequence
            positions; cross-attention: visual-token ordinals; see
            :func:`visual_token_keys`). Default: the real pattern's argmax key.
        space: "write" (the head's write ``W_O^h z``; b_O does not depend on A
            and is left out) or "z" (the o_proj input).
    """
    adapter = getattr(adapter, "adapter", adapter)
    if space not in ("write", "z"):
        raise InterventionError(f"space must be 'write' or 'z', not {space!r}")
    if not 0 <= block < trace.n_blocks:
        raise InterventionError(f"block {block} is out of range (0..{trace.n_blocks - 1})")
    if not 0 <= head < adapter.n_heads:
        raise InterventionError(f"head {head} is out of range (0..{adapter.n_heads - 1})")
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    if block not in trace.patterns:
        raise InterventionError(f"the trace has no pattern for block {block}: capture with pattern_layers including it")
    hits = (trace.query_positions == pos).nonzero()
    if len(hits) == 0:
        raise InterventionError(f"the trace has no pattern for query position {pos}: capture with query_positions")
    qi = int(hits[0])
    source = trace.kv_source[block]
    r = trace.resid_pre[block][batch] if source is None else source[batch]
    dt = accumulation_dtype(r.dtype)  # the norm's output dtype: float32 for a half-precision model
    f64 = torch.float64
    dev = r.device
    cpu = {"device": "cpu", "dtype": f64}  # everything the search touches: CPU, float64
    v = adapter.kv_norm(block)(r) @ adapter.W_V(block)[head].to(dev, dt) + adapter.b_V(block)[head].to(dev, dt)
    gate = adapter.output_gate(trace, block, batch)
    if gate is not None:  # the query's gate scales every key's value alike (Qwen3.5): z = gate * (A v)
        v = v * gate[pos, head].to(v)
    v = v.to(**cpu)  # (keys, d_head)
    n = v.shape[0]
    A = trace.patterns[block][batch, head, qi, :n].to(**cpu)
    allowed = adapter.allowed_keys(trace, block, batch)[pos].cpu().bool()[:n]
    q_all, k_all = adapter.queries_keys(trace, block, batch)
    q, k = q_all[pos, head].to(**cpu), k_all[:, head].to(**cpu)
    scale = float(adapter.score_scale(block))

    def transform(s: torch.Tensor) -> torch.Tensor:
        return adapter.score_transform(block, s.view(1, 1, -1)).view(-1)

    scores = transform((k @ q) * scale)
    W_O = adapter.W_O(block)[head].to(**cpu)  # (d_head, d_model)
    if space == "write":
        evals, U = torch.linalg.eigh(W_O @ W_O.T)
        values = v @ (U * evals.clamp_min(0).sqrt())
    else:
        values = v
    z_real = trace.z[block][batch, pos, head].to(**cpu)
    masked_mass = float(A[~allowed].sum())
    A = A.masked_fill(~allowed, 0.0)
    total = float(A.sum())
    A = A / total  # the model's softmax may run in float32: its row sums to 1 only to that precision
    from_scores = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    checks = {
        "output_reconstruction_error": float((A @ v - z_real).norm() / z_real.norm().clamp_min(1e-300)),
        "scores_pattern_max_abs_error": float((from_scores - A).abs().max()),
        "masked_mass": masked_mass,
        "pattern_sum_error": abs(total - 1.0),
    }
    notes = (
        ["the trace records an edited run (ablation / patching): A and o are the edited ones"] if trace.edits else []
    )
    # the residual variant (c-residual) and the reachability of free queries
    r_p = trace.resid_pre[block][batch, pos].to(**cpu)
    query_of_residual, query_map, path_checks, path_note = query_path(
        adapter, trace, block, head, pos, q, r_p, device=dev, batch=batch
    )
    checks.update(path_checks)
    if path_note is not None:
        notes.append(path_note)
    src = source_mask(A, allowed, sources)
    identity = type(adapter).score_transform is Adapter.score_transform
    return HeadProblem(
        values,
        A,
        allowed,
        scores,
        k,
        q,
        scale,
        src,
        None if identity else transform,
        r_p if query_of_residual is not None else None,
        query_of_residual,
        query_map,
        space,
        block,
        head,
        pos,
        trace.block_names[block],
        checks,
        notes,
    )


def with_values(problem: HeadProblem, values: torch.Tensor) -> HeadProblem:
    """The same problem with other values ``(keys, d)`` (constructed cases: what
    if two sources carried the same value?)."""
    return replace(problem, values=values.double())
