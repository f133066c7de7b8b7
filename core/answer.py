"""Answering: the model's next-token distribution at the answer position."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from core.errors import QuestionError, oom_guard
from core.models.adapter import check_pairs
from core.shell.lazy import make_module_callable


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
    """One :class:`Answer` per row of ``logits`` ``(batch, vocab)``: the
    softmax's top ``top_k`` tokens, the first being the answer."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    out = []
    for v, ix in zip(values.tolist(), indices.tolist()):
        top = [(adapter.token_str(i), float(p)) for i, p in zip(ix, v)]
        out.append(Answer(top[0][0], int(ix[0]), float(v[0]), top))
    return out


def answer_from_logits(adapter, logits: torch.Tensor, top_k: int = 5) -> Answer:
    """The :class:`Answer` a ``(vocab,)`` row of next-token logits gives (what
    :func:`answer` returns for the forward those logits came from)."""
    return _to_answers(adapter, logits[None], top_k)[0]


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
    raw_prompt: bool = False,
) -> list[Answer]:
    """Answer each (image, question) pair, ``batch_size`` at a time.

    Args:
        images: paths, bytes, PIL images or uint8 arrays, one per question.
        progress: called with (done, total) after each batch.
        cancel: polled between batches; returning True stops early with
            the answers so far.
        raw_prompt: let questions hold the model's special tokens (``</s>``,
            ``<|im_end|>``, ...), which the model then reads as markup; off,
            such a question is refused. Image placeholders are refused either way.

    Raises:
        QuestionError: a question the model cannot be run on (checked before
            any batch runs, so nothing is half done).
    """
    check_pairs(images, questions)
    for name, value in (("top_k", top_k), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QuestionError(f"{name} must be a positive integer, got {value!r}")
    adapter = loaded.adapter
    total = len(questions)
    for i, q in enumerate(questions):  # every question, before the first batch runs
        try:
            adapter.check_question(q, raw_prompt=raw_prompt)
        except QuestionError as e:
            if total == 1:
                raise
            raise QuestionError(f"question {i + 1} of {total}: {e}") from None
    out: list[Answer] = []
    for start in range(0, total, batch_size):
        if cancel is not None and cancel():
            break
        imgs = list(images[start : start + batch_size])
        with oom_guard(f"answering a batch of {len(imgs)}"):
            inputs = adapter.prepare(imgs, list(questions[start : start + batch_size]), raw_prompt=raw_prompt)
            logits = adapter.next_token_logits(inputs)  # checked: finite, the processor agreeing with the model
        out += _to_answers(adapter, logits, top_k)
        if progress is not None:
            progress(len(out), total)
    return out


def answer(loaded, image, question: str, *, top_k: int = 5, raw_prompt: bool = False) -> Answer:
    """Answer one question about one image (``raw_prompt``: see :func:`answer_batch`)."""
    return answer_batch(loaded, [image], [question], top_k=top_k, raw_prompt=raw_prompt)[0]


make_module_callable(__name__, answer)  # core.answer(...) is the function (core/shell/lazy.py)
