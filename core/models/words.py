"""Splitting a question into words, as the default models' word-level tokenizer
does (:mod:`core.zoo.vocab` builds that tokenizer with the same pattern and
re-exports these names)."""

from __future__ import annotations

import re

WORD = re.compile(r"\w+|[^\w\s]+")


def unknown_words(tokenizer, question: str) -> list[str]:
    """Words of ``question`` the tokenizer maps to ``<unk>``."""
    vocab = tokenizer.get_vocab()
    return [w for w in WORD.findall(question.lower()) if w not in vocab]
