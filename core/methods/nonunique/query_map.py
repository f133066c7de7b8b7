"""Level (c)'s geometry: the model's query of a residual through the block's
norm, ``W_Q``, ``b_Q`` and the position rotation (:func:`query_path`), and the
queries a residual can produce (:class:`QueryMap`), for one head at one query
position."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def rotation_matrix(adapter, trace, block: int, pos: int, d: int, dtype, batch: int) -> torch.Tensor:
    """``(d_head, d_head)`` R with ``q_rotated = q @ R`` at position ``pos`` (identity without RoPE)."""
    if adapter.position_scheme not in ("rope", "mrope") or trace.kv_source[block] is not None:
        return torch.eye(d, dtype=dtype)
    positions = adapter.rope_positions(trace, batch)
    p = positions[..., pos : pos + 1].to(adapter.device)
    eye = torch.eye(d, dtype=dtype, device=adapter.device).view(1, d, d)  # one position, d "heads": row i is e_i
    return adapter.rotate(eye, p, block)[0]


def query_path(
    adapter,
    trace,
    block: int,
    head: int,
    pos: int,
    query: torch.Tensor,
    residual: torch.Tensor,
    *,
    device: torch.device,
    batch: int,
) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, QueryMap | None, dict, str | None]:
    """The model's query of a residual at ``pos``, and the queries a residual can reach.

    Args:
        query: ``(d_head,)`` the real query (after bias, norms, rotation), float64 on the CPU.
        residual: ``(d_model,)`` the real residual the query reads, float64 on the CPU.
        device: where the model's norm runs.

    Returns:
        ``(query_of_residual, query_map, checks, note)``: ``query_of_residual``
        maps ``(d_model,) -> (d_head,)`` through the model's own norm, ``W_Q``,
        ``b_Q`` and the rotation; both are None where the path is not mapped
        (extra transforms, no norm of its own, or a recomputed query that
        disagrees with the real one), and ``note`` says why (else None).
    """
    cpu = {"device": "cpu", "dtype": torch.float64}
    norm = adapter.attn_norm(block)
    extras = adapter.query_extras(block)
    if extras is not None:
        note = f"{adapter.family}: the query path has extra transforms ({extras}); c-residual not mapped"
        return None, None, {}, note
    if getattr(norm, "kind", None) not in ("rmsnorm", "layernorm"):
        note = "the query reads the stream without a norm of its own (post-norm); c-residual not mapped"
        return None, None, {}, note
    R = rotation_matrix(adapter, trace, block, pos, query.shape[0], torch.float64, batch).to(**cpu)
    W_Q = adapter.W_Q(block)[head].to(**cpu)
    b_Q = adapter.b_Q(block)[head].to(**cpu)

    def query_of_residual(x: torch.Tensor) -> torch.Tensor:
        """``(d_model,) -> (d_head,)`` through the model's own norm (on its device), W_Q, b_Q, R."""
        return (norm(x.to(device)).to(**cpu) @ W_Q + b_Q) @ R

    err = float((query_of_residual(residual) - query).norm() / query.norm().clamp_min(1e-300))
    checks = {"query_from_residual_error": err}
    if err > 1e-4:
        note = f"the query recomputed from the residual differs by {err:.2g} (relative); c-residual not run"
        return None, None, checks, note
    return query_of_residual, QueryMap(norm, W_Q, b_Q, R, residual), checks, None


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
