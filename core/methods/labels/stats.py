"""The summary statistics the steps share: n, mean, standard error and a
normal 95% interval of the finite values, and Pearson / Spearman correlations."""

from __future__ import annotations

import math

import numpy as np

from core.stats import pearson, spearman


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
    """:func:`core.stats.pearson`, NaN where undefined (the steps compare it with thresholds)."""
    return _nan_if_none(pearson(np.ravel(a), np.ravel(b)))


def _spearman(a, b) -> float:
    """:func:`core.stats.spearman` (ties given their mean rank), NaN where undefined."""
    return _nan_if_none(spearman(np.ravel(a), np.ravel(b)))
