"""The audit's dataset: a pairs file (:func:`core.files.pairs.read_pairs`, one
:class:`core.files.pairs.Pair` per line), the target masks, and each visual
token's share inside a mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.files.pairs import Pair, pairs_file, read_pairs

DatasetItem = Pair  # one image-question pair of an audit dataset (the name the audit used before core.files.pairs.Pair)


def dataset_file(path: str | Path) -> Path:
    """The JSONL file of a dataset given as a file or a folder (:func:`core.files.pairs.pairs_file`)."""
    return pairs_file(path, "dataset file")


def read_dataset(path: str | Path, limit: int | None = None) -> list[Pair]:
    """Read a dataset JSONL or folder (see :mod:`core.dataset_audit`); ``limit``:
    the first N samples (later lines are not checked)."""
    return read_pairs(path, limit=limit, what="dataset file")


def token_cover(tokens, mask: np.ndarray) -> np.ndarray:
    """``(n_tokens,)``: the share of each visual token's box (its in-image
    part, pixels as :func:`core.forward.geometry.region_tokens` counts them) that
    ``mask`` covers; 0 for tokens without a patch (newline, CLS)."""
    h, w = mask.shape
    out = np.zeros(len(tokens))
    for i, t in enumerate(tokens):
        if t.col < 0:
            continue
        x0, y0, x1, y1 = t.box
        xa, ya = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
        xb, yb = min(w, int(np.ceil(x1))), min(h, int(np.ceil(y1)))
        if xb > xa and yb > ya:
            out[i] = float(mask[ya:yb, xa:xb].mean())
    return out
