"""Greedy decoding through the adapter, for every family.

open_clip's own ``CoCa.generate`` does not run under transformers 5, and a
read-out tool wants the same decoding for every family anyway: append the
argmax token and run again (no cache: answers here are a few tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generation:
    """Greedy continuation: token ids, their strings, each step's probability."""

    token_ids: list[int]
    tokens: list[str]
    probs: list[float]

    @property
    def text(self) -> str:
        return " ".join(self.tokens)


@torch.no_grad()
def greedy_generate(loaded, image, question: str, *, max_new_tokens: int = 8, raw_prompt: bool = False) -> Generation:
    """Greedy decoding of up to ``max_new_tokens`` tokens, stopping at EOS or
    padding (``raw_prompt``: see :func:`core.answer.answer_batch`)."""
    adapter = loaded.adapter
    inputs = adapter.prepare([image], [question], raw_prompt=raw_prompt)
    stop = {
        t
        for t in (getattr(adapter.tokenizer, "eos_token_id", None), getattr(adapter.tokenizer, "pad_token_id", None))
        if t is not None
    }
    ids, toks, probs = [], [], []
    for _ in range(max_new_tokens):
        p = adapter.next_token_logits(inputs)[0].float().softmax(-1)
        tok = int(p.argmax())
        if tok in stop:
            break
        ids.append(tok)
        toks.append(adapter.token_str(tok))
        probs.append(float(p[tok]))
        inputs = adapter.append_token(inputs, tok)
    return Generation(ids, toks, probs)
