"""Correlations the read-outs report (one implementation for every method).

Spearman's coefficient is Pearson's on ranks with ties given their mean rank,
so a tie never orders two equal values by chance. Both return ``None`` where
the coefficient is undefined: fewer than three pairs, or a constant side.
"""

from __future__ import annotations

import numpy as np

MIN_PAIRS = 3


def ranks(x) -> np.ndarray:
    """Ranks ``0 .. n-1`` of ``x`` ``(n,)``, ties given their mean rank."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    out = np.empty(len(a))
    out[order] = np.arange(len(a), dtype=np.float64)
    for v in np.unique(a):
        tie = a == v
        if tie.sum() > 1:
            out[tie] = out[tie].mean()
    return out


def _paired(x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"{what} needs two vectors of one length, got {a.shape} and {b.shape}")
    return a, b


def pearson(x, y) -> float | None:
    """Pearson's correlation of ``x`` and ``y`` ``(n,)`` (float64)."""
    a, b = _paired(x, y, "pearson")
    if len(a) < MIN_PAIRS:
        return None
    a, b = a - a.mean(), b - b.mean()
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / den if den > 0 else None


def spearman(x, y) -> float | None:
    """Spearman's rank correlation of ``x`` and ``y`` ``(n,)``."""
    a, b = _paired(x, y, "spearman")
    if len(a) < MIN_PAIRS:
        return None
    return pearson(ranks(a), ranks(b))
