"""The tuned-lens read-out (analyze's ``tuned_lens``): the trained reader and
its baselines at the answer position, beside the logit lens. Analyze only
(it needs a lens trained for the model: ``ReadoutOptions.tuned``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.readouts.base import ReadoutMethod

if TYPE_CHECKING:
    from core.methods.logit_lens import LensRow


@dataclass(frozen=True)
class TunedLensSection:
    """analyze's ``tuned_lens``: each reader's rows at the answer position by its
    name ("tuned lens", "tuned lens: mean baseline", "tuned lens: random baseline";
    :func:`core.methods.tuned_lens.tuned_lens_readers`), each row a
    :class:`core.methods.logit_lens.LensRow` naming its ``reader``."""

    readers: dict[str, list[LensRow]]

    def to_dict(self) -> dict:
        return {name: [r.to_dict() for r in rows] for name, rows in self.readers.items()}

    @classmethod
    def from_dict(cls, d: dict) -> TunedLensSection:
        # function-local: see core.readouts
        from core.methods.logit_lens import LensRow

        return cls({name: [LensRow.from_dict(r) for r in rows] for name, rows in d.items()})


class TunedLensReadout(ReadoutMethod):
    name = "tuned_lens"
    audit_method = "tuned lens"
    analyze_key = "tuned_lens"
    dataset_scale = False

    def run(self, ctx):
        """The readers' rows, or ``(None, None)`` without a lens."""
        # function-local: see core.readouts
        from core.methods.tuned_lens.readers import lens_audit, tuned_lens_readers

        tuned = ctx.options.tuned
        if tuned is None:
            return None, None
        tuned.check_model(ctx.loaded)
        tuned.to(ctx.adapter.device)  # a lens read from disk is on the CPU; the model may not be
        readers = tuned_lens_readers(tuned, ctx.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, batch=ctx.batch)
        return TunedLensSection(readers), lens_audit(tuned, positions="answer")
