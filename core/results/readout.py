"""The result vocabulary every method speaks (docs/ARCHITECTURE.md, "Results").

- :class:`Target`: the numbers of the answer position in one forward (answer
  and foil tokens, logit, logit difference, probability, the model's own
  prediction). analyze's ``target``, a counterfactual's ``original`` and
  ``edited``, an intervention's ``clean`` and ``edited`` are all Targets.
- :class:`Readout`: what a result says about itself, so that a session can
  store it without guessing from its keys: its run ``kind``, its JSON
  (``to_dict`` / ``from_dict``), a one-line numeric ``summary()``, the
  parameters it was called with and its :class:`core.results.audit.AuditRecord` rows.
- :func:`jsonable`: the one JSON cleaning (numpy and torch values to Python,
  non-finite floats to ``None``, as in every JSON the engine writes).
- :data:`RESULT_TYPES` and :func:`restore_result`: the class of each session
  run kind, and the one conversion of a stored result JSON back into that
  class (``from_dict``); a document that does not fit is one
  :class:`ResultDocumentError` naming the kind. JSON is what a session and the
  CLI store; a restored run is worked on as its class.

Import-light on purpose (no torch or numpy at import): the session and the CLI
parser read this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from core.errors import ReadoutError


def jsonable(x):
    """Strict-JSON-ready copy: numpy / torch values to Python, tuples to lists,
    non-finite floats to ``None``, objects with ``to_dict`` to their dict."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        types = set(map(type, x))
        if types == {float}:  # the common grid row: no Python call per number
            # a finite sum has no inf or nan among its terms (either makes the sum inf or nan)
            return list(x) if math.isfinite(sum(x)) else [v if math.isfinite(v) else None for v in x]
        if types == {int}:
            return list(x)
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "to_dict"):
        return jsonable(x.to_dict())
    if hasattr(x, "tolist"):  # numpy arrays and scalars, torch tensors
        return jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


@dataclass(frozen=True)
class Target:
    """The answer position's numbers in one forward.

    ``logit_diff`` is the answer logit minus the foil logit (``None`` without a
    foil); ``prob`` the answer's softmax probability; ``predicted`` the argmax
    token. ``position`` is the sequence position read out (``None`` where a
    method compares several forwards at their own answer positions).
    """

    answer: str
    answer_id: int
    foil: str | None
    foil_id: int | None
    logit: float
    logit_diff: float | None
    prob: float
    predicted: str
    predicted_id: int
    position: int | None = None

    @classmethod
    def from_logits(cls, adapter, logits, answer_id: int, foil_id: int | None = None, *, position: int | None = None):
        """The Target of one ``(vocab,)`` row of next-token logits, in float64
        arithmetic (so the logit difference and the probability do not carry
        the model dtype's rounding)."""
        z = logits.detach().double().cpu()
        predicted = int(z.argmax())
        return cls(
            answer=adapter.token_str(answer_id),
            answer_id=int(answer_id),
            foil=adapter.token_str(foil_id) if foil_id is not None else None,
            foil_id=int(foil_id) if foil_id is not None else None,
            logit=float(z[answer_id]),
            logit_diff=float(z[answer_id] - z[foil_id]) if foil_id is not None else None,
            prob=float(z.softmax(-1)[answer_id]),
            predicted=adapter.token_str(predicted),
            predicted_id=predicted,
            position=position,
        )

    @property
    def score(self) -> float:
        """What an effect is measured on: the logit difference with a foil, else the answer logit."""
        return self.logit_diff if self.logit_diff is not None else self.logit

    def line(self) -> str:
        """``'blue' p=0.912 (predicted 'blue'), logit diff vs 'red' +3.21``."""
        text = f"{self.answer!r} p={self.prob:.3f} (predicted {self.predicted!r})"
        if self.logit_diff is not None:
            text += f", logit diff vs {self.foil!r} {self.logit_diff:+.3f}"
        return text

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Target:
        return from_dict_fields(cls, d)


@dataclass
class AnswerEffect:
    """One edit's effect on the answer numbers: edited minus original
    (``logit_diff_change`` None without a foil); ``flipped``: the argmax token changed."""

    logit_change: float
    logit_diff_change: float | None
    prob_change: float
    flipped: bool

    @classmethod
    def between(cls, original: Target, edited: Target) -> AnswerEffect:
        """``edited`` minus ``original`` (two forwards read with the same answer and foil)."""
        both = original.logit_diff is not None and edited.logit_diff is not None
        return cls(
            edited.logit - original.logit,
            edited.logit_diff - original.logit_diff if both else None,
            edited.prob - original.prob,
            edited.predicted_id != original.predicted_id,
        )

    @property
    def drop(self) -> float:
        """The decrease of the target score (logit difference with a foil, else the
        answer logit): positive when the edit hurt the answer."""
        return -(self.logit_diff_change if self.logit_diff_change is not None else self.logit_change)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> AnswerEffect:
        return from_dict_fields(cls, d)


def change_line(before: Target | dict, after: Target | dict, flipped: bool) -> str:
    """One edit's effect on the answer: ``'blue' logit diff +3.210 -> +0.500, p 0.912
    -> 0.300; predicted 'blue' -> 'red' (flipped)`` (the answer logit without a foil).
    ``before`` / ``after``: :class:`Target` s, or a stored run's target JSON as the
    session's v2 migration reads it (of which it reads only answer, logit, logit_diff,
    prob and predicted)."""
    before = before.to_dict() if isinstance(before, Target) else before
    after = after.to_dict() if isinstance(after, Target) else after
    score, a, b = "logit diff", before.get("logit_diff"), after.get("logit_diff")
    if a is None or b is None:
        score, a, b = "logit", before["logit"], after["logit"]
    return (
        f"{before['answer']!r} {score} {a:+.3f} -> {b:+.3f}, p {before['prob']:.3f} -> {after['prob']:.3f}; "
        f"predicted {before['predicted']!r} -> {after['predicted']!r}" + (" (flipped)" if flipped else "")
    )


@runtime_checkable
class Readout(Protocol):
    """What every method's result says about itself (see the module docstring).

    ``kind`` is the session's run kind (``analyze``, ``counterfactual``,
    ``sweep``, ``intervention``, ``patching``, ``lens``, ``label``, ``audit``...).
    """

    kind: str

    def to_dict(self) -> dict: ...

    def summary(self) -> str:
        """One line with the result's main numbers."""
        ...

    def parameters(self) -> dict:
        """What the run was called with (question, tokens, fill, sizes...)."""
        ...

    def audit_records(self) -> list:
        """The :class:`core.results.audit.AuditRecord` rows (core.results.audit imports this module, so no import here)."""
        ...


def from_dict_fields(cls, d: dict[str, Any]):
    """``cls(**d)`` keeping only ``cls``'s dataclass fields (a stored JSON may hold more)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


class RecordedResult:
    """A :class:`Readout` said outright, for a result without a class of its own
    (a note, the dataset audit's summary run, a test's hand-made document) or
    for a method's result recorded with a larger document (the CLI's JSON adds
    the model and input header to the method's dict: :meth:`of`).

    ``doc`` is what the session stores as the run's result; ``audits`` are
    :class:`core.results.audit.AuditRecord` s or their dicts.
    """

    __slots__ = ("kind", "doc", "_summary", "_parameters", "_audits")

    def __init__(self, kind: str, doc: Any, summary: str = "", parameters: dict | None = None, audits=()):
        self.kind = kind
        self.doc = doc
        self._summary = str(summary)
        self._parameters = dict(parameters or {})
        self._audits = list(audits or [])

    @classmethod
    def of(cls, readout: Readout, doc: Any = None) -> RecordedResult:
        """``readout``'s own kind, summary, parameters and audit rows, stored as
        ``doc`` (default: its ``to_dict()``)."""
        return cls(
            readout.kind,
            readout.to_dict() if doc is None else doc,
            readout.summary(),
            readout.parameters(),
            readout.audit_records(),
        )

    def to_dict(self) -> Any:
        return self.doc

    def summary(self) -> str:
        return self._summary

    def parameters(self) -> dict:
        return dict(self._parameters)

    def audit_records(self) -> list:
        return list(self._audits)

    def __repr__(self) -> str:
        return f"RecordedResult({self.kind!r}, summary={self._summary!r})"


class ResultDocumentError(ReadoutError):
    """A stored result document that does not restore as its run kind's class
    (:func:`restore_result`): ``the stored <kind> result does not fit <Class>
    (<what is wrong>)``. ``kind`` and ``cause`` (what is wrong) are kept."""

    def __init__(self, kind: str, class_name: str, cause: str):
        self.kind = kind
        self.cause = " ".join(str(cause).split())
        super().__init__(f"the stored {kind} result does not fit {class_name} ({self.cause})")


@dataclass(frozen=True)
class Note:
    """A ``note`` run: what a user or a notebook wrote beside the runs, stored as
    given (``content``, a JSON object; ``text`` its words when it has them)."""

    content: dict
    kind: ClassVar[str] = "note"

    @property
    def text(self) -> str:
        return str(self.content.get("text") or "")

    def to_dict(self) -> dict:
        return dict(self.content)

    @classmethod
    def from_dict(cls, d: dict) -> Note:
        return cls(dict(d))

    def summary(self) -> str:
        return self.text

    def parameters(self) -> dict:
        return {}

    def audit_records(self) -> list:
        return []


# The class of each session run kind (core.session.records.KINDS), as "module:Class" imported on use
# (most pull in torch; this module must not). The "intervention" kind holds two classes: see result_type.
RESULT_TYPES: dict[str, str] = {
    "analyze": "core.analyze:AnalyzeResult",
    "generate": "core.generate:Generation",
    "counterfactual": "core.methods.counterfactual.effect:RegionCounterfactual",
    "sweep": "core.methods.counterfactual.sweep:OcclusionMap",
    "intervention": "core.methods.interventions:InterventionResult",
    "knockout": "core.methods.flow.knockout:KnockoutResult",
    "patch-grid": "core.methods.flow.patch_grid:PatchGrid",
    "attribution-patching": "core.methods.flow.attribution:AttributionPatching",
    "audit": "core.dataset_audit.summaries:AuditSummary",
    "nonunique": "core.methods.nonunique.results:NonuniqueResult",
    "qk-ov": "core.methods.qk_ov:QkOvResult",
    "label": "core.methods.validation.chain:ValidationChain",
    "validate": "core.validate:Validation",
    "lens": "core.methods.tuned_lens.evaluate:LensEvaluation",
    "statistics": "core.methods.patterns:PatternStatistics",
    "note": "core.results.readout:Note",
}
VISUAL_PATCH_TYPE = "core.methods.interventions:VisualPatchResult"


def result_type(kind: str, doc: Any) -> str | None:
    """``"module:Class"`` of a ``kind`` run's result ``doc``; None for a kind without a
    class of its own (a notebook's own kind).

    The one rule for the ``intervention`` kind, which the app and the CLI record for
    both ablations (and activation patching, knockout) and visual-feature patching:
    a document naming a patch ``site`` is a ``VisualPatchResult``; any other an
    ``InterventionResult`` (whose JSON has no ``site``)."""
    if kind == "intervention" and isinstance(doc, dict) and "site" in doc:
        return VISUAL_PATCH_TYPE
    return RESULT_TYPES.get(kind)


def result_class(path: str) -> type:
    """The class ``"module:Class"`` names (its module imported now)."""
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


def restore_result(kind: str, doc: Any) -> Readout:
    """The typed result of a ``kind`` run whose stored JSON is ``doc``: its class's
    ``from_dict(doc)`` (:func:`result_type`); a kind without a class of its own is a
    :class:`RecordedResult` holding ``doc`` as it is. The one place stored result JSON
    turns into the classes the session, export and app work with.

    Raises:
        ResultDocumentError: ``doc`` does not fit the class (not a JSON object, a
            field missing or of another type or version); the message names the kind.
    """
    path = result_type(kind, doc)
    if path is None:
        return RecordedResult(kind, doc)
    cls = result_class(path)
    if not isinstance(doc, dict):
        raise ResultDocumentError(kind, cls.__name__, f"a {type(doc).__name__}, not a JSON object")
    try:
        return cls.from_dict(doc)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ReadoutError) as e:
        raise ResultDocumentError(kind, cls.__name__, f"{type(e).__name__}: {e}") from None
