"""The region counterfactual as a batch read-out (the audit's
``counterfactual``): fill each sample's target mask and re-run the model, one
batched forward of the edited images; the answer effect beside the routing
read-outs of the same region. Not part of analyze (``vlm-readout
counterfactual`` is its one-image command)."""

from __future__ import annotations

from core.errors import oom_guard
from core.readouts.base import ReadoutMethod, distribution


class CounterfactualReadout(ReadoutMethod):
    name = "counterfactual"
    audit_method = "region counterfactual"
    needs_capture = False
    batched = True

    def run(self, ctx):
        return self.run_batch([ctx])[0]

    def run_batch(self, contexts):
        # function-local: see core.readouts
        import torch

        from core.methods.counterfactual import answer_effect, answer_numbers, as_fill, counterfactual_audit

        if not contexts:
            return []
        fill = as_fill(contexts[0].options.counterfactual_fill)
        adapter = contexts[0].adapter
        todo = [c for c in contexts if c.mask is not None and c.mask.any()]
        edited_logits = {}
        # one forward for the bare-prompt samples; a teacher-forced sample (its own answer prefix) runs alone
        chunks = [[c for c in todo if not c.answer_prefix]] + [[c] for c in todo if c.answer_prefix]
        for chunk in (ch for ch in chunks if ch):
            edited = [fill.apply(c.image, c.mask) for c in chunk]
            with oom_guard(f"running a batch of {len(chunk)} edited images"), torch.no_grad():
                inputs = adapter.prepare(edited, [c.question for c in chunk], answer_prefix=chunk[0].answer_prefix)
                out = adapter.next_token_logits(inputs).float().cpu()
            edited_logits.update({id(c): out[k] for k, c in enumerate(chunk)})
        results = []
        for c in contexts:
            if id(c) not in edited_logits:
                why = "no target mask" if c.mask is None else "the target mask is empty"
                results.append(({"fill": fill.kind, "skipped": why}, None))
                continue
            original = answer_numbers(adapter, c.logits, c.answer_id, c.foil_id)
            after = answer_numbers(adapter, edited_logits[id(c)], c.answer_id, c.foil_id)
            effect = answer_effect(original, after)
            section = {
                "fill": fill.kind,
                "skipped": None,
                "mask_area_px": int(c.mask.sum()),
                "original": original.to_dict(),
                "edited": after.to_dict(),
                "effect": {**effect.to_dict(), "drop": effect.drop},
            }
            results.append((section, counterfactual_audit(fill, {"region": "target_mask"})))
        return results

    def csv_columns(self):
        return ["cf_drop", "cf_logit_diff_change", "cf_prob_change", "cf_flipped"]

    def csv_values(self, s):
        e = s.get("effect") or {}
        return {
            "cf_drop": e.get("drop"),
            "cf_logit_diff_change": e.get("logit_diff_change"),
            "cf_prob_change": e.get("prob_change"),
            "cf_flipped": e.get("flipped"),
        }

    def summarize(self, sections):
        done = [s for s in sections if not s.get("skipped")]
        return {
            "n_skipped": len(sections) - len(done),
            "drop": distribution([s["effect"]["drop"] for s in done]),
            "logit_diff_change": distribution([s["effect"]["logit_diff_change"] for s in done]),
            "prob_change": distribution([s["effect"]["prob_change"] for s in done]),
            "flip_rate": sum(s["effect"]["flipped"] for s in done) / len(done) if done else None,
            "share_drop_positive": sum(s["effect"]["drop"] > 0 for s in done) / len(done) if done else None,
        }

    def controls(self):
        return ["the same fill for every sample", "original and edited numbers side by side"]

    def parameters(self, options):
        return {"region": "each sample's target_mask", "fill": options.counterfactual_fill}

    def notes(self):
        return [
            "the routing read-outs of the same region (attention / rollout region mass) sit beside the effect; "
            "summary.routing_vs_effect says how well they rank the effect across samples",
        ]
