"""Attention is not uniquely recoverable from outputs (docs/METHODS.md §4.10).

For one head at one query position the head's output is

    o = sum_j A_j v_j,      v_j = Norm(r_j) W_V^h + b_V^h   (d_head)

(read in the space the rest of the model sees: ``space="write"`` measures
``||(A' - A) V W_O^h||``, i.e. the head's write into the residual stream;
``space="z"`` the o_proj input). Other patterns ``A'`` can give nearly the same
output. This module searches for the ``A'`` that reproduces ``o`` within a
relative tolerance (``||o' - o|| / ||o|| <= tol``) while moving the most mass
off a source set ``S`` (default: the real pattern's argmax key), at three
constraint levels, reported side by side:

* **(a) simplex and mask**: ``A' >= 0``, ``sum A' = 1``, ``A'_j = 0`` on keys
  the model's mask hides. Convex (a linear objective over the simplex cut by
  an ellipsoid): solved by an interior-point method, so the result is an
  achieved ``A'`` *and* a proven bound (weak duality): no pattern within
  tolerance puts less than ``certified_min_source_mass`` on ``S``.
* **(b) bounded scores**: ``A' = softmax(s + delta)`` over the allowed keys,
  ``||delta||_inf <= B`` (logit units) around the model's real pre-softmax
  scores ``s``. Non-convex: a local search (penalty continuation with Adam
  and analytic gradients), so the moved mass is achieved, not a maximum; the
  bound alone (ignoring the output) caps what can be removed, and that cap
  is reported as the proven bound.
* **(c) legal query**: keys fixed as the model computed them, ``A' =
  softmax(score_transform(q' . k_j * scale))``. ``c-query`` optimises the
  post-rotation query ``q'`` freely and then checks whether any residual can
  produce it (``Norm(r)`` has a fixed RMS, so the reachable queries fill an
  ellipsoid, :class:`QueryMap`: ``query_reachable``); ``c-residual``
  searches only the reachable queries and returns a residual ``r'`` (with the
  real residual's RMS) whose query, recomputed through the real norm,
  ``W_Q``/``b_Q`` and the position rotation, gives the reported ``A'``.

Every level contains A itself (a: A; b: delta = 0; c: the real query), and
every search starts there, so the reported ``A'`` is never worse than A and
``start_error`` says how exactly each level reproduces A.

What this can say: whether a claim needs the *pattern's reality* (A is the
computed variable of the graph, true on this input whatever this finds) or
only the *output* (if an equally good output exists with the mass elsewhere,
the output alone does not show that the head needs this routing). What it
cannot say: which pattern the model "should" use, or that the source set
causes the answer (interventions do that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from core.audit import AuditRecord
from core.errors import InterventionError

LEVEL_NAMES = {
    "a": "simplex and mask only",
    "b": "softmax of the real scores + delta, |delta|_inf <= B",
    "c-query": "softmax of a free post-rotation query against the real keys",
    "c-residual": "query formed from a residual through the real norm, W_Q, b_Q and rotation; real keys",
}


# ----------------------------------------------------------------------------------------------- the problem
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
        src = _source_mask(pattern, allowed, sources)
        return cls(values, pattern, allowed, scores, keys, query, scale, src, space="given")


def _source_mask(pattern: torch.Tensor, allowed: torch.Tensor, sources: Sequence[int] | None) -> torch.Tensor:
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
    """Key indices of visual tokens (ordinals, as :func:`core.geometry.region_tokens`
    returns them) in block ``block``: sequence positions for self-attention,
    the ordinals themselves for cross-attention keys."""
    idx = [int(i) for i in token_indices]
    if trace.block_kinds[block] == "cross":
        return idx
    vp = trace.visual_positions[batch]
    if any(not 0 <= i < vp.shape[0] for i in idx):
        raise InterventionError(f"visual token ordinals must be in 0..{vp.shape[0] - 1}")
    return [int(vp[i]) for i in idx]


def _rotation_matrix(adapter, trace, block: int, pos: int, d: int, dtype, batch: int) -> torch.Tensor:
    """``(d_head, d_head)`` R with ``q_rotated = q @ R`` at position ``pos`` (identity without RoPE)."""
    if adapter.position_scheme not in ("rope", "mrope") or trace.kv_source[block] is not None:
        return torch.eye(d, dtype=dtype)
    positions = adapter.rope_positions(trace, batch)
    p = positions[..., pos : pos + 1].to(adapter.device)
    eye = torch.eye(d, dtype=dtype, device=adapter.device).view(1, d, d)  # one position, d "heads": row i is e_i
    return adapter.rotate(eye, p)[0]


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
    dt = r.dtype
    f64 = torch.float64
    dev = r.device
    cpu = {"device": "cpu", "dtype": f64}  # everything the search touches: CPU, float64
    v = adapter.kv_norm(block)(r) @ adapter.W_V(block)[head].to(dev, dt) + adapter.b_V(block)[head].to(dev, dt)
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
    query_of_residual = query_map = None
    r_p = trace.resid_pre[block][batch, pos].to(**cpu)
    from core.models.adapter import Adapter

    norm = adapter.attn_norm(block)
    if type(adapter).queries_keys is not Adapter.queries_keys:
        notes.append(f"{adapter.family}: the query path has extra transforms (q/k norms); c-residual not mapped")
    elif getattr(norm, "kind", None) not in ("rmsnorm", "layernorm"):
        notes.append("the query reads the stream without a norm of its own (post-norm); c-residual not mapped")
    else:
        R = _rotation_matrix(adapter, trace, block, pos, q.shape[0], f64, batch).to(**cpu)
        W_Q = adapter.W_Q(block)[head].to(**cpu)
        b_Q = adapter.b_Q(block)[head].to(**cpu)

        def query_of_residual(x: torch.Tensor) -> torch.Tensor:
            """``(d_model,) -> (d_head,)`` through the model's own norm (on its device), W_Q, b_Q, R."""
            return (norm(x.to(dev)).to(**cpu) @ W_Q + b_Q) @ R

        err = float((query_of_residual(r_p) - q).norm() / q.norm().clamp_min(1e-300))
        checks["query_from_residual_error"] = err
        if err > 1e-4:
            notes.append(f"the query recomputed from the residual differs by {err:.2g} (relative); c-residual not run")
            query_of_residual = None
        else:
            query_map = QueryMap(norm, W_Q, b_Q, R, r_p)
    src = _source_mask(A, allowed, sources)
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


class QueryMap:
    """The queries a residual can produce through the block's norm, ``W_Q``,
    ``b_Q`` and the position rotation, for one head at one position.

    ``Norm(r) = gain * u + bias`` with ``||u|| = c sqrt(d_model)`` (``sum u = 0``
    for LayerNorm), ``c = kappa / sqrt(kappa^2 + eps)`` for a residual of RMS
    (LayerNorm: standard deviation) ``kappa``. With ``M = diag(gain) W_Q``
    (rows centred for LayerNorm) the query is ``q = (u M + offset) R`` with
    ``offset = b_Q + bias W_Q``. A sphere of dimension ``> d_head`` maps onto
    the whole solid ellipsoid ``{y : y (M^T M)^-1 y^T <= c^2 d_model}``: a query
    is reachable iff its smallest ``u`` has ``||u|| < c sqrt(d_model)``.
    Queries are parametrised here as ``q = (z S + offset) R`` with ``z`` in the
    unit ball, ``S = c sqrt(d_model) (M^T M)^(1/2)``; :meth:`residual` builds a
    residual with the real residual's scale that produces ``z`` exactly, the
    one closest in direction to the real residual.
    """

    def __init__(self, norm, W_Q: torch.Tensor, b_Q: torch.Tensor, R: torch.Tensor, r_p: torch.Tensor, seed: int = 0):
        f64 = torch.float64
        self.kind = norm.kind
        d = W_Q.shape[0]
        self.d_model = d
        gain = torch.ones(d, dtype=f64) if norm.weight is None else norm.weight_offset + norm.weight.to("cpu", f64)
        M = gain.view(-1, 1) * W_Q.to(f64)
        self.offset = b_Q.to(f64) + (norm.bias.to("cpu", f64) @ W_Q.to(f64) if norm.bias is not None else 0.0)
        if self.kind == "layernorm":
            M = M - M.mean(0, keepdim=True)
            self.mean = float(r_p.mean())
            self.kappa = float(r_p.var(unbiased=False).sqrt())
        else:
            self.mean = 0.0
            self.kappa = float(r_p.pow(2).mean().sqrt())
        self.kappa = max(self.kappa, 1e-6)
        self.c = self.kappa / math.sqrt(self.kappa**2 + float(norm.eps))
        self.M, self.R = M, R.to(f64)
        self.pinv = torch.linalg.pinv(M)  # (d_head, d_model)
        evals, U = torch.linalg.eigh(M.T @ M)
        root = (U * evals.clamp_min(0).sqrt()) @ U.T
        self.S = self.c * math.sqrt(d) * root
        self.S_pinv = torch.linalg.pinv(self.S)
        # the null direction closest to the real residual's own direction
        basis = torch.cat([M, torch.ones(d, 1, dtype=f64)], 1) if self.kind == "layernorm" else M
        Q = torch.linalg.qr(basis).Q
        u_p = r_p.to(f64) - self.mean
        n = u_p - Q @ (Q.T @ u_p)
        if float(n.norm()) < 1e-9 * (float(u_p.norm()) + 1e-12):
            n = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=f64)
            n = n - Q @ (Q.T @ n)
        self.null = n / n.norm()

    def z_of_query(self, q: torch.Tensor) -> torch.Tensor:
        """``(d_head,)`` the ball coordinate of a query (its norm is the reach ratio)."""
        return (q.to(torch.float64) @ self.R.T - self.offset) @ self.S_pinv

    def reach_ratio(self, q: torch.Tensor) -> float:
        """``||u*|| / (c sqrt(d_model))`` for the smallest ``u`` giving ``q``; below 1:
        some residual of the real residual's scale produces ``q`` (inf: outside W_Q's range)."""
        y = q.detach().to(torch.float64) @ self.R.T - self.offset
        u = y @ self.pinv
        if float((u @ self.M - y).norm()) > 1e-6 * (float(y.norm()) + 1e-12):
            return float("inf")
        return float(u.norm() / (self.c * math.sqrt(self.d_model)))

    def query(self, z: torch.Tensor) -> torch.Tensor:
        """``(d_head,)`` the query of ball coordinate ``z``."""
        return (z @ self.S + self.offset) @ self.R

    def residual(self, z: torch.Tensor) -> torch.Tensor:
        """``(d_model,)`` a residual that produces :meth:`query` ``(z)`` through the real norm."""
        u = (z @ self.S) @ self.pinv  # smallest u, ||u|| <= c sqrt(d)
        alpha = math.sqrt(max(self.c**2 * self.d_model - float(u @ u), 0.0))
        w = (u + alpha * self.null) / self.c  # ||w|| = sqrt(d), sum w = 0 for LayerNorm
        return self.kappa * w + self.mean


# --------------------------------------------------------------------------------------------- the results
def _kl(p: torch.Tensor, q: torch.Tensor) -> float | None:
    """KL(p || q) in nats; None when infinite (p puts mass where q has none)."""
    support = p > 0
    if bool((q[support] <= 0).any()):
        return None
    return float((p[support] * (p[support].log() - q[support].log())).sum())


def _finite(x):
    return None if x is None or not math.isfinite(x) else x


@dataclass
class LevelResult:
    """The best alternative found at one constraint level.

    Attributes:
        level: "a", "b", "c-query" or "c-residual".
        ran: False when the level does not apply (reason in ``reason``).
        feasible: the reported ``A'`` reproduces the output within the tolerance.
        alternative: feasible and it moves at least ``min_moved`` mass off the
            set (half the set's mass when the set holds less than ``2 min_moved``).
        output_error: ``||o' - o|| / ||o||`` of the reported ``A'``.
        start_error: the same for this level's own reproduction of A (a: A
            itself; b: delta = 0; c: the real query / residual).
        source_mass: ``A'(S)``; ``moved_mass = A(S) - A'(S)``.
        certified_min_source_mass: a proven lower bound on ``A'(S)`` over every
            pattern of this level within tolerance (a: convex bound; b: what the
            bound B allows even ignoring the output); None where only a local
            search ran.
        pattern: ``(keys,)`` the reported ``A'`` (0 on masked keys).
        delta: ``(keys,)`` level b's perturbation (0 on masked keys).
        query: ``(d_head,)`` level c's post-rotation query.
        residual: ``(d_model,)`` c-residual's residual.
        extra: per level: ``target_set`` (the keys whose mass was minimised;
            the source set unless ``objective="tv"``); a: ``duality_gap``,
            ``newton_steps``; b: ``bound_only_min_set_mass``; c:
            ``query_reachable``, ``reach_ratio`` (below 1: some residual of the
            real residual's scale produces the query), ``query_norm_ratio``;
            c-residual: ``construction_error``, ``residual_rms_ratio``,
            ``residual_cosine_to_real``.

    ``moved_mass``, ``source_mass`` and ``certified_min_source_mass`` always
    refer to the source set S, whatever the objective.
    """

    level: str
    constraint: str
    parameters: dict
    ran: bool = True
    reason: str | None = None
    feasible: bool = False
    alternative: bool = False
    output_error: float = 0.0
    start_error: float = 0.0
    source_mass: float = 0.0
    moved_mass: float = 0.0
    moved_fraction: float = 0.0
    total_variation: float = 0.0
    kl_new_to_real: float | None = 0.0
    kl_real_to_new: float | None = 0.0
    certified_min_source_mass: float | None = None
    search: str = ""
    statement: str = ""
    pattern: torch.Tensor | None = field(default=None, repr=False)
    delta: torch.Tensor | None = field(default=None, repr=False)
    query: torch.Tensor | None = field(default=None, repr=False)
    residual: torch.Tensor | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)

    def to_dict(self, tensors: bool = True) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                if tensors:
                    out[k] = v.tolist()
            elif isinstance(v, float):
                out[k] = _finite(v)
            else:
                out[k] = v
        return out


@dataclass
class NonuniqueResult:
    """Alternative patterns for one head at one query position, side by side.

    Attributes:
        sources: the key indices of the set mass is moved off (S).
        real_source_mass: ``A(S)``.
        null_dimension: ``(allowed keys - 1) - rank(centred values)``: the
            dimension of the patterns that give exactly ``o`` (before the
            simplex); 0 means only A gives it exactly.
        checks: exactness of the inputs: the real output rebuilt from A and the
            values against the captured z; the pattern rebuilt from the scores.
        levels: one :class:`LevelResult` per level (and per score bound).
        summary: what the result says about a routing claim.
        does_not_say: what it does not.
    """

    block: int | None
    block_name: str | None
    head: int | None
    position: int | None
    space: str
    objective: str
    tol: float
    min_moved: float
    sources: list[int]
    real_source_mass: float
    real_entropy: float
    real_argmax: int
    n_keys: int
    n_allowed: int
    null_dimension: int
    checks: dict
    levels: list[LevelResult]
    summary: str
    does_not_say: str
    cancelled: bool = False
    audit: AuditRecord = field(repr=False, default=None)

    def level(self, name: str) -> LevelResult:
        """The first level result called ``name`` ("a", "b", "c-query", "c-residual")."""
        for lv in self.levels:
            if lv.level == name:
                return lv
        raise KeyError(name)

    def to_dict(self, tensors: bool = True) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("levels", "audit")}
        out["levels"] = [lv.to_dict(tensors) for lv in self.levels]
        out["audit"] = self.audit.to_dict() if self.audit is not None else None
        return out


# ------------------------------------------------------------------------------------------------ level (a)
def _level_a(
    problem: HeadProblem, target: torch.Tensor, tol: float, gap: float = 1e-7, max_newton: int = 400, cancel=None
) -> tuple[torch.Tensor, float, dict]:
    """Least mass on ``target`` over the patterns within ``tol``:

        min c.x   s.t.  x >= 0,  sum x = 1,  ||(x - a) U|| <= 1,   U = V / (tol ||o||)

    over the allowed keys, by a log-barrier interior-point method. Coordinates
    ``x = a + Q2 y + P diag(1/sigma) z`` (``U = P diag(sigma) V^T``; ``Q2`` spans
    the values' null directions) turn the thin ellipsoid into the unit ball
    ``||z|| <= 1``, so the Newton systems stay well scaled however small the
    tolerance. Returns (A', lower bound, info); the lower bound is weak duality
    with the simplex kept as the domain: for ``mu = 1 / (tau (1 - ||z||^2))``
    every feasible x has ``c.x >= L(x^) + min_j dL_j - dL . x^``,
    ``L(x) = c.x + mu (||(x - a) U||^2 - 1)`` (convex), whatever the accuracy of ``x^``."""
    idx = problem.allowed.nonzero().flatten()
    a = problem.pattern[idx]
    n = len(a)
    f64 = a.dtype
    c = target[idx].to(f64)
    info: dict = {"method": "interior point (log barrier, Newton)"}
    if bool(c.all()) or not bool(c.any()):  # nothing can move off (or onto) the set
        return problem.pattern.clone(), float(c @ a), {**info, "note": "the set covers every allowed key (or none)"}
    U = problem.values[idx] / (tol * float(problem.output.norm()))
    P, sig, _ = torch.linalg.svd(U, full_matrices=False)
    keep = sig > float(sig.max()) * 1e-12 if len(sig) else sig > 0
    P, sig = P[:, keep], sig[keep]
    k = P.shape[1]
    nz = n - k
    Q2 = torch.linalg.qr(P, mode="complete").Q[:, k:] if k else torch.eye(n, dtype=f64)
    B = torch.cat([Q2, P / sig], 1)  # x = a + B v, v = (y, z)
    e = B.sum(0)  # the equality sum x = 1 reads e . v = 0
    Bc = B.T @ c
    eye_k = torch.eye(k, dtype=f64)
    uniform = torch.full_like(a, 1.0 / n)
    v0 = torch.cat([Q2.T @ (uniform - a), sig * (P.T @ (uniform - a))])
    dev = float(v0[nz:].norm())
    v = v0 * (0.5 * min(1.0, 1.0 / dev) if dev > 0 else 0.5)  # strictly inside: x > 0, ||z|| <= 1/2
    m = n + 1
    tau, newton = 1.0, 0

    def phi(v, tau):
        x = a + B @ v
        z = v[nz:]
        f = 1.0 - float(z @ z)
        if f <= 0 or bool((x <= 0).any()):
            return math.inf
        return tau * float(Bc @ v) - float(x.log().sum()) - math.log(f)

    kkt = torch.zeros(n + 1, n + 1, dtype=f64)
    kkt[:n, n] = e
    kkt[n, :n] = e
    while True:
        for _ in range(80):  # centring: Newton with the equality constraint, backtracking
            x = a + B @ v
            z = v[nz:]
            f = 1.0 - float(z @ z)
            g = tau * Bc - B.T @ (1.0 / x)
            g[nz:] += (2.0 / f) * z
            H = (B.T / (x * x)) @ B
            H[nz:, nz:] += (2.0 / f) * eye_k + (4.0 / (f * f)) * torch.outer(z, z)
            kkt[:n, :n] = H
            dv = torch.linalg.solve(kkt, torch.cat([-g, g.new_zeros(1)]))[:n]
            dec = -float(g @ dv)
            newton += 1
            if dec / 2.0 < 1e-10 or newton > max_newton:
                break
            step, now = 1.0, phi(v, tau)
            while step > 1e-14:
                cand = v + step * dv
                if phi(cand, tau) <= now - 0.25 * step * dec:
                    break
                step *= 0.5
            if step <= 1e-14:
                break
            v = cand
        if m / tau < gap or newton > max_newton or (cancel is not None and cancel()):
            break
        tau *= 10.0
    x = a + B @ v
    z = v[nz:]
    s = float(z @ z)
    mu = 1.0 / (tau * max(1.0 - s, 1e-300))
    dL = c + 2.0 * mu * (P @ (sig * z))  # gradient of L: (x - a) U U^T = P sigma z
    bound = float(c @ x) + mu * (s - 1.0) + float(dL.min()) - float(dL @ x)
    best = torch.zeros_like(problem.pattern)
    best[idx] = x
    info.update({"newton_steps": newton, "duality_gap": float(c @ x) - bound, "null_directions": nz})
    return best, max(bound, 0.0), info


# ------------------------------------------------------------------------------------------- levels (b), (c)
@dataclass
class _Param:
    """Logits over the allowed keys as a function of a parameter ``theta``.

    ``logits(theta) -> (n_allowed,)``; ``vjp(theta, g) -> d(g . logits)/d theta``;
    ``project(theta) -> theta`` keeps theta in its set (None: unconstrained)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    vjp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    project: Callable[[torch.Tensor], torch.Tensor] | None = None


def _query_param(problem: HeadProblem, idx: torch.Tensor, base: torch.Tensor, J: torch.Tensor, project=None):
    """``q = base + theta @ J``; logits ``transform(scale * K q)`` over the allowed keys."""
    K = problem.keys[idx]
    scale = problem.score_scale
    tf = problem.transform

    def logits(th):
        raw = (K @ (base + th @ J)) * scale
        return raw if tf is None else tf(raw)

    def vjp(th, g):
        if tf is not None:  # the model's score transform (soft-capping), elementwise
            raw = ((K @ (base + th @ J)) * scale).requires_grad_(True)
            with torch.enable_grad():
                (g,) = torch.autograd.grad(tf(raw), raw, g)
        return J @ ((g @ K) * scale)

    return _Param(logits, vjp, project)


def _local_search(
    problem: HeadProblem,
    param: _Param,
    inits: list[torch.Tensor],
    target: torch.Tensor,
    tol: float,
    *,
    lr: float,
    stages: Sequence[float] = (1.0, 10.0, 100.0, 1000.0),
    steps: int = 150,
    cancel=None,
) -> torch.Tensor:
    """Least ``A'(target)`` with relative output error <= tol over ``theta``:
    penalty continuation (``A'(T) + mu relu(err/tol - 0.97)^2``, mu growing)
    with Adam and analytic gradients from each start, keeping the best
    feasible point seen (``inits[0]`` must be the level's own reproduction of
    A, which is feasible); an infeasible stage end is pulled back along the
    segment to ``inits[0]``. Returns the best feasible theta."""
    idx = problem.allowed.nonzero().flatten()
    W = problem.values[idx]
    a = problem.pattern[idx]
    no = float(problem.output.norm().clamp_min(1e-300))
    t = target[idx].to(W.dtype)
    limit = tol * (1.0 - 1e-6)  # a hair inside, so the reported pattern is feasible whatever the rounding

    def evaluate(th):
        P = param.logits(th).softmax(-1)
        D = (P - a) @ W
        e = float(D.norm()) / no
        return P, D, e, float(P @ t)

    theta0 = inits[0].clone()
    _, _, e0, m0 = evaluate(theta0)
    best_th, best_m = theta0, (m0 if e0 <= limit else math.inf)
    for init in inits:
        th = init.clone() if param.project is None else param.project(init.clone())
        m1, v1, k = torch.zeros_like(th), torch.zeros_like(th), 0
        for mu in stages:
            for _ in range(steps):
                P, D, e, m = evaluate(th)
                if e <= limit and m < best_m:
                    best_th, best_m = th.clone(), m
                gP = t
                over = e / tol - 0.97
                if over > 0 and e > 0:
                    gP = t + (2.0 * mu * over / (tol * no * no * e)) * (W @ D)
                g = param.vjp(th, P * (gP - P @ gP))
                k += 1
                m1 = 0.9 * m1 + 0.1 * g
                v1 = 0.999 * v1 + 0.001 * g * g
                th = th - lr * (m1 / (1 - 0.9**k)) / ((v1 / (1 - 0.999**k)).sqrt() + 1e-12)
                if param.project is not None:
                    th = param.project(th)
            P, D, e, m = evaluate(th)
            if e <= limit:
                if m < best_m:
                    best_th, best_m = th.clone(), m
            else:  # pull back towards the start until feasible (14 halvings)
                lo, hi = 0.0, 1.0
                for _ in range(14):
                    mid = 0.5 * (lo + hi)
                    cand = theta0 + mid * (th - theta0)
                    _, _, e_, m_ = evaluate(cand)
                    if e_ <= limit:
                        lo = mid
                        if m_ < best_m:
                            best_th, best_m = cand, m_
                    else:
                        hi = mid
            if cancel is not None and cancel():
                return best_th
    return best_th


# ---------------------------------------------------------------------------------------------- the search
def _needed(real: float, min_moved: float) -> float:
    """The mass an alternative must move off the set: ``min_moved``, or half the
    set's mass when the set holds less than ``2 min_moved``."""
    return min(min_moved, 0.5 * real)


def _fill(
    problem: HeadProblem, lv: LevelResult, P: torch.Tensor, target: torch.Tensor, tol: float, min_moved: float
) -> LevelResult:
    src = problem.sources
    real = float(problem.pattern[src].sum())
    lv.pattern = P.detach().clone()
    lv.output_error = problem.relative_error(P)
    lv.feasible = lv.output_error <= tol
    lv.source_mass = float(P[src].sum())
    lv.moved_mass = real - lv.source_mass
    lv.moved_fraction = lv.moved_mass / real if real > 0 else 0.0
    lv.total_variation = 0.5 * float((P - problem.pattern).abs().sum())
    lv.kl_new_to_real = _kl(P, problem.pattern)
    lv.kl_real_to_new = _kl(problem.pattern, P)
    lv.alternative = bool(lv.feasible and real > 0 and lv.moved_mass >= _needed(real, min_moved))
    if not torch.equal(target, src):
        lv.extra["target_set_mass_moved"] = float(problem.pattern[target].sum() - P[target].sum())
    return lv


def _statement(lv: LevelResult, real: float, tol: float, min_moved: float) -> str:
    if not lv.ran:
        return f"not run: {lv.reason}"
    moved = f"{lv.moved_mass:.3f} of the {real:.3f} on the set ({lv.moved_fraction:.0%})"
    err = f"output error {lv.output_error:.2%}, tolerance {tol:.0%}"
    need = f"{_needed(real, min_moved):.3f}"
    if lv.level == "a":
        bound = lv.certified_min_source_mass
        proof = f"proven: every pattern within tolerance keeps at least {bound:.3f} on the set"
        if lv.alternative:
            return (
                f"(a) simplex and mask only: a distribution over the allowed keys moves {moved} and reproduces "
                f"the head's output ({err}); {proof}. The output alone does not pin this routing; this level "
                "says nothing about whether any query could produce that pattern."
            )
        return (
            f"(a) simplex and mask only: no pattern within tolerance moves {need} or more off the set ({proof}, "
            f"of {real:.3f}); at this tolerance the head's output pins the mass on the set."
        )
    if lv.level == "b":
        B = lv.parameters["score_bound"]
        cap = f"even ignoring the output, scores within +/-{B:g} keep at least {lv.certified_min_source_mass:.3f}"
        if lv.alternative:
            return (
                f"(b) scores within +/-{B:g} logits of the real ones: softmax(s + delta) moves {moved} ({err}); "
                f"found by a local search, so at least this much is possible at this level ({cap})."
            )
        return (
            f"(b) scores within +/-{B:g} logits: the local search found no perturbation moving {need} or more "
            f"within tolerance (best: {moved}); not a proof that none exists ({cap})."
        )
    reach = lv.extra.get("query_reachable")
    if lv.level == "c-residual":
        how = "a residual at this position, through the real norm, W_Q, b_Q and rotation,"
    elif reach:
        how = "a free query vector that some residual can produce (reachable),"
    elif reach is False:
        how = "a free query vector that no residual can produce (outside the norm's reach),"
    else:
        how = "a free query vector (reachability not mapped for this family),"
    if lv.alternative:
        return (
            f"(c) {how} with the keys as computed, moves {moved} ({err}); found by a local search, so at "
            "least this much is possible."
        )
    return (
        f"(c) {how} with the keys as computed: the local search found none moving {need} or more within "
        f"tolerance (best: {moved}); not a proof that none exists."
    )


def _summary(levels: list[LevelResult], real: float, tol: float) -> str:
    def alt(name):
        return [lv for lv in levels if lv.level == name and lv.ran and lv.alternative]

    legal = alt("c-residual") + [lv for lv in alt("c-query") if lv.extra.get("query_reachable")]
    lv_a = [lv for lv in levels if lv.level == "a" and lv.ran]
    if legal:
        best = max(legal, key=lambda lv: lv.moved_mass)
        head = (
            "The head's output does not require this routing"
            if best.moved_fraction >= 0.5
            else "The head's output pins this routing only in part"
        )
        floor = (
            f" (and, proven at level a, no pattern within {tol:.0%} keeps less than "
            f"{lv_a[0].certified_min_source_mass:.3f} on it)"
            if lv_a
            else ""
        )
        return (
            f"{head}: a query the model could form (keys as computed) gives an output within {tol:.0%} that puts "
            f"{best.moved_mass:.3f} less mass on the set ({best.moved_fraction:.0%} of {real:.3f}){floor}. A "
            "claim resting on what the head writes cannot use the moved share of the mass as evidence that the "
            "set is needed; a claim about where the head routes on this input (the pattern's reality) is untouched."
        )
    if alt("c-query"):
        return (
            "A free query vector gives an equally good output with the mass elsewhere, but no residual could "
            "produce the queries found (outside the norm's reach), and the residual-level search found no legal "
            "one: only non-legal alternatives exist at level (c)."
        )
    if alt("b"):
        return (
            "Bounded score perturbations give an equally good output with less mass on the set, but no legal "
            "query was found that does (local search): the output does not pin the routing; the model's keys "
            "and reachable queries may."
        )
    if alt("a"):
        return (
            "Only level (a) alternatives exist: some distribution over the allowed keys reproduces the output "
            "with less mass on the set, but no bounded-score or legal-query alternative was found (local "
            "search). The output does not pin the pattern mathematically; the model's scores and keys constrain it."
        )
    if lv_a:
        bound = lv_a[0].certified_min_source_mass
        return (
            f"No alternative even at level (a): every pattern reproducing the head's output within {tol:.0%} "
            f"keeps at least {bound:.3f} of the {real:.3f} on the set (proven). Here the output implies the routing."
        )
    return "No alternative found at the levels run (local searches; level (a) was not run)."


DOES_NOT_SAY = (
    "It does not say which pattern the model 'should' use, that the source set causes the output or the "
    "answer, or what later components need: A is still the pattern the model computed on this input, and "
    "whether the routing matters is a question for ablation or patching of the head or the edge."
)


@torch.no_grad()
def solve(
    problem: HeadProblem,
    *,
    tol: float = 0.05,
    score_bounds: float | Sequence[float] = (1.0, 2.0),
    levels: Sequence[str] = ("a", "b", "c-query", "c-residual"),
    objective: str = "mass",
    min_moved: float = 0.05,
    seed: int = 0,
    steps: int = 150,
    gap: float = 1e-7,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> NonuniqueResult:
    """Search alternative patterns at each level (see the module docstring).

    Args:
        tol: relative output error an alternative may have.
        score_bounds: level b's bound(s) B on ``|delta|`` in logit units; one row per bound.
        levels: which of "a", "b", "c-query", "c-residual" to run.
        objective: "mass" (least mass on the source set) or "tv" (the largest
            total variation from A: the least mass on each top-k set of A,
            k = 1, 2, 4, 8, and on the source set; the largest TV kept).
        min_moved: the mass an alternative must move off the set to count as
            one (half the set's mass when the set holds less than twice this).
        seed: seeds the extra random start of levels b and c.
        steps: optimiser steps per penalty stage (4 stages per start, 2-3 starts).
        gap: level a's target duality gap (mass units) between the achieved
            ``A'(S)`` and its proven lower bound.
        progress: ``progress(done, total, message)`` after each level.
        cancel: returns True to stop; levels done so far are kept.
    """
    if objective not in ("mass", "tv"):
        raise InterventionError(f"objective must be 'mass' or 'tv', not {objective!r}")
    if not tol > 0:
        raise InterventionError("the tolerance must be positive")
    unknown = [lv for lv in levels if lv not in LEVEL_NAMES]
    if unknown:
        raise InterventionError(f"unknown levels {unknown}; choose from {list(LEVEL_NAMES)}")
    bounds = [float(score_bounds)] if isinstance(score_bounds, (int, float)) else [float(b) for b in score_bounds]
    if any(not b >= 0 for b in bounds):
        raise InterventionError("score bounds must be non-negative")
    p = problem
    if float(p.output.norm()) == 0:
        raise InterventionError("the head's output is zero here: a relative output error is undefined")
    allowed = p.allowed
    idx = allowed.nonzero().flatten()
    n_allowed = len(idx)
    real = float(p.pattern[p.sources].sum())
    if objective == "tv":
        order = p.pattern.masked_fill(~allowed, -1.0).argsort(descending=True)
        targets = []
        for k in (1, 2, 4, 8):
            if k < n_allowed:
                m = torch.zeros_like(allowed)
                m[order[:k]] = True
                targets.append(m)
        if not any(torch.equal(t, p.sources) for t in targets):
            targets.append(p.sources.clone())
    else:
        targets = [p.sources]
    plan = []
    for name in LEVEL_NAMES:  # c-query runs before c-residual: its query (pulled into reach) seeds the legal search
        if name in levels:
            plan += [("b", b) for b in bounds] if name == "b" else [(name, None)]
    results: dict[tuple, LevelResult] = {}
    free_queries: dict[int, torch.Tensor] = {}
    cancelled = False
    f64 = torch.float64
    for done, (name, B) in enumerate(plan):
        if cancel is not None and cancel():
            cancelled = True
            break
        runs = []
        for ti, target in enumerate(targets):
            gen = torch.Generator().manual_seed(int(seed))  # the same starts for every target set
            lv = LevelResult(name, LEVEL_NAMES[name], {"score_bound": B} if name == "b" else {})
            lv.extra["target_set"] = target.nonzero().flatten().tolist()
            is_src = torch.equal(target, p.sources)
            if name == "a":
                lv.search = "convex: interior point, with a weak-duality lower bound"
                lv.start_error = p.relative_error(p.pattern)
                P, cert, info = _level_a(p, target, tol, gap, cancel=cancel)
                lv.certified_min_source_mass = cert if is_src else None
                lv.extra.update(info)
            elif name == "b":
                lv.search = (
                    "local (non-convex): penalty continuation from delta = 0, the bound's corner, a seeded start"
                )
                s_a = p.scores[idx]
                lv.start_error = p.relative_error(p.softmax(p.scores))
                param = _Param(
                    lambda th, s_a=s_a, B=B: s_a + B * torch.tanh(th),
                    lambda th, g, B=B: g * B * (1.0 - torch.tanh(th) ** 2),
                )
                corner = torch.where(target[idx], -1.0, 1.0).to(f64)
                capped = torch.zeros_like(p.pattern)
                capped[idx] = (s_a + B * corner).softmax(-1)
                if is_src:
                    lv.certified_min_source_mass = float(capped[p.sources].sum())
                lv.extra["bound_only_min_set_mass"] = float(capped[target].sum())
                inits = [torch.zeros_like(s_a), 3.0 * corner, torch.randn(len(idx), generator=gen, dtype=f64)]
                th = _local_search(p, param, inits, target, tol, lr=0.05, steps=steps, cancel=cancel)
                P = torch.zeros_like(p.pattern)
                P[idx] = param.logits(th).softmax(-1)
                lv.delta = torch.zeros_like(p.pattern)
                lv.delta[idx] = B * torch.tanh(th)
            elif name == "c-residual":
                lv.search = "local (non-convex): penalty continuation over the reachable queries, from the real one"
                qm = p.query_map
                if qm is None or p.query_of_residual is None:
                    lv.ran = False
                    lv.reason = "the residual-to-query path is not mapped for this family (see notes)"
                    runs.append(lv)
                    continue
                lv.start_error = p.relative_error(p.softmax(p.scores_of_query(p.query_of_residual(p.residual))))
                z0 = qm.z_of_query(p.query)
                if float(z0.norm()) > 0.9999:
                    z0 = z0 * (0.9999 / float(z0.norm()))

                def project(th, z0=z0):
                    z = z0 + th
                    nz = float(z.norm())
                    return th if nz <= 0.9999 else z * (0.9999 / nz) - z0

                param = _query_param(p, idx, qm.query(z0), qm.S @ qm.R, project)
                rand = torch.randn(len(z0), generator=gen, dtype=f64)
                inits = [torch.zeros_like(z0), 0.5 * rand / rand.norm() - 0.5 * z0]
                if ti in free_queries:  # the free search's query, pulled into reach
                    inits.append(project(qm.z_of_query(free_queries[ti]) - z0))
                th = _local_search(p, param, inits, target, tol, lr=0.02, steps=steps, cancel=cancel)
                z = z0 + th
                lv.residual = qm.residual(z)
                lv.query = p.query_of_residual(lv.residual)  # through the real norm, W_Q, b_Q, rotation
                lv.extra["construction_error"] = float((lv.query - qm.query(z)).norm() / lv.query.norm())
                lv.extra["reach_ratio"] = float(z.norm())
                lv.extra["query_reachable"] = True
                lv.extra["residual_rms_ratio"] = float(
                    lv.residual.pow(2).mean().sqrt() / p.residual.pow(2).mean().sqrt()
                )
                lv.extra["residual_cosine_to_real"] = float(
                    torch.nn.functional.cosine_similarity(lv.residual, p.residual, dim=0)
                )
                P = p.softmax(p.scores_of_query(lv.query))
                if p.relative_error(P) > tol:  # rounding in the real path: step back towards the real residual
                    for lam in (0.999, 0.99, 0.95, 0.9, 0.75, 0.5, 0.25, 0.0):
                        r = qm.residual(z0 + lam * th) if lam > 0 else p.residual
                        P = p.softmax(p.scores_of_query(p.query_of_residual(r)))
                        if p.relative_error(P) <= tol:
                            lv.residual, lv.query = r, p.query_of_residual(r)
                            break
            else:  # c-query
                lv.search = "local (non-convex): penalty continuation over free queries, from the real one"
                lv.start_error = p.relative_error(p.softmax(p.scores_of_query(p.query)))
                K = p.keys[idx]
                k_norm = float(K.norm(dim=-1).mean()) if n_allowed else 1.0
                c = 1.0 / max(k_norm * abs(p.score_scale), 1e-12)
                d = p.query.shape[0]
                param = _query_param(p, idx, p.query, c * torch.eye(d, dtype=f64))
                inits = [torch.zeros(d, dtype=f64), torch.randn(d, generator=gen, dtype=f64) / math.sqrt(d)]
                th = _local_search(p, param, inits, target, tol, lr=0.05, steps=steps, cancel=cancel)
                lv.query = p.query + c * th
                free_queries[ti] = lv.query
                P = p.softmax(p.scores_of_query(lv.query))
                if p.query_map is not None:
                    ratio = p.query_map.reach_ratio(lv.query)
                    lv.extra["reach_ratio"] = _finite(ratio)
                    lv.extra["query_reachable"] = bool(ratio < 1.0)
                else:
                    lv.extra["query_reachable"] = None
            if lv.query is not None:
                lv.extra["query_norm_ratio"] = float(lv.query.norm() / p.query.norm().clamp_min(1e-300))
            runs.append(_fill(p, lv, P, target, tol, min_moved))
        ran = [r for r in runs if r.ran]
        if objective == "tv" and ran:
            lv = max((r for r in ran if r.feasible), key=lambda r: r.total_variation, default=ran[0])
            on_src = runs[[torch.equal(t, p.sources) for t in targets].index(True)]
            lv.certified_min_source_mass = on_src.certified_min_source_mass  # proven for every pattern
        else:
            lv = runs[0]
        lv.statement = _statement(lv, real, tol, min_moved)
        results[(name, B)] = lv
        if progress is not None:
            progress(done + 1, len(plan), f"level {name}" + (f" (B={B:g})" if B is not None else ""))
    plan_out = [item for item in plan if item in results]
    plan_out.sort(key=lambda item: (list(levels).index(item[0]), bounds.index(item[1]) if item[0] == "b" else 0))
    out = [results[item] for item in plan_out]
    V = p.values[idx]
    rank = int(torch.linalg.matrix_rank(V - V.mean(0, keepdim=True), rtol=1e-10)) if n_allowed > 1 else 0
    A_allowed = p.pattern[idx]
    pos_a = A_allowed[A_allowed > 0]
    audit = AuditRecord.for_method(
        "non-unique attention",
        controls=[
            "simplex and the model's mask (level a)",
            f"scores bounded by +/-{', '.join(f'{b:g}' for b in bounds)} logits around the real ones (level b)",
            "legal query: keys as computed; free query with a reachability check, and queries reachable from a "
            "residual through the real norm, W_Q, b_Q and rotation (level c)",
            f"output error in the {'head-write (W_O z)' if p.space == 'write' else p.space} space, relative to the "
            "head's full output (b_V included)",
        ],
        parameters={
            "block": p.block,
            "head": p.head,
            "position": p.position,
            "sources": p.sources.nonzero().flatten().tolist(),
            "tol": tol,
            "score_bounds": bounds,
            "objective": objective,
            "min_moved": min_moved,
            "seed": seed,
            "levels": list(levels),
        },
        notes=[
            "level a is convex (its bound is proven); levels b and c are local searches: an alternative found "
            "is real, a missing one is not proof that none exists",
            "A is still the pattern the model computed; an equally good alternative says the output does not pin "
            "the routing, not that the routing is unused",
        ]
        + list(p.notes),
    )
    return NonuniqueResult(
        p.block,
        p.block_name,
        p.head,
        p.position,
        p.space,
        objective,
        tol,
        min_moved,
        p.sources.nonzero().flatten().tolist(),
        real,
        float(-(pos_a * pos_a.log()).sum()),
        int(idx[A_allowed.argmax()]) if n_allowed else -1,
        int(p.pattern.shape[0]),
        n_allowed,
        max(n_allowed - 1 - rank, 0),
        dict(p.checks),
        out,
        _summary(out, real, tol),
        DOES_NOT_SAY,
        cancelled,
        audit,
    )


def nonunique_attention(
    adapter,
    trace,
    block: int,
    head: int,
    position: int | None = None,
    sources: Sequence[int] | None = None,
    *,
    space: str = "write",
    batch: int = 0,
    **kwargs,
) -> NonuniqueResult:
    """:func:`head_problem` then :func:`solve` (keyword arguments go to :func:`solve`).

    Example::

        tr = capture(loaded, image, question)               # every block, the answer position
        keys = visual_token_keys(tr, block, region_tokens(tokens, mask))
        res = nonunique_attention(loaded.adapter, tr, block, head, sources=keys)
        for lv in res.levels: print(lv.level, lv.feasible, lv.moved_mass, lv.statement)
    """
    problem = head_problem(adapter, trace, block, head, position, sources, space=space, batch=batch)
    return solve(problem, **kwargs)


def with_values(problem: HeadProblem, values: torch.Tensor) -> HeadProblem:
    """The same problem with other values ``(keys, d)`` (constructed cases: what
    if two sources carried the same value?)."""
    return replace(problem, values=values.double())
