"""The validate request: a functional claim, as its specification states it, checked by the seven-step chain on named
heads and routes, or on the candidates the search set proposes (``vlm-readout
validate``, the Validation tab; :func:`core.validate.validate`, docs/METHODS.md §4.11)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import Cancel, Progress, Request, register_request

if TYPE_CHECKING:
    from core.validate import Validation


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the region is an array
class ValidateRequest(Request):
    """Check ``claim`` on ``subjects`` (heads ``L1.H1``, routes ``L1.H0+L1.H1``) and on the
    top ``candidates`` heads the search set proposes.

    Attributes:
        dataset, heldout: the search and held-out sources (``scenes``, ``scenes:SPLIT``, a pairs
            JSONL or a folder holding one; heldout None: ``scenes:heldout`` for the scenes, the
            seeded other half of a file's lines).
        n, n_side: the attribute inputs of each set; the inputs of each other question kind (step 7).
        region: ``(H, W)`` bool, a painted region: the target of every line without a mask of its own.
        min_distractors, seed, batch_size: :func:`core.validate.validate`'s.
        spec: the claim's specification as its fields (``ClaimSpec.to_dict``), or a shipped
            one's name; None: the attribute relation. Kept as fields, so the session re-runs it
            without the file it was read from.
    """

    name: ClassVar[str] = "validate"

    subjects: tuple[str, ...] = ()
    claim: str
    dataset: str
    heldout: str | None = None
    candidates: int = 0
    n: int = 150
    n_side: int = 50
    region: Any = None
    min_distractors: int = 1
    seed: int = 0
    batch_size: int = 32
    spec: Any = None

    def parameters(self) -> dict[str, Any]:
        """The subjects as typed, the set sizes and options, whether a painted region was the
        lines' target, and the sources that are files with their SHA-256
        (:func:`core.validate.source_files`; the result records the conditions it read)."""
        from core.validate import source_files

        return {
            "typed_subjects": ", ".join(self.subjects),
            "claim": self.claim,
            "candidates": self.candidates,
            "n": self.n,
            "n_side": self.n_side,
            "painted_region": self.region is not None,
            "min_distractors": self.min_distractors,
            "seed": self.seed,
            "batch_size": self.batch_size,
            **({"specification": self.spec} if self.spec is not None else {}),
            **source_files(self.dataset, self.heldout),
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> Validation:
        """:func:`core.validate.validate`, cancellable between steps (those done are kept)."""
        from core.validate import validate

        return validate(
            loaded,
            list(self.subjects),
            claim=self.claim,
            dataset=self.dataset,
            heldout=self.heldout,
            candidates=self.candidates,
            n=self.n,
            n_side=self.n_side,
            region=self.region,
            min_distractors=self.min_distractors,
            seed=self.seed,
            batch_size=self.batch_size,
            progress=progress,
            cancel=cancel,
            spec=self.spec,
        )
