"""The qk-ov request: one head's QK and OV circuits, the weight level and, with an
image and a question, the scores it realised at the answer row (``vlm-readout qk-ov``,
the head menu's QK / OV; :func:`core.methods.qk_ov.qk_ov`, docs/METHODS.md §4.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.qk_ov import QkOvResult

# The copying score's token set at most (core.methods.qk_ov.COPYING_VOCAB_LIMIT, not imported:
# it loads torch): its matrix is tokens x tokens, its eigenvalues cubic in them.
MAX_COPY_TOKENS = 2048


def check_copy_words(words: str) -> list[str]:
    """The comma-separated words of ``--copy-tokens``, before the model loads;
    QuestionError (one line starting with ``--copy-tokens``) for text that is
    no word list (:func:`core.answer_text.text_problem`), an empty word, or
    more words than the copying score may run over (its matrix is tokens x
    tokens: :data:`MAX_COPY_TOKENS`)."""
    from core.answer_text import shown_text, text_problem
    from core.errors import QuestionError

    problem = text_problem(words)
    if problem is not None:
        raise QuestionError(f"--copy-tokens {problem}")
    split = [w.strip() for w in words.split(",")]
    if "" in split:
        raise QuestionError(f"--copy-tokens {shown_text(words)}: word {split.index('') + 1} is empty")
    if len(split) > MAX_COPY_TOKENS:
        raise QuestionError(
            f"--copy-tokens: {len(split):,} words; the copying score runs over at most {MAX_COPY_TOKENS}"
        )
    return split


def copy_token_ids(adapter, words: str) -> list[int]:
    """The token ids of comma-separated ``words`` (every sub-token, each once, in
    order); QuestionError (one line starting with ``--copy-tokens``) for a word
    that holds markup (an image placeholder, a special token) or that the
    vocabulary lacks (the unknown token: the score would run over it in the
    word's place), or more than :data:`MAX_COPY_TOKENS` tokens in all."""
    from core.answer_text import shown_text, word_tokens
    from core.errors import QuestionError

    ids: list[int] = []
    for word in check_copy_words(words):
        pieces = [i for i, _ in word_tokens(adapter, word)]
        label = f"--copy-tokens word {shown_text(word)}"
        adapter.check_markup(word, pieces, what=label)
        adapter.check_known_words(word, pieces, what=label)
        ids += [i for i in pieces if i not in ids]
    if len(ids) > MAX_COPY_TOKENS:
        raise QuestionError(
            f"--copy-tokens: the words are {len(ids):,} tokens; the copying score runs over at most {MAX_COPY_TOKENS}"
        )
    return ids


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the image is pixels
class QkOvRequest(AskedRequest):
    """``head``'s circuits: the weight level always; the activation level on ``image`` and
    ``question`` when both are given (neither: the weight level only), at the answer token
    read out. The answer and foil are the input's as typed (recorded; the circuits read no
    target).

    Attributes:
        head: ``BLOCK.H<index>`` (``L1.H0``; CoCa's ``T0.H1``, ``L1.xattn.H2``).
        copy_tokens: comma-separated words whose tokens the copying score runs over (None:
            the whole vocabulary when it has at most :data:`MAX_COPY_TOKENS` tokens).
        top_k: the keys listed with the most attention (activation level).
    """

    name: ClassVar[str] = "qk-ov"

    image: Image.Image | None = None
    question: str | None = None
    head: str
    copy_tokens: str | None = None
    raw_prompt: bool = False
    top_k: int = 5

    def __post_init__(self) -> None:
        from core.errors import QuestionError

        if (self.image is None) != (self.question is None):
            raise QuestionError(
                "the activation level needs both an image and a question (or neither, weight level only)"
            )
        if self.answer_text is not None and self.image is None:
            raise QuestionError("an answer token is read out on an input: give the image and the question")

    def parameters(self) -> dict[str, Any]:
        return {
            **self.asked_parameters(),
            "component": self.head,
            "copy_tokens": self.copy_tokens,
            "raw_prompt": self.raw_prompt,
            "top_k": self.top_k,
        }

    def copy_ids(self, adapter) -> list[int] | None:
        """The head checked (a bad name fails before anything runs) and the copying score's
        token ids (None: the default set); one line for copy tokens of a cross-attention head
        (its values are visual tokens, not token embeddings) or words no token set can hold."""
        from core.errors import QuestionError
        from core.methods.qk_ov import head_of

        block, _, _ = head_of(adapter, self.head)
        if self.copy_tokens is None:
            return None
        if adapter.blocks[block][1] != "self":
            raise QuestionError(
                f"--copy-tokens: {self.head} is a cross-attention head (its values are visual tokens, not token "
                "embeddings): it has no copying score"
            )
        return copy_token_ids(adapter, self.copy_tokens)

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> QkOvResult:
        """:func:`core.methods.qk_ov.qk_ov` (weight algebra and at most one capture: nothing to cancel between)."""
        from core.methods.qk_ov import qk_ov

        copy_ids = self.copy_ids(loaded.adapter)
        if progress is not None:
            progress(0, 0, f"QK / OV of {self.head}…")
        return qk_ov(
            loaded,
            self.head,
            self.image,
            self.question,
            copy_tokens=copy_ids,
            raw_prompt=self.raw_prompt,
            answer_text=self.answer_text,
            top_k=self.top_k,
        )
