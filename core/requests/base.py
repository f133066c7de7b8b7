"""What every request shares: a frozen description of one run that is both the
schema the CLI and the app fill in and the executor of the run (in the manner
of tuned-lens's command dataclasses).

A request names its inputs (image, question, the answer and foil as typed, the
answer token read out) and its options; ``run(loaded, progress, cancel)``
computes its :class:`core.results.readout.Readout` on a loaded model, and
``parameters()`` is what it was asked, as JSON. The CLI maps its arguments to a
request, the app's one generic job runs any request (app/jobs.py), so that the
same request gives the same result through either (tests/core/test_requests_parity.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from PIL import Image

    from core.answer_text import AnswerText
    from core.results.readout import Readout

# progress(done, total, message): total 0 = indeterminate; cancel() True = stop between steps
Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None

REQUESTS: dict[str, type[Request]] = {}
# the answer and foil as typed, in the parameters a run records (AskedRequest.asked_parameters)
TYPED_TARGET, TYPED_FOIL = "typed_target", "typed_foil"


def register_request(cls: type[Request]) -> type[Request]:
    """Class decorator: ``cls`` is the request named ``cls.name`` (one per run kind)."""
    if cls.name in REQUESTS:
        raise ValueError(f"two requests are named {cls.name!r}")
    REQUESTS[cls.name] = cls
    return cls


def no_progress(done: int, total: int, message: str) -> None:
    """The progress of a caller that shows none."""


def never_cancelled() -> bool:
    return False


# eq=False here and in every request: a request equals itself only. Pixels and masks have no
# field-wise equality, and a subclass would inherit a base's __eq__ comparing the base's fields alone.
@dataclass(frozen=True, kw_only=True, eq=False)
class Request:
    """One run asked of the engine. ``name``: the request (the CLI command, the app's
    action: ``analyze``, ``ablation``...); ``run`` returns the Readout whose ``kind``
    the session records (ablation and patching are both ``intervention`` runs)."""

    name: ClassVar[str]

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> Readout:
        raise NotImplementedError

    def parameters(self) -> dict[str, Any]:
        """What was asked, as JSON (images by path and SHA-256, tokens as typed)."""
        raise NotImplementedError

    def document(self, result: Readout, loaded) -> Any:
        """The JSON a run of this request is written as (the command's ``--json``) and recorded
        as (the session's run, from the CLI and the app alike): the result's own ``to_dict()``;
        a request whose command has always written more beside it (the counterfactual's model
        and input header, the generation's image) adds it here, once for both drivers."""
        return result.to_dict()

    def recorded(self, result: Readout, loaded) -> Readout:
        """What the session records of ``result``: its kind, summary, parameters and audit rows,
        stored as :meth:`document`."""
        from core.results.readout import RecordedResult

        return RecordedResult.of(result, self.document(result, loaded))

    def recorded_inputs(self) -> dict[str, Any]:
        """What a session stores of the request's input beside its parameters, the same from
        the CLI's ``--session`` and the app: the image (with the file it was read from) and the
        painted region's mask, where the request has them."""
        inputs = {}
        if getattr(self, "image", None) is not None:
            inputs.update(image=self.image, image_path=self.image_path)
        if getattr(self, "mask", None) is not None:
            inputs["mask"] = self.mask
        return inputs


@dataclass(frozen=True, kw_only=True, eq=False)
class AskedRequest(Request):
    """A request about one image and question: the image (pixels; ``image_path`` the file
    they were read from, None for pasted pixels), the question, the answer and foil as
    typed (``""``: the model's top token, no foil; a word of several tokens reads its
    first sub-token: :func:`core.answer_text.typed_token`, the one rule), and the answer
    token read out (``answer_text``; None: the first token after the bare prompt)."""

    image: Image.Image
    question: str
    image_path: str | None = None
    answer: str = ""
    foil: str = ""
    answer_text: AnswerText | None = None

    @property
    def answer_prefix(self) -> tuple[int, ...]:
        """The answer tokens the model is given before the one read out (teacher forcing)."""
        return self.answer_text.prefix_ids if self.answer_text is not None else ()

    def tokens(self, adapter) -> dict[str, int | None]:
        """``answer=`` / ``foil=`` token ids for the engine: the typed fields by
        :func:`core.answer_text.typed_token`; an empty answer reads the answer token read
        out (``answer_text``), else the model's top token (None)."""
        from core.answer_text import typed_token

        answer, foil = typed_token(adapter, self.answer), typed_token(adapter, self.foil)
        default = self.answer_text.token_id if self.answer_text is not None else None
        return {
            "answer": answer.token_id if answer else default,
            "foil": foil.token_id if foil else None,
        }

    def token_ids(self, adapter, base) -> tuple[int, int | None]:
        """``(answer id, foil id)`` read at ``base``'s (a capture of this request's input)
        answer position: :meth:`tokens`, the answer defaulting to the model's top token there
        (:func:`core.methods.counterfactual.resolve_tokens`)."""
        from core.methods.counterfactual import resolve_tokens

        tokens = self.tokens(adapter)
        logits = base.logits[0, int(base.answer_positions[0])]
        return resolve_tokens(adapter, tokens["answer"], tokens["foil"], logits)

    def asked_parameters(self) -> dict[str, Any]:
        """The input's part of :meth:`parameters`, as the app has always recorded it: the
        question, the answer and foil fields as typed (``typed_target``, ``typed_foil``: a
        restore puts the words back; the result names the tokens read as ``answer`` and
        ``foil``, which these must not override), and the answer token read out
        (:meth:`core.answer_text.AnswerText.to_dict`, flat: what a restore needs to read
        there again). The image is the run's own (its path and SHA-256 are run columns)."""
        return {
            "question": self.question,
            TYPED_TARGET: self.answer,
            TYPED_FOIL: self.foil,
            **(self.answer_text.to_dict() if self.answer_text is not None else {}),
        }
