"""The nonunique request: is one head's attention pattern the only one that gives its
output at the answer token read out? (``vlm-readout nonunique``, the head menu's
Non-unique; :func:`core.methods.nonunique.nonunique_of_input`, docs/METHODS.md §4.10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from core.methods.nonunique import NonuniqueResult

# core.methods.nonunique.LEVEL_NAMES, in order (not imported: it loads torch; tests/core/test_requests.py checks)
LEVELS = ("a", "b", "c-query", "c-residual")
DEFAULT_SCORE_BOUNDS = (1.0, 2.0)  # level b's bounds on the score change, in logits: one row each


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class NonuniqueRequest(AskedRequest):
    """Search the patterns that reproduce ``head``'s output while moving the most mass off
    a set of visual tokens, at the constraint levels asked. The answer and foil are the
    input's as typed (recorded; the search reads no target).

    Attributes:
        head: ``BLOCK.H<index>`` with the trace's block names (``L1.H3``; CoCa's ``L1.xattn.H0``).
        mask: ``(H, W)`` bool: the visual tokens it covers by ``cover`` are the set (None: the
            fewest tokens holding ``share`` of the head's image attention).
        mask_name: where the mask came from (its file, "painted region").
        tol: the relative output error an alternative may have.
        score_bounds: level b's bounds (one row each).
        levels: of :data:`LEVELS`.
        objective: ``mass`` or ``tv``; min_moved: the mass an alternative must move;
        space: ``write`` (W_O z) or ``z``; seed, steps: the local searches'.
    """

    name: ClassVar[str] = "nonunique"

    head: str
    mask: Any = None
    mask_name: str | None = None
    raw_prompt: bool = False
    cover: float = 0.25
    share: float = 0.5
    tol: float = 0.05
    score_bounds: tuple[float, ...] = DEFAULT_SCORE_BOUNDS
    levels: tuple[str, ...] = LEVELS
    objective: str = "mass"
    min_moved: float = 0.05
    space: str = "write"
    seed: int = 0
    steps: int = 150

    def parameters(self) -> dict[str, Any]:
        """The input, the head (``component``, as the CLI and the app have recorded it) and the
        search's options (the result's audit row holds the ones it ran with, by the same names)."""
        return {
            **self.asked_parameters(),
            "component": self.head,
            "mask": self.mask_name if self.mask is not None else None,
            "raw_prompt": self.raw_prompt,
            "cover": self.cover,
            "share": self.share,
            "tol": self.tol,
            "score_bounds": list(self.score_bounds),
            "levels": list(self.levels),
            "objective": self.objective,
            "min_moved": self.min_moved,
            "space": self.space,
            "seed": self.seed,
            "steps": self.steps,
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> NonuniqueResult:
        """:func:`core.methods.nonunique.nonunique_of_input` (cancellable between optimiser
        stages); the result carries the header the command writes (component, region, model, input)."""
        from core.methods.nonunique import nonunique_of_input

        if progress is not None:
            progress(0, 0, f"non-unique attention of {self.head}…")
        result, _ = nonunique_of_input(
            loaded,
            self.image,
            self.question,
            self.head,
            mask=self.mask,
            mask_name=self.mask_name,
            image_path=self.image_path,
            answer_text=self.answer_text,
            raw_prompt=self.raw_prompt,
            cover=self.cover,
            share=self.share,
            tol=self.tol,
            score_bounds=list(self.score_bounds),
            levels=tuple(self.levels),
            objective=self.objective,
            min_moved=self.min_moved,
            space=self.space,
            seed=self.seed,
            steps=self.steps,
            progress=progress,
            cancel=cancel,
        )
        return result
