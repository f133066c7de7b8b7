"""Level (b), bounded scores: ``A' = softmax(s + delta)`` over the allowed keys,
``||delta||_inf <= B`` around the model's real pre-softmax scores ``s``; a
local search, with what the bound alone allows as the proven cap."""

from __future__ import annotations

import torch

from core.methods.nonunique.local_search import Param, SearchSettings, local_search
from core.methods.nonunique.problem import HeadProblem
from core.methods.nonunique.results import LevelResult


def run_level_b(
    problem: HeadProblem, lv: LevelResult, target: torch.Tensor, settings: SearchSettings, *, bound: float
) -> torch.Tensor:
    """Fill ``lv`` (search, start error, the bound's cap, ``delta``) and return the ``(keys,)`` A' found.

    ``delta = B tanh(theta)`` keeps the bound; the starts are delta = 0, the
    bound's corner (``-B`` on the set, ``+B`` elsewhere) and one seeded start."""
    p, B = problem, bound
    idx = p.allowed.nonzero().flatten()
    lv.search = "local (non-convex): penalty continuation from delta = 0, the bound's corner, a seeded start"
    s_a = p.scores[idx]
    lv.start_error = p.relative_error(p.softmax(p.scores))
    param = Param(
        lambda th: s_a + B * torch.tanh(th),
        lambda th, g: g * B * (1.0 - torch.tanh(th) ** 2),
    )
    corner = torch.where(target[idx], -1.0, 1.0).to(torch.float64)
    capped = torch.zeros_like(p.pattern)
    capped[idx] = (s_a + B * corner).softmax(-1)
    if torch.equal(target, p.sources):
        lv.certified_min_source_mass = float(capped[p.sources].sum())
    lv.extra["bound_only_min_set_mass"] = float(capped[target].sum())
    inits = [
        torch.zeros_like(s_a),
        3.0 * corner,
        torch.randn(len(idx), generator=settings.generator, dtype=torch.float64),
    ]
    th = local_search(p, param, inits, target, settings, lr=0.05)
    P = torch.zeros_like(p.pattern)
    P[idx] = param.logits(th).softmax(-1)
    lv.delta = torch.zeros_like(p.pattern)
    lv.delta[idx] = B * torch.tanh(th)
    return P
