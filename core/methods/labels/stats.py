"""The summary statistics the steps share: n, mean, standard error and a
normal 95% interval of the finite values, and Pearson / Spearman correlations."""

from __future__ import annotations

import math

import numpy as np


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


def _pearson(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _spearman(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size < 3:
        return float("nan")
    return _pearson(a.argsort().argsort(), b.argsort().argsort())
