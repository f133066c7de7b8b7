"""The knockout request: cut every attention edge of each edge kind in a window of
layers centred on each layer in turn, and in all layers (``vlm-readout knockout``;
:func:`core.methods.flow.knockout.knockout_sweep`).

Edge kinds are ``SOURCE->TARGET`` over the named position sets of
:mod:`core.methods.flow.positions` (``image->answer``, ``region->answer``,
``question->last``, ``word:circle->answer``); ``region`` needs the painted mask.
The numbers are read at the answer token read out (``answer_text``: teacher
forcing), with the answer and foil as typed (:meth:`AskedRequest.tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from core.methods.flow.knockout import KnockoutResult


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class KnockoutRequest(AskedRequest):
    """Knock out ``edges`` in every window of ``window`` layers.

    Attributes:
        edges: the edge kinds, ``SOURCE->TARGET`` each.
        window: the window width in layers.
        heads: the heads cut in every block (None: all).
        mask: ``(H, W)`` bool, the painted region (the ``region`` set; None: no region).
        batch_size: edited copies of the input per forward.
        rollout: also rollout's per-layer reach beside each profile (one more capture, full patterns).
    """

    name: ClassVar[str] = "knockout"

    edges: tuple[str, ...]
    window: int = 1
    heads: tuple[int, ...] | None = None
    mask: Any = None
    batch_size: int = 8
    rollout: bool = True

    def __post_init__(self) -> None:
        """The edge kinds and the region are checked before any model runs (one line each)."""
        from core.errors import InterventionError
        from core.methods.flow.positions import REGION, parse_edges

        kinds = parse_edges(",".join(self.edges))
        uses_region = any(REGION in (k.source, k.target) for k in kinds)
        if uses_region and self.mask is None:
            raise InterventionError("an edge of the region needs a painted region (a mask)")
        if self.window < 1 or self.batch_size < 1:
            raise InterventionError("the window and the batch size are at least 1")
        object.__setattr__(self, "edges", tuple(k.name for k in kinds))

    def parameters(self) -> dict[str, Any]:
        return {
            **self.asked_parameters(),
            "edges": list(self.edges),
            "window": self.window,
            "heads": None if self.heads is None else list(self.heads),
            "rollout": self.rollout,
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> KnockoutResult:
        from core.forward.capture import capture
        from core.forward.geometry import painted_tokens
        from core.methods.flow.knockout import knockout_sweep
        from core.methods.flow.positions import EdgeKind

        adapter, prefix = loaded.adapter, self.answer_prefix
        inputs = adapter.prepare([self.image], [self.question], answer_prefix=prefix)
        base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
        region = painted_tokens(adapter.visual_tokens(self.image.size), self.mask) if self.mask is not None else ()
        answer_id, foil_id = self.token_ids(adapter, base)
        return knockout_sweep(
            loaded,
            inputs,
            self.image,
            self.question,
            [EdgeKind.parse(e) for e in self.edges],
            answer_id,
            foil_id,
            width=self.window,
            heads=self.heads,
            region=region,
            answer_prefix=prefix,
            batch_size=self.batch_size,
            rollout_alpha=0.5 if self.rollout else None,
            base=base,
            progress=progress,
            cancel=cancel,
        )
