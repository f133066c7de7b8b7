"""The summary statistics the steps share: n, mean, standard error and a
normal 95% interval of the finite values, Pearson / Spearman correlations,
and the exact tail of a hit count against per-sample chances."""

from __future__ import annotations

import math

import numpy as np

from core.methods.stats import pearson, spearman


def _stats(x) -> dict:
    """n, mean, standard error and a normal 95% interval of the finite values."""
    v = np.asarray(x, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    n = int(v.size)
    if n == 0:
        return {"n": 0, "mean": None, "se": None, "ci95": [None, None]}
    mean = float(v.mean())
    se = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "se": se, "ci95": [mean - 1.96 * se, mean + 1.96 * se]}


def _lower(st: dict) -> float:
    lo = st["ci95"][0]
    return float("nan") if lo is None else float(lo)


def _nan_if_none(r: float | None) -> float:
    return float("nan") if r is None else r


def _pearson(a, b) -> float:
    """:func:`core.methods.stats.pearson`, NaN where undefined (the steps compare it with thresholds)."""
    return _nan_if_none(pearson(np.ravel(a), np.ravel(b)))


def _spearman(a, b) -> float:
    """:func:`core.methods.stats.spearman` (ties given their mean rank), NaN where undefined."""
    return _nan_if_none(spearman(np.ravel(a), np.ravel(b)))


def fisher_lower(r: float, n: int) -> float:
    """The lower end of r's 95% interval by Fisher's transform, tanh(atanh(r) - 1.96 / sqrt(n - 3));
    NaN where r is undefined or n <= 3."""
    if not np.isfinite(r) or n <= 3:
        return float("nan")
    return float(math.tanh(math.atanh(min(max(r, -0.999999999), 0.999999999)) - 1.96 / math.sqrt(n - 3)))


def poisson_binomial_tail(k: int, p) -> float:
    """P(X >= k) for X a sum of independent Bernoulli(p_i): the exact one-sided
    p-value of k hits where sample i hits by chance with probability p_i (the
    normal approximation is wrong at small n: one hit in one sample at chance
    0.03 is 5.6 standard errors above chance, yet p = 0.03)."""
    p = np.clip(np.asarray(p, dtype=np.float64).ravel(), 0.0, 1.0)
    if k <= 0:
        return 1.0
    if k > p.size:
        return 0.0
    dist = np.zeros(p.size + 1)
    dist[0] = 1.0
    for i, q in enumerate(p):  # dist[j]: P(j hits among the first i samples)
        dist[1 : i + 2] = dist[1 : i + 2] * (1 - q) + dist[: i + 1] * q
        dist[0] *= 1 - q
    return float(min(1.0, dist[k:].sum()))
