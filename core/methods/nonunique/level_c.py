"""Level (c), legal query: the keys fixed as the model computed them, ``A' =
softmax(score_transform(q' . k_j * scale))``. ``c-query`` searches free
post-rotation queries and then checks whether a residual can produce the one
found; ``c-residual`` searches only the reachable queries
(:class:`~core.methods.nonunique.query_map.QueryMap`) and returns a residual
whose query, through the real norm, ``W_Q``, ``b_Q`` and rotation, gives A'."""

from __future__ import annotations

import math

import torch

from core.methods.nonunique.local_search import SearchSettings, local_search, query_param
from core.methods.nonunique.problem import HeadProblem
from core.methods.nonunique.results import LevelResult
from core.results.readout import jsonable

REACH = 0.9999  # how far into the unit ball the reachable search may go (its edge is a residual of zero slack)


def run_c_query(problem: HeadProblem, lv: LevelResult, target: torch.Tensor, settings: SearchSettings) -> torch.Tensor:
    """Fill ``lv`` (search, start error, ``query``, reachability) and return the ``(keys,)`` A' found.

    The query moves as ``q + c theta`` with ``c`` one over the mean key norm
    times the score scale, so a unit step in theta is about one logit."""
    p = problem
    idx = p.allowed.nonzero().flatten()
    lv.search = "local (non-convex): penalty continuation over free queries, from the real one"
    lv.start_error = p.relative_error(p.softmax(p.scores_of_query(p.query)))
    K = p.keys[idx]
    k_norm = float(K.norm(dim=-1).mean()) if len(idx) else 1.0
    c = 1.0 / max(k_norm * abs(p.score_scale), 1e-12)
    d = p.query.shape[0]
    param = query_param(p, idx, p.query, c * torch.eye(d, dtype=torch.float64))
    inits = [
        torch.zeros(d, dtype=torch.float64),
        torch.randn(d, generator=settings.generator, dtype=torch.float64) / math.sqrt(d),
    ]
    th = local_search(p, param, inits, target, settings, lr=0.05)
    lv.query = p.query + c * th
    P = p.softmax(p.scores_of_query(lv.query))
    if p.query_map is not None:
        ratio = p.query_map.reach_ratio(lv.query)
        lv.extra["reach_ratio"] = jsonable(ratio)
        lv.extra["query_reachable"] = bool(ratio < 1.0)
    else:
        lv.extra["query_reachable"] = None
    return P


def run_c_residual(
    problem: HeadProblem,
    lv: LevelResult,
    target: torch.Tensor,
    settings: SearchSettings,
    *,
    free_query: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Fill ``lv`` (search, start error, ``residual``, ``query``, construction
    checks) and return the ``(keys,)`` A' found; None (and ``lv.ran = False``)
    where the residual-to-query path is not mapped.

    Args:
        free_query: c-query's query for the same target set, pulled into reach
            as one more start.
    """
    p = problem
    idx = p.allowed.nonzero().flatten()
    lv.search = "local (non-convex): penalty continuation over the reachable queries, from the real one"
    qm = p.query_map
    if qm is None or p.query_of_residual is None:
        lv.ran = False
        lv.reason = "the residual-to-query path is not mapped for this family (see notes)"
        return None
    lv.start_error = p.relative_error(p.softmax(p.scores_of_query(p.query_of_residual(p.residual))))
    z0 = qm.z_of_query(p.query)
    if float(z0.norm()) > REACH:
        z0 = z0 * (REACH / float(z0.norm()))

    def project(th):
        z = z0 + th
        nz = float(z.norm())
        return th if nz <= REACH else z * (REACH / nz) - z0

    param = query_param(p, idx, qm.query(z0), qm.S @ qm.R, project)
    rand = torch.randn(len(z0), generator=settings.generator, dtype=torch.float64)
    inits = [torch.zeros_like(z0), 0.5 * rand / rand.norm() - 0.5 * z0]
    if free_query is not None:
        inits.append(project(qm.z_of_query(free_query) - z0))
    th = local_search(p, param, inits, target, settings, lr=0.02)
    z = z0 + th
    lv.residual = qm.residual(z)
    lv.query = p.query_of_residual(lv.residual)  # through the real norm, W_Q, b_Q, rotation
    lv.extra["construction_error"] = float((lv.query - qm.query(z)).norm() / lv.query.norm())
    lv.extra["reach_ratio"] = float(z.norm())
    lv.extra["query_reachable"] = True
    lv.extra["residual_rms_ratio"] = float(lv.residual.pow(2).mean().sqrt() / p.residual.pow(2).mean().sqrt())
    lv.extra["residual_cosine_to_real"] = float(torch.nn.functional.cosine_similarity(lv.residual, p.residual, dim=0))
    P = p.softmax(p.scores_of_query(lv.query))
    if p.relative_error(P) > settings.tol:  # rounding in the real path: step back towards the real residual
        for lam in (0.999, 0.99, 0.95, 0.9, 0.75, 0.5, 0.25, 0.0):
            r = qm.residual(z0 + lam * th) if lam > 0 else p.residual
            P = p.softmax(p.scores_of_query(p.query_of_residual(r)))
            if p.relative_error(P) <= settings.tol:
                lv.residual, lv.query = r, p.query_of_residual(r)
                break
    return P
