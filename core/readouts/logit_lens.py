"""The logit-lens read-out at the answer position (analyze's ``logit_lens``;
the audit's ``lens`` section, ``lens.csv``). Its section is the lens's rows,
:class:`core.methods.logit_lens.LensRow` s, the answer position's at every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.readouts.base import ReadoutMethod, distribution

if TYPE_CHECKING:
    from core.methods.logit_lens import LensRow


class LensReadout(ReadoutMethod):
    name = "lens"
    audit_method = "logit lens"
    analyze_key = "logit_lens"
    long_table = ("lens.csv", ["index", "layer", "answer_rank", "answer_logit", "logit_diff", "kl_to_final", "top1"])

    def run(self, ctx):
        # function-local: see core.readouts
        from core.methods.logit_lens import logit_lens

        lens = logit_lens(
            ctx.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, top_k=ctx.options.lens_top_k, batch=ctx.batch
        )
        return list(lens.rows), lens.audit

    def audit_section(self, section: list[LensRow], ctx):
        rows = [
            {
                "layer": r.layer,
                "answer_rank": r.answer_rank,
                "answer_logit": r.answer_logit,
                "logit_diff": r.logit_diff,
                "kl_to_final": r.kl_to_final,
                "top1": r.top[0][0],
            }
            for r in section
        ]
        top1_from = None  # first layer from which the answer stays the lens's top token
        for r in reversed(rows):
            if r["answer_rank"] != 0:
                break
            top1_from = r["layer"]
        return {"position": ctx.position, "top1_from_layer": top1_from, "rows": rows}

    def csv_columns(self):
        return ["lens_top1_from_layer"]

    def csv_values(self, s):
        return {"lens_top1_from_layer": s["top1_from_layer"]}

    def long_rows(self, index, s):
        return [{"index": index, **r} for r in s["rows"]]

    def summarize(self, sections):
        if not sections:
            return {"layers": []}
        layers = list(zip(*[s["rows"] for s in sections]))
        return {
            "layers": [
                {
                    "layer": rows[0]["layer"],
                    "answer_rank": distribution([r["answer_rank"] for r in rows]),
                    "logit_diff": distribution([r["logit_diff"] for r in rows]),
                    "answer_logit": distribution([r["answer_logit"] for r in rows]),
                    "kl_to_final": distribution([r["kl_to_final"] for r in rows]),
                    "top1_rate": sum(r["answer_rank"] == 0 for r in rows) / len(rows),
                }
                for rows in layers
            ],
            "top1_from_layer": distribution([s["top1_from_layer"] for s in sections]),
        }

    def controls(self):
        return ["success/failure samples compared"]

    def parameters(self, options):
        return {"position": "answer position", "top_k": options.lens_top_k}
