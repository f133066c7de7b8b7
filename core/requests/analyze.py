"""The analyze request: one capture and every text-side read-out of one image and
question (``vlm-readout analyze``, the window's Read out; :func:`core.analyze.analyze`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from core.analyze import AnalyzeResult

ATTENTION_PATHS = ("sdpa", "eager")  # core.forward.capture.capture's attention (not imported: it loads torch)


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the image is pixels
class AnalyzeRequest(AskedRequest):
    """Read out one image and question.

    Attributes:
        lens: a tuned-lens folder whose reader and baselines sit beside the logit lens (None: none).
        tuned: the lens of ``lens`` (or the one beside the weights) already read
            (:func:`core.methods.tuned_lens.store.load_lens`), so that it is read once; None:
            ``run`` reads ``lens``. Not a parameter: ``lens`` names it.
        attention: ``sdpa`` (the model's own attention, the kept rows recomputed) or ``eager``.
        raw_prompt: the question may hold the model's special tokens.
        rollout_alpha: rollout's weight of attention against the identity.
    """

    name: ClassVar[str] = "analyze"

    lens: str | None = None
    tuned: Any = field(default=None, repr=False)
    attention: str = "sdpa"
    raw_prompt: bool = False
    rollout_alpha: float = 0.5

    def __post_init__(self) -> None:
        from core.errors import QuestionError

        if self.attention not in ATTENTION_PATHS:
            raise QuestionError(f"attention {self.attention!r}: expected one of {', '.join(ATTENTION_PATHS)}")

    def parameters(self) -> dict[str, Any]:
        return {
            **self.asked_parameters(),
            "lens": None if self.lens is None else str(self.lens),
            "attention": self.attention,
            "raw_prompt": self.raw_prompt,
            "rollout_alpha": self.rollout_alpha,
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> AnalyzeResult:
        """:func:`core.analyze.analyze` (one forward; it has no step to cancel between)."""
        from core.analyze import analyze

        tuned = self.tuned
        if tuned is None and self.lens is not None:
            from core.methods.tuned_lens.store import load_lens

            tuned = load_lens(self.lens)
        return analyze(
            loaded,
            self.image,
            self.question,
            **self.tokens(loaded.adapter),
            rollout_alpha=self.rollout_alpha,
            tuned=tuned,
            raw_prompt=self.raw_prompt,
            answer_text=self.answer_text,
            progress=progress,
            attention=self.attention,
        )
