"""Answering: the model's next-token distribution at the answer position."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from core.errors import oom_guard


@dataclass
class Answer:
    """The greedy answer token, its probability and the top alternatives.

    ``top`` is ``[(token, prob), ...]`` sorted by probability, answer first.
    """

    answer: str
    answer_id: int
    prob: float
    top: list[tuple[str, float]]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["top"] = [[t, p] for t, p in self.top]
        return d


def _to_answers(adapter, logits: torch.Tensor, top_k: int) -> list[Answer]:
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    out = []
    for v, ix in zip(values.tolist(), indices.tolist()):
        top = [(adapter.token_str(i), float(p)) for i, p in zip(ix, v)]
        out.append(Answer(top[0][0], int(ix[0]), float(v[0]), top))
    return out


@torch.no_grad()
def answer_batch(
    loaded,
    images: Sequence,
    questions: Sequence[str],
    *,
    top_k: int = 5,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> list[Answer]:
    """Answer each (image, question) pair, ``batch_size`` at a time.

    Args:
        images: paths, bytes, PIL images or uint8 arrays.
        progress: called with (done, total) after each batch.
        cancel: polled between batches; returning True stops early with
            the answers so far.
    """
    adapter = loaded.adapter
    out: list[Answer] = []
    total = len(questions)
    for start in range(0, total, batch_size):
        if cancel is not None and cancel():
            break
        imgs = list(images[start : start + batch_size])
        with oom_guard(f"answering a batch of {len(imgs)}"):
            inputs = adapter.prepare(imgs, list(questions[start : start + batch_size]))
            out += _to_answers(adapter, adapter.next_token_logits(inputs), top_k)
        if progress is not None:
            progress(len(out), total)
    return out


def answer(loaded, image, question: str, *, top_k: int = 5) -> Answer:
    """Answer one question about one image."""
    return answer_batch(loaded, [image], [question], top_k=top_k)[0]
