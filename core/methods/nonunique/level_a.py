"""Level (a), simplex and mask: the least mass on a key set over every pattern
within tolerance, a convex problem solved by an interior-point method, with a
proven (weak-duality) lower bound."""

from __future__ import annotations

import math

import torch

from core.methods.nonunique.problem import HeadProblem
from core.methods.nonunique.results import LevelResult


def run_level_a(
    problem: HeadProblem, lv: LevelResult, target: torch.Tensor, *, tol: float, gap: float, cancel=None
) -> torch.Tensor:
    """Fill ``lv`` (search, start error, certificate, solver info) and return the ``(keys,)`` A' found."""
    lv.search = "convex: interior point, with a weak-duality lower bound"
    lv.start_error = problem.relative_error(problem.pattern)
    P, cert, info = min_set_mass(problem, target, tol, gap, cancel=cancel)
    lv.certified_min_source_mass = cert if torch.equal(target, problem.sources) else None
    lv.extra.update(info)
    return P


def min_set_mass(
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
