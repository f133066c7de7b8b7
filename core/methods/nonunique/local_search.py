"""The local search levels (b) and (c) share: logits over the allowed keys as a
function of a parameter (:class:`Param`), and penalty continuation with Adam
and analytic gradients (:func:`local_search`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from core.methods.nonunique.problem import HeadProblem


@dataclass(frozen=True)
class SearchSettings:
    """What each local search of one level and target set runs with: the
    tolerance, optimiser steps per penalty stage, the seeded generator of the
    extra random start (fresh per level and target set) and the cancel check."""

    tol: float
    steps: int
    generator: torch.Generator
    cancel: Callable[[], bool] | None = None


@dataclass
class Param:
    """Logits over the allowed keys as a function of a parameter ``theta``.

    ``logits(theta) -> (n_allowed,)``; ``vjp(theta, g) -> d(g . logits)/d theta``;
    ``project(theta) -> theta`` keeps theta in its set (None: unconstrained)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    vjp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    project: Callable[[torch.Tensor], torch.Tensor] | None = None


def query_param(problem: HeadProblem, idx: torch.Tensor, base: torch.Tensor, J: torch.Tensor, project=None):
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

    return Param(logits, vjp, project)


def local_search(
    problem: HeadProblem,
    param: Param,
    inits: list[torch.Tensor],
    target: torch.Tensor,
    settings: SearchSettings,
    *,
    lr: float,
    stages: Sequence[float] = (1.0, 10.0, 100.0, 1000.0),
) -> torch.Tensor:
    """Least ``A'(target)`` with relative output error <= ``settings.tol`` over ``theta``:
    penalty continuation (``A'(T) + mu relu(err/tol - 0.97)^2``, mu growing)
    with Adam and analytic gradients from each start, keeping the best
    feasible point seen (``inits[0]`` must be the level's own reproduction of
    A, which is feasible); an infeasible stage end is pulled back along the
    segment to ``inits[0]``; ``settings.steps`` Adam steps per stage. Returns
    the best feasible theta."""
    tol, steps, cancel = settings.tol, settings.steps, settings.cancel
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
