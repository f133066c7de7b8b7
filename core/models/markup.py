"""The text a question may hold: valid text, one question per image, and the
markup (special and control token strings) of a model that a question may not
hold (:class:`PromptMarkup`, derived per model by the adapter)."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import QuestionError

# The question every adapter renders once when it is built: the prompt must
# render, hold it verbatim and hold one image placeholder (where the processor
# has one), so a broken template fails at load time, not on every question.
PROBE_QUESTION = "what is in the image?"


def check_text(text, what: str = "question") -> str:
    """``text`` if it is a ``str`` that UTF-8 can encode; QuestionError otherwise
    (tokenizers raise a TypeError on lone surrogates such as ``"\\udcff"``)."""
    if not isinstance(text, str):
        raise QuestionError(f"the {what} is not valid text (got {type(text).__name__}, expected a string)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QuestionError(
            f"the {what} is not valid text (character {e.start} is {text[e.start]!r}, "
            "a lone surrogate that UTF-8 cannot encode)"
        ) from None
    return text


def check_pairs(images, questions) -> None:
    """QuestionError unless there is one image per question (``questions`` a
    sequence of questions, not one string)."""
    if isinstance(questions, str):
        raise QuestionError("expected a list of questions, got one string")
    if len(images) != len(questions):
        raise QuestionError(f"{len(images)} images for {len(questions)} questions (one image per question)")


def is_markup(token: str) -> bool:
    """Whether a special token's string can only be markup: it holds a letter
    or digit AND a symbol (``</s>``, ``[SEP]``, ``<|im_end|>``). A special
    token that is a plain word (an unk or pad token spelled ``unk``) or a lone
    symbol (CLIP's pad ``!``) is ordinary text too, and must not refuse
    ordinary questions."""
    return (
        isinstance(token, str)
        and any(c.isalnum() for c in token)
        and any(not c.isalnum() and not c.isspace() for c in token)
    )


def first_named(text: str, tokens: list[str]) -> str:
    """The token of ``tokens`` that occurs first in ``text`` (the longest at a
    tie); tokens found only in the encoding (not as substrings) come last."""

    def key(token: str) -> tuple[int, int]:
        at = text.find(token)
        return (at if at >= 0 else len(text), -len(token))

    return min(tokens, key=key)


@dataclass(frozen=True)
class PromptMarkup:
    """The strings of one model that a question may not hold.

    Attributes:
        placeholders: ``{string: kind}`` the processor expands into visual
            tokens ("image", "video"): refused even in raw prompts (one image
            per question; the processor or the model would fail on a second).
        special: every other special / control token string (sorted).
        ids: ``{token id: string}`` of all of them, for text the tokenizer
            normalises into a special token (matched on the encoded ids).
    """

    placeholders: dict[str, str]
    special: tuple[str, ...]
    ids: dict[int, str]
