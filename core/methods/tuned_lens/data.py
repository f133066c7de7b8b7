"""What the tuned lens trains and evaluates on: the token positions
(:func:`position_mask`), the batches and the pairs corpus (:class:`PairsCorpus`,
:func:`read_pairs`; the synthetic-scene corpus is
:class:`core.zoo.lens_corpus.SyntheticCorpus`) and the frozen forward over a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.files.pairs import MAX_PAIRS, Pair, load_pair_image
from core.files.pairs import read_pairs as read_pair_file
from core.forward.capture import capture
from core.methods.tuned_lens.lens import POSITION_SETS, LensError


def position_mask(adapter, trace, positions: str) -> torch.Tensor:
    """``(batch, pos)`` bool: the tokens of ``positions`` (see :class:`LensConfig`);
    padding is never selected. Cross-attention models have no visual tokens
    in the stream, so "visual" selects nothing there."""
    if positions not in POSITION_SETS:
        raise LensError(f"unknown positions {positions!r}; expected one of {', '.join(POSITION_SETS)}")
    b, p = trace.input_ids.shape
    mask = torch.zeros(b, p, dtype=torch.bool)
    if positions == "answer":
        mask[torch.arange(b), trace.answer_positions.cpu()] = True
        return mask
    for row in range(b):
        roles = adapter.token_roles(trace, row)
        for i, r in enumerate(roles):
            if r == "padding":
                continue
            if positions == "all" or (positions == "visual") == (r == "visual"):
                mask[row, i] = True
    return mask


@dataclass
class Batch:
    """Images, questions and (optional) answers of one step, or of a whole
    evaluation set (:meth:`PairsCorpus.take`: its images a :class:`Made` sequence)."""

    images: Sequence
    questions: Sequence[str]
    answers: Sequence[str | None]


class Made(Sequence):
    """``make(0), ..., make(n - 1)``, each made when it is read: an evaluation
    set's images are decoded (or drawn) one batch at a time, so a corpus of a
    million pairs is never held in memory at once."""

    def __init__(self, n: int, make: Callable[[int], Any]):
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.make(i) for i in range(*index.indices(self.n))]
        if not -self.n <= index < self.n:
            raise IndexError(index)
        return self.make(index % self.n)


class PairsCorpus:
    """A list of ``{"image_path", "question"[, "answer"]}`` pairs (e.g. from
    :func:`read_pairs`), cycled in a seeded order that is reshuffled every
    epoch (deterministic per step, so resume sees the same data)."""

    def __init__(self, pairs: Sequence[dict], *, seed: int = 0, source: str = ""):
        if not pairs:
            raise LensError("the corpus has no pairs")
        self.pairs, self.seed, self.source = list(pairs), seed, source

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(len(self.pairs), generator=g).tolist()

    def batch(self, step: int, batch_size: int) -> Batch:
        n = len(self.pairs)
        out, orders = [], {}
        for k in range(step * batch_size, (step + 1) * batch_size):
            epoch, i = divmod(k, n)
            if epoch not in orders:  # one shuffle per epoch the batch touches, not one per item
                orders[epoch] = self._order(epoch)
            out.append(self.pairs[orders[epoch][i]])
        return Batch([load_pair_image(p) for p in out], [p.question for p in out], [p.answer for p in out])

    def take(self, n: int | None = None) -> Batch:
        """The first ``n`` pairs (all without ``n``), their images decoded as they are read."""
        ps = self.pairs[:n] if n else self.pairs
        return Batch(Made(len(ps), lambda i: load_pair_image(ps[i])), [p.question for p in ps], [p.answer for p in ps])

    def describe(self) -> dict:
        return {"source": self.source or "image-question pairs", "n_pairs": len(self.pairs), "order": "seeded shuffle"}


def read_pairs(path: Path) -> list[Pair]:
    """Pairs from a JSONL file (as ``vlm-readout answer --pairs``: one
    ``{"image", "question"[, "answer"]}`` per line, image paths relative to the
    file) or from a folder (every ``*.jsonl`` in it, sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise LensError(f"{path}: no *.jsonl pairs files in this folder")
    else:
        files = [path]
    pairs = []
    for f in files:
        pairs += read_pair_file(f)
        if len(pairs) > MAX_PAIRS:  # each file is bounded on its own; so is the folder
            raise LensError(f"{path}: over {MAX_PAIRS:,} pairs in its *.jsonl files, the most a corpus may hold")
    return pairs


def _captured(loaded, batch: Batch):
    """One frozen, no-grad forward over the batch (no attention patterns kept): a Trace."""

    adapter = loaded.adapter
    with torch.no_grad():
        inputs = adapter.prepare(batch.images, batch.questions)
        trace = capture(loaded, None, "", inputs=inputs, pattern_layers=[])
    return trace
