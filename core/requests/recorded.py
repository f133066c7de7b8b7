"""What a stored run says it was asked, typed: the one reader of a recorded
run's parameters (the inverse of the requests' ``parameters()``).

A session stores each run's parameters as JSON: the request's
:meth:`~core.requests.base.Request.parameters` merged with the result's own
(:meth:`core.session.Session.record`). Whoever restores a run (the app's
History) reads them here, as attributes, never by key. A run of an older
session, of another command or of a script records less, and a file from
elsewhere may hold a value of another type: either reads as not recorded
(None, or an empty tuple), so the reader falls back on the typed result or says
what it could not set again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.answer_text import AnswerText
from core.requests.base import TYPED_FOIL, TYPED_TARGET


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _whole(value: Any) -> int | None:
    """An integer (a float holding one too, as JSON may write it); not a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _texts(value: Any) -> tuple[str, ...] | None:
    """A list of texts (None unless every item is one)."""
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _answer_text(parameters: Mapping) -> AnswerText | None:
    """The answer token read out, as :meth:`AnswerText.from_dict` reads it (None: the first token
    after the bare prompt, or fields it cannot read)."""
    try:
        return AnswerText.from_dict(dict(parameters))
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class RecordedParameters:
    """A run's recorded parameters as the requests wrote them (each None, or empty, where the run
    records nothing of the kind).

    Attributes:
        question: the question asked (every request about an image).
        typed_target, typed_foil: the Target and foil fields as typed
            (:meth:`core.requests.base.AskedRequest.asked_parameters`).
        answer_text: the answer token read out (None: the first token after the bare prompt).
        paste_from: a paste fill's source file (:meth:`core.requests.FillRequest.fill_parameters`).
        max_new_tokens: a generation's token budget, when one was asked.
        component, selected_in: the component ablated (or a head method's head) and the app's view
            it was selected in (``attention``, ``dla``, ``lens``).
        positions: an ablation's positions (``target``, ``all``, ``region``).
        source_image: the file a resample ablation or a patch took its source image from.
        reference_images: a mean ablation's reference images.
        token_sets: the names of the token sets a visual patch patched (the result's parameters).
        claim, typed_subjects, dataset, n, painted_region: a validation's claim, its subjects as
            typed, its data's file (None: the generated scenes), its search set's size, and whether
            a painted region was the lines' target (:meth:`core.requests.ValidateRequest.parameters`).
    """

    question: str | None = None
    typed_target: str | None = None
    typed_foil: str | None = None
    answer_text: AnswerText | None = None
    paste_from: str | None = None
    max_new_tokens: int | None = None
    component: str | None = None
    selected_in: str | None = None
    positions: str | None = None
    source_image: str | None = None
    reference_images: tuple[str, ...] = ()
    token_sets: tuple[str, ...] = ()
    claim: str | None = None
    typed_subjects: str | None = None
    dataset: str | None = None
    n: int | None = None
    painted_region: bool = False

    @classmethod
    def from_parameters(cls, parameters: Mapping | None) -> RecordedParameters:
        """Read ``parameters`` (a stored run's, :attr:`core.session.Run.parameters`; None: none)."""
        p = parameters if isinstance(parameters, Mapping) else {}
        token_sets = p.get("token_sets")
        return cls(
            question=_text(p.get("question")),
            typed_target=_text(p.get(TYPED_TARGET)),
            typed_foil=_text(p.get(TYPED_FOIL)),
            answer_text=_answer_text(p),
            paste_from=_text(p.get("paste_from")),
            max_new_tokens=_whole(p.get("max_new_tokens")),
            component=_text(p.get("component")),
            selected_in=_text(p.get("selected_in")),
            positions=_text(p.get("positions")),
            source_image=_text(p.get("source_image")),
            reference_images=_texts(p.get("reference_images")) or (),
            token_sets=tuple(str(name) for name in token_sets) if isinstance(token_sets, Mapping) else (),
            claim=_text(p.get("claim")),
            typed_subjects=_text(p.get("typed_subjects")),
            dataset=_text(p.get("dataset")),
            n=_whole(p.get("n")),
            painted_region=p.get("painted_region") is True,
        )

    @property
    def typed_fields(self) -> tuple[str, str] | None:
        """``(target, foil)`` as typed, when the run records both (None: an older run)."""
        if self.typed_target is None or self.typed_foil is None:
            return None
        return self.typed_target, self.typed_foil
