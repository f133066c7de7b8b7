"""The tuned-lens read-out (analyze's ``tuned_lens``): the trained reader and
its baselines at the answer position, beside the logit lens. Analyze only
(it needs a lens trained for the model: ``ReadoutOptions.tuned``)."""

from __future__ import annotations

from core.readouts.base import ReadoutMethod


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
        section = tuned_lens_readers(tuned, ctx.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, batch=ctx.batch)
        return section, lens_audit(tuned, positions="answer")
